"""Offline throughput: zserve vs Hugging Face transformers, and vs llama.cpp, on the same
checkpoint.

    python -m bench.throughput [--model-path DIR|FILE.gguf] [--dtype float32|bfloat16]
        [--quantization auto|none|gguf|int8]
        [--num-prompts 32] [--input-len 32] [--output-len 128] [--mode batch|single|both]
        [--single-prompts 4] [--url URL] [--skip-hf] [--json PATH] [--server-args "..."]
        [--compare-configs base= dp2="--dp-size 2" tp2="--tp-size 2" ...]
        [--llama-server BIN] [--llama-bench BIN] [--llama-model FILE.gguf]
        [--llama-threads N] [--rounds R]

--model-path: an HF checkpoint directory or a GGUF file (or a directory holding one); without
it, the model launch.py serves by default (SmolLM2-135M-Instruct, a Q4_1 GGUF). A GGUF is
served by zserve as it is and loaded by transformers with `gguf_file=` (both dequantize it
to the same float32 weights, then cast them to --dtype, unless zserve keeps them quantized:
see --quantization).

Workload: num_prompts prompts of input_len random token ids in [10, 700) (seeded), each
generating exactly output_len tokens (greedy, EOS ignored).

- zserve: launch.py is started on a free port (unless --url names a running server),
  warmed up on prompts of its own (as many as the measured ones, none sharing a first id
  with one: nothing the warm-up leaves in the prefix cache serves a measured prompt), its
  prefix cache emptied (POST /flush_cache) before each mode, then
    batch:  all prompts are sent at once as concurrent single-prompt streaming
            POST /generate requests (like a benchmark client); wall = first submit -> last
            stream's end.
    single: --single-prompts prompts (the first of the batch's), one request at a time.
  Every request streams; TTFT is from sending it to the first chunk that holds a token,
  e2e to the end of its stream, both as the client sees them (TPOT = (e2e - TTFT) /
  (tokens - 1)). Each row's cached_tokens (in --json) sums the measured requests'
  meta_info cached_tokens: 0, or the bench warns.
  The server is stopped (SIGTERM) before transformers runs, so the two never share the CPU.
  --quantization X is passed to launch.py (before --compare-configs' flags, so an entry's
  own wins). The `weights` column says what zserve served, from /server_info's
  quantization and dtype: a GGUF's linear layers kept in their own blocks (gguf: e.g.
  "Q4_1+Q8_0 blocks", the types read from the file; a layer of another type is dequantized,
  e.g. ", Q6_K as float32"), "int8 (Q8_0) blocks" (int8), or the dtype (none).
- llama.cpp (--llama-server BIN): llama-server on --llama-model (default: the model, when it
  is a GGUF; for an HF directory, a GGUF of the same model), on a free port with
  -t/-tb --llama-threads (default: torch's thread count, the one zserve runs with),
  -np num_prompts slots, -cb, and -c num_prompts x (input_len + output_len rounded up to
  256). The same prompt ids go to POST /completion {"prompt": ids, "n_predict",
  "ignore_eos": true, "temperature": 0, "repeat_penalty": 1.0, "cache_prompt": false,
  "stream": true} through the same client code as zserve's: the same warm-up prompts, then
  batch (all at once) and single (one at a time), tok/s, TTFT, TPOT and e2e measured the
  same way, at the client (it has no cache to flush: cache_prompt false skips it; its
  cached_tokens is the final chunk's timings.cache_n). llama-server holds back a token that
  ends inside a UTF-8 character until the character is whole, so its first chunk can come a
  token late; zserve's frames carry the ids as they come.
- --rounds R: zserve (each --compare-configs entry in turn), then llama-server, R times,
  alternating. Each server is launched for its turn and stopped after it, so only one is up
  at a time; no launched server (zserve or llama-server) outlives this process (stopped in
  a finally, and on Linux sent SIGTERM by the kernel if this process dies first; SIGTERM
  to this process runs the same cleanup). The table gives every round and, for R > 1, the median of each
  column; "zserve/llama.cpp" is printed per mode as the ratio of the median tok/s, with the
  per-round ratios.
- --llama-bench BIN: `BIN -m FILE -t N -p 0 -n 128 -r 3 -o json` once after the rounds (no
  server up): its tg128 rate (batch-1 decode of 128 tokens, no HTTP, no prefill, mean of 3
  runs) is one more single-mode row, a reference for zserve's single mode.
- transformers: AutoModelForCausalLM in the same dtype, generate() with static batching of
  all prompts (batch) or batch size 1 (single); do_sample=False, min_new_tokens =
  max_new_tokens = output_len (so EOS cannot end a sequence early).

Output tokens/s = total output tokens / wall. MFU = 2 * N * tokens/s / peak, with N the
parameters used in matmuls per token (all linear layers + the LM head; attention score
FLOPs are left out, a few percent at these lengths) and peak the best measured
[2048x2048] @ [2048x2048] matmul rate in the same dtype, on this machine, right now (for
bfloat16 on a CPU without a native bf16 GEMM, where torch's bf16 matmul is far slower than
its float32 one, the float32 rate: bf16 compute there is float32 in effect).
torch.set_num_threads is left at its default in both systems.

--compare-configs LABEL=FLAGS ...: zserve is run once per entry, one server after another,
each with those launch.py flags added (the scale-out flags: --dp-size, --tp-size, ...); a
second table gives each one's tokens/s as a multiple of the first entry's, its mean TTFT and
the resident memory of its whole process tree after the run (for R > 1 rounds, the medians).

--json PATH writes all of it: the configuration, every row (with its round), the servers'
/server_info, the llama-server command, llama-bench's JSON row and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx
import psutil

from bench.table import text_table
from tests.server import Server, die_with_parent, free_port   # the e2e tests' harness

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKEN_LOW, TOKEN_HIGH = 10, 700     # valid for the tiny tokenizer (754 tokens) too


def gguf_file(model_path: str) -> pathlib.Path | None:
    """The GGUF file model_path stands for (a .gguf, or a directory with exactly one), or
    None for an HF checkpoint directory."""
    from models.gguf import find_gguf
    return find_gguf(model_path)


def model_config(model_path: str) -> dict:
    """config.json's contents, or what it would say for a GGUF (from its metadata)."""
    gguf = gguf_file(model_path)
    if gguf is not None:
        from models.gguf import config_dict, read_header
        return config_dict(read_header(gguf))
    return json.loads((pathlib.Path(model_path) / "config.json").read_text())


