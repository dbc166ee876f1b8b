"""End to end, property-based (hypothesis): whatever body a client sends to any JSON route,
the answer is a 2xx or a 4xx, never a 5xx and never a hang, and afterwards the server is
healthy with its KV pool at the idle invariant (free + evictable == total).

Bodies mix fully random JSON (recursive: null, bools, integers up to thousands of digits,
floats with NaN and infinities, text with lone surrogates) with near-valid ones: a valid
body of the route (extreme but legal values included: top_p 1e-300, temperature 1e39, every
token a stop token) with up to two mutations (a field set to a random value of a random
type, a field dropped, an unknown field added). They go out as ASCII-escaped or raw UTF-8
(surrogates included) JSON under varied content types; hand-written raw bytes cover what
JSON encoders do not write (NaN, 1e400, 5,000-digit integers, nesting 2,000 deep, bad UTF-8).
A body that could be valid asks for at most 4 new tokens, so valid examples stay cheap.

Runs are reproducible: derandomized, no example database, no shrinking. Each route's test
collects every 5xx or broken stream and reports them together (the smallest body of each
kind) rather than stopping at the first; a hang (no answer in 30 s), a reset or a dead
server stops it at once, naming the request that did it and the ones just before.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict, deque

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server import wait_idle

pytestmark = pytest.mark.e2e

POST_EXAMPLES = 500
DIALECT_EXAMPLES = 100
GET_EXAMPLES = 60
MODEL = "$MODEL"       # replaced by the served model id when a body is sent
TIMEOUT = 30.0         # seconds; an answer slower than this for <= 4 tokens is a hang

# No shrinking: failures are collected and reported by kind (Fuzz.report), and a fatal one
# (a dead server) must be reported as it happened, not as whatever a replay then sees.
FUZZ = settings(max_examples=POST_EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(llama_server):
    before = llama_server.client.timeout
    llama_server.client.timeout = httpx.Timeout(TIMEOUT)
    yield llama_server
    llama_server.client.timeout = before


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.client.get("/v1/models").json()["data"][0]["id"]


# ---- strategies ----------------------------------------------------------------------------

HUGE_INTS = [2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 30,
             -10 ** 30, 10 ** 4000]     # 4,001 digits: still under Python's str->int limit
EXTREME_FLOATS = [0.0, -0.0, 1.0, 2.0, -2.0, 1e-300, 1e-46, 5e-324, 1.1754943508222875e-38,
                  3.4028234663852886e38, 3.5e38, 1e39, 1.7976931348623157e308,
                  -1.7976931348623157e308, math.nan, math.inf, -math.inf]
VOCAB = 754           # the tiny tokenizer's

# -- fully random JSON
texts = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(categories=["Cs", "Cc", "L", "N", "P", "So"]), max_size=6),
    st.sampled_from(["", "a", "hello", "\ud800", "a\udfffb", "\x00", "<s>", "</s>",
                     "<|im_start|>", "<|im_end|>"]))
integers = st.one_of(st.integers(-5, 800), st.integers(), st.sampled_from(HUGE_INTS))
floats = st.one_of(st.floats(), st.sampled_from(EXTREME_FLOATS))
scalars = st.one_of(st.none(), st.booleans(), integers, floats, texts)
any_json = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(texts, kids, max_size=4)), max_leaves=12)

# -- valid values (extremes included: a valid value must never hurt the server either)
prompt_text = st.text(max_size=16)
token_id = st.integers(0, VOCAB - 1)
ids = st.lists(token_id, min_size=1, max_size=6)
short = st.integers(0, 4)          # any length a valid body asks for: examples stay cheap
unit = st.one_of(st.floats(0, 1), st.sampled_from([1e-300, 1e-46, 5e-324, 1e-7, 1.0]))
temperature = st.one_of(st.floats(0, 2), st.sampled_from(
    [0.0, 1e-7, 1e-300, 3.4e38, 3.5e38, 1e39, 1e300]))
penalty = st.one_of(st.floats(-2, 2), st.sampled_from([-2.0, 2.0]))
rep_penalty = st.one_of(st.floats(0, 2, exclude_min=True), st.sampled_from([1e-300, 2.0]))
top_k = st.one_of(st.just(-1), st.integers(1, 50), st.sampled_from([VOCAB, 10 ** 6]))
seed = st.one_of(st.integers(0, 2 ** 63 - 1), st.integers(0, 10))
stop_ids = st.one_of(st.lists(token_id, max_size=4), st.just(list(range(VOCAB))))
stop = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4),
                                                           max_size=3))
bias = st.dictionaries(token_id.map(str), st.one_of(st.floats(-100, 100),
                                                    st.sampled_from([-1e30, 1e30])), max_size=3)
SAMPLING = {"temperature": temperature, "top_p": unit, "top_k": top_k, "min_p": unit,
            "frequency_penalty": penalty, "presence_penalty": penalty,
            "repetition_penalty": rep_penalty, "stop": stop, "stop_token_ids": stop_ids,
            "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
            "no_stop_trim": st.booleans(), "logit_bias": bias}

# -- garbage: any JSON, but for the fields that bound the work nothing that would mean a
# long generation (null: the default, up to the context's end; a number in 5..context)
LENGTH_KEYS = {"max_new_tokens", "min_new_tokens", "max_tokens", "max_completion_tokens",
               "min_tokens", "n", "best_of", "max_output_tokens", "num_predict"}
bad_lengths = st.one_of(st.sampled_from([-1, -4, 10 ** 6, 10 ** 30, 2 ** 63, 4.5, 0.5, 3.0,
                                         1e300, math.nan, math.inf, -math.inf]),
                        st.booleans(), texts, st.lists(scalars, max_size=3),
                        st.dictionaries(texts, scalars, max_size=3))


def garbage(key: str) -> st.SearchStrategy:
    return bad_lengths if key in LENGTH_KEYS else any_json


@st.composite
def near_valid(draw, required: dict, optional: dict):
    """A valid body (required fields, some optional ones), then up to two mutations: a field
    set to garbage, a field dropped, or an unknown field added. The unmutated bodies are
    mostly valid, so the fuzz reaches the tokenizer, the scheduler and the detokenizer."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    keys = sorted({*required, *optional})
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        key = draw(st.sampled_from(keys))
        how = draw(st.sampled_from(["garbage", "garbage", "drop", "unknown"]))
        if how == "garbage":
            body[key] = draw(garbage(key))
        elif how == "drop":
            body.pop(key, None)
        else:
            body[draw(texts)] = draw(any_json)
    return body


