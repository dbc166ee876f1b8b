"""LoRA adapters (--enable-lora: models/lora.py, scheduler_proc/adapters.py).

Unit: a PEFT adapter read into our fused layout gives transformers + peft's logits (unmerged
peft), rows of several adapters and none in one forward; the same over a base kept in Q8_0
blocks (--quantization int8) as over its dequantized floats; rsLoRA and alpha_pattern
scales; what is refused (DoRA, biases, modules_to_save, embedding targets, a pickle-only
adapter, a rank above --max-lora-rank); a llama.cpp LoRA GGUF reads as the PEFT adapter it
was written from. The scheduler's policy with a fake runner: --max-loras-per-batch, each
step's rows per adapter in at most two runs, unknown names 404, an unload that waits for
its requests, the prefix cache keyed by the adapter's load.

Served (tiny llama, random adapters of rank 8 on every projection and rank 16 on q/v only):
greedy ids equal transformers' on the peft-merged checkpoint, each adapter alone and mixed
with others and with base rows in one batch, unary, streamed and concurrent; the OpenAI,
Anthropic and Ollama routes take the adapter as `model`; load, use, unload and reload while
other requests run, an unload waiting for its stream; the prefix cache keyed by adapter;
over two tensor-parallel ranks, and over Q8_0 blocks (--quantization int8) against the
dequantized checkpoint merged with the adapter.
"""

from __future__ import annotations

import json
import random
import shutil
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from checkpoints.tiny import ensure_checkpoint
from models import kernels
from models.lora import AdapterError, LoraSet, read_adapter
from models.quant_linear import step_batch
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.runner import ModelRunner
from scheduler_proc.scheduler import Scheduler
from tests.reference import assert_greedy_match, greedy_reference
from tests.server import serving, wait_idle
from tests.test_scheduler_unit import FakeGrammars, FakeRunner, assert_pool_idle, finishes, \
    outputs, run_until_idle
