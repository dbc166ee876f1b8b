"""The plain-torch model against transformers, family by family, on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig, SmolLM3Config)

from model_helpers import DenseCausalAttention
from models import ModelConfig, load_model

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama_bias": lambda: LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
    "llama_tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama3_rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # the other rope types (models/rope.py); an original context of 64 puts the sequences
    # from 0 within it and the one from 300 past it (longrope's short and long factors)
    "linear_rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic_rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "yarn_rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 64}),
    "longrope_rope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
        "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**SMALL),                          # qkv bias
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32),             # 32 != 64/4; q/k norm
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=4096),
    # every second layer without RoPE (NoPE), biased q/k/v/o
    "smollm3": lambda: SmolLM3Config(**SMALL, no_rope_layer_interval=2, attention_bias=True,
                                     pad_token_id=0),
    "mistral_window": lambda: MistralConfig(**SMALL, sliding_window=6),
    # a global layer, then (from max_window_layers) a local one
    "qwen2_window": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=6,
                                        max_window_layers=1),
    # windows of 6 (the 20-token checks reach past them), a query scale not head_dim's,
    # GeGLU, (1 + w) norms, scaled embeddings; Gemma 2's score and logit caps
    "gemma2": lambda: Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=24,
                                   sliding_window=6, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0, pad_token_id=0),
    # a local layer (RoPE base 10,000) then a global one (1,000,000); q/k norms
    "gemma3": lambda: Gemma3TextConfig(**SMALL, head_dim=32, query_pre_attn_scalar=48,
                                       sliding_window=6, pad_token_id=0,
                                       layer_types=["sliding_attention", "full_attention"]),
    # fused qkv_proj / gate_up_proj in the checkpoint, partial rotary (12 of 16 dims),
    # longrope over an original context of 64
    "phi3": lambda: Phi3Config(**SMALL, pad_token_id=0, partial_rotary_factor=0.75,
                               original_max_position_embeddings=64, rope_parameters={
                                   "rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0, 1.0, 1.05, 1.1, 1.2, 1.4],
                                   "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
    # mixtures of experts: 4 experts, top 2; Qwen3-MoE's unnormalized, its second layer
    # dense (mlp_only_layers); Mixtral's renormalized, every layer sparse
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, head_dim=32, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        mlp_only_layers=[1]),
    "mixtral": lambda: MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}


def make_checkpoint(hf_config, path, **save_kwargs):
    """A random HF model saved to `path`, weights scaled up so logits are far from uniform.
    Norms scale by 1 + 0.3 N(0, 1) (Gemma's by 1 + weight: its weights are the 0.3 N)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    offset = 0.0 if hf_config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(offset + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    hf.save_pretrained(path, **save_kwargs)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_checkpoint(FAMILIES[request.param](), path)


def hf_logits(hf, ids, start=0):
    with torch.no_grad():
        pos = torch.arange(start, start + len(ids))[None]
        return hf(input_ids=ids[None], position_ids=pos).logits[0].float()


def our_logits(model, seqs):
    """seqs: [(ids, start_position)] run as one flat batch -> logits for every token."""
    ids = torch.cat([s for s, _ in seqs])
    positions = torch.cat([torch.arange(p, p + len(s)) for s, p in seqs])
    attn = DenseCausalAttention([len(s) for s, _ in seqs], model.attention_layers)
    return model.compute_logits(model(ids, positions, attn))


def test_logits_match_hf(checkpoint):
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, ids)
    assert expected.std() > 1.0                      # not near-uniform: the check has teeth
    got = our_logits(model, [(ids, 0)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_ragged_batch_matches_hf(checkpoint):
    """Three requests in one flat batch, one of them mid-sequence (positions from 300)."""
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    g = torch.Generator().manual_seed(2)
    seqs = [(torch.randint(0, 256, (n,), generator=g), start)
            for n, start in [(11, 0), (5, 0), (9, 300)]]
    got = our_logits(model, seqs)
    expected = torch.cat([hf_logits(hf, ids, start) for ids, start in seqs])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_bfloat16_is_close(checkpoint):
    """bf16 against HF fp32 (loose) and HF bf16 (same roundings: equal on CPU today)."""
    path, hf = checkpoint
    model = load_model(path, torch.bfloat16, "cpu")
    assert model.embed_tokens.weight.dtype == model.cos_sin.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    got = our_logits(model, [(ids, 0)])
    assert got.dtype == torch.float32
    expected = hf_logits(hf, ids)
    assert (got - expected).abs().max() < 0.25 * expected.std()
    hf_bf16 = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)
    torch.testing.assert_close(got, hf_bf16, atol=0.1, rtol=0)
    assert torch.equal(got.argmax(-1), hf_bf16.argmax(-1))


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    make_checkpoint(FAMILIES["llama_tied"](), tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, torch.float32, "cpu", pack=False)
    assert model.lm_head is None
    packed = load_model(tmp_path, torch.float32, "cpu", pack=True)   # gets a packed head
    ids = torch.arange(20)
    torch.testing.assert_close(our_logits(packed, [(ids, 0)]), our_logits(model, [(ids, 0)]),
                               atol=1e-4, rtol=0)


def test_packed_and_plain_linears_agree():
    """oneDNN-packed weights (the CPU fallback) give F.linear's result: bit-identical in
    bfloat16, to float32 rounding in float32."""
    from models.packed import PackedLinear, can_pack
    torch.manual_seed(0)
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 0.0)):
        if not can_pack(torch.device("cpu"), dtype):
            continue        # e.g. bfloat16 without AVX-512: the model keeps nn.Linear
        w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
        layer = PackedLinear(w, b)
        for rows in (1, 5, 32, 300):
            x = torch.randn(rows, 64, dtype=dtype)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b),
                                       atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_kernels_agree_with_f_linear(dtype):
    """Our kernels (the CPU default: AVX-512, else the AVX2 version of the same panels, up
    to 6 rows a tile) on every tile edge: rows 1..8 and past one tile,
    outputs not a multiple of 16 or of a 48-wide tile, odd K (bfloat16 pairs), bias or not.
    Both sum in float32 in another order than F.linear: float32 agrees to rounding, and
    bfloat16 is identical but for rare one-ulp differences where the float32 sums round
    to either side of a bfloat16 tie (or, where a sum cancels to near zero, differences of
    the float32 sums' own rounding, which is more than an ulp of the small result)."""
    from models import kernels
    from models import cpu_linear
    if not (kernels.available("cpu", dtype) or kernels.avx2_available("cpu")):
        pytest.skip(f"no CPU linear kernels for {dtype} on this CPU / compiler")
    torch.manual_seed(0)
    for n, k in ((96, 64), (17, 33), (50, 7), (1, 1), (200, 575)):
        w, b = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
        for bias in (b, None):
            layer = cpu_linear.CpuLinear(w, bias)
            for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 300):
                x = torch.randn(rows, k, dtype=dtype)
                got, want = layer(x), torch.nn.functional.linear(x, w, bias)
                if dtype == torch.bfloat16:
                    assert (got != want).float().mean() <= 0.01, (n, k, rows)
                    # one bfloat16 ulp, or where the sum cancels to near 0, what float32
                    # summation order can move it by: k * 2^-24 * sum |x w| (both sides)
                    order = 2 * k * 2 ** -24 * (x.float().abs() @ w.float().abs().T)
                    assert ((got.float() - want.float()).abs()
                            <= want.float().abs() * 2 ** -7 + order).all(), (n, k, rows)
                else:
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # A strided input (a view) is read correctly; an empty batch gives an empty output.
    layer = cpu_linear.CpuLinear(w, b)
    # Each row is summed alone, in k order, whatever tile it falls in: a row's output does
    # not depend on the batch around it, bit for bit (at 32 rows: AVX2 float32 tiles of 6
    # and 5 rows, bfloat16 tiles of 6 and 2).
    x = torch.randn(32, k, dtype=dtype)
    batch = layer(x)
    assert all(torch.equal(batch[i], layer(x[i:i + 1])[0]) for i in range(32))
    x = torch.randn(300, 2 * k, dtype=dtype)[:, ::2]
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b),
                               atol=1e-4 if dtype == torch.float32 else 0, rtol=2 ** -7)
    assert layer(torch.empty(0, k, dtype=dtype)).shape == (0, n)
    # Leading dims pass through; what the C side cannot take is refused, not misread.
    x = torch.randn(2, 3, k, dtype=dtype)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b),
                               atol=1e-4 if dtype == torch.float32 else 0, rtol=2 ** -7)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    for bad in (torch.randn(4, k + 1, dtype=dtype), torch.randn(4, k, dtype=other)):
        with pytest.raises(ValueError, match="CpuLinear"):
            layer(bad)


