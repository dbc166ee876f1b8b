"""Entry point of the scheduler process: the only scheduler code that knows its sockets. It
feeds the Scheduler core what the inbox receives, and guards it with a watchdog.

Watchdog (--watchdog-timeout S): while the scheduler has work, a step that does not end
within S seconds takes the process down with a stack dump of every thread on stderr (the
server log) and exit status 1; the launcher then shuts the whole server down. It is
faulthandler's C thread, so a stuck step holding the GIL cannot stop it. It is cancelled
before the loop blocks idle (no timer thread, no CPU use), and re-armed at most every
REARM_INTERVAL seconds while busy (arming starts a thread, ~30 us): it fires between S and
S + REARM_INTERVAL seconds after the last step began.

Tensor parallelism (--tp-size T > 1): T processes per replica, joined by torch.distributed;
rank 0 runs all of the above, ranks > 0 follow it (tp_worker.py). The watchdog guards
every rank: a follower's timer is paused while it waits for rank 0's next step.

Data parallelism (--dp-size > 1): replica r binds its own address (Addresses.replicas[r]);
its control replies go to the DP controller, which also gets a ReplicaStatus (the load and
how many requests it has received) with every TokenBatch the replica sends.
"""

from __future__ import annotations

import faulthandler
import os
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


def threads_per_rank(args) -> int:
    """Intra-op threads of each model process: this node's cores shared by its --dp-size x
    --tp-size / --nnodes model processes (torch would give each one all of them, and
    oversubscribed OpenMP threads spin against each other). OMP_NUM_THREADS overrides."""
    model_procs = args.dp_size * args.tp_size // args.nnodes
    return max(1, len(os.sched_getaffinity(0)) // model_procs)     # the cores we may use


def rank_title(replica: int, rank: int) -> str:
    """Process title of tensor-parallel rank `rank` of replica `replica`: rank 0 is the
    replica's scheduler ("scheduler", "scheduler-1", ...), the others its followers
    ("scheduler-tp1", "scheduler-1-tp1", ...)."""
    base = worker_title("scheduler", replica)
    return base if rank == 0 else f"{base}-tp{rank}"


def main(config: ServerConfig, addrs: Addresses, replica: int, rank: int,
         conn: Connection) -> None:
    """Rank `rank` of replica `replica` (--tp-size ranks each, --dp-size replicas). Rank 0 is
    the scheduler; ranks > 0 are tensor-parallel followers (tp_worker.py) with no sockets of
    their own: they take every step from rank 0's broadcast."""
    args = config.args

    def body(ready) -> None:
        # These import torch: after run_child has set the process title.
        import torch

        from models.distributed import SoloGroup, init_dist_group
        if "OMP_NUM_THREADS" not in os.environ and args.dp_size * args.tp_size > 1:
            torch.set_num_threads(threads_per_rank(args))   # one process: torch's default
        group = SoloGroup() if args.tp_size == 1 else \
            init_dist_group(args.device, addrs.dist[replica], rank, args.tp_size)
        watchdog = Watchdog(args.watchdog_timeout)
        if rank > 0:
            from scheduler_proc.tp_worker import run_follower
            run_follower(config, group, watchdog, ready)
            return
        scheduler, inbox, info = build_scheduler(config, addrs, replica, group)
        ready(info)
        serve(scheduler, inbox, watchdog)
    run_child(rank_title(replica, rank), args.log_level, conn, body, ipc_dir=addrs.ipc_dir)


def build_scheduler(config: ServerConfig, addrs: Addresses, replica: int, group):
    """Rank 0 of a replica: the model (this rank's shard), the KV manager, the sockets and
    the Scheduler core. Returns (scheduler, inbox, ready info); under tensor parallelism
    it returns once every rank holds its shard and its copy of the request table."""
    from models import describe_weights
    from scheduler_proc.grammar import GrammarCompiler
    from scheduler_proc.kv_manager import KVManager
    from scheduler_proc.runner import ModelRunner
    from scheduler_proc.scheduler import Scheduler
    args = config.args
    runner = ModelRunner(config, tp=group)
    kv = KVManager(pool_size=runner.pool_size, max_running=args.max_running_requests,
                   context_len=config.context_length, device=runner.device,
                   use_cache=not args.disable_radix_cache)
    runner.share_table(kv.req_to_token)
    grammars = GrammarCompiler(config.tokenizer_path, runner.config.vocab_size, runner.eos_ids)
    ctx = zmq.Context()
    inbox = Inbox(ctx, addrs.replicas[replica], SCHEDULER_INBOX)
    outbox = Outbox(ctx, addrs.detokenizer)
    if addrs.data_parallel:
        controller = Outbox(ctx, addrs.scheduler)
        balance = args.load_balance_method == "shortest_queue"   # round_robin reads none

        def send(batch: TokenBatch) -> None:
            outbox.send(batch)
            if balance:
                controller.send(ReplicaStatus(batch.load, scheduler.received_total))
        scheduler = Scheduler(args, runner, kv, send, controller.send, replica, grammars)
    else:
        to_api = [Outbox(ctx, a) for a in addrs.api]

        def reply(msg: ControlReply) -> None:
            if 0 <= msg.api < len(to_api):      # else a forged request's: nobody asked
                to_api[msg.api].send(msg)
        scheduler = Scheduler(args, runner, kv, outbox.send, reply, grammars=grammars)
    info = {"max_total_tokens": runner.pool_size, "context_length": config.context_length,
            "dtype": config.dtype, "device": str(runner.device),
            "weights": describe_weights(runner.model)}
    return scheduler, inbox, info
