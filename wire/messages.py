"""Every message that crosses a socket, grouped by the process that receives it, and the
union of messages each process's inbox accepts.

Messages are WireStructs (wire/schema.py: msgspec Structs sent as arrays of their field
values); the codec checks every value against the field annotations on the way in, so only
simple annotations are used: int, float, str, bool, list[...], dict[str, ...], nested wire
types and `X | None`. A message's integer `tag` is part of the protocol: append, never
renumber.

Invariant kept by the scheduler and relied on downstream: every request the scheduler
accepts produces exactly one terminal output (finish is not None), whatever ends it.
"""

from __future__ import annotations

import json

import msgspec

from wire.sampling import SamplingParams
from wire.schema import WireStruct, field

replace = msgspec.structs.replace   # copy a message with some fields changed (one spelling)


class FinishReason(WireStruct):
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


class ContentPart(WireStruct):
    """One part of a message whose content mixes text and images: type "text" (with its
    text) or "image" (the request's next image, GenerateRequest.image_data, in order)."""

    type: str
    text: str = ""

    def to_template(self) -> dict:
        """As transformers passes parts to chat templates."""
        return {"type": "image"} if self.type == "image" else {"type": "text",
                                                                 "text": self.text}


class ChatMessage(WireStruct):
    role: str
    content: str
    # OpenAI's tool-call history, for the chat template: an assistant message's calls as
    # JSON text (a list of {"id", "type", "function": {"name", "arguments"}}), and a tool
    # message's tool_call_id.
    tool_calls_json: str | None = None
    tool_call_id: str | None = None
    # Content with images: the parts in order (content is then their text joined).
    parts: list[ContentPart] | None = None

    def to_template(self) -> dict:
        """The message as chat templates read it (tool_calls parsed; None fields left out;
        a message with images as a list of parts)."""
        content = self.content if self.parts is None else [p.to_template()
                                                          for p in self.parts]
        out = {"role": self.role, "content": content}
        if self.tool_calls_json is not None:
            out["tool_calls"] = json.loads(self.tool_calls_json)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


MAX_TOP_LOGPROBS = 20   # per position, on every route (vLLM's default max_logprobs)
MAX_PRIORITY = 2**31 - 1  # a request's priority is an int in [-MAX_PRIORITY, MAX_PRIORITY]


class LogprobRequest(WireStruct):
    """What logprobs a request wants (SGLang's return_logprob / top_logprobs_num /
    logprob_start_len). start_len -1: no input logprobs."""

    top_logprobs_num: int = 0
    start_len: int = -1


