"""A tensor-parallel follower: ranks 1..T-1 of a replica. No sockets, no scheduler: a follower
holds its shard of the model and of the KV cache (a ModelRunner built with its group) and a
mirror of rank 0's request table, and executes every plan rank 0 broadcasts.

    run_follower(config, group, watchdog, ready)     # scheduler_proc/process.py, ranks > 0

The protocol, against rank 0's ModelRunner (runner.py):
1. every rank builds ModelRunner(config, tp=group): loads its shard; the KV pool size is
   agreed on inside (all_reduce_min), so the constructions must run together;
2. rank 0 builds its KVManager and calls runner.share_table(kv.req_to_token); it
   broadcasts TPInit {pool_size, table_rows, table_cols}; a follower builds its table;
3. barrier: every rank is ready (rank 0 reports ready to the launcher after it);
4. per step, rank 0's forward broadcasts a StepPlan; each follower applies the plan's
   table writes and runs runner.execute on it, making the same collectives as rank 0.
A plan with `stop` set ends the loop (rank 0: runner.stop_followers(); the tests use it, the
server does not: its ranks end when the launcher stops them, or with a peer gone).

Faults: anything that fails here (a frame that does not decode, a write outside the table,
an error in the model, a peer gone) leaves the group's state unknown. It propagates as a
TPFault, the process exits non-zero and the launcher takes the server down.

Watchdog (process.py): a follower blocks in the broadcast whenever the server is idle, so
the timer is paused while it waits for a plan and armed while it executes one.
"""

from __future__ import annotations

import logging

from scheduler_proc.pool import ReqToToken
from scheduler_proc.runner import ModelRunner, plan_embeds
from models.distributed import TPFault
from wire.codec import TP_FOLLOWER, DecodeError, decode
from wire.messages import StepPlan, TPInit
from wire.server_args import ServerConfig

log = logging.getLogger(__name__)


def run_follower(config: ServerConfig, group, watchdog, ready=None) -> None:
    """Rank group.rank > 0: build this rank's runner (together with the other ranks'), then
    follow rank 0 until it sends stop. ready(): called once every rank is loaded and has
    its table (after the startup barrier)."""
    follow(ModelRunner(config, tp=group), watchdog, ready)


def follow(runner: ModelRunner, watchdog, ready=None) -> None:
    """The follower loop (module docstring). watchdog: process.Watchdog, or anything with
    pause() and progress(). ready(): called once, after the startup barrier."""
    group = runner.tp
    if group.size < 2 or group.rank == 0:
        raise ValueError(f"rank {group.rank} of {group.size} is not a follower")
    table = _receive_init(runner)
    group.barrier()
    if ready is not None:
        ready()
    log.info("tensor-parallel rank %d of %d following rank 0", group.rank, group.size)
    while True:
        watchdog.pause()                    # idle until rank 0 has a step
        try:
            if not _step(runner, table, watchdog):
                return
        except TPFault:
            raise
        except Exception as e:              # a peer gone mid-collective, a bad write...
            raise TPFault(f"tensor-parallel step failed on rank {group.rank}: {e!r}") from e


def _step(runner: ModelRunner, table: ReqToToken, watchdog) -> bool:
    """Receive one plan and execute it; False when it says stop."""
    plan = _receive(runner.tp, StepPlan)
    watchdog.progress()
    if plan.stop:
        return False
    for w in plan.table_writes:
        table.write(w.row, w.start, w.slots)
    if plan.lora_loads:
        runner.apply_lora_loads(plan.lora_loads)
    runner.execute(plan, table.table,
                   embeds=plan_embeds(plan, runner.device, runner.model.config.hidden_size))
    return True


def _receive_init(runner: ModelRunner) -> ReqToToken:
    """TPInit -> this follower's request table (all zeros, as rank 0's is at this point)."""
    init = _receive(runner.tp, TPInit)
    if init.pool_size != runner.pool_size:
        raise TPFault(f"rank 0 says the KV pool has {init.pool_size} slots, this rank "
                      f"agreed on {runner.pool_size}")
    if init.table_rows < 1 or init.table_cols < 1:
        raise TPFault(f"rank 0 sent a {init.table_rows} x {init.table_cols} request table")
    return ReqToToken(init.table_rows, init.table_cols, runner.device)


def _receive(group, kind: type):
    """The next frame rank 0 broadcasts, which must be a `kind`."""
    frame = group.broadcast_bytes(None)
    try:
        msg = decode(frame, TP_FOLLOWER)
    except DecodeError as e:
        raise TPFault(f"rank {group.rank} received a bad frame from rank 0: {e}") from None
    if not isinstance(msg, kind):
        raise TPFault(f"rank {group.rank} expected a {kind.__name__} from rank 0, got a "
                      f"{type(msg).__name__}")
    return msg
