"""End to end: the dialects over the chat core (api_proc/chat.py) with their official
clients: Anthropic Messages (the anthropic SDK), OpenAI Responses (the openai SDK), Ollama
(the ollama client). One tiny qwen3 server with --tool-call-parser qwen, --reasoning-parser
qwen3 and an API key; outputs that a random model would never write (a tool call, a
<think> block) are forced with a grammar, so what is tested is how each route reads,
splits and renders them, unary and streamed; plain greedy text is compared across every
dialect."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from tests.server import serving, wait_idle

pytestmark = pytest.mark.e2e

KEY = "dialect-key"
TEMPLATE = ("{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
            "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% if m.tool_calls %} calls {{ m.tool_calls[0].function.name }}{% endif %}"
            "{% if m.tool_call_id %} answers {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}(no thinking)\n"
            "{% endif %}assistant:")
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
               "required": ["zone"]}
QUESTION = "What time is it?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dialects")
    (tmp / "template.jinja").write_text(TEMPLATE)
    with serving(tiny_model("qwen3"), "--tool-call-parser", "qwen", "--reasoning-parser",
                 "qwen3", "--chat-template", str(tmp / "template.jinja"), "--api-key", KEY,
                 tmpdir=tmp) as s:
        s.headers = {"Authorization": f"Bearer {KEY}"}
        s.client.headers.update(s.headers)  # the helpers (wait_idle) read /server_info
        yield s
        wait_idle(s)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(server, model) -> str:
    """The chat completions route's greedy text for QUESTION: what every dialect must give."""
    out = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    reply = out.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                        messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content
    return reply.choices[0].message.content


# ---- Anthropic Messages --------------------------------------------------------------------

def test_anthropic_message_and_stream_give_the_greedy_text(claude, model, greedy_text):
    kwargs = dict(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": QUESTION}])
    msg = claude.messages.create(**kwargs)
    assert msg.role == "assistant" and msg.type == "message"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == greedy_text
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens <= MAX_TOKENS
    assert claude.messages.count_tokens(model=model, messages=kwargs["messages"]
                                        ).input_tokens == msg.usage.input_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy_text == final.content[0].text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == \
        msg.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_round_trip(claude, model, stream):
    tools = [{"name": "get_time", "description": "The time in a zone.",
              "input_schema": TIME_SCHEMA}]
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model=model, max_tokens=40, tools=tools,
                  tool_choice={"type": "tool", "name": "get_time"})
    if stream:
        with claude.messages.stream(messages=messages, **kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(messages=messages, **kwargs)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET") and use.id
    messages += [{"role": "assistant", "content": msg.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "12:00"}]}]
    answer = claude.messages.create(model=model, max_tokens=5, messages=messages)
    assert answer.content[0].type == "text" and answer.usage.input_tokens > \
        msg.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_is_a_thinking_block(claude, model, stream):
    kwargs = dict(model=model, max_tokens=40,
                  messages=[{"role": "user", "content": QUESTION}],
                  thinking={"type": "enabled", "budget_tokens": 1024},
                  extra_body={"regex": "<think>[a-z]{5}</think>[a-z]{6}"})
    if stream:
        with claude.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    assert re.fullmatch("[a-z]{5}", msg.content[0].thinking)
    assert re.fullmatch("[a-z]{6}", msg.content[1].text)


def test_anthropic_errors_are_the_sdks_types(server, claude, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=0, messages=[
            {"role": "user", "content": "hi"}])
    assert "max_tokens" in e.value.message and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nonesuch", max_tokens=5, messages=[
            {"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0
                            ).messages.create(model=model, max_tokens=5,
                                              messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):     # a prefill
        claude.messages.create(model=model, max_tokens=5, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}])
