"""FastDecode (models/fast_decode.py, kernels/decode.c): a step of decode rows through every
layer in one C call must give the module path's hidden state and KV pool bit for bit, for
float32 and bfloat16 panels (safetensors) and GGUF blocks, with and without biases, at
batch 1 and in a batch; and it must stay out of the way where it does not apply."""

from __future__ import annotations

import gguf
import pytest
import torch

from checkpoints.tiny import build_tiny_checkpoint
from models import kernels
from scheduler_proc.attention import StepAttention
from models import load_model
from models.cpu_linear import CpuLinear
from models.quant_linear import QuantLinear
from scheduler_proc.pool import KVCache
from test_gguf import write_gguf

needs_kernels = pytest.mark.skipif(not kernels.avx2_available("cpu"),
                                   reason="no AVX2 kernels here: the fast path never applies")


def decode_step(model, cache, table, rows, lens, ids):
    out_slots = [int(table[r, n - 1]) for r, n in zip(rows, lens)]
    attn = StepAttention.build(cache, table, out_slots, rows, lens, [], "cpu",
                               decode_kernel=True)
    positions = torch.tensor([n - 1 for n in lens])
    if model.fast is not None:
        assert model.fast.takes(attn, positions)        # the fast path really runs
    return model(torch.tensor(ids), positions, attn)


def both_paths(model, batch: int, kv_dtype=None):
    """(fast hidden, fast pool), (module hidden, module pool) for one decode step of `batch`
    rows over random cached K/V (a pool of kv_dtype: default, the model's; a pool is its
    layers' buffers, and for int8 their scales after them)."""
    c = model.config
    dtype = model.norm.weight.dtype
    results = []
    for fast in (model.fast, None):
        torch.manual_seed(0)
        cache = KVCache(c.num_layers, 40 * batch, c.num_kv_heads, c.head_dim, dtype, "cpu",
                        kv_dtype)
        every = torch.arange(40 * batch + 1)
        for layer in range(c.num_layers):
            k, v = (torch.randn(len(every), c.num_kv_heads, c.head_dim, dtype=dtype)
                    for _ in range(2))
            cache.write(layer, every, k, v)
        table = torch.arange(1, 40 * batch + 1).view(batch, 40)
        rows, lens = list(range(batch))[::-1], [1 + 7 * i % 37 for i in range(batch)]
        ids = torch.randint(5, 700, (batch,)).tolist()
        saved, model.fast = model.fast, fast
        try:
            hidden = decode_step(model, cache, table, rows, lens, ids)
        finally:
            model.fast = saved
        results.append((hidden, [t.clone() for t in cache.kv + (cache.scales or [])]))
    return results


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """wide_heads(family): the tiny checkpoint with heads of 32 (the decode attention
    kernel's smallest; the default tiny heads of 16 take SDPA, so no fast path)."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = build_tiny_checkpoint(
                tmp_path_factory.mktemp(family), family, hidden_size=128,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=192)
        return made[family]
    return make


@needs_kernels
@pytest.mark.parametrize("family,qtype,dtype", [
    ("llama", None, torch.float32), ("qwen2", None, torch.float32),
    ("llama", None, torch.bfloat16), ("qwen2", None, torch.bfloat16),
    ("qwen2", "Q8_0", torch.float32), ("llama", "Q4_1", torch.float32),
    ("llama", "Q4_0", torch.float32)])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16, torch.int8])
def test_fast_path_equals_module_path(wide_heads, tmp_path, family, qtype, dtype, batch,
                                      kv_dtype):
    path = wide_heads(family)
    if qtype is not None:
        path = write_gguf(path, tmp_path / "m.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    model = load_model(path, dtype, "cpu", quantization="none" if qtype is None else "gguf")
    layer_type = CpuLinear if qtype is None else QuantLinear
    assert isinstance(model.layers[0].self_attn.qkv_proj, layer_type)
    assert model.fast is not None
    (fast, fast_kv), (slow, slow_kv) = both_paths(model, batch, kv_dtype)
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv))
    assert fast.abs().max() > 0


@needs_kernels
@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_fast_path_adds_lora_products_as_the_module_path(wide_heads, tmp_path, qtype):
    """LoRA runs (models/lora.py): decode.c adds each layer's adapter products after its
    linear kernel, as LoraLinear does: the same hidden state bit for bit, with rows of two
    adapters and of none in one step (the AVX2 kernels in make test's AVX2 re-run)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from models.lora import LoraSet

    path = wide_heads("llama")
    for i, targets in enumerate((["q_proj", "v_proj", "down_proj"],
                                 ["k_proj", "o_proj", "gate_proj", "up_proj"])):
        torch.manual_seed(i)
        get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(
            r=4 + 4 * i, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        ).save_pretrained(tmp_path / f"a{i}")
    if qtype is not None:
        path = write_gguf(path, tmp_path / "m.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    model = load_model(path, torch.float32, "cpu",
                       quantization="none" if qtype is None else "gguf")
    lora = LoraSet(model, 3, torch.float32)
    lora.load(1, tmp_path / "a0")
    lora.load(2, tmp_path / "a1")
    with lora.step([(2, 0, 2), (1, 3, 5)]):
        (fast, fast_kv), (slow, slow_kv) = both_paths(model, 5)
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv))
    (plain, _), _ = both_paths(model, 5)
    assert not torch.equal(plain[:2], fast[:2]) and not torch.equal(plain[3:], fast[3:])
    assert torch.equal(plain[2], fast[2])                   # the row of no adapter


