"""Tool calling's pure parts (api_proc/tools.py): tools / tool_choice validation, the JSON
schema a forced choice constrains the output to, and each family's tool-call format."""

from __future__ import annotations

import json

import pytest

from api_proc.tools import ToolError, check_tools, forced_calls, forced_schema, parse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_choices_normalize():
    assert check_tools(None, None) == ([], "none")
    functions, choice = check_tools([WEATHER, TIME], None)
    assert choice == "auto" and [f["name"] for f in functions] == ["get_weather", "get_time"]
    assert functions[1]["parameters"] == {"type": "object", "properties": {}}
    assert check_tools([WEATHER], "required")[1] == "required"
    assert check_tools([WEATHER], {"type": "function",
                                   "function": {"name": "get_weather"}})[1] == "get_weather"


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([], None, "tools"),
    ([{"type": "function"}], None, "tools"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        check_tools(tools, choice)
    assert e.value.param == param


def test_forced_schemas():
    functions, _ = check_tools([WEATHER, TIME], None)
    assert forced_schema(functions, "auto") is None and forced_schema(functions, "none") is None
    assert forced_schema(functions, "get_weather") == WEATHER["function"]["parameters"]
    req = forced_schema(functions, "required")
    assert [a["properties"]["name"]["const"] for a in req["anyOf"]] == ["get_weather",
                                                                        "get_time"]
    (call,) = forced_calls('{"name": "get_time", "arguments": {}}', "required")
    assert (call.name, json.loads(call.arguments)) == ("get_time", {})
    (call,) = forced_calls(' {"city": "Paris"} ', "get_weather")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert call.to_json(0)["id"].startswith("call_")


def test_qwen_blocks_are_calls_and_the_rest_is_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            '</tool_call>')
    content, calls = parse(text, "qwen")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse(broken, "qwen") == (broken, [])


def test_llama3_and_mistral_formats():
    content, calls = parse('<|python_tag|>{"name": "get_weather", "parameters": '
                           '{"city": "Oslo"}}; {"name": "get_time", "parameters": {}}', "llama3")
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse("The weather is fine.", "llama3") == ("The weather is fine.", [])
    content, calls = parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "mistral")
    assert content == "" and calls[0].name == "get_time" and calls[0].arguments == "{}"
    assert parse("[TOOL_CALLS] oops", "mistral") == ("[TOOL_CALLS] oops", [])


def test_forced_outputs_that_stopped_early_are_not_calls():
    assert forced_calls('{"city": "Par', "get_weather") == []
    assert forced_calls('"get_time"', "required") == []
    assert forced_calls("[" * 100000, "required") == []        # no RecursionError


def test_llama3_arguments_may_hold_semicolons():
    content, calls = parse('{"name": "run", "parameters": {"cmd": "a; b"}}', "llama3")
    assert content == "" and json.loads(calls[0].arguments) == {"cmd": "a; b"}
    assert parse("{" * 100000, "llama3")[1] == []