# ---------------------------------------------------------------------------------------
# Workload and model facts


def make_prompts(num: int, length: int, seed: int,
                 avoid: list[list[int]] = ()) -> list[list[int]]:
    """num prompts of `length` random ids. While the id range allows, no two of them, and
    none of them and a prompt in `avoid`, start with the same id: no prompt can find a
    prefix of its own in a prefix cache that holds only the others."""
    rng = random.Random(seed)
    taken = {p[0] for p in avoid if p}
    free = [i for i in range(TOKEN_LOW, TOKEN_HIGH) if i not in taken]
    firsts = rng.sample(free, min(num, len(free)))
    firsts += [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(num - len(firsts))]
    return [[first] + [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length - 1)]
            for first in firsts]


def warmup_prompts(prompts: list[list[int]], seed: int) -> list[list[int]]:
    """As many warm-up prompts as measured ones, of the same length, none sharing a first
    id with a measured one (so the warm-up leaves nothing in the cache they can use)."""
    return make_prompts(len(prompts), len(prompts[0]), seed + 1_000_003, avoid=prompts)


def matmul_params(model_path: str) -> dict:
    """Parameter counts from the config: those used in matmuls per token, and all. A
    mixture of experts' sparse layer counts its router and the experts_per_token experts a
    token runs (of num_experts held: `total`); Gemma's layers have four norms, Qwen3's and
    Gemma 3's heads q/k norms (counted in `total` only)."""
    from models import ModelConfig

    cfg = model_config(model_path)
    mc = ModelConfig.from_dict(cfg)
    h, vocab, layers = mc.hidden_size, mc.vocab_size, mc.num_layers
    attn = h * mc.q_size + 2 * h * mc.kv_size + mc.q_size * h
    dense_mlp = 3 * h * mc.intermediate_size
    expert = 3 * h * mc.moe_intermediate_size
    router = h * mc.num_experts
    used = held = 0
    for i in range(layers):
        if mc.sparse(i):
            used += attn + router + mc.experts_per_token * expert
            held += attn + router + mc.num_experts * expert
        else:
            used += attn + dense_mlp
            held += attn + dense_mlp
    lm_head = h * vocab
    tied = mc.tie_word_embeddings
    norms = layers * (4 if mc.gemma else 2) * h + h + (
        layers * 2 * mc.head_dim if mc.qk_norm else 0)
    total = held + lm_head + (0 if tied else h * vocab) + norms
    on_disk = cfg.get("dtype") or cfg.get("torch_dtype")
    if (gguf := gguf_file(model_path)) is not None:     # e.g. "GGUF Q4_1 + F32"
        from models.gguf import read_header
        types = sorted({t.type_name for t in read_header(gguf).tensors.values()})
        on_disk = "GGUF " + " + ".join(types)
    return {"matmul": used + lm_head, "total": total, "layers": layers,
            "tied": tied, "dtype_on_disk": on_disk,
            "experts": (f"{mc.experts_per_token} of {mc.num_experts}" if mc.num_experts
                        else None)}


# zserve's linear layers (fused as it fuses them) by their GGUF parts; then the LM head.
_FLOAT_TYPES = {"F32", "F16", "BF16"}


def gguf_linear_types(gguf: pathlib.Path) -> list[tuple[set[str], bool]]:
    """Each linear layer's GGUF tensor types, and whether zserve keeps it in its blocks
    (models/gguf.py: linear_types)."""
    from models import ModelConfig
    from models import gguf as zgguf
    header = zgguf.read_header(gguf)
    config = ModelConfig.from_dict(zgguf.config_dict(header), zgguf.generation_dict(header))
    return list(zgguf.linear_types(header, config).values())


def zserve_weights(info: dict, model_path: str) -> str | None:
    """What a zserve server computes its linear layers with, from /server_info: a GGUF's
    blocks ("Q4_1+Q8_0 blocks"; a layer whose parts are not all of one type the kernels
    run on is dequantized to the dtype), "int8 (Q8_0) blocks", or the dtype."""
    quantization, dtype = info.get("quantization"), info.get("dtype")
    if quantization == "int8":
        return "int8 (Q8_0) blocks"
    if quantization == "gguf":
        if (gguf := gguf_file(model_path)) is None:
            return "gguf blocks"
        kept, cast = set(), set()
        for types, native in gguf_linear_types(gguf):
            (kept if native else cast).update(types)
        label = [f"{'+'.join(sorted(kept))} blocks"] if kept else []
        label += [f"{'+'.join(sorted(cast))} as {dtype}"] if cast else []
        return ", ".join(label)
    return dtype        # none: everything dequantized (or cast) to the dtype


def llama_weights(gguf: pathlib.Path) -> str:
    """What llama.cpp computes a GGUF's linear layers with: the file's own types. For an
    architecture zserve does not read from GGUF (gemma3, qwen3moe: zserve serves those
    from safetensors), the types of the file's matrices and expert stacks (tensors of 2
    dimensions or more, the embedding included)."""
    try:
        types = set().union(*(types for types, _ in gguf_linear_types(gguf)))
    except ValueError:      # models/gguf.py: "unsupported GGUF architecture ..."
        from models.gguf import read_header
        types = {t.type_name for t in read_header(gguf).tensors.values()
                 if len(t.shape) >= 2}
    return "+".join(sorted(types)) + ("" if types <= _FLOAT_TYPES else " blocks")