sampling_params = near_valid({"max_new_tokens": short}, {
    **SAMPLING, "min_new_tokens": short, "n": st.integers(1, 3), "sampling_seed": seed,
    "spaces_between_special_tokens": st.booleans()})
generate_bodies = st.one_of(*(near_valid(prompt, {
    "sampling_params": st.one_of(sampling_params, st.lists(sampling_params, min_size=1,
                                                           max_size=3)),
    "rid": prompt_text, "stream": st.booleans(), "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 5), "logprob_start_len": st.integers(-1, 10),
    "return_text_in_logprobs": st.booleans(),
    # SGLang fields its clients send at their defaults
    "lora_path": st.none(), "return_hidden_states": st.just(False),
    "image_data": st.none(), "custom_logit_processor": st.none(),
}) for prompt in ({"text": prompt_text}, {"text": st.lists(prompt_text, min_size=1,
                                                           max_size=3)},
                  {"input_ids": ids}, {"input_ids": st.lists(ids, min_size=1, max_size=3)})))

OPENAI = {**SAMPLING, "model": st.one_of(st.just(MODEL), st.none()), "n": st.integers(1, 3),
          "seed": seed, "min_tokens": short, "user": prompt_text, "stream": st.booleans(),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
completion_bodies = near_valid({
    "prompt": st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=3), ids,
                        st.lists(ids, min_size=1, max_size=2)),
    "max_tokens": short}, {
    **OPENAI, "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": st.just(""),
    "best_of": st.just(1)})

message = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.one_of(prompt_text, st.lists(st.fixed_dictionaries({
        "type": st.just("text"), "text": prompt_text}), min_size=1, max_size=2))})
