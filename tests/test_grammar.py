"""Constrained decoding, without a server: grammar validation and compilation
(scheduler_proc/grammar.py, llguidance over the tiny llama's tokenizer), the sampler's token
bitmask (constrained rows pick only allowed tokens, free rows are untouched), the scheduler's
handling of requests that wait for their grammar (test_scheduler_unit's fakes), the
tokenizer worker's 400s and the OpenAI routes' response_format.
tests/test_structured_outputs.py runs it all end to end."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import json
import select

import pytest
import torch

from api_proc.openai_api import OpenAIError, parse_chat, parse_completion
from scheduler_proc import scheduler as scheduler_mod
from grammars.checker import Checker
from scheduler_proc.grammar import (STEER_WINDOW, GrammarCompiler, GrammarError, fill_bitmask,
                                    steer)
from scheduler_proc.sampler import (apply_token_bitmask, bitmask_bias, constrain,
                                    sample_tokens, token_logprobs, unpack_bias)
from test_scheduler_unit import (assert_pool_idle, finishes, ids_of, make, request,
                                 run_until_idle, token_after)
from tokenization.hf_tokenizer import HFTokenizer
from tokenization.prompts import Tokenizer
from tokenizer_proc.process import SCHEDULER, Worker
from wire.codec import decode
from wire.messages import (AbortRequest, FlushCacheRequest, GenerateRequest, ReleaseRequest,
                           TextBatch, TokenizedRequest)
from wire.sampling import SamplingParams

DATE = r"\d{4}-\d{2}-\d{2}"
YES_NO = 'root ::= answer\nanswer ::= ("yes" | "no") "."'


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf(tiny) -> HFTokenizer:
    return HFTokenizer.from_dir(tiny)


@pytest.fixture(scope="module")
def compiler(tiny, hf):
    c = GrammarCompiler(str(tiny), len(hf), [hf.eos_token_id])
    yield c
    c.close()


def compiled(compiler, kind, text):
    fut = compiler.compile((kind, text))
    fut.result(timeout=60)
    return compiler.matcher(fut)


def allowed(bitmask_row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.nonzero(bits)[0].tolist())


# ---- validation (the tokenizer worker's check) -------------------------------------------------

CHECKER = Checker()


def validate(kind: str, text: str) -> None:
    verdict = CHECKER.check(kind, text)
    if verdict:
        raise GrammarError(verdict)


@pytest.mark.parametrize("kind, text", [
    ("regex", DATE), ("regex", "(yes|no)"), ("ebnf", YES_NO), ("ebnf", 'start: "a" | "b"'),
    ("json_schema", '{"type":"object","properties":{"a":{"enum":[1,"x"]}}}'),
    ("json_schema", "{}"),
])
def test_valid_grammars_pass(kind, text):
    validate(kind, text)


@pytest.mark.parametrize("kind, text, message", [
    ("regex", "(unclosed", "The regex does not compile: "),
    ("regex", "(unclosed", "unclosed group"),
    ("ebnf", "root ::= undefined_rule", "The EBNF grammar does not compile: "),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    ("json_schema", '{"type":"objekt"}', "The JSON schema does not compile: Invalid type: "
                                         "objekt"),
    ("json_schema", '{"type":"string","format":"nope"}', "Unknown format: nope"),
    ("json_schema", '{"type":"string","pattern":"[a-z"}', "unclosed character class"),
    ("json_schema", '{"type":"integer","multipleOf":"x"}', "The JSON schema does not compile"),
])
def test_grammars_that_do_not_compile_name_the_problem(kind, text, message):
    with pytest.raises(GrammarError) as e:
        validate(kind, text)
    assert message in str(e.value)


# ---- the scheduler's compiler --------------------------------------------------------------------

def test_compiles_are_cached_by_text_lru_bounded(tiny, hf):
    c = GrammarCompiler(str(tiny), len(hf), [hf.eos_token_id], cache_size=2)
    try:
        a = c.compile(("regex", "a+"))
        assert c.compile(("regex", "a+")) is a and c.compiled_total == 1
        b = c.compile(("regex", "b+"))
        assert c.compile(("regex", "a+")) is a                 # a is now the most recent
        c.compile(("ebnf", YES_NO))                           # evicts b, not a
        assert c.compile(("regex", "a+")) is a and c.compile(("regex", "b+")) is not b
        assert c.compiled_total == 4
        bad = c.compile(("regex", "(unclosed"))
        assert c.compile(("regex", "(unclosed")) is bad       # failures are cached too
        with pytest.raises(GrammarError, match="The regex does not compile"):
            c.matcher(bad)
    finally:
        c.close()


def test_each_request_gets_its_own_matcher(compiler, hf):
    one, two = compiled(compiler, "regex", DATE), compiled(compiler, "regex", DATE)
    for token in hf.encode("2024-01-3", add_special_tokens=False):
        assert one.consume(token)
    assert not one.stopped and two.consumed == 0
    [last] = hf.encode("1", add_special_tokens=False)
    assert one.consume(last) and one.stopped                  # complete: nothing more fits
    x = hf.encode("x", add_special_tokens=False)[0]
    assert not two.consume(x) and two.error                  # a token the grammar forbids


def test_sync_rebuilds_a_matcher_from_the_output_ids(compiler, hf):
    ids = hf.encode("2024-01", add_special_tokens=False)
    m = compiled(compiler, "regex", DATE)
    m.sync(ids)
    assert m.consumed == len(ids)
    fresh = compiled(compiler, "regex", DATE)
    for t in ids:
        fresh.consume(t)
    assert (fill_bitmask([m]) == fill_bitmask([fresh])).all()
    m.sync(ids)                                               # in step: a no-op
    assert m.consumed == len(ids)


# ---- the sampler's bitmask ---------------------------------------------------------------------

def bitmask_of(rows: list[set[int]], vocab: int) -> np.ndarray:
    out = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for j, ids in enumerate(rows):
        for t in ids:
            out[j, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    return out


def test_apply_token_bitmask_masks_only_the_constrained_rows():
    vocab = 70                                    # not a multiple of 32: a partial last word
    logits = torch.randn(4, vocab)
    sets = [{0, 31, 32, 69}, {5}]
    out = apply_token_bitmask(logits, [1, 3], bitmask_of(sets, vocab))
    assert torch.equal(out[[0, 2]], logits[[0, 2]])           # free rows untouched
    for row, ids in zip([1, 3], sets):
        finite = set(torch.isfinite(out[row]).nonzero().view(-1).tolist())
        assert finite == ids
        assert torch.equal(out[row, sorted(ids)], logits[row, sorted(ids)])
    assert torch.isfinite(logits).all()                       # a copy: the input is kept
    # tokens past the bitmask's width (model vocabulary > tokenizer's) are never allowed
    narrow = apply_token_bitmask(torch.zeros(1, 100), [0], bitmask_of([{1, 63}], 64))
    assert set(torch.isfinite(narrow[0]).nonzero().view(-1).tolist()) == {1, 63}


def test_the_device_side_unpacking_equals_numpy_s():
    """The CUDA path unpacks with torch ops (unpack_bias); checked here on CPU tensors."""
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(3, 5), dtype=np.int32)
    cpu = bitmask_bias(words, "cpu")
    assert torch.equal(unpack_bias(torch.from_numpy(words)), cpu)
    assert set(cpu.unique().tolist()) == {0.0, float("-inf")}


class Row:
    """The sampler's view of a request: sampling, output_ids, generator, grammar."""

    def __init__(self, grammar=None, seed=None, **sampling):
        self.sampling = SamplingParams(**sampling)
        self.output_ids: list[int] = []
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.grammar = grammar


