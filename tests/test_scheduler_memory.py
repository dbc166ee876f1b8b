"""The scheduler's memory stays bounded when every step has a new row count.

oneDNN, which runs the model's linears where our CPU kernels cannot (models/packed.py),
compiles and caches a kernel (~0.5-1 MB) per row count; runner.bound_onednn_caches caps
its caches (runner.py's docstring). A serving step's row count is its decode rows plus a
prefill chunk, so a soak reaches hundreds of them: the scheduler's RSS climbed by 130-140 MB
a minute until the default caps (1024 kernels a cache) were reached.

Here the scheduler core, with the real ModelRunner on the tiny model forced onto oneDNN
(ZSERVE_CPU_KERNELS=0), prefills one request at a time with prompts of distinct lengths:
one new row count per step. The first lengths fill the capped caches; the next as many must
not grow the RSS further. It runs in a fresh interpreter because oneDNN reads its cache
sizes once per process, at its first primitive, which an earlier test in this one may have
run already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_proc.runner import ONEDNN_CACHE_VARIABLES

REPO = Path(__file__).resolve().parent.parent
SHAPES = 120            # distinct row counts per phase: x4 linear shapes, well over the cap
MAX_GROWTH_MB = 40      # measured: +0.2 MB capped, +230 MB with the default caps

CHILD = r"""
import json, sys
import psutil
import torch
torch.set_num_threads(1)    # two threads on a busy machine: 10x slower, same kernels cached
from scheduler_proc.kv_manager import KVManager
from models.packed import PackedLinear
from scheduler_proc.runner import ModelRunner
from scheduler_proc.scheduler import Scheduler
from wire.messages import TokenizedRequest
from wire.sampling import SamplingParams
from launch import resolve_args
from wire.server_args import ServerArgs

args = ServerArgs(model_path=sys.argv[1], max_total_tokens=4096)
runner = ModelRunner(resolve_args(args))
if not any(isinstance(m, PackedLinear) for m in runner.model.modules()):
    print(json.dumps({"skip": "the model's linears are not oneDNN's here"}))
    sys.exit()
batches = []
kv = KVManager(pool_size=runner.pool_size, max_running=args.max_running_requests,
               context_len=runner.context_len, device=runner.device, use_cache=True)
core = Scheduler(args, runner, kv, batches.append, lambda reply: None)

def prefill(length):
    # Distinct first tokens: no prefix is shared, so the whole prompt is one step's rows.
    ids = [10 + length % 500] + [11] * (length - 1)
    core.step([TokenizedRequest(rid=f"r{length}", input_ids=ids,
                                sampling=SamplingParams(max_new_tokens=1))])
    while not core.idle:
        core.step([])

rss = lambda: psutil.Process().memory_info().rss / 2**20
shapes = int(sys.argv[2])
for n in range(2, 2 + shapes):
    prefill(n)
filled = rss()
for n in range(2 + shapes, 2 + 2 * shapes):
    prefill(n)
assert all(o.finish is not None and o.finish.type == "length"
           for b in batches for o in b.outputs), "a request did not finish normally"
print(json.dumps({"filled_mb": filled, "growth_mb": rss() - filled}))
"""


def test_rss_bounded_under_distinct_batch_shapes(tiny_model):
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["ZSERVE_CPU_KERNELS"] = "0"
    out = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model("llama")), str(SHAPES)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["growth_mb"] < MAX_GROWTH_MB, result
