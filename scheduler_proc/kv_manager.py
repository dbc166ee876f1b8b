"""KVManager: request-level KV bookkeeping over the slot pool, the request-to-token table and
the radix prefix cache. The scheduler decides *what* runs; this decides *where its KV lives*.

Invariants, for an admitted request `req`:
- req.row is its row in the request table; positions 0..len(req.slots)-1 map to req.slots.
- req.slots[:req.prefix_len] belong to the radix tree and stay locked through
  req.prefix_node until release(); the rest are owned by the request alone.
When idle: pool.num_free + cache.evictable_size == pool.size (nothing owned, nothing locked).
"""

from __future__ import annotations

from scheduler_proc.pool import ReqToToken, TokenPool
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req


class KVManager:
    def __init__(self, pool: TokenPool, table: ReqToToken, use_cache: bool):
        self.pool = pool
        self.table = table
        self.cache = RadixCache(pool) if use_cache else None

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
        req.row = self.table.allocate()
        if self.cache is None:
            return
        slots, node = self.cache.match_prefix(req.token_ids(0, req.max_prefix_match))
        self.cache.lock(node)
        req.prefix_node, req.prefix_len = node, len(slots)
        req.slots = list(slots)
        self.table.write(req.row, 0, req.slots)

    def extend(self, req: Req, n: int) -> None:
        """Allocate slots for req's next n positions."""
        if self.pool.num_free < n and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        slots = self.pool.allocate(n)
        self.table.write(req.row, len(req.slots), slots)
        req.slots += slots

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
            have = self.cache.insert(req.token_ids(0, n), req.slots[:n])
            self.pool.free(req.slots[req.prefix_len:have] + req.slots[n:])
            self.cache.unlock(req.prefix_node)
        self.table.free(req.row)
        req.row, req.slots, req.prefix_node, req.prefix_len = None, [], None, 0

    def flush(self) -> None:
        """Drop every cached prefix. Only valid when no request holds a lock."""
        if self.cache is not None:
            self.cache.reset()