class Logprobs(WireStruct):
    """Logprobs of a run of positions: one entry per token. The scheduler fills ids and
    values; the detokenizer adds the token texts."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)   # None: the first prompt token
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    top_texts: list[list[str]] = field(default_factory=list)

    def head(self, n: int) -> "Logprobs":
        """The first n positions (self when it has no more; texts not kept)."""
        if n >= len(self.token_ids):
            return self
        return Logprobs(self.token_ids[:n], self.logprobs[:n], self.top_ids[:n],
                        self.top_logprobs[:n])

    def extend(self, other: "Logprobs") -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs
        self.texts += other.texts
        self.top_texts += other.top_texts


POOLING_MODES = ("last", "mean", "cls")     # how an embedding pools the prompt's hidden states
MAX_LABEL_IDS = 1024                         # label tokens one score request may ask for


class VectorRequest(WireStruct):
    """A prefill-only request (max_new_tokens 0) whose answer is one float32 vector read off
    its prompt instead of tokens (TokenOutput.vector, on its terminal output):
    - pooling "last" | "mean" | "cls": an embedding, the prompt's final hidden states (after
      the model's final norm) at its last position, averaged over every position, or at
      position 0; L2-normalized;
    - pooling "labels": a score, the log-probabilities of `label_ids` (in that order) as the
      token that follows the prompt (the full vocabulary's log-softmax at its last position).
    """

    pooling: str
    label_ids: list[int] = field(default_factory=list)

    def problem(self, vocab_size: int) -> str | None:
        """Why this cannot run on a model with this vocabulary (a client-facing message), or
        None. Every process that receives one asks."""
        if self.pooling == "labels":
            if not 1 <= len(self.label_ids) <= MAX_LABEL_IDS:
                return (f"label_token_ids must hold 1 to {MAX_LABEL_IDS} token ids, got "
                        f"{len(self.label_ids)}.")
            bad = next((t for t in self.label_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                return (f"Label token id {bad} is outside the vocabulary [0, {vocab_size}).")
            return None
        if self.pooling not in POOLING_MODES:
            return (f"pooling must be one of {', '.join(POOLING_MODES)} or labels, got "
                    f"{self.pooling!r}.")
        if self.label_ids:
            return "label_ids are for pooling labels only."
        return None


# ---- api -> tokenizer ---------------------------------------------------------------------

# chat_template_kwargs may not set these: the template's own variables
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class GenerateRequest(WireStruct, tag=1):
    """One prompt to run, after the API has normalized and validated the HTTP body.
    Exactly one of text / input_ids / messages is set (messages: the tokenizer applies the
    chat template)."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    stream: bool = False
    messages: list[ChatMessage] | None = None
    logprob: LogprobRequest | None = None
    fit_context: bool = False   # lower max_new_tokens to what the context leaves (chat default)
    api: int = 0                # the API process that owns it (--api-server-count): its
                                # outputs go to that process's inbox
    # messages only: what else the chat template renders, as JSON text {"tools": [...] or
    # null, "kwargs": {...}} (OpenAI tools; chat_template_kwargs, e.g. enable_thinking)
    template_json: str | None = None
    # The prompt's images, in the order of its placeholders: each as the client gave it
    # (base64, a data: URI, a path or a URL); the tokenizer loads and checks them.
    image_data: list[str] | None = None
    vector: VectorRequest | None = None     # an embedding or a score, not tokens
    priority: int = 0           # --enable-priority-scheduling: the queue's order (|p| < 2^31)
    lora: str | None = None     # --enable-lora: the adapter's name; None: the base model


# ---- api -> tokenizer -> scheduler ---------------------------------------------------------

class AbortRequest(WireStruct, tag=2):
    """Abort one request by rid, or every request with abort_all."""

    rid: str
    abort_all: bool = False
    message: str = "Aborted by the client."


class FlushCacheRequest(WireStruct, tag=7):
    """Drop the prefix cache (only when no request is running). Answered by ControlReply."""

    req_id: str
    api: int = 0                # where the ControlReply goes


MAX_LORA_NAME = 256             # an adapter's name, in characters


class LoraRequest(WireStruct, tag=18):
    """Load (op "load": `name` from `path`) or unload (op "unload") a LoRA adapter
    (--enable-lora; /load_lora_adapter, /unload_lora_adapter). Answered by ControlReply once
    done: an unload only when the requests using the adapter have ended."""

    req_id: str
    op: str
    name: str
    path: str = ""
    api: int = 0                # where the ControlReply goes


# ---- tokenizer -> scheduler ----------------------------------------------------------------

class ImageFeatures(WireStruct):
    """One image of a prompt, preprocessed for the model's vision encoder (media/): its
    pixels as raw bytes of `dtype` in `shape` (C order; no pickle), the family's extra
    geometry (Qwen2-VL's grid [t, h, w]; else empty), and where it sits in the prompt:
    positions offset..offset+length-1 are the image's expansion, and those of them that
    hold the model's image token take the encoder's output rows, in order.
    `hash`: hex digest of the pixels and geometry, the image's identity for the
    embedding cache and the prefix cache."""

    hash: str
    offset: int
    length: int
    pixels: bytes
    shape: list[int]
    dtype: str = "float32"
    grid: list[int] = field(default_factory=list)


class TokenizedRequest(WireStruct, tag=3):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    logprob: LogprobRequest | None = None
    fit_context: bool = False   # max_new_tokens was a default: the scheduler may lower it to
                                # what the KV pool can hold (chat without max_tokens)
    api: int = 0                # GenerateRequest.api, carried on
    images: list[ImageFeatures] | None = None   # in prompt order; None: a text prompt
    vector: VectorRequest | None = None         # GenerateRequest.vector, carried on
    priority: int = 0                           # GenerateRequest.priority, carried on
    lora: str | None = None                     # GenerateRequest.lora, carried on


# ---- detokenizer -> scheduler --------------------------------------------------------------

class ReleaseRequest(WireStruct, tag=4):
    """The detokenizer finished these requests (a stop string matched): free them. The
    scheduler still emits its one terminal output for each, which the detokenizer drops."""

    rids: list[str]


# ---- scheduler -> detokenizer --------------------------------------------------------------

class DecodeParams(WireStruct):
    """How to turn a request's ids into text; sent with the request's first output only."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    api: int = 0                        # the API process the rid's outputs go to


def accept_length(accepted: int, verify_steps: int) -> float | None:
    """Tokens a verify step made on average: the drafts it kept and its own (SGLang's
    spec_accept_length); None before any verify step."""
    return (accepted + verify_steps) / verify_steps if verify_steps else None


class SpecStats(WireStruct):
    """A request's speculative decoding so far (scheduler_proc/speculative.py), on each of
    its outputs where the server speculates: verify steps (steps in which its rows carried
    drafts), draft tokens verified, and how many of them were kept."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class TokenOutput(WireStruct):
    rid: str
    new_ids: list[int]                  # ids sampled for this rid in this step
    finish: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    queue_time: float | None            # seconds queued before the first forward (scheduler clock)
    decode: DecodeParams | None = None  # set on the rid's first output only
    logprobs: Logprobs | None = None    # of new_ids, when requested
    input_logprobs: Logprobs | None = None   # of the prompt from start_len, first output only
    # On the terminal output (scheduler clock, seconds): from the first forward to the
    # first token sampled, and from there to the end (None where there was no such span).
    prefill_time: float | None = None
    decode_time: float | None = None
    # A VectorRequest's answer, on its terminal output: float32 values, little-endian.
    vector: bytes | None = None
    spec: SpecStats | None = None       # so far, where the server speculates


class SchedulerLoad(WireStruct):
    """The scheduler's state after a step; rides along every TokenBatch and TextBatch so the
    API always knows the latest without asking (and an idle server sends nothing)."""

    seq: int = 0                        # increases with every snapshot of one replica
    replica: int = 0                    # which scheduler replica (--dp-size) this is
    running: int = 0
    queued: int = 0
    kv_total: int = 0
    kv_free: int = 0
    kv_evictable: int = 0
    prompt_tokens_total: int = 0        # counters since start
    generated_tokens_total: int = 0
    retracted_total: int = 0
    preempted_total: int = 0            # of those, retracted for a higher priority
    rejected_total: int = 0             # forged or invalid requests the scheduler refused
    requests_total: int = 0             # requests accepted since start
    cached_tokens_total: int = 0        # prompt tokens found in the prefix cache, since start
    queued_tokens: int = 0              # tokens of the queued requests (counted only for a
                                        # --load-balance-method shortest_queue controller)
    running_tokens: int = 0             # the same of the running ones
    # Speculative decoding, since start (empty where the server does not speculate):
    # spec_accept_hist[m] = verify steps that kept m tokens (m - 1 drafts and the token
    # after them), m = 1 .. --speculative-num-draft-tokens + 1 (index 0 unused).
    spec_draft_total: int = 0
    spec_accept_hist: list[int] = field(default_factory=list)
    # --enable-lora: the adapters loaded (and not being unloaded), in load order.
    lora_adapters: list[str] = field(default_factory=list)

    @property
    def spec_verify_total(self) -> int:
        return sum(self.spec_accept_hist)

    @property
    def spec_accepted_total(self) -> int:
        return sum((m - 1) * n for m, n in enumerate(self.spec_accept_hist) if m)

    @property
    def spec_accept_length(self) -> float | None:
        return accept_length(self.spec_accepted_total, self.spec_verify_total)

    @property
    def kv_used(self) -> int:
        """KV slots held by requests: neither free nor an evictable cached prefix."""
        return self.kv_total - self.kv_free - self.kv_evictable


class TokenBatch(WireStruct, tag=5):
    """One forward step's outputs: one message per step, not per token."""

    outputs: list[TokenOutput]
    load: SchedulerLoad


# ---- scheduler -> api ------------------------------------------------------------------------

class ControlReply(WireStruct, tag=8):
    """The answer to a FlushCacheRequest or a LoraRequest: from the scheduler, or with --dp-size > 1 from the
    data-parallel controller, which joins its replicas' answers (one load each)."""

    req_id: str
    ok: bool
    message: str
    loads: list[SchedulerLoad]
    api: int = 0


# ---- tp rank 0 -> tp followers ---------------------------------------------------------------
# Not a ZeroMQ socket: rank 0 broadcasts these frames to the other tensor-parallel ranks of
# its replica through torch.distributed (models/distributed.py broadcast_bytes). Only rank 0
# runs the scheduler; a follower needs only what its forward reads (scheduler_proc/runner.py).

class TableWrite(WireStruct):
    """Request-table entries rank 0 wrote: table[row, start:start + len(slots)] = slots."""

    row: int
    start: int
    slots: list[int]


class TPInit(WireStruct, tag=13):
    """Once, before the replica reports ready: the agreed KV pool size (the smallest any
    rank can hold) and the shape of the request table the followers mirror."""

    pool_size: int
    table_rows: int
    table_cols: int


class LoraLoad(WireStruct):
    """An adapter rank 0 loaded into `slot` since the previous plan, as its files were read
    (models/lora.py AdapterFiles: every rank parses the same bytes); kind "": unloaded."""

    slot: int
    kind: str = ""
    config: str = ""
    data: bytes = b""


class StepPlan(WireStruct, tag=14):
    """One forward step, as every rank executes it. The step's tokens are [decode rows...,
    prefill segments...]; `prefills` holds (table row, start, length) per segment;
    `score_ranges` (first token row, count) per input-logprob logits call, in order, then
    one logits call for `sample_rows` unless it is empty. `stop`: leave the follower loop.
    `embed_rows` / `embed_values`: image rows, as CausalLM.forward's `embeds`."""

    ids: list[int]
    positions: list[int]
    out_slots: list[int]
    decode_rows: list[int]
    decode_lens: list[int]
    prefills: list[list[int]]
    table_writes: list[TableWrite]
    score_ranges: list[list[int]]
    sample_rows: list[int]
    stop: bool = False
    # Rows whose inputs are an image encoder's output (rank 0 runs the encoder:
    # scheduler_proc/images.py), and those inputs as float32 bytes, [rows, hidden].
    embed_rows: list[int] = field(default_factory=list)
    embed_values: bytes = b""
    embed_positions: list[int] = field(default_factory=list)   # multimodal RoPE: [3, rows]
    # LoRA (models/lora.py): [slot, lo, hi] per run of rows using adapter `slot`; and the
    # adapters rank 0 loaded or unloaded since the last plan, which a follower applies, in
    # order, before executing.
    lora_runs: list[list[int]] = field(default_factory=list)
    lora_loads: list[LoraLoad] = field(default_factory=list)


# ---- scheduler replica -> data-parallel controller (--dp-size > 1) --------------------------

class ReplicaStatus(WireStruct, tag=9):
    """A replica's load after each step it sends outputs for: the controller's view for
    --load-balance-method shortest_queue. `received`: TokenizedRequests the replica has
    taken from its inbox since start, so the controller knows which of the requests it
    sent are already counted in `load`."""

    load: SchedulerLoad
    received: int


# ---- detokenizer (or tokenizer, for rejects) -> api ----------------------------------------

class TextOutput(WireStruct):
    rid: str
    text: str                           # new text since the previous output of this rid
    new_ids: list[int]                  # new ids since the previous output of this rid
    finish: FinishReason | None
    prompt_tokens: int = 0
    completion_tokens: int = 0          # cumulative; counts a matched EOS / stop token
    cached_tokens: int = 0
    queue_time: float | None = None
    logprobs: Logprobs | None = None
    input_logprobs: Logprobs | None = None
    prefill_time: float | None = None   # TokenOutput's, on the terminal output
    decode_time: float | None = None
    vector: bytes | None = None         # TokenOutput's, on the terminal output
    spec: SpecStats | None = None       # TokenOutput's


class TextBatch(WireStruct, tag=6):
    outputs: list[TextOutput]
    load: SchedulerLoad | None = None   # None on tokenizer rejects


# ---- api process -> api process (--api-server-count > 1) ------------------------------------

class PeerAbort(WireStruct, tag=10):
    """/abort_request reached API process `from_api`: abort the requests of this process
    whose user rid is `rid` (or starts with it, `prefix`), and answer with a PeerAbortReply.
    Access rights were checked by the process that received the HTTP request."""

    req_id: str
    from_api: int
    rid: str
    prefix: bool
    message: str


class PeerAbortReply(WireStruct, tag=11):
    req_id: str
    count: int                          # requests this process aborted


# ---- launcher -> api process k > 0 ----------------------------------------------------------

class ApiControl(WireStruct, tag=12):
    """kind "lost": a child process died, the server is going down: fail every request with
    `message` (503) and answer /health with 503. kind "drain": graceful shutdown (stop
    accepting, let requests finish for --shutdown-timeout seconds, then exit 0)."""

    kind: str
    message: str = ""


# ---- node r's launcher <-> node 0's launcher (--nnodes > 1): the node link ------------------
# Not ZeroMQ: one TCP connection per node, frames with a length prefix (wire/node_link.py).

class NodeHello(WireStruct, tag=15):
    """Node r's first frame: what both nodes must agree on to run one model together."""

    node_rank: int
    nnodes: int
    tp_size: int
    dtype: str
    context_length: int
    model: str                          # the model's facts: architecture, size, vocabulary
    version: str
    fingerprint: str = ""               # wire.model_path.model_fingerprint
    device: str = ""                    # --device (gloo ranks cannot meet NCCL ones)


class NodeReply(WireStruct, tag=16):
    """Node 0's answer to a NodeHello: ok, or why not (the two nodes' settings differ)."""

    ok: bool
    message: str


class NodeBye(WireStruct, tag=17):
    """Node 0 is going down: stop your ranks and exit with `exit_code` (0: a shutdown on
    purpose; 1: a process of node 0 died). A link that closes without this means node 0's
    launcher itself died: exit 1."""

    reason: str
    exit_code: int = 0


# ---- who receives what ------------------------------------------------------------------------
# One union per inbox (the PULL socket its process binds). Each process decodes with its
# inbox's decoder (wire/codec.py), so a message sent to the wrong process is a DecodeError.

TokenizerInbox = (GenerateRequest | AbortRequest | FlushCacheRequest                # from the API
                  | LoraRequest)
SchedulerInbox = (TokenizedRequest | AbortRequest | FlushCacheRequest               # tokenizer
                  | LoraRequest | ReleaseRequest)                                   # detokenizer
DpControllerInbox = (SchedulerInbox                              # in the scheduler's place
                     | ReplicaStatus | ControlReply)             # from the replicas
NodeLinkInbox = NodeHello | NodeReply | NodeBye             # launchers, over the node link
DetokenizerInbox = TokenBatch                                                       # scheduler
ApiInbox = (TextBatch | ControlReply      # detokenizer and tokenizer (rejects); scheduler
            | PeerAbort | PeerAbortReply | ApiControl)      # other API processes; launcher
TpFollowerInbox = TPInit | StepPlan     # tp rank 0, by torch.distributed broadcast (not a socket)

Message = (GenerateRequest | AbortRequest | TokenizedRequest | ReleaseRequest | TokenBatch
           | TextBatch | FlushCacheRequest | ControlReply | ReplicaStatus
           | PeerAbort | PeerAbortReply | ApiControl | NodeHello | NodeReply | NodeBye
           | TPInit | StepPlan | LoraRequest)                                   # every tag