from tests.test_scheduler_unit import make as make_without_lora
from wire.messages import LoraRequest, TokenizedRequest
from wire.sampling import SamplingParams
from wire.server_args import ServerArgs

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 16
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def make_adapter(base_dir, out_dir, r: int, targets: list[str], seed: int, scale: float = 1.0,
                 **config) -> None:
    """A random PEFT adapter of the checkpoint at base_dir (B not zero: init off), B scaled
    by `scale`, saved to out_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                          init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)


def merged(base_dir, adapter_dir, out_dir):
    """transformers + peft: the base with the adapter merged in, saved as a checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(hf, adapter_dir).merge_and_unload().save_pretrained(out_dir)
    return out_dir


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(5, 700) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama():
    return ensure_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """name -> (adapter dir, merged checkpoint dir)."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name, r, targets, seed, extra in (("a1", 8, ALL, 1, {}),
                                          ("a2", 16, ["q_proj", "v_proj"], 2,
                                           {"use_rslora": True})):
        make_adapter(llama, root / name, r, targets, seed, **extra)
        out[name] = (root / name, merged(llama, root / name, root / f"{name}-merged"))
    return out


# ---------------------------------------------------------------------------------------
# Unit: the low-rank products


def our_logits(model, ids: list[list[int]], runs=()) -> torch.Tensor:
    """Our model's logits over a flat batch of the sequences ids (causal within each),
    with the LoRA runs [(slot, lo, hi)] applied."""
    from tests.model_helpers import DenseCausalAttention
    flat = torch.tensor([t for s in ids for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in ids])
    attn = DenseCausalAttention([len(s) for s in ids], model.attention_layers)
    # a step of len(ids) requests: layers in blocks multiply float activations, as the
    # runner's steps of a few requests do (quant_linear.py: step_batch)
    with model.lora.step(list(runs)), step_batch(len(ids)):
        return model.compute_logits(model(flat, positions, attn))


def peft_logits(llama, adapter_dir, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32,
                                              attn_implementation="eager")
    model = PeftModel.from_pretrained(hf, adapter_dir).eval()     # not merged
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def close(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """float32 logits of the same math summed in another order: the model's logits reach
    tens here (the adapters move them by as much), float32 keeps ~7 digits, and ~10 sums of
    a few hundred terms each lie between: 1e-4 of the largest logit bounds the drift."""
    return (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_adapter_rows_of_one_batch_follow_peft(llama, adapters):
    from models import load_model

    model = load_model(llama, torch.float32, "cpu")
    lora = LoraSet(model, 3, torch.float32)
    assert lora.load(1, adapters["a1"][0]) == 8 and lora.load(2, adapters["a2"][0]) == 16
    seqs = prompts(0, 3)
    refs = [peft_logits(llama, adapters["a1"][0], seqs[0]),
            peft_logits(llama, adapters["a2"][0], seqs[1])]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32,
                                              attn_implementation="eager")
    with torch.no_grad():
        refs.append(hf(torch.tensor([seqs[2]])).logits[0])
    n0, n1 = len(seqs[0]), len(seqs[1])
    logits = our_logits(model, seqs, [(1, 0, n0), (2, n0, n0 + n1)])
    at = 0
    for seq, ref in zip(seqs, refs):
        assert close(logits[at:at + len(seq)], ref)
        at += len(seq)
    assert (refs[0] - peft_logits(llama, adapters["a2"][0], seqs[0])).abs().max() > 1.0
    lora.unload(1)
    assert close(our_logits(model, [seqs[0]], [(1, 0, n0)]), hf(torch.tensor([seqs[0]]))
                 .logits[0].detach())


ISAS = [pytest.param("avx2", id="avx2"),
        pytest.param("avx512", id="avx512", marks=pytest.mark.skipif(
            not kernels.available("cpu", torch.float32),
            reason="this CPU has no AVX-512 (or ZSERVE_CPU_ISA=avx2 asks for AVX2 only)"))]


@pytest.mark.skipif(not kernels.linear_available("cpu", torch.float32),
                    reason="no AVX2/FMA or no C compiler: torch's matmuls serve")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k, n, ranks", [(64, 96, (8, 0, 16)), (576, 960, (48, 16, 40)),
                                         (37, 21, (3, 17, 5))])
def test_the_kernels_runs_are_torchs_products(isa, k, n, ranks):
    """linear.c's zs_lora_f32 against the products in float64: rows in runs of several
    slots (one slot twice, one that does not adapt the layer: R = 0, rows left alone), more
    rows than one pass of the kernel (64); slot 1 adapts the whole output as one part, slot
    3 two parts (the first and last thirds of the columns, as q and v of a fused qkv, k
    left alone). Tolerance: each output sums r products of a K-term float32 sum, the terms
    O(1): 1e-5 relative to the largest."""
    from models.cpu_linear import to_panels
    from models.lora import LORA_ENTRY

    g = torch.Generator().manual_seed(k)
    lib = kernels.library()
    table = torch.zeros((4, LORA_ENTRY), dtype=torch.int64)
    held, weights = [], {}
    third = n // 3
    for slot, r in zip((1, 2, 3), ranks):
        if not r:
            continue
        spans = [(0, n)] if slot != 3 else [(0, third), (n - third, n)]
        a = torch.randn(r * len(spans), k, generator=g)
        parts = [(i * r, torch.randn(hi - lo, r, generator=g), lo)
                 for i, (lo, hi) in enumerate(spans)]
        weights[slot] = (a, parts)
        pa = to_panels(a)
        entry = [pa.data_ptr(), a.shape[0], len(parts)]
        held.append(pa)
        for r0, b, c0 in parts:
            pb = to_panels(b)
            held.append(pb)
            entry += [r0, r, pb.data_ptr(), c0, b.shape[0]]
        table[slot] = torch.tensor(entry + [0] * (LORA_ENTRY - len(entry)))
    rows = 150
    x, y = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    runs = [(1, 0, 5), (2, 5, 9), (3, 20, 100), (1, 100, 101), (3, 120, 150)]
    want = y.double().clone()
    for slot, lo, hi in runs:
        if slot in weights:
            a, parts = weights[slot]
            t = x[lo:hi].double() @ a.double().t()
            for r0, b, c0 in parts:
                want[lo:hi, c0:c0 + b.shape[0]] += t[:, r0:r0 + b.shape[1]] @ b.double().t()
    c_runs = torch.tensor(runs, dtype=torch.int64)
    assert lib.zs_lora_f32(int(isa == "avx512"), x.data_ptr(), k, y.data_ptr(), n,
                           c_runs.data_ptr(), len(runs), table.data_ptr()) == 0
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(y[9:20], want[9:20].float())         # no run: untouched


def test_a_base_in_q8_0_blocks_takes_adapters_as_its_dequantized_floats(llama, adapters):
    """--quantization int8: the base layers are QuantLinear (blocks.c at this size: the
    dequantized layer's output up to float32 rounding), the adapter's products the same."""
    from models import load_model
    from models.quant_linear import QuantLinear, dequantize, quantize_q8_0

    if not kernels.avx2_available("cpu"):
        pytest.skip("no AVX2 kernels here: --quantization int8 is not served")
    quant = load_model(llama, torch.float32, "cpu", quantization="int8")
    assert any(isinstance(m, QuantLinear) for m in quant.modules())
    plain = load_model(llama, torch.float32, "cpu", pack=False)
    head = plain.lm_head if plain.lm_head is not None else plain.embed_tokens
    plain.lm_head = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0],
                                    bias=False).requires_grad_(False)
    plain.lm_head.weight.data = head.weight.detach().clone()   # int8 quantizes the head too
    for layer in plain.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj, plain.lm_head):
            w = linear.weight
            w.copy_(dequantize("Q8_0", quantize_q8_0(w), w.shape[1]))
    seqs = prompts(1, 2)
    out = []
    for model in (quant, plain):
        lora = LoraSet(model, 2, torch.float32)
        lora.load(1, adapters["a1"][0])
        out.append(our_logits(model, seqs, [(1, 0, len(seqs[0]))]))
    assert close(*out)


def test_a_gguf_base_in_its_blocks_takes_adapters_as_its_dequantized_floats(llama, adapters,
                                                                           tmp_path):
    """--quantization gguf (QuantLinear layers, a QuantEmbedding) against the same file
    dequantized (none)."""
    import gguf
    from models import load_model
    from tests.test_gguf import write_gguf

    path = write_gguf(llama, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0)
    if not kernels.avx2_available("cpu"):
        pytest.skip("no AVX2 kernels here: GGUF blocks are dequantized")
    seqs = prompts(3, 2)
    out = []
    for quantization in ("gguf", "none"):
        model = load_model(path, torch.float32, "cpu", quantization=quantization)
        lora = LoraSet(model, 2, torch.float32)
        lora.load(1, adapters["a1"][0])
        out.append(our_logits(model, seqs, [(1, len(seqs[0]), len(seqs[0]) + len(seqs[1]))]))
    assert close(*out)


def test_scales_rslora_and_alpha_pattern(llama, tmp_path):
    make_adapter(llama, tmp_path / "p", 4, ["q_proj", "down_proj"], 3, use_rslora=True,
                 alpha_pattern={"down_proj": 2, "model.layers.1.self_attn.q_proj": 32})
    parts = read_adapter(tmp_path / "p")
    assert {p.name for p in parts} == {"q_proj", "down_proj"}
    assert {(p.layer, p.name): p.scale for p in parts if p.layer < 2} == {
        (0, "q_proj"): 8 / 4 ** 0.5, (0, "down_proj"): 2 / 4 ** 0.5,
        (1, "q_proj"): 32 / 4 ** 0.5, (1, "down_proj"): 2 / 4 ** 0.5}
    # peft's own scaling for the same config, module by module
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama),
                                           tmp_path / "p")
    layers = peft_model.base_model.model.model.layers
    for p in parts:
        module = getattr(layers[p.layer].self_attn if p.name == "q_proj" else
                         layers[p.layer].mlp, p.name)
        assert module.scaling["default"] == pytest.approx(p.scale)


@pytest.mark.parametrize("config,fragment", [
    ({"use_dora": True}, "DoRA"), ({"bias": "lora_only"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["embed_tokens"]}, "embedding")])
def test_adapters_we_do_not_serve_are_refused_naming_why(llama, tmp_path, config, fragment):
    targets = config.pop("target_modules", ["q_proj"])
    make_adapter(llama, tmp_path / "x", 4, targets, 0, **config)
    with pytest.raises(AdapterError, match=fragment):
        read_adapter(tmp_path / "x")


def test_a_pickled_adapter_is_not_loaded_and_ranks_are_bounded(llama, adapters, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (tmp_path / "adapter_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(AdapterError, match="pickle"):
        read_adapter(tmp_path)
    from models import load_model
    lora = LoraSet(load_model(llama, torch.float32, "cpu"), 2, torch.float32)
    with pytest.raises(AdapterError, match="above --max-lora-rank 8"):
        lora.load(1, adapters["a2"][0], max_rank=8)
    assert lora.weights[1] == {}


def test_overlapping_parts_are_refused_and_leave_the_slot_empty(llama, adapters, tmp_path):
    """A fused projection and its parts in one layer (qkv_proj with q_proj) would add q's
    rows twice: refused, and the slot keeps nothing of it."""
    from safetensors.torch import save_file
    from models import load_model

    config = json.loads((llama / "config.json").read_text())
    h = config["hidden_size"]
    d = h // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    key = "base_model.model.model.layers.0.self_attn"
    save_file({f"{key}.q_proj.lora_A.weight": torch.randn(4, h),
               f"{key}.q_proj.lora_B.weight": torch.randn(h, 4),
               f"{key}.qkv_proj.lora_A.weight": torch.randn(4, h),
               f"{key}.qkv_proj.lora_B.weight": torch.randn(qkv, 4)},
              tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    lora = LoraSet(load_model(llama, torch.float32, "cpu"), 2, torch.float32)
    lora.load(1, adapters["a1"][0])
    with pytest.raises(AdapterError, match="overlap"):
        lora.load(1, tmp_path)
    assert lora.weights[1] == {} and all(not m.table[1].any() for m in lora.modules.values())


def test_a_llama_cpp_lora_gguf_reads_as_its_peft_adapter(llama, adapters, tmp_path):
    """llama.cpp's convert_lora_to_gguf layout, written here with the gguf library: per
    tensor lora_a [r, in] and lora_b [out, r], llama's q/k B rows permuted as the base's
    are, alpha in adapter.lora.alpha. Served, it equals the PEFT adapter."""
    import gguf
    from models import load_model
    from models.gguf import _unpermute_rows
    from models.config import ModelConfig

    config = ModelConfig.from_dir(llama)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
             "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(tmp_path / "a1.gguf", "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 16.0)
    for p in read_adapter(adapters["a1"][0]):
        b = p.b
        if p.name in ("q_proj", "k_proj"):           # permute = the inverse of unpermute
            heads = config.num_heads if p.name == "q_proj" else config.num_kv_heads
            b = _permute(b, heads, config.head_dim)
            assert torch.equal(_unpermute_rows(b, heads, config.head_dim), p.b)
        base = f"blk.{p.layer}.{names[p.name]}.weight"
        writer.add_tensor(f"{base}.lora_a", p.a.numpy())
        writer.add_tensor(f"{base}.lora_b", b.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model = load_model(llama, torch.float32, "cpu")
    lora = LoraSet(model, 3, torch.float32)
    lora.load(1, adapters["a1"][0])
    lora.load(2, tmp_path / "a1.gguf")
    seq = prompts(2, 1)[0]
    assert close(our_logits(model, [seq], [(2, 0, len(seq))]),
                 our_logits(model, [seq], [(1, 0, len(seq))]))


def _permute(rows: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute."""
    rest = tuple(rows.shape[1:])
    return rows.reshape(heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(rows.shape)


# ---------------------------------------------------------------------------------------
# Unit: the scheduler's policy, with a fake runner


class AdapterRunner(FakeRunner):
    """FakeRunner with adapter slots (the fake model ignores them)."""

    def __init__(self):
        super().__init__()
        self.slots: dict[int, str] = {}

    def load_adapter(self, slot: int, path: str, max_rank=None) -> int:
        if path == "missing":
            raise ValueError("no such adapter")
        self.slots[slot] = path
        return 8

    def unload_adapter(self, slot: int) -> None:
        del self.slots[slot]


def make(**flags):
    args = ServerArgs(max_running_requests=8, chunked_prefill_size=64, enable_lora=True,
                      lora_paths=("a=pa", "b=pb", "c=pc"), **flags)
    kv = KVManager(pool_size=400, max_running=8, context_len=128, device="cpu",
                   use_cache=True)
    batches, replies = [], []
    s = Scheduler(args, AdapterRunner(), kv, batches.append, replies.append,
                  grammars=FakeGrammars())
    return s, batches, replies


def lora_request(rid: str, lora: str | None, ids=(1, 2, 3), n: int = 4) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_ids=list(ids),
                            sampling=SamplingParams(max_new_tokens=n), lora=lora)


def test_at_most_max_loras_per_batch_adapters_run_together_in_runs():
    s, batches, _ = make(max_loras_per_batch=2)
    msgs = [lora_request(f"r{i}", name, ids=(1, 2, 3 + i), n=6)
            for i, name in enumerate(["a", None, "b", "c", "a", None, "b"])]
    run_until_idle(s, msgs)
    done = finishes(batches)
    assert len(done) == 7 and all(f.type == "length" for f in done.values())
    for segments in s.runner.steps:
        names = {seg.req.adapter.name for seg in segments if seg.req.adapter is not None}
        assert len(names) <= 2
        plan, _, _ = ModelRunner.plan(segments)
        slots = [r[0] for r in plan.lora_runs]
        assert all(slots.count(x) <= 2 for x in slots)          # decode part, prefill part
        rows = [row for slot, lo, hi in plan.lora_runs for row in range(lo, hi)]
        at, want = 0, []
        for seg in segments:
            if seg.req.adapter is not None:
                want += range(at, at + seg.length)
            at += seg.length
        assert rows == want
    assert any(len({seg.req.adapter.name for seg in st if seg.req.adapter}) == 2
               for st in s.runner.steps)
    assert_pool_idle(s)


def test_unknown_adapters_are_404_and_a_server_without_adapters_400():
    s, batches, _ = make()
    run_until_idle(s, [lora_request("x", "zz")])
    assert finishes(batches)["x"].status_code == 404
    s2, batches2, _ = make_without_lora()
    run_until_idle(s2, [lora_request("y", "a")])
    assert finishes(batches2)["y"].status_code == 400
    assert "--enable-lora" in finishes(batches2)["y"].message


def test_an_unload_waits_for_the_requests_using_the_adapter():
    s, batches, replies = make()
    s.step([lora_request("long", "a", n=40)])
    s.step([LoraRequest(req_id="u", op="unload", name="a")])
    assert replies == [] and "a" not in s.load().lora_adapters
    s.step([lora_request("late", "a")])                        # being unloaded: 404
    assert finishes(batches)["late"].status_code == 404
    assert 1 in s.runner.slots
    run_until_idle(s)
    assert finishes(batches)["long"].type == "length"
    [reply] = replies
    assert reply.ok and reply.req_id == "u" and 1 not in s.runner.slots
    s.step([LoraRequest(req_id="l", op="load", name="a", path="pa2")])
    assert replies[-1].ok and s.load().lora_adapters == ["b", "c", "a"]
    s.step([LoraRequest(req_id="again", op="load", name="b", path="pb")])
    assert replies[-1].ok and "already" in replies[-1].message        # the same: converges
    for req_id, op, name, path, fragment in (("e1", "load", "b", "pb2", "already loaded"),
                                             ("e4", "load", "x:1", "p", "cannot name"),
                                             ("e2", "load", "d", "missing", "no such"),
                                             ("e3", "unload", "zz", "", "not loaded")):
        s.step([LoraRequest(req_id=req_id, op=op, name=name, path=path)])
        assert not replies[-1].ok and fragment in replies[-1].message


def test_the_prefix_cache_keys_prompts_by_adapter_load():
    s, batches, replies = make()
    prompt = tuple(range(1, 30))

    def cached(rid, lora):
        run_until_idle(s, [lora_request(rid, lora, ids=prompt)])
        return outputs(batches, rid)[-1].cached_tokens
    assert cached("a1", "a") == 0
    assert cached("a2", "a") > 0                  # the same adapter: a hit
    assert cached("b1", "b") == 0 and cached("n1", None) == 0
    s.step([LoraRequest(req_id="u", op="unload", name="a")])
    s.step([LoraRequest(req_id="l", op="load", name="a", path="pa")])
    assert cached("a3", "a") == 0                 # reloaded: a new load, no stale KV
    assert_pool_idle(s)


# ---------------------------------------------------------------------------------------
# Served


@pytest.fixture(scope="module")
def server(llama, adapters, tmp_path_factory):
    flags = ("--enable-lora", "--lora-paths", f"a1={adapters['a1'][0]}",
             f"a2={adapters['a2'][0]}", "--max-loaded-loras", "4", "--log-level", "info")
    with serving(llama, *flags, tmpdir=tmp_path_factory.mktemp("srv")) as s:
        yield s


def reference(adapters, llama, name: str | None, prompt: list[int]):
    return greedy_reference(llama if name is None else adapters[name][1], prompt, MAX_NEW)


def check(adapters, llama, name, prompt, out) -> None:
    ids, margins = reference(adapters, llama, name, prompt)
    assert_greedy_match(out["output_ids"], ids, margins)


@pytest.mark.e2e
def test_each_adapter_alone_mixed_and_streamed_follows_transformers_peft(server, llama,
                                                                         adapters):
    ps = prompts(10, 6)
    names = ["a1", "a2", None, "a2", "a1", None]
    for p, name in zip(ps, names):
        check(adapters, llama, name, p, server.generate_ok(input_ids=p, lora_path=name,
                                                           sampling_params=GREEDY))
        check(adapters, llama, name, p, server.stream(input_ids=p, lora_path=name,
                                                      sampling_params=GREEDY)[-1])
    batch = server.generate_ok(input_ids=ps, lora_path=names, sampling_params=GREEDY)
    for p, name, out in zip(ps, names, batch):
        check(adapters, llama, name, p, out)
    ref_a1 = reference(adapters, llama, "a1", ps[0])[0]
    assert ref_a1 != reference(adapters, llama, None, ps[0])[0]      # the adapter matters
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda pn: server.generate_ok(
            input_ids=pn[0], lora_path=pn[1], sampling_params=GREEDY), zip(ps, names)))
    for p, name, out in zip(ps, names, outs):
        check(adapters, llama, name, p, out)


