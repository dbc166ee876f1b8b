"""Unit tests for scheduler_proc/radix_cache.py against a real TokenPool.

Accounting checked throughout: every slot is free in the pool, owned by the tree, or held by
a (simulated) request, exactly once: pool.num_free + cache.total_size + held == pool.size."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.pool import TokenPool
from scheduler_proc.radix_cache import RadixCache, TreeNode, common_prefix_len


def _cache(size: int = 64) -> tuple[TokenPool, RadixCache]:
    pool = TokenPool(size)
    return pool, RadixCache(pool)


def _put(cache: RadixCache, ids: list[int]) -> list[int]:
    """Insert ids with fresh slots (the tree must not have any prefix of them)."""
    slots = cache.pool.allocate(len(ids))
    assert cache.insert(ids, slots) == 0
    cache.check()
    return slots


def _sizes(cache: RadixCache) -> tuple[int, int, int]:
    return cache.evictable_size, cache.protected_size, cache.total_size


def _cached(cache: RadixCache) -> set[tuple[int, ...]]:
    """The full prefix every node ends at, read without touching last_access."""
    out = set()
    for node in cache._nodes():
        parts = []
        while node is not cache.root:
            parts.append(node.key)
            node = node.parent
        out.add(tuple(t for part in reversed(parts) for t in part))
    return out


# ---- common prefix -----------------------------------------------------------------------

def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3], 0) == 3
    assert common_prefix_len([1, 2, 3], [1, 2], 0) == 2
    assert common_prefix_len([1, 2], [9, 1, 2, 3], 1) == 2
    assert common_prefix_len([1, 2, 3], [9, 1, 5, 3], 1) == 1
    assert common_prefix_len([1, 2, 3], [4], 0) == 0
    assert common_prefix_len([1], [1, 2], 2) == 0


# ---- match / insert ----------------------------------------------------------------------

def test_match_on_empty_tree():
    pool, cache = _cache()
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    assert cache.match_prefix([]) == ([], cache.root)
    assert _sizes(cache) == (0, 0, 0) and pool.num_free == pool.size
    cache.check()


def test_insert_then_match_exact_and_longer():
    pool, cache = _cache()
    slots = _put(cache, [1, 2, 3, 4])
    assert _sizes(cache) == (4, 0, 4) and pool.num_free == pool.size - 4
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got == slots and node.key == [1, 2, 3, 4] and node.parent is cache.root
    got, node2 = cache.match_prefix([1, 2, 3, 4, 5, 6])       # longer: stops at cached end
    assert got == slots and node2 is node
    assert cache.match_prefix([7, 1, 2]) == ([], cache.root)   # different first token
    cache.check()


def test_match_shorter_query_splits_node_keeping_slots_and_locks():
    pool, cache = _cache()
    slots = _put(cache, [1, 2, 3, 4, 5])
    _, whole = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(whole)
    assert _sizes(cache) == (0, 5, 5)

    got, upper = cache.match_prefix([1, 2])                    # ends inside: split
    assert got == slots[:2]
    assert upper.key == [1, 2] and upper.value == slots[:2] and upper.parent is cache.root
    assert whole.key == [3, 4, 5] and whole.value == slots[2:] and whole.parent is upper
    assert upper.children == {3: whole}
    assert upper.lock_ref == whole.lock_ref == 1                # lock covers both halves
    assert _sizes(cache) == (0, 5, 5)
    cache.check()

    assert cache.match_prefix([1, 2, 3, 4, 5]) == (slots, whole)   # the handle still works
    cache.unlock(whole)
    assert upper.lock_ref == whole.lock_ref == 0
    assert _sizes(cache) == (5, 0, 5)
    cache.check()


def test_match_diverging_mid_node_splits_there():
    pool, cache = _cache()
    slots = _put(cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 9, 9])
    assert got == slots[:3] and node.key == [1, 2, 3] and list(node.children) == [4]
    assert cache.total_size == 4
    cache.check()


def test_insert_returns_present_length_and_caller_frees_duplicates():
    pool, cache = _cache(32)
    first = _put(cache, [1, 2, 3, 4])
    # A second request computed the same prefix into its own slots, plus two more tokens.
    mine = pool.allocate(6)
    present = cache.insert([1, 2, 3, 4, 5, 6], mine)
    assert present == 4
    tree_slots, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert tree_slots == first + mine[4:]                       # tree kept its own slots
    dups = [s for s, t in zip(mine[:present], tree_slots) if s != t]
    assert dups == mine[:4]
    assert pool.num_free + cache.total_size + len(dups) == pool.size
    pool.free(dups)                                             # caller's part; no double free
    assert pool.num_free + cache.total_size == pool.size
    cache.check()

    # Reinserting what is all there: nothing new, the tree takes nothing.
    again = pool.allocate(3)
    assert cache.insert([1, 2, 3], again) == 3
    assert pool.num_free + cache.total_size + 3 == pool.size
    pool.free(again)
    cache.check()


def test_insert_with_the_trees_own_slots_needs_no_free():
    """A request that matched a prefix passes the tree's slots back; only its new tail is
    taken, and nothing in the matched part differs."""
    pool, cache = _cache(16)
    _put(cache, [5, 6, 7])
    cached, node = cache.match_prefix([5, 6, 7, 8])
    cache.lock(node)
    tail = pool.allocate(2)
    ids, slots = [5, 6, 7, 8, 9], cached + tail
    present = cache.insert(ids, slots)
    assert present == 3
    assert [s for s, t in zip(slots[:present], cache.match_prefix(ids)[0]) if s != t] == []
    cache.unlock(node)
    assert pool.num_free + cache.total_size == pool.size
    cache.check()


def test_insert_ending_inside_a_node_splits_it():
    pool, cache = _cache()
    slots = _put(cache, [1, 2, 3, 4])
    dup = pool.allocate(2)
    assert cache.insert([1, 2], dup) == 2
    pool.free(dup)
    _, node = cache.match_prefix([1, 2])
    assert node.key == [1, 2] and node.value == slots[:2] and len(node.children) == 1
    cache.check()


def test_insert_length_mismatch_raises():
    pool, cache = _cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1, 2])
    cache.check()


def test_branching_inserts():
    pool, cache = _cache()
    a = _put(cache, [1, 2, 3, 4])
    b_tail = pool.allocate(2)
    assert cache.insert([1, 2, 7, 8], a[:2] + b_tail) == 2      # branch at 2
    c = _put(cache, [9, 9])                                     # a second root child
    d_tail = pool.allocate(1)
    assert cache.insert([1, 5], a[:1] + d_tail) == 1            # branch at 1
    cache.check()
    assert cache.total_size == 4 + 2 + 2 + 1
    assert sorted(cache.root.children) == [1, 9]
    assert cache.match_prefix([1, 2, 3, 4])[0] == a
    assert cache.match_prefix([1, 2, 7, 8])[0] == a[:2] + b_tail
    assert cache.match_prefix([1, 5, 5])[0] == a[:1] + d_tail
    assert cache.match_prefix([9, 9])[0] == c
    _, n1 = cache.match_prefix([1])
    assert n1.key == [1] and sorted(n1.children) == [2, 5]
    _, n12 = cache.match_prefix([1, 2])
    assert n12.parent is n1 and sorted(n12.children) == [3, 7]
    assert pool.num_free + cache.total_size == pool.size


# ---- lock / unlock -----------------------------------------------------------------------

def test_lock_unlock_along_the_path():
    pool, cache = _cache()
    _put(cache, [1, 2, 3, 4])
    cache.insert([1, 2, 5, 6], cache.match_prefix([1, 2])[0] + pool.allocate(2))
    _, leaf_a = cache.match_prefix([1, 2, 3, 4])
    _, leaf_b = cache.match_prefix([1, 2, 5, 6])
    mid = leaf_a.parent
    assert mid is leaf_b.parent and mid.key == [1, 2]

    cache.lock(leaf_a)
    assert (leaf_a.lock_ref, mid.lock_ref, leaf_b.lock_ref) == (1, 1, 0)
    assert _sizes(cache) == (2, 4, 6)
    cache.lock(leaf_b)
    assert (leaf_a.lock_ref, mid.lock_ref, leaf_b.lock_ref) == (1, 2, 1)
    assert _sizes(cache) == (0, 6, 6)
    cache.lock(mid)
    assert mid.lock_ref == 3 and _sizes(cache) == (0, 6, 6)
    cache.check()

    cache.unlock(mid)
    cache.unlock(leaf_a)
    assert (leaf_a.lock_ref, mid.lock_ref, leaf_b.lock_ref) == (0, 1, 1)
    assert _sizes(cache) == (2, 4, 6)
    cache.unlock(leaf_b)
    assert _sizes(cache) == (6, 0, 6)
    assert cache.root.lock_ref == 0
    cache.check()


def test_lock_root_is_a_no_op():
    pool, cache = _cache()
    _put(cache, [1, 2])
    cache.lock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 0 and _sizes(cache) == (2, 0, 2)


def test_unlock_below_zero_raises_and_changes_nothing():
    pool, cache = _cache()
    _put(cache, [1, 2, 3])
    _, leaf = cache.match_prefix([1, 2, 3, 9])
    _, upper = cache.match_prefix([1])                          # split: upper, then leaf
    cache.lock(upper)
    with pytest.raises(RuntimeError, match="below zero"):
        cache.unlock(leaf)                                      # leaf is at 0, upper at 1
    assert (upper.lock_ref, leaf.lock_ref) == (1, 0)
    assert _sizes(cache) == (2, 1, 3)
    cache.unlock(upper)
    with pytest.raises(RuntimeError, match="below zero"):
        cache.unlock(upper)
    cache.check()


def test_stale_handle_is_refused():
    pool, cache = _cache()
    _put(cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    assert cache.evict(2) == 2
    with pytest.raises(RuntimeError, match="not in the tree"):
        cache.lock(node)
    assert _sizes(cache) == (0, 0, 0)
    cache.check()


# ---- evict -------------------------------------------------------------------------------

def test_evict_least_recently_used_leaf_first():
    pool, cache = _cache()
    _put(cache, [1, 1])
    _put(cache, [2, 2])
    _put(cache, [3, 3])
    cache.match_prefix([1, 1])                                  # [1, 1] is now the newest
    assert cache.evict(1) == 2                                  # a whole leaf: the oldest
    assert _cached(cache) == {(1, 1), (3, 3)}
    assert cache.evict(2) == 2                                  # then the next oldest
    assert _cached(cache) == {(1, 1)}
    assert pool.num_free + cache.total_size == pool.size
    cache.check()


def test_evict_never_touches_locked_nodes():
    pool, cache = _cache()
    a = _put(cache, [1, 2, 3])
    _put(cache, [4, 5])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    assert cache.evict(100) == 2                                # asked for more than exists
    assert _sizes(cache) == (0, 3, 3)
    assert cache.match_prefix([1, 2, 3])[0] == a
    assert cache.evict(1) == 0
    cache.unlock(node)
    assert cache.evict(1) == 3
    assert _sizes(cache) == (0, 0, 0) and pool.num_free == pool.size
    cache.check()


def test_evict_keeps_locked_parent_but_takes_its_unlocked_children():
    pool, cache = _cache()
    _put(cache, [1, 2, 3, 4])
    _, upper = cache.match_prefix([1, 2])
    cache.lock(upper)
    assert cache.evict(10) == 2                                 # the [3, 4] leaf only
    assert upper.children == {} and _sizes(cache) == (0, 2, 2)
    cache.unlock(upper)
    cache.check()


def test_parent_becomes_evictable_after_its_children_go():
    pool, cache = _cache()
    root_part = _put(cache, [1, 2])
    cache.insert([1, 2, 3], root_part + pool.allocate(1))
    cache.insert([1, 2, 4], root_part + pool.allocate(1))
    _put(cache, [9])                                            # the newest leaf
    # Leaves [3] and [4] are older than [9]; after both go, [1, 2] (older still) is next,
    # within the same evict call.
    assert cache.evict(3) == 4
    assert _cached(cache) == {(9,)}
    assert cache.evict(5) == 1                                  # only [9] was left
    assert cache.total_size == 0 and pool.num_free == pool.size
    cache.check()


def test_recent_match_protects_a_leaf_from_lru():
    pool, cache = _cache()
    _put(cache, [1, 2])
    cache.insert([1, 2, 3], cache.match_prefix([1, 2])[0] + pool.allocate(1))
    _put(cache, [9])
    cache.match_prefix([1, 2, 3])                               # [1, 2, 3] newer than [9]
    assert cache.evict(1) == 1
    assert _cached(cache) == {(1, 2), (1, 2, 3)}
    cache.check()


def test_evict_frees_into_the_pool_once():
    pool, cache = _cache(16)
    slots = _put(cache, [1, 2, 3, 4])
    free_before = pool.num_free
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.evict(3) == 4
    assert pool.num_free == free_before + 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(slots[:1])                                    # already back in the pool
    assert sorted(pool.allocate(pool.num_free)) == list(range(1, 17))


# ---- reset / check -----------------------------------------------------------------------

def test_reset_frees_everything():
    pool, cache = _cache(16)
    _put(cache, [1, 2, 3])
    cache.insert([1, 2, 5], cache.match_prefix([1, 2])[0] + pool.allocate(1))
    _, old = cache.match_prefix([1, 2, 3])
    cache.reset()
    assert _sizes(cache) == (0, 0, 0) and pool.num_free == pool.size
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    with pytest.raises(RuntimeError, match="not in the tree"):
        cache.lock(old)
    cache.check()
    _put(cache, [1, 2, 3])                                      # usable again
    cache.reset()
    assert pool.num_free == pool.size


def test_reset_with_locks_raises_and_keeps_the_tree():
    pool, cache = _cache(16)
    slots = _put(cache, [1, 2, 3])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert cache.match_prefix([1, 2, 3])[0] == slots and _sizes(cache) == (0, 3, 3)
    cache.unlock(node)
    cache.reset()
    assert pool.num_free == pool.size


def test_check_catches_corruption():
    pool, cache = _cache(16)
    slots = _put(cache, [1, 2, 3])
    _, node = cache.match_prefix([1, 2, 3])
    cache._evictable += 1
    with pytest.raises(RuntimeError, match="evictable"):
        cache.check()
    cache._evictable -= 1
    node.value = node.value[:2]
    with pytest.raises(RuntimeError, match="slots"):
        cache.check()
    node.value = slots
    pool.free(slots[:1])                                        # the tree still "owns" it
    with pytest.raises(RuntimeError, match="free list"):
        cache.check()


# ---- randomized --------------------------------------------------------------------------

class _Req:
    """A simulated request: its ids, the locked node its cached prefix ends at, the tree's
    slots for that prefix, and the slots it owns for the rest."""

    def __init__(self, ids: list[int], cached: list[int], node: TreeNode, own: list[int]):
        self.ids, self.cached, self.node, self.own = ids, cached, node, own

    @property
    def slots(self) -> list[int]:
        return self.cached + self.own


def _check_locks(cache: RadixCache, reqs: list[_Req]) -> None:
    """lock_ref of every node == number of requests whose locked node is it or below."""
    expected: dict[int, int] = {}
    for r in reqs:
        n = r.node
        while n is not cache.root:
            expected[n.id] = expected.get(n.id, 0) + 1
            n = n.parent
    for n in cache._nodes():
        assert n.lock_ref == expected.get(n.id, 0), (n, expected.get(n.id, 0))


def _cache_req(cache: RadixCache, req: _Req) -> None:
    """Give the request's KV to the tree (SGLang's cache_finished/unfinished_req): insert,
    free the duplicates the tree already had, re-match and move the lock to the new end."""
    pool = cache.pool
    ids, slots = req.ids, req.slots
    present = cache.insert(ids, slots)
    tree_slots, node = cache.match_prefix(ids)
    assert len(tree_slots) == len(ids) and tree_slots[present:] == slots[present:]
    assert tree_slots[:len(req.cached)] == req.cached           # locked: never changed
    dups = [s for s, t in zip(slots[:present], tree_slots) if s != t]
    assert set(dups) <= set(req.own)
    pool.free(dups)
    cache.lock(node)
    cache.unlock(req.node)
    req.cached, req.node, req.own = tree_slots, node, []


def test_random_requests_keep_every_invariant():
    rng = random.Random(1234)
    pool, cache = _cache(96)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    reqs: list[_Req] = []
    counts = {"start": 0, "grow": 0, "cache": 0, "finish": 0, "evict": 0, "abort": 0}

    def allocate(n: int) -> list[int] | None:
        if not pool.can_allocate(n):
            cache.evict(n - pool.num_free)
        return pool.allocate(n) if pool.can_allocate(n) else None

    for step in range(600):
        op = rng.random()
        if op < 0.3 or not reqs:                                # a request arrives
            ids = list(rng.choice(prefixes)) + [rng.randrange(50)
                                                for _ in range(rng.randrange(0, 8))]
            if rng.random() < 0.3 and reqs:                     # or continues another's
                other = rng.choice(reqs).ids
                ids = other[:rng.randrange(1, len(other) + 1)]
                ids += [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
            cached, node = cache.match_prefix(ids)
            assert cached == cache.match_prefix(ids[:len(cached)])[0]
            cache.lock(node)
            own = allocate(len(ids) - len(cached))
            if own is None:                                     # does not fit: back off
                cache.unlock(node)
            else:
                reqs.append(_Req(ids, cached, node, own))
                counts["start"] += 1
        elif op < 0.5:                                          # decode a few tokens
            req = rng.choice(reqs)
            n = rng.randrange(1, 4)
            more = allocate(n)
            if more is not None:
                req.ids += [rng.randrange(50) for _ in range(n)]
                req.own += more
                counts["grow"] += 1
        elif op < 0.6:                                          # cache an unfinished request
            _cache_req(cache, rng.choice(reqs))
            counts["cache"] += 1
        elif op < 0.8:                                          # finish: tree keeps the KV
            req = reqs.pop(rng.randrange(len(reqs)))
            _cache_req(cache, req)
            cache.unlock(req.node)
            counts["finish"] += 1
        elif op < 0.9:                                          # abort: free without caching
            req = reqs.pop(rng.randrange(len(reqs)))
            pool.free(req.own)
            cache.unlock(req.node)
            counts["abort"] += 1
        else:
            before = cache.evictable_size
            freed = cache.evict(rng.randrange(1, 20))
            assert freed <= before and cache.evictable_size == before - freed
            counts["evict"] += 1

        cache.check()
        _check_locks(cache, reqs)
        held = sum(len(r.own) for r in reqs)
        assert pool.num_free + cache.total_size + held == pool.size, step
        assert cache.evictable_size + cache.protected_size == cache.total_size
        for r in reqs:                                          # running prefixes stay cached
            assert cache.match_prefix(r.ids[:len(r.cached)])[0] == r.cached

    assert all(v > 10 for v in counts.values()), counts
    for req in reqs:                                            # drain: idle invariant
        pool.free(req.own)
        cache.unlock(req.node)
    assert cache.protected_size == 0
    assert pool.num_free + cache.evictable_size == pool.size
    cache.reset()
    assert pool.num_free == pool.size