chat_bodies = near_valid({"messages": st.lists(message, min_size=1, max_size=3),
                          "max_tokens": short}, {
    **OPENAI, "max_completion_tokens": short, "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5), "tools": st.just([]), "tool_choice": st.just("none"),
    "response_format": st.just({"type": "text"}), "add_generation_prompt": st.just(True),
    "continue_final_message": st.just(False), "chat_template_kwargs": st.just({})})

abort_bodies = near_valid({}, {"rid": prompt_text, "abort_all": st.booleans()})

# The other dialects (api_proc/anthropic.py, responses.py, ollama.py, embeddings.py)
block = st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text})
anthropic_bodies = near_valid({"model": st.just(MODEL), "max_tokens": short, "messages": st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        prompt_text, st.lists(block, min_size=1, max_size=2))}), min_size=1, max_size=2)}, {
    "system": st.one_of(prompt_text, st.lists(block, max_size=2)), "stream": st.booleans(),
    "temperature": temperature, "top_p": unit, "top_k": top_k, "stop_sequences": st.lists(
        st.text(min_size=1, max_size=4), max_size=2), "metadata": st.just({"user_id": "u"}),
    "thinking": st.just({"type": "disabled"}), "tool_choice": st.just({"type": "none"})})
responses_bodies = near_valid({"input": st.one_of(prompt_text, st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                           "content": prompt_text}), min_size=1, max_size=2)),
    "max_output_tokens": st.integers(1, 4)}, {
    "model": st.just(MODEL), "instructions": prompt_text, "stream": st.booleans(),
    "temperature": temperature, "top_p": unit, "store": st.booleans(),
    "text": st.just({"format": {"type": "text"}}), "reasoning": st.just({})})
ollama_options = near_valid({"num_predict": st.integers(0, 4)}, {
    "temperature": temperature, "top_p": unit, "top_k": top_k, "seed": seed,
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "repeat_penalty": rep_penalty})
ollama_chat_bodies = near_valid({"model": st.just(MODEL), "options": ollama_options,
                                 "messages": st.lists(message, min_size=1, max_size=2)}, {
    "stream": st.booleans(), "format": st.sampled_from(["", "json"]), "think": st.booleans(),
    "keep_alive": st.just("5m")})
ollama_generate_bodies = near_valid({"model": st.just(MODEL), "options": ollama_options,
                                     "prompt": prompt_text}, {
    "system": prompt_text, "stream": st.booleans(), "format": st.sampled_from(["", "json"])})
ollama_embed_bodies = near_valid({"model": st.just(MODEL), "input": st.one_of(
    prompt_text, st.lists(prompt_text, min_size=1, max_size=3))}, {"truncate": st.booleans()})
inputs = st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=3), ids,
                   st.lists(ids, min_size=1, max_size=2))
embeddings_bodies = near_valid({"input": inputs}, {
    "model": st.just(MODEL), "encoding_format": st.sampled_from(["float", "base64"]),
    "pooling": st.sampled_from(["last", "mean", "cls"])})
score_bodies = near_valid({"query": prompt_text, "items": st.lists(prompt_text, min_size=1,
                                                                   max_size=3),
                           "label_token_ids": st.lists(token_id, min_size=1, max_size=3)}, {
    "model": st.just(MODEL), "apply_softmax": st.booleans(), "item_first": st.booleans()})
rerank_bodies = near_valid({"query": prompt_text, "documents": st.lists(
    prompt_text, min_size=1, max_size=3)}, {"model": st.just(MODEL), "top_n": st.integers(
        0, 4), "return_documents": st.booleans()})


def shorten(path: str, body):
    """Whatever a body's other fields, a prompt it carries asks for at most 4 tokens (a
    missing or null length field would mean the default: up to the context's end)."""
    if not isinstance(body, dict):
        return body
    if path == "/generate" and ("text" in body or "input_ids" in body):
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = {"max_new_tokens": 4}
        for d in (sp if isinstance(sp, list) else [sp]):
            if isinstance(d, dict) and d.get("max_new_tokens") is None:
                d["max_new_tokens"] = 4
    elif path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 4
    elif path.startswith("/api/"):
        options = body.get("options")
        if options is None:
            options = body["options"] = {}
        if isinstance(options, dict) and (not isinstance(options.get("num_predict"), int) or
                                          options["num_predict"] < 0):
            options["num_predict"] = 4
    elif path.startswith("/v1/") and ("prompt" in body or "messages" in body):
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body and body[key] is None:
                body[key] = 4
        body.setdefault("max_tokens", 4)
    return body


