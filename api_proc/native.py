"""SGLang's native POST /generate: body normalization and the four response forms.

The body is validated here, at the boundary; everything after trusts it. A body becomes a
list of GenerateRequests in output order (prompt-major when n > 1).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api_proc.boundary import BadRequest, JSONResponse, error_response, read_json
from api_proc.pipeline import Pipeline, Prompt, expand, priority_of, settle
from api_proc.state import Dispatcher, RequestState, SubmitError
from api_proc.streaming import DONE, KEEPALIVE, SSEResponse, changes, sse
from wire.messages import MAX_LORA_NAME, MAX_TOP_LOGPROBS, GenerateRequest, LogprobRequest
from wire.sampling import SamplingParams

LOGPROB_KEYS = ("return_logprob", "top_logprobs_num", "logprob_start_len",
                "return_text_in_logprobs")
KNOWN_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream", "image_data",
              "priority", "lora_path", *LOGPROB_KEYS}

# The rest of SGLang's GenerateReqInput. Its clients send many of these on every request
# (bench_serving: lora_path, return_routed_experts; the router: model, log_metrics, no_logs,
# background, return_bytes, return_entropy, return_hidden_states, ...).
# Bookkeeping that does not change the output: any value is accepted and ignored.
SGLANG_IGNORED = frozenset({
    "model", "log_metrics", "no_logs", "custom_labels", "conversation_id", "routing_key",
    "received_time", "external_trace_header", "session_id"})
# Features zserve does not have: accepted at their default (or null), else a 400.
SGLANG_DEFAULTS: dict[str, Any] = {
    "input_embeds": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "token_ids_logprob": None, "return_sampling_mask": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None,
    "session_params": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "extra_key": None, "cache_salt": None,
    "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None,
    "multi_item_delimiter_indices": None,
}


def _is_default(value: Any, default: Any) -> bool:
    """null, the default, or (batch form) a list of those."""
    if value is None or (value == default and type(value) is type(default)):
        return True
    return isinstance(value, list) and all(_is_default(v, default) for v in value)


def _check_fields(body: dict) -> None:
    unknown = sorted(k for k in body
                     if k not in KNOWN_KEYS and k not in SGLANG_IGNORED
                     and k not in SGLANG_DEFAULTS)
    if unknown:
        raise BadRequest(f"Unknown field(s) in the request: {', '.join(unknown)}.")
    unsupported = sorted(k for k, default in SGLANG_DEFAULTS.items()
                         if k in body and not _is_default(body[k], default))
    if unsupported:
        raise BadRequest(f"Field(s) not supported by zserve: {', '.join(unsupported)} "
                         f"(only null or the default value is accepted).")


@dataclass(slots=True)
class ParsedGenerate:
    requests: list[GenerateRequest]
    is_batch: bool          # the response is an array (or frames carry "index")
    stream: bool
    text_in_logprobs: bool = False
    # n > 1: one prefill-only request per such prompt, run first so the n samples share
    # the prompt's KV through the prefix cache instead of computing it n times.
    warmups: list[GenerateRequest] = field(default_factory=list)


def _is_int(x: Any) -> bool:
    return type(x) is int


def _prompts(body: dict) -> tuple[list[str] | list[list[int]], bool, str]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [text], False, "text"
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return text, True, "text"
        raise BadRequest("text must be a string or a non-empty list of strings.")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return [ids], False, "input_ids"
    if (isinstance(ids, list) and ids and all(isinstance(p, list) and p and
                                              all(_is_int(t) for t in p) for p in ids)):
        return ids, True, "input_ids"
    raise BadRequest("input_ids must be a non-empty list of integers or a non-empty list of "
                     "such lists.")


def _sampling(body: dict, num: int, is_batch: bool) -> list[SamplingParams]:
    raw = body.get("sampling_params")
    try:
        if isinstance(raw, list):
            if not is_batch or len(raw) != num:
                raise BadRequest(f"sampling_params is a list of {len(raw)} but there are "
                                 f"{num} prompts.")
            return [SamplingParams.from_json(p) for p in raw]
        return [SamplingParams.from_json(raw)] * num
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _rids(body: dict, num: int, ns: list[int], is_batch: bool) -> list[str]:
    """One rid per output, prompt-major. A user rid on a batch or with n > 1 gets `_i`."""
    rid = body.get("rid")
    total = sum(ns)
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str):
        if total == 1 and not is_batch:
            return [rid]
        return [f"{rid}_{i}" for i in range(total)]
    if isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) for r in rid):
        return [r if n == 1 else f"{r}_{j}" for r, n in zip(rid, ns) for j in range(n)]
    raise BadRequest("rid must be a string or a list of strings, one per prompt.")


def _image_list(value: Any, where: str) -> list[str] | None:
    """One prompt's images: null, one image, or a list of them (each a string)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value) or None
    raise BadRequest(f"{where} must be an image (a base64 string, a data: URI, a file path "
                     f"or a URL), a list of images, or null.")


def _images(body: dict, num: int, is_batch: bool) -> list[list[str] | None]:
    """image_data, one entry per prompt: for one prompt an image or a list of its images;
    for a batch a list with one entry (an image, a list of images, or null) per prompt."""
    raw = body.get("image_data")
    if raw is None:
        return [None] * num
    if not is_batch:
        return [_image_list(raw, "image_data")]
    if not isinstance(raw, list) or len(raw) != num:
        raise BadRequest(f"image_data must be a list with one entry per prompt ({num}).")
    return [_image_list(v, f"image_data[{i}]") for i, v in enumerate(raw)]