def test_constrained_and_free_rows_share_a_step(compiler, hf):
    vocab = len(hf)
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 5
    greedy_g, sampled_g = compiled(compiler, "regex", DATE), compiled(compiler, "ebnf", YES_NO)
    rows = [Row(greedy_g, temperature=0), Row(temperature=0),
            Row(sampled_g, seed=1, temperature=1.0), Row(seed=2, temperature=0.8, top_k=50)]
    date_ok = allowed(fill_bitmask([greedy_g])[0], vocab)
    yes_no_ok = allowed(fill_bitmask([sampled_g])[0], vocab)
    assert 0 < len(date_ok) < vocab and 0 < len(yes_no_ok) < vocab
    masked = constrain(logits, rows)
    ids = sample_tokens(masked, rows, [hf.eos_token_id])
    assert ids[0] == max(date_ok, key=lambda t: logits[0, t].item())   # greedy among allowed
    assert ids[2] in yes_no_ok
    # the free rows draw exactly what they would alone, unmasked
    alone = [Row(temperature=0), Row(seed=2, temperature=0.8, top_k=50)]
    assert [ids[1], ids[3]] == sample_tokens(logits[[1, 3]], alone, [hf.eos_token_id])
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    # many draws from the constrained row stay inside the grammar
    draws = sample_tokens(masked[[2]].expand(2000, vocab).clone(),
                          [Row(sampled_g, temperature=1.5)] * 2000, [])
    assert set(draws) <= yes_no_ok and len(set(draws)) > 1
    assert constrain(logits, alone) is logits                 # nothing constrained: no copy


