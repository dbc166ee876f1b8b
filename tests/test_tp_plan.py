"""Tensor parallelism's step protocol (runner.py, tp_worker.py, tp.py): what rank 0 tells its
followers and how they follow, in one process where possible.

- TPInit / StepPlan frames: round trip through the followers' decoder, bad frames refused;
- broadcast_bytes (ThreadGroup): frames of 0, 4088 (fills the head), 4089 (one byte more:
  a second collective) and 100 kB bytes arrive whole on every rank;
- the request-table mirror: test_scheduler_random's traffic (retractions, aborts, flushes,
  failed steps) with each step's plan encoded, decoded and replayed on a zero table, which
  always matches the real one wherever the step reads it;
- the real Scheduler on a rank-0 ModelRunner with followers (ThreadGroup, T = 2, 3) gives
  the same greedy tokens, cached tokens and logprobs as one rank, for concurrent requests
  with chunked prefill, prefix-cache hits and input logprobs;
- faults: a bad frame or a failed step is a TPFault, which ends the process
  (leaves_device_unknown);
- DistGroup: two processes joined by gloo run every collective and the sharded tiny model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from scheduler_proc import tp_worker
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.pool import ReqToToken
from scheduler_proc.runner import ModelRunner, leaves_device_unknown
from scheduler_proc.scheduler import Scheduler
from models.distributed import HEAD_BYTES, LENGTH_BYTES, SOLO, TPFault, ThreadGroup
from wire.codec import TP_FOLLOWER, DecodeError, decode, encode
from wire.messages import (AbortRequest, LogprobRequest, StepPlan, TableWrite, TokenBatch,
                           TokenizedRequest, TPInit)
from wire.sampling import SamplingParams
from wire.server_args import ServerArgs

REPO = Path(__file__).resolve().parent.parent

PLAN = StepPlan(ids=[5, 6, 7, 8], positions=[9, 0, 1, 2], out_slots=[12, 1, 2, 3],
                decode_rows=[3], decode_lens=[10], prefills=[[0, 0, 3]],
                table_writes=[TableWrite(row=3, start=9, slots=[12]),
                              TableWrite(row=0, start=0, slots=[1, 2, 3])],
                score_ranges=[[1, 2]], sample_rows=[0, 3])


class Watchdog:
    """process.Watchdog's surface, counting."""

    def __init__(self):
        self.paused = self.armed = 0

    def pause(self):
        self.paused += 1

    def progress(self):
        self.armed += 1


# ---- frames ---------------------------------------------------------------------------------

@pytest.mark.parametrize("msg", [TPInit(pool_size=4096, table_rows=8, table_cols=2048), PLAN,
                                 msgspec.structs.replace(PLAN, stop=True)],
                         ids=["init", "plan", "stop"])
def test_follower_frames_round_trip(msg):
    out = decode(encode(msg), TP_FOLLOWER)
    assert type(out) is type(msg) and out == msg


@pytest.mark.parametrize("frame", [
    b"\xc1",                                                           # not msgpack
    encode(AbortRequest(rid="x")),                                     # another inbox's
    msgspec.msgpack.encode([13, 4096, 8]),                             # a field short
    msgspec.msgpack.encode([13, 4096, 8, "2048"]),                     # a str for an int
    encode(PLAN)[:-1],                                                 # truncated
    msgspec.msgpack.encode([14, [], [], [], [], [], [], [[0, 0]], [], [], False]),  # bad write
    msgspec.msgpack.encode([99]),                                      # unknown tag
], ids=["garbage", "abort", "short", "type", "truncated", "write", "tag"])
def test_a_bad_frame_is_a_decode_error(frame):
    with pytest.raises(DecodeError):
        decode(frame, TP_FOLLOWER)


# ---- broadcast_bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, HEAD_BYTES - LENGTH_BYTES, HEAD_BYTES - LENGTH_BYTES + 1,
                               100_000])
def test_broadcast_bytes_arrive_whole(n):
    data = os.urandom(n)
    calls = [0] * 3

    def rank(g):
        broadcast = g._broadcast_

        def counted(t):
            calls[g.rank] += 1
            broadcast(t)
        g._broadcast_ = counted
        return g.broadcast_bytes(data if g.rank == 0 else None)
    assert ThreadGroup.run(3, rank) == [data] * 3
    assert calls == [1 if n <= HEAD_BYTES - LENGTH_BYTES else 2] * 3   # one phase if it fits
    assert SOLO.broadcast_bytes(data) == data


