"""Every message that crosses a socket, grouped by the process that receives it.

Messages are plain dataclasses whose field annotations the codec checks on the way in, so
only simple annotations are used: int, float, str, bool, list[...], dict[str, ...], nested
message dataclasses and `X | None`.

Invariant kept by the scheduler and relied on downstream: every request the scheduler
accepts produces exactly one terminal output (finish is not None), whatever ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.sampling import SamplingParams


@dataclass(slots=True)
class FinishReason:
    """Why a request ended, in a form that maps 1:1 onto SGLang's meta_info.finish_reason."""

    type: str                           # "length" | "stop" | "abort"
    length: int | None = None           # "length": the max_new_tokens that was reached
    matched_token: int | None = None    # "stop": the EOS / stop token id that matched
    matched_str: str | None = None      # "stop": the stop string that matched
    message: str | None = None          # "abort": a human readable reason
    status_code: int | None = None      # "abort": HTTP status for errors the client caused

    def to_json(self) -> dict:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "stop":
            matched = self.matched_str if self.matched_str is not None else self.matched_token
            return {"type": "stop", "matched": matched}
        out = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


# ---- api -> tokenizer ---------------------------------------------------------------------

@dataclass(slots=True)
class GenerateRequest:
    """One prompt to run, after the API has normalized and validated the HTTP body.
    Exactly one of text / input_ids is set."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    stream: bool = False


# ---- api -> tokenizer -> scheduler ---------------------------------------------------------

@dataclass(slots=True)
class AbortRequest:
    """Abort one request by rid, or every request with abort_all."""

    rid: str
    abort_all: bool = False
    message: str = "Aborted by the client."


@dataclass(slots=True)
class FlushCacheRequest:
    """Drop the prefix cache (only when no request is running). Answered by ControlReply."""

    req_id: str


# ---- tokenizer -> scheduler ----------------------------------------------------------------

@dataclass(slots=True)
class TokenizedRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False


# ---- detokenizer -> scheduler --------------------------------------------------------------

@dataclass(slots=True)
class ReleaseRequest:
    """The detokenizer finished these requests (a stop string matched): free them. The
    scheduler still emits its one terminal output for each, which the detokenizer drops."""

    rids: list[str]


# ---- scheduler -> detokenizer --------------------------------------------------------------

@dataclass(slots=True)
class DecodeParams:
    """How to turn a request's ids into text; sent with the request's first output only."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False


@dataclass(slots=True)
class TokenOutput:
    rid: str
    new_ids: list[int]                  # ids sampled for this rid in this step
    finish: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    queue_time: float | None            # seconds queued before the first forward (scheduler clock)
    decode: DecodeParams | None = None  # set on the rid's first output only


@dataclass(slots=True)
class SchedulerLoad:
    """The scheduler's state after a step; rides along every TokenBatch and TextBatch so the
    API always knows the latest without asking (and an idle server sends nothing)."""

    seq: int = 0                        # increases with every snapshot: newer wins
    running: int = 0
    queued: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_evictable: int = 0
    prompt_tokens_total: int = 0        # counters since start
    generated_tokens_total: int = 0
    retracted_total: int = 0


@dataclass(slots=True)
class TokenBatch:
    """One forward step's outputs: one message per step, not per token."""

    outputs: list[TokenOutput]
    load: SchedulerLoad


# ---- scheduler -> api ------------------------------------------------------------------------

@dataclass(slots=True)
class ControlReply:
    req_id: str
    ok: bool
    message: str
    load: SchedulerLoad


# ---- detokenizer (or tokenizer, for rejects) -> api ----------------------------------------

@dataclass(slots=True)
class TextOutput:
    rid: str
    text: str                           # new text since the previous output of this rid
    new_ids: list[int]                  # new ids since the previous output of this rid
    finish: FinishReason | None
    prompt_tokens: int = 0
    completion_tokens: int = 0          # cumulative; counts a matched EOS / stop token
    cached_tokens: int = 0
    queue_time: float | None = None


@dataclass(slots=True)
class TextBatch:
    outputs: list[TextOutput]
    load: SchedulerLoad | None = None   # None on tokenizer rejects