def test_sharded_checkpoint(tmp_path):
    hf = make_checkpoint(FAMILIES["qwen3"](), tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path, torch.float32, "cpu")
    ids = torch.arange(20)
    torch.testing.assert_close(our_logits(model, [(ids, 0)]), hf_logits(hf, ids),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_stacked_in_the_checkpoint(tmp_path, family):
    """transformers 5's own layout (save_original_format=False): each layer's experts in
    one [E, 2 * I, hidden] gate_up and one [E, hidden, I] down tensor, Mixtral's
    block_sparse_moe renamed mlp; the same model as the Hub's one tensor per expert."""
    hf = make_checkpoint(FAMILIES[family](), tmp_path, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path, torch.float32, "cpu")
    ids = torch.arange(20)
    torch.testing.assert_close(our_logits(model, [(ids, 0)]), hf_logits(hf, ids),
                               atol=1e-4, rtol=0)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    make_checkpoint(FAMILIES["llama"](), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = weights.pop(
        "model.layers.1.self_attn.k_proj.weight")
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.self_attn\."
                                         r"k_proj\.weight'\].*self_attn\.extra\.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*"
                                         "LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tmp_path, torch.float32, "cpu")


def test_config_from_old_style_json(tmp_path):
    """Pre-transformers-5 dialect: rope_theta + rope_scaling, torch_dtype, eos as a list,
    plus generation_config.json's eos ids."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128008],
        "tie_word_embeddings": False}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [128001, 128009]}))
    c = ModelConfig.from_dir(tmp_path)
    assert (c.family, c.head_dim, c.num_kv_heads, c.rope_theta) == ("llama", 128, 8, 500000.0)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert c.eos_token_ids == [128001, 128008, 128009] and c.bos_token_id == 128000
    assert c.dtype == torch.bfloat16
    assert not (c.qkv_bias or c.o_bias or c.qk_norm or c.tie_word_embeddings)