def test_thread_group_collectives():
    def rank(g):
        t = torch.full((2, 3), float(g.rank + 1))
        g.all_reduce_(t)
        gathered = g.gather_vocab(torch.full((1, 2), float(g.rank)))
        return t, gathered, g.all_reduce_min(7 - g.rank)
    out = ThreadGroup.run(3, rank)
    assert all(torch.equal(t, torch.full((2, 3), 6.0)) for t, _, _ in out)
    assert torch.equal(out[0][1], torch.tensor([[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]))
    assert out[1][1] is None and out[2][1] is None
    assert [m for _, _, m in out] == [5, 5, 5]


# ---- the request-table mirror ------------------------------------------------------------------

class MirrorCheck:
    """Wraps a runner's forward as rank 0 would: the step's plan, with the table writes
    logged since the last one, goes through the codec and is replayed on a mirror table,
    which must then hold what the real table holds wherever the step reads it."""

    def __init__(self, kv: KVManager, forward):
        self.real = kv.req_to_token
        self.real.log = []
        self.mirror = ReqToToken(self.real.size, self.real.table.shape[1], "cpu")
        self.forward = forward
        self.steps = 0

    def __call__(self, segments, table):
        plan = ModelRunner.plan(segments)[0]
        plan.table_writes, self.real.log[:] = list(self.real.log), []
        plan = decode(encode(plan), TP_FOLLOWER)
        for w in plan.table_writes:
            self.mirror.write(w.row, w.start, w.slots)
        read = list(zip(plan.decode_rows, plan.decode_lens))
        read += [(row, start + n) for row, start, n in plan.prefills]
        for row, end in read:
            assert torch.equal(self.mirror.table[row, :end], table[row, :end]), (row, end)
        self.steps += 1
        return self.forward(segments, table)


@pytest.mark.parametrize("seed", range(6))
def test_table_mirror_follows_random_traffic(seed, caplog):
    from test_scheduler_random import Run

    caplog.set_level(logging.CRITICAL, logger="scheduler_proc.scheduler")
    run = Run(seed)
    check = MirrorCheck(run.s.kv, run.s.runner.forward)
    run.s.runner.forward = check
    run.go()
    assert check.steps > 100


# ---- the real scheduler on T ranks ------------------------------------------------------------

BASE = list(range(40, 80))


def traffic() -> list[list[TokenizedRequest]]:
    """Messages per step: three concurrent prompts sharing a prefix (chunked: 8-token
    chunks), one with input and output logprobs; later, repeats that hit the prefix cache."""
    def req(rid, ids, n=6, **kw):
        return TokenizedRequest(rid=rid, input_ids=ids, sampling=SamplingParams(
            max_new_tokens=n, temperature=0.0), **kw)
    return [[req("a", BASE[:20] + [3]), req("b", BASE[:13] + [4, 5], n=9),
             req("c", BASE[:30], logprob=LogprobRequest(top_logprobs_num=2, start_len=2))],
            [], [req("d", BASE[:5] + [6])], [], [], [],
            [req("a2", BASE[:20] + [3]), req("c2", BASE[:30] + [7], n=3)]]


def drive(runner: ModelRunner, args: ServerArgs, context: int) -> dict:
    """The Scheduler on this runner until every request ended: {rid: (ids, cached,
    logprobs, input logprobs)}; the KV pool must be whole again."""
    kv = KVManager(pool_size=runner.pool_size, max_running=args.max_running_requests,
                   context_len=context, device=runner.device, use_cache=True)
    runner.share_table(kv.req_to_token)
    batches: list[TokenBatch] = []
    s = Scheduler(args, runner, kv, batches.append, lambda reply: None)
    steps = traffic()
    for i in range(200):
        s.step(steps[i] if i < len(steps) else [])
        if s.idle and i >= len(steps):
            break
    runner.stop_followers()
    assert s.idle and kv.pool.num_free + kv.evictable == kv.pool.size
    out: dict = {}
    for o in (o for b in batches for o in b.outputs):
        ids, _, lps, ilps = out.setdefault(o.rid, ([], [0], [], []))
        ids += o.new_ids
        if o.logprobs is not None:
            lps += o.logprobs.logprobs
        if o.input_logprobs is not None:
            ilps += o.input_logprobs.logprobs
        if o.finish is not None:
            assert o.finish.type == "length", o.finish
            out[o.rid][1][0] = o.cached_tokens
    return out


@pytest.fixture(scope="module")
def served(tiny_model):
    """family -> (ServerArgs, resolved config, what one rank serves)."""
    from launch import resolve_args

    cache = {}

    def get(family):
        if family not in cache:
            args = ServerArgs(model_path=str(tiny_model(family)), max_total_tokens=600,
                              chunked_prefill_size=8, max_running_requests=4)
            config = resolve_args(args)
            cache[family] = args, config, drive(ModelRunner(config), args,
                                                config.context_length)
        return cache[family]
    return get


@pytest.mark.parametrize("family,size", [("llama", 2), ("llama", 3), ("qwen2", 2)])
def test_scheduler_on_tensor_parallel_ranks_equals_one_rank(served, family, size):
    args, config, want = served(family)
    dogs = [Watchdog() for _ in range(size)]

    def rank(g):
        runner = ModelRunner(config, tp=g)
        if g.rank == 0:
            return drive(runner, args, config.context_length)
        tp_worker.follow(runner, dogs[g.rank])
    got = ThreadGroup.run(size, rank)[0]
    assert got.keys() == want.keys()
    for rid, (ids, cached, lps, ilps) in want.items():
        assert got[rid][0] == ids, rid
        assert got[rid][1] == cached, rid
        torch.testing.assert_close(torch.tensor(got[rid][2]), torch.tensor(lps), atol=1e-4,
                                   rtol=0)
        assert [x is None for x in got[rid][3]] == [x is None for x in ilps], rid
        torch.testing.assert_close(torch.tensor([x for x in got[rid][3] if x is not None]),
                                   torch.tensor([x for x in ilps if x is not None]),
                                   atol=1e-4, rtol=0)
    assert want["a2"][1][0] > 0 and want["c"][3]            # a cache hit, input logprobs
    assert all(d.paused == d.armed > 5 for d in dogs[1:])   # paused before each plan


def test_ranks_agree_on_the_smallest_pool(served, monkeypatch):
    """Each rank's own capacity (here: made to differ) -> all_reduce_min -> TPInit."""
    _, config, _ = served("llama")
    config = dataclasses.replace(config, args=dataclasses.replace(config.args,
                                                                  max_total_tokens=None))
    monkeypatch.setattr(ModelRunner, "_default_pool_size",
                        lambda self, args: 300 - 100 * self.tp.rank)

    def rank(g):
        runner = ModelRunner(config, tp=g)
        if g.rank == 0:
            runner.share_table(ReqToToken(2, 16, "cpu"))
            runner.stop_followers()
        else:
            tp_worker.follow(runner, Watchdog())
        return runner.pool_size, runner.cache.kv[0].shape[0]
    assert ThreadGroup.run(3, rank) == [(100, 101)] * 3


# ---- faults ------------------------------------------------------------------------------------

def test_a_bad_frame_or_an_unexpected_message_is_a_tp_fault():
    def rank(g):
        if g.rank == 0:
            g.broadcast_bytes(b"\x93garbage")
            g.broadcast_bytes(encode(PLAN))
            return None
        errors = []
        for kind in (TPInit, TPInit):
            try:
                tp_worker._receive(g, kind)
            except TPFault as e:
                errors.append(str(e))
        return errors
    errors = ThreadGroup.run(2, rank)[1]
    assert "bad frame" in errors[0] and "expected a TPInit" in errors[1]
    assert leaves_device_unknown(TPFault("x"))


def test_a_failed_step_is_fatal_on_every_rank(served):
    """Rank 0's model raises inside a step whose plan the follower already runs: both end
    with a TPFault (the follower's collective is broken, not left hanging)."""
    args, config, _ = served("llama")
    faults = []

    def rank(g):
        runner = ModelRunner(config, tp=g)
        if g.rank == 0:
            def broken(*a, **kw):
                raise RuntimeError("injected")
            runner.execute = broken
            try:
                drive(runner, args, config.context_length)
            except TPFault as e:
                faults.append(e)
                raise
        else:
            try:
                tp_worker.follow(runner, Watchdog())
            except TPFault as e:
                faults.append(e)
                raise
    with pytest.raises(TPFault):
        ThreadGroup.run(2, rank, timeout=10)
    assert len(faults) == 2 and all(leaves_device_unknown(e) for e in faults)
    assert "injected" in str(faults[0])


# ---- DistGroup: two processes joined by gloo ---------------------------------------------------

CHILD = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
from model_helpers import DenseCausalAttention
from models import load_model
from models.distributed import init_dist_group

rank, store, model_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = init_dist_group("cpu", f"file://{store}", rank, 2)
big = bytes(range(256)) * 400
out = {"small": g.broadcast_bytes(b"hello" if rank == 0 else None).decode(),
       "big": g.broadcast_bytes(big if rank == 0 else None) == big,
       "empty": g.broadcast_bytes(b"" if rank == 0 else None) == b""}
t = torch.full((3,), float(rank + 1))
out["sum"] = g.all_reduce_(t).tolist()
v = g.gather_vocab(torch.full((2, 2), float(rank)))
out["gather"] = None if v is None else v.tolist()
out["min"] = g.all_reduce_min(10 - rank)
g.barrier()
model = load_model(model_path, torch.float32, "cpu", tp=g)
ids, pos = torch.arange(5, 25), torch.arange(20)
logits = model.compute_logits(model(ids, pos, DenseCausalAttention()))
if rank == 0:
    full = load_model(model_path, torch.float32, "cpu")
    want = full.compute_logits(full(ids, pos, DenseCausalAttention()))
    out["err"] = float((logits - want).abs().max() / want.abs().max())
print(json.dumps(out))
"""


def test_dist_group_over_gloo(tiny_model, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "store"), str(tiny_model("llama"))]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for r, out in enumerate(outs):
        assert out["small"] == "hello" and out["big"] and out["empty"]
        assert out["sum"] == [3.0] * 3 and out["min"] == 9
        assert out["gather"] == ([[0.0, 0.0, 1.0, 1.0]] * 2 if r == 0 else None)
    assert outs[0]["err"] < 5e-6