def measure_peak_gflops(dtype: str, n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps [n x n] @ [n x n] matmul rate in GFLOP/s. A dtype torch computes on a
    slow path (bfloat16 without a native bf16 GEMM: ~0.3 GFLOP/s, a minute per 2048 matmul)
    is timed at 512 instead."""
    import torch

    dt = getattr(torch, dtype)
    x = torch.ones(512, 512, dtype=dt)
    torch.matmul(x, x)                          # warm-up
    t = time.perf_counter()
    torch.matmul(x, x)
    if (probe := time.perf_counter() - t) > 0.05:   # under ~5 GFLOP/s: the slow path
        return 2 * 512 ** 3 / probe / 1e9
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dt)
    b = torch.randn(n, n, generator=g).to(dt)
    c = torch.empty(n, n, dtype=dt)
    torch.matmul(a, b, out=c)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _result(system, mode, dtype, prompts, output_tokens, wall, ttfts, e2es, tpots, **extra):
    return {"system": system, "mode": mode, "dtype": dtype, "num_requests": prompts,
            "output_tokens": output_tokens, "wall_s": wall,
            "tok_s": output_tokens / wall if wall > 0 else None,
            "ttft_mean_s": _mean(ttfts), "e2e_mean_s": _mean(e2es), "tpot_mean_s": _mean(tpots),
            **extra}


# ---------------------------------------------------------------------------------------
# zserve


def launch_server(model_path: str, dtype: str, extra: list[str]) -> tuple[Server, float]:
    """launch.py on a free port, with the same harness the end-to-end tests use; returns the
    server and its startup time to /health in seconds."""
    t0 = time.monotonic()
    server = Server(model_path, "--dtype", dtype, *extra, tmpdir=tempfile.gettempdir(),
                    one_thread=False)
    print(f"# launched zserve on {server.url} (log: {server.log_path})", file=sys.stderr)
    return server, time.monotonic() - t0


def same_model(served: str, model_path: str) -> bool:
    """Whether the server's model_path (for a GGUF: its sidecar directory) is model_path."""
    if os.path.realpath(served) == os.path.realpath(model_path):
        return True
    try:
        ours, theirs = gguf_file(model_path), gguf_file(served)
    except (OSError, ValueError):
        return False
    return ours is not None and theirs is not None and ours.resolve() == theirs.resolve()


def wait_health(url: str, timeout: float) -> None:
    """Wait for an already running server's /health to answer 200."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return
            last = f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise SystemExit(f"no healthy zserve server at {url} after {timeout:.0f}s ({last})")
        time.sleep(0.5)


def _body(ids, output_len: int) -> dict:
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                "ignore_eos": True}}


def _frame(frame: dict) -> tuple[int, dict | None]:
    """One streamed /generate frame: (tokens so far, the answer's facts if it is the
    terminal frame). Frames are cumulative; the terminal one carries the latencies."""
    meta = frame["meta_info"]
    if meta.get("finish_reason") is None:
        return meta["completion_tokens"], None
    return meta["completion_tokens"], {"completion_tokens": meta["completion_tokens"],
                                       "cached_tokens": meta.get("cached_tokens"),
                                       "queue_time": meta.get("queue_time"),
                                       "finish_reason": meta["finish_reason"]}


def flush_cache(url: str, timeout: float = 30.0) -> None:
    """POST /flush_cache, retried while the scheduler still holds requests (it refuses to
    flush then), so that no measured prompt finds its prefix in the cache."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(url + "/flush_cache", json={}, timeout=timeout)
        if r.status_code == 200:
            return
        if r.status_code != 400 or time.monotonic() > deadline:
            raise RuntimeError(f"POST /flush_cache returned {r.status_code}: {r.text[:300]}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------
# llama.cpp


class LlamaServer:
    """llama.cpp's llama-server as a subprocess on a free port, up for one turn.

    Invariant: no llama-server outlives its turn. stop() (from a finally) ends it, SIGTERM then
    SIGKILL, and reaps it; a failed or interrupted startup stops it before raising; if this
    process dies without running either, the kernel sends it SIGTERM."""

    def __init__(self, binary: str, model: str, slots: int, ctx: int, threads: int,
                 timeout: float = 180.0, extra: tuple[str, ...] = ()):
        """extra: more llama-server flags (bench/images.py: --mmproj FILE)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [binary, "-m", model, "-t", str(threads), "-tb", str(threads),
                        "-np", str(slots), "-cb", "-c", str(ctx),
                        "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.log_path = pathlib.Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent())
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:                     # /health answers 503 while the model loads
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n"
                                   f"{self.logs()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"llama-server not healthy after {timeout:.0f}s:\n"
                                   f"{self.logs()[-4000:]}")
            time.sleep(0.2)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def llama_slot_context(input_len: int, output_len: int) -> int:
    """One slot's context: a prompt and its output (at least the warm-up's 8 tokens), rounded
    up to 256 (-c is divided evenly among the -np slots)."""
    need = input_len + max(output_len, 8) + 1
    return -(-need // 256) * 256


def _llama_body(ids, output_len: int) -> dict:
    return {"prompt": ids, "n_predict": output_len, "ignore_eos": True, "temperature": 0,
            "repeat_penalty": 1.0, "cache_prompt": False, "stream": True}


def _llama_frame(frame: dict) -> tuple[int, dict | None]:
    """One streamed /completion chunk: a partial per token (text held back while it is an
    incomplete UTF-8 sequence), then the final one ("stop": true, with timings)."""
    n = frame.get("tokens_predicted", 0)
    if not frame.get("stop"):
        return n, None
    timings = frame.get("timings") or {}
    return n, {"completion_tokens": n, "cached_tokens": timings.get("cache_n"),
               "finish_reason": frame.get("stop_type")}


def run_llama_bench(binary: str, model: str, threads: int, n_gen: int = 128,
                    reps: int = 3) -> tuple[dict, dict]:
    """llama-bench's batch-1 decode rate (tg): (a single-mode result row, its JSON row)."""
    cmd = [binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(n_gen),
           "-r", str(reps), "-o", "json"]
    print(f"# llama-bench: {shlex.join(cmd)}", file=sys.stderr)
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          preexec_fn=die_with_parent())
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}:\n{done.stderr[-2000:]}")
    row = next(r for r in json.loads(done.stdout) if r["n_prompt"] == 0 and r["n_gen"] == n_gen)
    samples = row.get("samples_ns") or [row["avg_ns"]] * reps
    tok_s = row["avg_ts"]                       # llama-bench's own: mean of the runs' rates
    result = _result(f"llama-bench tg{n_gen}", "single", "-", len(samples),
                     n_gen * len(samples), sum(samples) / 1e9, [None], [s / 1e9 for s in samples],
                     [1 / tok_s], command=shlex.join(cmd), stddev_tok_s=row.get("stddev_ts"))
    result["tok_s"] = tok_s
    return result, row


