"""The scheduler core driven with a fake model runner and a real KVManager: validation of
what arrives on its socket, fault isolation (a failing forward or sampling row), the KV
pool's idle invariant afterwards, retraction and overcommit, held outputs, aborts and
releases, fitting chat requests to the pool, the queue limit and the watchdog's timer.
test_scheduler_random.py drives the same fakes with random traffic."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch

from scheduler_proc import process
from scheduler_proc import runner as runner_mod
from scheduler_proc.grammar import GrammarError
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.runner import Segment, sample_isolated
from scheduler_proc.sampler import seeded_generator
from scheduler_proc.scheduler import Scheduler
from wire.messages import (AbortRequest, FlushCacheRequest, LogprobRequest, Logprobs,
                           ReleaseRequest, TokenizedRequest)
from wire.sampling import SamplingParams
from wire.server_args import ServerArgs

VOCAB, CONTEXT, EOS = 50, 128, 0


@dataclass
class FakeConfig:
    vocab_size: int = VOCAB
    eos_token_ids: list[int] = field(default_factory=lambda: [EOS])


def token_after(seq_len: int) -> int:
    """FakeRunner's model: the token sampled after seq_len known tokens (never EOS)."""
    return 1 + seq_len % (VOCAB - 1)


class RunnerCheckFailed(BaseException):
    """A FakeRunner check failed: a BaseException, so that the scheduler's fault isolation
    (which ends a step's requests on an Exception from the forward) lets it through."""


class FakeRunner:
    """ModelRunner's surface without a model: token = token_after(seq_len). It checks what
    the real runner relies on: decode segments first, each position's slot in the request
    table, no slot written twice in a step, and that every position a segment attends holds
    KV computed for the same tokens (`kv`: slot -> a hash of the tokens up to it; a failed
    forward leaves its slots' KV unknown). Logprobs (all 0.0) are added where the real
    runner adds them. `fail(segments)` may raise (a failed forward) or return
    {rid: exception} (failed sampling rows). A segment with drafts (speculative decoding)
    is verified as the real runner does: row i's token is token_after(seq_len + i), and
    the drafts are kept up to the first that differs from its row's token, or a stop
    token; its KV positions hash its drafts."""

    device = "cpu"
    context_len = CONTEXT

    def __init__(self):
        self.config = FakeConfig()
        self.fail = lambda segments: {}
        self.steps: list[list[Segment]] = []
        self.kv: dict[int, int | None] = {}
        self.hashes: dict[str, tuple[object, list[int]]] = {}   # rid -> (req, its hashes)

    def prefix_hashes(self, req, end: int) -> list[int]:
        """hashes[p]: a hash of req's tokens 0..p (what position p's KV depends on)."""
        known, hashes = self.hashes.get(req.rid, (None, []))
        if known is not req:
            hashes = []
            self.hashes[req.rid] = (req, hashes)
        h = hashes[-1] if hashes else 0
        for token in req.token_ids(len(hashes), end):
            h = hash((h, token))
            hashes.append(h)
        return hashes

    def forward(self, segments, req_to_token):
        try:
            return self._forward(segments, req_to_token)
        except AssertionError as e:      # not a model failure for the scheduler to survive
            raise RunnerCheckFailed(str(e)) from e

    def _forward(self, segments, req_to_token):
        self.steps.append(segments)
        prefills = [not s.decodes for s in segments]
        assert prefills == sorted(prefills), "decode rows must come first"
        table, written = req_to_token.tolist(), []
        for seg in segments:
            req, start, end = seg.req, seg.start, seg.start + seg.length
            assert start == req.num_computed - seg.length and seg.length > 0
            assert table[req.row][:end] == req.slots[:end], f"{req.rid}: its table row"
            assert not seg.draft or (seg.sample and end - len(seg.draft) == req.seq_len), \
                f"{req.rid}: drafts must follow its newest token"
            hashes = list(self.prefix_hashes(req, end - len(seg.draft)))
            for token in seg.draft:
                hashes.append(hash((hashes[-1], token)))
            kv = [self.kv.get(slot) for slot in req.slots[:start]]
            assert kv == hashes[:start], f"{req.rid}: the KV of its first {start} positions"
            self.kv.update(zip(req.slots[start:end], hashes[start:end]))
            written += req.slots[start:end]
        assert len(set(written)) == len(written), "a slot written twice in one step"
        try:
            failed = self.fail(segments)
        except AssertionError:
            raise
        except Exception:
            for slot in written:
                self.kv[slot] = None
            raise
        for seg in segments:        # logprobs as the real runner adds them, all 0.0
            req = seg.req
            lo, hi = req.input_logprob_positions(seg.start, seg.start + seg.length)
            if lo < hi:
                req.input_logprobs.extend(zero_logprobs(req.token_ids(lo + 1, hi + 1)))
        out = [failed.get(s.req.rid, self.verify(s) if s.draft else token_after(s.req.seq_len))
               for s in segments if s.sample]
        for seg, token in zip([s for s in segments if s.sample], out):
            if seg.req.logprob is not None and not isinstance(token, Exception):
                seg.req.pending_logprobs = zero_logprobs(
                    token if isinstance(token, list) else [token])
        return out

    def verify(self, seg) -> list[int]:
        req, kept = seg.req, []
        stops = set(req.sampling.stop_token_ids) | (set() if req.sampling.ignore_eos else {EOS})
        for i in range(len(seg.draft) + 1):
            kept.append(token_after(req.seq_len + i))
            if i == len(seg.draft) or kept[-1] != seg.draft[i] or kept[-1] in stops:
                break
        return kept