@st.composite
def payloads(draw, path: str, near_valid: st.SearchStrategy):
    """(body bytes, content type) for one request to path."""
    body = shorten(path, draw(st.one_of(near_valid, near_valid, near_valid, any_json)))
    if draw(st.booleans()):
        raw = json.dumps(body, ensure_ascii=True).encode()              # \ud800 escapes
    else:
        raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ctype = draw(st.sampled_from(["application/json"] * 6 +
                                 ["application/json; charset=utf-8", "text/plain", None]))
    return raw, ctype


# ---- the harness ---------------------------------------------------------------------------

class Fuzz:
    """Sends requests and keeps what went wrong, grouped by kind."""

    def __init__(self, server, model_id: str):
        self.server, self.model_id = server, model_id
        self.count = 0
        self.statuses: Counter[int] = Counter()
        self.recent: deque[str] = deque(maxlen=3)     # the requests before a fatal one
        self.fatal_message: str | None = None          # the first fatal failure, kept
        self.problems: dict[str, list[bytes]] = defaultdict(list)

    def send(self, method: str, path: str, raw: bytes | None = None,
             ctype: str | None = "application/json", params=None) -> httpx.Response:
        if raw is not None:
            raw = raw.replace(MODEL.encode(), json.dumps(self.model_id)[1:-1].encode())
        headers = {"content-type": ctype} if ctype else {}
        self.count += 1
        try:
            with self.server.client.stream(method, path, content=raw, headers=headers,
                                           params=params) as r:
                body = r.read()
        except httpx.HTTPError as e:
            self.fatal(f"{type(e).__name__}: {e}", method, path, raw)
        self.statuses[r.status_code] += 1
        self.recent.append(f"{method} {path} {(raw or b'')[:400]!r} -> {r.status_code} "
                           f"{body[-160:]!r}")
        if r.status_code >= 500:
            self.problem(f"{r.status_code} {body[:120]!r}", method, path, raw)
        elif r.status_code < 300 and not stream_complete(path, r.headers.get(
                "content-type", ""), body):
            self.problem(f"stream not ended as its dialect ends one: ...{body[-80:]!r}",
                         method, path, raw)
        elif not 200 <= r.status_code < 500:
            self.problem(f"status {r.status_code}", method, path, raw)
        return r

    def problem(self, kind: str, method: str, path: str, raw: bytes | None) -> None:
        if self.server.proc.poll() is not None or not self.healthy():
            self.fatal(f"the server is down after: {kind}", method, path, raw)
        self.problems[kind].append(raw or b"")

    def fatal(self, why: str, method: str, path: str, raw: bytes | None) -> None:
        if self.fatal_message is None:
            recent = "".join(f"\n  {line}" for line in self.recent)
            self.fatal_message = (
                f"{method} {path} {(raw or b'')[:600]!r}\n-> {why}\nafter {self.count} "
                f"requests; the last ones:{recent}\nearlier problems:"
                f"{self.report() or ' none'}")
        pytest.fail(self.fatal_message, pytrace=False)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.server.url + "/health", timeout=TIMEOUT).status_code == 200
        except httpx.HTTPError:
            return False

    def report(self) -> str:
        return "".join(f"\n  {len(bodies)} x {kind}; smallest body: "
                       f"{min(bodies, key=len)[:300]!r}"
                       for kind, bodies in sorted(self.problems.items()))

    def check(self, min_count: int) -> None:
        assert not self.problems, f"{self.count} requests; problems:{self.report()}"
        assert self.count >= min_count
        assert_healthy_and_idle(self.server)


