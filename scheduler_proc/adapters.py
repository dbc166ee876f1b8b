"""Adapters: the scheduler's table of LoRA adapters (--enable-lora): which names are loaded,
in which of the runner's slots, how many requests use each, and the unloads waiting for
those requests to end.

    adapters.load(name, path) -> (ok, message)    # /load_lora_adapter
    adapters.unload(name, done) -> message | None # /unload_lora_adapter: done(ok, message)
                                                  # is called once no request uses it
    adapters.problem(name) -> message | None      # can a new request use it (404 if not)
    adapters.acquire(req) / adapters.release(req) # a request names it / has ended
    adapters.fits(running, req)                   # --max-loras-per-batch

Invariants: `users[name]` counts the requests in flight (queued or running) that name
`name`, acquired once when accepted and released once when they end; an adapter being
unloaded takes no new request, and its slot is freed (runner.unload_adapter) only when its
users reach 0. Each load gets a new `uid`: the prefix cache keys a request's prompt by it
(Req), so KV computed under an adapter that was unloaded is never matched again, even under
a reloaded adapter of the same name.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from scheduler_proc.runner import leaves_device_unknown
from wire.server_args import ServerArgs, lora_name, lora_name_problem, lora_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    slot: int
    uid: int
    users: int = 0
    unloads: list[Callable[[bool, str], None]] = field(default_factory=list)  # waiting

    @property
    def draining(self) -> bool:
        return bool(self.unloads)


class Adapters:
    def __init__(self, args: ServerArgs, runner):
        """runner: has load_adapter(slot, path) -> rank and unload_adapter(slot)."""
        self.runner = runner
        self.max_loaded = args.max_loaded_loras
        self.max_rank = args.max_lora_rank
        self.per_batch = args.max_loras_per_batch
        self.by_name: dict[str, Adapter] = {}
        self._uids = itertools.count(1)
        for spec in args.lora_paths or ():
            ok, message = self.load(lora_name(spec), lora_path(spec))
            if not ok:
                raise ValueError(f"--lora-paths {spec}: {message}")

    @property
    def names(self) -> list[str]:
        """Loaded and usable, in load order (SchedulerLoad.lora_adapters)."""
        return [a.name for a in self.by_name.values() if not a.draining]

    def load(self, name: str, path: str) -> tuple[bool, str]:
        """Load `name` from `path`. The same name from the same path again is a success
        (nothing reloaded): a load that failed on some data-parallel replicas converges when
        retried."""
        if (problem := lora_name_problem(name)) is not None or not path:
            return False, problem or "lora_path must be a non-empty string."
        if name in self.by_name:
            adapter = self.by_name[name]
            if adapter.path == path and not adapter.draining:
                return True, f"The adapter `{name}` is loaded (from {path} already)."
            what = "being unloaded" if adapter.draining else f"already loaded from {adapter.path}"
            return False, f"The adapter `{name}` is {what}."
        used = {a.slot for a in self.by_name.values()}
        free = next((s for s in range(1, self.max_loaded + 1) if s not in used), None)
        if free is None:
            return False, (f"{self.max_loaded} adapters are loaded (--max-loaded-loras): "
                           f"unload one first.")
        try:
            rank = self.runner.load_adapter(free, path, self.max_rank)
        except Exception as e:          # noqa: BLE001 - the adapter's fault (AdapterError,
            if leaves_device_unknown(e):            # out of memory), not the server's
                raise
            log.warning("loading LoRA adapter %s from %s failed: %s", name, path, e)
            return False, f"Cannot load the adapter `{name}`: {e}"
        self.by_name[name] = Adapter(name, path, free, next(self._uids))
        log.info("loaded LoRA adapter %s (rank %d) from %s into slot %d", name, rank, path,
                 free)
        return True, f"Loaded the adapter `{name}`."

    def unload(self, name: str, done: Callable[[bool, str], None]) -> None:
        """Unload `name` once no request uses it; done(ok, message) then (or at once)."""
        adapter = self.by_name.get(name)
        if adapter is None:
            done(False, f"The adapter `{name}` is not loaded.")
            return
        adapter.unloads.append(done)
        if adapter.users == 0:
            self._drop(adapter)
        else:
            log.info("unloading LoRA adapter %s once its %d requests end", name,
                     adapter.users)

    def _drop(self, adapter: Adapter) -> None:
        self.runner.unload_adapter(adapter.slot)
        del self.by_name[adapter.name]
        log.info("unloaded LoRA adapter %s", adapter.name)
        for done in adapter.unloads:
            done(True, f"Unloaded the adapter `{adapter.name}`.")

    def problem(self, name: str) -> str | None:
        """Why a new request cannot use adapter `name` (for a 404), or None."""
        adapter = self.by_name.get(name)
        if adapter is None:
            return f"The model `{name}` does not exist (no LoRA adapter of that name is loaded)."
        if adapter.draining:
            return f"The model `{name}` does not exist (its LoRA adapter is being unloaded)."
        return None

    def acquire(self, name: str) -> Adapter:
        adapter = self.by_name[name]
        adapter.users += 1
        return adapter

    def release(self, adapter: Adapter) -> None:
        adapter.users -= 1
        if adapter.users == 0 and adapter.draining:
            self._drop(adapter)

    def fits(self, running: list, req) -> bool:
        """Can req join running without more than --max-loras-per-batch adapters in a step?"""
        if req.adapter is None:
            return True
        names = {r.adapter.name for r in running if r.adapter is not None}
        return req.adapter.name in names or len(names) < self.per_batch
