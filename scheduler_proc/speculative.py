"""Speculative decoding: where draft tokens come from and how many a decoding request gets
(the scheduler's side), and the rule that keeps or drops them (the runner's side).

The step. A decoding request with k draft tokens d0..d(k-1) runs k+1 rows in one forward:
its last known token and the drafts, at positions p..p+k. They are decode rows of the
request's one table row, row i attending positions 0..p+i (each step's K/V is written
before any row attends: attention.py), so every kernel that runs decode rows runs them,
and the weights are read once for k+1 tokens. Only the rows' compute is extra.

The rule (`verify`, run by the runner on the rows' logits). Row i is sampled exactly as
the request's next token would be sampled after output_ids + d0..d(i-1): penalties,
min_new_tokens, the grammar's mask (the matcher advanced over the drafts, then rolled
back), top-k/p, its seeded generator. The first row whose token differs from its draft
ends the step; the tokens kept are the drafts accepted before it and its own token (the
bonus row's, k+1 tokens, when all are accepted). Each kept token is therefore drawn from
the model's distribution given exactly the tokens before it: the same ids as without
speculation at temperature 0, and the same distribution with sampling. For a draft that
is one token d rather than a distribution, this *is* the standard accept/resample rule:
accept d with probability p(d), else draw from p with d removed and renormalized; drawing
t ~ p and keeping t (accepted iff t == d) gives every token the same probability. A
seeded request draws its generator once per output token either way, so its tokens do not
depend on whether, or how much, it speculated.

The KV of a step's rejected positions is given back at once (KVManager.truncate): after
the step a request has computed exactly seq_len - 1 positions, as after a plain decode.

Drafts (`Proposer`): `NgramProposer` (prompt lookup: the longest suffix of the request's
tokens, max_n down to min_n long, that occurred before, in its own tokens or in a finished
request's; the tokens that followed its last occurrence). A proposer is a `Proposer`:
`propose(req, k) -> list[int]`, told when a request finished; a draft model or an
EAGLE-style head can be one.

How many (`Speculator.draft_len`). A request's per-token acceptance `a` is measured (a
decayed count of drafts accepted over drafts tried, each step contributing its accepted
run and, when it stopped early, one rejection), so its j-th draft is kept with chance
about a^j. A step of R rows costs cost(R) one-row steps (`step_cost`: on the CPU the
weights are read once per tile of 8, 4, 2 or 1 rows, blocks.c and linear.c, so 2 rows
cost 1.1 and 3 rows 2.1, measured: models/quant_linear.py's cpu_step_cost; on CUDA rows
are nearly free until compute-bound). Each
request in turn gets the k that makes the step's expected tokens per unit of cost
largest, (tokens + a + ... + a^k) / (cost(rows + k) + k draft_cost) (a draft model's
forwards: draft_cost each), if that beats no drafts by MARGIN:
alone with a = 0.6 that is 3 drafts (4 rows, one tile); with a = 0.3, 1; at 32 rows none
(an extra tile of weights for a few expected tokens). A request that drafts nothing has
its estimate drift back toward the prior (EXPLORE a step) so that it tries again later.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from models.quant_linear import cpu_step_cost
from wire.messages import SpecStats

PRIOR = 0.6             # per-token acceptance assumed before a request has been measured
PRIOR_WEIGHT = 2.0      # ... worth this many drafts
DECAY = 0.8             # per verify step: older steps weigh less (~5 steps of memory)
EXPLORE = 0.05          # per step without drafts: the estimate moves this far to the prior
MARGIN = 0.02           # drafts must promise this much more output per unit of step cost
CUDA_ROW_COST = 0.05    # an extra row of a CUDA step (memory-bound: nearly free), a guess
INDEX_WINDOW = 8192      # a request's own tokens looked up: its newest this many
INDEX_STEP = 1024        # of them indexed in one step at most
STORE_TAIL = 1024        # a finished request's newest tokens kept for others' drafts
STORE_ENTRIES = 200_000  # n-grams kept for that (about 20 MB at 8-token spans)
# Replaces step_cost by 1 + c (R - 1) for the float c given, in [0, 1]: 0 makes every
# decoding request draft as many tokens as it can, whatever the batch and its acceptance
# (the tests' setting).
ROW_COST_ENV = "ZSERVE_SPEC_ROW_COST"


def linear_step_cost(row_cost: float):
    return lambda rows: 1.0 + row_cost * (rows - 1)


class Proposer:
    """Where drafts come from (the interface). `draft_cost`: what proposing one draft
    costs, in one-row steps of the served model (a draft model's forward; 0 for a lookup)."""

    draft_cost = 0.0

    def propose(self, req, k: int) -> list[int]:
        """Up to k tokens req may say next (fewer, or none, are fine)."""
        raise NotImplementedError

    def finished(self, req) -> None:
        """req ended (with output): what it said, for the proposer to learn from."""

    def flush(self) -> None:
        """Forget what finished requests said (/flush_cache)."""


class NgramProposer(Proposer):
    """Prompt lookup, in the request's own tokens and in what finished requests said. Each
    n-gram (min_n <= n <= max_n) of a request's tokens (prompt and output; `NgramIndex`,
    on Req.spec) maps to the position after its latest occurrence; each of a finished
    request's newest tokens (`NgramStore`, the server's) to the tokens that followed it. The
    longest match wins (the request's own on a tie): a request that repeats an earlier one
    (a retry, the next of n samples, an agent's turn re-sent) drafts that one's answer."""

    def __init__(self, min_n: int, max_n: int, span: int):
        self.min_n, self.max_n = min_n, max_n
        self.store = NgramStore(min_n, max_n, span)

    def propose(self, req, k: int) -> list[int]:
        index = req.spec.index
        if index is None:
            index = req.spec.index = NgramIndex(self.min_n, self.max_n)
        n, draft = index.match(req, k)
        if n < self.max_n:
            tail = req.token_ids(max(req.seq_len - self.max_n, 0), req.seq_len)
            theirs, cont = self.store.match(tail)
            if theirs > n:
                return list(cont[:k])
        return draft

    def finished(self, req) -> None:
        self.store.add(req.token_ids(max(req.seq_len - STORE_TAIL, 0), req.seq_len))

    def flush(self) -> None:
        self.store.seen.clear()


class NgramIndex:
    """One request's n-grams -> the position after their latest occurrence, indexed as
    tokens arrive (INDEX_STEP positions a step at most, so a long prompt costs no step
    much; from its newest INDEX_WINDOW tokens)."""

    __slots__ = ("maps", "done", "max_n")

    def __init__(self, min_n: int, max_n: int):
        self.maps = {n: {} for n in range(max_n, min_n - 1, -1)}   # longest first
        self.max_n = max_n
        self.done = 0                   # positions below this are indexed (or skipped)

    def match(self, req, k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens that followed the longest n-gram ending req's tokens), or
        (0, [])."""
        n_tokens = req.seq_len
        self.done = max(self.done, n_tokens - INDEX_WINDOW)
        if self.done < n_tokens:
            # The n-gram ending just before position t is followed by position t. The
            # newest token's own n-grams are indexed when a token follows it, so a lookup
            # never finds the suffix it is looking up.
            end = min(n_tokens, self.done + INDEX_STEP)
            lo = max(self.done - self.max_n, 0)
            tokens = req.token_ids(lo, end)
            for t in range(max(self.done, 1), end):
                for n, seen in self.maps.items():
                    if t - n >= lo:
                        seen[tuple(tokens[t - n - lo:t - lo])] = t
            self.done = end
        tail = req.token_ids(max(n_tokens - self.max_n, 0), n_tokens)
        for n, seen in self.maps.items():
            if len(tail) >= n and (p := seen.get(tuple(tail[len(tail) - n:]))) is not None:
                return n, req.token_ids(p, min(p + k, n_tokens))
        return 0, []


class NgramStore:
    """Finished requests' n-grams -> the up to `span` tokens that followed their latest
    occurrence; at most STORE_ENTRIES n-grams, the least recently written dropped first."""

    def __init__(self, min_n: int, max_n: int, span: int):
        self.sizes = range(max_n, min_n - 1, -1)
        self.span = span
        self.seen: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, tokens: list[int]) -> None:
        seen = self.seen
        for t in range(1, len(tokens)):
            cont = tuple(tokens[t:t + self.span])
            for n in self.sizes:
                if t >= n:
                    key = tuple(tokens[t - n:t])
                    seen[key] = cont
                    seen.move_to_end(key)
        while len(seen) > STORE_ENTRIES:
            seen.popitem(last=False)

    def match(self, tail: list[int]) -> tuple[int, tuple[int, ...]]:
        for n in self.sizes:
            if len(tail) >= n and (cont := self.seen.get(tuple(tail[len(tail) - n:]))):
                return n, cont
        return 0, ()


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its proposer's index, its measured acceptance and what
    it reports (meta_info: spec_verify_ct, spec_draft_tokens, spec_accepted_tokens)."""

    index: object | None = None
    accepted: float = PRIOR * PRIOR_WEIGHT      # decayed drafts accepted
    tried: float = PRIOR_WEIGHT                 # decayed drafts decided (accepted + rejections)
    verify_ct: int = 0
    drafted: int = 0
    accepted_total: int = 0
    draft_done: int = 0         # a draft model's K/V covers positions 0..draft_done-1

    @property
    def rate(self) -> float:
        return self.accepted / self.tried


@dataclass
class Speculator:
    """The scheduler's drafting policy and its counters (the server's totals)."""

    proposer: Proposer
    max_draft: int
    step_cost: Callable[[int], float]
    drafted_total: int = 0
    accept_lengths: list[int] = field(default_factory=list)   # [m]: verify steps keeping m
                                                               # tokens (index 0 unused)

    @classmethod
    def of(cls, args, device_type: str, proposer: Proposer | None = None
           ) -> "Speculator | None":
        """From the server's flags; None without --speculative-algorithm. proposer: the
        STANDALONE draft model (draft_model.py); NGRAM's is made here."""
        if args.speculative_algorithm is None:
            return None
        if proposer is None:
            proposer = NgramProposer(args.speculative_ngram_min_match_window_size,
                                     args.speculative_ngram_max_match_window_size,
                                     args.speculative_num_draft_tokens)
        cost = linear_step_cost(CUDA_ROW_COST) if device_type == "cuda" else cpu_step_cost
        if (given := os.environ.get(ROW_COST_ENV)) is not None:
            try:
                row_cost = float(given)
            except ValueError:
                row_cost = -1.0
            if not 0.0 <= row_cost <= 1.0:
                raise ValueError(f"{ROW_COST_ENV}={given!r}: give a number in [0, 1]")
            cost = linear_step_cost(row_cost)
        return cls(proposer, args.speculative_num_draft_tokens, cost,
                   accept_lengths=[0] * (args.speculative_num_draft_tokens + 2))

    def draft_len(self, req, rows: int, tokens: float, cap: int) -> int:
        """How many drafts req should get in a step that has `rows` rows and `tokens`
        expected tokens without them (module docstring), at most cap. A request that gets
        none has its acceptance estimate drift back toward the prior."""
        if req.spec is None:
            req.spec = SpecState()
        s = req.spec
        cap = min(cap, self.max_draft)
        if cap > 0 and self.step_cost(rows + cap) <= self.step_cost(rows):
            return cap                      # rows are free: draft all that can be had
        a = s.rate
        best_k, best, gain = 0, tokens / self.step_cost(rows), 0.0
        for k in range(1, cap + 1):
            gain += a ** k
            value = (tokens + gain) / (self.step_cost(rows + k) +
                                       k * self.proposer.draft_cost)
            if value > best * (1 + MARGIN) or (best_k and value > best):
                best_k, best = k, value
        if best_k == 0:
            s.accepted += EXPLORE * (PRIOR * s.tried - s.accepted)
        return best_k

    @staticmethod
    def expected(req, k: int) -> float:
        """The drafts of k that req is expected to keep."""
        a = req.spec.rate
        return sum(a ** j for j in range(1, k + 1))

    def propose(self, req, k: int) -> list[int]:
        """Up to k drafts for req (draft_len's k; their slots already given)."""
        return list(self.proposer.propose(req, k))[:k]

    @staticmethod
    def stats(req) -> SpecStats:
        """What req's outputs report (meta_info's spec_* fields, on its last)."""
        s = req.spec
        if s is None:                   # it never reached a decode step
            return SpecStats()
        return SpecStats(verify_ct=s.verify_ct, draft_tokens=s.drafted,
                         accepted_tokens=s.accepted_total)

    def finished(self, req) -> None:
        """req ended: what it said may be others' drafts."""
        if req.output_ids:
            self.proposer.finished(req)

    def flush(self) -> None:
        self.proposer.flush()

    def truncated(self, req, n: int) -> None:
        """req's positions n and after were given back (rejected or cut drafts)."""
        if req.spec is not None:
            req.spec.draft_done = min(req.spec.draft_done, n)

    @property
    def accepted_total(self) -> int:
        return sum((m - 1) * n for m, n in enumerate(self.accept_lengths) if m)

    def reset(self, req) -> None:
        """What req's proposer computed over its KV is unknown (it was retracted, or a
        proposal failed): a draft model starts it again from position 0."""
        if req.spec is not None:
            req.spec.draft_done = 0

    def record(self, req, drafted: int, accepted: int) -> None:
        """A verify step of req: `drafted` drafts, the first `accepted` of them kept."""
        s = req.spec
        s.accepted = s.accepted * DECAY + accepted
        s.tried = s.tried * DECAY + accepted + (accepted < drafted)
        s.verify_ct += 1
        s.drafted += drafted
        s.accepted_total += accepted
        self.drafted_total += drafted
        self.accept_lengths[min(accepted + 1, len(self.accept_lengths) - 1)] += 1


def accepted_run(draft: list[int], sampled: list[int]) -> int:
    """How many drafts the sampled rows accept: the length of the common prefix."""
    n = 0
    for d, t in zip(draft, sampled):
        if d != t:
            break
        n += 1
    return n
