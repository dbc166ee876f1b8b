"""Tensor-parallel process groups: the collectives the sharded model and the runner use, behind
one interface, so the model code never knows how its ranks are joined.

    group.rank, group.size
    group.all_reduce_(t)           # in place, SUM over the ranks
    group.gather_vocab(t)          # rank 0: cat(every rank's t, -1); the others: None
    group.broadcast_bytes(b)       # rank 0 gives b, every rank returns it (others pass None)
    group.all_reduce_min(n)        # the smallest int any rank gave
    group.barrier()

Three kinds:
- SoloGroup: one rank (T = 1). Every call is the identity; the model skips its hooks
  altogether (`if tp.size > 1`), so a single rank pays nothing.
- DistGroup: torch.distributed between processes (`init_dist_group`): gloo on CPU, NCCL on
  CUDA plus a gloo group for the byte broadcast and the small integer collectives (SGLang's
  tp_cpu_group), so those never touch the GPU.
- ThreadGroup: T threads of one process (`ThreadGroup.run`), for tests. Sums are taken in
  rank order, so a result does not depend on which thread arrives first.

Every rank must make the same collective calls, with the same shapes, in the same order:
that is the runner's invariant (runner.py: execute), not this module's.

broadcast_bytes carries msgpack frames (wire/codec.py), never pickle, in uint8 tensors, in
two phases: a fixed HEAD_BYTES tensor holding the 8-byte little-endian length and the first
HEAD_BYTES - 8 bytes, then, only when the frame is longer, the rest. A decode step's plan
fits the head, so it costs one collective; receivers learn the length before the second.

Faults: a collective whose peer died raises (gloo: "Connection closed by peer"). Under
tensor parallelism a rank that stops inside a step leaves its peers inside a collective, so
any exception there is a TPFault: fatal, the process exits and the launcher takes the
server down.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from datetime import timedelta
from typing import Callable, TypeVar
from urllib.parse import urlparse

import numpy as np
import torch

HEAD_BYTES = 4096               # the first phase of broadcast_bytes (a decode step's plan fits)
LENGTH_BYTES = 8                # little-endian length at the start of the head
MAX_FRAME = 1 << 40             # a larger length can only be a corrupt head
FOREVER = timedelta(days=3650)  # idle followers wait in a broadcast; hangs are the watchdog's

T = TypeVar("T")


class TPFault(RuntimeError):
    """A tensor-parallel step failed: the peers may be inside a collective, so the model
    state of the whole group is unknown (runner.leaves_device_unknown says True)."""


class SoloGroup:
    """One rank: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if data is None:
            raise ValueError("rank 0 must give the bytes it broadcasts")
        return data

    def all_reduce_min(self, n: int) -> int:
        return n

    def barrier(self) -> None:
        pass


SOLO = SoloGroup()


