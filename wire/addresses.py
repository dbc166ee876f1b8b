"""The socket address plan: every address any process binds or connects comes from here.

launch.py builds one Addresses and hands it to every child. ipc:// sockets live in a
private directory created with mode 0700 and removed at shutdown.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Addresses:
    ipc_dir: str
    api: str                    # bound by the API process: TextBatch (and tokenizer rejects)
    tokenizer: tuple[str, ...]  # one per tokenizer worker, bound by it ("tokenizer",
                                # "tokenizer-1", ...): GenerateRequest, AbortRequest,
                                # FlushCacheRequest; the API's one PUSH connects to all
    scheduler: str              # bound by the scheduler: TokenizedRequest, AbortRequest,
                                # ReleaseRequest
    detokenizer: str            # bound by the detokenizer: TokenBatch

    @classmethod
    def create(cls, tokenizer_workers: int = 1) -> "Addresses":
        ipc_dir = tempfile.mkdtemp(prefix="zserve-")   # mkdtemp creates it with mode 0700
        os.chmod(ipc_dir, 0o700)

        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, name)}"
        return cls(ipc_dir=ipc_dir, api=ipc("api"),
                   tokenizer=tuple(ipc(worker_title("tokenizer", i))
                                   for i in range(tokenizer_workers)),
                   scheduler=ipc("scheduler"), detokenizer=ipc("detokenizer"))

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def worker_title(kind: str, index: int) -> str:
    """The name of worker `index` of a kind: its process title (zserve::NAME), log prefix and
    ipc file. The first keeps the bare name ("tokenizer"), the others are "tokenizer-1", ..."""
    return kind if index == 0 else f"{kind}-{index}"
