"""bench/perplexity.py: the window and scoring arithmetic, then the script against two tiny
llama servers that must compute the same model (the prefix cache on and off)."""

from __future__ import annotations

import json
import math
import tempfile

import pytest

from bench import perplexity

CTX, WINDOWS = 64, 3


def test_windows_and_scoring():
    ids = list(range(10, 33))                               # 23 ids
    windows = perplexity.split_windows(ids, 5)
    assert windows == [ids[0:5], ids[5:10], ids[10:15], ids[15:20]]   # the tail of 3 dropped
    assert perplexity.split_windows(ids, 5, max_windows=2) == windows[:2]
    assert perplexity.split_windows(ids, 5, bos=1)[1] == [1, *ids[6:10]]
    assert ids[5] == 15                                     # the input is left alone
    assert perplexity.split_windows(ids[:4], 5) == []

    assert perplexity.first_scored(512, "all") == 1
    assert perplexity.first_scored(512, "half") == 257      # llama.cpp: 255 tokens a window
    assert perplexity.first_scored(5, "half") == 3
    assert perplexity.first_scored(512, "100") == 100
    for bad in ("0", "512", "x"):
        with pytest.raises(ValueError):
            perplexity.first_scored(512, bad)
    assert perplexity.scored_count(23, 5, "all") == 4 * 4
    assert perplexity.scored_count(23, 5, "half") == 4 * 2
    assert perplexity.scored_count(23, 5, "all", max_windows=1) == 4
    assert perplexity.scored_count(1024, 512, "half") == 2 * 255

    lps = [None, -1.0, -2.0, -3.0, -4.0]
    assert perplexity.window_nlls(lps, 1) == [1.0, 2.0, 3.0, 4.0]
    assert perplexity.window_nlls(lps, 3) == [3.0, 4.0]
    with pytest.raises(ValueError):
        perplexity.window_nlls(lps, 0)                      # position 0 has no logprob
    s = perplexity.summarize([1.0, 2.0, 3.0, 4.0])
    assert s["tokens_scored"] == 4 and s["mean_nll"] == 2.5
    assert s["ppl"] == pytest.approx(math.exp(2.5))
    assert s["ppl_err"] == pytest.approx(math.exp(2.5) * math.sqrt((5 / 3) / 4))
    assert perplexity.logprob_deltas([1.0, 2.0], [1.5, 1.0]) == \
        {"mean_abs_dlogprob": 0.75, "max_abs_dlogprob": 1.0}


def test_parse_llama_perplexity():
    out = ("perplexity: tokenizing the input ..\nperplexity: calculating perplexity over 8 "
           "chunks, n_ctx=512, batch_size=2048, n_seq=4\n[1]17.1,[2]18.3,\n"
           "Final estimate: PPL = 18.2345 +/- 0.41234\n")
    assert perplexity.parse_llama_perplexity(out) == (18.2345, 0.41234, 8)
    with pytest.raises(ValueError):
        perplexity.parse_llama_perplexity("no estimate here")


@pytest.mark.e2e
def test_two_configs_agree(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # as tests/server.py's fixtures run servers
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the servers' logs and ipc dirs
    out = tmp_path / "ppl.json"
    argv = ["--model-path", str(tiny_model("llama")), "--configs", "a=",
            "b=--disable-radix-cache", "--ctx", str(CTX), "--max-windows", str(WINDOWS),
            "--concurrency", "2", "--json", str(out)]
    assert perplexity.main(argv) == 0
    table = capsys.readouterr().out
    assert "vs first" in table and "base" in table

    report = json.loads(out.read_text())
    assert report["num_windows"] == WINDOWS and report["num_ids"] >= WINDOWS * CTX
    assert report["bos"] is not None                # the tiny tokenizer adds one
    a, b = report["rows"]
    assert [a["label"], b["label"]] == ["a", "b"] and "error" not in a and "error" not in b
    expected = perplexity.scored_count(report["num_ids"], CTX, "all", WINDOWS)
    assert expected == WINDOWS * (CTX - 1)
    assert a["tokens_scored"] == b["tokens_scored"] == expected
    assert len(a["window_mean_nll"]) == WINDOWS
    for r in (a, b):
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
        assert r["mean_nll"] == pytest.approx(math.log(r["ppl"]))
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-4)
    assert abs(b["rel_diff"]) < 1e-4 and b["max_abs_dlogprob"] < 1e-2
