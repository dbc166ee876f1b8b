"""bench/serving.py and bench/compare.py against the tiny llama server: a few seconds of load,
then the result's counts are checked against what the server itself counted."""

from __future__ import annotations

import json

import pytest

from bench import compare, serving
from tests.server import wait_idle

pytestmark = pytest.mark.e2e

PROMPTS, INPUT_LEN, OUTPUT_LEN = 12, 16, 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(server, out_dir, name: str, *flags: str) -> dict:
    """One benchmark run in this process; returns its JSON, checked against the server's
    own token counters (the run plus its warm-up)."""
    before = wait_idle(server)
    argv = ["--base-url", server.url, "--num-prompts", str(PROMPTS),
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--random-range-ratio", "1.0", "--request-rate", "20", "--max-concurrency", "4",
            "--seed", "0", "--output-dir", str(out_dir), "--output-file", f"{name}.json",
            "--disable-tqdm", *flags]
    assert serving.main(argv) == 0
    after = wait_idle(server)
    result = json.loads((out_dir / f"{name}.json").read_text())
    s, warm = result["summary"], result["warmup"]
    assert warm["failed"] == 0
    assert (s["total_output_tokens"] + warm["output_tokens"] ==
            after["generated_tokens_total"] - before["generated_tokens_total"])
    assert (s["total_input_tokens"] + warm["prompt_tokens"] ==
            after["prompt_tokens_total"] - before["prompt_tokens_total"])
    png = (out_dir / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    return result


def check_records(result: dict, num: int) -> None:
    s = result["summary"]
    assert (s["completed"], s["failed"], s["num_requests"]) == (num, 0, num)
    reqs = result["requests"]
    assert sorted(r["index"] for r in reqs) == list(range(num))
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs) == num * OUTPUT_LEN
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert s["output_len_mismatch"] == s["tokens_from_chunks"] == 0
    for r in reqs:
        assert r["success"] and r["error"] is None
        assert r["output_tokens"] == r["requested_output_len"] == OUTPUT_LEN
        assert sum(r["chunk_tokens"]) == OUTPUT_LEN
        assert len(r["itl"]) == OUTPUT_LEN - r["chunk_tokens"][0]
        assert 0 <= r["start"] and 0 < r["ttft"] <= r["e2e"]
        assert r["chunk_times"] == sorted(r["chunk_times"])
    for key in ("ttft", "tpot", "e2e"):
        assert s[key]["count"] == num and s[key]["median_ms"] <= s[key]["p99_ms"]
    tl = result["timeline"]
    assert sum(tl["requests_started"]) == sum(tl["requests_finished"]) == num
    assert sum(tl["output_tokens_per_s"]) * tl["bin_s"] == pytest.approx(num * OUTPUT_LEN)
    assert s["duration_s"] > 0 and 0 < s["concurrency"] <= 4 + 1e-6
    assert s["client_cpu_fraction"] > 0


def test_serving_and_compare(llama_server, tmp_path, capsys):
    native = bench(llama_server, tmp_path, "native", "--slo-ttft-ms", "1e9", "--flush-cache")
    check_records(native, PROMPTS)
    assert native["config"]["tokenizer"]["kind"] == "tokenizers"   # the server's, loaded here
    assert all(r["prompt_tokens"] == INPUT_LEN for r in native["requests"])   # input_ids
    s = native["summary"]
    assert s["slo_met"] == PROMPTS and s["goodput"] == pytest.approx(s["request_throughput"])

    chat = bench(llama_server, tmp_path, "chat", "--backend", "openai-chat")
    check_records(chat, PROMPTS)
    for r in chat["requests"]:      # whole-word tokens as text, then the chat template
        assert r["client_prompt_len"] == INPUT_LEN < r["prompt_tokens"]
    assert chat["summary"]["goodput"] is None

    capsys.readouterr()
    out = tmp_path / "cmp.png"
    assert compare.main([str(tmp_path / "native.json"), str(tmp_path / "chat.json"),
                         "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "native" in table and "chat" in table and "output tok/s" in table
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 20_000


def test_jsonl_over_completions(llama_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me about item {i}.",
                                        "output_len": OUTPUT_LEN}) + "\n" for i in range(3)))
    result = bench(llama_server, tmp_path, "jsonl", "--backend", "openai",
                   "--dataset-name", "jsonl", "--dataset-path", str(data),
                   "--num-prompts", "4", "--warmup-requests", "0")
    check_records(result, 4)        # 3 lines cycled to 4 prompts
    assert result["warmup"]["requests"] == 0


def test_sharegpt_and_jsonl_parsing(tiny_model, tmp_path):
    tok = serving.LocalTokenizer(str(tiny_model("llama")))
    convo = lambda *turns: {"conversations": [{"from": f, "value": v} for f, v in turns]}
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        convo(("human", "What is the capital of France?"), ("gpt", "Paris, of course.")),
        convo(("human", "only one turn")),
        convo(("human", "x"), ("gpt", "a reply that is long enough")),     # prompt too short
        convo(("human", "Long " * 600), ("gpt", "ok ok ok ok")),             # over the context
    ]))
    got = serving.sharegpt_prompts(str(path), tok, None, context_len=512)
    assert [p.text for p in got] == ["What is the capital of France?"]
    assert got[0].output_len == len(tok.encode("Paris, of course."))
    assert serving.sharegpt_prompts(str(path), tok, 5, 512)[0].output_len == 5

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a b c", "output_len": 3}\n\n{"prompt": "d"}\n')
    with pytest.raises(SystemExit):             # the second line has no output_len
        serving.jsonl_prompts(str(rows), tok, None)
    assert [p.output_len for p in serving.jsonl_prompts(str(rows), None, 7)] == [7, 7]
