"""Entry point of the scheduler process: the only scheduler code that knows its sockets. It
feeds the Scheduler core what the inbox receives, and guards it with a watchdog.

Watchdog (--watchdog-timeout S): while the scheduler has work, a step that does not end
within S seconds takes the process down with a stack dump of every thread on stderr (the
server log) and exit status 1; the launcher then shuts the whole server down. It is
faulthandler's C thread, so a stuck step holding the GIL cannot stop it. It is cancelled
before the loop blocks idle (no timer thread, no CPU use), and re-armed at most every
REARM_INTERVAL seconds while busy (arming starts a thread, ~30 us): it fires between S and
S + REARM_INTERVAL seconds after the last step began.

Data parallelism (--dp-size > 1): replica r binds its own address (Addresses.replicas[r]);
its control replies go to the DP controller, which also gets a ReplicaStatus (the load and
how many requests it has received) with every TokenBatch the replica sends.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from multiprocessing.connection import Connection

import zmq

from wire.addresses import Addresses, worker_title
from wire.codec import SCHEDULER_INBOX
from wire.messages import ControlReply, ReplicaStatus, TokenBatch
from wire.proc import run_child
from wire.server_args import ServerConfig
from wire.sockets import Inbox, Outbox

REARM_INTERVAL = 1.0    # seconds
LONGEST_TIMER = 1e9     # seconds (~30 years): faulthandler refuses more than time_t holds


class Watchdog:
    """`progress()` before each step while busy; `pause()` before blocking idle."""

    def __init__(self, timeout: float):
        if not timeout > 0:
            raise ValueError(f"--watchdog-timeout must be positive, got {timeout}")
        self.timer = min(timeout + REARM_INTERVAL, LONGEST_TIMER)
        self.armed_at: float | None = None

    def progress(self) -> None:
        now = time.monotonic()
        if self.armed_at is None or now - self.armed_at >= REARM_INTERVAL:
            faulthandler.dump_traceback_later(self.timer, exit=True, file=sys.stderr)
            self.armed_at = now

    def pause(self) -> None:
        if self.armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self.armed_at = None


def serve(scheduler, inbox: Inbox, watchdog: Watchdog) -> None:
    """The loop: block for messages only when idle, then one step."""
    while True:
        idle = scheduler.idle
        if idle:
            watchdog.pause()
        msgs = inbox.recv(timeout_ms=None if idle else 0)
        watchdog.progress()
        scheduler.step(msgs)


def main(config: ServerConfig, addrs: Addresses, replica: int, conn: Connection) -> None:
    args = config.args

    def body(ready) -> None:
        # These import torch: after run_child has set the process title.
        from scheduler_proc.kv_manager import KVManager
        from scheduler_proc.runner import ModelRunner
        from scheduler_proc.scheduler import Scheduler
        runner = ModelRunner(config)
        kv = KVManager(pool_size=runner.pool_size, max_running=args.max_running_requests,
                       context_len=config.context_length, device=runner.device,
                       use_cache=not args.disable_radix_cache)
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.replicas[replica], SCHEDULER_INBOX)
        outbox = Outbox(ctx, addrs.detokenizer)
        if addrs.data_parallel:
            controller = Outbox(ctx, addrs.scheduler)

            def send(batch: TokenBatch) -> None:
                outbox.send(batch)
                controller.send(ReplicaStatus(batch.load, scheduler.received_total))
            scheduler = Scheduler(args, runner, kv, send, controller.send, replica)
        else:
            to_api = [Outbox(ctx, a) for a in addrs.api]

            def reply(msg: ControlReply) -> None:
                if 0 <= msg.api < len(to_api):      # else a forged request's: nobody asked
                    to_api[msg.api].send(msg)
            scheduler = Scheduler(args, runner, kv, outbox.send, reply)
        watchdog = Watchdog(args.watchdog_timeout)
        ready({"max_total_tokens": runner.pool_size, "context_length": config.context_length,
               "dtype": config.dtype, "device": str(runner.device)})
        serve(scheduler, inbox, watchdog)
    run_child(worker_title("scheduler", replica), args.log_level, conn, body,
              ipc_dir=addrs.ipc_dir)
