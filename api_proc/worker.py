"""API process k > 0 (--api-server-count N): the same app as the launcher's own API process
(process 0), on its own SO_REUSEPORT socket of the same port (api_proc/listener.py), with
its own rid -> state dict and its own inbox (Addresses.api[k]).

It is started once the pipeline is ready and takes its orders from the launcher over its
inbox (wire.messages.ApiControl): "lost" (a child died: fail every request with 503, then
exit at once) and "drain" (graceful shutdown: stop accepting, let requests finish for up to
--shutdown-timeout seconds, exit 0). Like every child it ignores SIGTERM and SIGINT, so
uvicorn's own signal handling is turned off here.
"""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection

from api_proc.listener import bind_listener
from wire.addresses import Addresses, worker_title
from wire.proc import run_child
from wire.server_args import ServerConfig


def main(config: ServerConfig, addrs: Addresses, index: int, scheduler_info: dict,
         pools: list[int], conn: Connection) -> None:
    args = config.args

    def body(ready) -> None:
        listener = bind_listener(args.host, args.port, reuse_port=True)
        from api_proc.app import build_app
        from api_proc.server import make_server
        from api_proc.state import Admission, Dispatcher
        dispatcher = Dispatcher(addrs, Admission(args.max_queued_requests,
                                                 args.request_timeout), index)
        dispatcher.expect_replicas(pools, args.lora_names)
        dispatcher.log_requests = args.log_requests
        app = build_app(config, dispatcher, scheduler_info)
        server = make_server(app, args, dispatcher)
        server.capture_signals = contextlib.nullcontext     # the launcher decides

        def stop(kind: str) -> None:
            if kind == "lost":
                server.shutdown_timeout = 0.0
            server.should_exit = True
        dispatcher.on_stop = stop
        ready()
        server.run(sockets=[listener])
    run_child(worker_title("api", index), args.log_level, conn, body, ipc_dir=addrs.ipc_dir)
