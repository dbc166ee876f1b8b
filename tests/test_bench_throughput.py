"""bench/throughput.py's zserve side against the tiny llama server: what it measures must
be prefill and decode, not the prefix cache, and its latencies are the client's. And the
bench checkpoints' shapes (bench/make_checkpoint.py, issue 23's Gemma 3 and Qwen3-MoE), at
a tiny width: zserve reads them as those families, the bench counts their matmul
parameters right, and llama.cpp's converter (where its source is at hand) writes a GGUF of
the same tensors."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from bench import make_checkpoint as mc
from bench import throughput as tp

PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8


@pytest.mark.e2e
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


# Each shape at a tiny width; what stays is what makes the shape (window pattern, query
# scale, tied head; experts, top k, renormalization).
TINY = {
    "gemma3-270m": dict(layers=7, hidden_size=64, intermediate_size=96, head_dim=32,
                        num_attention_heads=2, vocab_size=1024, query_pre_attn_scalar=32),
    "qwen3-moe": dict(layers=2, hidden_size=64, moe_intermediate_size=16, num_experts=16,
                      num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, vocab_size=1024),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_bench_checkpoint(request, tmp_path_factory):
    shape = request.param
    out = tmp_path_factory.mktemp(shape)
    kwargs = dict(TINY[shape])
    mc.build(out, layers=kwargs.pop("layers"), shape=shape, **kwargs)
    return shape, out


def test_bench_shapes_are_their_families(tiny_bench_checkpoint):
    from models import ModelConfig

    shape, out = tiny_bench_checkpoint
    config = ModelConfig.from_dir(out)
    params = tp.matmul_params(str(out))
    h, v = config.hidden_size, config.vocab_size
    attn = h * config.q_size * 2 + 2 * h * config.kv_size
    if shape == "gemma3-270m":
        assert config.family == "gemma3" and config.tie_word_embeddings
        # one global layer in six, the others windowed at 512 with the local RoPE base
        assert config.layer_windows == (1, 1, 1, 1, 1, 0, 1)
        assert config.sliding_window == 512 and config.local_rope_theta == 10000.0
        assert config.rope_theta == 1e6 and config.attn_scale == 32 ** -0.5
        assert params["matmul"] == 7 * (attn + 3 * h * 96) + h * v
        assert params["experts"] is None
    else:
        assert config.family == "qwen3_moe" and not config.tie_word_embeddings
        assert config.moe_layers == (1, 1) and config.norm_topk_prob
        assert (config.num_experts, config.experts_per_token) == (16, 4)
        # a token runs the router and 4 of the 16 experts of each layer, and the LM head
        expert = 3 * h * 16
        assert params["matmul"] == 2 * (attn + h * 16 + 4 * expert) + h * v
        assert params["total"] > 2 * 16 * expert + 2 * h * v
        assert params["experts"] == "4 of 16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "RANDOM_WEIGHTS.txt").is_file()


CONVERTER = pathlib.Path(os.environ.get(
    "ZSERVE_LLAMA_CONVERTER", "~/.cache/llama-cpp/src/llama_cpp_python-0.3.36/vendor/"
    "llama.cpp/convert_hf_to_gguf.py")).expanduser()


@pytest.mark.skipif(not CONVERTER.is_file(), reason="llama.cpp's converter is not at hand "
                    "(ZSERVE_LLAMA_CONVERTER)")
def test_hf_to_gguf_keeps_the_whole_model(tiny_bench_checkpoint, tmp_path):
    """The converter's GGUF holds every row of the embedding (the tokenizer has 759) and
    the same values, so llama.cpp runs zserve's model."""
    import gguf as gguf_lib
    import numpy as np
    from safetensors.numpy import load_file

    shape, out = tiny_bench_checkpoint
    target = tmp_path / "model.gguf"
    subprocess.run([sys.executable, "-m", "bench.hf_to_gguf", "--converter", str(CONVERTER),
                    str(out), "--outtype", "f32", "--outfile", str(target)],
                   check=True, capture_output=True, cwd=tp.REPO)
    reader = gguf_lib.GGUFReader(str(target))
    tensors = {t.name: t for t in reader.tensors}
    hf = load_file(str(out / "model.safetensors"))
    embed = tensors["token_embd.weight"]
    assert embed.data.shape == (1024, 64)
    np.testing.assert_array_equal(embed.data, hf["model.embed_tokens.weight"])
    if shape == "qwen3-moe":
        experts = tensors["blk.1.ffn_gate_exps.weight"].data
        assert experts.shape == (16, 16, 64)
        np.testing.assert_array_equal(experts[5], hf["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert tp.llama_weights(target) == "F32"
