"""Decode attention: our C kernel (kernels/attention.c) and the SDPA fallback both equal a
dense softmax(q k^T / sqrt(d)) v over each row's own slots, read through the table, for
each pool dtype (the model's, bfloat16, int8 with its scales: --kv-cache-dtype)."""

from __future__ import annotations

import pytest
import torch

from models.ops import decode_kernel_fits
from scheduler_proc.attention import StepAttention
from scheduler_proc.pool import KVCache


def dense_decode(cache: KVCache, table, rows, lens, q):
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // cache.kv[0].shape[2]
    for b, (row, n) in enumerate(zip(rows, lens)):
        keys, values = cache.gather(0, table[row, :n], torch.float32)  # as the pool holds them
        k = keys.repeat_interleave(group, dim=1)                # [n, H, D]
        v = values.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), k) * q.shape[-1] ** -0.5, -1)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


def fill(cache: KVCache, pad: float = 1e4) -> None:
    """Random K/V in every slot of layer 0 (written as the pool stores them), and `pad` in
    the padding slot 0: any leak of it into a row shows up."""
    n, _, hkv, d = cache.kv[0].shape
    every = torch.arange(n)
    k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    k[0] = v[0] = pad
    cache.write(0, every, k.to(cache.dtype), v.to(cache.dtype))


KV_DTYPES = [None, torch.bfloat16, torch.int8]          # None: the model's dtype


# The kernel's task splits: a small batch by KV head, a big one ("many") by row, and one or
# two long rows (fewer row-head pairs than 4 a thread) by positions too, in shares of 256
# or more merged after (the second long row's shorter length leaves a share empty).
BATCHES = {"few": ([7, 0, 3, 5, 1, 2], [1, 2, 63, 64, 65, 257]),   # out of order, not
           "many": ([7, 0, 3, 5, 1, 2, *range(8, 20)],              # every row; around
                    [1, 2, 63, 64, 65, 257, *range(100, 112)]),     # the 64-block
           "one long": ([4], [1999]),
           "two long": ([4, 1], [2100, 300])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_decode_matches_dense(dtype, kv_dtype, heads, kv_heads, head_dim, kernel, batch):
    if kernel and not decode_kernel_fits(torch.device("cpu"), dtype, heads, kv_heads, head_dim,
                                         kv_dtype):
        pytest.skip("no decode kernel for this CPU / compiler")
    if not kernel and "long" in batch:
        pytest.skip("positions are split on the kernel only; SDPA has the short batches")
    torch.manual_seed(0)
    rows, lens = BATCHES[batch]
    ctx, reqs = max(300, max(lens)), len(rows)
    cache = KVCache(1, reqs * ctx, kv_heads, head_dim, dtype, "cpu", kv_dtype)
    fill(cache)
    table = torch.zeros(max(rows) + 2, ctx, dtype=torch.int64)
    slots = torch.randperm(reqs * ctx)[: sum(lens)] + 1
    for row, n in zip(rows, lens):
        table[row, :n], slots = slots[:n], slots[n:]
    q = torch.randn(len(rows), heads, head_dim, dtype=dtype)
    attn = StepAttention.build(cache, table, list(range(1, len(rows) + 1)), rows, lens, [],
                               "cpu", decode_kernel=kernel)
    got = attn._decode(0, q)
    assert got.dtype == dtype and got.shape == q.shape
    # Both sides sum the same K/V values (an int8 key: per block, then scaled; the dense
    # side: the scaled values), so they differ by float32 summation order; the output is
    # then rounded once to the model dtype.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), dense_decode(cache, table, rows, lens, q),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_nan_key_poisons_its_row_only(dtype, kv_dtype):
    """As in SDPA: a NaN in a row's keys makes that row's output NaN; other rows are intact
    (int8: the NaN's block has a NaN scale)."""
    if not decode_kernel_fits(torch.device("cpu"), dtype, 4, 2, 64, kv_dtype):
        pytest.skip("no decode kernel for this CPU / compiler")
    cache = KVCache(1, 40, 2, 64, dtype, "cpu", kv_dtype)
    fill(cache, 0.0)
    table = torch.arange(1, 41).view(2, 20)
    k = cache.gather(0, torch.tensor([5]))[0].clone()
    k[0, 1, 7] = float("nan")                          # row 0's position 4, KV head 1
    cache.write(0, torch.tensor([5]), k, k)
    q = torch.randn(2, 4, 64, dtype=dtype)
    out = StepAttention.build(cache, table, [1, 2], [0, 1], [20, 20], [], "cpu",
                              decode_kernel=True)._decode(0, q)
    assert out[0, 2:].isnan().all() and not out[0, :2].isnan().any()
    assert not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_step_writes_kv_and_attends_like_sdpa(dtype, kv_dtype):
    """A whole step through StepAttention (K/V written from strided views of a qkv output,
    then decode rows attended) gives the same pool and output on our kernels as on torch:
    the pool bit for bit (attention.c's kv_put rounds to bfloat16, and to int8 with its
    scales, exactly as pool.py's torch code does)."""
    heads, kv_heads, d, rows = 4, 2, 64, 9
    if not decode_kernel_fits(torch.device("cpu"), dtype, heads, kv_heads, d, kv_dtype):
        pytest.skip("no decode kernel for this CPU / compiler")
    torch.manual_seed(0)
    table = torch.arange(1, rows * 30 + 1).view(rows, 30)
    lens = [1 + 3 * i for i in range(rows)]
    out_slots = [int(table[i, n - 1]) for i, n in enumerate(lens)]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=dtype)
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
    results = []
    for kernel in (True, False):
        cache = KVCache(1, rows * 30, kv_heads, d, dtype, "cpu", kv_dtype)
        torch.manual_seed(1)
        fill(cache, 0.0)
        attn = StepAttention.build(cache, table, out_slots, list(range(rows)), lens, [],
                                   "cpu", decode_kernel=kernel)
        results.append((attn(0, q, k, v), cache))
    (o_kernel, kv_kernel), (o_torch, kv_torch) = results
    assert torch.equal(kv_kernel.kv[0], kv_torch.kv[0])
    if kv_dtype == torch.int8:
        assert torch.equal(kv_kernel.scales[0], kv_torch.scales[0])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o_kernel, o_torch, atol=tol, rtol=tol)
