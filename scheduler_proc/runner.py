"""ModelRunner: owns the model weights, the KV buffers (pool.KVCache, `pool_size` slots) and
one forward step. Which slots and table rows a request uses is the scheduler's KVManager's
business (kv_manager.py); the runner only reads them.

`forward(segments, req_to_token)` takes the step's segments (which request, which positions)
and the request-to-token table, runs one model call over the whole ragged batch, computes
logits only for the rows that sample, and returns one sampled token id per sampling
segment. It never decides what to run.

A step is two halves: `plan(segments)` turns the segments into a StepPlan (wire/messages.py:
token ids, positions, slots, the attention layout, which rows get logits), and
`execute(plan, table)` runs it: StepAttention.build, the model, one compute_logits per
input-logprob range, then one for the sampled rows, always in that order.

Vector requests (wire/messages.py VectorRequest: embeddings and scores) read their answer
off the same step. A score's label logprobs come from its last position's logits: a score
range like an input-logprob one, computed on every rank. An embedding pools the final
hidden states after the model's final norm (Req.pool); those rows are whole on every rank
(the layers end in all-reduces), so rank 0 pools them alone and the plan does not change:
embeddings work under tensor parallelism as on one rank.

Tensor parallelism (`tp`, models/distributed.py, size T > 1): every rank holds a shard of the
model (models/tp.py) and a KV cache of its own kv heads, and every rank runs `execute` on
the same plan, so all ranks make the same collectives with the same shapes in the same
order. Only rank 0 runs the Scheduler and KVManager; its `forward` broadcasts each plan
(msgpack, no pickle) before executing it, and does the sampling and logprobs alone on the
gathered logits. The followers run tp_worker.follow. What a follower needs besides the
plan is the request table: rank 0's ReqToToken logs its writes (`share_table`), each plan
carries the writes made since the previous one, and a follower applies them to its own
table before executing. Rows freed on rank 0 are not cleared on the followers: positions
past a row's length are never attended (only masked out in SDPA's padded decode batch).
The KV pool size is the smallest any rank can hold (all_reduce_min at construction);
`share_table` sends it with the table's shape (TPInit) and waits for every rank.
LoRA adapters (--enable-lora, models/lora.py) are loaded by rank 0 when the scheduler says
(`load_adapter`); each plan carries the loads and unloads made since the previous one, which
a follower applies (`apply_lora_loads`) before executing, and the step's runs of rows per
adapter (`lora_runs`: the plan reads each segment's Req.adapter).

Faults: an exception from the model call propagates (the scheduler ends the step's
requests). Under tensor parallelism it is a TPFault instead, which leaves_device_unknown
marks fatal: a peer may be inside a collective this rank will never join. Sampling is
isolated per request: if sampling the batch raises, each row is sampled again alone (seeded
generators rewound first), and a row that fails alone gets the exception in place of its
token. A CUDA error other than out-of-memory is sticky (the context, weights and KV
included, can no longer be trusted), so `leaves_device_unknown` marks it for the scheduler
to take the process down.

Memory: where the model's linears are oneDNN's (models/packed.py: CPUs without AVX-512, or
ZSERVE_CPU_KERNELS=0), oneDNN JIT-compiles a kernel for each (weight shape, row count) it
meets and keeps it in two caches, its primitive cache and ideep's LRU, of 1024 entries each
by default. A kernel holds ~0.5-1 MB, and a step's row count (its decode rows plus a prefill
chunk) is new on many steps, so under load the scheduler's RSS climbed until the caches
were full: +130-140 MB a minute in a soak of the tiny model, ~+770 MB at the limit.
`bound_onednn_caches` caps both caches at ONEDNN_CACHE_CAPACITY kernels (~70-130 MB); a
kernel evicted and needed again is recompiled, ~0.5 ms.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import psutil
import torch

from models.ops import decode_kernel_fits
from scheduler_proc.attention import StepAttention
from scheduler_proc.images import ImageEmbedder
from models import ModelConfig, load_model
from scheduler_proc.pool import KVCache, ReqToToken
from scheduler_proc.request import Req
from scheduler_proc.sampler import constrain, sample_tokens, token_logprobs
from scheduler_proc.speculative import accepted_run
from models.distributed import SOLO, TPFault, rank_device
from models.quant_linear import step_batch
from wire.codec import encode
from models.lora import AdapterFiles, LoraSet, read_files
from wire.messages import LoraLoad, StepPlan, TableWrite, TPInit
from wire.server_args import ServerArgs, ServerConfig

log = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.1    # of total RAM, for the default --max-total-tokens on CPU
ONEDNN_CACHE_CAPACITY = 128     # oneDNN kernels kept per cache (module docstring); >= 1:
                                # ideep crashes with LRU_CACHE_CAPACITY=0
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


class Scored(NamedTuple):
    """A score range's request: input logprobs of positions lo..hi-1, or (labels) the
    label logprobs of its last position."""

    req: Req
    lo: int
    hi: int
    labels: bool


class Pooled(NamedTuple):
    """Hidden rows row..row+n-1 of a step, a vector request's positions start..start+n-1."""

    req: Req
    row: int
    n: int
    start: int


