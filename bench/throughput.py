"""Offline throughput: zserve vs Hugging Face transformers on the same checkpoint.

    python -m bench.throughput [--model-path DIR|FILE.gguf] [--dtype float32|bfloat16]
        [--num-prompts 32] [--input-len 32] [--output-len 128] [--mode batch|single|both]
        [--single-prompts 4] [--url URL] [--skip-hf] [--json PATH] [--server-args "..."]
        [--compare-configs base= dp2="--dp-size 2" tp2="--tp-size 2" ...]

--model-path: an HF checkpoint directory or a GGUF file (or a directory holding one); without
it, the model launch.py serves by default (SmolLM2-135M-Instruct, a Q4_1 GGUF). A GGUF is
served by zserve as it is and loaded by transformers with `gguf_file=` (both dequantize it
to the same float32 weights, then cast them to --dtype).

Workload: num_prompts prompts of input_len random token ids in [10, 700) (seeded), each
generating exactly output_len tokens (greedy, EOS ignored).

- zserve: launch.py is started on a free port (unless --url names a running server),
  warmed up, then
    batch:  all prompts are sent at once as concurrent single-prompt POST /generate requests
            (like a benchmark client); wall = first submit -> last completion.
    single: --single-prompts prompts, one request at a time.
  The server is stopped (SIGTERM) before transformers runs, so the two never share the CPU.
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
the resident memory of its whole process tree after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import shlex
import sys
import tempfile
import time

import httpx
import psutil

from tests.server import Server     # the one harness for launching zserve as a subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKEN_LOW, TOKEN_HIGH = 10, 700     # valid for the tiny tokenizer (754 tokens) too


def gguf_file(model_path: str) -> pathlib.Path | None:
    """The GGUF file model_path stands for (a .gguf, or a directory with exactly one), or
    None for an HF checkpoint directory."""
    from scheduler_proc.models.gguf import find_gguf
    return find_gguf(model_path)


def model_config(model_path: str) -> dict:
    """config.json's contents, or what it would say for a GGUF (from its metadata)."""
    gguf = gguf_file(model_path)
    if gguf is not None:
        from scheduler_proc.models.gguf import config_dict, read_header
        return config_dict(read_header(gguf))
    return json.loads((pathlib.Path(model_path) / "config.json").read_text())


# ---------------------------------------------------------------------------------------
# Workload and model facts


def make_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)] for _ in range(num)]


def matmul_params(model_path: str) -> dict:
    """Parameter counts from the config: those used in matmuls per token, and all."""
    cfg = model_config(model_path)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    layers = cfg["num_hidden_layers"]
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    lm_head = h * vocab
    tied = cfg.get("tie_word_embeddings", False)
    norms = layers * 2 * h + h
    total = layers * per_layer + lm_head + (0 if tied else h * vocab) + norms
    on_disk = cfg.get("dtype") or cfg.get("torch_dtype")
    if (gguf := gguf_file(model_path)) is not None:     # e.g. "GGUF Q4_1 + F32"
        from scheduler_proc.models.gguf import read_header
        types = sorted({t.type_name for t in read_header(gguf).tensors.values()})
        on_disk = "GGUF " + " + ".join(types)
    return {"matmul": layers * per_layer + lm_head, "total": total, "layers": layers,
            "tied": tied, "dtype_on_disk": on_disk}


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
    return {"input_ids": ids,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                "ignore_eos": True}}


def _check(resp: httpx.Response, output_len: int) -> dict:
    if resp.status_code != 200:
        raise RuntimeError(f"/generate returned {resp.status_code}: {resp.text[:500]}")
    out = resp.json()
    meta = out["meta_info"]
    if meta["completion_tokens"] != output_len:
        print(f"# warning: a request generated {meta['completion_tokens']} tokens, not "
              f"{output_len} (finish_reason {meta.get('finish_reason')})", file=sys.stderr)
    return meta


def _tpot(meta: dict) -> float | None:
    n = meta.get("completion_tokens", 0)
    if n < 2 or meta.get("e2e_latency") is None or meta.get("first_token_latency") is None:
        return None
    return (meta["e2e_latency"] - meta["first_token_latency"]) / (n - 1)


