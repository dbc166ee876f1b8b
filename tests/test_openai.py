"""End to end: the OpenAI-compatible routes, driven by the official `openai` SDK against a
launched server on the tiny llama checkpoint. Greedy outputs are checked against /generate
(which test_generate checks against transformers), token counts against the tokenizer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server import wait_idle

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about foxes."}]
GREEDY = {"temperature": 0, "max_tokens": 16}
IGNORE_EOS = {"ignore_eos": True}                  # SGLang extra, sent through extra_body


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(llama_server):
    return llama_server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(model_dir):
    return str(model_dir)            # no --served-model-name: the id is the model path


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def native_text(server, **body) -> str:
    return server.generate_ok(**body)["text"]


# ---- /v1/models ----------------------------------------------------------------------------

def test_models_lists_the_served_model(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "zserve" and m.created > 0
    assert m.root == model and m.max_model_len == 512


# ---- /v1/completions -----------------------------------------------------------------------

def test_completion_matches_native_and_counts_tokens(client, server, model, tok):
    r = client.completions.create(model=model, prompt=PROMPT, extra_body=IGNORE_EOS, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.logprobs is None
    assert choice.text == native_text(server, text=PROMPT, sampling_params={
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_completion_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                  extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 16


def test_completion_prompt_list_and_n(client, model, tok):
    prompts = [PROMPT, "def fibonacci(n):"]
    r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=4,
                                  extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # prompt tokens are counted once per prompt, not once per sample
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 4


def test_completion_token_id_prompt(client, server, model, tok):
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=model, prompt=ids, extra_body=IGNORE_EOS, **GREEDY)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == native_text(server, input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})


def test_completion_echo_prepends_the_prompt(client, model, tok):
    plain = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    echoed = client.completions.create(model=model, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ids = tok.encode(PROMPT)                       # token ids echo as their decoded text
    by_ids = client.completions.create(model=model, prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text == tok.decode(ids) + plain.choices[0].text


def test_completion_stream_matches_unary(client, model):
    unary = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *text_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == unary.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == \
        unary.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage_chunk.usage, k) for k in counts] == \
        [getattr(unary.usage, k) for k in counts]
    # The stream ran second: its prompt was served from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stop_string(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, extra_body=IGNORE_EOS,
                                     **GREEDY).choices[0].text
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isalnum())
    r = client.completions.create(model=model, prompt=PROMPT, stop=[stop],
                                  extra_body=IGNORE_EOS, **GREEDY)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop


def visible(tokens: list[str], tok) -> str:
    """The text of these token strings as skip_special_tokens shows it, ASCII only: a token
    ending inside a UTF-8 character shows as U+FFFD on its own, not in the joined text."""
    return ascii_only("".join(t for t in tokens if t not in tok.all_special_tokens))


def ascii_only(text: str) -> str:
    return "".join(ch for ch in text if ch.isascii())


def test_completion_logprobs(client, model, tok):
    r = client.completions.create(model=model, prompt=PROMPT, logprobs=3,
                                  extra_body=IGNORE_EOS, **GREEDY)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert visible(lp.tokens, tok) == ascii_only(text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # top 3 (+ the sampled token); texts shared by several ids keep the best logprob
        assert value <= 0 and 1 <= len(top) <= 4
        assert top[token] == value == max(top.values())     # greedy: the sampled is the best


def test_completion_echo_logprobs_include_the_prompt(client, model, tok):
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1,
                                  max_tokens=4, temperature=0, extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(tok.encode(PROMPT)) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    generated = r.choices[0].text[len(PROMPT):]
    assert visible(lp.tokens[-4:], tok) == ascii_only(generated)
    assert lp.text_offset[-4] == len(PROMPT)


# ---- /v1/chat/completions ------------------------------------------------------------------

def test_chat_matches_native_on_the_templated_prompt(client, server, model, tok):
    r = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant"
    ids = chat_ids(tok, MESSAGES)
    native = server.generate_ok(input_ids=ids, sampling_params={"temperature": 0,
                                                                "max_new_tokens": 16})
    assert choice.message.content == native["text"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    expected = {"length": "length", "stop": "stop"}[native["meta_info"]["finish_reason"]["type"]]
    assert choice.finish_reason == expected


def test_chat_content_parts_join_texts(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say something"},
                                          {"type": "text", "text": "about foxes."}]}]
    joined = [{"role": "user", "content": "Say something\nabout foxes."}]
    a = client.chat.completions.create(model=model, messages=parts, **GREEDY)
    b = client.chat.completions.create(model=model, messages=joined, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == \
        (b.usage.prompt_tokens, b.usage.completion_tokens)


def test_chat_stream_deltas_concatenate_to_unary(client, model):
    unary = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    *choice_chunks, usage_chunk = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert choice_chunks[-1].choices[0].finish_reason == unary.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == unary.choices[0].message.content
    assert usage_chunk.choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage_chunk.usage, k) for k in counts] == \
        [getattr(unary.usage, k) for k in counts]
    # The stream ran second: its prompt was served from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_without_usage_has_no_usage_chunk(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                 **GREEDY))
    assert all(c.choices and c.usage is None for c in chunks)


def test_chat_n_with_seed_is_reproducible(client, model, tok):
    kw = dict(model=model, messages=MESSAGES, n=2, seed=1234, temperature=1.0, max_tokens=8,
              extra_body=IGNORE_EOS)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.prompt_tokens == len(chat_ids(tok, MESSAGES))     # once, not per sample
    assert a.usage.completion_tokens == 16


def test_chat_stream_n2_joins_choices_by_index(client, model):
    unary = client.chat.completions.create(model=model, messages=MESSAGES, n=2, **GREEDY)
    texts = {0: "", 1: ""}
    finishes = {}
    for c in client.chat.completions.create(model=model, messages=MESSAGES, n=2,
                                            stream=True, **GREEDY):
        [choice] = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in unary.choices]
    assert set(finishes) == {0, 1}


def test_chat_stop_string(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES,
                                          extra_body=IGNORE_EOS, **GREEDY)
    text = full.choices[0].message.content
    stop = next(ch for ch in text[1:] if ch.isascii() and ch.isalnum())
    r = client.chat.completions.create(model=model, messages=MESSAGES, stop=stop,
                                       extra_body=IGNORE_EOS, **GREEDY)
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_without_max_tokens_runs_to_eos_or_context(client, model, tok):
    r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0)
    prompt = len(chat_ids(tok, MESSAGES))
    assert r.usage.prompt_tokens == prompt
    assert 0 < r.usage.completion_tokens <= 512 - prompt - 1


def test_chat_logprobs(client, model, tok):
    r = client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True,
                                       top_logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 16
    assert visible([e.token for e in content], tok) == \
        ascii_only(r.choices[0].message.content)
    for e in content:
        assert e.bytes == list(e.token.encode("utf-8")) and e.logprob <= 0
        assert len(e.top_logprobs) == 2
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)

    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True,
        extra_body=IGNORE_EOS, **GREEDY))
    streamed = [e for c in chunks if c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == \
        [(e.token, pytest.approx(e.logprob, abs=1e-5)) for e in content]


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("params, message", [
    ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
    ({"top_p": 2}, "top_p must be in (0, 1], got 2.0."),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0."),
])
def test_bad_sampling_values_are_400_with_sglang_messages(client, model, params, message):
    for create, kw in [(client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": MESSAGES})]:
        with pytest.raises(openai.BadRequestError) as e:
            create(model=model, **kw, **params)
        assert e.value.status_code == 400
        assert message in e.value.message
        err = e.value.body
        assert err["type"] == "BadRequestError" and err["code"] == 400
        assert err["param"] == next(iter(params))


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "no-such-model" in e.value.message and e.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)


def test_model_may_be_omitted(server):
    r = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "This model does not take images"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "only text and image_url content parts are supported"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}},
     "only allowed when 'stream' is enabled"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs requires logprobs"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     'tool_choice "auto"'),         # tools without a forced choice: not supported yet
    ({"messages": MESSAGES, "max_tokens": 600},
     "exceeds the model's maximum context length of 512 tokens"),
])
def test_bad_chat_requests_are_400(server, model, body, fragment):
    r = server.client.post("/v1/chat/completions", json={"model": model, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "BadRequestError"
    assert err["code"] == 400


def test_prompt_over_context_length_is_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=list(range(5, 605)), max_tokens=1)
    assert "longer than the model's context length (512 tokens)" in e.value.message
    with pytest.raises(openai.BadRequestError):     # the same through a stream
        list(client.completions.create(model=model, prompt=list(range(5, 605)),
                                       max_tokens=1, stream=True))


def test_malformed_body_is_400(server):
    r = server.client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = server.client.post("/v1/completions", json={"model": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_stream_disconnect_aborts_the_request(server, model, tok):
    # max_tokens runs to the end of the context: the request cannot finish by itself
    # before the client goes away.
    max_tokens = 512 - len(chat_ids(tok, MESSAGES)) - 1
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    before = wait_idle(server)["generated_tokens_total"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())            # the first frame: the request is running
            assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == \
                "assistant"
    info = wait_idle(server)
    assert info["generated_tokens_total"] - before < max_tokens
    kv = info["kv_pool"]
    assert kv["free"] + kv["evictable"] == kv["total"], kv


def test_served_model_name_and_chat_template_override(model_dir, launch, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    server = launch(model_dir, "--served-model-name", "tiny-one", "--chat-template",
                    str(template))
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["tiny-one"]
        out = c.chat.completions.create(model="tiny-one", max_tokens=2, messages=[
            {"role": "user", "content": "abc"}, {"role": "user", "content": "de"}])
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        assert out.usage.prompt_tokens == len(tok.encode("abc|de|", add_special_tokens=False))
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model=str(model_dir), max_tokens=2,
                                      messages=[{"role": "user", "content": "x"}])


# ---- one pipeline for both routes (native and OpenAI) ---------------------------------------

def test_n_samples_share_the_prompt_kv_on_both_routes(server, client, model):
    """n > 1 first prefills the prompt once (a warm-up), so every sample finds all but the
    prompt's last token in the prefix cache: on /generate and on the OpenAI routes alike."""
    ids = [7 + (i * 37) % 500 for i in range(40)]           # a prompt no other test sends
    outs = server.generate_ok(input_ids=ids, sampling_params={"n": 3, "max_new_tokens": 2,
                                                              "temperature": 1.0})
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(ids) - 1] * 3
    ids2 = [9 + (i * 41) % 500 for i in range(40)]
    r = client.completions.create(model=model, prompt=ids2, n=3, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 3 * (len(ids2) - 1)
    messages = [{"role": "user", "content": "a question nobody asked before, twice over"}]
    r = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * (r.usage.prompt_tokens - 1)


def test_logprobs_are_not_duplicated(client, model):
    """Each generated token has exactly one logprob entry, streamed or not."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=2,
                                  temperature=0, extra_body=IGNORE_EOS)
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                            logprobs=2, temperature=0, stream=True,
                                            extra_body=IGNORE_EOS))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == r.choices[0].logprobs.tokens
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        logprobs=True, top_logprobs=2, temperature=0)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_models_by_id_and_the_default_name(server, model, client):
    assert client.models.retrieve(model).id == model            # the SDK's GET /v1/models/{id}
    card = server.client.get(f"/v1/models/{model}").json()
    assert card == server.client.get("/v1/models").json()["data"][0]
    r = server.client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = server.client.post("/v1/chat/completions", json={
        "model": "default", "messages": MESSAGES, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