@dataclass(slots=True)
class Segment:
    """`length` tokens of `req`, from position req.num_computed (before this step's slots
    were added: `start`). `sample` is true when the segment ends at the request's newest
    token, so its last row is sampled. A decoding request's segment may carry `draft`
    tokens (speculative.py): its newest token and the drafts, length 1 + len(draft), all
    decode rows, every row sampled."""

    req: Req
    start: int
    length: int
    sample: bool
    draft: list[int] = field(default_factory=list)

    @property
    def decodes(self) -> bool:
        """Its rows are decode rows (one token, or a token and its drafts)."""
        return self.length == 1 or bool(self.draft)

    def token_ids(self) -> list[int]:
        end = self.start + self.length - len(self.draft)
        return self.req.token_ids(self.start, end) + self.draft


def leaves_device_unknown(exc: BaseException) -> bool:
    """True for errors after which the model state cannot be trusted: a CUDA error other
    than out-of-memory poisons the whole context; a failed tensor-parallel step (TPFault)
    leaves the peers' state unknown."""
    if isinstance(exc, TPFault):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    return (isinstance(exc, getattr(torch, "AcceleratorError", ())) or
            "CUDA error" in str(exc))


def bound_onednn_caches() -> None:
    """Cap oneDNN's per-shape kernel caches (module docstring), unless the environment
    already sets them. oneDNN and ideep read these variables once, when the process runs its
    first oneDNN primitive: this must come before the model loads (packing the weights is
    one), or it has no effect."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


class ModelRunner:
    def __init__(self, resolved: ServerConfig, tp=SOLO):
        """Settings from the resolved record (wire/server_args.py); only the KV pool size is
        worked out here when --max-total-tokens is not given: it depends on the memory left
        once the weights are loaded. tp: this rank's tensor-parallel group; every rank of
        it must construct its runner (the pool size is agreed on here)."""
        args = resolved.args
        bound_onednn_caches()
        self.tp = tp
        self.device = (torch.device(args.device) if tp.size == 1
                       else rank_device(args.device, tp.rank))
        self.dtype: torch.dtype = getattr(torch, resolved.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, resolved.kv_dtype)
        self.config = ModelConfig.from_dir(resolved.model_path)     # the whole model's
        self.context_len = resolved.context_length
        self.model = load_model(resolved.model_path, self.dtype, self.device, tp=tp,
                                quantization=resolved.quantization,
                                int8_batch=args.int8_activation_batch)
        self.eos_ids = list(self.config.eos_token_ids)
        c = self.model.config                       # this rank's heads (all of them on one)
        self.pool_size = args.max_total_tokens or self._default_pool_size(args)
        if tp.size > 1:
            self.pool_size = tp.all_reduce_min(self.pool_size)
        self.cache = KVCache(c.num_layers, self.pool_size, c.num_kv_heads, c.head_dim,
                             self.dtype, self.device, self.kv_dtype)
        self.decode_kernel = decode_kernel_fits(self.device, self.dtype, c.num_heads,
                                                c.num_kv_heads, c.head_dim, self.kv_dtype)
        self.table_log: list[TableWrite] | None = None     # rank 0 under TP: share_table
        # LoRA adapters in slots 1..--max-loaded-loras (0: the base model), and rank 0's
        # loads since the last plan (tensor parallelism: every rank loads them).
        self.lora = None
        self.lora_log: list[LoraLoad] = []
        if args.enable_lora:
            self.lora = LoraSet(self.model, args.max_loaded_loras + 1, self.dtype)
        # A vision-language model's encoder, run on the images of each step (images.py).
        self.images = (None if self.model.vision is None else ImageEmbedder(
            self.model.vision, self.device, self.dtype,
            args.image_embedding_cache_mb * 1024 * 1024,
            mrope=self.config.mrope_section is not None))
        torch.manual_seed(args.random_seed)
        log.info("model %s (%s) on %s/%s, KV pool %d tokens (%s), decode attention on %s%s",
                 resolved.model_path, c.architecture, self.device, self.dtype, self.pool_size,
                 resolved.kv_dtype,
                 "zserve's CPU kernel" if self.decode_kernel else "SDPA",
                 f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "")

    def _default_pool_size(self, args: ServerArgs) -> int:
        c = self.model.config
        per_token = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                            self.kv_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * args.mem_fraction_static)
        else:
            budget = int(psutil.virtual_memory().total * CPU_KV_MEMORY_FRACTION)
        # Never more than every running request at full context could use.
        return max(1, min(budget // per_token, args.max_running_requests * self.context_len))

    # ---- tensor parallelism: rank 0's side (tp_worker.py has the followers') ------------

    def share_table(self, req_to_token: ReqToToken) -> None:
        """Rank 0 under tensor parallelism, once, after building the KVManager and before
        reporting ready: log the request table's writes into each step's plan, send the
        followers the pool size and the table's shape (TPInit), and wait until every rank
        has its table (so ready means every rank is loaded). A no-op on one rank."""
        if self.tp.size == 1:
            return
        if self.tp.rank != 0:
            raise RuntimeError("share_table is rank 0's; followers run tp_worker.follow")
        rows, cols = req_to_token.table.shape
        req_to_token.log = self.table_log = []
        self.tp.broadcast_bytes(encode(TPInit(pool_size=self.pool_size, table_rows=rows,
                                              table_cols=cols)))
        self.tp.barrier()

    def stop_followers(self) -> None:
        """Rank 0: let the followers leave their loop (a plan with `stop` set). Optional: a
        follower whose rank 0 is gone fails in its next collective anyway."""
        if self.tp.size > 1 and self.table_log is not None:
            self.tp.broadcast_bytes(encode(_empty_plan(stop=True)))

    # ---- LoRA adapters -------------------------------------------------------------------

    def load_adapter(self, slot: int, path: str, max_rank: int | None = None) -> int:
        """Load the adapter at `path` into `slot`; returns its rank. AdapterError (a
        ValueError) if it cannot serve here: nothing loaded. Rank 0 under tensor
        parallelism: the files it read go to the followers with the next plan (they parse
        the same bytes, never the path again)."""
        files = read_files(path)
        rank = self.lora.load_files(slot, files, path, max_rank)
        if self.tp.size > 1:
            self.lora_log.append(LoraLoad(slot, files.kind, files.config, files.data))
        return rank

    def unload_adapter(self, slot: int) -> None:
        self.lora.unload(slot)
        if self.tp.size > 1:
            self.lora_log.append(LoraLoad(slot))

    def apply_lora_loads(self, loads: list[LoraLoad]) -> None:
        """A follower: rank 0's loads and unloads, in order. Rank 0 loaded the same bytes:
        a failure here is the follower's (its memory), fatal as any failed step."""
        for load in loads:
            if load.kind:
                self.lora.load_files(load.slot, AdapterFiles(load.kind, load.config, load.data),
                                     f"adapter in slot {load.slot}")
            else:
                self.lora.unload(load.slot)

    # ---- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, segments: list[Segment],
                req_to_token: torch.Tensor) -> list[int | Exception]:
        """Run one step and return one sampled id per sampling segment, in segment order,
        or the exception that stopped that row's sampling (see the module docstring).
        Decode segments (length 1) must come first; slots for this step's tokens must
        already be in each req.slots and in row req.row of `req_to_token` (KVManager's
        request table, on the runner's device). Logprobs, when requested, are appended to
        req.pending_logprobs / req.input_logprobs."""
        plan, scored, pooled = self.plan(segments)
        embeds = self.images.step_embeds(segments) if self.images is not None else None
        capture = self._pooler(pooled) if pooled else None
        if self.tp.size == 1:
            logits = self.execute(plan, req_to_token, self._scorer(scored), embeds, capture)
        else:
            logits = self._execute_shared(plan, req_to_token, scored, embeds, capture)
        if logits is None:
            return []
        sampling = [s for s in segments if s.sample]
        if not any(s.draft for s in sampling):
            return sample_isolated(logits, [s.req for s in sampling], self.eos_ids)
        return sample_with_drafts(logits, sampling, self.eos_ids)

    @staticmethod
    def plan(segments: list[Segment]) -> tuple[StepPlan, list[Scored], list[Pooled]]:
        """The step's StepPlan (its table_writes still empty); for each of its score ranges
        (in order) the request and the positions lo..hi-1 whose logits score its prompt
        tokens lo+1..hi, or (labels) its last position's logits give its label logprobs;
        and the hidden rows vector requests pool. Reads only the segments."""
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        decode_rows, decode_lens, prefills = [], [], []
        sample_rows: list[int] = []
        score_ranges: list[list[int]] = []
        scored: list[Scored] = []
        pooled: list[Pooled] = []
        lora_runs: list[list[int]] = []
        for seg in segments:
            req, end = seg.req, seg.start + seg.length
            first_row = len(ids)
            if req.adapter is not None:         # runs of rows per adapter (models/lora.py)
                slot = req.adapter.slot
                if lora_runs and lora_runs[-1][0] == slot and lora_runs[-1][2] == first_row:
                    lora_runs[-1][2] += seg.length
                else:
                    lora_runs.append([slot, first_row, first_row + seg.length])
            ids += seg.token_ids()
            positions += req.positions(seg.start, end)
            out_slots += req.slots[seg.start:end]
            if seg.decodes:
                decode_rows += [req.row] * seg.length
                decode_lens += range(seg.start + 1, end + 1)
            else:
                prefills.append([req.row, seg.start, seg.length])
            if seg.sample:
                sample_rows += range(len(ids) - 1 - len(seg.draft), len(ids))
            lo, hi = req.input_logprob_positions(seg.start, end)
            if lo < hi:
                score_ranges.append([first_row + lo - seg.start, hi - lo])
                scored.append(Scored(req, lo, hi, labels=False))
            lo, hi = req.vector_positions(seg.start, end)
            if lo < hi and req.vector.pooling == "labels":     # logits: every rank's call
                score_ranges.append([first_row + lo - seg.start, 1])
                scored.append(Scored(req, lo, hi, labels=True))
            elif lo < hi:                                      # hidden rows: rank 0 alone
                pooled.append(Pooled(req, first_row + lo - seg.start, hi - lo, lo))
        plan = StepPlan(ids=ids, positions=positions, out_slots=out_slots,
                        decode_rows=decode_rows, decode_lens=decode_lens, prefills=prefills,
                        table_writes=[], score_ranges=score_ranges, sample_rows=sample_rows,
                        lora_runs=lora_runs)
        return plan, scored, pooled

    @torch.inference_mode()
    def execute(self, plan: StepPlan, req_to_token: torch.Tensor,
                score: Callable[[int, torch.Tensor], None] | None = None,
                embeds: tuple | None = None,
                capture: Callable[[torch.Tensor], None] | None = None
                ) -> torch.Tensor | None:
        """Run a plan: the model over its tokens (the rows in `embeds` taking an image
        encoder's output: CausalLM.forward), handed whole to capture(hidden) on rank 0
        (vector requests pool rows of it: no collective, the rows are whole on every
        rank), then the logits of each score range (handed to score(i, logits) on rank 0)
        and of the sampled rows, returned (None where there are none, and on the
        followers). The same calls in the same order on every rank: each one may be a
        collective."""
        attn = StepAttention.build(self.cache, req_to_token, plan.out_slots, plan.decode_rows,
                                   plan.decode_lens, plan.prefills, self.device,
                                   self.decode_kernel, self.model.attention_layers)
        # The quantized layers' kernel rule counts the step's requests, not its rows
        # (quant_linear.py): a request alone is computed the same way at every length.
        lora = (self.lora.step([tuple(r) for r in plan.lora_runs]) if plan.lora_runs
                else contextlib.nullcontext())
        with step_batch(len(set(plan.decode_rows)) + len(plan.prefills)), lora:
            hidden = self.model(torch.tensor(plan.ids, dtype=torch.int64, device=self.device),
                                torch.tensor(plan.positions, dtype=torch.int64,
                                             device=self.device),
                                attn, embeds)
            if capture is not None:
                capture(hidden)
            for i, (row, n) in enumerate(plan.score_ranges):
                logits = self.model.compute_logits(hidden[row:row + n])
                if score is not None:
                    score(i, logits)
            if not plan.sample_rows:
                return None
            return self.model.compute_logits(hidden[plan.sample_rows])

    def _scorer(self, scored: list[Scored]) -> Callable[[int, torch.Tensor], None]:
        """score(i, logits) for execute: input logprobs of the i-th score range, where row j's
        logits score the prompt token that follows it; or a labels request's label
        logprobs, from its last position's logits."""
        def score(i: int, logits: torch.Tensor) -> None:
            req, lo, hi, labels = scored[i]
            if labels:
                logp = torch.log_softmax(logits[0].float(), dim=-1)
                req.pooled = logp[torch.tensor(req.vector.label_ids, device=logp.device)]
                return
            lp = token_logprobs(logits, req.token_ids(lo + 1, hi + 1),
                                req.logprob.top_logprobs_num)
            req.input_logprobs.extend(lp)
        return score

    def _pooler(self, pooled: list[Pooled]) -> Callable[[torch.Tensor], None]:
        """capture(hidden) for execute: each vector request's rows after the model's final
        norm (what compute_logits applies), handed to Req.pool."""
        def capture(hidden: torch.Tensor) -> None:
            for req, row, n, start in pooled:
                req.pool(self.model.norm(hidden[row:row + n]), start)
        return capture

    def _execute_shared(self, plan: StepPlan, req_to_token: torch.Tensor,
                        scored: list[Scored],
                        embeds: tuple | None = None,
                        capture: Callable[[torch.Tensor], None] | None = None
                        ) -> torch.Tensor | None:
        """Rank 0 under tensor parallelism: broadcast the plan (with the table writes since
        the last one, and the image rows rank 0's encoder made), execute it with the
        followers. A failure inside is a TPFault (fatal); one in rank 0's own scoring or
        pooling is kept until every collective of the step is done, then raised as on one
        rank (it ends the step's requests)."""
        if self.table_log is None:
            raise RuntimeError("tensor-parallel rank 0 runs a step before share_table")
        plan.table_writes = list(self.table_log)
        self.table_log.clear()              # in place: it is the ReqToToken's log too
        plan.lora_loads, self.lora_log = self.lora_log, []
        if embeds is not None:
            plan.embed_rows = embeds[0].tolist()
            plan.embed_values = embeds[1].float().cpu().numpy().tobytes()
            plan.embed_positions = [] if embeds[2] is None else embeds[2].flatten().tolist()
        score_error: list[Exception] = []
        scorer = self._scorer(scored)

        def score(i: int, logits: torch.Tensor) -> None:
            if not score_error:
                try:
                    scorer(i, logits)
                except Exception as e:          # noqa: BLE001 - raised after the step
                    score_error.append(e)

        def pool(hidden: torch.Tensor) -> None:
            try:
                capture(hidden)
            except Exception as e:              # noqa: BLE001 - raised after the step
                score_error.append(e)
        try:
            self.tp.broadcast_bytes(encode(plan))
            logits = self.execute(plan, req_to_token, score, embeds,
                                  None if capture is None else pool)
        except Exception as e:
            raise TPFault(f"tensor-parallel step failed on rank 0: {e!r}") from e
        if score_error:
            raise score_error[0]
        return logits