def test_min_new_tokens_yields_to_the_grammar():
    """A min_new_tokens ban that would leave a constrained row nothing falls back to the
    best token the grammar allows (the masked logits are the fallback's raw logits), never
    to one it forbids; a ban that leaves something is kept."""
    vocab, eos = 40, 3
    logits = torch.randn(2, vocab)
    logits[:, 7] = 50.0                               # the model's favourite: forbidden
    masked = apply_token_bitmask(logits, [0, 1], bitmask_of([{eos}, {eos, 9}], vocab))
    rows = [Row(temperature=0, min_new_tokens=5), Row(temperature=1.0, min_new_tokens=5)]
    assert sample_tokens(masked, rows, [eos]) == [eos, 9]


def test_logprobs_list_only_tokens_the_grammar_allows():
    logits = apply_token_bitmask(torch.randn(2, 40), [0], bitmask_of([{4, 9}], 40))
    lp = token_logprobs(logits, [9, 3], top_n=5)
    assert set(lp.top_ids[0]) == {4, 9} and len(lp.top_logprobs[0]) == 2   # not 5
    assert abs(sum(math.exp(v) for v in lp.top_logprobs[0]) - 1) < 1e-5
    assert len(lp.top_ids[1]) == 5                                        # a free row
    assert all(math.isfinite(v) for row in lp.top_logprobs for v in row)


# ---- the scheduler: requests waiting for their grammar -------------------------------------

@pytest.fixture(autouse=True)
def short_grammar_wait(monkeypatch):
    """Steps with only compiles pending block this long on them (the fakes never finish
    while blocked)."""
    monkeypatch.setattr(scheduler_mod, "GRAMMAR_WAIT", 0.001)


def constrained(rid: str, key: str = "stop:3", **kw):
    return request(rid, regex=key, **kw)


def test_a_request_waits_for_its_grammar_without_kv_and_others_run():
    s, batches, _ = make()
    s.step([constrained("g", max_new_tokens=10), request("free", max_new_tokens=3)])
    assert [r.rid for r in s.compiling] == ["g"] and s.compiling[0].row is None
    assert not s.idle and s.load().queued == 1
    run_until_idle_except_compiling(s)
    assert finishes(batches) == {"free": finishes(batches)["free"]}   # free one is done
    s.grammars.resolve()
    run_until_idle(s)
    f = finishes(batches)["g"]
    assert (f.type, f.matched_token) == ("stop", token_after(3 + 2))  # grammar complete
    assert ids_of(batches, "g") == [token_after(3 + i) for i in range(3)]
    assert_pool_idle(s)


def run_until_idle_except_compiling(s, steps: int = 100) -> None:
    for _ in range(steps):
        if not (s.waiting or s.running):
            return
        s.step([])
    raise AssertionError("requests still running")


def run_compiled(s, msgs) -> None:
    """Send msgs, let every compile finish, run until idle."""
    s.step(msgs)
    s.grammars.resolve()
    run_until_idle(s)


