"""KVManager: request-level KV bookkeeping. It owns the allocators of KV memory: the slot pool
(TokenPool), the request-to-token table (ReqToToken) and the radix prefix cache over the
pool. The scheduler decides *what* runs; this decides *where its KV lives*. The K/V buffers
themselves (pool.KVCache) are the ModelRunner's: slot s is row s of every layer's buffer,
so the runner's KVCache must hold pool_size slots, and the runner reads `req_to_token.table`
(given to each forward) to find a request's slots.

Invariants (verified by `check()`), for an admitted request `req`:
- req.row is its own row of the request table; the row maps positions 0..len(req.slots)-1
  to req.slots and holds 0 (the padding slot) beyond. A free row is all 0.
- req.slots[:req.prefix_len] are the slots of the tree's path from the root to
  req.prefix_node, which req locks once until release(); the rest are owned by req alone.
A request that is not admitted (waiting) holds no row, no slot and no lock.
Every slot of the pool is in exactly one place: free, in the tree, or owned by one admitted
request: pool.num_free + cache.total_size + sum(owned) == pool.size.
When idle (nothing admitted): every row is free, nothing is locked, and
pool.num_free + cache.evictable_size == pool.size.
"""

from __future__ import annotations

import torch

from scheduler_proc.pool import ReqToToken, TokenPool
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req


