"""Per-request state in the API process and the dispatcher that feeds it.

Identity: a client names a request with its rid (`RequestState.user_rid`, what meta_info and
/abort_request use); on the wire every submission gets an internal id of its own
(`RequestState.rid`, unique for the life of this process), so a rid reused by a client can
never end or receive the outputs of an earlier request that is still being wound down.

Invariants: `Dispatcher.states` holds an internal id from submit until its terminal output
arrives (or the request is ended here: timeout, shutdown, lost pipeline); `Dispatcher.rids`
maps each user rid in flight to its internal id, so a user rid is never in flight twice.
Outputs are stamped and queued by the dispatcher task as they arrive; route handlers consume
them at their own pace. A handler that falls behind (a stream whose client does not read)
never makes outputs pile up as frames: outputs are small deltas, folded together when taken.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from api_proc.metrics import Throughput, clip, metrics, request_line
from api_proc.timing import RequestTiming
from wire.addresses import Addresses
from wire.messages import (AbortRequest, ApiControl, ControlReply, FinishReason,
                           FlushCacheRequest, LoraRequest, PeerAbort, PeerAbortReply,
                           GenerateRequest, LogprobRequest, Logprobs, SchedulerLoad, SpecStats,
                           accept_length,
                           TextBatch, TextOutput, replace)
from wire.codec import API_INBOX, encode
from wire.sockets import AsyncInbox, Outbox

log = logging.getLogger(__name__)
request_log = logging.getLogger("zserve.requests")
PEER_ABORT_TIMEOUT = 5.0    # seconds for the other API processes to answer an abort
LORA_CONTROL_TIMEOUT = 300.0    # seconds an adapter's load, or its unload (which waits for
                                # the requests using it), may take before a 503


def is_admission(out: TextOutput) -> bool:
    """The scheduler's word that a streamed request passed its checks and is queued
    (scheduler.admit): no finish, and no queue time yet (every output after the first
    forward has one)."""
    return out.finish is None and out.queue_time is None and not out.new_ids


class SubmitError(ValueError):
    """A request the dispatcher refuses; the message is for the client (HTTP 400)."""


class DuplicateRid(SubmitError):
    pass


class Unsendable(SubmitError):
    """A request that passed validation but cannot be encoded (e.g. an int wider than
    64 bits, a lone surrogate in a string): a client error, not a server one."""


class QueueFull(SubmitError):
    """--max-queued-requests: the server has as many requests waiting as it may (503)."""

    status = 503


class RequestState:
    """One request as the client sees it: cumulative text and ids, meta, timing.

    Outputs wait in `pending` until taken; `take()` folds every pending output at once into
    the cumulative text, ids and logprobs (so a slow reader costs one delta per output, not
    one frame). `unsent()` hands out what arrived since it was last called (incremental
    frames)."""

    __slots__ = ("rid", "user_rid", "timing", "pending", "arrived", "listener", "text",
                 "output_ids", "last", "logprob", "output_logprobs", "input_logprobs",
                 "text_in_logprobs", "sent", "timer", "route", "priority", "lora")

    def __init__(self, rid: str, logprob: LogprobRequest | None = None,
                 user_rid: str | None = None):
        self.rid = rid
        self.user_rid = rid if user_rid is None else user_rid
        self.timing = RequestTiming()
        self.pending: list[TextOutput] = []
        self.arrived = asyncio.Event()          # set while pending is not empty
        self.listener: asyncio.Event | None = None   # a stream watching several states
        self.text = ""
        self.output_ids: list[int] = []
        self.last: TextOutput | None = None     # the newest output taken
        self.logprob = logprob                  # what logprobs were asked for, if any
        self.output_logprobs = Logprobs()       # cumulative, one entry per output id
        self.input_logprobs: Logprobs | None = None
        self.text_in_logprobs = False           # SGLang's return_text_in_logprobs
        self.sent = (0, 0)                      # text and ids handed out by unsent()
        self.timer: asyncio.TimerHandle | None = None   # --request-timeout
        self.priority = 0                       # its priority (the request log line)
        self.lora: str | None = None            # its LoRA adapter (the request log line)
        self.route: str | None = None           # the route it came through (metrics, logs);
                                                # None: internal (probes, warm-ups)

    def push(self, out: TextOutput) -> None:
        """Queue an output (the dispatcher's side)."""
        self.pending.append(out)
        self.arrived.set()
        if self.listener is not None:
            self.listener.set()

    def take(self) -> TextOutput | None:
        """Fold every pending output in; returns the newest (None if none was pending)."""
        for out in self.pending:
            self.text += out.text
            self.output_ids += out.new_ids
            if out.logprobs is not None:
                self.output_logprobs.extend(out.logprobs)
            if out.input_logprobs is not None:
                self.input_logprobs = out.input_logprobs
            self.last = out
        self.pending = []
        self.arrived.clear()
        return self.last

    async def next(self) -> TextOutput:
        """Wait for at least one output and fold in all that are pending; the newest."""
        await self.arrived.wait()
        out = self.take()
        assert out is not None
        return out

    def unsent(self) -> tuple[str, list[int], Logprobs]:
        """Text, ids and their logprobs taken since the previous call, marked sent."""
        t, i = self.sent
        self.sent = (len(self.text), len(self.output_ids))
        lp = self.output_logprobs
        return self.text[t:], self.output_ids[i:], Logprobs(
            lp.token_ids[i:], lp.logprobs[i:], lp.top_ids[i:], lp.top_logprobs[i:],
            lp.texts[i:], lp.top_texts[i:])

    async def wait_finished(self) -> TextOutput:
        while self.last is None or self.last.finish is None:
            await self.next()
        return self.last

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish is not None

    @property
    def admitted_only(self) -> bool:
        """Nothing has come but the scheduler's admission (is_admission): no text to show."""
        return self.last is not None and is_admission(self.last)   # always the first output

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

    def meta_info(self, incremental_logprobs: Logprobs | None = None) -> dict:
        """meta_info of the newest output; logprobs are the cumulative ones unless an
        increment is given (incremental streaming)."""
        out = self.last
        assert out is not None
        meta = {"id": self.user_rid,
                "finish_reason": out.finish.to_json() if out.finish else None,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens}
        if self.logprob is not None:
            lp = self.output_logprobs if incremental_logprobs is None else \
                incremental_logprobs
            meta["output_token_logprobs"], meta["output_top_logprobs"] = \
                self._logprob_triples(lp)
            if self.input_logprobs is not None:
                meta["input_token_logprobs"], meta["input_top_logprobs"] = \
                    self._logprob_triples(self.input_logprobs)
        if out.finish is not None:
            meta["e2e_latency"] = self.timing.e2e_latency
            meta["first_token_latency"] = self.timing.first_token_latency
            meta["queue_time"] = out.queue_time
            meta["prefill_time"] = out.prefill_time
            meta["decode_time"] = out.decode_time
            meta["inter_token_latency"] = self.timing.mean_inter_token_latency
            if out.spec is not None:
                meta.update(spec_meta(out.spec))
        return meta


@dataclass(frozen=True, slots=True)
class Admission:
    """Limits the dispatcher applies before a request reaches a tokenizer."""

    max_queued: int | None = None       # --max-queued-requests
    timeout: float | None = None        # --request-timeout (waiting plus running)


class Dispatcher:
    """Owns the rid -> RequestState dict and the API end of the pipeline. `index`: which
    API process this is (--api-server-count); it binds that process's inbox, and every
    request it sends names it, so the request's outputs come back here."""

    def __init__(self, addrs: Addresses, admission: Admission = Admission(), index: int = 0):
        ctx = self.ctx = zmq.asyncio.Context()
        self.index = index
        # Internal ids are unique across API processes: process 0's are bare hex numbers,
        # process k's are "k.<hex>".
        self.id_prefix = "" if index == 0 else f"{index}."
        self.inbox = AsyncInbox(ctx, addrs.api[index], API_INBOX)
        # A plain (non-awaiting) send on an asyncio socket: sends never block (no HWM), and
        # aborts must be sendable from cancellation paths that cannot await. One PUSH
        # connected to every tokenizer worker: ZeroMQ hands them messages round-robin.
        self.to_tokenizer = Outbox(ctx, addrs.tokenizer)
        # The other API processes (--api-server-count), for aborts by a rid they own.
        self.peers = {k: Outbox(ctx, a) for k, a in enumerate(addrs.api) if k != index}
        self.peer_aborts: dict[str, tuple[asyncio.Future[int], list[int]]] = {}
        # API processes k > 0: on_stop(kind) when the launcher sends ApiControl "lost"
        # (after every request here has failed) or "drain".
        self.on_stop: Callable[[str], None] | None = None
        self.admission = admission
        self.states: dict[str, RequestState] = {}     # internal id -> state
        self.rids: dict[str, str] = {}                # user rid -> internal id
        self.ids = itertools.count()
        self.submitted = 0                            # requests taken in by this process
        self.throughput = Throughput()                # tokens/s from the loads' counters
        self.busy = asyncio.Event()       # set when a load shows work (the throughput log)
        self.log_requests = False         # --log-requests: prompts and outputs, clipped
        self.lost: str | None = None      # set when the pipeline is gone; then all fail fast
        self.loop: asyncio.AbstractEventLoop | None = None   # set once run() starts
        # The newest load of each scheduler replica (seq grows per replica), and their sum.
        self.loads: dict[int, SchedulerLoad] = {0: SchedulerLoad()}
        self.load = SchedulerLoad()
        self.controls: dict[str, asyncio.Future[ControlReply]] = {}

    def close(self) -> None:
        """Close the sockets and the context (a context left to the garbage collector
        terminates there, and blocks forever while a socket is open)."""
        self.inbox.sock.close(linger=0)
        self.to_tokenizer.sock.close(linger=0)
        for peer in self.peers.values():
            peer.sock.close(linger=0)
        self.ctx.term()

    @property
    def waiting(self) -> int:
        """Requests in flight that the scheduler is not running (its last word on running
        may lag a little: this errs towards counting more waiting). With other API
        processes, the server's running count is not ours to subtract: our requests, at
        most as many as the server has queued."""
        if self.peers:
            return min(len(self.states), self.load.queued)
        return max(len(self.states) - self.load.running, 0)

    def submit(self, reqs: list[GenerateRequest],
               route: str | None = None) -> list[RequestState]:
        """Register and send a group of requests atomically (all or none). Each is sent
        under a fresh internal id; the state keeps the client's rid. `route`: the route
        they came through, for metrics and logs (None: internal requests)."""
        rids = [r.rid for r in reqs]
        dup = next((rid for rid in rids if rid in self.rids), None)
        if dup is None and len(set(rids)) < len(rids):
            dup = next(rid for rid in rids if rids.count(rid) > 1)
        if dup is not None:
            raise DuplicateRid(f"Duplicate request ID {dup!r} is already in flight.")
        limit = self.admission.max_queued
        if limit is not None and self.waiting >= limit:
            if route is not None:
                metrics().rejected.labels("queue_full").inc(len(reqs))
            raise QueueFull(f"The server is busy: {self.waiting} requests are already "
                            f"waiting (--max-queued-requests {limit}). Try again later.")
        sent = [replace(r, rid=f"{self.id_prefix}{next(self.ids):x}", api=self.index)
                for r in reqs]
        try:
            frames = [encode(r) for r in sent]
        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as e:
            raise Unsendable(f"The request has a value that cannot be processed: {e}") from None
        states = []
        for req, wire, frame in zip(reqs, sent, frames):
            state = RequestState(wire.rid, req.logprob, user_rid=req.rid)
            state.route = route
            state.priority = req.priority
            state.lora = req.lora
            self.states[wire.rid] = state
            self.rids[req.rid] = wire.rid
            if self.admission.timeout is not None:
                state.timer = asyncio.get_running_loop().call_later(
                    self.admission.timeout, self.end, state, FinishReason(
                        "abort", status_code=503, message=f"The request timed out after "
                        f"{self.admission.timeout:g} s (--request-timeout)."))
            self.to_tokenizer.send_frame(frame)
            log.debug("request %r runs as %s", req.rid, wire.rid)   # to match child logs
            if self.log_requests and route is not None:
                request_log.info("request %s %s in: %s", req.rid, route, clip(
                    repr(req.text if req.text is not None else
                         req.messages if req.messages is not None else req.input_ids)))
            states.append(state)
        self.submitted += len(states)
        self._count_in_flight()
        return states

    def _count_in_flight(self) -> None:
        metrics().in_flight.set(len(self.states))

    def _finished(self, state: RequestState, out: TextOutput) -> None:
        """A request's terminal output, received or made here: metrics and the log line."""
        self._count_in_flight()
        if state.route is None:
            return
        t = state.timing
        metrics().finished(out, state.route, t.first_token_latency, t.e2e_latency,
                           state.lora, state.priority)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info("%s", request_line(state.user_rid, state.route, out,
                                                t.first_token_latency, t.e2e_latency,
                                                state.priority, state.lora))
            if self.log_requests:
                request_log.info("request %s out: %s", state.user_rid,
                                 clip(repr(state.text + "".join(o.text for o in
                                                                state.pending))))

    def _forget(self, state: RequestState) -> None:
        self.states.pop(state.rid, None)
        if self.rids.get(state.user_rid) == state.rid:
            del self.rids[state.user_rid]
        if state.timer is not None:
            state.timer.cancel()

    def end(self, state: RequestState, finish: FinishReason) -> None:
        """End a request here, at once (timeout, shutdown): its client gets `finish`, the
        pipeline is told to abort it, and whatever it still sends is dropped."""
        if self.states.get(state.rid) is not state:
            return
        if not self.lost:
            self.to_tokenizer.send(AbortRequest(rid=state.rid, message=finish.message or ""))
        self._end_here(state, finish, time.monotonic())

    def _end_here(self, state: RequestState, finish: FinishReason, now: float) -> None:
        """Give state a terminal output made here. It carries the counts of the newest
        output received (what the pipeline will no longer send), so that the log line and
        the token metrics of a timed-out or failed request count the tokens it had."""
        self._forget(state)
        state.timing.mark_output(now, terminal=True)
        seen = state.pending[-1] if state.pending else state.last
        out = TextOutput(state.rid, "", [], finish) if seen is None else TextOutput(
            state.rid, "", [], finish, prompt_tokens=seen.prompt_tokens,
            completion_tokens=seen.completion_tokens, cached_tokens=seen.cached_tokens,
            queue_time=seen.queue_time)
        state.push(out)
        self._finished(state, out)

    def end_all(self, message: str) -> None:
        """Shutdown: every request in flight ends with a 503 and `message`."""
        for state in list(self.states.values()):
            self.end(state, FinishReason("abort", message=message, status_code=503))

    def abort(self, user_rid: str, message: str = "Aborted by the client.") -> None:
        rid = self.rids.get(user_rid)
        if rid is not None and not self.lost:
            self.to_tokenizer.send(AbortRequest(rid=rid, message=message))

    def abort_prefix(self, prefix: str) -> int:
        rids = [rid for rid in self.rids if rid.startswith(prefix)]
        for rid in rids:
            self.abort(rid)
        return len(rids)

    def abort_here(self, rid: str, prefix: bool,
                   message: str = "Aborted by the client.") -> int:
        """Abort this process's requests whose user rid is `rid` (or starts with it)."""
        if prefix:
            return self.abort_prefix(rid)
        found = rid in self.rids
        self.abort(rid, message)
        return int(found)

    async def abort_everywhere(self, rid: str, prefix: bool,
                               timeout: float = PEER_ABORT_TIMEOUT) -> int:
        """abort_here in every API process (a client's requests may have reached any of
        them); the number aborted in all. A peer that does not answer in `timeout` seconds
        counts 0 (it is going down: the launcher takes the server down with it)."""
        n = self.abort_here(rid, prefix)
        if not self.peers or self.lost:
            return n
        req_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.peer_aborts[req_id] = (fut, [len(self.peers), n])
        try:
            for peer in self.peers.values():
                peer.send(PeerAbort(req_id, self.index, rid, prefix, "Aborted by the client."))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return self.peer_aborts[req_id][1][1]
        finally:
            self.peer_aborts.pop(req_id, None)

    def _peer_abort(self, msg: PeerAbort) -> None:
        if msg.from_api in self.peers:
            n = self.abort_here(msg.rid, msg.prefix, msg.message)
            self.peers[msg.from_api].send(PeerAbortReply(msg.req_id, n))

    def _peer_abort_reply(self, msg: PeerAbortReply) -> None:
        pending = self.peer_aborts.get(msg.req_id)
        if pending is None:
            return                                  # late (timed out) or forged
        fut, left_and_count = pending
        left_and_count[0] -= 1
        left_and_count[1] += max(msg.count, 0)
        if left_and_count[0] == 0 and not fut.done():
            fut.set_result(left_and_count[1])

    def _control(self, msg: ApiControl) -> None:
        if msg.kind not in ("lost", "drain"):
            return
        if msg.kind == "lost":
            self.fail_all(msg.message)
        if self.on_stop is not None:
            self.on_stop(msg.kind)

    def abort_unfinished(self, states: list[RequestState]) -> None:
        for s in states:
            if self.states.get(s.rid) is s and not self.lost:
                self.to_tokenizer.send(AbortRequest(rid=s.rid))

    def fail_all(self, message: str) -> None:
        """The pipeline is lost: end every request in flight with a 503."""
        self.lost = message
        now = time.monotonic()
        for state in list(self.states.values()):
            self._end_here(state, FinishReason("abort", message=message, status_code=503),
                           now)

    async def flush_cache(self, timeout: float = 30.0) -> ControlReply:
        return await self._control_request(FlushCacheRequest(uuid.uuid4().hex, api=self.index),
                                           timeout)

    async def lora_control(self, op: str, name: str, path: str = "",
                           timeout: float = LORA_CONTROL_TIMEOUT) -> ControlReply:
        """Load or unload a LoRA adapter (wire/messages.py LoraRequest)."""
        return await self._control_request(LoraRequest(uuid.uuid4().hex, op, name, path,
                                                       api=self.index), timeout)

    async def _control_request(self, msg, timeout: float) -> ControlReply:
        fut = self.controls[msg.req_id] = asyncio.get_running_loop().create_future()
        try:
            self.to_tokenizer.send(msg)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.controls.pop(msg.req_id, None)

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters loaded, as the newest loads say (/v1/models)."""
        return self.load.lora_adapters

    def expect_replicas(self, pools: list[int], lora_adapters: list[str] | None = None
                        ) -> None:
        """Before the first output: replica r's KV pool holds pools[r] tokens, all free,
        and the adapters of --lora-paths are loaded."""
        self.loads = {r: SchedulerLoad(replica=r, kv_total=n, kv_free=n,
                                       lora_adapters=list(lora_adapters or ()))
                      for r, n in enumerate(pools)}
        self.load = total_load(list(self.loads.values()))

    def _update_load(self, load: SchedulerLoad) -> None:
        old = self.loads.get(load.replica)
        if old is None or load.seq < old.seq:   # control replies and batches race: newest
            return                              # wins; an unknown replica is forged
        self.loads[load.replica] = load
        self.load = load if len(self.loads) == 1 else total_load(list(self.loads.values()))
        self.throughput.add(self.load, time.monotonic())
        if self.load.running or self.load.queued:
            self.busy.set()

    def lose_threadsafe(self, message: str) -> None:
        """Called from the supervisor thread when a child dies."""
        self.lost = message
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.fail_all, message)

    async def run(self) -> None:
        """Stamp and route every output to its request's queue."""
        self.loop = asyncio.get_running_loop()
        others = {PeerAbort: self._peer_abort, PeerAbortReply: self._peer_abort_reply,
                  ApiControl: self._control, ControlReply: self._control_reply}
        while True:
            batch = await self.inbox.recv_one()
            if isinstance(batch, TextBatch):
                self._deliver(batch)
            else:                                 # API_INBOX decodes nothing else
                others[type(batch)](batch)

    def _control_reply(self, reply: ControlReply) -> None:
        for load in reply.loads:
            self._update_load(load)
        fut = self.controls.get(reply.req_id)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _deliver(self, batch: TextBatch) -> None:
        """Stamp each output and queue it on its request (the per-step path)."""
        now = time.monotonic()
        if batch.load is not None:
            self._update_load(batch.load)
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue                          # ended here already (timeout, lost, ...)
            terminal = out.finish is not None
            if not is_admission(out):             # not a token: no latency of its own
                state.timing.mark_output(now, terminal, len(out.new_ids))
                if state.route is not None:
                    metrics().output(state.timing.last_gap)
            if terminal:
                self._forget(state)
            state.push(out)
            if terminal:
                self._finished(state, out)


def spec_meta(spec: SpecStats) -> dict:
    """A request's speculative decoding in meta_info, by SGLang's names: verify steps, draft
    tokens and those kept, the share kept, and the tokens a verify step made on average
    (the kept drafts and each step's own token; None before any verify step)."""
    return {"spec_verify_ct": spec.verify_ct, "spec_draft_token_num": spec.draft_tokens,
            "spec_accept_token_num": spec.accepted_tokens,
            "spec_accept_rate": spec.accepted_tokens / spec.draft_tokens
            if spec.draft_tokens else None,
            "spec_accept_length": accept_length(spec.accepted_tokens, spec.verify_ct)}


def total_load(loads: list[SchedulerLoad]) -> SchedulerLoad:
    """The whole server's load: every count summed over the replicas (seq and replica are
    per replica, and meaningless in a sum: 0)."""
    fields = [f for f in SchedulerLoad.__struct_fields__ if f not in ("seq", "replica")]
    total = SchedulerLoad(**{f: sum(getattr(x, f) for x in loads)
                             for f in fields if f not in ("spec_accept_hist", "lora_adapters")})
    # An adapter is usable once every replica has it loaded.
    total.lora_adapters = [n for n in loads[0].lora_adapters
                           if all(n in x.lora_adapters for x in loads)] if loads else []
    hist = [0] * max((len(x.spec_accept_hist) for x in loads), default=0)
    for x in loads:                             # elementwise
        for m, n in enumerate(x.spec_accept_hist):
            hist[m] += n
    total.spec_accept_hist = hist
    return total
