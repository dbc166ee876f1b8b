"""The socket address plan: every address any process binds or connects comes from here.

launch.py builds one Addresses and hands it to every child. ipc:// sockets live in a
private directory created with mode 0700 and removed at shutdown. Names of the default
layout (one process of each kind) are "api", "tokenizer", "scheduler", "detokenizer";
further workers of a kind are "api-1", "tokenizer-1", ... (worker_title).

| address | bound by | pushed to by |
|---|---|---|
| api[k] | API process k | the detokenizer (TextBatch of the rids k owns), tokenizers (rejects), the scheduler or DP controller (ControlReply) |
| tokenizer[i] | tokenizer worker i | every API process (one PUSH connected to all: round-robin) |
| scheduler | the scheduler, or with --dp-size > 1 the DP controller | tokenizers, the detokenizer (releases), replicas (status, replies) |
| replicas[r] | replica r's scheduler (--dp-size > 1; else replicas == (scheduler,)) | the DP controller |
| detokenizer | the detokenizer | every replica's scheduler |

`dist[r]` is not a ZeroMQ address: it is where replica r's tensor-parallel ranks meet
(torch.distributed's init_method): a file store in the ipc directory on one node, or
--dist-init-addr's tcp://HOST:PORT across nodes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Addresses:
    ipc_dir: str
    api: tuple[str, ...]        # one per API process (module docstring's table)
    tokenizer: tuple[str, ...]  # one per tokenizer worker
    scheduler: str              # the pipeline's entry to the scheduler side
    replicas: tuple[str, ...]   # one per scheduler replica
    detokenizer: str
    dist: tuple[str, ...]       # one per replica: its ranks' rendezvous (module docstring)

    @classmethod
    def create(cls, tokenizer_workers: int = 1, api_servers: int = 1, dp_size: int = 1,
               dist_init: tuple[str, int] | None = None) -> "Addresses":
        """dist_init: node 0's (host, port) when the ranks span several nodes."""
        ipc_dir = tempfile.mkdtemp(prefix="zserve-")   # mkdtemp creates it with mode 0700
        os.chmod(ipc_dir, 0o700)

        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, name)}"

        def ipcs(kind: str, n: int) -> tuple[str, ...]:
            return tuple(ipc(worker_title(kind, i)) for i in range(n))
        scheduler = ipc("scheduler")
        replicas = (scheduler,) if dp_size == 1 else \
            tuple(ipc(f"replica-{r}") for r in range(dp_size))
        if dist_init is None:
            dist = tuple(f"file://{os.path.join(ipc_dir, f'dist-{r}')}"
                         for r in range(dp_size))
        else:
            host, port = dist_init
            dist = (f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}",)
        return cls(ipc_dir=ipc_dir, api=ipcs("api", api_servers),
                   tokenizer=ipcs("tokenizer", tokenizer_workers), scheduler=scheduler,
                   replicas=replicas, detokenizer=ipc("detokenizer"), dist=dist)

    @property
    def data_parallel(self) -> bool:
        """A DP controller sits between the tokenizers and the replicas."""
        return self.replicas != (self.scheduler,)

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def worker_title(kind: str, index: int) -> str:
    """The name of worker `index` of a kind: its process title (zserve::NAME), log prefix and
    ipc file. The first keeps the bare name ("tokenizer"), the others are "tokenizer-1", ..."""
    return kind if index == 0 else f"{kind}-{index}"
