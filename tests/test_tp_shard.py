"""Tensor-parallel sharding (models/tp.py, the llama.py hooks, the loaders), in one process:
T ranks are T threads of a ThreadGroup (models/distributed.py), so each test is the real
sharded model against the unsharded one, with nothing launched.

- logits: tiny llama, qwen2 (tied embeddings, qkv bias) and qwen3 (q/k norm, head_dim 32)
  at T = 2, 3, 4 equal the unsharded model's on a ragged batch, and through a real KV cache
  and StepAttention (a prefill, a chunk over a cached prefix, decode steps), up to the
  rounding of the row-parallel sums (~1e-6 of the logits' scale, float32);
- an uneven GQA split (8 q heads over 2 kv heads on 3 ranks: kv heads expanded) with
  attention and MLP biases, which the tiny checkpoints do not reach;
- kv_ids: every local q head reads the kv head its global q head reads (hypothesis);
- a vocabulary that does not divide by T: padded blocks, logits trimmed to V;
- the loaders: every shard parameter is exactly its slice of the unsharded model's, from
  safetensors and from GGUF (llama's q/k un-permuted per head before the cut).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from model_helpers import DenseCausalAttention
from models.ops import decode_kernel_fits
from scheduler_proc.attention import StepAttention
from models import load_model
from models.tp import Shard, kv_ids, part
from scheduler_proc.pool import KVCache, ReqToToken
from models.distributed import ThreadGroup

FAMILIES = ("llama", "qwen2", "qwen3")
SIZES = (2, 3, 4)
LENS, STARTS = [5, 1, 9, 3], [0, 7, 0, 300]     # a ragged batch, two of it mid-sequence
REL_TOL = 5e-6      # of the logits' largest magnitude: rounding of the row-parallel sums


def load(path, tp=None):
    kwargs = {} if tp is None else {"tp": tp}
    return load_model(path, torch.float32, "cpu", pack=False, **kwargs)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=REL_TOL * float(want.abs().max()))


def ragged_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(LENS),), generator=g)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(STARTS, LENS)])
    return ids, positions


def sharded_logits(path, size: int, ids, positions) -> torch.Tensor:
    """Rank 0's logits of the T-way sharded model (the other ranks must get None)."""
    def rank(g):
        model = load(path, g)
        return model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    out = ThreadGroup.run(size, rank)
    assert all(o is None for o in out[1:])
    return out[0]


