"""RequestTiming: the one home for a request's latencies (DESIGN.md section 3).

Every reading comes from this process's monotonic clock. created_at is taken after the body
is normalized and before the request goes to a tokenizer; the first output and the finish
are stamped when the API process receives them, by the dispatcher, not when a handler gets
around to reading them, so a batch item's latency is its own.
"""

from __future__ import annotations

import time


class RequestTiming:
    __slots__ = ("created_at", "first_output_at", "finished_at")

    def __init__(self) -> None:
        self.created_at = time.monotonic()
        self.first_output_at: float | None = None
        self.finished_at: float | None = None

    def mark_output(self, now: float, terminal: bool) -> None:
        """Stamp an output received at `now`; the first and the terminal are set once."""
        if self.first_output_at is None:
            self.first_output_at = now
        if terminal and self.finished_at is None:
            self.finished_at = now

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_output_at is None else self.first_output_at - self.created_at

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.created_at