def zero_logprobs(ids: list[int]) -> Logprobs:
    return Logprobs(token_ids=list(ids), logprobs=[0.0] * len(ids),
                    top_ids=[[] for _ in ids], top_logprobs=[[] for _ in ids])


class FakeMatcher:
    """A grammar that is complete after `length` tokens, whatever they are. `sync` (called
    on retraction) checks that it was fed exactly the request's output ids."""

    error = ""

    def __init__(self, length: int):
        self.length = length
        self.tokens: list[int] = []

    def consume(self, token: int) -> bool:
        self.tokens.append(token)
        return True

    @property
    def stopped(self) -> bool:
        return len(self.tokens) >= self.length

    def valid_prefix(self, tokens: list[int]) -> int:
        return min(len(tokens), max(0, self.length - len(self.tokens)))

    def sync(self, output_ids: list[int]) -> None:
        if self.tokens != output_ids:
            raise RunnerCheckFailed(f"matcher fed {self.tokens}, outputs {output_ids}")


class FakeGrammars:
    """GrammarCompiler's surface for the scheduler. A key ("regex", "stop:N") compiles to a
    FakeMatcher(N); ("regex", "bad...") fails with a GrammarError. Futures are cached by key
    and stay pending until `resolve` (every pending one, or those `pick(key)` chooses)."""

    def __init__(self):
        self.cache: dict[tuple[str, str], Future] = {}
        self.pending: list[tuple[tuple[str, str], Future]] = []

    def compile(self, key: tuple[str, str]) -> Future:
        if key not in self.cache:
            self.cache[key] = Future()
            self.pending.append((key, self.cache[key]))
        return self.cache[key]

    def resolve(self, pick=lambda key: True) -> None:
        for key, fut in list(self.pending):
            if pick(key):
                self.pending.remove((key, fut))
                if key[1].startswith("bad"):
                    fut.set_exception(GrammarError(f"The regex does not compile: {key[1]}"))
                else:
                    fut.set_result(int(key[1].split(":")[1]))

    def matcher(self, fut: Future) -> FakeMatcher:
        return FakeMatcher(fut.result())


