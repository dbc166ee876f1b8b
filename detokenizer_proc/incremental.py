"""Incremental detokenization and stop-string matching for one request.

This module owns the pure (socket-free) logic of the detokenizer process: turning the
output token ids of one request, delivered a few at a time, into text deltas that are safe
to show to a client. The process loop (detokenizer_proc's main) keeps one `DecodeStream`
per in-flight rid, calls `push()` once per TokenBatch entry and forwards the `Delta`.

Two layers, applied per id:

1. Decoding (`_decode_step`). Decoding the whole output after every token would cost
   O(length) per token, so we use the prefix-offset technique of vLLM/SGLang: only a small
   window `ids[_prefix:]` is decoded and diffed against the part of that window's text that
   was already emitted. The first ids of the window are "context" that was emitted earlier;
   they keep decoders that treat the first token specially (SentencePiece's leading-space
   strip, byte-fallback grouping) producing the same text as a full decode would. Text
   that ends in U+FFFD (a multi-byte character whose bytes have not all arrived yet) is held
   back until later ids complete it, or until the request finishes.
2. Stop strings (`_feed_text`). After each id, the new text is searched for stop strings
   (only the region that could contain a new match); text that might be the start of a stop
   string is held back until it is decided.

Not thread-safe; one stream per request, used from one thread.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_FFFD = "\ufffd"  # what lossy UTF-8 decoding yields for an incomplete or invalid sequence


@dataclass(slots=True)
class Delta:
    """The result of one `DecodeStream.push`."""

    text: str  # new text that is now safe to show (may be "")
    stop_matched: str | None  # the stop string that finished the request, if any
    num_ids: int  # how many of the pushed ids were consumed (all, unless a stop matched earlier)


class DecodeStream:
    """Incremental detokenization of one request's output ids.

    push(ids, finished) feeds the next output ids and returns the text that became safe to
    show. Guarantees:

    - No delta ends in the middle of a UTF-8 character (trailing U+FFFD is held back).
    - With no stop string matched, the concatenation of all deltas equals
      ``tokenizer.decode(all_ids, skip_special_tokens=...)`` once `finished=True` was pushed.
    - When a stop string completes, the request is finished: the delta carries the text up
      to the stop string (including it if `no_stop_trim`), `stop_matched`, and `num_ids`
      counting the pushed ids up to and including the one that completed the match; ids
      after it are ignored. If several stop strings occur, the one that completes first
      (earliest end in the text) wins; on a tie, the longer one (earliest start).
    - Empty stop strings are ignored.
    - Any push after the stream finished raises RuntimeError.

    `spaces_between_special_tokens` is passed to `tokenizer.decode`; HFTokenizer
    (tokenization.hf_tokenizer) ignores it as Hugging Face fast tokenizers do (their Rust
    decoder decides the spacing), and as SGLang's do.

    Known limit (shared with vLLM and SGLang): emitted text is never retracted. With a
    byte-fallback (<0xNN>) tokenizer, an output that *ends* in an invalid byte run right
    after byte tokens that formed valid characters decodes in full with those characters
    turned into U+FFFD too, while the stream already emitted them. Valid text, and any
    output of a byte-level (GPT-2 style) tokenizer, match the full decode exactly.
    """

    # Window management, in ids. The decode window ids[_prefix:] is slid forward once it
    # holds at least _SLIDE_AT ids and ends cleanly; the new window start is a "clean
    # boundary" (a point where the text decoded so far ended with a complete character) at
    # least _CONTEXT_IDS ids before the end, so the window keeps some context. The per-token
    # decode therefore covers at most ~_SLIDE_AT + a few ids, independent of output length.
    _CONTEXT_IDS = 4
    _SLIDE_AT = 16
    # Safety valve for pathological output (a long run of ids whose text never ends with a
    # complete character, i.e. invalid bytes): past this many ids the window is flushed as
    # is (U+FFFD included) and restarted, so the cost stays bounded.
    _MAX_WINDOW = 256

    __slots__ = (
        "_tokenizer",
        "_decode_kwargs",
        "_ids",
        "_prefix",
        "_win_emitted",
        "_clean",
        "_fffd_pending",
        "_stops",
        "_no_stop_trim",
        "_tail_len",
        "_stop_prefixes",
        "_prefix_last_chars",
        "_tail",
        "_held",
        "_parts",
        "_finished",
        "_stop_matched",
    )

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }

        # --- decoding state ---
        self._ids: list[int] = []  # every id pushed (and consumed) so far
        self._prefix = 0  # start of the decode window
        self._win_emitted = 0  # chars of decode(ids[_prefix:]) already emitted
        self._clean: list[int] = []  # clean boundaries inside the window, ascending
        self._fffd_pending = False  # the window's text currently ends in held U+FFFD

        # --- stop-string state ---
        if isinstance(stop, str):  # tolerate a bare string
            stop = (stop,)
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._no_stop_trim = no_stop_trim
        max_stop = max((len(s) for s in self._stops), default=0)
        # A new match must end in the new text, so it starts at most max_stop - 1 chars
        # before it: keep that many trailing chars of decoded text in `_tail`.
        self._tail_len = max(max_stop - 1, 0)
        # Every proper prefix of every stop string, for the hold-back check, plus the set of
        # their last characters as a cheap first filter.
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._prefix_last_chars = frozenset(p[-1] for p in self._stop_prefixes)
        self._tail = ""  # the last _tail_len chars of all decoded text (emitted + held)
        self._held = ""  # decoded text not yet emitted: a possible start of a stop string

        # --- output ---
        self._parts: list[str] = []  # emitted deltas; joined lazily by `text`
        self._finished = False
        self._stop_matched: str | None = None

    # ------------------------------------------------------------------ public API

    @property
    def text(self) -> str:
        """All text emitted so far."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `finished=True` was pushed."""
        return self._finished

    @property
    def stop_matched(self) -> str | None:
        """The stop string that finished the stream, if any."""
        return self._stop_matched

    def push(self, ids: Sequence[int], finished: bool) -> Delta:
        """Feed the next output ids; `finished` says the request has no more ids."""
        if self._finished:
            raise RuntimeError("DecodeStream.push() called after the stream finished")
        out: list[str] = []
        n = len(ids)

        if not self._stops:
            # No stop strings: nothing depends on per-id boundaries, decode the batch at once.
            if n:
                self._ids.extend(ids)
                out.append(self._decode_step(flush=finished))
            elif finished and self._fffd_pending:
                out.append(self._decode_step(flush=True))
            return self._result(out, None, n, finished)

        # Stop strings: one id at a time so that a match is attributed to the id that
        # completed it and nothing after that id is consumed.
        for i, tok in enumerate(ids):
            self._ids.append(tok)
            new = self._decode_step(flush=finished and i == n - 1)
            text, matched = self._feed_text(new)
            out.append(text)
            if matched is not None:
                return self._result(out, matched, i + 1, True)
        if finished and n == 0 and self._fffd_pending:
            text, matched = self._feed_text(self._decode_step(flush=True))
            out.append(text)
            if matched is not None:
                return self._result(out, matched, 0, True)
        if finished:
            # Finished without a match: whatever was held as a possible stop start is text.
            out.append(self._held)
            self._held = ""
        return self._result(out, None, n, finished)

    # ------------------------------------------------------------------ internals

    def _result(self, out: list[str], matched: str | None, num_ids: int, finished: bool) -> Delta:
        text = "".join(out)
        if text:
            self._parts.append(text)
        if finished:
            self._finished = True
            self._stop_matched = matched
        return Delta(text=text, stop_matched=matched, num_ids=num_ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_step(self, flush: bool) -> str:
        """Decode the window after new ids were appended; return the newly safe text.

        With flush=True (last step of the request) trailing U+FFFD is emitted too, so the
        emitted text equals the full decode.
        """
        ids = self._ids
        text = self._decode(ids[self._prefix :])
        end = len(text)
        clean = flush or not text.endswith(_FFFD)
        if not clean:
            # Hold back the trailing U+FFFD run: it is (or may be) a character whose bytes
            # have not all arrived. Text before it is final: lossy UTF-8 decoding never
            # revisits a character once a later one was decoded.
            end = len(text.rstrip(_FFFD))
        # `end` can be below `_win_emitted` when an incomplete tail makes the decoder
        # re-group earlier bytes (byte-fallback); that resolves once the character completes.
        new = text[self._win_emitted : end] if end > self._win_emitted else ""
        if end > self._win_emitted:
            self._win_emitted = end
        self._fffd_pending = not clean

        if clean:
            self._clean.append(len(ids))
            if len(ids) - self._prefix >= self._SLIDE_AT:
                self._slide()
        elif len(ids) - self._prefix > self._MAX_WINDOW:
            # Pathological: hundreds of ids without a complete character at the end. Emit
            # the window as it is and restart it with no context.
            new += text[self._win_emitted :]
            self._prefix = len(ids)
            self._win_emitted = 0
            self._clean.clear()
            self._fffd_pending = False
        return new

    def _slide(self) -> None:
        """Move the window start forward to a clean boundary, keeping some context.

        Called only right after a clean step, when all of the window's text was emitted; so
        all of decode(ids[b:]) counts as emitted for the new window start b.
        """
        ids = self._ids
        k = bisect_right(self._clean, len(ids) - self._CONTEXT_IDS)
        if k == 0:
            return
        b = self._clean[k - 1]
        if b <= self._prefix:
            return
        context_len = len(self._decode(ids[b:]))
        if context_len == 0 and len(ids) - self._prefix <= self._MAX_WINDOW:
            # The context decodes to nothing (e.g. only skipped special tokens): then the
            # next token would be decoded as the first one, and decoders that strip its
            # leading space (SentencePiece) would drop text. Try again later.
            return
        del self._clean[:k]
        self._prefix = b
        self._win_emitted = context_len

    def _feed_text(self, new: str) -> tuple[str, str | None]:
        """Pass newly decoded text through the stop-string matcher.

        Returns (text that is now safe to emit, the stop string matched or None).
        Invariant: `_held` is the longest suffix of the decoded text that is a proper prefix
        of some stop string; any new match therefore starts inside `_held` or `new`.
        """
        if not self._stops:
            return new, None
        if not new:
            return "", None

        tail = self._tail
        search = tail + new
        new_at = len(tail)  # where `new` starts in `search`
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # Only matches that end inside `new` are new.
            start = search.find(stop, max(0, new_at - len(stop) + 1))
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand

        held_at = new_at - len(self._held)  # where `_held` starts in `search`
        if best is not None:
            end, start, stop = best
            cut = end if self._no_stop_trim else start
            self._held = ""
            return search[held_at : max(cut, held_at)], stop

        if self._tail_len:
            self._tail = search[-self._tail_len :]
        pending = search[held_at:]  # == self._held + new
        keep = self._holdback_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def _holdback_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._prefix_last_chars:
            return 0
        for k in range(min(len(text), self._tail_len), 0, -1):
            if text[-k:] in self._stop_prefixes:
                return k
        return 0
