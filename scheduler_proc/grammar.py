r"""Constrained decoding with llguidance: a request's `json_schema`, `regex` or `ebnf` becomes
a grammar over the model's tokens, and the sampler may only pick tokens the grammar allows.

Where each part runs:
- `validate(kind, text)`: the tokenizer worker, before the request reaches the scheduler. It
  checks the grammar itself (no tokenizer: ~1 ms) so a bad one is a 400 naming the problem.
  No torch here: the tokenizer process imports this module.
- `GrammarCompiler.compile(key)`: the scheduler. Building a matcher over the vocabulary
  (lexer, token trie) runs on a small thread pool, not on the scheduler's loop (llguidance
  drops the GIL while it builds); compiled grammars are cached by their text, LRU-bounded
  (a failed compile is cached too). The request waits, holding no KV, until its future is
  done (scheduler.py `compiling`); each request then gets its own copy of the compiled
  matcher (`matcher`, a deep copy: microseconds).
- `fill_bitmask(matchers)`: the sampler, every step (runner.py `_sample` via
  sampler.constrain): one bit per token, 1 where the grammar allows it. Only rank 0 samples,
  so tensor parallelism needs nothing more.
- `Matcher.consume(token)`: the scheduler, after sampling, for each constrained request.

Invariant (kept by the scheduler): a request's matcher has consumed exactly its output ids,
in order. A retracted request keeps its output ids (it is recomputed, not regenerated), so
its matcher stays as it is; `Matcher.sync` rebuilds it from the output ids if they ever
differ.

JSON is generated without free whitespace, with json.dumps' separators (", " and ": "): a
small model allowed any whitespace can loop on newlines until its length limit (xgrammar's
`any_whitespace` has the same failure). A schema can opt in with llguidance's own key,
`"x-guidance": {"whitespace_flexible": true}`. Keywords llguidance does not implement are
an error (its `lenient` option stays off): nothing in a schema is silently ignored.

A regex is matched whole (as if anchored), in Rust's regex syntax, with `\d`, `\w` and `\s`
meaning their ASCII classes (as in xgrammar and JSON Schema patterns): with Unicode classes
`\d{4}` let a model write "🯸🯸🯸🯸" (U+1FBF8, a segmented digit) for a year.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

log = logging.getLogger(__name__)

ASCII_CLASSES = "dws"       # regex \d, \w, \s mean [0-9], [0-9a-zA-Z_], [ \t\n\r\f\v]
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILE_THREADS = 2         # the scheduler's compile pool
CACHE_SIZE = 128            # compiled grammars kept per scheduler (LRU)
VALIDATE_CACHE_CHARS = 65536    # the tokenizer caches verdicts on grammars up to this long
MAX_ERROR_CHARS = 1000      # of an llguidance error quoted back to a client
KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}


class GrammarError(ValueError):
    """A grammar that does not compile; the message is shown to the client (400)."""


def _error(kind: str, message: str) -> GrammarError:
    message = message.strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return GrammarError(f"The {KIND_NAMES.get(kind, kind)} does not compile: {message}")


def to_llguidance(kind: str, text: str) -> str:
    """The llguidance grammar for a request's constraint (kind: a wire.sampling.GRAMMAR_KEYS
    name). Raises GrammarError where the conversion itself fails."""
    import llguidance
    from llguidance import LLMatcher
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "regex":             # \d \w \s are ASCII (module docstring)
            return LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(text, ASCII_CLASSES)}/")
        if kind == "ebnf":              # GBNF (llama.cpp's, xgrammar's) or Lark
            return llguidance.grammar_from("ebnf", text)
    except ValueError as e:
        raise _error(kind, str(e)) from None
    raise GrammarError(f"Unknown constraint kind {kind!r}.")


def validate(kind: str, text: str) -> None:
    """Raise GrammarError if the grammar does not compile (checked without a tokenizer, so
    a few grammars that hit a limit only with the vocabulary fail later, in the scheduler,
    still as a 400)."""
    message = _verdict(kind, text) if len(text) <= VALIDATE_CACHE_CHARS else \
        _verdict.__wrapped__(kind, text)
    if message:
        raise GrammarError(message)


@lru_cache(maxsize=256)
def _verdict(kind: str, text: str) -> str:
    """"" if the grammar is valid, else the client-facing error."""
    from llguidance import LLMatcher
    try:
        problem = LLMatcher.validate_grammar(to_llguidance(kind, text))
    except GrammarError as e:
        return str(e)
    return str(_error(kind, problem)) if problem else ""


class Matcher:
    """One request's position in its grammar. `consumed`: tokens consumed so far."""

    __slots__ = ("m", "template", "consumed", "n_vocab")

    def __init__(self, template, n_vocab: int):
        self.template = template        # the compiled, never-advanced matcher (shared)
        self.m = template.deep_copy()
        self.consumed = 0
        self.n_vocab = n_vocab          # the bitmask's width in tokens

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher
        is then in an error state: see `error`)."""
        self.consumed += 1
        return self.m.consume_token(token)

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
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._tokenizer = None
        self._n_vocab = vocab_size
        self._lock = threading.Lock()
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

    def _build(self, kind: str, text: str):
        from llguidance import LLMatcher
        grammar = to_llguidance(kind, text)
        m = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise _error(kind, m.get_error())
        return m

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