def make(pool: int = 400, max_running: int = 8, grammars=None,
         **flags) -> tuple[Scheduler, list, list]:
    """grammars: a FakeGrammars by default (s.grammars)."""
    flags.setdefault("chunked_prefill_size", 64)
    args = ServerArgs(max_running_requests=max_running, **flags)
    kv = KVManager(pool_size=pool, max_running=max_running, context_len=CONTEXT,
                   device="cpu", use_cache=not args.disable_radix_cache)
    batches, replies = [], []
    return Scheduler(args, FakeRunner(), kv, batches.append, replies.append,
                     grammars=grammars or FakeGrammars()), batches, replies


def request(rid: str, ids=(1, 2, 3), **sampling) -> TokenizedRequest:
    sampling.setdefault("max_new_tokens", 4)
    return TokenizedRequest(rid=rid, input_ids=list(ids), sampling=SamplingParams(**sampling))


def finishes(batches) -> dict:
    return {o.rid: o.finish for b in batches for o in b.outputs if o.finish is not None}


def run_until_idle(s: Scheduler, msgs=(), steps: int = 500) -> None:
    s.step(list(msgs))
    for _ in range(steps):
        if s.idle:
            return
        s.step([])
    raise AssertionError("the scheduler did not become idle")


def assert_pool_idle(s: Scheduler) -> None:
    """Idle: free + evictable == total, every table row free, nothing locked."""
    pool, rows = s.kv.pool, s.kv.req_to_token
    assert not s.in_flight and not s.running and not s.waiting
    assert pool.num_free + s.kv.evictable == pool.size
    assert rows.num_free == rows.size
    s.kv.check([])
    if s.kv.cache is not None:
        s.kv.cache.check()


def outputs(batches, rid: str) -> list:
    return [o for b in batches for o in b.outputs if o.rid == rid]


def ids_of(batches, rid: str) -> list[int]:
    return [t for o in outputs(batches, rid) for t in o.new_ids]


def expected_ids(prompt_len: int, n: int) -> list[int]:
    return [token_after(prompt_len + i) for i in range(n)]


# ---- validation of what arrives ---------------------------------------------------------

FORGED = [
    (request("r", [1, 10 ** 6]), "Token id 1000000 in input_ids is outside the vocabulary"),
    (request("r", [-1, 2]), "Token id -1 in input_ids is outside the vocabulary"),
    (request("r", []), "The input is empty."),
    (request("r", [1] * CONTEXT), f"longer than the model's context length ({CONTEXT}"),
    (request("r", [1] * 100, max_new_tokens=28), "exceeds the model's maximum context length"),
    (request("r", top_p=1e-300), "top_p must be at least"),
    (request("r", temperature=float("nan")), "temperature must be a non-negative finite"),
    (request("r", temperature=1e39), "temperature must be at most"),
    (request("r", repetition_penalty=1e-300), "repetition_penalty must be at least"),
    (request("r", max_new_tokens=-1), "max_new_tokens must be at least 0"),
    (request("r", min_new_tokens=9), "min_new_tokens must be in"),
    (request("r", stop_token_ids=[VOCAB]), "stop_token_ids contains 50, outside the vocab"),
    (request("r", logit_bias={"50": 1.0}), "logit_bias must has keys in [0, 49]"),
    (request("r", logit_bias={"one": 1.0}), "logit_bias keys must be token ids"),
    (request("r", stop=[""]), "must not contain an empty string"),
    (request("r", sampling_seed=2 ** 64), "sampling_seed must fit in 64 bits"),
]


@pytest.mark.parametrize("msg, fragment", FORGED, ids=[f for _, f in FORGED])
def test_forged_request_is_answered_400_and_dropped(msg, fragment):
    s, batches, _ = make()
    s.step([msg])
    [out] = [o for b in batches for o in b.outputs]
    assert out.rid == "r" and out.new_ids == [] and out.decode is not None
    assert out.finish.type == "abort" and out.finish.status_code == 400
    assert fragment in out.finish.message
    assert s.rejected_total == 1 and s.idle and not s.runner.steps
    run_until_idle(s, [request("next")])               # and the next request is served
    assert finishes(batches)["next"].type == "length"
    assert_pool_idle(s)