@pytest.mark.e2e
def test_dialects_take_the_adapter_as_model(server, llama, adapters):
    import anthropic
    import ollama
    import openai

    p = prompts(11, 1)[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="a2", prompt=p, max_tokens=MAX_NEW,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.model == "a2"
    assert server.generate_ok(input_ids=p, lora_path="a2", sampling_params=GREEDY)["text"] \
        == out.choices[0].text
    ids = [m.id for m in client.models.list().data]
    assert ids[1:] == ["a1", "a2"] and client.models.retrieve("a1").parent == ids[0]
    messages = [{"role": "user", "content": "Say something."}]
    texts = {}
    for model in ("a1", None):
        chat = client.chat.completions.create(
            model=model or ids[0], messages=messages, max_tokens=8, temperature=0)
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        msg = claude.messages.create(model=model or ids[0], messages=messages, max_tokens=8,
                                     extra_body={"temperature": 0})
        lama = ollama.Client(host=server.url).chat(
            model=model or ids[0], messages=messages, options={"num_predict": 8,
                                                                "temperature": 0})
        texts[model] = chat.choices[0].message.content
        assert msg.content[0].text == texts[model] == lama.message.content
        assert chat.model == msg.model == (model or ids[0])       # the adapter answered
    assert texts["a1"] != texts[None]
    with pytest.raises(openai.NotFoundError, match="zz"):
        client.chat.completions.create(model="zz", messages=messages, max_tokens=4)
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
            model="zz", messages=messages, max_tokens=4)
    r = server.generate(text="a", lora_path="zz")
    assert r.status_code == 404 and "zz" in r.json()["error"]["message"]