async def _zserve_concurrent(url: str, prompts, output_len: int):
    limits = httpx.Limits(max_connections=len(prompts) + 4,
                          max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        async def one(ids):
            r = await client.post("/generate", json=_body(ids, output_len))
            return _check(r, output_len), time.perf_counter()

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        wall = max(t for _, t in done) - t0
    return [m for m, _ in done], wall


def zserve_warmup(url: str, prompts, output_len: int) -> None:
    with httpx.Client(base_url=url, timeout=None) as c:
        for p in prompts[:2]:
            _check(c.post("/generate", json=_body(p, 8)), 8)
    asyncio.run(_zserve_concurrent(url, prompts, min(4, output_len)))


def zserve_batch(url: str, prompts, output_len: int, dtype: str) -> dict:
    metas, wall = asyncio.run(_zserve_concurrent(url, prompts, output_len))
    toks = sum(m["completion_tokens"] for m in metas)
    return _result("zserve", "batch", dtype, len(prompts), toks, wall,
                   [m.get("first_token_latency") for m in metas],
                   [m.get("e2e_latency") for m in metas], [_tpot(m) for m in metas],
                   queue_mean_s=_mean([m.get("queue_time") for m in metas]))


def zserve_single(url: str, prompts, output_len: int, dtype: str) -> dict:
    metas, wall = [], 0.0
    with httpx.Client(base_url=url, timeout=None) as c:
        for p in prompts:
            t0 = time.perf_counter()
            metas.append(_check(c.post("/generate", json=_body(p, output_len)), output_len))
            wall += time.perf_counter() - t0
    toks = sum(m["completion_tokens"] for m in metas)
    return _result("zserve", "single", dtype, len(prompts), toks, wall,
                   [m.get("first_token_latency") for m in metas],
                   [m.get("e2e_latency") for m in metas], [_tpot(m) for m in metas])


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


def print_table(report: dict) -> None:
    rows = report["results"]
    hf = {(r["mode"]): r["tok_s"] for r in rows if r["system"] == "transformers"}
    head = ["system", "mode", "dtype", "reqs", "out tok", "wall s", "tok/s", "zserve/HF",
            "MFU %", "TTFT ms", "TPOT ms", "e2e s", "load"]
    table = []
    for r in rows:
        ratio = None
        if r["system"] == "zserve" and hf.get(r["mode"]):
            ratio = r["tok_s"] / hf[r["mode"]]
        table.append([r["system"], r["mode"], r["dtype"], str(r["num_requests"]),
                      str(r["output_tokens"]), _fmt(r["wall_s"], spec=".2f"),
                      _fmt(r["tok_s"]), _fmt(ratio, spec=".2f"), _fmt(r["mfu"], 100, ".2f"),
                      _fmt(r["ttft_mean_s"], 1000), _fmt(r["tpot_mean_s"], 1000),
                      _fmt(r["e2e_mean_s"], spec=".2f"), _fmt(r.get("load1_after"))])
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h)
              for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    c = report["config"]
    print()
    print(f"model {c['model_path']}  ({report['params']['matmul'] / 1e6:.1f}M matmul params, "
          f"{report['params']['layers']} layers, on disk {report['params']['dtype_on_disk']})  "
          f"dtype {c['dtype']}")
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
    print(line(head))
    print(line(["-" * w for w in widths]))
    for t in table:
        print(line(t))
    print()
    print("batch: all prompts at once (zserve: concurrent HTTP requests, continuous batching; "
          "transformers: one static-batch generate()). single: one request at a time.")
    print("TTFT/TPOT/e2e: zserve from meta_info (server side); transformers measured around "
          "generate() (TTFT: prefill + first token, via a streamer hook).")
    print(f"load: 1-min load average when the run ended (at start: "
          f"{report['load1_at_start']:.1f}). The run itself adds about "
          f"{report['machine']['cpus']}; much more means other work competed for the CPUs "
          f"and the numbers are noisy.")
    if report.get("zserve_startup_s") is not None:
        print(f"zserve startup to /health: {report['zserve_startup_s']:.1f} s")
    compared = [r for r in rows if r.get("config_flags") is not None]
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
    """One zserve server (launched with `flags`, or --url): warm-up, then each mode."""
    server = None
    results = []
    try:
        if args.url:
            url = args.url.rstrip("/")
            wait_health(url, args.url_wait)
        else:
            server, report["zserve_startup_s"] = launch_server(model_path, args.dtype, flags)
            url = server.url
        try:
            info = httpx.get(url + "/server_info", timeout=10).json()
            report["zserve_server_info"] = info
            if info.get("dtype") not in (None, "auto", args.dtype):
                print(f"# warning: the server runs {info['dtype']}, not --dtype "
                      f"{args.dtype}", file=sys.stderr)
            if info.get("model_path") and not same_model(info["model_path"], model_path):
                print(f"# warning: the server serves {info['model_path']}, not "
                      f"{model_path}", file=sys.stderr)
        except Exception:
            pass
        print("# zserve warm-up ...", file=sys.stderr)
        zserve_warmup(url, prompts, args.output_len)
        for mode in modes:
            print(f"# zserve {mode} ...", file=sys.stderr)
            if mode == "batch":
                results.append(zserve_batch(url, prompts, args.output_len, args.dtype))
            else:
                results.append(zserve_single(url, single_prompts, args.output_len, args.dtype))
            if server is not None:
                results[-1]["rss_mb"] = tree_rss_mb(server.proc.pid)
    except Exception:
        if server is not None:
            print(f"# server log tail:\n{server.logs()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            rc = server.terminate()
            print(f"# zserve stopped (exit {rc})", file=sys.stderr)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Throughput: zserve vs transformers.")
    p.add_argument("--model-path", help="an HF checkpoint directory or a GGUF file "
                   "(default: the model launch.py serves without one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here as JSON")
    args = p.parse_args(argv)
    if args.output_len < 1 or args.input_len < 1 or args.num_prompts < 1:
        p.error("lengths and counts must be positive")
    if args.compare_configs and args.url:
        p.error("--compare-configs launches its own servers: drop --url")

    import torch

    if args.model_path is None:
        from launch import default_model
        args.model_path = default_model()
    model_path = str(pathlib.Path(args.model_path).expanduser().absolute())
    params = matmul_params(model_path)
    modes = ["batch", "single"] if args.mode == "both" else [args.mode]
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    single_prompts = prompts[:max(1, min(args.single_prompts, len(prompts)))]

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
    if report["load1_at_start"] > 0.5 * (os.cpu_count() or 1):
        print(f"# warning: 1-min load average is {report['load1_at_start']:.1f} on "
              f"{os.cpu_count()} CPUs: other work is running, numbers will be noisy",
              file=sys.stderr)

    def add(r):
        r["mfu"] = 2 * params["matmul"] * r["tok_s"] / (peak * 1e9) if r["tok_s"] else None
        r["load1_after"] = os.getloadavg()[0]
        report["results"].append(r)
        print(f"# {r['system']} {r['mode']}: {r['tok_s']:.1f} tok/s", file=sys.stderr)

    if not args.skip_zserve:
        configs = [parse_config(c) for c in args.compare_configs] or [("", "")]
        for label, flags in configs:
            results = run_zserve(args, model_path, prompts, single_prompts, modes, report,
                                 shlex.split(args.server_args) + shlex.split(flags))
            for r in results:
                if label:
                    r["system"] = f"zserve[{label}]"
                    r["config_flags"] = flags
                add(r)

    if not args.skip_hf:
        print("# transformers: loading ...", file=sys.stderr)
        model = hf_load(model_path, args.dtype)
        for mode in modes:
            print(f"# transformers {mode} ...", file=sys.stderr)
            if mode == "batch":
                add(hf_batch(model, prompts, args.output_len, args.dtype))
            else:
                add(hf_single(model, single_prompts, args.output_len, args.dtype))
        del model

    # Table order: by mode, zserve first.
    order = {"batch": 0, "single": 1}
    report["results"].sort(key=lambda r: (order[r["mode"]], r["system"] != "zserve"))
    print_table(report)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"# wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
