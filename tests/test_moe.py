"""Mixtures of experts (models/moe.py): Qwen3-MoE and Mixtral.

- the grouped forward (SparseMoE: each chosen expert run once over its tokens' rows) equals
  a naive loop over tokens and their k experts, in both routing variants, and runs no
  expert twice and none that no token chose;
- tensor parallelism in one process (T threads, models/distributed.py ThreadGroup): the
  sharded model's logits equal the unsharded one's, from a checkpoint with one tensor per
  expert and from one with the experts stacked;
- end to end on tiny checkpoints (checkpoints/tiny.py's rules; Qwen3-MoE with a dense layer
  among its sparse ones): greedy ids on /generate equal transformers', unary, in a batch
  and streamed, with the prefix cache on (its hits counted) and off, and under --tp-size 2
  for Qwen3-MoE; --quantization int8 keeps the experts float.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints.tiny import build_tiny_checkpoint
from model_helpers import DenseCausalAttention
from models import kernels, load_model, moe
from models.config import ModelConfig
from models.distributed import ThreadGroup
from tests.reference import (assert_output_greedy, assert_served_batch_greedy,
                             shared_prefix_prompts)
from tests.server import serving, wait_idle

FAMILIES = ("qwen3_moe", "mixtral")
MAX_NEW = 16
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """tiny_moe(family) -> its tiny checkpoint, built once per module."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = build_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
        return built[family]
    return get


# ---- the grouped forward ------------------------------------------------------------------

def moe_config(fp32: bool, normalize: bool, experts: int = 6, k: int = 2) -> ModelConfig:
    """One sparse layer: Mixtral's routing (float32 weights, always renormalized) or
    Qwen3-MoE's (weights in the dtype, renormalized if asked)."""
    arch = "MixtralForCausalLM" if fp32 else "Qwen3MoeForCausalLM"
    config = ModelConfig.from_dict({
        "architectures": [arch], "vocab_size": 8, "hidden_size": 16, "intermediate_size": 12,
        "moe_intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_local_experts": experts, "num_experts_per_tok": k, "norm_topk_prob": normalize})
    assert (config.routing_weights_fp32, config.norm_topk_prob) == (fp32, normalize)
    return config