def plan_embeds(plan: StepPlan, device: torch.device, hidden: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A follower's copy of the image rows rank 0 put in the plan (execute's embeds)."""
    if not plan.embed_rows:
        return None
    values = np.frombuffer(plan.embed_values, dtype=np.float32)
    if values.size != len(plan.embed_rows) * hidden:
        raise ValueError(f"a plan's image rows hold {values.size} values, not "
                         f"{len(plan.embed_rows)} x {hidden}")
    rope = None
    if plan.embed_positions:
        if len(plan.embed_positions) != 3 * len(plan.embed_rows):
            raise ValueError(f"a plan's image rows have {len(plan.embed_positions)} rope "
                             f"positions, not 3 x {len(plan.embed_rows)}")
        rope = torch.tensor(plan.embed_positions, dtype=torch.int64, device=device).view(3, -1)
    return (torch.tensor(plan.embed_rows, dtype=torch.int64, device=device),
            torch.from_numpy(values.reshape(-1, hidden).copy()).to(device), rope)


def _empty_plan(stop: bool = False) -> StepPlan:
    return StepPlan(ids=[], positions=[], out_slots=[], decode_rows=[], decode_lens=[],
                    prefills=[], table_writes=[], score_ranges=[], sample_rows=[], stop=stop)


def sample_with_drafts(logits: torch.Tensor, sampling: list[Segment],
                       eos_ids: list[int]) -> list[int | list[int] | Exception]:
    """forward's answer for a step where some segments carry drafts: their rows are
    verified one request at a time (`verify`: a list of the tokens kept, or the exception
    that stopped it), the other rows sampled together as always."""
    plain_rows, plain_reqs, at = [], [], 0
    for seg in sampling:
        if not seg.draft:
            plain_rows.append(at)
            plain_reqs.append(seg.req)
        at += 1 + len(seg.draft)
    plain = iter(sample_isolated(logits[plain_rows], plain_reqs, eos_ids)
                 if plain_rows else [])
    out: list[int | list[int] | Exception] = []
    at = 0
    for seg in sampling:
        n = 1 + len(seg.draft)
        out.append(verify(logits[at:at + n], seg.req, seg.draft, eos_ids) if seg.draft
                   else next(plain))
        at += n
    return out


def verify(logits: torch.Tensor, req: Req, draft: list[int],
           eos_ids: list[int]) -> list[int] | Exception:
    """The tokens a request's verify rows keep (speculative.py's rule): row i sampled as
    the request's next token after output_ids + draft[:i], up to the first row whose token
    is not its draft, or one that ends the request (a stop token, its grammar complete).
    Its logprobs (of those tokens) go to req.pending_logprobs. A failure is returned, not
    raised (logged): this request's alone, its generator and matcher as they were."""
    state = None if req.generator is None else req.generator.get_state()
    try:
        if _plain_greedy(req):
            ids = sample_tokens(logits, [req] * len(logits), eos_ids)
            kept = ids[:accepted_run(draft, ids) + 1]
            if req.logprob is not None:
                req.pending_logprobs = token_logprobs(logits[:len(kept)], kept,
                                                      req.logprob.top_logprobs_num)
            return kept
        return _verify_rows(logits, req, draft, eos_ids)
    except Exception as e:
        if leaves_device_unknown(e):
            raise
        if state is not None:
            req.generator.set_state(state)
        log.error("verifying the drafts of request %s failed", req.rid, exc_info=e)
        return e