@pytest.mark.parametrize("logprob, fragment", [
    (LogprobRequest(top_logprobs_num=21), "top_logprobs_num must be in [0, 20], got 21."),
    (LogprobRequest(top_logprobs_num=-1), "top_logprobs_num must be in [0, 20], got -1."),
    (LogprobRequest(start_len=-2), "logprob_start_len must be at least -1, got -2."),
])
def test_forged_logprob_request_is_400(logprob, fragment):
    s, batches, _ = make()
    msg = request("r")
    msg.logprob = logprob
    s.step([msg])
    assert finishes(batches)["r"].message == fragment
    assert finishes(batches)["r"].status_code == 400


def test_duplicate_and_empty_rids_are_dropped_without_touching_the_running_one():
    s, batches, _ = make()
    s.step([request("a", max_new_tokens=6, ignore_eos=True)])
    s.step([request("a", [9, 9]), request("")])
    assert s.rejected_total == 2
    assert all(o.rid == "a" and o.finish is None for b in batches for o in b.outputs)
    run_until_idle(s)
    assert finishes(batches) == {"a": finishes(batches)["a"]}
    assert finishes(batches)["a"].type == "length"
    assert_pool_idle(s)


def test_odd_control_messages_are_harmless():
    s, batches, replies = make()
    s.step([AbortRequest(rid="nobody"), AbortRequest(rid="", abort_all=True),
            ReleaseRequest(rids=["x", "x", ""]), FlushCacheRequest(req_id="")])
    assert replies[-1].ok and s.idle and not batches
    s.step([request("a", max_new_tokens=20), request("b", max_new_tokens=20)])
    s.step([ReleaseRequest(rids=["a", "a", "zzz"]), FlushCacheRequest(req_id="f"),
            AbortRequest(rid="b", message="")])
    assert not replies[-1].ok                           # busy: refused, not crashed
    assert finishes(batches)["a"].message == "Released by the detokenizer."
    assert finishes(batches)["b"].type == "abort"
    assert_pool_idle(s)


def test_early_aborts_are_bounded(monkeypatch):
    monkeypatch.setattr("scheduler_proc.scheduler.MAX_EARLY_ABORTS", 100)
    s, _, _ = make()
    s.step([AbortRequest(rid=f"ghost-{i}") for i in range(1000)])
    assert len(s.early_aborts) == 100 and "ghost-999" in s.early_aborts
    s.step([request("ghost-999")])                      # the abort still overtakes it
    assert s.idle


# ---- fault isolation ----------------------------------------------------------------------

def test_failed_forward_ends_the_steps_requests_and_caches_nothing_it_wrote():
    s, batches, _ = make()
    run_until_idle(s, [request("warm", [1, 2, 3, 4, 5], max_new_tokens=3)])
    cached = s.kv.evictable                             # 5 prompt + 2 decoded positions
    assert cached == 7

    def boom(segments):
        if any(seg.req.rid == "bad" for seg in segments):
            raise RuntimeError("simulated kernel failure")
        return {}
    s.runner.fail = boom
    # "bad" shares the cached prefix; its new positions 5..9 are written by the failed step.
    s.step([request("bad", [1, 2, 3, 4, 5, 11, 12, 13, 14, 15], max_new_tokens=3)])
    out = finishes(batches)["bad"]
    assert out.type == "abort" and out.status_code == 500
    assert "simulated kernel failure" in out.message
    assert_pool_idle(s)
    assert s.kv.evictable == cached                     # nothing of the failed step cached
    ids, _ = s.kv.cache.match_prefix([1, 2, 3, 4, 5, 11, 12, 13])
    assert len(ids) == 5
    s.runner.fail = lambda segments: {}
    run_until_idle(s, [request("after", [1, 2, 3, 4, 5, 11], max_new_tokens=5)])
    assert finishes(batches)["after"].type == "length"
    assert_pool_idle(s)


