"""The dialects' translations to the chat core's form (api_proc/anthropic.py,
responses.py, ollama.py) and the Responses store, as pure functions."""

from __future__ import annotations

import pytest

from api_proc import anthropic, ollama, responses
from api_proc.boundary import BadRequest
from api_proc.chat import OpenAIError


def test_anthropic_blocks_become_chat_messages():
    chat = anthropic.to_chat({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "thinking": {"type": "disabled"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "Call f."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "There:"},
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "42"}]}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        # the tool result first, as its own message, then the user's text
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "There:"}]}]
    assert chat["max_tokens"] == 9 and chat["stop"] == ["\n\n"]
    assert chat["tool_choice"] == "required"
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                    {"role": "assistant", "content": "y"}]}, "prefill"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, "not supported"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
      "messages": [{"role": "user", "content": "x"}]}, "custom tools"),
])
def test_anthropic_refusals(body, words):
    with pytest.raises(BadRequest, match=words):
        anthropic.to_chat(body)


def test_responses_items_become_chat_messages():
    chat, conversation = responses.to_chat({
        "instructions": "Be brief.", "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"}]},
        history=[{"role": "user", "content": "Earlier"}])
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert conversation == chat["messages"][1:]         # instructions are not kept
    assert conversation[0] == {"role": "user", "content": "Earlier"}
    assert [c["id"] for c in conversation[2]["tool_calls"]] == ["c1", "c2"]  # one turn
    assert conversation[3] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    assert chat["max_tokens"] == 7 and chat["response_format"]["json_schema"]["name"] == "n"
    with pytest.raises(OpenAIError, match="item_reference"):
        responses.to_chat({"input": [{"type": "item_reference", "id": "x"}]}, [])
    with pytest.raises(OpenAIError, match="function tools"):
        responses.to_chat({"input": "x", "tools": [{"type": "web_search"}]}, [])


def test_the_responses_store_is_bounded():
    store = responses.ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True,
                                                                  True]
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 9_000}])
    assert store.bytes <= 10_000 and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and store.get("big") is None


def test_ollama_options_and_messages():
    chat = ollama.chat_body({"messages": [
        {"role": "user", "content": "Hi", "images": ["aGk="]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"a": 1}}}]}],
        "options": {"temperature": 0, "num_predict": -1, "stop": "x",
                    "repeat_penalty": 1.1, "num_ctx": 4096},
        "format": "json", "think": False, "stream": False}, "m")
    assert chat["messages"][0]["content"][1] == {"type": "image_url",
                                                 "image_url": {"url": "aGk="}}
    assert chat["messages"][1]["tool_calls"][0]["function"] == {"name": "f",
                                                               "arguments": '{"a": 1}'}
    assert chat["temperature"] == 0 and "max_tokens" not in chat and chat["stop"] == ["x"]
    assert chat["repetition_penalty"] == 1.1 and "num_ctx" not in chat
    assert chat["response_format"] == {"type": "json_object"} and chat["stream"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(BadRequest, match="raw"):
        ollama.generate_body({"prompt": "x", "raw": True}, "m")