@pytest.fixture(scope="module")
def full(tiny_model):
    """family -> (path, the unsharded model), loaded once."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tiny_model(family)
            cache[family] = path, load(path)
        return cache[family]
    return get


# ---- the split rules ----------------------------------------------------------------------

def test_part_is_balanced_and_covers():
    for n in range(1, 20):
        for size in range(1, n + 1):
            ranges = [part(n, size, r) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_kv_ids_of_the_tiny_models():
    """H=4 q heads, K=2 kv heads: the plan's worked examples."""
    assert [kv_ids(4, 2, 2, r) for r in range(2)] == [[0], [1]]                 # split
    assert [kv_ids(4, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]       # replicated
    assert [kv_ids(4, 2, 3, r) for r in range(3)] == [[0], [0], [1]]            # q 1, 1, 2
    assert [kv_ids(8, 2, 3, r) for r in range(3)] == [[0], [0, 0, 1], [1]]      # r1 expanded


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_kv_ids_every_local_head_reads_its_global_kv_head(data):
    kv = data.draw(st.integers(1, 16))
    heads = kv * data.draw(st.integers(1, 8))
    size = data.draw(st.integers(1, heads))
    rank = data.draw(st.integers(0, size - 1))
    ids = kv_ids(heads, kv, size, rank)
    qlo, qhi = part(heads, size, rank)
    assert (qhi - qlo) % len(ids) == 0                   # uniform local groups: GQA holds
    group = (qhi - qlo) // len(ids)
    for j, q in enumerate(range(qlo, qhi)):
        assert ids[j // group] == q // (heads // kv)
    if kv % size == 0:                                   # split: K/T distinct heads each
        assert ids == list(range(rank * kv // size, (rank + 1) * kv // size))
    if kv < size and size % kv == 0 and heads % size == 0:   # replicated: one head each
        assert len(ids) == 1


def test_too_many_ranks_is_refused(full):
    _, model = full("llama")
    with pytest.raises(ValueError, match="attention heads"):
        Shard.of(model.config, 5, 0)


# ---- logits -------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_logits_equal_unsharded(full, family, size):
    path, model = full(family)
    ids, positions = ragged_batch(model.vocab_size)
    want = model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    got = sharded_logits(path, size, ids, positions)
    assert_logits_close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def run_paged(model, steps) -> list[torch.Tensor]:
    """The model over a real KV cache and request table, one StepAttention per step;
    returns each step's logits of every row (None off rank 0)."""
    c = model.config                                    # this rank's heads
    cache = KVCache(c.num_layers, 64, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    table = ReqToToken(2, 64, "cpu")
    kernel = decode_kernel_fits(torch.device("cpu"), torch.float32, c.num_heads,
                                c.num_kv_heads, c.head_dim)
    out = []
    for step in steps:
        for row, start, slots in step["writes"]:
            table.write(row, start, slots)
        slots = [s for _, _, ss in step["writes"] for s in ss]
        attn = StepAttention.build(cache, table.table, slots, step["decode_rows"],
                                   step["decode_lens"], step["prefills"], "cpu", kernel)
        hidden = model(torch.tensor(step["ids"]), torch.tensor(step["positions"]), attn)
        out.append(model.compute_logits(hidden))
    return out


def paged_steps(vocab: int) -> list[dict]:
    """Two sequences in table rows 0 and 1: a prefill of both; then row 0's first decode
    alongside a chunk of row 1 over its cached prefix; then three decodes of both. Each
    step's tokens: decode rows first, then prefill segments (the runner's layout)."""
    g = torch.Generator().manual_seed(5)
    toks = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(2)]
    free = iter(range(1, 64))

    def slots(n):
        return [next(free) for _ in range(n)]

    steps = [dict(ids=toks[0][:6] + toks[1][:4], positions=[*range(6), *range(4)],
                  decode_rows=[], decode_lens=[], prefills=[(0, 0, 6), (1, 0, 4)],
                  writes=[(0, 0, slots(6)), (1, 0, slots(4))]),
             dict(ids=[toks[0][6]] + toks[1][4:9], positions=[6, *range(4, 9)],
                  decode_rows=[0], decode_lens=[7], prefills=[(1, 4, 5)],
                  writes=[(0, 6, slots(1)), (1, 4, slots(5))])]
    for k in range(3):
        steps.append(dict(ids=[toks[0][7 + k], toks[1][9 + k]], positions=[7 + k, 9 + k],
                          decode_rows=[0, 1], decode_lens=[8 + k, 10 + k], prefills=[],
                          writes=[(0, 7 + k, slots(1)), (1, 9 + k, slots(1))]))
    return steps


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_kv_cache_steps_equal_unsharded(full, family, size):
    path, model = full(family)
    steps = paged_steps(model.vocab_size)
    want = run_paged(model, steps)
    out = ThreadGroup.run(size, lambda g: run_paged(load(path, g), steps))
    assert all(logits is None for rank in out[1:] for logits in rank)
    for got, expected in zip(out[0], want):
        assert_logits_close(got, expected)


# ---- checkpoints the tiny models do not reach ----------------------------------------------

def write_llama(out: Path, heads: int, kv: int, vocab: int, bias: bool = False,
                tied: bool = False, seed: int = 0) -> Path:
    """A random Llama checkpoint (HF names, safetensors) with the given head counts."""
    hidden, head_dim, inter, layers = 64, 8, 96, 2
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
         "model.norm.weight": 1 + rand(hidden, scale=0.3)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, hidden, scale=1.0)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * head_dim, hidden),
                  "self_attn.k_proj": (kv * head_dim, hidden),
                  "self_attn.v_proj": (kv * head_dim, hidden),
                  "self_attn.o_proj": (hidden, heads * head_dim),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                  "mlp.down_proj": (hidden, inter)}
        for name, shape in shapes.items():
            w[f"{p}{name}.weight"] = rand(*shape)
            if bias:
                w[f"{p}{name}.bias"] = rand(shape[0])
        w[f"{p}input_layernorm.weight"] = 1 + rand(hidden, scale=0.3)
        w[f"{p}post_attention_layernorm.weight"] = 1 + rand(hidden, scale=0.3)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "attention_bias": bias,
        "mlp_bias": bias, "tie_word_embeddings": tied, "eos_token_id": 2}))
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_uneven_gqa_split_with_biases(tmp_path, size):
    """8 q heads over 2 kv heads: on 3 ranks the kv heads are expanded per q head; o_proj and
    down_proj biases are added once after the all-reduce."""
    path = write_llama(tmp_path / "m", heads=8, kv=2, vocab=300, bias=True)
    model = load(path)
    ids, positions = ragged_batch(300)
    want = model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    assert_logits_close(sharded_logits(path, size, ids, positions), want)
    steps = paged_steps(300)
    out = ThreadGroup.run(size, lambda g: run_paged(load(path, g), steps))
    for got, expected in zip(out[0], run_paged(model, steps)):
        assert_logits_close(got, expected)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("vocab,size", [(13, 4), (301, 2), (5, 4)])
