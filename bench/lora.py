"""Multi-LoRA throughput and priority latency (issue 26's two targets).

    python -m bench.lora [--model-path DIR] [--adapters 4] [--rank 16] [--num-prompts 32]
        [--input-len 32] [--output-len 128] [--rounds 3] [--skip-lora] [--skip-priority]

--model-path: an HF checkpoint (default: the default model's shape in float32, random
weights: bench.make_checkpoint's smollm2-135m, built into /tmp/zserve-bench/ once).

- Adapters: --adapters random PEFT adapters of --rank on every attention and MLP projection
  of every layer (A ~ N(0, 1/in), B ~ N(0, 0.01): the text is as meaningless as the
  checkpoint's), written as adapter_config.json + adapter_model.safetensors.
- Throughput: --num-prompts streamed /generate requests at once (bench.throughput's
  client: random ids, greedy, EOS ignored, exactly --output-len tokens each), on a server
  without --enable-lora (base), and on one with --enable-lora serving the adapters, the
  prompts spread round-robin over them. Each round launches each server in turn (one up at a
  time), warms it up, and flushes its prefix cache; tok/s is output tokens over the wall
  time from the first request sent to the last stream's end. Printed: each round, the
  medians, and lora / base.
- Priority: a server with --enable-priority-scheduling, --max-running-requests
  --num-prompts and --priority-scheduling-preemption-threshold --threshold (default 0: a
  higher priority preempts; SGLang's default 10 would not let priority 10 preempt 0). A
  priority-10 request (a prompt of --input-len, 4 tokens) on the idle server, 9 times;
  then under --num-prompts x 2 priority-0 requests of 4 x --output-len tokens each (the
  batch full, as many queued), 9 priority-10 requests one after another.
  TTFT is the client's: sending to the first token. Printed: the medians and loaded / idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time

import httpx

from bench import make_checkpoint
from bench.throughput import ZSERVE, _body, _post_concurrent, flush_cache, launch_server, \
    make_prompts, warmup, warmup_prompts
from bench.throughput import Api

DEFAULT_MODEL = "/tmp/zserve-bench/smollm2-135m-float32"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_path: str, out: pathlib.Path, n: int, rank: int) -> list[str]:
    """n random PEFT adapters of the checkpoint's shape; their NAME=PATH specs."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((pathlib.Path(model_path) / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    specs = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for name, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if name[0] in "qkvo" else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) \
                    / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) \
                    * 0.01
        path = out / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "bias": "none"}))
        specs.append(f"adapter{i}={path}")
    return specs


def with_adapter(ids_and_name, output_len: int) -> dict:
    ids, name = ids_and_name
    return {**_body(ids, output_len), "lora_path": name}


LORA_API = Api("zserve", "/generate", with_adapter, ZSERVE.frame, ZSERVE.flush)


def throughput_round(model_path: str, specs: list[str], prompts, warm, output_len: int
                     ) -> dict[str, float]:
    names = [s.split("=", 1)[0] for s in specs]
    out = {}
    for label, flags, api, items, warm_items in (
            ("base", [], ZSERVE, prompts, warm),
            ("lora", ["--enable-lora", "--lora-paths", *specs], LORA_API,
             [(p, names[i % len(names)]) for i, p in enumerate(prompts)],
             [(p, names[i % len(names)]) for i, p in enumerate(warm)])):
        server, _ = launch_server(model_path, "float32", flags)
        try:
            warmup(api, server.url, warm_items, output_len)
            flush_cache(server.url)
            metas, wall = asyncio.run(_post_concurrent(api, server.url, items, output_len))
            out[label] = sum(m["completion_tokens"] for m in metas) / wall
        finally:
            server.terminate()
    return out


def ttft(url: str, ids: list[int], priority: int) -> float:
    body = {**_body(ids, 4), "priority": priority}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=body, timeout=None) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["meta_info"]["completion_tokens"] > 0:
                    return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def priority_run(model_path: str, num: int, input_len: int, output_len: int,
                 threshold: int) -> dict:
    probes = make_prompts(9, input_len, seed=11)
    load = make_prompts(2 * num, input_len, seed=12)
    server, _ = launch_server(model_path, "float32", [
        "--enable-priority-scheduling", "--max-running-requests", str(num),
        "--priority-scheduling-preemption-threshold", str(threshold)])
    try:
        warmup(ZSERVE, server.url, warmup_prompts(load, 13)[:num], output_len)
        idle = [ttft(server.url, p, 10) for p in probes]
        flush_cache(server.url)

        async def saturate():
            return await _post_concurrent(ZSERVE, server.url, load, 4 * output_len)

        import threading
        background = threading.Thread(target=lambda: asyncio.run(saturate()), daemon=True)
        background.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = server.server_info()
            if info["queued_requests"] > 0:
                break
            time.sleep(0.1)
        loaded_info = server.server_info()
        loaded = [ttft(server.url, [p[0] + 1] + p[1:], 10) for p in probes]
        background.join()
        return {"idle": statistics.median(idle), "loaded": statistics.median(loaded),
                "running": loaded_info["running_requests"],
                "queued": loaded_info["queued_requests"],
                "preempted": server.server_info()["preempted_total"]}
    finally:
        server.terminate()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--skip-lora", action="store_true")
    p.add_argument("--skip-priority", action="store_true")
    args = p.parse_args(argv)
    model_path = args.model_path or str(make_checkpoint.ensure(DEFAULT_MODEL))
    prompts = make_prompts(args.num_prompts, args.input_len, seed=0)
    warm = warmup_prompts(prompts, 1)
    if not args.skip_lora:
        with tempfile.TemporaryDirectory() as tmp:
            specs = make_adapters(model_path, pathlib.Path(tmp), args.adapters, args.rank)
            rounds = []
            for r in range(args.rounds):
                rounds.append(throughput_round(model_path, specs, prompts, warm,
                                               args.output_len))
                print(f"round {r + 1}: base {rounds[-1]['base']:.1f} tok/s, "
                      f"{args.adapters} adapters of rank {args.rank} "
                      f"{rounds[-1]['lora']:.1f} tok/s, ratio "
                      f"{rounds[-1]['lora'] / rounds[-1]['base']:.3f}", flush=True)
            base = statistics.median(x["base"] for x in rounds)
            lora = statistics.median(x["lora"] for x in rounds)
            print(f"{args.num_prompts} at once, {args.output_len} tokens each: base "
                  f"{base:.1f} tok/s, over {args.adapters} adapters {lora:.1f} tok/s: "
                  f"lora / base {lora / base:.3f} (target >= 0.8)")
    if not args.skip_priority:
        res = priority_run(model_path, args.num_prompts, args.input_len, args.output_len,
                           args.threshold)
        print(f"priority 10 TTFT: idle {res['idle'] * 1000:.1f} ms, under "
              f"{2 * args.num_prompts} priority-0 requests ({res['running']} running, "
              f"{res['queued']} queued) {res['loaded'] * 1000:.1f} ms: loaded / idle "
              f"{res['loaded'] / res['idle']:.2f} (target <= 1.5); "
              f"{res['preempted']} preemptions")


if __name__ == "__main__":
    main(sys.argv[1:])
