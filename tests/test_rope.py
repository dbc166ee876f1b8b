"""models/rope.py against transformers' own RoPE code (modeling_rope_utils.ROPE_INIT_FUNCTIONS
and each family's rotary embedding module), type by type: the frequencies, the attention
factor and the cos|sin table, bit for bit; and what config.py refuses."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from models import ModelConfig
from models.rope import attention_factor, cos_sin_table, inv_freq

SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
FACTORS = [1.0, 1.1, 1.3, 2.0, 3.5, 5.0, 8.0, 9.0, 12.0, 13.0, 14.0, 20.0, 24.0, 30.0, 31.0,
           32.0]      # 16 per-frequency factors: heads of 32, whole

CASES = {
    "default": lambda: LlamaConfig(**SMALL),
    "linear": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "dynamic": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "dynamic_odd_length": lambda: LlamaConfig(**{**SMALL, "max_position_embeddings": 300},
                                              rope_parameters={"rope_type": "dynamic",
                                                               "rope_theta": 50000.0,
                                                               "factor": 1.7}),
    "yarn": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128}),
    "yarn_untruncated_betas": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "truncate": False,
        "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 64}),
    "yarn_mscale": lambda: LlamaConfig(**SMALL, rope_parameters={     # DeepSeek's form
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 32}),
    "yarn_attention_factor": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 0.9,
        "original_max_position_embeddings": 128}),
    "longrope": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8 + [1.5] * 8,
        "long_factor": FACTORS, "original_max_position_embeddings": 64}),
    "longrope_factor": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": FACTORS[::-1],
        "long_factor": FACTORS, "factor": 3.0, "original_max_position_embeddings": 100}),
    "llama3": lambda: LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Phi-4-mini's form: partial rotary 0.75 of heads of 32 (24 dims, 12 frequencies)
    "phi3_longrope_partial": lambda: Phi3Config(
        **SMALL, partial_rotary_factor=0.75, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": FACTORS[:12], "long_factor": FACTORS[4:]}),
    # Phi-3-mini-128k's first config: "su", in the old dialect (transformers 5 then wants
    # original_max_position_embeddings in rope_scaling too, and reads that one: the same here)
    "phi3_su": lambda: Phi3Config(
        **SMALL, original_max_position_embeddings=128, rope_theta=10000.0,
        rope_scaling={"type": "su", "short_factor": FACTORS[::-1], "long_factor": FACTORS,
                      "original_max_position_embeddings": 128}),
}


def _ours(hf_config) -> ModelConfig:
    """Our config from transformers' config.json form of it."""
    arch = "Phi3ForCausalLM" if isinstance(hf_config, Phi3Config) else "LlamaForCausalLM"
    return ModelConfig.from_dict({**hf_config.to_dict(), "architectures": [arch]})


def _rotary(hf_config):
    return (Phi3RotaryEmbedding if isinstance(hf_config, Phi3Config)
            else LlamaRotaryEmbedding)(hf_config)


@pytest.fixture(params=list(CASES))
def configs(request):
    """(transformers' config, ours from its config.json form)."""
    hf = CASES[request.param]()
    return hf, _ours(hf)


def test_frequencies_and_attention_factor_are_transformers(configs):
    hf, ours = configs
    rope_type = hf.rope_parameters["rope_type"]
    module = _rotary(hf)
    assert ours.rotary_dim == 2 * module.inv_freq.shape[0]
    assert torch.equal(inv_freq(ours), module.inv_freq)     # what its model starts with
    assert attention_factor(ours) == module.attention_scaling
    if rope_type in ROPE_INIT_FUNCTIONS:
        want, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        assert torch.equal(inv_freq(ours), want) and attention_factor(ours) == factor
    if rope_type == "longrope":         # its choice past the original context
        orig = hf.rope_parameters["original_max_position_embeddings"]
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=orig + 1)
        assert torch.equal(inv_freq(ours, long=True), long)
        assert not torch.equal(long, inv_freq(ours))


def test_table_is_transformers_cos_sin(configs):
    """Every row of the table is what transformers' rotary module gives that position, for
    the sequences where its choice is the table's: all positions for most types; for longrope
    a sequence within the original context (short factors) and the positions past it, which
    transformers rotates with the long factors as soon as a forward reaches them."""
    hf, ours = configs
    table = cos_sin_table(ours)
    r = ours.rotary_dim
    assert table.shape == (ours.max_position_embeddings, r) and table.dtype == torch.float32
    spans = [(0, ours.max_position_embeddings)]
    if hf.rope_parameters["rope_type"] == "longrope":
        orig = hf.rope_parameters["original_max_position_embeddings"]
        spans = [(0, orig), (orig, ours.max_position_embeddings)]
    x = torch.zeros(1, dtype=torch.float32)
    for lo, hi in spans:
        cos, sin = _rotary(hf)(x, torch.arange(lo, hi)[None])
        assert torch.equal(table[lo:hi, :r // 2], cos[0, :, :r // 2])
        assert torch.equal(table[lo:hi, r // 2:], sin[0, :, :r // 2])
        assert torch.equal(cos[0, :, :r // 2], cos[0, :, r // 2:])    # its [f, f] layout


def test_dynamic_serves_the_plain_table():
    """NTK-dynamic within max_position_embeddings (all the launcher serves) is plain RoPE."""
    plain = _ours(CASES["default"]())
    dynamic = _ours(CASES["dynamic"]())
    assert torch.equal(cos_sin_table(dynamic), cos_sin_table(plain))


def test_attention_factors_fold_into_the_table():
    """YaRN and LongRoPE scale cos and sin (so the one-call decode kernel, which reads the
    same table, gets it too); the factors have their documented values."""
    import math
    yarn = _ours(CASES["yarn"]())
    assert attention_factor(yarn) == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)
    phi = _ours(CASES["phi3_longrope_partial"]())
    assert attention_factor(phi) == pytest.approx(math.sqrt(1 + math.log(8) / math.log(64)),
                                                  rel=1e-12)
    row = cos_sin_table(phi)[0]                 # position 0: cos = 1, sin = 0, times the factor
    assert torch.equal(row[:12], torch.full((12,), attention_factor(phi)))
    assert torch.equal(row[12:], torch.zeros(12))


@pytest.mark.parametrize("rope,pattern", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 16,
      "original_max_position_embeddings": 64}, r"short_factor has 3 entries, expected 16"),
    ({"rope_type": "yarn_v2", "factor": 2.0}, r"unsupported rope type 'yarn_v2'"),
    ({"rope_type": "linear"}, r"rope type 'linear' needs factor"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 16},
     r"rope type 'longrope' needs short_factor"),
])
def test_bad_rope_parameters_are_refused(rope, pattern):
    cfg = {"architectures": ["LlamaForCausalLM"], **SMALL, "rope_scaling": rope}
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_dict(cfg)


def test_partial_rotary_must_be_even():
    cfg = {"architectures": ["Phi3ForCausalLM"], **SMALL, "partial_rotary_factor": 0.3}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.3 gives 9 rotated dims"):
        ModelConfig.from_dict(cfg)
    assert ModelConfig.from_dict({**cfg, "partial_rotary_factor": 0.5}).rotary_dim == 16
