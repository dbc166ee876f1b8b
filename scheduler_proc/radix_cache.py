"""The prefix cache: a radix tree over token ids whose nodes own KV slots of a TokenPool
(SGLang's RadixCache, page size 1).

A request that starts with a cached prefix reuses its slots instead of recomputing them.
Running requests lock the path they use; unlocked leaves are evicted least recently used
first when the pool runs short. Verbs: `match_prefix / insert / evict`, `lock / unlock`.

Invariants (kept by RadixCache, verified by `check()`):
- len(node.key) == len(node.value) for every node; the root has an empty key, every other
  node a non-empty one, and a parent's children are keyed by their first token id.
- every slot the tree owns is owned by exactly one node and is not in the pool's free list.
- node.lock_ref == number of lock() calls on it or a descendant not yet unlock()ed; locked
  nodes are never evicted. (So a parent's lock_ref >= the sum of its children's.)
- evictable_size == slots in nodes with lock_ref == 0; protected_size == slots in locked
  nodes; evictable_size + protected_size == total_size == slots in the tree.

Node identity is stable: a split keeps the original node object as the lower part (the one
that still ends where it did), so a TreeNode a request holds keeps meaning the same prefix.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from scheduler_proc.pool import TokenPool


class TreeNode:
    """One edge of the tree: `key` token ids whose KV lives in `value` slots."""

    __slots__ = ("id", "key", "value", "children", "parent", "lock_ref", "last_access")

    _ids = itertools.count()

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None,
                 last_access: int = 0):
        self.id = next(TreeNode._ids)             # tie-break for the eviction heap
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}   # first token id -> child
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access            # RadixCache's clock, not wall time

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


def common_prefix_len(key: list[int], ids: list[int], start: int) -> int:
    """Length of the common prefix of key and ids[start:]."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start:start + n]:           # the usual case: one C-level compare
        return n
    i = 0
    while key[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    """Radix tree of cached prefixes over a TokenPool. See the module docstring for the
    invariants; sizes are counters kept incrementally, so their queries are O(1)."""

    def __init__(self, pool: TokenPool):
        self.pool = pool
        self._clock = itertools.count(1)
        self.root = TreeNode([], [], None)        # empty key; never locked, never evicted
        self._evictable = 0
        self._protected = 0

    # ---- sizes --------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- match / insert / evict ---------------------------------------------------------

    def match_prefix(self, ids: Sequence[int]) -> tuple[list[int], TreeNode]:
        """Longest cached prefix of ids: (its slots, the node where the match ends; root if
        none). If the match ends inside a node, that node is split so the returned node ends
        exactly there. Touches last_access of the matched path."""
        ids = list(ids)
        now = next(self._clock)
        node, i, slots = self.root, 0, []
        node.last_access = now
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = common_prefix_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots += child.value
            node, i = child, i + n                # after a split, the next lookup misses
        return slots, node

    def insert(self, ids: Sequence[int], slots: Sequence[int]) -> int:
        """Insert ids with their slots. Returns how many leading ids were already in the
        tree; for those the tree keeps its own slots, and the caller still owns (and must
        free) the entries of slots[:returned] that differ from the tree's. The tree takes
        ownership of slots[returned:]. Splits nodes as needed."""
        ids, slots = list(ids), list(slots)
        if len(ids) != len(slots):
            raise ValueError(f"insert: {len(ids)} ids but {len(slots)} slots")
        now = next(self._clock)
        node, i = self.root, 0
        node.last_access = now
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = TreeNode(ids[i:], slots[i:], node, now)
                node.children[ids[i]] = leaf
                self._evictable += len(leaf.key)
                break
            n = common_prefix_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def evict(self, num_slots: int) -> int:
        """Free at least num_slots (if possible) back to the pool, evicting unlocked leaves
        least recently used first; a parent left as an unlocked leaf becomes a candidate.
        Returns the number freed (less than asked if not enough is evictable)."""
        if num_slots <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            self.pool.free(leaf.value)
            freed += len(leaf.value)
            self._evictable -= len(leaf.value)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None                    # stale handles now fail lock()/unlock()
            if not parent.children and parent.lock_ref == 0 and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ---- lock / unlock ------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (lock_ref += 1 along the path)."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Undo one lock(node). Raises (changing nothing) if a lock_ref would go negative."""
        path = self._path(node)
        for n in path:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of {n!r} below zero (unlocking {node!r})")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)
                self._evictable += len(n.key)

    # ---- whole tree ---------------------------------------------------------------------

    def reset(self) -> None:
        """Free every slot back to the pool and empty the tree. Raises if anything is
        locked (a running request still uses the tree)."""
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked slots in the tree")
        slots = [s for n in self._nodes() for s in n.value]
        self.pool.free(slots)
        for n in self._nodes():
            n.parent = None
        self.root = TreeNode([], [], None)
        self._evictable = self._protected = 0

    def check(self) -> None:
        """Walk the tree and verify every invariant; raise RuntimeError naming the first one
        broken. O(tree size): for tests and debugging."""
        def fail(msg: str) -> None:
            raise RuntimeError(f"radix cache invariant broken: {msg}")

        if self.root.key or self.root.value or self.root.parent is not None:
            fail("root must have an empty key and value and no parent")
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            if not node.key:
                fail(f"{node!r} has an empty key")
            if len(node.key) != len(node.value):
                fail(f"{node!r}: {len(node.key)} ids but {len(node.value)} slots")
            if node.parent is None or node.parent.children.get(node.key[0]) is not node:
                fail(f"{node!r} is not its parent's child under its first token id")
            if node.lock_ref < 0:
                fail(f"{node!r} has negative lock_ref")
            below = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < below:
                fail(f"{node!r}: lock_ref {node.lock_ref} < children's total {below}")
            for s in node.value:
                if s in seen:
                    fail(f"slot {s} owned twice")
                if not 0 < s <= self.pool.size:
                    fail(f"slot {s} of {node!r} is outside the pool")
                if self.pool._is_free[s]:         # pool internals: read-only, for checking
                    fail(f"slot {s} of {node!r} is in the pool's free list")
                seen.add(s)
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        if self.root.lock_ref != 0:
            fail(f"root lock_ref {self.root.lock_ref} != 0 (the root is never locked)")
        if (evictable, protected) != (self._evictable, self._protected):
            fail(f"counted evictable/protected {evictable}/{protected}, "
                 f"kept {self._evictable}/{self._protected}")

    # ---- helpers ------------------------------------------------------------------------

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split node after its first n ids (0 < n < len(key)); return the new upper node.
        The original object stays the lower part, so handles to it keep their meaning; the
        upper part inherits lock_ref (every lock below node also covers it) and last_access,
        so sizes do not change."""
        parent = node.parent
        upper = TreeNode(node.key[:n], node.value[:n], parent, node.last_access)
        upper.lock_ref = node.lock_ref
        node.key, node.value = node.key[n:], node.value[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        parent.children[upper.key[0]] = upper
        return upper

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """node and its ancestors below the root; raises if node is no longer in this tree."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise RuntimeError(f"{node!r} is not in the tree (evicted or reset)")
            path.append(node)
            node = node.parent
        return path

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
