"""Imports follow the process graph: no process package imports another's, the model
package imports none of them, and only the scheduler loads torch.

The tokenizer, detokenizer and API processes tokenize with tokenization.hf_tokenizer, not
transformers (whose import pulls in torch: seconds of CPU and hundreds of MB per process).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tokenization.hf_tokenizer import HFTokenizer

REPO = Path(__file__).resolve().parent.parent

# What each process body loads before it is ready, in a fresh interpreter.
PROCESS_BODIES = """
import json, sys
from pathlib import Path
import api_proc.openai_api, launch
from detokenizer_proc.process import make_detokenizer
from tokenizer_proc.process import make_worker
from wire.server_args import ServerArgs
config = launch.resolve_args(ServerArgs(model_path=sys.argv[1], context_length=64,
                                        chat_template="{{ messages[0].content }}"))
make_worker(config)
make_detokenizer(config)
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def test_process_bodies_import_neither_torch_nor_transformers(tiny_model):
    out = subprocess.run([sys.executable, "-c", PROCESS_BODIES, str(tiny_model("llama"))],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr


def libtorch_mapped(proc: psutil.Process) -> bool:
    return any(Path(m.path).name.startswith("libtorch") for m in proc.memory_maps())


@pytest.mark.e2e
def test_only_the_scheduler_maps_libtorch(tiny_model, llama_server):
    path, server = tiny_model("llama"), llama_server
    # The API process loads its own tokenizer on first use: echo a token-id prompt.
    ids = [40, 41, 42, 0, 43]
    r = server.client.post("/v1/completions", json={"prompt": ids, "echo": True,
                                                     "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(
        HFTokenizer.from_dir(path).decode(ids, skip_special_tokens=False))
    procs = {"api": psutil.Process(server.proc.pid),
             **{title: server.child(title) for title in ("tokenizer", "detokenizer",
                                                         "scheduler")}}
    assert {name: libtorch_mapped(p) for name, p in procs.items()} == {
        "api": False, "tokenizer": False, "detokenizer": False, "scheduler": True}


def _imports(path: Path):
    """(line, top-level package) of every absolute import in a module."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def test_no_process_package_imports_another():
    """A *_proc package is one process's code; the shared packages (wire, tokenization,
    grammars, models, checkpoints) import no *_proc package at all."""
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    procs = {p for p in packages if p.endswith("_proc")}
    assert {"api_proc", "tokenizer_proc", "scheduler_proc", "detokenizer_proc"} <= procs
    assert "models" in packages and "tokenization" in packages
    crossings = [f"{f.relative_to(REPO)}:{line} imports {top}"
                 for package in sorted(packages) for f in sorted((REPO / package).rglob("*.py"))
                 for line, top in _imports(f)
                 if top in procs and top != package]
    assert crossings == []