class _Framed:
    """broadcast_bytes over a group's in-place uint8 broadcast from rank 0 (`_broadcast_`)."""

    rank: int

    def _broadcast_(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes the frame, the others None; every rank returns the frame."""
        first = HEAD_BYTES - LENGTH_BYTES
        head = np.zeros(HEAD_BYTES, dtype=np.uint8)
        if self.rank == 0:
            if data is None:
                raise ValueError("rank 0 must give the bytes it broadcasts")
            n = len(data)
            head[:LENGTH_BYTES] = np.frombuffer(n.to_bytes(LENGTH_BYTES, "little"), np.uint8)
            head[LENGTH_BYTES:LENGTH_BYTES + min(n, first)] = np.frombuffer(
                data, np.uint8, count=min(n, first))
        self._broadcast_(torch.from_numpy(head))
        if self.rank == 0:
            if len(data) > first:
                self._broadcast_(torch.from_numpy(np.frombuffer(data, np.uint8)[first:].copy()))
            return bytes(data)
        n = int.from_bytes(head[:LENGTH_BYTES].tobytes(), "little")
        if n > MAX_FRAME:
            raise TPFault(f"broadcast head announces {n} bytes: corrupt")
        out = head[LENGTH_BYTES:LENGTH_BYTES + min(n, first)].tobytes()
        if n <= first:
            return out
        rest = np.empty(n - first, dtype=np.uint8)
        self._broadcast_(torch.from_numpy(rest))
        return out + rest.tobytes()


class DistGroup(_Framed):
    """One rank of a torch.distributed group (module docstring). `device_group` carries the
    model's tensors (gloo on CPU, NCCL on CUDA); `cpu_group` the bytes and integers."""

    def __init__(self, rank: int, size: int, device_group, cpu_group):
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, group=self.device_group)
        return t

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor | None:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(t, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def _broadcast_(self, t: torch.Tensor) -> None:
        torch.distributed.broadcast(t, src=0, group=self.cpu_group)

    def all_reduce_min(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.cpu_group)


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device a rank's model lives on: `device` as given on CPU or with an index; a
    bare "cuda" becomes cuda:rank (modulo the GPUs this process sees)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return device


def init_dist_group(device: str | torch.device, init_method: str, rank: int,
                    world_size: int) -> DistGroup:
    """Join the replica's group: `init_method` is the rendezvous (a file:// store on one
    node, tcp://HOST:PORT across nodes). Blocks until all world_size ranks joined. The
    timeout is FOREVER: followers sit in a broadcast while the server is idle."""
    import torch.distributed as dist

    if _is_loopback(init_method):
        # gloo connects its pairs through the interface the host name resolves to, which in
        # a container may be unroutable; on one host the loopback always works.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = rank_device(device, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=FOREVER)
    world = dist.group.WORLD
    cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=FOREVER)
    return DistGroup(rank, world_size, world, cpu)


def _is_loopback(init_method: str) -> bool:
    url = urlparse(init_method)
    if url.scheme == "file":
        return True
    host = url.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Shared:
    """What the threads of one ThreadGroup exchange through."""

    def __init__(self, size: int, timeout: float):
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size


class ThreadGroup(_Framed):
    """Rank `rank` of `size` threads in one process (tests). Each collective: every thread
    posts its value, waits for all, reads what it needs, waits again (so no slot is
    overwritten while another thread still reads it)."""

    def __init__(self, rank: int, size: int, shared: _Shared):
        self.rank, self.size, self._shared = rank, size, shared

    @classmethod
    def create(cls, size: int, timeout: float = 60.0) -> list[ThreadGroup]:
        shared = _Shared(size, timeout)
        return [cls(r, size, shared) for r in range(size)]

    @classmethod
    def run(cls, size: int, fn: Callable[[ThreadGroup], T], timeout: float = 60.0) -> list[T]:
        """fn(group) on `size` threads, one per rank; their results in rank order. The
        first exception is re-raised (the others' collectives are broken, not left hanging)."""
        groups = cls.create(size, timeout)
        results: list = [None] * size
        errors: list[BaseException] = []

        def body(g: ThreadGroup) -> None:
            try:
                results[g.rank] = fn(g)
            except BaseException as e:          # noqa: BLE001 - re-raised below
                errors.append(e)
                g._shared.barrier.abort()

        threads = [threading.Thread(target=body, args=(g,), name=f"tp-rank-{g.rank}")
                   for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        primary = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if primary or errors:
            raise (primary or errors)[0]
        return results

    def _exchange(self, value):
        """Post value, wait for every rank's; the list of all values in rank order."""
        s = self._shared
        s.slots[self.rank] = value
        s.barrier.wait()
        return list(s.slots)

    def _done(self) -> None:
        self._shared.barrier.wait()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        self._done()
        return t.copy_(total)

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(t)
        out = torch.cat(parts, dim=-1) if self.rank == 0 else None
        self._done()
        return out

    def _broadcast_(self, t: torch.Tensor) -> None:
        src = self._exchange(t)[0]
        if self.rank != 0:
            t.copy_(src)
        self._done()

    def all_reduce_min(self, n: int) -> int:
        out = min(self._exchange(n))
        self._done()
        return out

    def barrier(self) -> None:
        self._shared.barrier.wait()