# How each dialect's stream ends (the last frame or line), when it ends well or with an error.
STREAM_ENDS = {"/v1/messages": (b"event: message_stop", b"event: error"),
               "/v1/responses": (b"event: response.completed", b"event: response.incomplete",
                                 b"event: error")}


def stream_complete(path: str, content_type: str, body: bytes) -> bool:
    if content_type.startswith("application/x-ndjson"):         # Ollama's
        lines = body.strip().split(b"\n")
        last = json.loads(lines[-1]) if lines and lines[-1] else {}
        return last.get("done") is True or "error" in last
    if not content_type.startswith("text/event-stream"):
        return True
    frames = [f for f in body.strip().split(b"\n\n") if not f.startswith(b":")]
    if path not in STREAM_ENDS:
        return bool(frames) and frames[-1] == b"data: [DONE]"
    return bool(frames) and frames[-1].startswith(STREAM_ENDS[path])


def assert_healthy_and_idle(server) -> None:
    assert server.proc.poll() is None, server.logs()
    assert server.client.get("/health").status_code == 200
    kv = wait_idle(server)["kv_pool"]
    assert kv["free"] + kv["evictable"] == kv["total"], kv
    out = server.generate_ok(text="still serving", sampling_params={
        "max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2


# ---- POST routes: random bodies ------------------------------------------------------------

NEAR_VALID = {"/generate": generate_bodies, "/v1/completions": completion_bodies,
              "/v1/chat/completions": chat_bodies, "/abort_request": abort_bodies,
              "/flush_cache": any_json}


@pytest.mark.parametrize("path", list(NEAR_VALID))
def test_random_bodies_never_get_a_5xx(server, model_id, path):
    fuzz = Fuzz(server, model_id)

    @FUZZ
    @given(payloads(path, NEAR_VALID[path]))
    def example(payload):
        fuzz.send("POST", path, *payload)
    example()
    fuzz.check(POST_EXAMPLES)
    served = sum(n for status, n in fuzz.statuses.items() if status < 300)
    assert served >= fuzz.count // 10, f"too few valid bodies reached the model: {fuzz.statuses}"


DIALECTS = {"/v1/messages": anthropic_bodies, "/v1/responses": responses_bodies,
            "/api/chat": ollama_chat_bodies, "/api/generate": ollama_generate_bodies,
            "/v1/embeddings": embeddings_bodies, "/v1/score": score_bodies,
            "/v1/rerank": rerank_bodies, "/v1/messages/count_tokens": anthropic_bodies,
            "/v1/responses/input_tokens": responses_bodies, "/api/embed": ollama_embed_bodies,
            "/api/show": near_valid({"model": st.just(MODEL)}, {"verbose": st.booleans()})}


@pytest.mark.parametrize("path", list(DIALECTS))
def test_the_dialects_random_bodies_never_get_a_5xx(server, model_id, path):
    """The same harness over the other dialects' routes, with fewer examples a route: their
    bodies all become the chat core's (or the embeddings') requests, which the routes
    above fuzz at length."""
    fuzz = Fuzz(server, model_id)

    @settings(FUZZ, max_examples=DIALECT_EXAMPLES)
    @given(payloads(path, DIALECTS[path]))
    def example(payload):
        fuzz.send("POST", path, *payload)
    example()
    fuzz.check(DIALECT_EXAMPLES)
    served = sum(n for status, n in fuzz.statuses.items() if status < 300)
    assert served >= fuzz.count // 10, f"too few valid bodies reached the model: {fuzz.statuses}"


# ---- POST routes: raw bytes no JSON encoder writes -----------------------------------------

DEEP = 2000
# Each route's smallest valid body, with @ where a value goes.
TEMPLATES = {
    "/generate": b'{"text": "a", "sampling_params": {"max_new_tokens": 1, "temperature": @}}',
    "/v1/completions": b'{"prompt": "a", "max_tokens": 1, "temperature": @}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "a"}], '
                            b'"max_tokens": 1, "temperature": @}',
    "/abort_request": b'{"rid": @}',
}
# Values that are not JSON, or JSON no route can take: the answer must be a 4xx.
BAD_VALUES = {
    "nan": b"NaN", "infinity": b"Infinity", "minus_infinity": b"-Infinity",
    "exponent_overflow": b"1e400", "int_5000_digits": b"9" * 5000,
    "deep_array": b"[" * DEEP + b"]" * DEEP, "deep_object": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "bad_utf8": b'"\xff\xfe"', "truncated_literal": b"tru",
}
WHOLE_BODIES = {
    "not_json": b"{not json", "empty": b"", "truncated": b'{"text": "a", "prompt": [1',
    "deep_array_body": b"[" * DEEP + b"]" * DEEP, "deep_object_body":
        b'{"a":' * DEEP + b"1" + b"}" * DEEP, "bad_utf8_body": b"\xff\xfe{}",
}


def raw_bodies(path: str) -> dict[str, tuple[bytes, bool]]:
    """name -> (body, whether only a 4xx is right; else a 2xx is right too)."""
    t = TEMPLATES[path]
    cases = {name: (raw, True) for name, raw in WHOLE_BODIES.items()}
    cases |= {name: (t.replace(b"@", v), True) for name, v in BAD_VALUES.items()}
    cases |= {   # valid JSON, odd content
        "lone_surrogate_key": (b'{"\\ud800": 1, ' + t[1:].replace(b"@", b"0"), False),
        "lone_surrogate_value": (t.replace(b"@", b'"\\udfff"'), path != "/abort_request"),
        "lone_surrogate_prompt": (t.replace(b'"a"', b'"\\ud800"').replace(b"@", b"0"),
                                  False),
        "duplicate_keys": (t.replace(b"@", b'0, "temperature": 0'), False),
        "underflow": (t.replace(b"@", b"1e-400"), False),
    }
    return cases


RAW_CASES = [(path, name) for path in TEMPLATES for name in raw_bodies(path)]


@pytest.mark.parametrize("path,case", RAW_CASES, ids=[f"{p}:{c}" for p, c in RAW_CASES])
def test_raw_bodies_get_a_4xx_or_a_2xx_never_a_5xx(server, model_id, path, case):
    raw, only_4xx = raw_bodies(path)[case]
    raw = raw.replace(MODEL.encode(), model_id.encode())
    r = server.client.post(path, content=raw, headers={"content-type": "application/json"})
    if only_4xx or r.status_code >= 300:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert isinstance(r.json()["error"]["message"], str)
    else:
        assert 200 <= r.status_code < 300, (r.status_code, r.text[:300])


def test_raw_bodies_on_flush_cache(server, model_id):
    fuzz = Fuzz(server, model_id)
    bodies = {raw for path in TEMPLATES for raw, _ in raw_bodies(path).values()}
    for raw in bodies:
        fuzz.send("POST", "/flush_cache", raw)
    fuzz.check(len(bodies))


# ---- GET routes, and every route with the wrong method -------------------------------------

GET_ROUTES = ["/health", "/server_info", "/model_info", "/v1/models", "/get_model_info",
              "/get_server_info"]
query = st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3)


@pytest.mark.parametrize("path", GET_ROUTES)
def test_get_routes_with_random_queries_and_bodies(server, model_id, path):
    fuzz = Fuzz(server, model_id)

    @settings(FUZZ, max_examples=GET_EXAMPLES)
    @given(params=query, body=st.one_of(st.none(), payloads(path, any_json)))
    def example(params, body):
        r = fuzz.send("GET", path, *(body or (None, None)), params=params)
        assert r.status_code == 200, (r.status_code, r.text[:300])
        r.json()
    example()
    fuzz.check(GET_EXAMPLES)


WRONG_METHODS = [(m, path) for path in GET_ROUTES for m in ("POST", "PUT", "DELETE")] + \
                [(m, path) for path in NEAR_VALID for m in ("GET", "PUT", "DELETE")]


@pytest.mark.parametrize("method,path", WRONG_METHODS, ids=[f"{m}{p}" for m, p in WRONG_METHODS])
def test_wrong_methods_are_a_4xx(server, method, path):
    """A GET acts on nothing (a GET /flush_cache once flushed the cache)."""
    r = server.client.request(method, path, content=b"{}",
                              headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