def test_grammar_completion_wins_over_length():
    s, batches, _ = make()
    run_compiled(s, [constrained("g", "stop:4", max_new_tokens=4)])
    assert finishes(batches)["g"].type == "stop" and len(ids_of(batches, "g")) == 4
    run_compiled(s, [constrained("h", "stop:9", max_new_tokens=4)])
    assert finishes(batches)["h"].type == "length"


@pytest.mark.parametrize("end", ["abort", "release", "abort_all"])
def test_abort_and_release_reach_a_request_waiting_for_its_grammar(end):
    s, batches, _ = make()
    s.step([constrained("g"), constrained("h", "stop:2")])
    msg = {"abort": AbortRequest(rid="g"), "release": ReleaseRequest(rids=["g"]),
           "abort_all": AbortRequest(rid="", abort_all=True)}[end]
    s.step([msg])
    assert finishes(batches)["g"].type == "abort" and "g" not in s.in_flight
    s.grammars.resolve()                          # the compile ends later: nothing happens
    run_until_idle(s)
    outs = [o for b in batches for o in b.outputs if o.rid == "g"]
    assert len(outs) == 1                         # exactly one terminal output
    assert (finishes(batches)["h"].type == "abort") == (end == "abort_all")
    assert_pool_idle(s)


def test_a_grammar_that_fails_to_compile_ends_its_requests_with_a_400():
    s, batches, _ = make()
    s.step([constrained("a", "bad grammar"), constrained("b", "bad grammar")])
    s.grammars.resolve()
    s.step([constrained("c", "bad grammar")])     # the cached failure: answered at once
    for rid in "abc":
        f = finishes(batches)[rid]
        assert (f.type, f.status_code) == ("abort", 400)
        assert f.message == "The regex does not compile: bad grammar"
    assert s.idle and s.rejected_total == 3 and not s.runner.steps
    assert_pool_idle(s)


def test_a_streamed_constrained_request_is_admitted_only_once_its_grammar_compiled():
    s, batches, _ = make()
    good, bad = constrained("good"), constrained("bad", "bad grammar")
    good.stream = bad.stream = True
    s.step([good, bad])
    assert not [o for b in batches for o in b.outputs]          # compiling: nothing yet
    s.grammars.resolve()
    run_compiled(s, [])
    out = {rid: [o for b in batches for o in b.outputs if o.rid == rid]
           for rid in ("good", "bad")}
    assert out["good"][0].new_ids == [] and out["good"][0].finish is None   # the admission
    assert len(out["bad"]) == 1 and out["bad"][0].finish.status_code == 400  # none for it


def test_a_fault_in_the_compiler_is_a_500_for_that_request_only():
    s, batches, _ = make()
    s.step([constrained("a", "stop:1"), request("b")])
    s.grammars.pending[0][1].set_exception(RuntimeError("boom"))
    s.grammars.pending.clear()
    run_until_idle(s)
    assert finishes(batches)["a"].status_code == 500 and "boom" in finishes(batches)["a"].message
    assert finishes(batches)["b"].type == "length"


def test_flush_waits_for_compiling_requests_and_the_queue_limit_counts_them():
    s, batches, replies = make(max_queued_requests=1)
    s.step([constrained("a"), constrained("b"), FlushCacheRequest(req_id="f")])
    assert not replies[-1].ok
    f = finishes(batches)["b"]
    assert (f.type, f.status_code) == ("abort", 503)       # the newest over the limit
    s.grammars.resolve()
    run_until_idle(s)
    assert finishes(batches)["a"].type == "stop"


def test_the_idle_loop_blocks_on_compiles(monkeypatch):
    """With only compiles pending, a step waits on them (no spinning) and returns as soon as
    one is done."""
    s, batches, _ = make()
    s.step([constrained("g", "stop:1")])
    monkeypatch.setattr(scheduler_mod, "GRAMMAR_WAIT", 60.0)
    timer = threading.Timer(0.2, s.grammars.resolve)
    timer.start()
    start = time.monotonic()
    s.step([])
    assert time.monotonic() - start >= 0.15       # it blocked until the compile ended ...
    timer.join()
    run_until_idle(s)                             # ... and did not wait out GRAMMAR_WAIT
    assert finishes(batches)["g"].type == "stop"


