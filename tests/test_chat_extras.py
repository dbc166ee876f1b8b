"""End to end: /v1/chat/completions with --tool-call-parser qwen and --reasoning-parser
qwen3, and chat_template_kwargs, on a tiny qwen3 server with a chat template that renders
tools and an enable_thinking switch. The outputs are forced with a grammar (a random model
would never write a tool call or a <think> block): what is tested is how the route reads
and splits them, unary and streamed."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

TEMPLATE = ("{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
            "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% if m.tool_calls %} calls {{ m.tool_calls[0].function.name }}{% endif %}"
            "{% if m.tool_call_id %} answers {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}(no thinking)\n"
            "{% endif %}assistant:")
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-extras")
    (tmp / "template.jinja").write_text(TEMPLATE)
    with serving(tiny_model("qwen3"), "--tool-call-parser", "qwen", "--reasoning-parser",
                 "qwen3", "--chat-template", str(tmp / "template.jinja"), tmpdir=tmp) as s:
        yield s
        wait_idle(s)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def ask(client, stream: bool, **body):
    """(message fields joined over the stream, finish_reason)."""
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=60, temperature=0, **body)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        m = choice.message
        return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
                "calls": m.tool_calls or []}, choice.finish_reason
    content, reasoning, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "calls": calls}, finish


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_goes_to_reasoning_content(client, stream):
    got, finish = ask(client, stream, extra_body={"regex": "<think>[a-z]{5}</think>[a-z]{6}"})
    assert finish == "stop"
    assert re.fullmatch("[a-z]{5}", got["reasoning"]) and re.fullmatch("[a-z]{6}",
                                                                        got["content"]), got


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_from_the_output(client, stream):
    got, finish = ask(client, stream, tools=[TIME_TOOL],
                      extra_body={"regex": re.escape(CALL)})
    assert finish == "tool_calls" and not got["content"], got
    (call,) = got["calls"]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == \
        {"zone": "UTC"} and call.id


def test_text_without_calls_stays_content(client):
    got, finish = ask(client, False, tools=[TIME_TOOL], extra_body={"regex": "[a-z]{8}"})
    assert finish == "stop" and re.fullmatch("[a-z]{8}", got["content"]) and not got["calls"]


def prompt_tokens(server, **body) -> int:
    r = server.client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_tools_and_chat_template_kwargs_reach_the_template(server):
    plain = prompt_tokens(server)
    assert prompt_tokens(server, tools=[TIME_TOOL]) > plain            # "Tools: get_time"
    assert prompt_tokens(server, tools=[TIME_TOOL], tool_choice="none") == plain
    assert prompt_tokens(server, chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(server, chat_template_kwargs={"enable_thinking": True}) == plain
    r = server.client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]


def test_tool_call_history_reaches_the_template(server):
    """An agent loop's second turn: the assistant's earlier call and the tool's answer."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    bare = [*MESSAGES, {"role": "assistant", "content": None},
            {"role": "tool", "content": "12:00"}]
    tokens = {}
    for name, messages in (("turn", turn), ("bare", bare)):
        r = server.client.post("/v1/chat/completions", json={
            "messages": messages, "tools": [TIME_TOOL], "max_tokens": 1})
        assert r.status_code == 200, r.text
        tokens[name] = r.json()["usage"]["prompt_tokens"]
    assert tokens["turn"] > tokens["bare"]      # "calls get_time" and "answers call_1"
    r = server.client.post("/v1/chat/completions", json={"messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]})
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"]