def _plain_greedy(req: Req) -> bool:
    """Every row's token is its argmax, whatever came before it: greedy, no penalty, no
    grammar, no min_new_tokens ban left."""
    s = req.sampling
    return (s.is_greedy and req.grammar is None and not s.logit_bias
            and s.frequency_penalty == 0.0 and s.presence_penalty == 0.0
            and s.repetition_penalty == 1.0 and len(req.output_ids) >= s.min_new_tokens)


def _verify_rows(logits: torch.Tensor, req: Req, draft: list[int],
                 eos_ids: list[int]) -> list[int]:
    """verify, one row at a time: the output ids and the matcher advance over each
    accepted draft for the next row's penalties, bans and mask, and are put back after."""
    stops = req.sampling.stop_ids(eos_ids)
    n_out, consumed, broken = len(req.output_ids), 0, False
    kept: list[int] = []
    logprobs = None
    try:
        for i in range(len(draft) + 1):
            token = _sample(logits[i:i + 1], [req], eos_ids)[0]
            kept.append(token)
            if req.logprob is not None:
                if logprobs is None:
                    logprobs = req.pending_logprobs
                else:
                    logprobs.extend(req.pending_logprobs)
            if i == len(draft) or token != draft[i] or token in stops:
                break
            req.output_ids.append(token)
            if req.grammar is not None:
                if not req.grammar.consume(token):
                    broken = True
                    break
                consumed += 1
                if req.grammar.stopped:
                    break
    finally:
        del req.output_ids[n_out:]
        if req.grammar is not None:
            if broken:
                req.grammar.consumed = -1               # stale: rebuilt by sync
            else:
                req.grammar.rollback(consumed)          # (marks it stale if it cannot)
            req.grammar.sync(req.output_ids)
    req.pending_logprobs = logprobs
    return kept