def test_without_a_compiler_constrained_requests_are_refused():
    s, batches, _ = make()
    s.grammars = None
    s.step([constrained("g")])
    f = finishes(batches)["g"]
    assert f.status_code == 400 and "Constrained decoding" in f.message and s.idle


def test_a_forged_constraint_is_refused():
    s, batches, _ = make()
    s.step([request("a", regex="a", ebnf="b"), request("b", json_schema="[]")])
    assert "Only one of regex" in finishes(batches)["a"].message
    assert "must be a JSON object" in finishes(batches)["b"].message


def test_a_retracted_constrained_request_keeps_its_matcher():
    """Overcommitted (as in test_scheduler_unit): the newer is retracted and recomputed; its
    matcher saw each of its tokens exactly once (FakeMatcher.sync checks on retraction)."""
    s, batches, _ = make(pool=50, max_running=2)
    s.step([constrained("a", "stop:28", max_new_tokens=30, ignore_eos=True),
            constrained("b", "stop:28", max_new_tokens=30, ignore_eos=True)])
    s.grammars.resolve()
    s.step([])
    assert [r.rid for r in s.running] == ["a", "b"]
    run_until_idle(s)
    assert s.retracted_total == 1
    for rid in "ab":
        assert finishes(batches)[rid].type == "stop" and len(ids_of(batches, rid)) == 28
    assert_pool_idle(s)


# ---- the tokenizer worker's 400s -----------------------------------------------------------------

@pytest.fixture(scope="module")
def worker(tiny):
    import json
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    return Worker(Tokenizer(str(tiny), vocab, 64))


def handled(worker: Worker, req: GenerateRequest) -> tuple[int, bytes]:
    """What the worker makes of one request, once its grammar has a verdict."""
    routed = worker.handle(req)
    while routed is None:
        assert worker.parked, "a request that was neither routed nor parked"
        select.select([worker.checker.fileno()], [], [], worker.checker.wait_s())
        [routed] = worker.collect() or [None]
    return routed


@pytest.mark.parametrize("sampling, fragment", [
    ({"regex": "(unclosed"}, "The regex does not compile: "),
    ({"ebnf": "root ::= nowhere"}, "The EBNF grammar does not compile: "),
    ({"json_schema": '{"type":"objekt"}'}, "Invalid type: objekt"),
    ({"json_schema": "[1]"}, "json_schema must be a JSON object"),       # forged shapes
    ({"regex": ""}, "sampling_params.regex must not be empty."),
    ({"regex": "a", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf"),
])
def test_the_tokenizer_refuses_bad_grammars_with_a_400(worker, sampling, fragment):
    req = GenerateRequest(rid="r", text="hi", input_ids=None,
                          sampling=SamplingParams(max_new_tokens=4, **sampling))
    dest, frame = handled(worker, req)
    [out] = decode(frame).outputs
    assert dest == 0 and isinstance(decode(frame), TextBatch)
    assert out.finish.status_code == 400 and fragment in out.finish.message, out.finish


def test_the_tokenizer_passes_good_grammars_on(worker):
    for sampling in ({"regex": DATE}, {"ebnf": YES_NO}, {"json_schema": '{"type":"object"}'}):
        req = GenerateRequest(rid="r", text="hi", input_ids=None,
                              sampling=SamplingParams(max_new_tokens=4, **sampling))
        dest, frame = handled(worker, req)
        assert dest == SCHEDULER and isinstance(decode(frame), TokenizedRequest)
        assert decode(frame).sampling.grammar == req.sampling.grammar


# ---- the OpenAI routes ---------------------------------------------------------------------------

MODEL = "m"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("parse", ["chat", "completion"])
def test_response_format_and_sglang_extras(parse):
    def sampling(**body) -> SamplingParams:
        if parse == "chat":
            return parse_chat({**CHAT, **body}, MODEL, 128).requests[0].sampling
        return parse_completion({"prompt": "hi", **body}, MODEL).requests[0].sampling
    assert sampling().grammar is None
    assert sampling(response_format={"type": "text"}).grammar is None
    assert sampling(response_format={"type": "json_object"}).json_schema == '{"type":"object"}'
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                  "strict": True, "description": "d"}}
    assert sampling(response_format=fmt).json_schema == \
        '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    assert sampling(regex=DATE).regex == DATE
    assert sampling(ebnf=YES_NO).ebnf == YES_NO
    assert sampling(json_schema=SCHEMA).json_schema == sampling(response_format=fmt).json_schema
    assert sampling(json_schema='{"type":"string"}').json_schema == '{"type":"string"}'


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": "json"}, "response_format", "must be an object with a string 'type'"),
    ({"response_format": {"type": "yaml"}}, "response_format", 'type "yaml" is not supported'),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format", "name must be a non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format", "strict must be a boolean"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format", "Unknown field(s) in response_format.json_schema: extra."),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format",
     "Unknown field(s) in response_format: schema."),
    ({"response_format": {"type": "structural_tag"}}, "response_format",
     'type "structural_tag" is not supported'),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format",
     "Only one of regex, json_schema, or ebnf can be set"),
    ({"regex": "a", "ebnf": "b"}, "ebnf", "Only one of regex, json_schema, or ebnf"),
    ({"regex": 3}, "regex", "regex must be a string"),
    ({"json_schema": "{"}, "json_schema", "json_schema is not valid JSON"),
])
@pytest.mark.parametrize("parse", ["chat", "completion"])
def test_bad_response_formats_are_400_naming_the_field(parse, body, param, fragment):
    with pytest.raises(OpenAIError) as e:
        if parse == "chat":
            parse_chat({**CHAT, **body}, MODEL, 128)
        else:
            parse_completion({"prompt": "hi", **body}, MODEL)
    assert e.value.status == 400 and e.value.param == param
    assert fragment in str(e.value), str(e.value)


