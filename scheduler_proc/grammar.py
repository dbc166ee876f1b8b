"""Constrained decoding in the scheduler: compiled grammars over the model's tokens, and the
sampler's masks. The grammars themselves (conversion, limits, the checker process) are the
shared package `grammars`, which the tokenizer uses too.

Where each part runs:
- the tokenizer worker checks a request's grammar first (grammars.checker, in a child
  process), so a bad one is a 400 before the request is queued.
- `GrammarCompiler.compile(key)`: the scheduler. A grammar not in its cache is checked again
  in the scheduler's own checker process (anyone who can reach the scheduler's socket can
  forge a request, so nothing the tokenizer said is trusted), then its matcher is built over
  the vocabulary (lexer, token trie) on a thread of grammars.llg.COMPILE_STACK bytes, off
  the scheduler's loop (llguidance drops the GIL while it builds), and its first mask is
  computed so that a grammar past llguidance's own limits is a 400 before the request is
  queued. Compiled grammars are cached by their text, LRU-bounded (a failed compile is
  cached too). Compile threads run at a lower OS priority (COMPILE_NICE): a big grammar
  takes the CPU the model's steps leave, not theirs. The request waits, holding no KV,
  until its future is done (scheduler.py `compiling`); each request then gets its own copy
  of the compiled matcher (`matcher`, a deep copy: microseconds).
- `fill_bitmask(matchers)`: the sampler, every step (runner.py `_sample` via
  sampler.constrain): one bit per token, 1 where the grammar allows it. Only rank 0 samples,
  so tensor parallelism needs nothing more.
- `Matcher.consume(token)`: the scheduler, after sampling, for each constrained request.

- `steer(bitmask, matchers, remaining)`: the sampler, after the masks: a request whose
  token budget is about to run out is steered to end its grammar in time (below).

Ending within the budget (`Closer`): a small model asked for JSON with an unbounded string
or number can go on writing it until max_new_tokens and return text that does not parse.
In its last STEER_WINDOW tokens, every step, a constrained request's matcher is rolled out
(on a copy) along a closing policy: end where the grammar allows it (EOS), else take what
the grammar forces (llguidance's fast-forward tokens: a key, a separator), else the first
allowed of `"`, `}`, `]`, else the first allowed single-byte token in a fixed order
(digits, letters, the rest). The rollout's length bounds what closing takes (its free
choices are single-byte tokens), so once it comes within
STEER_SLACK tokens of the budget, the request takes the rollout's first token instead of
sampling: it ends with a whole match (finish_reason stop), up to STEER_SLACK tokens before
its budget. Cost: a rollout is a few llguidance token checks per step (well under a
millisecond), in a request's last STEER_WINDOW tokens only. Where the policy cannot close
the grammar within the budget (a regex that needs a letter the order never reaches, a
required structure longer than the window) nothing is steered.

Invariant (kept by the scheduler): a request's matcher has consumed exactly its output ids,
in order. A retracted request keeps its output ids (it is recomputed, not regenerated), so
its matcher stays as it is; `Matcher.sync` rebuilds it from the output ids if they ever
differ.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from grammars.checker import Checker
from grammars.llg import (COMPILE_STACK, GrammarError, error, first_error, is_limit, on_stack,
                          to_llguidance)

log = logging.getLogger(__name__)

STEER_WINDOW = 64           # a request's last tokens in which closing is planned each step
STEER_SLACK = 8             # steer once closing takes this close to the budget
COMPILE_THREADS = 2         # the scheduler's compile pool
COMPILE_NICE = 10           # added to a compile thread's OS nice value
CACHE_SIZE = 128            # compiled grammars kept per scheduler (LRU)

__all__ = ["Closer", "GrammarCompiler", "GrammarError", "Matcher", "fill_bitmask", "steer"]


class Closer:
    """The closing policy over one vocabulary (module docstring): `plan(m, cap)` is the
    (length, first token) of the shortest way to end that the policy finds from matcher m,
    or None if it finds none within cap tokens."""

    FIRST = (b'"', b"}", b"]")

    def __init__(self, tokenizer, eos: int):
        self.eos = eos
        singles: dict[bytes, int] = {}
        for t in range(tokenizer.vocab_size):
            if not tokenizer.is_special_token(t):
                b = tokenizer.decode_bytes([t])
                if len(b) == 1:
                    singles.setdefault(b, t)
        rank = {b: i for i, b in enumerate(
            [*self.FIRST, *(bytes([c]) for c in b"0123456789"),
             *(bytes([c]) for c in range(ord("a"), ord("z") + 1)),
             *(bytes([c]) for c in range(ord("A"), ord("Z") + 1))])}
        self.order = [t for _, t in sorted(singles.items(),
                                           key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))]

    def plan(self, m, cap: int) -> tuple[int, int] | None:
        m = m.deep_copy()
        first = None
        for n in range(cap + 1):
            if m.is_stopped():
                return (n, first) if first is not None else None
            if m.is_accepting():                  # EOS ends it here: one more token
                return n + 1, self.eos if first is None else first
            if n == cap:
                return None
            forced = m.compute_ff_tokens()        # what the grammar dictates, as the model
            token = forced[0] if forced else next(   # would spell it (merged tokens)
                (t for t in self.order if m.validate_tokens([t]) == 1), None)
            if token is None or not m.consume_token(token):
                return None
            first = token if first is None else first
        return None


class Matcher:
    """One request's position in its grammar. `consumed`: tokens consumed so far."""

    __slots__ = ("m", "template", "consumed", "n_vocab", "limit_error", "closer")

    def __init__(self, template, n_vocab: int, closer: Closer | None = None):
        self.closer = closer            # the vocabulary's closing policy (None: no steering)
        self.template = template        # the compiled, never-advanced matcher (shared)
        self.m = template.deep_copy()
        self.consumed = 0
        self.limit_error = ""
        self.n_vocab = n_vocab          # the bitmask's width in tokens

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher
        is then in an error state: see `error` and `limit_error`)."""
        self.consumed += 1
        try:
            ok = self.m.consume_token(token)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:    # noqa: BLE001 - a Rust panic: this request's grammar
            self.limit_error = f"the grammar engine failed ({type(e).__name__}: {e})"
            return False
        # The mask allowed the token, so a refusal is llguidance running past one of its
        # limits (the grammar's fault, a 400) where its error says so.
        self.limit_error = "" if ok or not is_limit(self.m.get_error()) else self.m.get_error()
        return ok

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (nothing consumed)."""
        try:
            return self.m.validate_tokens(tokens) if tokens else 0
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:           # noqa: BLE001 - a Rust panic: draft nothing
            return 0

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens (a speculative step's drafts). Where the matcher
        cannot, it is marked stale (consumed -1): the caller syncs it from the output ids."""
        if not n:
            return
        try:
            ok = self.m.rollback(n)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:           # noqa: BLE001 - a Rust panic
            ok = False
        self.consumed = self.consumed - n if ok is not False else -1

    def steer(self, remaining: int) -> int | None:
        """The token this request must take now to end its grammar within `remaining`
        tokens (this step's included), or None to sample freely."""
        if self.closer is None or remaining > STEER_WINDOW or self.m.is_error():
            return None
        plan = self.closer.plan(self.m, remaining)
        if plan is None or plan[0] + STEER_SLACK < remaining:
            return None
        return plan[1]

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS consumed, or no extension)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()

    def sync(self, output_ids: list[int]) -> None:
        """Rebuild from the output ids if the matcher does not stand after all of them."""
        if self.consumed != len(output_ids):
            self.m = self.template.deep_copy()
            self.consumed = len(output_ids)
            self.m.consume_tokens(output_ids)


# ---- the scheduler's compiler ---------------------------------------------------------------

class GrammarCompiler:
    """Compiles grammars for one scheduler on a thread pool, cached by (kind, text).

    Every method is called from the scheduler's thread; only `_build` runs on the pool. The
    llguidance tokenizer (the vocabulary as byte strings, ~0.5-1 s to build) is made on the
    first compile, so a server that never sees a grammar never pays for it."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: list[int],
                 threads: int = COMPILE_THREADS, cache_size: int = CACHE_SIZE):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar",
                                       initializer=_lower_priority)
        self._tokenizer = None
        self._closer: Closer | None = None
        self._n_vocab = vocab_size
        self._lock = threading.Lock()
        self.checker = Checker()        # this scheduler's own: it trusts no tokenizer
        self.compiled_total = 0         # compiles started (cache misses)

    def compile(self, key: tuple[str, str]) -> Future:
        """A future of the compiled grammar for key; resolve it with `matcher`."""
        fut = self.cache.get(key)
        if fut is not None:
            self.cache.move_to_end(key)
            return fut
        fut = self.pool.submit(self._build, *key)
        self.compiled_total += 1
        self.cache[key] = fut
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)      # its holders keep their reference
        return fut

    def matcher(self, fut: Future) -> Matcher:
        """A fresh matcher from a done future; raises GrammarError (or, for a fault in the
        compiler itself, whatever it raised)."""
        return Matcher(fut.result(), self._n_vocab, self._closer)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.checker.close()

    def _build(self, kind: str, text: str):
        """On a pool thread: check in the child, then build on a big stack (module doc)."""
        verdict = self.checker.check(kind, text)
        if verdict:
            raise GrammarError(verdict)
        tokenizer = self.tokenizer()
        return on_stack(COMPILE_STACK, _matcher, kind, text, tokenizer)

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                from tokenization.hf_tokenizer import HFTokenizer
                hf = HFTokenizer.from_dir(self.tokenizer_path)
                # The mask covers the model's vocabulary; tokens past the tokenizer's are
                # never allowed, tokens past the model's are cut off (fill_bitmask).
                self._n_vocab = max(self.vocab_size, len(hf))
                eos = self.eos_ids or [hf.eos_token_id or 0]
                self._tokenizer = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(),
                                                         n_vocab=self._n_vocab, eos_token=eos)
                self._closer = Closer(self._tokenizer, eos[0])
                log.info("grammar tokenizer ready (%d tokens)", self._n_vocab)
            return self._tokenizer


def _matcher(kind: str, text: str, tokenizer):
    from llguidance import LLMatcher
    try:
        m = LLMatcher(tokenizer, to_llguidance(kind, text), log_level=0)
        problem = first_error(m)
    except (GrammarError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:    # noqa: BLE001 - a Rust panic (pyo3) is a BaseException
        raise error(kind, f"{type(e).__name__}: {e}") from None
    if problem:
        raise error(kind, problem)
    return m


def _lower_priority() -> None:
    """This thread's nice value COMPILE_NICE higher than the process's (Linux: per thread;
    the threads it starts inherit it)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                  + COMPILE_NICE))
    except (OSError, AttributeError):
        pass