def sample_isolated(logits: torch.Tensor, reqs: list[Req],
                    eos_ids: list[int]) -> list[int | Exception]:
    """Sample one token per row (with its logprobs, when requested) for the whole batch; if
    that raises, sample each row alone, so one request's failure is only its own. Each
    failure's traceback is logged once."""
    states = [None if r.generator is None else r.generator.get_state() for r in reqs]
    try:
        return _sample(logits, reqs, eos_ids)
    except Exception as e:
        if leaves_device_unknown(e):
            raise
        batch_error = e
    for req, state in zip(reqs, states):      # rewind: a row's draw must not depend on
        if state is not None:                 # how far the failed batch attempt got
            req.generator.set_state(state)
    out: list[int | Exception] = []
    for i, req in enumerate(reqs):
        try:
            out += _sample(logits[i:i + 1], [req], eos_ids)
        except Exception as e:
            if leaves_device_unknown(e):
                raise
            log.error("sampling failed for request %s", req.rid, exc_info=e)
            out.append(e)
    if all(isinstance(t, int) for t in out):
        log.error("sampling the batch failed, but every row alone succeeded",
                  exc_info=batch_error)
    return out


def _sample(logits: torch.Tensor, reqs: list[Req], eos_ids: list[int]) -> list[int]:
    """Constrained rows are masked by their grammars first (sampler.constrain), so their
    tokens and their logprobs come from the masked distribution; each matcher is advanced
    by the scheduler once the step's tokens are final (a row re-sampled alone after a
    failed batch attempt must see the same matcher)."""
    logits = constrain(logits, reqs)
    next_ids = sample_tokens(logits, reqs, eos_ids)
    for i, req in enumerate(reqs):
        if req.logprob is not None:
            req.pending_logprobs = token_logprobs(logits[i:i + 1], [next_ids[i]],
                                                  req.logprob.top_logprobs_num)
    return next_ids