# ---- ending within the budget (grammar.Closer, grammar.steer) -----------------------------

def babble(compiler, hf, kind: str, text: str, budget: int, likes: bytes) -> tuple[str, bool]:
    """Decode with a 'model' that always picks an allowed token spelling one of `likes`
    (or else the lowest allowed id), steered by the budget; (the text, grammar complete)."""
    m = compiled(compiler, kind, text)
    vocab = m.n_vocab
    liked = [t for t in range(len(hf)) if hf.decode([t]).encode() in
             [bytes([c]) for c in likes]]
    out: list[int] = []
    while len(out) < budget and not m.stopped:
        row = steer(fill_bitmask([m]), [m], [budget - len(out)])[0]
        ok = allowed(row, vocab)
        token = next((t for t in liked if t in ok), min(ok))
        assert m.consume(token)
        out.append(token)
    return hf.decode(out), m.stopped or m.m.is_accepting()


@pytest.mark.parametrize("budget", [16, 40, 64, 120])
def test_an_unbounded_string_is_closed_within_the_budget(compiler, hf, budget):
    schema = {"type": "object", "properties": {"s": {"type": "string"},
                                               "n": {"type": "integer"}},
              "required": ["s", "n"], "additionalProperties": False}
    text, done = babble(compiler, hf, "json_schema", json.dumps(schema), budget, b"ab")
    assert done, text
    obj = json.loads(text)
    assert set(obj) == {"s", "n"} and isinstance(obj["n"], int)


def test_nested_arrays_and_numbers_are_closed_too(compiler, hf):
    schema = {"type": "array", "items": {"type": "object", "properties": {
        "v": {"type": "array", "items": {"type": "number"}}}, "required": ["v"]}}
    text, done = babble(compiler, hf, "json_schema", json.dumps(schema), 48, b"1, ")
    assert done and isinstance(json.loads(text), list), text


def test_nothing_is_steered_before_the_budget_is_in_sight(compiler, hf):
    """A string the 'model' never ends: it runs past the window's start, then is closed."""
    text, done = babble(compiler, hf, "json_schema", '{"type": "string"}', 200, b"ab")
    assert done and json.loads(text) and len(text) > 200 - STEER_WINDOW
