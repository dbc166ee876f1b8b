"""How one tensor-parallel rank's share of a Llama-family model is cut from the whole.

    shard = Shard.of(config, size, rank)     # llama.py builds one when size > 1
    shard.config                             # the per-rank ModelConfig the module is built with
    shard.select(part, kind)                 # which rows / columns of a checkpoint tensor
    shard.select_fused(parts, kind)          # ... of one holding several parts (Phi-3's qkv)

Megatron's layout, as SGLang and vLLM use it:
- attention: q heads split in balanced ranges `part(H, T, r)` (divisibility is not needed:
  H=4 on T=3 gives 2, 1, 1 heads); each rank keeps the kv heads its q heads read (`kv_ids`).
  q/k/v (fused qkv_proj) are column-parallel: a rank computes its own heads whole; o_proj is
  row-parallel: each rank multiplies its heads' columns and the partial sums are all-reduced.
- MLP: gate/up (fused) column-parallel over `part(I, T, r)`, down_proj row-parallel.
- mixture of experts (moe.py): every expert cut as the MLP is, over
  `part(moe_intermediate_size, T, r)`; the router is replicated. A checkpoint holds the
  experts one tensor each (2-D, as the MLP's) or stacked [E, ...] (`select_stacked`).
- A row-parallel layer is built without its bias; the model adds the bias once, after the
  all-reduce (else it would be summed T times).
- vocabulary: embedding and LM head rows in blocks of Vs = ceil(V / T) (the last block
  zero-padded). The embedding zeroes the ids outside its block and all-reduces (exactly one
  rank contributes each row, so the sum is exact); the LM head computes its block's logits
  whole and rank 0 gathers them, trimmed to V.
- norms, q/k norms (Qwen3, per head) and RoPE tables are replicated.

kv heads under GQA (G = H / K q heads read each kv head): a rank's q heads need kv heads
`need = [q // G for q in its range]`. When each distinct kv head serves the same number of
them (K % T == 0: each rank holds K/T; K < T with T % K == 0: one head copied on T/K ranks,
SGLang's kv head replicas) the rank keeps the distinct ones, and attention keeps GQA with
G_r = H_r / K_r. Otherwise (uneven splits) it keeps one kv head per q head (G_r = 1): more
KV memory on that rank, always exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import ModelConfig

# Checkpoint parts (the leaf module name in HF's naming) split along the output rows; the
# row-parallel ones split along their input columns (their biases are replicated).
COLUMN_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARTS = ("o_proj", "down_proj")
VOCAB_PARTS = ("embed_tokens", "lm_head")


def part(n: int, size: int, rank: int) -> tuple[int, int]:
    """The balanced range [lo, hi) of n items that rank `rank` of `size` holds."""
    return rank * n // size, (rank + 1) * n // size


def kv_ids(num_heads: int, num_kv_heads: int, size: int, rank: int) -> list[int]:
    """The global kv heads rank `rank` keeps, in the order of its local kv heads (module
    docstring): local q head j then reads local kv head j // (H_r // len(kv_ids))."""
    qlo, qhi = part(num_heads, size, rank)
    group = num_heads // num_kv_heads
    need = [q // group for q in range(qlo, qhi)]
    unique = list(dict.fromkeys(need))
    if len(need) % len(unique) == 0 and all(need.count(u) == len(need) // len(unique)
                                            for u in unique):
        return unique
    return need


@dataclass(frozen=True, slots=True)
class Selection:
    """Which part of a full checkpoint tensor a rank loads: `index` (a slice, or a list of
    row numbers) along dimension `dim`, whose full length must be `full`."""

    dim: int
    index: slice | list[int]
    full: int

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    @property
    def key(self) -> tuple:
        """The selection as an index into a full tensor (a slice only)."""
        return (slice(None),) * self.dim + (self.index,)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This selection of a full tensor `t`."""
        if isinstance(self.index, slice):
            return t[self.key]
        return t.index_select(self.dim, torch.tensor(self.index, dtype=torch.int64))


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`'s share of a model with config `full` (module docstring)."""

    full: ModelConfig
    size: int
    rank: int
    q_heads: tuple[int, int]        # [lo, hi) of the global q heads
    kv_heads: tuple[int, ...]       # global kv head of each local kv head
    inter: tuple[int, int]          # [lo, hi) of the MLP's intermediate columns
    moe_inter: tuple[int, int]      # [lo, hi) of each expert's intermediate columns
    vocab: tuple[int, int]          # [lo, hi) of the real vocabulary rows held
    vocab_rows: int                 # Vs: rows of the local embedding / LM head (padded)
    config: ModelConfig             # the per-rank config the module is built with

    @classmethod
    def of(cls, full: ModelConfig, size: int, rank: int) -> Shard:
        h, k, i, v = full.num_heads, full.num_kv_heads, full.intermediate_size, full.vocab_size
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
        columns = min(i, full.moe_intermediate_size) if full.num_experts else i
        if size > h or size > columns:
            raise ValueError(f"--tp-size {size} is more than the model's {h} attention heads "
                             f"or {columns} MLP columns")
        if h % k:
            raise ValueError(f"{h} attention heads are not a multiple of {k} kv heads")
        q_heads, inter = part(h, size, rank), part(i, size, rank)
        moe_inter = part(full.moe_intermediate_size, size, rank)
        kv = tuple(kv_ids(h, k, size, rank))
        rows = -(-v // size)
        vocab = (min(rank * rows, v), min((rank + 1) * rows, v))
        config = dataclasses.replace(full, num_heads=q_heads[1] - q_heads[0],
                                     num_kv_heads=len(kv), intermediate_size=inter[1] - inter[0],
                                     moe_intermediate_size=moe_inter[1] - moe_inter[0],
                                     vocab_size=rows)
        return cls(full, size, rank, q_heads, kv, inter, moe_inter, vocab, rows, config)

    def select(self, part_name: str, kind: str, expert: bool = False) -> Selection | None:
        """The rows or columns of the full checkpoint tensor of `part_name` (q_proj, down_proj,
        embed_tokens, ...; HF's leaf module names) and `kind` ("weight" | "bias") this rank
        loads; None: the whole tensor (replicated). expert: gate_proj, up_proj or down_proj
        is one expert's (cut over moe_inter)."""
        c, d = self.full, self.full.head_dim
        inter, full_inter = ((self.moe_inter, c.moe_intermediate_size) if expert
                             else (self.inter, c.intermediate_size))
        if part_name == "q_proj":
            lo, hi = self.q_heads
            return Selection(0, slice(lo * d, hi * d), c.num_heads * d)
        if part_name in ("k_proj", "v_proj"):
            return Selection(0, _head_rows(self.kv_heads, d), c.num_kv_heads * d)
        if part_name in ("gate_proj", "up_proj"):
            return Selection(0, slice(*inter), full_inter)
        if part_name in ROW_PARTS and kind == "weight":
            if part_name == "o_proj":
                lo, hi = self.q_heads
                return Selection(1, slice(lo * d, hi * d), c.num_heads * d)
            return Selection(1, slice(*inter), full_inter)
        if part_name in VOCAB_PARTS:
            return Selection(0, slice(*self.vocab), c.vocab_size)
        return None

    def select_fused(self, part_names: tuple[str, ...], kind: str) -> Selection:
        """A checkpoint tensor that holds the column-parallel `part_names` (q_proj, k_proj,
        v_proj, or gate_proj, up_proj) stacked along its rows, as Phi-3 stores qkv_proj and
        gate_up_proj: this rank's rows of each part, in order (the rows the module's own
        fused layer holds)."""
        rows, start = [], 0
        for name in part_names:
            sel = self.select(name, kind)
            index = sel.index
            picked = range(*index.indices(sel.full)) if isinstance(index, slice) else index
            rows.extend(start + r for r in picked)
            start += sel.full
        return Selection(0, rows, start)
    def select_stacked(self, param: str) -> Selection:
        """This rank's part of the experts stacked in one tensor, as transformers 5 holds
        them: "gate_up_proj" [E, 2 * I, hidden] (its gate rows, then its up rows, of every
        expert) or "down_proj" [E, hidden, I]; or as a GGUF file does: "gate_proj",
        "up_proj" [E, I, hidden] and "down_proj"."""
        lo, hi = self.moe_inter
        i = self.full.moe_intermediate_size
        if param == "gate_up_proj":
            return Selection(1, [*range(lo, hi), *range(i + lo, i + hi)], 2 * i)
        if param in ("gate_proj", "up_proj"):
            return Selection(1, slice(lo, hi), i)
        return Selection(2, slice(lo, hi), i)

    @property
    def real_vocab_rows(self) -> int:
        """Rows of the local vocabulary block that are real tokens; the rest are padding."""
        return self.vocab[1] - self.vocab[0]


def _head_rows(heads: tuple[int, ...], head_dim: int) -> slice | list[int]:
    """The rows of a [heads * head_dim, ...] tensor holding `heads`, in order: a slice when
    they are consecutive (the split and replicated cases), else the row numbers."""
    if list(heads) == list(range(heads[0], heads[0] + len(heads))):
        return slice(heads[0] * head_dim, (heads[0] + len(heads)) * head_dim)
    return [h * head_dim + j for h in heads for j in range(head_dim)]