def test_failed_forward_mid_decode_keeps_what_earlier_steps_computed():
    s, batches, _ = make()
    calls = []

    def fail_third(segments):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("simulated")
        return {}
    s.runner.fail = fail_third
    run_until_idle(s, [request("a", [1, 2, 3, 4], max_new_tokens=10),
                       request("b", [7, 8, 9], max_new_tokens=10)])
    f = finishes(batches)
    assert f["a"].status_code == 500 and f["b"].status_code == 500
    # Steps 1-2 computed the prompts and one decoded position each; step 3's were dropped.
    assert s.kv.evictable == (4 + 1) + (3 + 1)
    assert_pool_idle(s)


def test_a_failed_sampling_row_ends_only_its_request():
    s, batches, _ = make()
    s.runner.fail = lambda segments: {"bad": ValueError("simulated sampling failure")}
    run_until_idle(s, [request("good", max_new_tokens=5), request("bad", max_new_tokens=5)])
    f = finishes(batches)
    assert f["good"].type == "length"
    assert f["bad"].status_code == 500 and "simulated sampling failure" in f["bad"].message
    assert s.generated_tokens_total == 5
    assert_pool_idle(s)


def test_a_cuda_error_takes_the_process_down():
    s, _, _ = make()

    def sticky(segments):
        raise RuntimeError("CUDA error: device-side assert triggered")
    s.runner.fail = sticky
    with pytest.raises(RuntimeError, match="CUDA error"):
        s.step([request("a")])


@dataclass
class Row:
    rid: str
    sampling: SamplingParams
    output_ids: list = field(default_factory=list)
    generator: torch.Generator | None = None
    logprob: LogprobRequest | None = None
    pending_logprobs: object = None


def test_sample_isolated_retries_row_by_row(monkeypatch):
    real = runner_mod.sample_tokens

    def flaky(logits, reqs, eos_ids):
        if any(r.rid == "bad" for r in reqs):
            raise RuntimeError("simulated")
        return real(logits, reqs, eos_ids)
    monkeypatch.setattr(runner_mod, "sample_tokens", flaky)
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    seeded = SamplingParams(temperature=1.0)
    alone = real(logits[2:], [Row("s", seeded, generator=seeded_generator(5, "cpu"))], [])
    rows = [Row("g", SamplingParams(temperature=0), logprob=LogprobRequest(top_logprobs_num=2)),
            Row("bad", SamplingParams()), Row("s", seeded, generator=seeded_generator(5, "cpu"))]
    out = sample_isolated(logits, rows, [])
    assert out[0] == logits[0].argmax().item() and rows[0].pending_logprobs is not None
    assert isinstance(out[1], RuntimeError)
    assert out[2] == alone[0]                   # the seeded row draws as it would alone


# ---- overcommit and retraction, held outputs, aborts and releases ---------------------------

def test_overcommitted_requests_are_retracted_and_still_finish_correctly():
    # Each needs 3 + 29 = 32 slots: 64 > 50, but admission reserves only 70% of what they
    # may still generate, so both run until the pool is full; then the newer is retracted.
    s, batches, _ = make(pool=50, max_running=2)
    s.step([request("a", [1, 2, 3], max_new_tokens=30, ignore_eos=True),
            request("b", [4, 5, 6], max_new_tokens=30, ignore_eos=True)])
    assert [r.rid for r in s.running] == ["a", "b"]              # overcommitted
    while s.retracted_total == 0:
        s.step([])
        s.kv.check(s.running)
    assert [r.rid for r in s.running] == ["a"] and [r.rid for r in s.waiting] == ["b"]
    b = s.waiting[0]
    assert b.row is None and not b.slots and b.output_ids       # holds nothing, keeps outputs
    run_until_idle(s)
    f = finishes(batches)
    assert f["a"].type == f["b"].type == "length" and s.retracted_total == 1
    for rid, prompt in (("a", 3), ("b", 3)):
        outs = outputs(batches, rid)
        assert ids_of(batches, rid) == expected_ids(prompt, 30)  # nothing lost or repeated
        assert outs[0].decode is not None and all(o.decode is None for o in outs[1:])
        assert [o.finish is not None for o in outs] == [False] * (len(outs) - 1) + [True]
    assert s.generated_tokens_total == 60
    assert_pool_idle(s)


