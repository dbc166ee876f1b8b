"""The scheduler loop: admits requests, picks each step's segments, runs the model, and
emits one TokenBatch per step.

A step is a mixed batch: every running request that has finished its prompt decodes one
token, and up to --chunked-prefill-size prompt tokens are prefilled alongside, so a long
prompt delays running decodes by at most one chunk per step.

Memory is overcommitted the way SGLang does it: admission reserves only an estimate of each
running request's remaining tokens (`new_token_ratio` of them). When a step cannot get the
slots it needs, the most recently admitted requests are retracted to the front of the queue
(their KV goes into the prefix cache, their outputs so far are kept) and the estimate is
raised. Invariant: every accepted request gets exactly one terminal output.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import zmq

from scheduler_proc.kv_manager import KVManager
from scheduler_proc.request import Req
from scheduler_proc.runner import ModelRunner, Segment
from wire.addresses import Addresses
from wire.messages import (AbortRequest, ControlReply, FinishReason, FlushCacheRequest,
                           ReleaseRequest, SchedulerLoad, TokenBatch, TokenizedRequest,
                           TokenOutput)
from wire.server_args import ServerArgs
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)

EARLY_ABORT_TTL = 30.0      # seconds to remember an abort that overtook its request
INIT_NEW_TOKEN_RATIO = 0.7  # share of a request's remaining max_new_tokens reserved for it
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600   # per step
HELD_OUTPUT_INTERVAL = 50   # tokens a non-streaming request's output may wait (see emit)


class Scheduler:
    def __init__(self, args: ServerArgs, addrs: Addresses, ctx: zmq.Context):
        self.args = args
        self.runner = ModelRunner(args)
        self.kv = KVManager(self.runner.pool, self.runner.req_to_token,
                            use_cache=not args.disable_radix_cache)
        self.eos_ids = set(self.runner.config.eos_token_ids)
        self.inbox = Inbox(ctx, addrs.scheduler)
        self.outbox = Outbox(ctx, addrs.detokenizer)
        self.to_api = Outbox(ctx, addrs.api)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []              # in admission order
        self.outputs: list[TokenOutput] = []      # sent with the next TokenBatch
        self.early_aborts: dict[str, float] = {}  # rid -> when its abort arrived
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.seq = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.retracted_total = 0

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
            self.add(Req(msg, self.runner.device))
        elif isinstance(msg, AbortRequest):
            self.abort(msg)
        elif isinstance(msg, ReleaseRequest):
            for req in self._find(lambda r: r.rid in msg.rids):
                self.finish(req, FinishReason("abort", message="Released by the detokenizer."))
        elif isinstance(msg, FlushCacheRequest):
            self.flush_cache(msg.req_id)
        else:
            log.error("unexpected message %s", type(msg).__name__)

    def add(self, req: Req) -> None:
        self._expire_early_aborts()
        if self.early_aborts.pop(req.rid, None) is not None:
            self.finish(req, FinishReason("abort", message="Aborted by the client."))
        elif req.max_total_tokens > self.runner.pool_size:
            # Even alone, with every cached prefix evicted, it could not finish.
            self.finish(req, FinishReason(
                "abort", status_code=400,
                message=f"The request needs {req.max_total_tokens} KV slots (prompt + "
                        f"max_new_tokens) but the pool has {self.runner.pool_size}."))
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
        """Slots the running requests are expected to still need (estimated)."""
        return sum(r.seq_len - r.num_computed +
                   math.ceil((r.sampling.max_new_tokens - len(r.output_ids))
                             * self.new_token_ratio) for r in self.running)

    def admit_cost(self, req: Req) -> int:
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        return req.seq_len + math.ceil(remaining * self.new_token_ratio)

    def schedule(self) -> list[Segment]:
        self.make_room()
        budget = self.args.chunked_prefill_size
        segments: list[Segment] = []
        for req in self.running:
            todo = req.seq_len - req.num_computed
            n = todo if todo == 1 else min(todo, budget)
            if n == 0 or n > self.kv.available:
                continue
            budget -= n if todo > 1 else 0
            segments.append(self._segment(req, n, todo))
        room = self.kv.available - self.reserved()
        while (self.waiting and budget > 0 and
               len(self.running) < self.args.max_running_requests and
               (not self.running or self.admit_cost(self.waiting[0]) <= room)):
            req = self.waiting.popleft()
            self.kv.admit(req)
            self.running.append(req)
            if req.cached_tokens is None:
                req.cached_tokens = req.prefix_len
                self.prompt_tokens_total += len(req.input_ids)
            todo = req.seq_len - req.num_computed
            n = min(todo, budget)
            budget -= n
            segments.append(self._segment(req, n, todo))
            room = self.kv.available - self.reserved()
        now = time.monotonic()
        for seg in segments:
            if seg.req.queue_time is None:
                seg.req.queue_time = now - seg.req.arrived_at
        if segments:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                       self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        segments.sort(key=lambda s: s.length != 1)   # decode rows first (see attention.py)
        return segments

    def _segment(self, req: Req, n: int, todo: int) -> Segment:
        """Give req slots for its next n positions. The segment samples when it reaches the
        newest token, unless the request is prefill-only (max_new_tokens 0)."""
        self.kv.extend(req, n)
        return Segment(req, req.num_computed - n, n,
                       sample=n == todo and req.sampling.max_new_tokens > 0)

    def step_need(self) -> int:
        """Slots this step needs at least: one per decoding request, plus the next chunk of
        the oldest request still in its prompt (so a prefill can never starve)."""
        todos = [r.seq_len - r.num_computed for r in self.running]
        prefill = next((t for t in todos if t > 1), 0)
        return todos.count(1) + min(prefill, self.args.chunked_prefill_size)

    def make_room(self) -> None:
        """Retract the newest running requests until this step's minimum fits."""
        while len(self.running) > 1 and self.kv.available < self.step_need():
            self.retract(self.running[-1])

    def retract(self, req: Req) -> None:
        self.kv.release(req)
        if not req.announced:
            req.reset_input_logprobs()
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.retracted_total += 1
        self.new_token_ratio = 1.0
        log.info("retracted %s (%d tokens) to free KV memory", req.rid, req.seq_len)

    # ---- results ------------------------------------------------------------------------

    def finish_step(self, segments: list[Segment], next_ids: list[int]) -> None:
        for seg in segments:        # prefill-only requests end once their prompt is cached
            req = seg.req
            if req.sampling.max_new_tokens == 0 and req.num_computed == req.seq_len:
                self.finish(req, FinishReason("length", length=0))
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
            self.kv.release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish = reason
        self.emit(req, new_ids or [], reason)

    def emit(self, req: Req, new_ids: list[int], finish: FinishReason | None) -> None:
        """Queue req's output for this step's TokenBatch. A request whose tokens nobody
        watches (Req.output_can_wait) sends its first token at once (first-token latency),
        then every HELD_OUTPUT_INTERVAL tokens and at its end, as SGLang does for
        non-streaming requests: with one request on two cores, waking the detokenizer
        and the API for every token cost ~10% of decode speed."""
        if req.held_ids:
            new_ids, req.held_ids = req.held_ids + new_ids, []
        if finish is None and req.announced and req.output_can_wait \
                and len(new_ids) < HELD_OUTPUT_INTERVAL:
            req.held_ids = new_ids
            return
        first = not req.announced
        self.outputs.append(TokenOutput(
            rid=req.rid, new_ids=new_ids, finish=finish, prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens or 0, queue_time=req.queue_time,
            decode=req.decode_params() if first else None,
            logprobs=req.pending_logprobs if new_ids else None,
            input_logprobs=req.input_logprobs if first and req.wants_input_logprobs else None))
        req.pending_logprobs = None
        req.announced = True

    # ---- introspection ------------------------------------------------------------------

    def flush_cache(self, req_id: str) -> None:
        if self.running or self.waiting:
            ok, message = False, "Cache not flushed because there are pending requests."
        else:
            self.kv.flush()
            ok, message = True, "Cache flushed."
        self.to_api.send(ControlReply(req_id, ok, message, self.load()))

    def load(self) -> SchedulerLoad:
        pool = self.runner.pool
        self.seq += 1
        return SchedulerLoad(seq=self.seq, running=len(self.running), queued=len(self.waiting),
                             kv_total=pool.size, kv_free=pool.num_free,
                             kv_evictable=self.kv.evictable,
                             prompt_tokens_total=self.prompt_tokens_total,
                             generated_tokens_total=self.generated_tokens_total,
                             retracted_total=self.retracted_total)