@pytest.mark.e2e
def test_the_prefix_cache_keys_by_adapter_and_logs_name_it(server):
    p = [699] + prompts(12, 1)[0] * 3        # no other prompt here starts with 699
    body = {"temperature": 0, "max_new_tokens": 2}
    first = server.generate_ok(input_ids=p, lora_path="a1", sampling_params=body)
    again = server.generate_ok(input_ids=p, lora_path="a1", sampling_params=body)
    other = server.generate_ok(input_ids=p, lora_path="a2", sampling_params=body)
    base = server.generate_ok(input_ids=p, sampling_params=body)
    assert first["meta_info"]["cached_tokens"] == 0 < again["meta_info"]["cached_tokens"]
    assert other["meta_info"]["cached_tokens"] == base["meta_info"]["cached_tokens"] == 0
    assert re.search(r"request \w+ generate: .*; length; adapter a2", server.logs())
    server.generate_ok(input_ids=p, lora_path="a1", priority=5, sampling_params=body)
    metrics = server.client.get("/metrics").text
    def count(name):
        found = re.search(re.escape(name) + r" ([0-9.e+]+)", metrics)
        return float(found[1]) if found else 0.0
    assert count('zserve:lora_requests_total{adapter="a1"}') >= 3
    assert count('zserve:priority_requests_total{priority_class="above_zero"}') >= 1
    assert 'adapter="zz"' not in metrics                   # refused names make no label
    assert server.server_info()["lora_adapters"] == ["a1", "a2"]