def test_a_retracted_request_resumes_from_its_cached_kv():
    s, batches, _ = make()
    s.step([request("a", [1, 2, 3], max_new_tokens=30, ignore_eos=True),
            request("b", list(range(4, 24)), max_new_tokens=12, ignore_eos=True)])
    for _ in range(4):
        s.step([])
    b = s.running[-1]
    computed = b.num_computed
    s.retract(b)                                      # as make_room does
    assert s.kv.evictable == computed and b.row is None
    s.step([])
    # Re-admitted at once (the pool is large) with its own positions from the cache: only
    # its newest token is computed.
    [seg] = [seg for seg in s.runner.steps[-1] if seg.req is b]
    assert (seg.start, seg.length, b.prefix_len) == (computed, 1, computed)
    run_until_idle(s)
    assert ids_of(batches, "b") == expected_ids(20, 12)
    assert all(o.cached_tokens == 0 for o in outputs(batches, "b"))   # its first admission
    assert_pool_idle(s)


def test_a_request_that_fits_only_without_the_cache_evicts_it():
    s, batches, _ = make(pool=40, max_running=4)
    run_until_idle(s, [request("warm", list(range(1, 31)), max_new_tokens=5)])
    assert s.kv.evictable == 34
    run_until_idle(s, [request("big", list(range(31, 41)) * 3, max_new_tokens=11)])
    assert finishes(batches)["big"].type == "length"
    assert ids_of(batches, "big") == expected_ids(30, 11)
    assert_pool_idle(s)


def _streamed(msg: TokenizedRequest) -> TokenizedRequest:
    msg.stream = True
    return msg


def test_held_outputs_of_a_request_nobody_watches():
    s, batches, _ = make()
    run_until_idle(s, [request("quiet", max_new_tokens=120, ignore_eos=True),
                       _streamed(request("loud", max_new_tokens=5, ignore_eos=True)),
                       request("stops", max_new_tokens=5, ignore_eos=True, stop=["x"])])
    assert [len(o.new_ids) for o in outputs(batches, "quiet")] == [1, 50, 50, 19]
    assert [len(o.new_ids) for o in outputs(batches, "loud")] == [0] + [1] * 5  # admission
    assert [len(o.new_ids) for o in outputs(batches, "stops")] == [1] * 5
    assert ids_of(batches, "quiet") == expected_ids(3, 120)
    assert_pool_idle(s)


def test_a_streamed_request_is_admitted_before_its_first_token():
    """The admission (scheduler.admit): an output with no ids, no finish, no queue time and
    the DecodeParams, sent once the request passed every check; the outputs after it carry
    no DecodeParams. Unary requests get none."""
    s, batches, _ = make()
    run_until_idle(s, [_streamed(request("s", max_new_tokens=3, ignore_eos=True)),
                       request("u", max_new_tokens=3, ignore_eos=True)])
    first, *rest = outputs(batches, "s")
    assert first.new_ids == [] and first.finish is None and first.queue_time is None
    assert first.decode is not None and all(o.decode is None for o in rest)
    assert all(o.queue_time is not None for o in rest) and rest[-1].finish is not None
    u = outputs(batches, "u")
    assert u[0].new_ids and u[0].decode is not None