class KVManager:
    def __init__(self, pool_size: int, max_running: int, context_len: int,
                 device: torch.device | str, use_cache: bool):
        """pool_size: KV slots (the runner's KVCache size); max_running: rows of the request
        table (at least the scheduler's --max-running-requests); context_len: its width."""
        self.pool = TokenPool(pool_size)
        self.req_to_token = ReqToToken(max_running, context_len, device)
        self.cache = RadixCache(self.pool) if use_cache else None

    @property
    def evictable(self) -> int:
        return self.cache.evictable_size if self.cache else 0

    @property
    def available(self) -> int:
        """Slots that can be handed out now, evicting unlocked cached prefixes if needed."""
        return self.pool.num_free + self.evictable

    def admit(self, req: Req) -> None:
        """Give req a table row and its longest cached prefix. The last known token is never
        matched: its logits are needed, so at least one position is always computed."""
        req.row = self.req_to_token.allocate()
        if self.cache is None:
            return
        slots, node = self.cache.match_prefix(req.key_ids(0, req.max_prefix_match))
        self.cache.lock(node)
        req.prefix_node, req.prefix_len = node, len(slots)
        req.slots = list(slots)
        self.req_to_token.write(req.row, 0, req.slots)

    def extend(self, req: Req, n: int) -> None:
        """Allocate slots for req's next n positions."""
        if self.pool.num_free < n and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        slots = self.pool.allocate(n)
        self.req_to_token.write(req.row, len(req.slots), slots)
        req.slots += slots

    def truncate(self, req: Req, n: int) -> None:
        """Give back the slots of req's positions n and after (a verify step's rejected
        drafts: speculative.py); their table entries go back to 0."""
        if not req.prefix_len <= n <= len(req.slots):
            raise RuntimeError(f"truncate of {req.rid} to {n} positions outside "
                               f"[{req.prefix_len}, {len(req.slots)}]")
        dropped = req.slots[n:]
        if dropped:
            self.pool.free(dropped)
            self.req_to_token.write(req.row, n, [0] * len(dropped))
            del req.slots[n:]

    def release(self, req: Req, valid: int | None = None) -> None:
        """Give back everything req holds. With the cache, its computed tokens are inserted
        into the tree (so a finished or retracted request's KV can be reused) and only the
        slots that duplicate what the tree already had are freed. `valid`: only positions
        0..valid-1 hold trustworthy KV (a failed step's positions do not); the slots of the
        rest are freed, never cached. It is never below req.prefix_len (the tree's own)."""
        n = len(req.slots) if valid is None else valid
        if not req.prefix_len <= n <= len(req.slots):
            raise RuntimeError(f"release of {req.rid}: {n} valid positions outside "
                               f"[{req.prefix_len}, {len(req.slots)}]")
        if self.cache is None:
            self.pool.free(req.slots)
        else:
            have = self.cache.insert(req.key_ids(0, n), req.slots[:n])
            self.pool.free(req.slots[req.prefix_len:have] + req.slots[n:])
            self.cache.unlock(req.prefix_node)
        self.req_to_token.free(req.row)
        req.row, req.slots, req.prefix_node, req.prefix_len = None, [], None, 0

    def flush(self) -> None:
        """Drop every cached prefix. Only valid when no request holds a lock."""
        if self.cache is not None:
            self.cache.reset()

    def check(self, admitted: list[Req]) -> None:
        """Verify the module docstring's invariants for these admitted requests (all of
        them), and the tree's slot counts; raise RuntimeError naming the first one broken.
        The tree's own structure is RadixCache.check's. O(tree + tokens): for tests and
        debugging."""
        def fail(msg: str) -> None:
            raise RuntimeError(f"KV invariant broken: {msg}")

        rows = [r.row for r in admitted]
        if None in rows or len(set(rows)) != len(rows):
            fail(f"admitted requests' rows are not distinct rows: {rows}")
        if self.req_to_token.num_free + len(rows) != self.req_to_token.size:
            fail(f"{self.req_to_token.num_free} free rows + {len(rows)} admitted != "
                 f"{self.req_to_token.size}")
        table = self.req_to_token.table.tolist()
        for r in set(range(len(table))) - set(rows):
            if any(table[r]):
                fail(f"free row {r} of the request table is not all 0")
        locks: dict[int, int] = {}                   # id(node) -> locks admitted reqs hold
        owned: list[int] = []
        for req in admitted:
            n, row = len(req.slots), table[req.row]
            if row[:n] != req.slots or any(row[n:]):
                fail(f"{req.rid}: table row {req.row} does not map its {n} positions")
            path: list[int] = []
            node = req.prefix_node
            if self.cache is None:
                if node is not None or req.prefix_len:
                    fail(f"{req.rid} holds a prefix without a cache")
            else:
                while node is not self.cache.root:
                    locks[id(node)] = locks.get(id(node), 0) + 1
                    path[:0] = node.value
                    node = node.parent
            if path != req.slots[:req.prefix_len]:
                fail(f"{req.rid}: its first {req.prefix_len} slots are not its locked path")
            owned += req.slots[req.prefix_len:]
        tree: set[int] = set()
        cached = evictable = 0
        if self.cache is not None:
            stack = list(self.cache.root.children.values())
            while stack:
                node = stack.pop()
                if node.lock_ref != locks.get(id(node), 0):
                    fail(f"{node!r} has lock_ref {node.lock_ref}, admitted requests hold "
                         f"{locks.get(id(node), 0)}")
                tree.update(node.value)
                cached += len(node.value)
                evictable += 0 if node.lock_ref else len(node.value)
                stack.extend(node.children.values())
            if (len(tree), evictable) != (self.cache.total_size, self.cache.evictable_size):
                fail(f"the tree holds {cached} slots ({len(tree)} distinct, {evictable} "
                     f"unlocked); it counts {self.cache.total_size} "
                     f"({self.cache.evictable_size} evictable)")
        is_free = self.pool._is_free                 # pool internals: read-only, for checking
        if cached != len(tree) or any(not 0 < s <= self.pool.size or is_free[s]
                                      for s in tree):
            fail("a slot of the tree is in it twice, free or outside the pool")
        if len(set(owned)) != len(owned) or not tree.isdisjoint(owned):
            fail("a slot is owned twice (by two requests, or by a request and the tree)")
        if any(not 0 < s <= self.pool.size or is_free[s] for s in owned):
            fail("a request owns a slot that is free or outside the pool")
        if self.pool.num_free + len(tree) + len(owned) != self.pool.size:
            fail(f"{self.pool.num_free} free + {len(tree)} cached + {len(owned)} owned != "
                 f"{self.pool.size} slots (leaked)")
