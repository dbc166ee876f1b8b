"""Where a batch-1 decode step's time goes on the torch path, in process (no server).

    python -m bench.profile_decode --model-path /tmp/gemma3-270m [--dtype float32]
        [--prompt-len 32] [--steps 16] [--batch 1] [--top 25]

Loads the model as the scheduler does (models.load_model: the CPU linear kernels where
they apply), prefills one prompt of random ids per row, then decodes `--steps` steps of
`--batch` rows under torch.profiler, each step's forward and logits as the runner computes
them (greedy: the argmax is fed back). Attention is a stand-in (bench's own, below: the
cache kept as growing tensors, SDPA over it, the layer's window and scale applied), not
the scheduler's paged pool and C decode kernel: at these lengths attention is a small
share either way; what this measures is everything around it. A model that FastDecode
runs (Llama's layer, dense MLPs) takes the one-call path only through the scheduler's
attention, so here every family runs layer by layer, as Gemma and the mixtures of experts
always do.

Printed: the mean step time (untimed by the profiler: a separate timed run of the same
steps), the time inside each kind of module (inclusive: a label's time includes the
labels inside it), and the top torch ops by self time.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F


class CachedAttention:
    """attn(layer_id, q, k, v) with the K/V of each layer kept as one growing tensor per
    row (rows: the batch's requests, each `n_new` tokens this call)."""

    def __init__(self, layers, batch: int):
        self.layers = layers
        self.batch = batch
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_id, q, k, v):
        b = self.batch
        n = q.shape[0] // b
        q, k, v = (t.reshape(b, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        if layer_id in self.k:
            k = torch.cat((self.k[layer_id], k), dim=2)
            v = torch.cat((self.v[layer_id], v), dim=2)
        self.k[layer_id], self.v[layer_id] = k, v
        spec = self.layers[layer_id]
        if spec.window is not None and k.shape[2] > spec.window:
            k, v = k[:, :, -spec.window:], v[:, :, -spec.window:]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=spec.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[3])


LABELS = {   # module class name -> label (the sub-modules of a layer by their attribute)
    "GemmaRMSNorm": "norm (Gemma, 1 + w)", "RMSNorm": "norm",
    "SelfAttention": "self_attn", "MLP": "mlp (dense)", "SparseMoE": "moe",
    "Router": "moe.router", "Experts": "moe.experts",
}


def annotate(model) -> None:
    """A profiler range around every module of interest (forward hooks)."""
    def pre(label):
        def hook(module, args):
            module._zs_range = torch.autograd.profiler.record_function(label)
            module._zs_range.__enter__()
        return hook

    def post(module, args, out):
        module._zs_range.__exit__(None, None, None)

    for name, module in model.named_modules():
        kind = type(module).__name__
        label = LABELS.get(kind)
        leaf = name.rsplit(".", 1)[-1]
        if label is None and isinstance(module, torch.nn.Module) and leaf in (
                "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            label = f"linear {leaf}"
        if label is not None:
            module.register_forward_pre_hook(pre(label))
            module.register_forward_hook(post)


def run(model, batch: int, prompt_len: int, steps: int, profile: bool):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 700, (batch * prompt_len,), generator=gen)
    attn = CachedAttention(model.attention_layers, batch)
    positions = torch.arange(prompt_len).repeat(batch)
    hidden = model(ids, positions, attn)
    last = hidden.view(batch, prompt_len, -1)[:, -1]
    tok = model.compute_logits(last).argmax(-1)
    pos = torch.full((batch,), prompt_len)
    times = []
    prof = None
    ctx = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
           if profile else None)
    if ctx is not None:
        prof = ctx.__enter__()
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            with torch.autograd.profiler.record_function("step.forward"):
                hidden = model(tok, pos, attn)
            with torch.autograd.profiler.record_function("step.logits (final norm, LM head)"):
                tok = model.compute_logits(hidden).argmax(-1)
            times.append(time.perf_counter() - t0)
            pos = pos + 1
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return times, prof


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Profile batch-1 decode steps in process.")
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    from models import load_model

    t0 = time.perf_counter()
    model = load_model(args.model_path, getattr(torch, args.dtype), "cpu")
    print(f"loaded in {time.perf_counter() - t0:.1f} s; torch threads "
          f"{torch.get_num_threads()}; fast decode: {model.fast is not None}")
    run(model, args.batch, args.prompt_len, 4, profile=False)           # warm-up
    times, _ = run(model, args.batch, args.prompt_len, args.steps, profile=False)
    times.sort()
    print(f"decode step, batch {args.batch}: median {1000 * times[len(times) // 2]:.1f} ms, "
          f"min {1000 * times[0]:.1f} ms over {len(times)} steps (not profiled)")
    annotate(model)
    _, prof = run(model, args.batch, args.prompt_len, args.steps, profile=True)
    events = prof.key_averages()
    ours = [e for e in events if e.key.startswith(("step.", "norm", "self_attn", "mlp",
                                                   "moe", "linear "))]
    total = sum(e.cpu_time_total for e in ours if e.key.startswith("step."))
    print(f"\nmodule ranges (inclusive), per step; share of the profiled step:")
    for e in sorted(ours, key=lambda e: -e.cpu_time_total):
        print(f"  {e.key:<36} {e.cpu_time_total / 1000 / args.steps:8.2f} ms  "
              f"{100 * e.cpu_time_total / total:5.1f}%  ({e.count // args.steps} calls/step)")
    print(f"\ntop {args.top} torch ops by self CPU time:")
    ops = collections.Counter()
    calls = collections.Counter()
    for e in events:
        if not e.key.startswith(("step.", "norm", "self_attn", "mlp", "moe", "linear ")):
            ops[e.key] += e.self_cpu_time_total
            calls[e.key] += e.count
    for key, us in ops.most_common(args.top):
        print(f"  {key:<44} {us / 1000 / args.steps:8.2f} ms/step  {100 * us / total:5.1f}%  "
              f"({calls[key] / args.steps:.0f} calls/step)")


if __name__ == "__main__":
    main()
