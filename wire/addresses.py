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
    api: str            # bound by the API process: TextBatch (and tokenizer rejects)
    tokenizer: str      # bound by the tokenizer worker: GenerateRequest, AbortRequest
    scheduler: str      # bound by the scheduler: TokenizedRequest, AbortRequest, ReleaseRequest
    detokenizer: str    # bound by the detokenizer: TokenBatch

    @classmethod
    def create(cls) -> "Addresses":
        ipc_dir = tempfile.mkdtemp(prefix="zserve-")   # mkdtemp creates it with mode 0700
        os.chmod(ipc_dir, 0o700)

        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, name)}"
        return cls(ipc_dir=ipc_dir, api=ipc("api"), tokenizer=ipc("tokenizer"),
                   scheduler=ipc("scheduler"), detokenizer=ipc("detokenizer"))

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