def test_fast_path_stays_out_of_the_way(tiny_model, wide_heads):
    """Qwen3 (per-head q/k norm), float16 and unpacked layers take the module path; so
    does a step with a prefill segment (FastDecode.takes)."""
    assert load_model(tiny_model("qwen3"), torch.float32, "cpu").fast is None
    assert load_model(tiny_model("llama"), torch.float32, "cpu").fast is None   # heads of 16
    assert load_model(wide_heads("llama"), torch.float16, "cpu").fast is None
    assert load_model(wide_heads("llama"), torch.float32, "cpu", pack=False).fast is None
    assert load_model(wide_heads("llama"), torch.bfloat16, "cpu", pack=False).fast is None
    model = load_model(wide_heads("llama"), torch.float32, "cpu")
    if model.fast is None:
        pytest.skip("no AVX2 kernels here")
    cache = KVCache(model.config.num_layers, 64, model.config.num_kv_heads,
                    model.config.head_dim, torch.float32, "cpu")
    table = torch.arange(1, 65).view(2, 32)
    prefill = StepAttention.build(cache, table, [1, 2, 3], [], [], [(0, 0, 3)], "cpu",
                                  decode_kernel=True)
    assert not model.fast.takes(prefill, torch.arange(3))


def phi3_wide(path, partial: float):
    """A tiny Phi-3 with heads of 32 (the decode kernel's), longrope over an original
    context of 16 (both_paths' decode rows sit on both sides of it), rotating `partial` of
    each head."""
    pairs = int(32 * partial) // 2
    return build_tiny_checkpoint(
        path, "phi3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=192, partial_rotary_factor=partial,
        original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": partial,
                         "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
                         "long_factor": [1.0 + 2.0 * i for i in range(pairs)]})


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_longrope_is_just_another_table(tmp_path, dtype):
    """decode.c reads the model's own cos|sin table, so a whole-head rotary with longrope
    (short and long factors, its attention factor folded into the table) runs on the fast
    path, equal to the module path; Phi-3's partial rotary does not run there."""
    model = load_model(phi3_wide(tmp_path / "full", 1.0), dtype, "cpu")
    assert model.fast is not None and model.config.rope_scaling["rope_type"] == "longrope"
    (fast, fast_kv), (slow, slow_kv) = both_paths(model, 5)
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_kv, slow_kv))
    partial = load_model(phi3_wide(tmp_path / "partial", 0.75), dtype, "cpu")
    assert partial.config.rotary_dim == 24 and partial.fast is None