def naive_moe(block: moe.SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, as the papers write it (transformers' numerics:
    weights in float32 or the dtype, each token's k products summed in order)."""
    weights, ids = block.gate(x)
    out = []
    for t in range(x.shape[0]):
        terms = []
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            terms.append((block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
                         * weights[t, j])
        out.append(torch.stack(terms).sum(0).to(x.dtype))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp32,normalize", [(True, True), (False, False), (False, True)])
def test_grouped_experts_equal_the_naive_loop(dtype, fp32, normalize):
    torch.manual_seed(0)
    block = moe.SparseMoE(moe_config(fp32, normalize))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    block = block.to(dtype)
    for n in (1, 2, 7, 33):
        x = torch.randn(n, 16, dtype=dtype)
        want = naive_moe(block, x)
        got = block(x)
        assert got.dtype == dtype and got.shape == x.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    weights, ids = block.gate(torch.randn(50, 16, dtype=dtype))
    assert weights.dtype == (torch.float32 if fp32 else dtype)
    if normalize:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(50),
                                   atol=1e-2 if weights.dtype == torch.bfloat16 else 1e-6,
                                   rtol=0)
    assert (ids[:, 0] != ids[:, 1]).all()


def test_each_chosen_expert_runs_once_and_the_others_not(monkeypatch):
    """Two matmuls per expert some token chose (plus the router's one), however many tokens
    chose it: the grouping, not a loop over tokens."""
    torch.manual_seed(1)
    block = moe.SparseMoE(moe_config(True, True, experts=8, k=2))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        block.gate.weight[5:] = -1e4 * block.gate.weight[5:].abs().sum(1, keepdim=True)
    x = torch.randn(40, 16).abs()           # experts 5, 6, 7 now score far below the others
    _, ids = block.gate(x)
    chosen = len(set(ids.flatten().tolist()))
    assert chosen <= 5
    want, calls = naive_moe(block, x), []
    linear = moe.F.linear
    monkeypatch.setattr(moe.F, "linear", lambda *a: calls.append(1) or linear(*a))
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1 + 2 * chosen


def test_bad_expert_counts_are_refused(tmp_path):
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": 16,
           "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_local_experts": 2, "num_experts_per_tok": 3}
    with pytest.raises(ValueError, match="num_experts_per_tok 3 must be in"):
        ModelConfig.from_dict(cfg)
    dense = {**cfg, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 0}
    c = ModelConfig.from_dict(dense)                    # no experts: a dense model
    assert c.num_experts == 0 and c.moe_layers is None and not c.sparse(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_experts_decode_on_the_torch_path(tiny_moe, family):
    """FastDecode.of says None (decode.c runs dense MLPs only); the linear layers around
    the experts, and the experts, still get the CPU kernels where there are some."""
    model = load_model(tiny_moe(family), torch.float32, "cpu")
    assert model.fast is None
    assert isinstance(model.layers[0].mlp, moe.SparseMoE)
    if family == "qwen3_moe":                           # mlp_only_layers=[1]
        assert not isinstance(model.layers[1].mlp, moe.SparseMoE)
    if kernels.linear_available("cpu", torch.float32):
        from models.cpu_linear import CpuExperts
        assert not isinstance(model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
        assert isinstance(model.layers[0].mlp.experts, CpuExperts)


def test_few_pairs_make_the_sorts_groups():
    """Decode-sized steps group in Python: the same experts, tokens and pairs, in the same
    order, as the sort makes for bigger ones (so each expert's call sees the same rows)."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((1, 8), (3, 2), (8, 8)):
        ids = torch.stack([torch.randperm(20, generator=g)[:k] for _ in range(n)])
        few = moe._groups(ids, 20)
        limit, moe._FEW_PAIRS = moe._FEW_PAIRS, 0
        try:
            sorted_ = moe._groups(ids, 20)
        finally:
            moe._FEW_PAIRS = limit
        assert [e for e, _, _ in few] == [e for e, _, _ in sorted_]
        for (_, t1, p1), (_, t2, p2) in zip(few, sorted_):
            assert t1.tolist() == t2.tolist() and p1.tolist() == p2.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_on_the_linear_kernel(dtype):
    """CpuExperts (each expert's panels on linear.c) against the stacks in torch: float32
    to summation order (the kernel sums K in another order: ~1e-6 relative); in bfloat16
    a projection's output may round to the other side of a tie (one ulp of it), which the
    next projection and the k-term sum carry through at their scale: a few ulps of the
    outputs' magnitude."""
    from models.cpu_linear import CpuExperts
    if not kernels.linear_available("cpu", dtype):
        pytest.skip(f"no linear kernel for {dtype} on this CPU")
    torch.manual_seed(2)
    block = moe.SparseMoE(moe_config(False, True, experts=8, k=2))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    block = block.to(dtype).requires_grad_(False)
    x = torch.randn(40, 16, dtype=dtype)
    want = block(x)
    block.experts = CpuExperts(block.experts)
    got = block(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 4 * ulp
        assert (got == want).float().mean() > 0.9          # most outputs: no tie at all


# ---- tensor parallelism in one process ----------------------------------------------------

LENS, STARTS = [5, 1, 9, 3], [0, 7, 0, 300]


def stacked_copy(src, dst, family: str):
    """The checkpoint `src` with its experts stacked as transformers 5 holds them (what
    save_pretrained(save_original_format=False) writes)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    block, gate, up, down = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                             "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}[family]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.{block}"
        if f"{pre}.gate.weight" not in weights:
            continue                                    # a dense layer
        n = cfg["num_local_experts"]
        weights[f"model.layers.{layer}.mlp.gate.weight"] = weights.pop(f"{pre}.gate.weight")
        weights[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([weights.pop(f"{pre}.experts.{e}.{gate}.weight"),
                       weights.pop(f"{pre}.experts.{e}.{up}.weight")]) for e in range(n)])
        weights[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([
            weights.pop(f"{pre}.experts.{e}.{down}.weight") for e in range(n)])
    save_file(weights, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_experts_equal_unsharded(tiny_moe, tmp_path, family):
    path = tiny_moe(family)
    stacked = stacked_copy(path, tmp_path / "stacked", family)
    g = torch.Generator().manual_seed(0)
    model = load_model(path, torch.float32, "cpu", pack=False)
    ids = torch.randint(5, model.vocab_size, (sum(LENS),), generator=g)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(STARTS, LENS)])
    want = model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    tol = 5e-6 * float(want.abs().max())               # rounding of the row-parallel sums
    for source, size in ((path, 2), (path, 3), (stacked, 1), (stacked, 2)):
        def rank(tp):
            m = load_model(source, torch.float32, "cpu", pack=False,
                           **({} if tp is None else {"tp": tp}))
            return m.compute_logits(m(ids, positions, DenseCausalAttention(LENS)))
        got = rank(None) if size == 1 else ThreadGroup.run(size, rank)[0]
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


# ---- end to end ---------------------------------------------------------------------------

e2e = pytest.mark.e2e
CONFIGS = {                                     # name: flags
    "radix": (),                                # default flags
    "no-radix": ("--disable-radix-cache", "--chunked-prefill-size", "8"),
    "tp2": ("--tp-size", "2", "--chunked-prefill-size", "16"),
}
SERVERS = [(f, c) for f in FAMILIES for c in ("radix", "no-radix")] + [("qwen3_moe", "tp2")]


@pytest.fixture(scope="module", params=SERVERS, ids=[f"{f}-{c}" for f, c in SERVERS])
def server(request, tiny_moe, tmp_path_factory):
    family, config = request.param
    model_dir = tiny_moe(family)
    with serving(model_dir, *CONFIGS[config], tmpdir=tmp_path_factory.mktemp("srv")) as s:
        s.config, s.model_dir = config, model_dir
        yield s


PROMPTS = [[10, 200, 31, 77, 5, 600], [400, 12], list(range(20, 60))]


@e2e
def test_unary_and_batch_equal_transformers(server):
    for p in PROMPTS:
        assert_output_greedy(server.model_dir, p, server.generate_ok(
            input_ids=p, sampling_params=GREEDY), MAX_NEW)
    outs = server.generate_ok(input_ids=PROMPTS, sampling_params=GREEDY)   # one batch
    for p, out in zip(PROMPTS, outs):
        assert_output_greedy(server.model_dir, p, out, MAX_NEW)
    assert_served_batch_greedy(server, PROMPTS, MAX_NEW, torch.float32, 1e-3)  # concurrent
    wait_idle(server)


@e2e
def test_streams_equal_transformers(server):
    frames = server.stream(input_ids=PROMPTS[0], sampling_params=GREEDY)
    for prev, cur in zip(frames, frames[1:]):
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert_output_greedy(server.model_dir, PROMPTS[0], frames[-1], MAX_NEW)
    frames = server.stream(input_ids=PROMPTS, sampling_params=GREEDY)
    for i, p in enumerate(PROMPTS):
        last = [f for f in frames if f["index"] == i][-1]
        assert last["meta_info"]["finish_reason"] is not None
        assert_output_greedy(server.model_dir, p, last, MAX_NEW)
    wait_idle(server)


@e2e
def test_shared_prefixes_and_the_prefix_cache(server):
    """Prompts sharing a 48-token prefix: the first fills the cache, the rest (sent
    together) hit it where it is on; outputs equal transformers' either way."""
    ps = shared_prefix_prompts(11, 4)
    first = server.generate_ok(input_ids=ps[0], sampling_params=GREEDY)
    assert_output_greedy(server.model_dir, ps[0], first, MAX_NEW)
    outs = server.generate_ok(input_ids=ps[1:], sampling_params=GREEDY)
    for p, out in zip(ps[1:], outs):
        assert_output_greedy(server.model_dir, p, out, MAX_NEW)
        cached = out["meta_info"]["cached_tokens"]
        assert cached >= 48 if server.config != "no-radix" else cached == 0, cached
    wait_idle(server)


def test_int8_quantization_keeps_the_experts_float(tiny_moe):
    """--quantization int8 turns the linear layers (attention, the dense MLP) into Q8_0
    blocks; the experts and router are no nn.Linear and stay float32 (in process: the
    server loads the model with this same call)."""
    from models import describe_weights
    if not kernels.avx2_available("cpu"):
        pytest.skip("--quantization int8 needs the AVX2 kernels")
    model = load_model(tiny_moe("qwen3_moe"), torch.float32, "cpu", quantization="int8")
    weights = describe_weights(model)
    assert "Q8_0" in weights["linear_layers"]
    assert weights["experts"] == {"layers": 1, "dtype": "float32"}
    ids = torch.tensor(PROMPTS[0])
    logits = model.compute_logits(model(ids, torch.arange(len(ids)),
                                        DenseCausalAttention(layers=model.attention_layers)))
    assert logits.shape == (len(ids), model.vocab_size) and torch.isfinite(logits).all()