"""Req: the scheduler's view of one request, from arrival to its terminal output."""

from __future__ import annotations

import time

import torch

from wire.messages import DecodeParams, FinishReason, TokenizedRequest
from wire.sampling import SamplingParams


class Req:
    """State derived from lists rather than kept in counters: the KV of positions
    0..num_computed-1 lives in `slots`, so num_computed is len(slots)."""

    __slots__ = ("rid", "input_ids", "sampling", "stream", "output_ids", "slots", "row",
                 "prefix_node", "prefix_len", "cached_tokens", "arrived_at", "queue_time",
                 "finish", "announced", "generator")

    def __init__(self, msg: TokenizedRequest):
        self.rid = msg.rid
        self.input_ids: list[int] = msg.input_ids
        self.sampling: SamplingParams = msg.sampling
        self.stream = msg.stream
        self.output_ids: list[int] = []
        self.slots: list[int] = []          # KV slot of each computed position
        self.row: int | None = None          # row in the request-to-token table while admitted
        self.prefix_node = None              # radix node locked for the cached prefix
        self.prefix_len = 0                  # slots[:prefix_len] are the radix tree's
        self.cached_tokens: int | None = None  # prompt tokens served from the cache (1st admit)
        self.arrived_at = time.monotonic()
        self.queue_time: float | None = None
        self.finish: FinishReason | None = None
        self.announced = False               # has the detokenizer seen DecodeParams yet
        seed = msg.sampling.sampling_seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return len(self.slots)

    @property
    def max_total_tokens(self) -> int:
        """KV slots this request needs if it runs to max_new_tokens (the last sampled token's
        KV is never computed)."""
        return len(self.input_ids) + max(self.sampling.max_new_tokens - 1, 0)

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        return (self.input_ids[start:] if start < n else []) + \
            self.output_ids[max(start - n, 0):end - n]

    def decode_params(self) -> DecodeParams:
        s = self.sampling
        return DecodeParams(skip_special_tokens=s.skip_special_tokens,
                            spaces_between_special_tokens=s.spaces_between_special_tokens,
                            stop=list(s.stop), no_stop_trim=s.no_stop_trim)