def test_no_admission_for_a_stream_refused_at_the_queue_limit():
    s, batches, _ = make(max_running=1, max_queued_requests=1)
    run_until_idle(s, [_streamed(request(f"q{i}", max_new_tokens=2, ignore_eos=True))
                       for i in range(4)])
    refused = [rid for rid in ("q0", "q1", "q2", "q3")
               if outputs(batches, rid)[-1].finish.status_code == 503]
    assert refused
    for rid in refused:
        [only] = outputs(batches, rid)                # the 503 alone: no admission before it
        assert only.decode is not None


def test_held_outputs_go_out_with_an_abort_or_a_release():
    s, batches, _ = make()
    s.step([request("a", max_new_tokens=100, ignore_eos=True),
            request("b", [4, 5], max_new_tokens=100, ignore_eos=True)])
    for _ in range(9):
        s.step([])
    assert len(ids_of(batches, "a")) == 1 and len(s.in_flight["a"].held_ids) == 9
    s.step([AbortRequest(rid="a"), ReleaseRequest(rids=["b"])])
    f = finishes(batches)
    assert f["a"].type == "abort" and f["a"].message == "Aborted by the client."
    assert f["b"].type == "abort" and f["b"].message == "Released by the detokenizer."
    assert ids_of(batches, "a") == expected_ids(3, 10)
    assert ids_of(batches, "b") == expected_ids(2, 10)
    assert s.kv.evictable == (3 + 9) + (2 + 9)                 # their KV is cached
    assert_pool_idle(s)


def test_aborts_of_running_queued_and_not_yet_arrived_requests():
    s, batches, _ = make(max_running=1)
    s.step([AbortRequest(rid="early"), request("run", max_new_tokens=50),
            request("queued", max_new_tokens=50), request("early"), request("last")])
    f = finishes(batches)
    assert f["early"].type == "abort" and "early" not in s.in_flight
    assert [r.rid for r in s.running] == ["run"]
    s.step([AbortRequest(rid="queued", message="bye")])
    out = outputs(batches, "queued")
    assert len(out) == 1 and out[0].finish.message == "bye" and out[0].new_ids == []
    assert out[0].decode is not None and out[0].queue_time is None
    s.step([AbortRequest(rid="", abort_all=True)])
    f = finishes(batches)
    assert f["run"].type == f["last"].type == "abort" and s.idle
    s.step([AbortRequest(rid="run"), ReleaseRequest(rids=["queued", "early"])])
    assert sum(o.finish is not None for b in batches for o in b.outputs) == 4
    assert_pool_idle(s)


def test_release_of_a_queued_request():
    s, batches, _ = make(max_running=1)
    s.step([request("a", max_new_tokens=10), request("b", max_new_tokens=10)])
    s.step([ReleaseRequest(rids=["b", "b"])])
    [out] = outputs(batches, "b")
    assert out.finish.message == "Released by the detokenizer." and out.new_ids == []
    assert [r.rid for r in s.running] == ["a"] and not s.waiting
    run_until_idle(s)
    assert finishes(batches)["a"].type == "length"
    assert_pool_idle(s)


@pytest.mark.parametrize("start_len", [0, 20])
def test_a_request_retracted_before_its_first_output_scores_its_prompt_once(start_len):
    s, batches, _ = make(chunked_prefill_size=8)
    msg = request("lp", list(range(1, 41)), max_new_tokens=3)
    msg.logprob = LogprobRequest(start_len=start_len)
    s.step([msg])
    s.step([])
    req = s.running[0]
    assert req.num_computed == 16 and not req.announced
    s.retract(req)                                    # as make_room does
    assert s.kv.evictable == 16
    run_until_idle(s)
    first = outputs(batches, "lp")[0]
    assert first.input_logprobs.token_ids == list(range(1, 41))[start_len:]
    # Re-admitted with the cached positions whose logits are not needed (none for 0).
    assert req.cached_tokens == 0 and ids_of(batches, "lp") == expected_ids(40, 3)
    [resumed] = [seg for seg in s.runner.steps[2] if seg.req is req]
    assert resumed.start == min(16, max(start_len - 1, 0))
    assert_pool_idle(s)