# ---------------------------------------------------------------------------------------
# The client, one for both servers: one POST per prompt


@dataclasses.dataclass(frozen=True)
class Api:
    """How a server takes one prompt of ids, streamed: body(ids, output_len) is the JSON to
    POST to route; frame(chunk) reads one streamed JSON chunk as (tokens generated so far,
    the answer's facts if it is the last: completion_tokens, cached_tokens, ...); flush(url),
    if the server has one, empties its prefix cache (llama-server: none; every body sends
    "cache_prompt": false instead)."""
    system: str
    route: str
    body: Callable[[list[int], int], dict]
    frame: Callable[[dict], tuple[int, dict | None]]
    flush: Callable[[str], None] | None


ZSERVE = Api("zserve", "/generate", _body, _frame, flush_cache)
LLAMA = Api("llama.cpp", "/completion", _llama_body, _llama_frame, None)


def _tpot(meta: dict) -> float | None:
    n = meta.get("completion_tokens", 0)
    if n < 2 or meta.get("e2e_latency") is None or meta.get("first_token_latency") is None:
        return None
    return (meta["e2e_latency"] - meta["first_token_latency"]) / (n - 1)


async def _stream(api: Api, client: httpx.AsyncClient, ids, output_len: int):
    """One streamed request as its client sees it: (its facts, with first_token_latency
    from sending it to the first chunk that holds a token and e2e_latency to the end of the
    stream; the time the stream ended)."""
    t0 = time.perf_counter()
    first = facts = None
    async with client.stream("POST", api.route, json=api.body(ids, output_len)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{api.route} returned {r.status_code}: "
                               f"{(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n, last = api.frame(json.loads(line[len("data: "):]))
            if first is None and n > 0:
                first = time.perf_counter()
            facts = last or facts
    end = time.perf_counter()
    if facts is None:
        raise RuntimeError(f"{api.route}: the stream ended without its last chunk")
    if facts["completion_tokens"] != output_len:
        print(f"# warning: a {api.system} request generated {facts['completion_tokens']} "
              f"tokens, not {output_len} (finish {facts.get('finish_reason')})",
              file=sys.stderr)
    return {**facts, "first_token_latency": None if first is None else first - t0,
            "e2e_latency": end - t0}, end


async def _post_concurrent(api: Api, url: str, prompts, output_len: int):
    limits = httpx.Limits(max_connections=len(prompts) + 4,
                          max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_stream(api, client, p, output_len) for p in prompts))
        wall = max(t for _, t in done) - t0
    return [m for m, _ in done], wall


async def _post_sequential(api: Api, url: str, prompts, output_len: int):
    # A new connection per request, for both servers alike: llama-server may close the one a
    # stream came on, and a request sent on it then gets "disconnected without a response".
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        metas, wall = [], 0.0
        for p in prompts:
            t0 = time.perf_counter()
            meta, end = await _stream(api, client, p, output_len)
            metas.append(meta)
            wall += end - t0
    return metas, wall


def warmup(api: Api, url: str, prompts, output_len: int) -> None:
    """Two requests one at a time, then all of `prompts` at once (the batch shape). The
    prompts must not be the measured ones: zserve would keep them in its prefix cache."""
    asyncio.run(_post_sequential(api, url, prompts[:2], min(8, output_len)))
    asyncio.run(_post_concurrent(api, url, prompts, min(4, output_len)))


def _cached(metas) -> int | None:
    cached = [m.get("cached_tokens") for m in metas]
    return None if None in cached else sum(cached)


def run_batch(api: Api, url: str, prompts, output_len: int, dtype: str) -> dict:
    metas, wall = asyncio.run(_post_concurrent(api, url, prompts, output_len))
    toks = sum(m["completion_tokens"] for m in metas)
    return _result(api.system, "batch", dtype, len(prompts), toks, wall,
                   [m.get("first_token_latency") for m in metas],
                   [m.get("e2e_latency") for m in metas], [_tpot(m) for m in metas],
                   queue_mean_s=_mean([m.get("queue_time") for m in metas]),
                   cached_tokens=_cached(metas))


def run_single(api: Api, url: str, prompts, output_len: int, dtype: str) -> dict:
    metas, wall = asyncio.run(_post_sequential(api, url, prompts, output_len))
    toks = sum(m["completion_tokens"] for m in metas)
    return _result(api.system, "single", dtype, len(prompts), toks, wall,
                   [m.get("first_token_latency") for m in metas],
                   [m.get("e2e_latency") for m in metas], [_tpot(m) for m in metas],
                   cached_tokens=_cached(metas))