def _adapters(body: dict, num: int, is_batch: bool) -> list[str | None]:
    """lora_path (SGLang's): one prompt's LoRA adapter by name, or null (the base model);
    for a batch one name for all, or a list with one name or null per prompt. The
    scheduler refuses names that are not loaded (404)."""
    raw = body.get("lora_path")

    def name(v: Any, where: str) -> str | None:
        if v is None or (isinstance(v, str) and 0 < len(v) <= MAX_LORA_NAME):
            return v
        raise BadRequest(f"{where} must be a LoRA adapter's name (a non-empty string of at "
                         f"most {MAX_LORA_NAME} characters) or null.")
    if isinstance(raw, list) and is_batch:
        if len(raw) != num:
            raise BadRequest(f"lora_path must be one name, or a list with one entry per "
                             f"prompt ({num}).")
        return [name(v, f"lora_path[{i}]") for i, v in enumerate(raw)]
    return [name(raw, "lora_path")] * num


def parse_generate(body: Any) -> ParsedGenerate:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    _check_fields(body)
    logprob, text_in_logprobs = _logprob(body)
    prompts, is_batch, kind = _prompts(body)
    params = _sampling(body, len(prompts), is_batch)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean.")
    rids = _rids(body, len(prompts), [p.n for p in params], is_batch)
    images = _images(body, len(prompts), is_batch)
    try:
        priority = priority_of(body)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    reqs, warmups = expand([Prompt(text=p, image_data=im) if kind == "text"
                            else Prompt(input_ids=p, image_data=im)
                            for p, im in zip(prompts, images)], params, rids, stream=stream,
                           logprob=logprob, priority=priority,
                           lora=_adapters(body, len(prompts), is_batch))
    return ParsedGenerate(reqs, is_batch or len(reqs) > 1, stream, text_in_logprobs, warmups)


def _logprob(body: dict) -> tuple[LogprobRequest | None, bool]:
    def get(key, default):
        value = body.get(key)
        return default if value is None else value
    want, text = get("return_logprob", False), get("return_text_in_logprobs", False)
    top, start = get("top_logprobs_num", 0), get("logprob_start_len", -1)
    for key, value in (("return_logprob", want), ("return_text_in_logprobs", text)):
        if not isinstance(value, bool):
            raise BadRequest(f"{key} must be a boolean, got {value!r}.")
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                         f"got {top!r}.")
    if not _is_int(start) or start < -1:
        raise BadRequest(f"logprob_start_len must be an integer >= -1, got {start!r}.")
    return (LogprobRequest(top_logprobs_num=top, start_len=start) if want else None), text


def item_json(state: RequestState, incremental: bool = False) -> dict:
    """The response object of one item: cumulative, or (incremental streaming) what was
    taken since the previous frame."""
    if not incremental:
        return {"text": state.text, "output_ids": list(state.output_ids),
                "meta_info": state.meta_info()}
    text, ids, logprobs = state.unsent()
    return {"text": text, "output_ids": ids, "meta_info": state.meta_info(logprobs)}


class GenerateHandler:
    def __init__(self, dispatcher: Dispatcher, incremental_streaming: bool,
                 share_prompts: bool = True, send_timeout: float = 60.0):
        self.dispatcher = dispatcher
        self.pipeline = Pipeline(dispatcher, share_prompts)
        self.incremental = incremental_streaming
        self.send_timeout = send_timeout

    async def handle(self, request: Request) -> Response:
        try:
            parsed = parse_generate(await read_json(request))
            states = await self.pipeline.start(request, parsed.requests, parsed.warmups,
                                               "generate")
            for st in states:
                st.text_in_logprobs = parsed.text_in_logprobs
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        if parsed.stream:
            return await self.stream(request, states, parsed.is_batch)
        return await self.unary(request, states, parsed.is_batch)

    async def unary(self, request: Request, states: list[RequestState],
                    is_batch: bool) -> Response:
        # Every item is drained concurrently; the array keeps input order.
        early = await settle(request, self.dispatcher, states,
                             [s.wait_finished() for s in states])
        if early is not None:
            return early
        items = [item_json(s) for s in states]
        return JSONResponse(items if is_batch else items[0])

    async def stream(self, request: Request, states: list[RequestState],
                     is_batch: bool) -> Response:
        # Wait for each item's admission (or first output) so that a rejected prompt is a
        # plain HTTP error.
        early = await settle(request, self.dispatcher, states, [s.next() for s in states])
        if early is not None:
            return early
        return SSEResponse(self._frames(states, is_batch), self.send_timeout)

    async def _frames(self, states: list[RequestState], is_batch: bool) -> AsyncIterator[str]:
        """One frame per item that changed since the previous write. An item that fails
        once the stream has started (timeout, shutdown, lost pipeline) ends the whole stream
        with SGLang's error event; the other items are aborted."""
        try:
            async for changed in changes(states):
                if not changed:
                    yield KEEPALIVE
                    continue
                failed = next((states[i] for i in changed if states[i].error), None)
                if failed is not None:
                    yield sse({"error": {"message": failed.error.message,
                                         "status_code": failed.error.status_code}})
                    break
                for i in changed:
                    frame = item_json(states[i], self.incremental)
                    if is_batch:
                        frame["index"] = i
                    yield sse(frame)
            yield DONE
        finally:
            self.dispatcher.abort_unfinished(states)
