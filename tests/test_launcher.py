"""The launcher explains itself: --help works, and every mistake in how the server is started
ends within seconds, before a model is loaded, with one line naming the problem."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.server import REPO, Server

MISTAKE_SECONDS = 3.0


def launch(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_lists_every_flag_with_its_default():
    r = launch("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--model-path", "--api-key", "--max-queued-requests", "--shutdown-timeout",
                 "--mem-fraction-static"):
        assert flag in r.stdout
    assert "(default: 30000)" in r.stdout


def broken_models(root, tiny):
    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny / "config.json", no_weights)
    gpt2 = root / "gpt2"
    shutil.copytree(tiny, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config,
                                                  "architectures": ["GPT2LMHeadModel"]}))
    empty = root / "empty"
    empty.mkdir()
    return {"missing": (["--model-path", str(root / "nope")], "no such file or directory"),
            "no_config": (["--model-path", str(empty)], "no config.json"),
            "no_weights": (["--model-path", str(no_weights)], "no *.safetensors weights"),
            "architecture": (["--model-path", str(gpt2)],
                             "GPT2LMHeadModel is not supported; zserve serves LlamaForCausalLM"),
            "bad_value": (["--model-path", str(tiny), "--port", "http"],
                          "argument --port: invalid int value"),
            "bad_range": (["--model-path", str(tiny), "--max-running-requests", "0"],
                          "--max-running-requests must be positive"),
            "context": (["--model-path", str(tiny), "--context-length", "100000"],
                        "longer than the model's max_position_embeddings (512)"),
            "tp_size": (["--model-path", str(tiny), "--tp-size", "5"],
                        "--tp-size 5: the model has only 4 attention heads to split"),
            "node_mismatch": (["--model-path", str(tiny), "--nnodes", "2", "--tp-size", "3",
                               "--dist-init-addr", "127.0.0.1:1"],
                              "--tp-size (3) must be a multiple of --nnodes (2)")}


CASES = ["missing", "no_config", "no_weights", "architecture", "bad_value", "bad_range",
         "context", "tp_size", "node_mismatch"]


@pytest.mark.parametrize("case", CASES)
def test_mistakes_are_one_line_and_fast(case, tiny_model, tmp_path):
    argv, fragment = broken_models(tmp_path, tiny_model("llama"))[case]
    t0 = time.monotonic()
    r = launch(*argv)
    took = time.monotonic() - t0
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert took < MISTAKE_SECONDS, f"{case} took {took:.1f} s"


def test_cuda_without_a_gpu_is_one_line(tiny_model):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    r = launch("--model-path", str(tiny_model("llama")), "--device", "cuda")
    assert r.returncode != 0
    assert r.stderr.strip() == ("zserve: --device cuda: no CUDA device is visible on this "
                                "machine (no NVIDIA driver); use --device cpu")


def test_busy_port_is_found_before_loading(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = launch("--model-path", str(tiny_model("llama")), "--port", str(port))
        assert time.monotonic() - t0 < MISTAKE_SECONDS
    assert r.returncode != 0
    assert r.stderr.strip() == (f"zserve: --host 127.0.0.1 --port {port}: the address is "
                                f"already in use")


def test_unknown_hub_id_offline_is_one_line(tmp_path):
    r = launch("--model-path", "nobody/no-such-model",
               env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0], r.stderr
    assert "pass a local model directory or a .gguf file" in lines[0]


@pytest.mark.e2e
def test_hub_id_resolves_from_the_local_cache_offline(tiny_model, tmp_path):
    """A hub cache laid out as huggingface_hub writes it (refs/main -> snapshots/<rev>)."""
    repo = tmp_path / "hf" / "hub" / "models--zserve-test--tiny-llama"
    revision = "0" * 40
    shutil.copytree(tiny_model("llama"), repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    s = Server("zserve-test/tiny-llama", tmpdir=tmp_path,
               env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    try:
        info = s.client.get("/model_info").json()
        assert info["model_path"] == str(repo / "snapshots" / revision)
        assert s.generate_ok(text="hi", sampling_params={"max_new_tokens": 3})[
            "meta_info"]["completion_tokens"] == 3
    finally:
        assert s.terminate() == 0
