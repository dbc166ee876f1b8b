"""A draft model as a speculative proposer (--speculative-algorithm STANDALONE
--speculative-draft-model-path DIR): a smaller model with the target's vocabulary, run in
the scheduler, proposing k tokens by greedy decode (speculative.py decides k and verifies).

Its KV lives in a pool of its own with the target pool's slot numbering: the draft's K/V
of a request's position p is at slot req.slots[p] of DraftModel.cache, through the same
request table, so the pool machinery (admission, the radix cache, truncation of rejected
positions, retraction) needs nothing new. Invariant: positions 0..spec.draft_done-1 of a
request hold the draft's K/V of exactly its tokens there. A proposal first catches the
draft up from draft_done to the request's newest token (the whole prompt the first time,
one or two tokens after a verify step), then decodes k - 1 more rows greedily, each at the
next position, into the slots the scheduler gave the drafts; afterwards draft_done is the
last position whose input was a token the request now has. A slot given back and reused
by another request is stale until that request's draft computes it (its draft_done starts
at 0); a cached prefix shared by several requests is recomputed by each, with the same
tokens. The draft's K/V only decides what is proposed, never what is output.

One rank only (the launcher refuses it with --tp-size > 1): the draft runs on rank 0's
device, unsharded. Its forwards count in the policy's step cost as `draft_cost` a draft
(its weights' bytes over the served model's). Not counted: on CUDA its memory when the
target's pool is sized (so --max-total-tokens is required there).
"""

from __future__ import annotations

import logging

import torch

from models import describe_weights, load_model
from models.ops import decode_kernel_fits
from models.quant_linear import step_batch
from scheduler_proc.attention import StepAttention
from scheduler_proc.pool import KVCache
from scheduler_proc.speculative import Proposer

log = logging.getLogger(__name__)

CATCH_UP_CHUNK = 512        # positions the draft catches up in a step at most (a long
                            # prompt over several steps, drafting only once caught up)


class DraftModel(Proposer):
    def __init__(self, path: str, target, dtype: torch.dtype, device, pool_size: int,
                 table: torch.Tensor, context_len: int):
        """target: the served model (its config, and its weights' size for draft_cost)."""
        self.model = load_model(path, dtype, device)
        target_config = target.config
        c = self.model.config
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {path}: its vocabulary has "
                             f"{c.vocab_size} tokens, the served model's "
                             f"{target_config.vocab_size}: a draft model must share the "
                             f"served model's tokenizer")
        self.device, self.table = device, table
        self.max_len = min(context_len, c.max_position_embeddings)
        self.cache = KVCache(c.num_layers, pool_size, c.num_kv_heads, c.head_dim, dtype,
                             device, dtype)
        self.decode_kernel = decode_kernel_fits(device, dtype, c.num_heads, c.num_kv_heads,
                                                c.head_dim, dtype)
        # A decode step reads every weight once: a draft costs about its weights' bytes
        # over the served model's, in the served model's one-row steps.
        self.draft_cost = (describe_weights(self.model)["bytes"] /
                           max(describe_weights(target)["bytes"], 1))
        log.info("draft model %s (%s, %d layers, %.0f%% of the served model's weight "
                 "bytes), its KV pool %d tokens", path, c.architecture, c.num_layers,
                 100 * self.draft_cost, pool_size)

    @torch.inference_mode()
    def propose(self, req, k: int) -> list[int]:
        """k greedy draft tokens after req's tokens. Their slots (positions seq_len ..
        seq_len + k - 2 take the drafts' K/V) are in req.slots already (add_drafts)."""
        last = req.seq_len - 1              # the newest token's position (its slot given)
        if last + k > self.max_len or len(req.slots) < last + k:
            return []
        state = req.spec
        done = min(state.draft_done, last)
        if last + 1 - done > CATCH_UP_CHUNK:     # a long prompt: a chunk a step, no drafts
            self._forward(req, done, req.token_ids(done, done + CATCH_UP_CHUNK), False)
            state.draft_done = done + CATCH_UP_CHUNK
            return []
        token = self._forward(req, done, req.token_ids(done, last + 1), True)
        drafts = [token]
        for i in range(1, k):
            drafts.append(self._forward(req, last + i, [drafts[-1]], True))
        # Positions last .. last + k - 1 were computed from the newest token and the first
        # k - 1 drafts; where the scheduler gives positions back (drafts cut or rejected),
        # Speculator.truncated cuts draft_done to match.
        state.draft_done = last + k
        return drafts

    def _forward(self, req, start: int, ids: list[int], logits: bool) -> int | None:
        n = len(ids)
        end = start + n
        if n == 1:
            decode_rows, decode_lens, prefills = [req.row], [end], []
        else:
            decode_rows, decode_lens, prefills = [], [], [(req.row, start, n)]
        attn = StepAttention.build(self.cache, self.table, req.slots[start:end], decode_rows,
                                   decode_lens, prefills, self.device, self.decode_kernel,
                                   self.model.attention_layers)
        with step_batch(1):
            hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device),
                                torch.arange(start, end, dtype=torch.int64,
                                             device=self.device), attn)
            if not logits:
                return None
            return int(self.model.compute_logits(hidden[-1:]).argmax(-1))

