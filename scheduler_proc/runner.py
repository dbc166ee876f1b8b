"""ModelRunner: owns the model weights, the KV buffers (pool.KVCache, `pool_size` slots) and
one forward step. Which slots and table rows a request uses is the scheduler's KVManager's
business (kv_manager.py); the runner only reads them.

`forward(segments, req_to_token)` takes the step's segments (which request, which positions)
and the request-to-token table, runs one model call over the whole ragged batch, computes
logits only for the rows that sample, and returns one sampled token id per sampling
segment. It never decides what to run.

Faults: an exception from the model call propagates (the scheduler ends the step's
requests). Sampling is isolated per request: if sampling the batch raises, each row is
sampled again alone (seeded generators rewound first), and a row that fails alone gets the
exception in place of its token. A CUDA error other than out-of-memory is sticky (the
context, weights and KV included, can no longer be trusted), so `leaves_device_unknown`
marks it for the scheduler to take the process down.

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

import logging
import os
from dataclasses import dataclass

import psutil
import torch

from scheduler_proc.attention import StepAttention, decode_kernel_fits
from scheduler_proc.models import ModelConfig, load_model
from scheduler_proc.pool import KVCache
from scheduler_proc.request import Req
from scheduler_proc.sampler import sample_tokens, token_logprobs
from wire.server_args import ServerArgs, ServerConfig

log = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.1    # of total RAM, for the default --max-total-tokens on CPU
ONEDNN_CACHE_CAPACITY = 128     # oneDNN kernels kept per cache (module docstring); >= 1:
                                # ideep crashes with LRU_CACHE_CAPACITY=0
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass(slots=True)
class Segment:
    """`length` tokens of `req`, from position req.num_computed (before this step's slots
    were added: `start`). `sample` is true when the segment ends at the request's newest
    token, so its last row is sampled."""

    req: Req
    start: int
    length: int
    sample: bool


def leaves_device_unknown(exc: BaseException) -> bool:
    """True for errors after which the model state cannot be trusted: a CUDA error other
    than out-of-memory poisons the whole context."""
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
    def __init__(self, resolved: ServerConfig):
        """Settings from the resolved record (wire/server_args.py); only the KV pool size is
        worked out here when --max-total-tokens is not given: it depends on the memory left
        once the weights are loaded."""
        args = resolved.args
        bound_onednn_caches()
        self.device = torch.device(args.device)
        self.dtype: torch.dtype = getattr(torch, resolved.dtype)
        self.config = ModelConfig.from_dir(resolved.model_path)
        self.context_len = resolved.context_length
        self.model = load_model(resolved.model_path, self.dtype, self.device)
        self.eos_ids = list(self.config.eos_token_ids)
        c = self.config
        self.pool_size = args.max_total_tokens or self._default_pool_size(args)
        self.cache = KVCache(c.num_layers, self.pool_size, c.num_kv_heads, c.head_dim,
                             self.dtype, self.device)
        self.decode_kernel = decode_kernel_fits(self.device, self.dtype, c.num_heads,
                                                c.num_kv_heads, c.head_dim)
        torch.manual_seed(args.random_seed)
        log.info("model %s (%s) on %s/%s, KV pool %d tokens, decode attention on %s",
                 resolved.model_path, c.architecture, self.device, self.dtype, self.pool_size,
                 "zserve's CPU kernel" if self.decode_kernel else "SDPA")

    def _default_pool_size(self, args: ServerArgs) -> int:
        c = self.config
        per_token = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                            self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * args.mem_fraction_static)
        else:
            budget = int(psutil.virtual_memory().total * CPU_KV_MEMORY_FRACTION)
        # Never more than every running request at full context could use.
        return max(1, min(budget // per_token, args.max_running_requests * self.context_len))

    @torch.inference_mode()
    def forward(self, segments: list[Segment],
                req_to_token: torch.Tensor) -> list[int | Exception]:
        """Run one step and return one sampled id per sampling segment, in segment order,
        or the exception that stopped that row's sampling (see the module docstring).
        Decode segments (length 1) must come first; slots for this step's tokens must
        already be in each req.slots and in row req.row of `req_to_token` (KVManager's
        request table, on the runner's device). Logprobs, when requested, are appended to
        req.pending_logprobs / req.input_logprobs."""
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        decode_rows, decode_lens, prefills = [], [], []
        sample_rows: list[int] = []
        scored: list[tuple[Req, int, int, int]] = []   # (req, first row, positions lo, hi)
        for seg in segments:
            req, end = seg.req, seg.start + seg.length
            first_row = len(ids)
            ids += req.token_ids(seg.start, end)
            positions += range(seg.start, end)
            out_slots += req.slots[seg.start:end]
            if seg.length == 1:
                decode_rows.append(req.row)
                decode_lens.append(end)
            else:
                prefills.append((req.row, seg.start, seg.length))
            if seg.sample:
                sample_rows.append(len(ids) - 1)
            lo, hi = req.input_logprob_positions(seg.start, end)
            if lo < hi:
                scored.append((req, first_row + lo - seg.start, lo, hi))
        attn = StepAttention.build(self.cache, req_to_token, out_slots, decode_rows,
                                   decode_lens, prefills, self.device, self.decode_kernel)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device),
                            torch.tensor(positions, dtype=torch.int64, device=self.device),
                            attn)
        for req, row, lo, hi in scored:
            self._score_prompt(req, hidden[row:row + hi - lo], req.token_ids(lo + 1, hi + 1))
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[sample_rows])
        return sample_isolated(logits, [s.req for s in segments if s.sample], self.eos_ids)

    def _score_prompt(self, req: Req, hidden: torch.Tensor, targets: list[int]) -> None:
        """Input logprobs: row j's logits score the prompt token that follows it."""
        lp = token_logprobs(self.model.compute_logits(hidden), targets,
                            req.logprob.top_logprobs_num)
        req.input_logprobs.extend(lp)


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
    next_ids = sample_tokens(logits, reqs, eos_ids)
    for i, req in enumerate(reqs):
        if req.logprob is not None:
            req.pending_logprobs = token_logprobs(logits[i:i + 1], [next_ids[i]],
                                                  req.logprob.top_logprobs_num)
    return next_ids
