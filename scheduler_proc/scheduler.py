"""The scheduler loop: admits requests, picks each step's segments, runs the model, and
emits one TokenBatch per step.

A step is a mixed batch: every running request that has finished its prompt decodes one
token, and up to --chunked-prefill-size prompt tokens are prefilled alongside, so a long
prompt delays running decodes by at most one chunk per step.

Admission reserves KV room for a request's whole run (prompt + max_new_tokens), so a step
never runs out of slots. Invariant: every accepted request gets exactly one terminal output.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from scheduler_proc.request import Req
from scheduler_proc.runner import ModelRunner, Segment
from wire.addresses import Addresses
from wire.messages import (AbortRequest, FinishReason, ReleaseRequest, SchedulerLoad,
                           TokenBatch, TokenizedRequest, TokenOutput)
from wire.server_args import ServerArgs
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)

EARLY_ABORT_TTL = 30.0   # seconds to remember an abort that overtook its request


class Scheduler:
    def __init__(self, args: ServerArgs, addrs: Addresses, ctx: zmq.Context):
        self.args = args
        self.runner = ModelRunner(args)
        self.eos_ids = set(self.runner.config.eos_token_ids)
        self.inbox = Inbox(ctx, addrs.scheduler)
        self.outbox = Outbox(ctx, addrs.detokenizer)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outputs: list[TokenOutput] = []          # sent with the next TokenBatch
        self.early_aborts: dict[str, float] = {}      # rid -> when its abort arrived
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0

    # ---- the loop -----------------------------------------------------------------------

    def run_forever(self) -> None:
        while True:
            idle = not (self.waiting or self.running)
            for msg in self.inbox.recv(timeout_ms=None if idle else 0):
                self.handle(msg)
            segments = self.schedule()
            if segments:
                self.finish_step(segments, self.runner.forward(segments))
            if self.outputs:
                self.outbox.send(TokenBatch(self.outputs, self.load()))
                self.outputs = []

    # ---- inbox --------------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedRequest):
            self.add(Req(msg))
        elif isinstance(msg, AbortRequest):
            self.abort(msg)
        elif isinstance(msg, ReleaseRequest):
            for req in self._find(lambda r: r.rid in msg.rids):
                self.finish(req, FinishReason("abort", message="Released by the detokenizer."))
        else:
            log.error("unexpected message %s", type(msg).__name__)

    def add(self, req: Req) -> None:
        self._expire_early_aborts()
        if self.early_aborts.pop(req.rid, None) is not None:
            self.finish(req, FinishReason("abort", message="Aborted by the client."))
        elif req.max_total_tokens > self.runner.pool_size:
            self.finish(req, FinishReason(
                "abort", status_code=400,
                message=f"The request needs {req.max_total_tokens} KV slots (prompt + "
                        f"max_new_tokens) but the pool has {self.runner.pool_size}."))
        elif req.sampling.max_new_tokens == 0:
            self.finish(req, FinishReason("length", length=0))
        else:
            self.waiting.append(req)

    def abort(self, msg: AbortRequest) -> None:
        found = self._find(lambda r: msg.abort_all or r.rid == msg.rid)
        for req in found:
            self.finish(req, FinishReason("abort", message=msg.message))
        if not found and not msg.abort_all:
            self.early_aborts[msg.rid] = time.monotonic()

    def _find(self, pred) -> list[Req]:
        return [r for r in (*self.running, *self.waiting) if pred(r)]

    def _expire_early_aborts(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self.early_aborts.items() if now - t > EARLY_ABORT_TTL]:
            del self.early_aborts[rid]

    # ---- scheduling ---------------------------------------------------------------------

    def reserved(self) -> int:
        """KV slots promised to admitted requests but not yet allocated."""
        return sum(r.max_total_tokens - r.num_computed for r in self.running)

    def can_admit(self, req: Req) -> bool:
        return (len(self.running) < self.args.max_running_requests and
                self.runner.pool.num_free - self.reserved() >= req.max_total_tokens)

    def schedule(self) -> list[Segment]:
        budget = self.args.chunked_prefill_size
        segments: list[Segment] = []
        for req in self.running:
            todo = req.seq_len - req.num_computed
            n = todo if todo == 1 else min(todo, budget)
            if n == 0:
                continue
            if todo > 1:
                budget -= n
            segments.append(Segment(req, req.num_computed, n, sample=n == todo))
        while self.waiting and budget > 0 and self.can_admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.prompt_tokens_total += len(req.input_ids)
            req.row = self.runner.req_to_token.allocate()
            self.running.append(req)
            n = min(req.seq_len, budget)
            budget -= n
            segments.append(Segment(req, 0, n, sample=n == req.seq_len))
        now = time.monotonic()
        for seg in segments:
            req = seg.req
            if req.queue_time is None:
                req.queue_time = now - req.arrived_at
            slots = self.runner.pool.allocate(seg.length)
            self.runner.req_to_token.write(req.row, seg.start, slots)
            req.slots += slots
        segments.sort(key=lambda s: s.length != 1)   # decode rows first (see attention.py)
        return segments

    # ---- results ------------------------------------------------------------------------

    def finish_step(self, segments: list[Segment], next_ids: list[int]) -> None:
        sampled = [s.req for s in segments if s.sample]
        self.generated_tokens_total += len(next_ids)
        for req, token in zip(sampled, next_ids):
            req.output_ids.append(token)
            reason = self.check_finished(req, token)
            if reason is not None:
                self.finish(req, reason, new_ids=[token])
            else:
                self.emit(req, [token], None)

    def check_finished(self, req: Req, token: int) -> FinishReason | None:
        s = req.sampling
        if len(req.output_ids) >= s.max_new_tokens:
            return FinishReason("length", length=s.max_new_tokens)
        if len(req.output_ids) > s.min_new_tokens:
            if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
                return FinishReason("stop", matched_token=token)
        return None

    def finish(self, req: Req, reason: FinishReason, new_ids: list[int] | None = None) -> None:
        """End a request wherever it is and free what it holds."""
        if req.row is not None:
            self.runner.pool.free(req.slots)
            self.runner.req_to_token.free(req.row)
            req.slots, req.row = [], None
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish = reason
        self.emit(req, new_ids or [], reason)

    def emit(self, req: Req, new_ids: list[int], finish: FinishReason | None) -> None:
        self.outputs.append(TokenOutput(
            rid=req.rid, new_ids=new_ids, finish=finish, prompt_tokens=len(req.input_ids),
            cached_tokens=0, queue_time=req.queue_time,
            decode=None if req.announced else req.decode_params()))
        req.announced = True

    # ---- introspection ------------------------------------------------------------------

    def load(self) -> SchedulerLoad:
        pool = self.runner.pool
        return SchedulerLoad(running=len(self.running), queued=len(self.waiting),
                             kv_total=pool.size, kv_free=pool.num_free, kv_evictable=0,
                             prompt_tokens_total=self.prompt_tokens_total,
                             generated_tokens_total=self.generated_tokens_total)