# ---- the sampler's side -----------------------------------------------------------------------

_executor = None


def _parallel():
    """llguidance's thread pool for filling many rows' masks at once (made on first use)."""
    global _executor
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor(num_threads=max(1, min(os.cpu_count() or 1, 8)))
    return _executor


def fill_bitmask(matchers: list[Matcher]):
    """[len(matchers), ceil(n_vocab / 32)] int32 numpy array: bit t % 32 of word t // 32 of
    row j is 1 where matchers[j] allows token t next."""
    import numpy as np                  # here: the tokenizer process imports this module
    words = (max(m.n_vocab for m in matchers) + 31) // 32
    bitmask = np.zeros((len(matchers), words), dtype=np.int32)
    try:
        if len(matchers) == 1:
            matchers[0].m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        else:
            _parallel().unsafe_compute_mask_ptr([(m.m, j) for j, m in enumerate(matchers)],
                                                bitmask.ctypes.data, words * 4, len(matchers))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:        # noqa: BLE001 - a Rust panic is a BaseException: as an
        raise RuntimeError(f"the grammar engine failed: {e}") from None   # Exception, the
    return bitmask                    # step's requests end with an error, not the process


def steer(bitmask, matchers: list[Matcher], remaining: list[int]):
    """Rows of `bitmask` (fill_bitmask's) narrowed to the one token a request must take to
    end its grammar within its `remaining` tokens (Matcher.steer); the same array."""
    bits = bitmask.view("uint32")           # the same words, bit 31 without a sign
    for j, (m, left) in enumerate(zip(matchers, remaining)):
        token = m.steer(left)
        if token is not None and bits[j, token // 32] >> (token % 32) & 1:
            bits[j] = 0
            bits[j, token // 32] = 1 << (token % 32)
    return bitmask
