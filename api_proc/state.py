"""Per-request state in the API process and the dispatcher that feeds it.

Invariant: `Dispatcher.states` holds a rid from submit until its terminal output arrives
(or the pipeline is lost); a rid is never in flight twice. Outputs are stamped and queued
by the dispatcher task as they arrive; route handlers consume the queues at their own pace.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq.asyncio

from api_proc.timing import RequestTiming
from wire.addresses import Addresses
from wire.messages import (AbortRequest, ControlReply, FinishReason, FlushCacheRequest,
                           GenerateRequest, LogprobRequest, Logprobs, SchedulerLoad, TextBatch,
                           TextOutput)
from wire.codec import encode
from wire.sockets import AsyncInbox, Outbox

log = logging.getLogger(__name__)


class SubmitError(ValueError):
    """A request the dispatcher refuses; the message is for the client (HTTP 400)."""


class DuplicateRid(SubmitError):
    pass


class Unsendable(SubmitError):
    """A request that passed validation but cannot be encoded (e.g. an int wider than
    64 bits, a lone surrogate in a string): a client error, not a server one."""


class RequestState:
    """One request as the client sees it: cumulative text and ids, meta, timing."""

    __slots__ = ("rid", "timing", "queue", "text", "output_ids", "last", "logprob",
                 "output_logprobs", "input_logprobs", "text_in_logprobs")

    def __init__(self, rid: str, logprob: LogprobRequest | None = None):
        self.rid = rid
        self.timing = RequestTiming()
        self.queue: asyncio.Queue[TextOutput] = asyncio.Queue()
        self.text = ""
        self.output_ids: list[int] = []
        self.last: TextOutput | None = None     # the newest output taken from the queue
        self.logprob = logprob                  # what logprobs were asked for, if any
        self.output_logprobs = Logprobs()       # cumulative, one entry per output id
        self.input_logprobs: Logprobs | None = None
        self.text_in_logprobs = False           # SGLang's return_text_in_logprobs

    async def next(self) -> TextOutput:
        """The next output, folded into the cumulative text, ids and logprobs."""
        out = await self.queue.get()
        self.text += out.text
        self.output_ids += out.new_ids
        if out.logprobs is not None:
            self.output_logprobs.extend(out.logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        self.last = out
        return out

    async def wait_finished(self) -> TextOutput:
        while self.last is None or self.last.finish is None:
            await self.next()
        return self.last

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish is not None

    @property
    def error(self) -> FinishReason | None:
        """The finish reason if the request failed in a way the client must see as an HTTP
        error (an abort with a status code)."""
        f = self.last.finish if self.last else None
        return f if f is not None and f.status_code is not None else None

    def _logprob_triples(self, lp: Logprobs) -> tuple[list, list]:
        """SGLang's shapes: [[logprob, id, text|None], ...] and per position a list of such
        triples for the top logprobs."""
        texts = lp.texts if self.text_in_logprobs else [None] * len(lp.token_ids)
        tokens = [[v, t, x] for v, t, x in zip(lp.logprobs, lp.token_ids, texts)]
        tops = []
        for i, (ids, vals) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
            names = lp.top_texts[i] if self.text_in_logprobs else [None] * len(ids)
            tops.append([[v, t, x] for v, t, x in zip(vals, ids, names)])
        return tokens, tops

    def meta_info(self, incremental: bool = False) -> dict:
        out = self.last
        assert out is not None
        meta = {"id": self.rid,
                "finish_reason": out.finish.to_json() if out.finish else None,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens}
        if self.logprob is not None:
            lp = (out.logprobs or Logprobs()) if incremental else self.output_logprobs
            meta["output_token_logprobs"], meta["output_top_logprobs"] = \
                self._logprob_triples(lp)
            if self.input_logprobs is not None:
                meta["input_token_logprobs"], meta["input_top_logprobs"] = \
                    self._logprob_triples(self.input_logprobs)
        if out.finish is not None:
            meta["e2e_latency"] = self.timing.e2e_latency
            meta["first_token_latency"] = self.timing.first_token_latency
            meta["queue_time"] = out.queue_time
        return meta


class Dispatcher:
    """Owns the rid -> RequestState dict and the API end of the pipeline."""

    def __init__(self, addrs: Addresses):
        ctx = zmq.asyncio.Context()
        self.inbox = AsyncInbox(ctx, addrs.api)
        # A plain (non-awaiting) send on an asyncio socket: sends never block (no HWM), and
        # aborts must be sendable from cancellation paths that cannot await.
        self.to_tokenizer = Outbox(ctx, addrs.tokenizer)
        self.states: dict[str, RequestState] = {}
        self.lost: str | None = None      # set when the pipeline is gone; then all fail fast
        self.loop: asyncio.AbstractEventLoop | None = None   # set once run() starts
        self.load = SchedulerLoad()                          # the newest the scheduler sent
        self.controls: dict[str, asyncio.Future[ControlReply]] = {}

    def submit(self, reqs: list[GenerateRequest]) -> list[RequestState]:
        """Register and send a group of requests atomically (all or none)."""
        rids = [r.rid for r in reqs]
        dup = next((rid for rid in rids if rid in self.states), None)
        if dup is None and len(set(rids)) < len(rids):
            dup = next(rid for rid in rids if rids.count(rid) > 1)
        if dup is not None:
            raise DuplicateRid(f"Duplicate request ID {dup!r} is already in flight.")
        try:
            frames = [encode(r) for r in reqs]
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as e:
            raise Unsendable(f"The request has a value that cannot be processed: {e}") from None
        states = []
        for req, frame in zip(reqs, frames):
            state = self.states[req.rid] = RequestState(req.rid, req.logprob)
            self.to_tokenizer.send_frame(frame)
            states.append(state)
        return states

    def abort(self, rid: str, message: str = "Aborted by the client.") -> None:
        if rid in self.states and not self.lost:
            self.to_tokenizer.send(AbortRequest(rid=rid, message=message))

    def abort_prefix(self, prefix: str) -> int:
        rids = [rid for rid in self.states if rid.startswith(prefix)]
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def abort_unfinished(self, states: list[RequestState]) -> None:
        for s in states:
            if self.states.get(s.rid) is s:
                self.abort(s.rid)

    def fail_all(self, message: str) -> None:
        """The pipeline is lost: end every request in flight with a 503."""
        self.lost = message
        now = time.monotonic()
        for state in self.states.values():
            state.timing.mark_output(now, terminal=True)
            state.queue.put_nowait(TextOutput(state.rid, "", [], FinishReason(
                "abort", message=message, status_code=503)))
        self.states.clear()

    async def flush_cache(self, timeout: float = 30.0) -> ControlReply:
        req_id = uuid.uuid4().hex
        fut = self.controls[req_id] = asyncio.get_running_loop().create_future()
        try:
            self.to_tokenizer.send(FlushCacheRequest(req_id))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(req_id, None)

    def _update_load(self, load: SchedulerLoad) -> None:
        if load.seq >= self.load.seq:      # control replies and batches race: newest wins
            self.load = load

    def lose_threadsafe(self, message: str) -> None:
        """Called from the supervisor thread when a child dies."""
        self.lost = message
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.fail_all, message)

    async def run(self) -> None:
        """Stamp and route every output to its request's queue."""
        self.loop = asyncio.get_running_loop()
        while True:
            batch = await self.inbox.recv_one()
            if isinstance(batch, ControlReply):
                self._update_load(batch.load)
                fut = self.controls.get(batch.req_id)
                if fut is not None and not fut.done():
                    fut.set_result(batch)
                continue
            if not isinstance(batch, TextBatch):
                log.error("unexpected message %s", type(batch).__name__)
                continue
            now = time.monotonic()
            if batch.load is not None:
                self._update_load(batch.load)
            for out in batch.outputs:
                state = self.states.get(out.rid)
                if state is None:
                    continue                      # e.g. the pipeline was declared lost
                terminal = out.finish is not None
                state.timing.mark_output(now, terminal)
                state.queue.put_nowait(out)
                if terminal:
                    del self.states[out.rid]