# ---------------------------------------------------------------------------------------
# Hugging Face transformers


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives.

    generate() calls put() once with the prompt, then once per step with the new tokens."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def _hf_generate(model, ids, output_len: int):
    import torch

    x = torch.tensor(ids, dtype=torch.long)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len,
            pad_token_id=model.generation_config.pad_token_id, streamer=clock,
            temperature=None, top_p=None, top_k=None)
    t1 = time.perf_counter()
    new = out.shape[1] - x.shape[1]
    if new != output_len:
        print(f"# warning: transformers generated {new} tokens, not {output_len}",
              file=sys.stderr)
    ttft = (clock.first - t0) if clock.first is not None else None
    return new * x.shape[0], t1 - t0, ttft


def hf_load(model_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    gguf = gguf_file(model_path)
    if gguf is not None:        # transformers dequantizes it to float32, then casts to dtype
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    return model


def hf_batch(model, prompts, output_len: int, dtype: str) -> dict:
    _hf_generate(model, prompts, min(4, output_len))  # warm-up at the batch shape
    toks, wall, ttft = _hf_generate(model, prompts, output_len)
    tpot = (wall - ttft) / (output_len - 1) if ttft is not None and output_len > 1 else None
    # Static batching: every sequence starts and ends together.
    return _result("transformers", "batch", dtype, len(prompts), toks, wall,
                   [ttft], [wall], [tpot])


def hf_single(model, prompts, output_len: int, dtype: str) -> dict:
    _hf_generate(model, prompts[:1], min(4, output_len))  # warm-up at batch size 1
    toks, wall, ttfts, e2es, tpots = 0, 0.0, [], [], []
    for p in prompts:
        n, w, ttft = _hf_generate(model, [p], output_len)
        toks, wall = toks + n, wall + w
        ttfts.append(ttft)
        e2es.append(w)
        tpots.append((w - ttft) / (n - 1) if ttft is not None and n > 1 else None)
    return _result("transformers", "single", dtype, len(prompts), toks, wall,
                   ttfts, e2es, tpots)


# ---------------------------------------------------------------------------------------
# Report


def _fmt(x, scale=1.0, spec=".1f", none="-"):
    return none if x is None else format(x * scale, spec)


_MEDIAN_KEYS = ("wall_s", "tok_s", "ttft_mean_s", "e2e_mean_s", "tpot_mean_s", "queue_mean_s",
                "mfu", "rss_mb")


def median_rows(rows: list[dict]) -> list[dict]:
    """For each (system, mode) run in more than one round: a row of the rounds' medians."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if isinstance(r.get("round"), int):
            groups.setdefault((r["system"], r["mode"]), []).append(r)
    out = []
    for runs in groups.values():
        if len(runs) < 2:
            continue
        m = {**runs[0], "round": "median", "load1_after": None}
        for key in _MEDIAN_KEYS:
            values = [r.get(key) for r in runs]
            m[key] = None if None in values else statistics.median(values)
        cached = [r.get("cached_tokens") for r in runs]     # over all the rounds
        m["cached_tokens"] = None if None in cached else sum(cached)
        out.append(m)
    return out


def llama_ratios(rows: list[dict]) -> dict:
    """zserve tok/s over llama.cpp's, per zserve system (each --compare-configs entry) and
    mode: per round, and of the medians over the rounds."""
    llama = {(r["mode"], r["round"]): r["tok_s"] for r in rows
             if r["system"] == "llama.cpp" and isinstance(r.get("round"), int)}
    out: dict = {}
    for r in rows:
        if r["system"].startswith("zserve") and (r["mode"], r.get("round")) in llama:
            entry = out.setdefault(r["system"], {}).setdefault(r["mode"], {"zserve": [],
                                                                           "llama": []})
            entry["zserve"].append(r["tok_s"])
            entry["llama"].append(llama[r["mode"], r["round"]])
    for modes in out.values():
        for entry in modes.values():
            entry["per_round"] = [z / l for z, l in zip(entry["zserve"], entry["llama"])]
            entry["of_medians"] = (statistics.median(entry.pop("zserve"))
                                   / statistics.median(entry.pop("llama")))
    return out


_LEFT = {"system", "mode", "round", "dtype", "weights"}


def print_table(report: dict) -> None:
    rows = report["results"]
    c = report["config"]
    rounds = c["rounds"] > 1
    hf = {(r["mode"]): r["tok_s"] for r in rows if r["system"] == "transformers"}
    llama = {(r["mode"], r.get("round")): r["tok_s"] for r in rows if r["system"] == "llama.cpp"}
    head = ["system", "mode", *(["round"] if rounds else []), "dtype", "weights", "reqs",
            "out tok", "wall s", "tok/s", "zserve/HF", *(["zserve/llama"] if llama else []),
            "MFU %", "TTFT ms", "TPOT ms", "e2e s", "load"]
    table = []
    for r in rows:
        ratio = llama_ratio = None
        if r["system"] == "zserve" and hf.get(r["mode"]):
            ratio = r["tok_s"] / hf[r["mode"]]
        if r["system"].startswith("zserve") and llama.get((r["mode"], r.get("round"))):
            llama_ratio = r["tok_s"] / llama[r["mode"], r.get("round")]
        cells = {"system": r["system"], "mode": r["mode"], "round": str(r.get("round") or "-"),
                 "dtype": r["dtype"], "weights": r.get("weights") or "-",
                 "reqs": str(r["num_requests"]), "out tok": str(r["output_tokens"]),
                 "wall s": _fmt(r["wall_s"], spec=".2f"), "tok/s": _fmt(r["tok_s"]),
                 "zserve/HF": _fmt(ratio, spec=".2f"),
                 "zserve/llama": _fmt(llama_ratio, spec=".2f"),
                 "MFU %": _fmt(r["mfu"], 100, ".2f"), "TTFT ms": _fmt(r["ttft_mean_s"], 1000),
                 "TPOT ms": _fmt(r["tpot_mean_s"], 1000),
                 "e2e s": _fmt(r["e2e_mean_s"], spec=".2f"),
                 "load": _fmt(r.get("load1_after"))}
        table.append([cells[h] for h in head])
    print()
    experts = report["params"].get("experts")
    print(f"model {c['model_path']}  ({report['params']['matmul'] / 1e6:.1f}M matmul params "
          f"a token{f' ({experts} experts)' if experts else ''}, "
          f"{report['params']['layers']} layers, on disk {report['params']['dtype_on_disk']})  "
          f"dtype {c['dtype']}")
    if (lc := report.get("llama")) is not None:
        print(f"llama.cpp model {lc['model']}  (linear layers: {lc['weights']})")
    print(f"workload: {c['num_prompts']} prompts (single mode: {c['single_prompts']}) x "
          f"{c['input_len']} input tokens -> {c['output_len']} output tokens each, greedy, "
          f"ignore_eos")
    print(f"machine: {report['machine']['cpus']} CPUs, torch threads {report['torch_threads']} "
          f"(default, set_num_threads not called; the server keeps its own default too)")
    if report["peak_gflops"] == report["dtype_peak_gflops"]:
        print(f"peak: {report['peak_gflops']:.1f} GFLOP/s ({c['dtype']} 2048x2048 matmul, "
              f"best of 5)")
    else:
        print(f"peak: {report['peak_gflops']:.1f} GFLOP/s (float32 2048x2048 matmul, best of "
              f"5: torch's {c['dtype']} one reached only {report['dtype_peak_gflops']:.1f}, "
              f"no native {c['dtype']} GEMM on this CPU)")
    print("MFU = 2 * N_matmul_params * output_tok_per_s / peak_FLOP_per_s "
          "(attention-score FLOPs and prefill not counted)")
    print()
    print(text_table(head, table, left={i for i, h in enumerate(head) if h in _LEFT}))
    print()
    print("batch: all prompts at once (zserve: concurrent HTTP requests, continuous batching; "
          "transformers: one static-batch generate()). single: one request at a time.")
    print("TTFT/TPOT/e2e: servers streamed, as their client sees them (send -> first chunk "
          "holding a token -> end of the stream); warm-up on other prompts, prefix cache "
          "emptied before each mode; transformers measured around generate() (TTFT: "
          "prefill + first token, via a streamer hook).")
    if lc is not None:
        print(f"llama.cpp: {lc['command']} (a free port each turn); the same client as "
              f"zserve's, POST /completion with stream and cache_prompt false.")
    if (lb := report.get("llama_bench")) is not None:
        print(f"llama-bench: {lb.get('command') or '-'}: batch-1 decode after an empty prompt, "
              f"no HTTP; tok/s is its mean over the runs"
              + (f" (+/- {lb['stddev_ts']:.1f})" if lb.get("stddev_ts") is not None else "")
              + (f"; FAILED: {lb['error']}" if lb.get("error") else ""))
    if rounds:
        print(f"round: {c['rounds']} rounds, each server launched for its turn (zserve, then "
              f"llama.cpp, alternating); median: each column's median over the rounds.")
    print(f"load: 1-min load average when the run ended (at start: "
          f"{report['load1_at_start']:.1f}). The run itself adds about "
          f"{report['machine']['cpus']}; much more means other work competed for the CPUs "
          f"and the numbers are noisy.")
    for system, modes in (report.get("llama_ratios") or {}).items():
        if rounds:
            print(f"{system}/llama.cpp tok/s (ratio of the medians; per round): " + "  ".join(
                f"{mode} x{e['of_medians']:.2f} ({' '.join(f'{x:.2f}' for x in e['per_round'])})"
                for mode, e in modes.items()))
        else:
            print(f"{system}/llama.cpp tok/s: " + "  ".join(
                f"{mode} x{e['of_medians']:.2f}" for mode, e in modes.items()))
    if report.get("zserve_startup_s") is not None:
        print(f"zserve startup to /health: {report['zserve_startup_s']:.1f} s")
    if report.get("llama_startup_s") is not None:
        print(f"llama-server startup to /health: {report['llama_startup_s']:.1f} s")
    compared = [r for r in rows if r.get("config_flags") is not None
                and (r.get("round") == "median") == rounds]
    if compared:
        print()
        print("configs (--compare-configs), same workload, one server after another:")
        base = {}
        for r in compared:
            base.setdefault(r["mode"], r["tok_s"])
            print(f"  {r['system']:<24} {r['mode']:<6} {r['tok_s']:8.1f} tok/s  "
                  f"x{r['tok_s'] / base[r['mode']]:.2f} of the first  "
                  f"TTFT {_fmt(r['ttft_mean_s'], 1000)} ms  "
                  f"RSS {_fmt(r.get('rss_mb'), spec='.0f')} MB  flags: {r['config_flags'] or '-'}")


# ---------------------------------------------------------------------------------------


def parse_config(text: str) -> tuple[str, str]:
    """--compare-configs entry "LABEL=FLAGS" (FLAGS may be empty: the base)."""
    label, sep, flags = text.partition("=")
    if not sep or not label:
        raise SystemExit(f"--compare-configs: expected LABEL=FLAGS, got {text!r}")
    return label, flags


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MB."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1e6


def run_zserve(args, model_path: str, prompts, single_prompts, modes, report,
               flags: list[str]) -> list[dict]:
    """One zserve server (launched with `flags`, or --url): warm-up, then each mode. Each
    result says what the server's linear layers ran on (`weights`, from /server_info)."""
    server = None
    if args.url:
        url = args.url.rstrip("/")
        wait_health(url, args.url_wait)
    else:
        server, report["zserve_startup_s"] = launch_server(model_path, args.dtype, flags)
        url = server.url
    with turn_of("zserve", server, server and server.terminate):
        weights = None
        try:
            info = httpx.get(url + "/server_info", timeout=10).json()
            report["zserve_server_info"] = info
            weights = zserve_weights(info, model_path)
            if info.get("dtype") not in (None, "auto", args.dtype):
                print(f"# warning: the server runs {info['dtype']}, not --dtype "
                      f"{args.dtype}", file=sys.stderr)
            if info.get("model_path") and not same_model(info["model_path"], model_path):
                print(f"# warning: the server serves {info['model_path']}, not "
                      f"{model_path}", file=sys.stderr)
        except Exception:
            pass
        return run_modes(ZSERVE, "zserve", url, prompts, single_prompts, modes, args,
                         args.dtype, weights, None if server is None else server.proc.pid)


@contextlib.contextmanager
def turn_of(name: str, server, stop: Callable[[], int] | None):
    """A launched server's turn (zserve's or llama-server's): if the turn fails its log
    tail is printed; however it ends, stop() stops it. server None (--url): nothing."""
    try:
        yield
    except Exception:
        if server is not None:
            print(f"# {name} log tail:\n{server.logs()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            print(f"# {name} stopped (exit {stop()})", file=sys.stderr)


def run_modes(api: Api, name: str, url: str, prompts, single_prompts, modes, args,
              dtype: str, weights: str, pid: int | None) -> list[dict]:
    """One server's turn once it is up: warm-up on prompts of its own (none shares a first
    id with a measured one), then each mode after emptying the server's prefix cache, a
    result row each (with the weights served, the prompt tokens the server says it served
    from a cache, which must be 0, and, for a server launched here, its process tree's
    memory)."""
    print(f"# {name} warm-up ...", file=sys.stderr)
    warmup(api, url, warmup_prompts(prompts, args.seed), args.output_len)
    results = []
    for mode in modes:
        print(f"# {name} {mode} ...", file=sys.stderr)
        if api.flush is not None:
            api.flush(url)
        if mode == "batch":
            results.append(run_batch(api, url, prompts, args.output_len, dtype))
        else:
            results.append(run_single(api, url, single_prompts, args.output_len, dtype))
        results[-1]["weights"] = weights
        if results[-1]["cached_tokens"]:
            print(f"# warning: {name} {mode}: {results[-1]['cached_tokens']} measured prompt "
                  f"tokens were served from its prefix cache", file=sys.stderr)
        if pid is not None:
            results[-1]["rss_mb"] = tree_rss_mb(pid)
    return results


def run_llama(args, llama_model: str, prompts, single_prompts, modes, report) -> list[dict]:
    """One llama-server turn: launched on llama_model with a slot per prompt, warm-up, each
    mode, stopped."""
    slots = len(prompts)
    ctx = slots * llama_slot_context(args.input_len, args.output_len)
    t0 = time.monotonic()
    server = LlamaServer(args.llama_server, llama_model, slots, ctx, args.llama_threads)
    with turn_of("llama-server", server, server.stop):
        report["llama_startup_s"] = time.monotonic() - t0
        report["llama"]["command"] = shlex.join(server.command)
        print(f"# launched llama-server on {server.url} (log: {server.log_path})",
              file=sys.stderr)
        return run_modes(LLAMA, "llama.cpp", server.url, prompts, single_prompts, modes,
                         args, "-", report["llama"]["weights"], server.proc.pid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Throughput: zserve vs transformers and "
                                "llama.cpp.")
    p.add_argument("--model-path", help="an HF checkpoint directory or a GGUF file "
                   "(default: the model launch.py serves without one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", choices=["auto", "none", "gguf", "int8"],
                   help="passed to launch.py (default: not passed, the server's auto)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mode", choices=["batch", "single", "both"], default="both")
    p.add_argument("--single-prompts", type=int, default=4,
                   help="prompts sent one at a time in single mode")
    p.add_argument("--url", help="use an already running zserve server at this URL")
    p.add_argument("--url-wait", type=float, default=120.0,
                   help="seconds to wait for --url's /health to answer 200")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--skip-zserve", action="store_true", help="do not run zserve")
    p.add_argument("--server-args", default="", help="extra launch.py flags (one string)")
    p.add_argument("--compare-configs", nargs="+", default=[], metavar="LABEL=FLAGS",
                   help="run zserve once per entry, one after another, with these launch.py "
                        "flags added (e.g. base= dp2='--dp-size 2' tp2='--tp-size 2'); "
                        "the table gives each one's tok/s relative to the first, and the "
                        "memory of its process tree")
    p.add_argument("--llama-server", metavar="BIN", help="also benchmark llama.cpp's "
                   "llama-server on --llama-model, alternating with zserve (--rounds)")
    p.add_argument("--llama-bench", metavar="BIN", help="also run llama.cpp's llama-bench "
                   "(-p 0 -n 128 -r 3) on --llama-model: a batch-1 decode row")
    p.add_argument("--llama-model", metavar="FILE.gguf", help="the GGUF llama.cpp runs "
                   "(default: --model-path when it is a GGUF; for an HF directory, a GGUF of "
                   "the same model, e.g. made with llama-quantize)")
    p.add_argument("--llama-threads", type=int, help="llama-server -t/-tb and llama-bench -t "
                   "(default: torch's thread count, the one zserve runs with)")
    p.add_argument("--rounds", type=int, default=1, help="run zserve and llama-server this "
                   "many times, alternating; the table adds the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.output_len < 1 or args.input_len < 1 or args.num_prompts < 1:
        p.error("lengths and counts must be positive")
    if args.compare_configs and args.url:
        p.error("--compare-configs launches its own servers: drop --url")
    if args.rounds < 1:
        p.error("--rounds must be positive")
    if args.llama_threads is not None and args.llama_threads < 1:
        p.error("--llama-threads must be positive")
    for flag in ("llama_server", "llama_bench"):
        if (binary := getattr(args, flag)) is not None:
            setattr(args, flag, binary := os.path.expanduser(binary))
            if not os.access(binary, os.X_OK):
                p.error(f"--{flag.replace('_', '-')} {binary}: not an executable file")

    import torch

    if args.model_path is None:
        from launch import default_model
        args.model_path = default_model()
    model_path = str(pathlib.Path(args.model_path).expanduser().absolute())
    llama_model = None
    if args.llama_server or args.llama_bench:
        llama_model = (pathlib.Path(args.llama_model).expanduser().absolute() if args.llama_model
                       else gguf_file(model_path))
        if llama_model is None:
            p.error(f"{model_path} is not a GGUF: pass --llama-model FILE.gguf, a GGUF of "
                    f"the same model, for llama.cpp")
        if not llama_model.is_file():
            p.error(f"--llama-model {llama_model}: no such file")
        llama_model = str(llama_model)
    params = matmul_params(model_path)
    modes = ["batch", "single"] if args.mode == "both" else [args.mode]
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    single_prompts = prompts[:max(1, min(args.single_prompts, len(prompts)))]
    if args.llama_threads is None:
        args.llama_threads = torch.get_num_threads()

    print(f"# measuring {args.dtype} matmul peak ...", file=sys.stderr)
    peak = dtype_peak = measure_peak_gflops(args.dtype)
    if args.dtype != "float32":
        peak = max(dtype_peak, measure_peak_gflops("float32"))
    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "json"},
                   "model_path": model_path, "single_prompts": len(single_prompts)},
        "params": params, "peak_gflops": peak, "dtype_peak_gflops": dtype_peak,
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "mfu_formula": "2 * params_matmul * tok_s / (peak_gflops * 1e9)",
        "zserve_startup_s": None, "load1_at_start": os.getloadavg()[0], "results": [],
    }
    if llama_model is not None:
        report["llama"] = {"model": llama_model,
                           "weights": llama_weights(pathlib.Path(llama_model)),
                           "threads": args.llama_threads, "slots": len(prompts),
                           "ctx": len(prompts) * llama_slot_context(args.input_len,
                                                                    args.output_len),
                           "command": None}
    if report["load1_at_start"] > 0.5 * (os.cpu_count() or 1):
        print(f"# warning: 1-min load average is {report['load1_at_start']:.1f} on "
              f"{os.cpu_count()} CPUs: other work is running, numbers will be noisy",
              file=sys.stderr)

    def add(r):
        r["mfu"] = 2 * params["matmul"] * r["tok_s"] / (peak * 1e9) if r["tok_s"] else None
        r["load1_after"] = os.getloadavg()[0]
        report["results"].append(r)
        where = f" (round {r['round']})" if args.rounds > 1 and r.get("round") else ""
        print(f"# {r['system']} {r['mode']}{where}: {r['tok_s']:.1f} tok/s", file=sys.stderr)

    configs = [parse_config(c) for c in args.compare_configs] or [("", "")]
    quantization = ["--quantization", args.quantization] if args.quantization else []
    for round_ in range(1, args.rounds + 1):    # zserve, llama.cpp, zserve, llama.cpp, ...
        for label, flags in configs if not args.skip_zserve else []:
            results = run_zserve(args, model_path, prompts, single_prompts, modes, report,
                                 shlex.split(args.server_args) + quantization
                                 + shlex.split(flags))
            for r in results:
                if label:
                    r["system"] = f"zserve[{label}]"
                    r["config_flags"] = flags
                r["round"] = round_
                add(r)
        if args.llama_server:
            for r in run_llama(args, llama_model, prompts, single_prompts, modes, report):
                r["round"] = round_
                add(r)
    if args.llama_server:
        report["llama_ratios"] = llama_ratios(report["results"])
    report["results"] += median_rows(report["results"])

    if args.llama_bench:
        try:
            r, report["llama_bench"] = run_llama_bench(args.llama_bench, llama_model,
                                                      args.llama_threads)
            report["llama_bench"]["command"] = r["command"]
            r["weights"] = report["llama"]["weights"]
            add(r)
        except (RuntimeError, ValueError, StopIteration, KeyError) as e:
            print(f"# warning: llama-bench failed: {e}", file=sys.stderr)
            report["llama_bench"] = {"error": str(e).splitlines()[0] if str(e) else repr(e)}

    if not args.skip_hf:
        print("# transformers: loading ...", file=sys.stderr)
        model = hf_load(model_path, args.dtype)
        for mode in modes:
            print(f"# transformers {mode} ...", file=sys.stderr)
            if mode == "batch":
                add(hf_batch(model, prompts, args.output_len, args.dtype))
            else:
                add(hf_single(model, single_prompts, args.output_len, args.dtype))
            report["results"][-1]["weights"] = args.dtype
        del model

    # Table order: by mode, then round (the medians after the rounds, single runs last),
    # zserve first, then llama.cpp, llama-bench, transformers.
    order = {"batch": 0, "single": 1}
    rank = lambda system: (0 if system.startswith("zserve") else 1 if system == "llama.cpp"
                           else 2 if system.startswith("llama-bench") else 3)
    when = lambda r: (r["round"] if isinstance(r.get("round"), int)
                      else args.rounds + (1 if r.get("round") == "median" else 2))
    report["results"].sort(key=lambda r: (order[r["mode"]], when(r), rank(r["system"])))
    print_table(report)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


def _exit_on_sigterm(signum, frame):
    """SIGTERM ends the run as Ctrl-C does: through the finally blocks that stop the servers."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
