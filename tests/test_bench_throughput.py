"""bench/throughput.py's zserve side against the tiny llama server: what it measures must
be prefill and decode, not the prefix cache, and its latencies are the client's."""

from __future__ import annotations

import types

import pytest

from bench import throughput as tp

pytestmark = pytest.mark.e2e

PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8


def test_measured_prompts_miss_the_prefix_cache(llama_server):
    prompts = tp.make_prompts(PROMPTS, INPUT_LEN, seed=0)
    warm = tp.warmup_prompts(prompts, seed=0)
    firsts = [p[0] for p in prompts]
    assert len(set(firsts)) == PROMPTS and not set(firsts) & {p[0] for p in warm}

    args = types.SimpleNamespace(output_len=OUTPUT_LEN, seed=0)
    batch, single = tp.run_modes(tp.ZSERVE, "zserve", llama_server.url, prompts, prompts[:2],
                                 ["batch", "single"], args, "float32", "-", None)
    # The single mode's prompts were the batch's too: only the flush between keeps them out.
    assert batch["cached_tokens"] == 0 and single["cached_tokens"] == 0
    assert batch["output_tokens"] == PROMPTS * OUTPUT_LEN
    assert single["output_tokens"] == 2 * OUTPUT_LEN
    for row in (batch, single):
        assert 0 < row["ttft_mean_s"] < row["e2e_mean_s"] and row["tpot_mean_s"] > 0

    # The check sees a cache hit: the single mode's prompts again, with no flush, are
    # served from the cache (all but the last prompt token, which must be recomputed).
    again = tp.run_single(tp.ZSERVE, llama_server.url, prompts[:2], OUTPUT_LEN, "float32")
    assert again["cached_tokens"] >= 2 * (INPUT_LEN - 1)
    tp.flush_cache(llama_server.url)                # leave the shared server's cache empty
