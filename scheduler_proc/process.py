"""Entry point of the scheduler process."""

from __future__ import annotations

from multiprocessing.connection import Connection

import zmq

from wire.addresses import Addresses
from wire.proc import run_child
from wire.server_args import ServerArgs


def main(args: ServerArgs, addrs: Addresses, conn: Connection) -> None:
    def body(ready) -> None:
        from scheduler_proc.scheduler import Scheduler   # imports torch: after the title is set
        scheduler = Scheduler(args, addrs, zmq.Context())
        r = scheduler.runner
        ready({"max_total_tokens": r.pool_size, "context_length": r.context_len,
               "dtype": str(r.dtype).removeprefix("torch."), "device": str(r.device)})
        scheduler.run_forever()
    run_child("scheduler", args.log_level, conn, body)
