"""SparseMoE: the mixture-of-experts MLP of Qwen3-MoE and Mixtral, over a flat batch of tokens.

This module owns routing and running the experts; llama.py's DecoderLayer picks it or the
dense MLP per layer (ModelConfig.sparse), and the loader fills its parameters, whose names
are transformers 5's: `mlp.gate.weight` (the router, [E, hidden]),
`mlp.experts.gate_up_proj` ([E, 2 * I, hidden]: each expert's gate rows, then its up rows)
and `mlp.experts.down_proj` ([E, hidden, I]).

    weights, ids = router(x)             # [N, k] each: the top k experts of each token
    y = experts(x, weights, ids)         # sum over k of weight * expert(x)

Grouped by expert: the step's N * k (token, expert) pairs are sorted by expert, and each
chosen expert runs once, as two matmuls over the rows of the tokens that chose it
(index_select); an expert no token chose costs nothing, and no Python loop runs per token.
Each pair's output goes to the pair's slot (index_copy_); the slots are multiplied by their
routing weights and a token's k slots summed in its top-k order: the arithmetic of
transformers' default experts implementation ("grouped_mm": per-pair weighted outputs,
then a sum over k; its "eager" one adds them into the output expert by expert instead,
which differs in rounding only), so greedy outputs equal transformers'. The router is its too: softmax over the experts in float32,
top k, renormalized if norm_topk_prob, and the weights cast to the model's dtype unless
routing_weights_fp32 (Mixtral keeps them in float32, so its products and their sum are in
float32, then cast back).

The router is torch; the experts are F.linear over the stacked weights here, and the loader
puts them on our CPU linear kernel where it runs (cpu_linear.CpuExperts) or keeps a GGUF's
in their blocks (quant_linear.QuantExperts), both through the gate_up / down hooks below.
--quantization int8's Q8_0 blocks replace nn.Linear modules only, so the experts stay in the
model's dtype, and the one-call decode step (fast_decode.py) runs dense MLPs only, so a
model with experts decodes on the torch path, layer by layer. An expert's two
projections are its `gate_up(e, x)` and `down(e, h)`: --quantization gguf replaces the
module with quant_linear.QuantExperts, the same forward over the file's blocks (one kernel
call per projection of each chosen expert); the router stays float.

Tensor parallelism (`tp`): each rank holds every expert's share of the intermediate columns
(models/tp.py: Shard.moe_inter), as the dense MLP is cut; the down projection is then
row-parallel and the ranks' sums are all-reduced once, after the experts are summed. The
router is replicated, so every rank routes every token alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .ops import silu_and_mul


class Router(nn.Module):
    """Each token's top experts and their weights (module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k = config.experts_per_token
        self.normalize = config.norm_topk_prob
        self.fp32 = config.routing_weights_fp32

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [N, hidden] -> (weights [N, k], expert ids [N, k] int64), best expert first."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32 else weights.to(logits.dtype)), ids


class Experts(nn.Module):
    """The stacked expert weights, and their grouped forward (module docstring)."""

    def __init__(self, config: ModelConfig):
        """config: this rank's (moe_intermediate_size its share of each expert's columns)."""
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x: [N, hidden]; weights, ids: [N, k] (Router's) -> [N, hidden] in x's dtype."""
        n, k = ids.shape
        out = x.new_empty((n * k, x.shape[1]))
        for e, tokens, pairs in _groups(ids, self.num_experts):
            h = silu_and_mul(self.gate_up(e, x.index_select(0, tokens)))
            out.index_copy_(0, pairs, self.down(e, h))
        weighted = out * weights.reshape(-1, 1)         # float32 under routing_weights_fp32
        return weighted.view(n, k, -1).sum(dim=1).to(x.dtype)

    def gate_up(self, e: int, x: Tensor) -> Tensor:
        """Expert e's gate and up projections of x [M, hidden] -> [M, 2 * I] (gate first)."""
        return F.linear(x, self.gate_up_proj[e])

    def down(self, e: int, h: Tensor) -> Tensor:
        """Expert e's down projection of h [M, I] -> [M, hidden]."""
        return F.linear(h, self.down_proj[e])


# Up to this many (token, expert) pairs a step (decode steps of a few requests), the groups
# are made in Python from the ids: the same groups as the sort's, without its tensor ops
# (~1.5 ms a layer at batch 1 with 128 experts, bench/README.md).
_FEW_PAIRS = 64


def _groups(ids: Tensor, num_experts: int) -> list[tuple[int, Tensor, Tensor]]:
    """The step's (token, expert) pairs grouped by expert, ascending, each group's pairs in
    pair order: (expert, its tokens [M], its pairs [M]), pair p being token p // k's p % k-th
    choice. Experts no token chose are left out."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    if n * k <= _FEW_PAIRS:
        by_expert: dict[int, list[int]] = {}
        for p, e in enumerate(flat.tolist()):
            by_expert.setdefault(e, []).append(p)
        return [(e, torch.tensor([p // k for p in pairs]), torch.tensor(pairs))
                for e, pairs in sorted(by_expert.items())]
    order = torch.argsort(flat, stable=True)            # pairs by expert, in pair order
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens, groups, start = order // k, [], 0
    for e, count in enumerate(counts):
        if count:
            groups.append((e, tokens[start:start + count], order[start:start + count]))
            start += count
    return groups


class SparseMoE(nn.Module):
    """The mixture-of-experts MLP: route, run the chosen experts, and under tensor
    parallelism join the ranks' partial sums."""

    def __init__(self, config: ModelConfig, tp=None):
        super().__init__()
        self.tp = tp
        self.gate = Router(config)
        self.experts = Experts(config)

    def forward(self, x: Tensor) -> Tensor:
        out = self.experts(x, *self.gate(x))
        if self.tp is not None:
            out = self.tp.all_reduce_(out)
        return out
