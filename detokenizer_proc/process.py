"""Detokenizer process: one TokenBatch in, one TextBatch out, per scheduler step.

Per rid it keeps a DecodeStream from the rid's first output (which carries DecodeParams)
until its terminal output. When a stop string matches, the request is finished here: the
API gets the terminal output at once and the scheduler gets a ReleaseRequest; until the
scheduler's own terminal output for that rid arrives, its outputs are dropped.

Each output is checked against what the detokenizer knows before it is decoded: token ids
inside the vocabulary, logprob lists of matching lengths, decode params within the API's
limits, a vector (an embedding or a score: wire/messages.py VectorRequest) of whole float32
values and on a terminal output only. An output that fails (or whose decoding fails) ends
its own request the same way a stop string does, with a status-500 abort instead of a
stop, and the rest of the batch goes on; an output for an unknown rid without decode params
is dropped. Both are counted.

Routing (--api-server-count N): a rid's outputs go to the API process named in its
DecodeParams (`api`); every API process gets every batch's load, with or without outputs
of its own, so each one knows the whole server's state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from detokenizer_proc.incremental import DecodeStream
from tokenization.hf_tokenizer import HFTokenizer
from wire.addresses import Addresses
from wire.codec import DETOKENIZER_INBOX
from wire.messages import (DecodeParams, FinishReason, Logprobs, ReleaseRequest, TextBatch,
                           TextOutput, TokenBatch, TokenOutput)
from wire.proc import run_child
from wire.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from wire.server_args import ServerConfig
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)


FINISH_TYPES = ("length", "stop", "abort")


class OutputError(ValueError):
    """A TokenOutput that cannot be right, whoever sent it."""


@dataclass(slots=True)
class RidState:
    stream: DecodeStream | None     # None once released: nothing more is decoded
    api: int = 0                    # the API process that owns the rid
    completion_tokens: int = 0
    released: bool = False      # finished here (stop string, error); awaiting the scheduler's end


class Detokenizer:
    """`process(batch)` never raises. Counters: `dropped` (outputs for unknown rids without
    decode params), `failed` (outputs that ended their request with an error here)."""

    def __init__(self, tokenizer, model_vocab_size: int | None = None, api_servers: int = 1):
        self.tokenizer = tokenizer
        self.api_servers = api_servers
        # Ids the model may emit: the tokenizer's, added tokens included, and the rows of a
        # model whose embedding is padded past them (those decode to "").
        self.vocab_size = max(len(tokenizer), model_vocab_size or 0)
        self.states: dict[str, RidState] = {}
        self.dropped = 0
        self.failed = 0

    def process(self, batch: TokenBatch) -> tuple[list[TextBatch], list[str]]:
        """Returns one TextBatch per API process (the outputs of the rids it owns, and the
        load) and the rids to release in the scheduler."""
        outs: list[list[TextOutput]] = [[] for _ in range(self.api_servers)]
        release: list[str] = []
        for o in batch.outputs:
            api = self._owner(o)
            try:
                out = self._output(o, release)
            except Exception as e:
                out = self._fail(o, e, release)
            if out is not None:
                outs[api].append(out)
        return [TextBatch(o, batch.load) for o in outs], release

    def _owner(self, o: TokenOutput) -> int:
        """The API process o goes to: the rid's, else its decode params' (checked again by
        _check_decode), else 0 (an output for an unknown rid: that API drops it)."""
        st = self.states.get(o.rid)
        if st is not None:
            return st.api
        api = o.decode.api if o.decode is not None else 0
        return api if 0 <= api < self.api_servers else 0

    def _output(self, o: TokenOutput, release: list[str]) -> TextOutput | None:
        st = self.states.get(o.rid)
        if st is None:
            if o.decode is None:
                self.dropped += 1
                log.error("dropped an output for unknown rid %r without decode params "
                          "(%d dropped so far)", o.rid, self.dropped)
                return None
            self._check_decode(o.decode)
            d = o.decode
            st = RidState(DecodeStream(
                self.tokenizer, skip_special_tokens=d.skip_special_tokens,
                spaces_between_special_tokens=d.spaces_between_special_tokens,
                stop=d.stop, no_stop_trim=d.no_stop_trim), api=d.api)
            self.states[o.rid] = st
        if st.released:
            if o.finish is not None:
                del self.states[o.rid]
            return None
        self._check(o)
        out = self._step(st, o)
        if out.finish is not None:
            if o.finish is None:        # finished by a stop string: the scheduler runs on
                self._release(o.rid, st, release)
            else:
                del self.states[o.rid]
        return out

    def _release(self, rid: str, st: RidState, release: list[str]) -> None:
        st.released = True
        st.stream = None
        release.append(rid)

    def _fail(self, o: TokenOutput, e: Exception, release: list[str]) -> TextOutput:
        """End o's request with an error; the scheduler is told to stop it unless this was
        its last output."""
        self.failed += 1
        if isinstance(e, OutputError):
            log.error("ended request %r: %s (%d failed so far)", o.rid, e, self.failed)
            message = f"Internal error: the detokenizer got a bad output ({e})."
        else:
            log.exception("ended request %r on an internal error (%d failed so far)", o.rid,
                          self.failed)
            message = f"Internal error in the detokenizer ({type(e).__name__})."
        st = self.states.get(o.rid) or RidState(None)
        if o.finish is None:
            self.states[o.rid] = st
            if not st.released:
                self._release(o.rid, st, release)
        else:
            self.states.pop(o.rid, None)
        return TextOutput(rid=o.rid, text="", new_ids=[],
                          finish=FinishReason("abort", message=message, status_code=500),
                          prompt_tokens=o.prompt_tokens,
                          completion_tokens=st.completion_tokens,
                          cached_tokens=o.cached_tokens)

    # ---- validation -------------------------------------------------------------------------

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise OutputError(f"{what} has token id {bad}, outside the vocabulary "
                              f"[0, {self.vocab_size})")

    def _check_logprobs(self, lp: Logprobs | None, what: str) -> None:
        if lp is None:
            return
        n = len(lp.token_ids)
        if not len(lp.logprobs) == len(lp.top_ids) == len(lp.top_logprobs) == n:
            raise OutputError(f"{what} has lists of different lengths")
        if any(len(i) != len(v) for i, v in zip(lp.top_ids, lp.top_logprobs)):
            raise OutputError(f"{what} has top lists of different lengths")
        self._check_ids(lp.token_ids, what)
        for ids in lp.top_ids:
            self._check_ids(ids, what)

    def _check(self, o: TokenOutput) -> None:
        self._check_ids(o.new_ids, "new_ids")
        self._check_logprobs(o.logprobs, "logprobs")
        self._check_logprobs(o.input_logprobs, "input_logprobs")
        if o.vector is not None and (o.finish is None or len(o.vector) % 4):
            raise OutputError(f"a vector of {len(o.vector)} bytes on a "
                              f"{'terminal' if o.finish else 'running'} output (float32 "
                              f"values, on the terminal output only)")
        if o.spec is not None and not (0 <= o.spec.verify_ct and
                                       0 <= o.spec.accepted_tokens <= o.spec.draft_tokens):
            raise OutputError(f"speculative counts {o.spec}: negative, or more drafts kept "
                              f"than verified")
        if o.finish is not None and o.finish.type not in FINISH_TYPES:
            raise OutputError(f"unknown finish type {o.finish.type!r}")
        for name in ("queue_time", "prefill_time", "decode_time"):
            value = getattr(o, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise OutputError(f"{name} is {value}")

    def _check_decode(self, d: DecodeParams) -> None:
        # The API's limits: DecodeStream keeps every prefix of every stop string.
        if len(d.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in d.stop):
            raise OutputError(f"decode params with {len(d.stop)} stop strings (at most "
                              f"{MAX_STOP_STRINGS} of at most {MAX_STOP_LENGTH} characters)")
        if not 0 <= d.api < self.api_servers:
            raise OutputError(f"decode params name API process {d.api} of "
                              f"{self.api_servers}")

    def _step(self, st: RidState, o: TokenOutput) -> TextOutput:
        delta = st.stream.push(o.new_ids, finished=o.finish is not None)
        used = o.new_ids[:delta.num_ids]
        st.completion_tokens += len(used)
        finish = o.finish
        if delta.stop_matched is not None:
            finish = FinishReason("stop", matched_str=delta.stop_matched)
        return TextOutput(rid=o.rid, text=delta.text, new_ids=used, finish=finish,
                          prompt_tokens=o.prompt_tokens,
                          completion_tokens=st.completion_tokens,
                          cached_tokens=o.cached_tokens, queue_time=o.queue_time,
                          logprobs=self._with_texts(o.logprobs, len(used)),
                          input_logprobs=self._with_texts(o.input_logprobs, None),
                          prefill_time=o.prefill_time, decode_time=o.decode_time,
                          vector=o.vector, spec=o.spec)

    def _with_texts(self, lp: Logprobs | None, keep: int | None) -> Logprobs | None:
        """Trim to the ids actually used and add each token's own text (SGLang decodes
        every id alone, so a piece of a multi-byte character shows as U+FFFD)."""
        if lp is None:
            return None
        if keep is not None:
            lp = lp.head(keep)
        decode = self.tokenizer.decode
        lp.texts = [decode([t]) for t in lp.token_ids]
        lp.top_texts = [[decode([t]) for t in ids] for ids in lp.top_ids]
        return lp


def make_detokenizer(config: ServerConfig) -> Detokenizer:
    """The detokenizer as the process builds it, from the resolved record (the model's
    vocabulary size included: config.json is not read again here)."""
    return Detokenizer(HFTokenizer.from_dir(config.tokenizer_path), config.vocab_size,
                       config.args.api_server_count)


def main(config: ServerConfig, addrs: Addresses, conn: Connection) -> None:
    def body(ready) -> None:
        detok = make_detokenizer(config)
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.detokenizer, DETOKENIZER_INBOX)
        to_api = [Outbox(ctx, a) for a in addrs.api]
        to_scheduler = Outbox(ctx, addrs.scheduler)
        ready()
        while True:
            for batch in inbox.recv(timeout_ms=None):    # TokenBatches only (its decoder)
                texts, release = detok.process(batch)
                for outbox, text in zip(to_api, texts):
                    outbox.send(text)   # even when empty: it carries the scheduler's load
                if release:
                    to_scheduler.send(ReleaseRequest(release))
    run_child("detokenizer", config.args.log_level, conn, body, ipc_dir=addrs.ipc_dir)