# ---- fitting to the pool, the queue limit ---------------------------------------------------

def test_fit_context_lowers_max_new_tokens_to_the_pool():
    s, batches, _ = make(pool=60)
    fit = request("fit", [1] * 30, max_new_tokens=97, min_new_tokens=90, ignore_eos=True)
    fit.fit_context = True
    run_until_idle(s, [fit, request("strict", [1] * 30, max_new_tokens=97)])
    f = finishes(batches)
    assert f["fit"].type == "length" and f["fit"].length == 31    # 30 + 31 - 1 == 60
    assert f["strict"].status_code == 400 and "KV slots" in f["strict"].message
    too_long = request("long", [1] * 61, max_new_tokens=10)
    too_long.fit_context = True
    run_until_idle(s, [too_long])
    assert finishes(batches)["long"].status_code == 400
    assert_pool_idle(s)


def test_queue_limit_ends_new_arrivals_beyond_it_with_503():
    s, batches, _ = make(max_running=1, max_queued_requests=2)
    s.step([request(f"r{i}", max_new_tokens=3) for i in range(6)])
    f = finishes(batches)
    assert sorted(f) == ["r3", "r4", "r5"]               # r0 runs, r1 and r2 wait
    assert all(x.status_code == 503 and x.message.startswith("The request queue is full")
               for x in f.values())
    assert len(s.waiting) == 2
    run_until_idle(s)
    assert all(finishes(batches)[f"r{i}"].type == "length" for i in range(3))
    assert_pool_idle(s)


def test_retracted_requests_are_never_dropped_by_the_queue_limit():
    s, batches, _ = make(pool=40, max_running=2, max_queued_requests=1)
    s.step([request("a", max_new_tokens=20, ignore_eos=True),
            request("b", max_new_tokens=20, ignore_eos=True)])
    assert len(s.running) == 2
    s.retract(s.running[-1])          # as make_room does; the raised estimate keeps it out
    s.step([request("c"), request("d")])
    f = finishes(batches)
    assert "b" not in f and f["c"].status_code == 503 and f["d"].status_code == 503
    assert [r.rid for r in s.waiting] == ["b"]
    run_until_idle(s)
    assert finishes(batches)["b"].type == "length"
    assert_pool_idle(s)


# ---- the watchdog's timer (the e2e test in test_scheduler_faults.py sees it fire) -----------

def test_watchdog_rearms_at_most_every_interval_and_pauses_idle(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])
    armed = []
    monkeypatch.setattr(process.faulthandler, "dump_traceback_later",
                        lambda timeout, **kw: armed.append((timeout, kw["exit"])))
    monkeypatch.setattr(process.faulthandler, "cancel_dump_traceback_later",
                        lambda: armed.append("cancel"))
    w = process.Watchdog(5.0)
    w.pause()                                           # not armed: nothing to cancel
    w.progress()
    clock[0] += process.REARM_INTERVAL / 2
    w.progress()                                        # too soon to re-arm
    clock[0] += process.REARM_INTERVAL / 2
    w.progress()
    w.pause()
    w.pause()
    w.progress()
    timer = 5.0 + process.REARM_INTERVAL                # fires S..S+interval after a step
    assert armed == [(timer, True), (timer, True), "cancel", (timer, True)]


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")])
def test_watchdog_refuses_a_timeout_that_is_not_positive(timeout):
    with pytest.raises(ValueError, match="--watchdog-timeout must be positive"):
        process.Watchdog(timeout)


def test_watchdog_caps_what_faulthandler_cannot_hold():
    assert process.Watchdog(float("inf")).timer == process.LONGEST_TIMER
