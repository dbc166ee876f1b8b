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

COMPILE_THREADS = 2         # the scheduler's compile pool
COMPILE_NICE = 10           # added to a compile thread's OS nice value
CACHE_SIZE = 128            # compiled grammars kept per scheduler (LRU)

__all__ = ["GrammarCompiler", "GrammarError", "Matcher", "fill_bitmask"]


class Matcher:
    """One request's position in its grammar. `consumed`: tokens consumed so far."""

    __slots__ = ("m", "template", "consumed", "n_vocab", "limit_error")

    def __init__(self, template, n_vocab: int):
        self.template = template        # the compiled, never-advanced matcher (shared)
        self.m = template.deep_copy()
        self.consumed = 0
        self.limit_error = ""
        self.n_vocab = n_vocab          # the bitmask's width in tokens

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher
        is then in an error state: see `error` and `limit_error`)."""
        self.consumed += 1
        ok = self.m.consume_token(token)
        # The mask allowed the token, so a refusal is llguidance running past one of its
        # limits (the grammar's fault, a 400) where its error says so.
        self.limit_error = "" if ok or not is_limit(self.m.get_error()) else self.m.get_error()
        return ok

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
        return Matcher(fut.result(), self._n_vocab)

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

                from tokenizer_proc.hf_tokenizer import HFTokenizer
                hf = HFTokenizer.from_dir(self.tokenizer_path)
                # The mask covers the model's vocabulary; tokens past the tokenizer's are
                # never allowed, tokens past the model's are cut off (fill_bitmask).
                self._n_vocab = max(self.vocab_size, len(hf))
                eos = self.eos_ids or [hf.eos_token_id or 0]
                self._tokenizer = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(),
                                                         n_vocab=self._n_vocab, eos_token=eos)
                log.info("grammar tokenizer ready (%d tokens)", self._n_vocab)
            return self._tokenizer


def _matcher(kind: str, text: str, tokenizer):
    from llguidance import LLMatcher
    m = LLMatcher(tokenizer, to_llguidance(kind, text), log_level=0)
    problem = first_error(m)
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
    if len(matchers) == 1:
        matchers[0].m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    else:
        _parallel().unsafe_compute_mask_ptr([(m.m, j) for j, m in enumerate(matchers)],
                                            bitmask.ctypes.data, words * 4, len(matchers))
    return bitmask
