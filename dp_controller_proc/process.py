"""The data-parallel controller (--dp-size D > 1): binds the scheduler's address, so the
tokenizers and the detokenizer talk to it as they would to one scheduler, and spreads the
work over D scheduler replicas (each a whole model with its own KV pool and prefix cache).

- TokenizedRequest: to the replica the policy picks (policy.py).
- AbortRequest and ReleaseRequest: to every replica. A replica that does not hold the rid
  ignores a release, and keeps an abort as an early abort for 30 s (the abort may have
  overtaken its request, scheduler.py): internal rids are unique, so it never matches
  another request. Keeping no rid -> replica map means nothing here grows with traffic.
- FlushCacheRequest and LoraRequest: to every replica; their D ControlReplies are joined
  into one for the API process that asked (ok only if every replica flushed, or loaded or
  unloaded the adapter).
- ReplicaStatus: each replica's load after each step, for shortest_queue.

The replicas' outputs do not pass through here: each replica pushes its TokenBatches to
the one detokenizer, whose loads name their replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq

from dp_controller_proc.policy import POLICIES
from wire.addresses import Addresses
from wire.codec import DP_CONTROLLER_INBOX
from wire.messages import (AbortRequest, ControlReply, FlushCacheRequest, LoraRequest,
                           ReleaseRequest,
                           ReplicaStatus, TokenizedRequest)
from wire.proc import run_child
from wire.server_args import ServerConfig
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)

FLUSH_FORGET_AFTER = 60.0   # seconds: a flush some replica never answered is forgotten
LORA_FORGET_AFTER = 900.0   # an adapter's unload waits for its requests: longer than the
                            # API's wait for it (api_proc/state.py LORA_CONTROL_TIMEOUT)


@dataclass(slots=True)
class FlushJoin:
    api: int
    started: float
    forget_after: float = FLUSH_FORGET_AFTER
    replies: list[ControlReply] = field(default_factory=list)


class Controller:
    """What the controller does with each inbox message, without sockets: `to_replica(r,
    msg)` and `to_api(k, msg)` send. Never raises on a valid message."""

    def __init__(self, replicas: int, method: str, api_servers: int,
                 to_replica: Callable[[int, object], None],
                 to_api: Callable[[int, object], None]):
        self.replicas = replicas
        self.policy = POLICIES[method](replicas)
        self.api_servers = api_servers
        self.to_replica, self.to_api = to_replica, to_api
        self.flushes: dict[str, FlushJoin] = {}
        self.dropped = 0

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedRequest):
            self.to_replica(self.policy.pick(len(msg.input_ids)), msg)
        elif isinstance(msg, (AbortRequest, ReleaseRequest)):
            self.broadcast(msg)
        elif isinstance(msg, (FlushCacheRequest, LoraRequest)):
            self.start_flush(msg)
        elif isinstance(msg, ControlReply):
            self.join_flush(msg)
        elif isinstance(msg, ReplicaStatus) and 0 <= msg.load.replica < self.replicas:
            self.policy.status(msg.load.replica, msg)
        else:
            self.dropped += 1
            log.error("dropped a %s (%d dropped so far)", type(msg).__name__, self.dropped)

    def broadcast(self, msg) -> None:
        for r in range(self.replicas):
            self.to_replica(r, msg)

    def start_flush(self, msg: FlushCacheRequest) -> None:
        now = time.monotonic()
        for req_id in [k for k, j in self.flushes.items()
                       if now - j.started > j.forget_after]:
            del self.flushes[req_id]
        if not 0 <= msg.api < self.api_servers or msg.req_id in self.flushes:
            self.dropped += 1
            return
        self.flushes[msg.req_id] = FlushJoin(msg.api, now, LORA_FORGET_AFTER if isinstance(
            msg, LoraRequest) else FLUSH_FORGET_AFTER)
        self.broadcast(msg)

    def join_flush(self, reply: ControlReply) -> None:
        join = self.flushes.get(reply.req_id)
        if join is None:
            self.dropped += 1
            return
        join.replies.append(reply)
        if len(join.replies) < self.replicas:
            return
        del self.flushes[reply.req_id]
        failed = [r for r in join.replies if not r.ok]
        self.to_api(join.api, ControlReply(
            req_id=reply.req_id, ok=not failed,
            message=(failed or join.replies)[0].message,
            loads=[load for r in join.replies for load in r.loads], api=join.api))


def main(config: ServerConfig, addrs: Addresses, conn: Connection) -> None:
    args = config.args

    def body(ready) -> None:
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.scheduler, DP_CONTROLLER_INBOX)
        replicas = [Outbox(ctx, a) for a in addrs.replicas]
        apis = [Outbox(ctx, a) for a in addrs.api]
        controller = Controller(len(replicas), args.load_balance_method, len(apis),
                                lambda r, msg: replicas[r].send(msg),
                                lambda k, msg: apis[k].send(msg))
        ready()
        while True:
            for msg in inbox.recv(timeout_ms=None):
                controller.handle(msg)
    run_child("dp-controller", args.log_level, conn, body, ipc_dir=addrs.ipc_dir)
