"""Unit tests for scheduler_proc/pool.py: TokenPool, ReqToToken, KVCache sizing.

TokenPool invariant: every slot 1..size is either free or owned, exactly once; slot 0 (the
padding slot) is never handed out."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_proc.pool import KVCache, ReqToToken, TokenPool, quantize_kv


def _check_invariant(pool: TokenPool, owned: set[int]) -> None:
    """Free slots and owned slots partition 1..size, and allocate hands out exactly the free."""
    assert pool.num_free + len(owned) == pool.size
    assert pool.can_allocate(pool.num_free)
    assert not pool.can_allocate(pool.num_free + 1)


def _drain(pool: TokenPool) -> list[int]:
    """Allocate everything that is free (to inspect the free set), then give it back."""
    n = pool.num_free
    slots = pool.allocate(n)
    pool.free(slots)
    assert pool.num_free == n
    return slots


def test_fresh_pool():
    pool = TokenPool(8)
    assert pool.size == 8 and pool.num_free == 8
    assert pool.can_allocate(0) and pool.can_allocate(8) and not pool.can_allocate(9)
    assert sorted(_drain(pool)) == list(range(1, 9))


def test_allocate_hands_out_distinct_nonzero_slots():
    pool = TokenPool(10)
    a = pool.allocate(3)
    b = pool.allocate(0)
    c = pool.allocate(7)
    assert len(a) == 3 and b == [] and len(c) == 7
    assert sorted(a + c) == list(range(1, 11))
    assert 0 not in a + c
    assert pool.num_free == 0 and pool.can_allocate(0) and not pool.can_allocate(1)


def test_low_slots_first():
    pool = TokenPool(5)
    assert sorted(pool.allocate(2)) == [1, 2]


def test_free_makes_slots_reusable():
    pool = TokenPool(4)
    a = pool.allocate(4)
    pool.free(a[1:3])
    assert pool.num_free == 2 and pool.can_allocate(2) and not pool.can_allocate(3)
    again = pool.allocate(2)
    assert sorted(again) == sorted(a[1:3])
    pool.free(a[:1] + again + a[3:])
    assert pool.num_free == 4
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]


def test_allocating_more_than_free_raises_without_changing_state():
    pool = TokenPool(6)
    owned = set(pool.allocate(4))
    with pytest.raises(MemoryError, match="want 3 slots, 2 free"):
        pool.allocate(3)
    assert pool.num_free == 2
    _check_invariant(pool, owned)
    rest = pool.allocate(2)
    assert not owned & set(rest) and sorted(owned | set(rest)) == list(range(1, 7))


def test_double_free_raises_and_keeps_the_free_count():
    pool = TokenPool(4)
    a = pool.allocate(2)
    pool.free([a[0]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])
    assert pool.num_free == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([4])                       # never allocated: free from the start
    assert pool.num_free == 3
    pool.free([a[1]])                        # the other slot still frees normally
    assert pool.num_free == 4
    assert sorted(_drain(pool)) == [1, 2, 3, 4]


def test_failed_free_does_not_leak_other_slots():
    pool = TokenPool(4)
    a, b = pool.allocate(2)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([a, b])                    # b is already free
    assert pool.num_free == 3
    pool.free([a])                           # a was never freed: this must succeed
    assert pool.num_free == 4


def test_repeated_slot_in_one_free_call_does_not_leak():
    pool = TokenPool(2)
    (a,) = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.free([a, a])
    pool.free([a])
    assert pool.num_free == 2


def test_freeing_the_padding_slot_is_refused():
    pool = TokenPool(2)
    with pytest.raises((RuntimeError, ValueError, IndexError)):
        pool.free([0])
    assert 0 not in pool.allocate(pool.num_free)


def test_random_alloc_free_keeps_the_invariant():
    rng = random.Random(7)
    pool = TokenPool(64)
    owned: list[list[int]] = []
    for _ in range(500):
        if owned and rng.random() < 0.45:
            pool.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randrange(0, 12)
            if pool.can_allocate(n):
                owned.append(pool.allocate(n))
            else:
                with pytest.raises(MemoryError):
                    pool.allocate(n)
        held = [s for group in owned for s in group]
        assert len(held) == len(set(held)) and 0 not in held
        assert all(1 <= s <= 64 for s in held)
        _check_invariant(pool, set(held))


# ---- ReqToToken --------------------------------------------------------------------------

def test_req_to_token_double_free_raises():
    table = ReqToToken(max_reqs=2, context_len=4, device="cpu")
    row = table.allocate()
    table.free(row)
    with pytest.raises(RuntimeError):
        table.free(row)
    assert sorted([table.allocate(), table.allocate()]) == [0, 1]


def test_req_to_token_rows_are_distinct_and_reusable():
    table = ReqToToken(max_reqs=3, context_len=8, device="cpu")
    assert table.table.shape == (3, 8) and table.table.dtype == torch.int64
    assert not table.table.any()
    rows = [table.allocate() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(MemoryError):
        table.allocate()
    table.free(rows[1])
    assert table.allocate() == rows[1]


def test_req_to_token_write_and_free_zeroes_the_row():
    table = ReqToToken(max_reqs=2, context_len=6, device="cpu")
    r0, r1 = table.allocate(), table.allocate()
    table.write(r0, 0, [5, 6])
    table.write(r0, 2, [9])
    table.write(r1, 3, [1, 2, 3])
    assert table.table[r0].tolist() == [5, 6, 9, 0, 0, 0]
    assert table.table[r1].tolist() == [0, 0, 0, 1, 2, 3]
    table.write(r0, 1, [7])                  # overwrite in place
    assert table.table[r0].tolist() == [5, 7, 9, 0, 0, 0]
    table.write(r0, 4, [])                   # empty write is a no-op
    assert table.table[r0].tolist() == [5, 7, 9, 0, 0, 0]
    table.free(r0)
    assert table.table[r0].tolist() == [0] * 6
    assert table.table[r1].tolist() == [0, 0, 0, 1, 2, 3]   # other rows untouched
    assert table.allocate() == r0 and not table.table[r0].any()


# ---- KVCache -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2),
                                         (torch.float16, 2)])
def test_bytes_per_token(dtype, size):
    # K and V, per layer, per kv head, per head dim.
    assert KVCache.bytes_per_token(num_layers=3, num_kv_heads=2, head_dim=8,
                                   dtype=dtype) == 2 * 3 * 2 * 8 * size


def test_bytes_per_token_matches_allocated_buffers():
    layers, size, heads, dim = 2, 5, 3, 4
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(layers, size, heads, dim, dtype, "cpu")
        assert len(cache.kv) == layers
        assert all(t.shape == (size + 1, 2, heads, dim) and t.dtype == dtype
                   for t in cache.kv)
        total = sum(t.numel() * t.element_size() for t in cache.kv)
        assert total == (size + 1) * KVCache.bytes_per_token(layers, heads, dim, dtype)


def test_kv_cache_write_then_gather_returns_what_was_written():
    cache = KVCache(2, 10, 3, 4, torch.float32, "cpu")
    k, v = torch.randn(3, 3, 4), torch.randn(3, 3, 4)
    slots = torch.tensor([7, 2, 9])
    cache.write(1, slots, k, v)
    gk, gv = cache.gather(1, torch.tensor([[9, 7], [2, 0]]))
    assert gk.shape == gv.shape == (2, 2, 3, 4)
    assert torch.equal(gk[0, 0], k[2]) and torch.equal(gv[0, 1], v[0])
    assert torch.equal(gk[1, 0], k[1]) and not gk[1, 1].any()     # slot 0: padding
    assert not cache.kv[0].any()                                  # other layers untouched


# ---- int8 KV (--kv-cache-dtype int8) -------------------------------------------------------

def test_int8_bytes_per_token_counts_the_scales():
    # 2 * 3 layers * 2 heads * 64 values: one byte each, and a float32 scale per 32 of them.
    values = 2 * 3 * 2 * 64
    assert KVCache.bytes_per_token(3, 2, 64, torch.int8) == values + values // 32 * 4
    cache = KVCache(3, 5, 2, 64, torch.float32, "cpu", torch.int8)
    total = sum(t.numel() * t.element_size() for t in cache.kv + cache.scales)
    assert total == 6 * KVCache.bytes_per_token(3, 2, 64, torch.int8)
    assert cache.kv[0].dtype == torch.int8 and cache.scales[0].shape == (6, 2, 2, 2)


def test_int8_needs_whole_blocks_per_head():
    with pytest.raises(ValueError, match="divisible by 32"):
        KVCache(1, 4, 2, 48, torch.float32, "cpu", torch.int8)


def test_quantize_kv_rounds_each_value_to_half_a_step():
    """|x - q * scale| <= scale / 2 (q: x / scale rounded to nearest) plus the float32
    rounding of x / scale and of q * scale, each at most 2^-24 of a value <= max |x| of the
    block (so 2 * 2^-24 * max|x| * 1.01 for the pair, 1.01 for |q s| <= 127.5 s)."""
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 3, 64)     # blocks of unlike magnitudes
    x[0, 0, :32] = 0                                          # a block of zeros
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (7, 3, 2)
    assert q.abs().max() <= 127
    blocks = x.unflatten(-1, (2, 32))
    amax = blocks.abs().amax(-1)
    assert torch.equal(scale, amax / 127)
    back = q.unflatten(-1, (2, 32)).float() * scale[..., None]
    bound = scale[..., None] / 2 + 2 * 2 ** -24 * 1.01 * amax[..., None]
    assert ((back - blocks).abs() <= bound).all()
    assert not q[0, 0, :32].any() and scale[0, 0, 0] == 0
    # the largest value of each block is exact up to the rounding of its scale
    assert (q.unflatten(-1, (2, 32)).abs().amax(-1) == 127).logical_or(amax == 0).all()


def test_quantize_kv_keeps_a_nan_in_its_block():
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    q, scale = quantize_kv(x)
    assert scale[1, 1].isnan() and not q[1, 32:].any()       # reads back as NaN
    assert not scale[0].isnan().any() and not scale[1, 0].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_a_pool_of_another_dtype_reads_back_in_the_model_dtype(dtype, kv_dtype):
    cache = KVCache(2, 10, 3, 64, dtype, "cpu", kv_dtype)
    k, v = torch.randn(3, 3, 64, dtype=dtype), torch.randn(3, 3, 64, dtype=dtype)
    slots = torch.tensor([7, 2, 9])
    cache.write(1, slots, k, v)
    assert cache.kv[1].dtype == kv_dtype
    gk, gv = cache.gather(1, torch.tensor([[9, 7], [2, 0]]))
    assert gk.dtype == gv.dtype == dtype and gk.shape == (2, 2, 3, 64)
    if kv_dtype == torch.int8:
        want_k = quantize_kv(k)[0].unflatten(-1, (2, 32)).float() * quantize_kv(k)[1][..., None]
        want_k = want_k.flatten(-2).to(dtype)
    else:
        want_k = k.to(kv_dtype).to(dtype)
    assert torch.equal(gk[0, 0], want_k[2]) and torch.equal(gk[1, 0], want_k[1])
    assert not gk[1, 1].any()                                     # slot 0: padding
    # within half an int8 step (1/254 of a block's largest) or bfloat16's 2^-9 relative
    assert gv[0, 1].float().sub(v[0].float()).abs().max() <= 0.01 * v[0].float().abs().max()