@pytest.mark.e2e
def test_load_use_unload_and_reload_while_requests_run(server, llama, adapters, tmp_path):
    client = server.client
    p = prompts(13, 1)[0]
    long = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}
    background = ThreadPoolExecutor(2)
    busy = background.submit(server.generate_ok, input_ids=p, lora_path="a2",
                             sampling_params=long)
    r = client.post("/load_lora_adapter", json={"lora_name": "a3",
                                                "lora_path": str(adapters["a1"][0])})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == ["a1", "a2", "a3"]
    check(adapters, llama, "a1", p, server.generate_ok(input_ids=p, lora_path="a3",
                                                       sampling_params=GREEDY))
    # An unload posted while a stream uses the adapter (its first frame read) does not cut
    # it: it waits for it (when it is still running then: the log says so; the unit test
    # above holds the order without a race), and the stream ends whole.
    with client.stream("POST", "/generate", json={"input_ids": p, "lora_path": "a3",
                                                  "stream": True, "sampling_params": long}
                       ) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        unload = background.submit(client.post, "/unload_lora_adapter",
                                   json={"lora_name": "a3"})
        frames = [json.loads(line[5:]) for line in lines
                  if line.startswith("data:") and line != "data: [DONE]"]
    last = frames[-1]["meta_info"]
    assert last["completion_tokens"] == 300 and last["finish_reason"]["type"] == "length"
    r = unload.result()
    assert r.status_code == 200 and r.json()["loaded_adapters"] == ["a1", "a2"]
    log = server.logs()
    if "unloading LoRA adapter a3 once its 1 requests end" in log:
        assert log.index("unloaded LoRA adapter a3") > \
            log.index("unloading LoRA adapter a3 once its 1 requests end")
    assert "a3" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert server.generate(input_ids=p, lora_path="a3", sampling_params=GREEDY) \
        .status_code == 404
    r = client.post("/load_lora_adapter", json={"lora_name": "a3",
                                                "lora_path": str(adapters["a2"][0])})
    assert r.status_code == 200
    check(adapters, llama, "a2", p, server.generate_ok(input_ids=p, lora_path="a3",
                                                       sampling_params=GREEDY))
    assert busy.result()["meta_info"]["completion_tokens"] == 300
    for bad, fragment in (({"alpha_pattern": {"(": 1}}, "not a LoRA adapter"),
                          ({"lora_alpha": [1]}, "numbers"), ([1, 2], "JSON object")):
        path = tmp_path / f"bad{len(fragment)}"
        shutil.copytree(adapters["a1"][0], path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(
            {**config, **bad} if isinstance(bad, dict) else bad))
        r = client.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    (path / "adapter_config.json").write_text((adapters["a1"][0] / "adapter_config.json")
                                              .read_text())
    (path / "adapter_model.safetensors").write_bytes(b"\x10" * 64)        # corrupt
    r = client.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
    assert r.status_code == 400 and "not a LoRA adapter" in r.json()["error"]["message"]
    for path, body, status, fragment in (
            ("/load_lora_adapter", {"lora_name": "a1", "lora_path": "/x"}, 400, "already"),
            ("/load_lora_adapter", {"lora_name": "default", "lora_path": "/x"}, 400,
             "cannot name"),
            ("/load_lora_adapter", {"lora_name": "a9", "lora_path": "/nope"}, 400, "/nope"),
            ("/load_lora_adapter", {"lora_name": "a9"}, 400, "lora_path"),
            ("/unload_lora_adapter", {"lora_name": "zz"}, 404, "not loaded"),
            ("/unload_lora_adapter", {"lora_name": 3}, 400, "lora_name")):
        r = client.post(path, json=body)
        assert r.status_code == status and fragment in r.json()["error"]["message"], r.text
    assert client.post("/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    wait_idle(server)


@pytest.mark.e2e
def test_adapters_under_two_tensor_parallel_ranks(llama, adapters, tmp_path):
    ps = prompts(14, 3)
    names = ["a1", None, "a2"]
    with serving(llama, "--tp-size", "2", "--enable-lora", "--lora-paths",
                 f"a1={adapters['a1'][0]}", tmpdir=tmp_path) as s:
        r = s.client.post("/load_lora_adapter", json={"lora_name": "a2",
                                                      "lora_path": str(adapters["a2"][0])})
        assert r.status_code == 200
        for p, name, out in zip(ps, names, s.generate_ok(input_ids=ps, lora_path=names,
                                                         sampling_params=GREEDY)):
            check(adapters, llama, name, p, out)
        assert s.client.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code \
            == 200
        check(adapters, llama, "a2", ps[0], s.stream(input_ids=ps[0], lora_path="a2",
                                                     sampling_params=GREEDY)[-1])


@pytest.mark.e2e
@pytest.mark.skipif(not kernels.avx2_available("cpu"),
                    reason="no AVX2 kernels here: --quantization int8 is not served")
def test_adapters_over_q8_0_blocks_follow_the_dequantized_model(llama, adapters, tmp_path):
    """--quantization int8: the reference is transformers + peft on the checkpoint whose
    linear weights are the Q8_0 blocks dequantized (blocks.c's output at a few requests)."""
    from safetensors.torch import load_file, save_file
    from models.quant_linear import dequantize, quantize_q8_0
    import shutil

    twin = tmp_path / "twin"
    shutil.copytree(llama, twin)
    for f in twin.glob("*.safetensors"):
        tensors = load_file(f)
        for key, w in tensors.items():
            if w.dim() == 2 and "embed_tokens" not in key:
                tensors[key] = dequantize("Q8_0", quantize_q8_0(w), w.shape[1])
        save_file(tensors, f, metadata={"format": "pt"})
    ref_dir = merged(twin, adapters["a1"][0], tmp_path / "twin-a1")
    p = prompts(15, 1)[0]
    with serving(llama, "--quantization", "int8", "--enable-lora", "--lora-paths",
                 f"a1={adapters['a1'][0]}", tmpdir=tmp_path) as s:
        ids, margins = greedy_reference(ref_dir, p, MAX_NEW)
        assert_greedy_match(s.generate_ok(input_ids=p, lora_path="a1",
                                          sampling_params=GREEDY)["output_ids"], ids, margins)
