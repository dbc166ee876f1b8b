"""RequestTiming: the one home for a request's latencies (DESIGN.md section 3).

Every reading comes from this process's monotonic clock. created_at is taken after the body
is normalized and before the request goes to a tokenizer; the first output and the finish
are stamped when the API process receives them, by the dispatcher, not when a handler gets
around to reading them, so a batch item's latency is its own.

Inter-token latency: each output after the first brings n new tokens `gap` seconds after
the previous output; each of those tokens took gap / n (`gaps()` hands the pairs to the
metrics). The mean over the request is (last output - first output) / (tokens after the
first output): what a client reading every streamed token would measure, on average.
"""

from __future__ import annotations

import time


class RequestTiming:
    __slots__ = ("created_at", "first_output_at", "last_output_at", "finished_at",
                 "later_tokens", "last_gap")

    def __init__(self) -> None:
        self.created_at = time.monotonic()
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None
        self.finished_at: float | None = None
        self.later_tokens = 0           # tokens that arrived after the first output
        self.last_gap: tuple[float, int] | None = None  # (seconds, tokens) of the newest output

    def mark_output(self, now: float, terminal: bool, tokens: int = 0) -> None:
        """Stamp an output of `tokens` new tokens received at `now`; the first and the
        terminal are set once."""
        if self.first_output_at is None:
            self.first_output_at = now
            self.last_gap = None
        elif tokens:
            self.last_gap = (now - self.last_output_at, tokens)
            self.later_tokens += tokens
        else:
            self.last_gap = None
        if tokens or self.last_output_at is None:
            self.last_output_at = now
        if terminal and self.finished_at is None:
            self.finished_at = now

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_output_at is None else self.first_output_at - self.created_at

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created_at

    @property
    def mean_inter_token_latency(self) -> float | None:
        """Seconds per token after the first output (None before a second one)."""
        if not self.later_tokens:
            return None
        return (self.last_output_at - self.first_output_at) / self.later_tokens
