"""Random traffic through the real Scheduler and KVManager, on test_scheduler_unit's
FakeRunner (which checks each step's KV: table rows, and that every attended position holds
KV computed for the same tokens).

Each seeded run picks a small KV pool, --max-running-requests, a prefill chunk, the radix
cache on or off and sometimes a queue limit, then sends random messages: arrivals (prompts
cut from a few shared bases, so the prefix cache matters, with random max_new_tokens, stop
ids, min_new_tokens, streaming, logprobs, fit_context, grammars; a few invalid or too big
for the pool; fewer while the queue is long), duplicate and empty rids, aborts of running, queued,
finished, unknown and not yet arrived rids, abort_all, releases, flushes, and injected
forward and sampling failures. Pools are small, so admission overcommits and requests are
retracted. A grammar (test_scheduler_unit's FakeGrammars: complete after N tokens, or one
that fails to compile) compiles over a random number of steps; its requests wait without KV
meanwhile.

After every step: the KV invariants (KVManager.check; the radix tree's own every 4th step
and when idle), every request not yet ended is in flight and nothing else is, a waiting
request holds no KV, each output continues its request's exact token sequence (the fake
model's tokens depend only on the position, so a retraction must neither lose nor repeat
one), its logprobs match its tokens and its prompt's are whole, and when idle
free + evictable == total with every table row free. Every accepted request gets exactly
one terminal output and nothing after it; one not aborted, released or failed ends by its
grammar, length or stop token exactly where it should, or with a 400 if its grammar does
not compile. Odd seeds speculate (speculative.py's Speculator, its adaptive length or
always the most, with `Guesser`'s drafts: each right with a per-run chance, some EOS): a
verify step keeps the drafts the fake model agrees with and gives back the rest's KV, so
the same checks hold. A failure names the seed; rerun one with -k "seed-N".
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field

import pytest

from scheduler_proc import scheduler as scheduler_mod
from scheduler_proc.speculative import (Proposer, Speculator, cpu_step_cost,
                                        linear_step_cost)
from test_scheduler_unit import CONTEXT, VOCAB, RunnerCheckFailed, make, token_after
from wire.messages import (AbortRequest, FlushCacheRequest, LogprobRequest, ReleaseRequest,
                           TokenizedRequest)
from wire.sampling import SamplingParams

SEEDS = range(12)
OPS_PER_SEED = 420          # messages sent per seeded run (12 x 420 = 5,040 in all)
DRAIN_STEPS = 5000          # an idle scheduler must be reached within this many steps
KINDS = ["arrive", "dup", "abort", "early", "abort_all", "release", "flush"]


@dataclass
class Expect:
    """What the test knows about one accepted rid."""

    prompt_len: int
    max_new: int                          # after fit_context
    min_new: int
    stop_ids: list[int]
    logprob: LogprobRequest | None
    input_ids: list[int]
    reject: bool = False                  # must end with a 400 before running
    grammar_len: int | None = None        # its grammar is complete after this many tokens
    bad_grammar: bool = False             # its grammar does not compile
    causes: set[str] = field(default_factory=set)   # "abort", "release", "early"
    ids: list[int] = field(default_factory=list)
    outputs: int = 0
    done: bool = False
    stream: bool = False
    admitted: bool = False                # its admission output came (streams only)

    def natural_end(self) -> tuple[str, int]:
        """("length" | "stop", tokens generated) as check_finished decides it."""
        for i in range(self.max_new):
            n = i + 1
            if n == self.grammar_len:         # the grammar wins over the length
                return "stop", n
            if n >= self.max_new:
                return "length", n
            if n > self.min_new and token_after(self.prompt_len + i) in self.stop_ids:
                return "stop", n
        return "length", 0


class Guesser(Proposer):
    """Drafts for the fake model: up to k tokens, each token_after (what the model will say)
    with probability `right`, else a random token (EOS among them)."""

    def __init__(self, rng: random.Random, right: float):
        self.rng, self.right = rng, right

    def propose(self, req, k: int) -> list[int]:
        return [token_after(req.seq_len + i) if self.rng.random() < self.right
                else self.rng.randrange(VOCAB) for i in range(self.rng.randint(0, k))]


class Run:
    def __init__(self, seed: int):
        self.seed = seed
        rng = self.rng = random.Random(seed)
        self.pool = rng.choice([32, 48, 64, 96, 160])
        self.max_running = rng.randint(1, 8)
        self.limit = rng.choice([None, None, None, rng.randint(1, 6)])
        self.backlog = rng.randint(1, 3 * self.max_running)   # most waiting before an arrival
        self.long = rng.choice([1, 4])           # weight of long generations (retractions)
        # Few aborts and releases in some runs, so requests live long enough to be retracted.
        self.weights = list(itertools.accumulate([60, 3, rng.choice([1, 4, 12]), 2, 0.25,
                                                  rng.choice([1, 3, 8]), 2]))
        self.s, self.batches, self.replies = make(
            pool=self.pool, max_running=self.max_running,
            chunked_prefill_size=rng.choice([4, 8, 16, 64]),
            disable_radix_cache=rng.random() < 0.2, max_queued_requests=self.limit)
        self.s.runner.fail = self.inject
        if seed % 2:
            most = rng.choice([2, 4, 8])
            self.s.spec = Speculator(Guesser(rng, rng.choice([0.5, 0.9, 1.0])), most,
                                     step_cost=rng.choice([cpu_step_cost,
                                                           linear_step_cost(0.0)]),
                                     accept_lengths=[0] * (most + 2))
        self.bases = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 60))]
                      for _ in range(rng.randint(1, 4))]
        self.expect: dict[str, Expect] = {}
        self.open: set[str] = set()             # rids sent, not ended yet
        self.early: set[str] = set()            # aborted before they arrive
        self.failed: set[str] = set()           # rids of failed forwards / sampling rows
        self.next_rid = 0
        self.ops = 0
        self.steps = 0
        self.flushes = 0
        self.ending: set[str] = set()
        self.ending_all = False
        self.stats = {"overcommitted": 0, "cached": 0, "503": 0, "stop": 0, "ended_early": 0,
                      "grammar_stop": 0, "grammar_400": 0}

    def fail(self, msg: str) -> None:
        raise AssertionError(f"seed {self.seed}: {msg}")

    # ---- messages -------------------------------------------------------------------------

    def inject(self, segments) -> dict:
        """The fake runner's faults: rarely a failed forward, now and then a failed row."""
        if self.rng.random() < 0.01:
            self.failed.update(seg.req.rid for seg in segments)
            raise RuntimeError("injected forward failure")
        bad = {seg.req.rid: ValueError("injected sampling failure")
               for seg in segments if seg.sample and self.rng.random() < 0.01}
        self.failed.update(bad)
        return bad

    def arrival(self) -> TokenizedRequest:
        rng = self.rng
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        base = rng.choice(self.bases)
        ids = base[:rng.randint(1, len(base))] + [rng.randrange(VOCAB)
                                                  for _ in range(rng.choice([0, 0, 1, 5, 15]))]
        max_new = rng.choice([0, 1, rng.randint(1, 10), rng.randint(1, 40)] +
                             [rng.randint(self.pool // 4, self.pool // 2)] * self.long)
        min_new = rng.randint(0, max_new) if rng.random() < 0.3 else 0
        stop_ids = [rng.randint(1, VOCAB - 1)] if rng.random() < 0.3 else []
        logprob = None
        if rng.random() < 0.15:
            logprob = LogprobRequest(top_logprobs_num=rng.randint(0, 2), start_len=rng.choice(
                [-1, 0, 1, rng.randint(0, len(ids) + 2)]))
        grammar = None
        if rng.random() < 0.2:              # FakeGrammars: "stop:N", or one that fails
            grammar = rng.choice([f"stop:{rng.randint(1, 12)}", "bad1", "bad2"])
        msg = TokenizedRequest(
            rid=rid, input_ids=ids, stream=rng.random() < 0.3, logprob=logprob,
            sampling=SamplingParams(max_new_tokens=max_new, min_new_tokens=min_new,
                                    stop_token_ids=stop_ids, ignore_eos=rng.random() < 0.5,
                                    stop=["x"] if rng.random() < 0.1 else [], regex=grammar),
            fit_context=rng.random() < 0.1)
        if rng.random() < 0.02:
            msg.input_ids = ids + [VOCAB]                      # forged: outside the vocab
        e = Expect(len(msg.input_ids), max_new, min_new, stop_ids, logprob=logprob,
                   input_ids=msg.input_ids, stream=msg.stream)
        room = self.pool - len(ids) + 1
        if msg.fit_context and len(ids) + max_new < CONTEXT and max_new > room >= 1:
            e.max_new, e.min_new = room, min(min_new, room)
        invalid = msg.input_ids[-1] == VOCAB or len(ids) + max_new >= CONTEXT
        too_big = len(ids) + max(e.max_new - 1, 0) > self.pool    # checked after an abort
        e.reject = invalid or (too_big and rid not in self.early)
        if grammar is not None:
            e.bad_grammar = grammar.startswith("bad")
            e.grammar_len = None if e.bad_grammar else int(grammar.split(":")[1])
        if rid in self.early:
            e.causes.add("early")
        self.expect[rid] = e
        self.open.add(rid)
        return msg

    def pending(self, rid: str) -> bool:
        return rid in self.open

    def pick(self, reqs) -> str:
        return self.rng.choice(reqs).rid if reqs else "nobody"

    def message(self):
        rng, s = self.rng, self.s
        kind = rng.choices(KINDS, cum_weights=self.weights)[0]
        while kind == "arrive" and len(s.waiting) > self.backlog:    # keep the queue short
            kind = rng.choices(KINDS, cum_weights=self.weights)[0]
        if kind == "arrive":
            return self.arrival()
        if kind == "dup":                    # a rid in flight, or an empty one: dropped
            rid = self.pick(s.running + list(s.waiting)) if rng.random() < 0.8 else ""
            if rid in self.ending or self.ending_all or rid == "nobody":
                rid = ""                     # (ended earlier in this step: it would run)
            return TokenizedRequest(rid=rid, input_ids=[1],
                                    sampling=SamplingParams(max_new_tokens=1))
        if kind == "early":                  # the abort overtakes its request
            rid = f"r{self.next_rid}"
            self.early.add(rid)
            return AbortRequest(rid=rid)
        if kind == "abort_all":              # this step's arrivals so far included
            for rid in self.open:
                self.expect[rid].causes.add("abort")
            self.ending_all = True
            return AbortRequest(rid="", abort_all=True)
        if kind == "flush":
            self.flushes += 1
            return FlushCacheRequest(req_id=f"f{self.flushes}")
        choices = [self.pick(s.running), self.pick(list(s.waiting)), self.pick(s.compiling),
                   f"ghost{rng.random()}",
                   f"r{rng.randrange(self.next_rid)}" if self.next_rid else "x"]
        if kind == "abort":
            rid = rng.choice(choices)
            if self.pending(rid):          # in flight, or arrived earlier in this step
                self.expect[rid].causes.add("abort")
                self.ending.add(rid)
            return AbortRequest(rid=rid, message=rng.choice(["Aborted by the client.", "bye"]))
        rids = [rng.choice(choices) for _ in range(rng.randint(1, 3))]
        for rid in rids:
            if self.pending(rid):          # in flight, or arrived earlier in this step
                self.expect[rid].causes.add("release")
                self.ending.add(rid)
        return ReleaseRequest(rids=rids)

    # ---- checks ----------------------------------------------------------------------------

    def step(self, msgs: list) -> None:
        s = self.s
        alone_flush = (len(msgs) == 1 and isinstance(msgs[0], FlushCacheRequest)
                       and s.idle)
        s.grammars.resolve(lambda key: self.rng.random() < 0.4)   # compiles end in time
        s.step(msgs)
        if len(self.batches) > 1:
            self.fail("more than one TokenBatch in a step")
        for batch in self.batches:
            for out in batch.outputs:
                self.check_output(out)
        flushes = [m.req_id for m in msgs if isinstance(m, FlushCacheRequest)]
        if [r.req_id for r in self.replies] != flushes:
            self.fail(f"flush replies {self.replies} for {flushes}")
        if alone_flush and not (self.replies[-1].ok and s.kv.pool.num_free == self.pool):
            self.fail("a flush of an idle scheduler did not empty the cache")
        self.check_state()
        self.batches.clear()                 # checked: keep the heap small
        self.replies.clear()
        s.runner.steps.clear()

    def check_output(self, out) -> None:
        e = self.expect.get(out.rid)
        if e is None or e.done:
            self.fail(f"output for {out.rid!r}, which is {'done' if e else 'unknown'}: {out}")
        if "early" in e.causes and (out.finish is None or out.finish.type != "abort"):
            self.fail(f"{out.rid} was aborted before it arrived but got {out}")
        if out.finish is None and out.queue_time is None and not out.new_ids:
            # The admission (scheduler.admit): a stream's first output, once it passed every
            # check; it carries the DecodeParams, and no logprobs.
            if not e.stream or e.admitted or e.outputs or out.decode is None or e.reject \
                    or out.logprobs is not None or out.input_logprobs is not None:
                self.fail(f"{out.rid}: an admission out of place: {out} ({e})")
            e.admitted = True
            return
        if (out.decode is not None) != (e.outputs == 0 and not e.admitted):
            self.fail(f"{out.rid}: DecodeParams on output {e.outputs}")
        if out.finish is not None and out.finish.status_code in (400, 503) and e.admitted \
                and not e.ids:
            self.fail(f"{out.rid}: admitted, then refused: {out.finish}")
        e.outputs += 1
        e.ids += out.new_ids
        want = [token_after(e.prompt_len + i) for i in range(len(e.ids))]
        if e.ids != want:
            self.fail(f"{out.rid}: tokens {e.ids}, expected {want}")
        if out.cached_tokens:
            self.stats["cached"] += 1
        self.check_logprobs(out, e)
        if out.finish is None:
            return
        e.done = True
        self.open.discard(out.rid)
        f, end = out.finish, e.natural_end()
        if e.reject:
            if not (f.type == "abort" and f.status_code == 400 and not e.ids):
                self.fail(f"{out.rid} should have been refused with a 400: {f}")
        elif e.bad_grammar and f.status_code == 400:
            if not (f.type == "abort" and "does not compile" in f.message and not e.ids):
                self.fail(f"{out.rid} has a grammar that does not compile, but ended {f}")
            self.stats["grammar_400"] += 1
        elif f.type != "abort":
            if e.bad_grammar:
                self.fail(f"{out.rid} ran with a grammar that does not compile: {f}")
            if (f.type, len(e.ids)) != end:
                self.fail(f"{out.rid} ended {f} after {len(e.ids)} tokens, expected {end}")
            if f.type == "length" and f.length != e.max_new:
                self.fail(f"{out.rid}: {f}, max_new_tokens {e.max_new}")
            self.stats["stop"] += f.type == "stop"
            self.stats["grammar_stop"] += f.type == "stop" and len(e.ids) == e.grammar_len
        else:
            self.stats["ended_early"] += 1
            if f.status_code == 500:
                ok = out.rid in self.failed
            elif f.status_code == 503:
                ok = self.limit is not None and not e.ids
                self.stats["503"] += 1
            elif f.message == "Released by the detokenizer.":
                ok = "release" in e.causes
            else:
                ok = f.status_code is None and bool(e.causes & {"abort", "early"})
            if not ok or len(e.ids) > end[1]:
                self.fail(f"{out.rid} ended {f} after {len(e.ids)} tokens without cause "
                          f"(causes {e.causes})")

    def check_logprobs(self, out, e: Expect) -> None:
        """The fake runner's logprobs: one per new id; the prompt's from start_len, whole
        once a token was sampled (a retraction before the first output starts them over,
        and the prefix cache must not skip a position whose logits are needed)."""
        lp = e.logprob
        if lp is None or not out.new_ids:
            got = None if out.logprobs is None else out.logprobs.token_ids
            if got is not None and got != out.new_ids:
                self.fail(f"{out.rid}: logprobs of {got} with new ids {out.new_ids}")
        elif out.logprobs is None or out.logprobs.token_ids != out.new_ids:
            self.fail(f"{out.rid}: logprobs {out.logprobs} for new ids {out.new_ids}")
        if e.outputs > 1:
            if out.input_logprobs is not None:
                self.fail(f"{out.rid}: input logprobs after the first output")
            return
        if e.reject:                # refused before it became a request: no logprobs
            return
        if lp is None or lp.start_len < 0:
            if out.input_logprobs is not None:
                self.fail(f"{out.rid}: input logprobs it did not ask for")
            return
        want, got = e.input_ids[lp.start_len:], out.input_logprobs.token_ids
        whole = out.new_ids or (out.finish is not None and out.finish.type == "length")
        if got != want[:len(got)] or (whole and got != want):
            self.fail(f"{out.rid}: input logprobs of {got}, expected {want} "
                      f"(from {lp.start_len})")

    def check_state(self) -> None:
        s, kv = self.s, self.s.kv
        self.steps += 1
        try:
            kv.check(s.running)
            if kv.cache is not None and (s.idle or self.steps % 4 == 0):
                kv.cache.check()             # the tree's structure: O(tree), not every step
        except RuntimeError as e:
            self.fail(str(e))
        if any(r.row is not None or r.slots or r.prefix_node is not None
               for r in [*s.waiting, *s.compiling]):
            self.fail("a waiting request holds KV")
        if any(r.grammar is None for r in [*s.waiting, *s.running] if r.sampling.grammar):
            self.fail("a constrained request left `compiling` without its matcher")
        pending = self.open
        queued = [r.rid for r in s.running] + [r.rid for r in s.waiting] + \
            [r.rid for r in s.compiling]
        if pending != set(s.in_flight) or sorted(queued) != sorted(pending):
            self.fail(f"requests not ended {sorted(pending)}, in flight "
                      f"{sorted(s.in_flight)}, running or waiting {sorted(queued)}")
        if len(s.running) > self.max_running:
            self.fail(f"{len(s.running)} running, limit {self.max_running}")
        if sum(r.max_total_tokens for r in s.running) > self.pool:
            self.stats["overcommitted"] += 1
        if s.idle and kv.pool.num_free + kv.evictable != kv.pool.size:
            self.fail(f"idle: {kv.pool.num_free} free + {kv.evictable} evictable != "
                      f"{kv.pool.size}")

    # ---- the run ---------------------------------------------------------------------------

    def go(self) -> None:
        rng = self.rng
        while self.ops < OPS_PER_SEED:
            self.ending, self.ending_all = set(), False    # rids this step's messages end
            msgs = [self.message() for _ in range(rng.choice([0, 1, 1, 2, 3, 5]))]
            self.ops += len(msgs)
            self.step(msgs)
            for _ in range(rng.choice([0, 0, 1, 2])):
                self.step([])
        for _ in range(DRAIN_STEPS):
            if self.s.idle:
                break
            self.step([])
        else:
            self.fail(f"not idle after {DRAIN_STEPS} steps")
        if self.open or any(not e.done for e in self.expect.values()):
            self.fail("a request never ended")
        s = self.s
        s.step([FlushCacheRequest(req_id="last")])
        if not self.replies[-1].ok or s.kv.pool.num_free != self.pool:
            self.fail("the final flush did not free the whole pool")


@pytest.fixture(scope="module")
def totals():
    """What all the seeds exercised together: checked after the last one."""
    return {"ops": 0, "retracted": 0, "requests": 0, "drafted": 0, "accepted": 0}


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed-{n}" for n in SEEDS])
def test_random_traffic_keeps_every_invariant(seed, totals, caplog, monkeypatch):
    # A step with only compiles pending blocks on them: the fakes end only between steps.
    monkeypatch.setattr(scheduler_mod, "GRAMMAR_WAIT", 0)
    # Thousands of expected warnings (forged requests, injected failures with tracebacks):
    # formatting them would take a third of the run.
    caplog.set_level(logging.CRITICAL, logger="scheduler_proc.scheduler")
    run = Run(seed)
    try:
        run.go()
    except AssertionError:
        raise
    except (Exception, RunnerCheckFailed) as e:   # the bookkeeping or the fake runner
        raise AssertionError(f"seed {seed}: {e!r}") from e
    totals["ops"] += run.ops
    totals["retracted"] += run.s.retracted_total
    totals["requests"] += len(run.expect)
    if run.s.spec is not None:
        totals["drafted"] += run.s.spec.drafted_total
        totals["accepted"] += run.s.spec.accepted_total
    for k, v in run.stats.items():
        totals[k] = totals.get(k, 0) + v
    print(f"seed {seed}: pool {run.pool}, max_running {run.max_running}, "
          f"{run.s.retracted_total} retracted, {run.stats}")


def test_the_random_runs_covered_what_they_are_for(totals):
    if totals["ops"] < OPS_PER_SEED * len(SEEDS):
        pytest.skip("run with every seed")
    assert totals["ops"] >= 5000, totals
    assert totals["retracted"] > 0 and totals["overcommitted"] > 0, totals
    assert totals["cached"] > 0 and totals["stop"] > 0 and totals["ended_early"] > 0, totals
    assert totals["grammar_stop"] > 0 and totals["grammar_400"] > 0, totals
    assert 0 < totals["accepted"] < totals["drafted"], totals     # drafts kept and dropped