def test_vocab_not_divisible_is_padded_and_trimmed(tmp_path, vocab, size, tied):
    """Blocks of ceil(V/T) rows; the last block's padding (with V=5 on 4 ranks, the whole
    last block) is zero and never reaches the logits."""
    path = write_llama(tmp_path / "m", heads=4, kv=2, vocab=vocab, tied=tied)
    model = load(path)
    ids, positions = ragged_batch(vocab)
    want = model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    got = sharded_logits(path, size, ids, positions)
    assert got.shape == (sum(LENS), vocab)
    assert_logits_close(got, want)

    def blocks(g):
        m = load(path, g)
        real = m.shard.real_vocab_rows
        head = m.embed_tokens.weight if tied else m.lm_head.weight
        return m.embed_tokens.weight.shape[0], real, bool(
            m.embed_tokens.weight[real:].eq(0).all() and head[real:].eq(0).all())
    rows = -(-vocab // size)
    out = ThreadGroup.run(size, blocks)
    assert [o[0] for o in out] == [rows] * size
    assert sum(o[1] for o in out) == vocab
    assert all(o[2] for o in out)


# ---- loaders: each shard parameter is its slice of the full one ------------------------------

def expected_shard(full_params: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """What rank shard.rank's parameters must be, cut from the unsharded model's by hand."""
    c, d = shard.full, shard.full.head_dim
    q, kv, inter = c.num_heads * d, c.num_kv_heads * d, c.intermediate_size
    qlo, qhi = shard.q_heads
    ilo, ihi = shard.inter
    kv_rows = torch.tensor([h * d + j for h in shard.kv_heads for j in range(d)])
    out = {}
    for name, t in full_params.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out[name] = torch.cat([t[qlo * d:qhi * d], t[q:q + kv][kv_rows],
                                   t[q + kv:][kv_rows]])
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            out[name] = torch.cat([t[ilo:ihi], t[inter + ilo:inter + ihi]])
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, qlo * d:qhi * d]
        elif name.endswith("down_proj.weight"):
            out[name] = t[:, ilo:ihi]
        elif name.endswith("o_proj.bias"):
            out[name.replace("o_proj.bias", "o_bias")] = t
        elif name.endswith("down_proj.bias"):
            out[name.replace("down_proj.bias", "down_bias")] = t
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            block = torch.zeros(shard.vocab_rows, t.shape[1])
            block[:shard.real_vocab_rows] = t[slice(*shard.vocab)]
            out[name] = block
        else:
            out[name] = t
    return out


def assert_shards_are_slices(path, full_model, size: int) -> None:
    full_params = dict(full_model.named_parameters())

    def check(g):
        model = load(path, g)
        got = dict(model.named_parameters())
        want = expected_shard(full_params, model.shard)
        assert got.keys() == want.keys()
        return [name for name in got if not torch.equal(got[name], want[name])]
    assert ThreadGroup.run(size, check) == [[]] * size


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_safetensors_shards_are_slices(full, family, size):
    path, model = full(family)
    assert_shards_are_slices(path, model, size)


def test_safetensors_shards_with_biases_and_expanded_kv(tmp_path):
    path = write_llama(tmp_path / "m", heads=8, kv=2, vocab=301, bias=True)
    assert_shards_are_slices(path, load(path), 3)


@pytest.mark.parametrize("size", [2, 3])
def test_phi3_fused_checkpoint_tensors_are_cut_per_rank(tmp_path, size):
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj fused: each rank reads its q, k, v
    and gate, up rows of them (on 3 ranks its kv heads expanded, read as runs of rows), and
    the sharded logits equal the unsharded model's."""
    from checkpoints.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "phi3", "phi3")
    model = load(path)
    assert_shards_are_slices(path, model, size)
    ids, positions = ragged_batch(model.vocab_size)
    want = model.compute_logits(model(ids, positions, DenseCausalAttention(LENS)))
    assert_logits_close(sharded_logits(path, size, ids, positions), want)


@pytest.mark.parametrize("family,size", [("llama", 2), ("llama", 3), ("qwen3", 4)])
def test_gguf_shards_are_slices(tiny_model, tmp_path, family, size):
    """F32 GGUF: dequantized whole, llama's q/k permutation undone per head, then cut."""
    from test_gguf import write_gguf

    hf_dir = tiny_model(family)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf")
    assert_shards_are_slices(path, load(path), size)


def test_a_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    """Under TP the full tensor's shape is still checked, not just the slice's."""
    path = write_llama(tmp_path / "m", heads=4, kv=2, vocab=64)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.gate_proj.weight"] = weights[
        "model.layers.0.mlp.gate_proj.weight"][:90]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ValueError, match="gate_proj.weight has shape"):
        ThreadGroup.run(2, lambda g: load(bad, g))
