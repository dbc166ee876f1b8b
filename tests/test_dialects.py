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
import ollama
import httpx
import openai
import pytest

from tests.server import serving, wait_idle
from tests.test_chat_extras import TEMPLATE    # tools, and an enable_thinking switch
from tests.test_embeddings import ATOL

pytestmark = pytest.mark.e2e

KEY = "dialect-key"
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


def test_native_generate_of_the_templated_prompt_gives_the_greedy_text(server, greedy_text):
    ids = httpx.post(server.url + "/tokenize", headers=server.headers, json={
        "messages": [{"role": "user", "content": QUESTION}]}).json()["tokens"]
    out = httpx.post(server.url + "/generate", headers=server.headers, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                              "temperature": 0}}).json()
    assert out["text"] == greedy_text


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


def test_anthropic_max_tokens_is_a_cap(claude, model):
    """Agents send a large fixed max_tokens: it is lowered to the room the context leaves."""
    with claude.messages.stream(model=model, max_tokens=1_000_000, extra_body={
            "regex": "[a-z]{3}"}, messages=[{"role": "user", "content": QUESTION}]) as s:
        msg = s.get_final_message()
    assert re.fullmatch("[a-z]{3}", msg.content[0].text) and msg.stop_reason == "end_turn"


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


# ---- OpenAI Responses ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_responses_plain_and_streamed_give_the_greedy_text(oai, model, greedy_text):
    r = oai.responses.create(model=model, input=QUESTION, max_output_tokens=MAX_TOKENS,
                             temperature=0)
    assert r.output_text == greedy_text and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= MAX_TOKENS
    assert oai.responses.retrieve(r.id).output_text == greedy_text
    kinds, text = [], ""
    for ev in oai.responses.create(model=model, input=QUESTION, max_output_tokens=MAX_TOKENS,
                                   temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert text == greedy_text == final.output_text
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.completed" if r.status == "completed" else \
        "response.incomplete"
    assert final.usage.input_tokens == r.usage.input_tokens
    n = oai.post("/responses/input_tokens", cast_to=object,
                 body={"model": model, "input": QUESTION})["input_tokens"]
    assert n == r.usage.input_tokens
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_then_previous_response_id(oai, model, stream):
    tools = [{"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}]
    kwargs = dict(model=model, tools=tools, max_output_tokens=40,
                  tool_choice={"type": "function", "name": "get_time"})
    if stream:
        with oai.responses.stream(input=QUESTION, **kwargs) as s:
            first = s.get_final_response()
    else:
        first = oai.responses.create(input=QUESTION, **kwargs)
    (call,) = [it for it in first.output if it.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    follow = oai.responses.create(
        model=model, previous_response_id=first.id, max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert follow.output[0].type == "message"
    # the earlier turns are in the prompt: more input tokens than the first turn had
    assert follow.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, input="hi", previous_response_id="resp_nonesuch")


def test_responses_json_schema_format(oai, model):
    r = oai.responses.create(model=model, input=QUESTION, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "time", "schema": TIME_SCHEMA,
                   "strict": True}})
    assert json.loads(r.output_text)["zone"] in ("UTC", "CET")


# ---- Ollama --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lama(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


def test_ollama_list_show_ps_version(server, lama, model):
    (listed,) = lama.list().models
    assert listed.model == f"{model}:latest" and listed.size > 0
    shown = lama.show(f"{model}:latest")
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert lama.ps().models[0].model == listed.model
    assert httpx.get(server.url + "/api/version", headers=server.headers).json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        lama.show("llama3.2:latest")
    assert e.value.status_code == 404


def test_ollama_chat_and_generate_give_the_greedy_text(lama, model, greedy_text):
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    messages = [{"role": "user", "content": QUESTION}]
    r = lama.chat(model=model, messages=messages, options=options, stream=False)
    assert r.message.content == greedy_text and r.done and r.done_reason in ("stop", "length")
    assert r.eval_count <= MAX_TOKENS and r.prompt_eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration > 0
    parts = list(lama.chat(model=f"{model}:latest", messages=messages, options=options,
                           stream=True))
    assert "".join(p.message.content for p in parts) == greedy_text
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == r.eval_count
    g = lama.generate(model=model, prompt=QUESTION, options=options)
    assert g.response == greedy_text and g.done
    streamed = "".join(p.response for p in lama.generate(model=model, prompt=QUESTION,
                                                         options=options, stream=True))
    assert streamed == greedy_text


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_format_constrains_the_output(lama, model, stream):
    parts = lama.chat(model=model, messages=[{"role": "user", "content": QUESTION}],
                      stream=stream, options={"num_predict": 40}, think=True,
                      format={"type": "string", "pattern": "^[a-z]{4}$"})
    if stream:
        parts = list(parts)
        content = "".join(p.message.content for p in parts)
    else:
        content = parts.message.content
    assert re.fullmatch('"[a-z]{4}"', content), content


def test_ollama_errors(lama, model):
    with pytest.raises(ollama.ResponseError) as e:
        lama.chat(model=model, messages=[{"role": "user", "content": "hi"}],
                  options={"temperature": -1})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        lama.generate(model=model, prompt="hi", raw=True)
    assert e.value.status_code == 400


def test_ollama_embed_is_the_embeddings_route(server, lama, oai, model):
    texts = [QUESTION, "Another text"]
    got = lama.embed(model=f"{model}:latest", input=texts)
    want = oai.embeddings.create(model=model, input=texts)
    assert len(got.embeddings) == 2 and got.prompt_eval_count == want.usage.prompt_tokens
    # The same vectors up to float32 summation order: the second request of a prompt may be
    # computed past a cached prefix, in other row groupings (test_embeddings.py ATOL argues
    # the bound for unit vectors).
    for ours, theirs in zip(got.embeddings, want.data):
        assert ours == pytest.approx(theirs.embedding, abs=ATOL)
    legacy = httpx.post(server.url + "/api/embeddings", headers=server.headers,
                        json={"model": model, "prompt": QUESTION}).json()
    assert legacy["embedding"] == pytest.approx(got.embeddings[0], abs=ATOL)


def test_every_dialect_has_its_route_in_metrics(server, lama, claude, oai, model):
    """Runs after the tests above (file order): each dialect's requests are counted under
    its own route label."""
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for route in ("chat_completions", "messages", "responses", "ollama_chat",
                  "ollama_generate", "ollama_embed", "embeddings"):
        assert re.search(rf'zserve:requests_total{{[^}}]*route="{route}"[^}}]*}} [1-9]',
                         text), route
    assert httpx.get(server.url + "/api/tags").status_code == 401      # behind --api-key
