"""OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

A body becomes one GenerateRequest per prompt per sample (n=1 each; choice index =
prompt * n + sample), built through `SamplingParams.from_json` so a bad value gets SGLang's
message, as on /generate. Errors use OpenAI's nested shape with the right HTTP status.

Each choice is its request's RequestState (`_Choice` adds the index), which accumulates
the text, ids and logprobs; streams send what arrived since their previous chunk.

Choices made where OpenAI, vLLM and SGLang leave room (README lists them):
- `model` may be omitted or "default" (SGLang); any other name than the served one is a 404.
  GET /v1/models/{id} answers the served model's card.
- completions: `max_tokens` null means 16, OpenAI's default. chat: no `max_tokens` /
  `max_completion_tokens` means "until the context length" (vLLM, SGLang): the API process
  renders the chat template itself to count the prompt.
- `seed` with n > 1: sample j uses seed + j, so the samples differ yet are reproducible.
- Text content parts are joined with "\n" (vLLM); image_url parts go to the chat template
  as {"type": "image"} parts (transformers' form), their URLs to the tokenizer process,
  which loads them (media/sources.py: what may be fetched); any other part type is a 400.
- Unknown fields are ignored (as vLLM and SGLang do); known OpenAI features we do not have
  (suffix, best_of != n, tool_choice "auto" without --tool-call-parser, ...) are a 400.
- Tools (chat): a named function in `tool_choice`, or "required", constrains the output to
  a call (api_proc/tools.py: the function's parameters schema, or {name, arguments} over
  the tools) and answers `tool_calls` with finish_reason "tool_calls"; streamed, the call
  comes as one `tool_calls` delta once whole. An output cut by max_tokens stays content.
  tool_choice "auto" (with --tool-call-parser): the tools go to the chat template and the
  output's calls are parsed (api_proc/tools.py); a stream holds the text to its end.
- --reasoning-parser: `<think>` text goes to `reasoning_content` (api_proc/reasoning.py);
  `chat_template_kwargs` are template variables (not the template's own names).
- Structured outputs, on both routes: `response_format` {"type": "json_object"} (any JSON
  object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (the
  schema is always enforced, whatever `strict` says), and SGLang's extra fields `regex`,
  `ebnf`, `json_schema`; at most one constraint per request (grammars/llg.py).
- finish_reason: length -> "length", stop -> "stop" (plus SGLang's `matched_stop`), an abort
  with no HTTP status (e.g. /abort_request) -> "abort"; an abort with a status is an error
  response, or an `{"error": ...}` event in a stream that has started.
- Logprobs: at most 20 (vLLM's default max). Completions' `top_logprobs` dicts hold the top
  k plus the sampled token (vLLM), so `logprobs: 0` gives the sampled token only.
  `echo` with `logprobs` also returns the prompt's logprobs (first one null), as vLLM.
  -inf is sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, read_json
from api_proc.pipeline import Pipeline, Prompt, expand, settle
from api_proc.state import Dispatcher, RequestState, SubmitError
from api_proc.streaming import DONE, KEEPALIVE, SSEResponse, changes, sse
from api_proc.reasoning import StreamSplitter
from api_proc.reasoning import split as split_reasoning
from api_proc.tools import ToolError, check_tools, forced_calls, forced_schema
from api_proc.tools import parse as parse_tool_calls
from wire.messages import (MAX_TOP_LOGPROBS, TEMPLATE_RESERVED, ChatMessage, ContentPart,
                           FinishReason, GenerateRequest, LogprobRequest, Logprobs,
                           TextOutput)
from wire.sampling import GRAMMAR_KEYS, SamplingError, SamplingParams
from wire.server_args import ServerConfig

log = logging.getLogger(__name__)

MAX_LOGPROBS = MAX_TOP_LOGPROBS
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MIN_LOGPROB = -9999.0

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError",
               403: "PermissionDeniedError", 404: "NotFoundError", 409: "ConflictError",
               422: "UnprocessableEntityError", 429: "RateLimitError",
               503: "ServiceUnavailableError"}

# OpenAI field (or SGLang extra) -> sampling_params key. max_tokens is handled apart.
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim", "seed": "sampling_seed", "min_tokens": "min_new_tokens",
    "logit_bias": "logit_bias", "n": "n",
    "regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema",     # SGLang's extras
}
RESPONSE_FORMAT_KEYS = {"type", "json_schema"}
JSON_SCHEMA_FORMAT_KEYS = {"name", "description", "schema", "strict"}


class OpenAIError(BadRequest):
    """A client error in OpenAI's shape: `param` names the offending field when known."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message, status)
        self.param = param


def error_json(message: str, status: int, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else
                           "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    return JSONResponse(error_json(message, status, param), status_code=status)


# ---- body parsing ----------------------------------------------------------------------------

@dataclass(slots=True)
class ParsedOpenAI:
    """A validated OpenAI body: the GenerateRequests in choice order and how to answer."""

    requests: list[GenerateRequest]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None         # completions: top k; chat: top_logprobs (None: no logprobs)
    echo: list[str | list[int]] | None = None   # completions with echo: each prompt
    warmups: list[GenerateRequest] = field(default_factory=list)   # n > 1: see pipeline.py
    tool_choice: str | None = None  # chat with a forced tool call: a function name or
                                    # "required" (api_proc/tools.py); None: plain text
    tool_parser: str | None = None  # chat with tool_choice "auto": parse the output's calls
    reasoning_parser: str | None = None     # chat: split <think> into reasoning_content


def _check_model(body: dict, model_id: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise OpenAIError("model must be a string.", param="model")
    if model not in (model_id, "default"):      # "default": SGLang's name for the one model
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")


def _bool_field(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise OpenAIError(f"{key} must be a boolean.", param=key)
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise OpenAIError("The 'stream_options' parameter is only allowed when 'stream' is "
                          "enabled.", param="stream_options")
    if not isinstance(opts, dict):
        raise OpenAIError("stream_options must be an object.", param="stream_options")
    include = opts.get("include_usage")
    if include is not None and type(include) is not bool:
        raise OpenAIError("stream_options.include_usage must be a boolean.",
                          param="stream_options")
    return bool(include)


def _reject_unsupported(body: dict, checks: dict[str, Any]) -> None:
    """checks: field -> predicate that is True for the values we accept."""
    for key, ok in checks.items():
        if key in body and body[key] is not None and not ok(body[key]):
            raise OpenAIError(f"{key}={json.dumps(body[key])} is not supported.", param=key)


def _response_format(body: dict) -> dict | None:
    """The JSON schema that `response_format` asks for, or None (absent, or "text")."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise OpenAIError("response_format must be an object with a string 'type'.",
                          param="response_format")
    extra = sorted(set(fmt) - RESPONSE_FORMAT_KEYS)
    if extra:
        raise OpenAIError(f"Unknown field(s) in response_format: {', '.join(extra)}.",
                          param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise OpenAIError(f"response_format type {json.dumps(kind)} is not supported (text, "
                          f"json_object or json_schema).", param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise OpenAIError("response_format.json_schema must be an object with 'name' and "
                          "'schema'.", param="response_format")
    extra = sorted(set(spec) - JSON_SCHEMA_FORMAT_KEYS)
    if extra:
        raise OpenAIError(f"Unknown field(s) in response_format.json_schema: "
                          f"{', '.join(extra)}.", param="response_format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise OpenAIError("response_format.json_schema.name must be a non-empty string.",
                          param="response_format")
    if spec.get("strict") is not None and type(spec["strict"]) is not bool:
        raise OpenAIError("response_format.json_schema.strict must be a boolean.",
                          param="response_format")
    schema = spec.get("schema")
    if type(schema) is not dict:
        raise OpenAIError("response_format.json_schema.schema must be a JSON Schema object.",
                          param="response_format")
    return schema


def _sampling(body: dict, max_tokens_key: str | None,
              default_max_tokens: int | None) -> SamplingParams:
    """The SGLang sampling dict from the OpenAI fields, validated by from_json."""
    raw: dict[str, Any] = {}
    for name, key in SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            raw[key] = body[name]
    max_tokens = body.get(max_tokens_key) if max_tokens_key else None
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    schema = _response_format(body)
    if schema is not None:
        if any(k in raw for k in GRAMMAR_KEYS):
            raise OpenAIError("Only one of regex, json_schema, or ebnf can be set (a JSON "
                              "response_format counts as json_schema).",
                              param="response_format")
        raw["json_schema"] = schema
    try:
        return SamplingParams.from_json(raw)
    except SamplingError as e:      # name the OpenAI field the sampling key came from
        names = {v: k for k, v in SAMPLING_FIELDS.items()}
        names["max_new_tokens"] = max_tokens_key or "max_tokens"
        if schema is not None:
            names["json_schema"] = "response_format"
        raise OpenAIError(str(e), param=names.get(e.key)) from None


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(type(t) is int for t in x)


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIError("prompt is required.", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt):
            return list(prompt)
    raise OpenAIError("prompt must be a string, a non-empty list of strings, a non-empty "
                      "list of token ids, or a non-empty list of such lists.", param="prompt")


def _logprobs_num(body: dict, key: str) -> int:
    value = body[key]
    if type(value) is not int or not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"{key} must be an integer in [0, {MAX_LOGPROBS}], got "
                          f"{json.dumps(value)}.", param=key)
    return value


def parse_completion(body: Any, model_id: str) -> ParsedOpenAI:
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    _check_model(body, model_id)
    _reject_unsupported(body, {"suffix": lambda v: v == "",
                               "best_of": lambda v: v == body.get("n", 1) or v == 1})
    prompts = _prompts(body)
    stream = _bool_field(body, "stream")
    include_usage = _stream_options(body, stream)
    echo = _bool_field(body, "echo")
    logprobs = None if body.get("logprobs") is None else _logprobs_num(body, "logprobs")
    params = _sampling(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprob_req = None
    if logprobs is not None:
        logprob_req = LogprobRequest(top_logprobs_num=logprobs, start_len=0 if echo else -1)
    base = uuid.uuid4().hex
    rids = [f"cmpl-{base}_{i}" for i in range(len(prompts) * params.n)]
    reqs, warmups = expand([Prompt(text=p) if isinstance(p, str) else Prompt(input_ids=p)
                            for p in prompts], [params] * len(prompts), rids,
                           stream=stream, logprob=logprob_req)
    return ParsedOpenAI(reqs, params.n, stream, include_usage, logprobs,
                        echo=prompts if echo else None, warmups=warmups)


def _content(content: Any, i: int, images: list[str]) -> tuple[str, list[ContentPart] | None]:
    """A message's content -> (its text, its parts when it has images); the images' URLs
    are appended to `images`, in order."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise OpenAIError(f"messages[{i}].content must be a string or a list of content "
                          f"parts.", param="messages")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise OpenAIError(f"messages[{i}].content: a text part needs a string "
                                  f"'text'.", param="messages")
            parts.append(ContentPart("text", part["text"]))
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise OpenAIError(f"messages[{i}].content: an image_url part needs "
                                  f"{{\"url\": string}}.", param="messages")
            parts.append(ContentPart("image"))
            images.append(url)
        else:
            raise OpenAIError(f"messages[{i}].content: only text and image_url content parts "
                              f"are supported, got {json.dumps(kind)}.", param="messages")
    text = "\n".join(p.text for p in parts if p.type == "text")
    return text, parts if any(p.type == "image" for p in parts) else None


def _messages(body: dict) -> tuple[list[ChatMessage], list[str]]:
    """The messages, and their images' URLs in order."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("messages must be a non-empty list.", param="messages")
    out, images = [], []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise OpenAIError(f"messages[{i}] must be an object with a string 'role'.",
                              param="messages")
        content = m.get("content")
        if content is None and m["role"] != "assistant":
            raise OpenAIError(f"messages[{i}] ({m['role']}) needs content.",
                              param="messages")
        text, parts = ("", None) if content is None else _content(content, i, images)
        out.append(ChatMessage(m["role"], text, _history_calls(m.get("tool_calls"), i),
                               _tool_call_id(m.get("tool_call_id"), i), parts))
    return out, images


def _history_calls(calls, i: int) -> str | None:
    """An assistant message's earlier tool_calls, for the template (JSON text)."""
    if calls is None:
        return None
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls):
        raise OpenAIError(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\", "
                          f"\"function\": {{\"name\", \"arguments\"}}}} objects.",
                          param="messages")
    return json.dumps(calls, ensure_ascii=False)


def _tool_call_id(value, i: int) -> str | None:
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"messages[{i}].tool_call_id must be a string.", param="messages")
    return value


def parse_chat(body: Any, model_id: str, context_length: int, tool_parser: str | None = None,
               reasoning_parser: str | None = None, takes_images: bool = False
               ) -> ParsedOpenAI:
    """tool_parser / reasoning_parser: the server's --tool-call-parser and
    --reasoning-parser (None: not set); takes_images: the model is a vision one."""
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    _check_model(body, model_id)
    functions, choice = _tools(body, tool_parser)
    template_json = _template_json(body, choice)
    _reject_unsupported(body, {
        "tools": lambda v: True, "tool_choice": lambda v: True,     # _tools took them
        "functions": lambda v: v == [], "function_call": lambda v: v == "none",
        "add_generation_prompt": lambda v: v is True,
        "continue_final_message": lambda v: v is False,
        "chat_template_kwargs": lambda v: True, "audio": lambda v: False,
        "modalities": lambda v: v == ["text"]})
    messages, images = _messages(body)
    if images and not takes_images:
        raise OpenAIError("This model does not take images (image_url content parts).",
                          param="messages")
    stream = _bool_field(body, "stream")
    include_usage = _stream_options(body, stream)
    want_logprobs = _bool_field(body, "logprobs")
    top = None
    if body.get("top_logprobs") is not None:
        top = _logprobs_num(body, "top_logprobs")
        if not want_logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.",
                              param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"
    unset = body.get(key) is None
    # Unset: checked against the most it can be; the tokenizer process fits it to the room
    # the templated prompt leaves (fit_context).
    params = _sampling(body, key, context_length - 1 if unset else None)
    forced = forced_schema(functions, choice)
    if forced is not None:
        if any(getattr(params, k) is not None for k in GRAMMAR_KEYS):
            raise OpenAIError("A forced tool_choice constrains the output already: drop "
                              "response_format / regex / ebnf / json_schema.",
                              param="tool_choice")
        params = params.with_json_schema(forced)
    logprob_req = None if logprobs is None else LogprobRequest(top_logprobs_num=logprobs)
    base = uuid.uuid4().hex
    reqs, warmups = expand([Prompt(messages=messages, template_json=template_json,
                                   image_data=images or None)], [params],
                           [f"chatcmpl-{base}_{j}" for j in range(params.n)], stream=stream,
                           logprob=logprob_req, fit_context=unset)
    return ParsedOpenAI(reqs, params.n, stream, include_usage, logprobs, warmups=warmups,
                        tool_choice=choice if forced is not None else None,
                        tool_parser=tool_parser if choice == "auto" else None,
                        reasoning_parser=reasoning_parser)


def _tools(body: dict, tool_parser: str | None) -> tuple[list[dict], str]:
    """tools and tool_choice (api_proc/tools.py). A named function or "required" is
    enforced with a JSON-schema grammar; "auto" needs the server's --tool-call-parser
    (without one it is refused rather than ignored)."""
    try:
        functions, choice = check_tools(body.get("tools"), body.get("tool_choice"))
    except ToolError as e:
        raise OpenAIError(str(e), param=e.param) from None
    if choice == "auto" and tool_parser is None:
        raise OpenAIError("tool_choice \"auto\" (the default with tools) needs the server "
                          "started with --tool-call-parser; or name a function "
                          "({\"type\": \"function\", \"function\": {\"name\": ...}}) or use "
                          "\"required\".", param="tool_choice")
    return functions, choice


def _template_json(body: dict, choice: str) -> str | None:
    """What the chat template renders besides the messages: the tools (unless
    tool_choice is "none") and chat_template_kwargs."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or TEMPLATE_RESERVED & kwargs.keys():
        raise OpenAIError(f"chat_template_kwargs must be an object whose keys are none of "
                          f"{sorted(TEMPLATE_RESERVED)}.", param="chat_template_kwargs")
    tools = body.get("tools") if choice != "none" else None
    if tools is None and not kwargs:
        return None
    return json.dumps({"tools": tools, "kwargs": kwargs}, ensure_ascii=False)


# ---- consuming outputs -----------------------------------------------------------------------


class _Choice:
    """One choice: its index and its request's state, which accumulates the text, ids and
    logprobs of every output (and hands out what a stream has not sent: unsent())."""

    __slots__ = ("index", "state")

    def __init__(self, index: int, state: RequestState):
        self.index = index
        self.state = state

    @property
    def logprobs(self) -> Logprobs:
        return self.state.output_logprobs

    @property
    def input_logprobs(self) -> Logprobs | None:
        return self.state.input_logprobs


def _finish_reason(finish: FinishReason | None) -> str | None:
    if finish is None:
        return None
    return {"length": "length", "stop": "stop"}.get(finish.type, "abort")


def _matched_stop(finish: FinishReason | None) -> int | str | None:
    if finish is None or finish.type != "stop":
        return None
    return finish.matched_str if finish.matched_str is not None else finish.matched_token


def _usage(choices: list[_Choice], n: int) -> dict:
    """Prompt tokens count once per prompt, not once per sample; cached tokens (OpenAI's
    prompt_tokens_details) count every sample's prefix-cache hits."""
    prompt = sum(c.state.last.prompt_tokens for c in choices if c.index % n == 0)
    completion = sum(c.state.last.completion_tokens for c in choices)
    cached = sum(c.state.last.cached_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _lp(value: float | None) -> float | None:
    return None if value is None else max(value, MIN_LOGPROB)


def _token_text(lp: Logprobs, i: int) -> str:
    return lp.texts[i] if i < len(lp.texts) else f"token_id:{lp.token_ids[i]}"


def _top_pairs(lp: Logprobs, i: int) -> list[tuple[str, float]]:
    ids = lp.top_ids[i] if i < len(lp.top_ids) else []
    values = lp.top_logprobs[i] if i < len(lp.top_logprobs) else []
    texts = lp.top_texts[i] if i < len(lp.top_texts) else []
    return [(texts[j] if j < len(texts) else f"token_id:{tid}", _lp(values[j]))
            for j, tid in enumerate(ids) if j < len(values)]


def completion_logprobs(lp: Logprobs, offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs for these tokens, text offsets from `offset`. Returns the
    object and the offset after the last token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for i in range(len(lp.token_ids)):
        text, value = _token_text(lp, i), _lp(lp.logprobs[i] if i < len(lp.logprobs) else None)
        out["tokens"].append(text)
        out["token_logprobs"].append(value)
        if value is None:
            out["top_logprobs"].append(None)
        else:
            top: dict[str, float] = {}
            for t, v in _top_pairs(lp, i):     # best first: a text shared by ids keeps it
                top.setdefault(t, v)
            top.setdefault(text, value)
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(lp: Logprobs) -> dict:
    def entry(text: str, value: float | None) -> dict:
        return {"token": text, "logprob": MIN_LOGPROB if value is None else value,
                "bytes": list(text.encode("utf-8"))}
    content = []
    for i in range(len(lp.token_ids)):
        e = entry(_token_text(lp, i), _lp(lp.logprobs[i] if i < len(lp.logprobs) else None))
        e["top_logprobs"] = [entry(t, v) for t, v in _top_pairs(lp, i)]
        content.append(e)
    return {"content": content}


class _LocalTokenizer:
    """The API process's own tokenizer (tokenization.hf_tokenizer: no transformers, no
    torch), loaded on first use and run on one thread, off the event loop. Used only for the
    text of token-id prompts that a completion with echo must prepend."""

    def __init__(self, tokenizer_path: str):
        self.tokenizer_path = tokenizer_path
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-tokenizer")
        self.tok = None

    def _load(self):
        if self.tok is None:
            from tokenization.hf_tokenizer import HFTokenizer
            self.tok = HFTokenizer.from_dir(self.tokenizer_path)
        return self.tok

    async def _run(self, fn, *a):
        def call():
            return fn(self._load(), *a)
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    async def decode(self, ids: list[int]) -> str:
        def decode(t, x):
            try:
                return t.decode(x, skip_special_tokens=False)
            except Exception as e:     # e.g. an id outside the vocabulary
                raise OpenAIError(f"The prompt's token ids cannot be decoded: {e}",
                                  param="prompt") from None
        return await self._run(decode, ids)



# ---- the routes ------------------------------------------------------------------------------

class OpenAIHandler:
    def __init__(self, config: ServerConfig, dispatcher: Dispatcher):
        self.config = config
        self.model_id = config.served_model_name
        self.dispatcher = dispatcher
        self.pipeline = Pipeline(dispatcher, not config.args.disable_radix_cache)
        self.created = int(time.time())
        self.tokenizer = _LocalTokenizer(config.tokenizer_path)

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    def _card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "zserve", "root": self.config.model_path, "parent": None,
                "max_model_len": self.config.context_length,
                "input_modalities": (["text"] if self.config.model.image_token_id is None
                                     else ["text", "image"])}

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card; any other id is a 404."""
        if request.path_params["model"] not in (self.model_id, "default"):
            return error_response(f"The model `{request.path_params['model']}` does not "
                                  f"exist.", 404, "model")
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            if chat:
                args = self.config.args
                parsed = parse_chat(body, self.model_id, self.config.context_length,
                                    args.tool_call_parser, args.reasoning_parser,
                                    self.config.model.image_token_id is not None)
            else:
                parsed = parse_completion(body, self.model_id)
            echo = await self._echo_texts(parsed)
            states = await self.pipeline.start(request, parsed.requests, parsed.warmups,
                                               "chat_completions" if chat else "completions")
        except OpenAIError as e:
            return error_response(str(e), e.status, e.param)
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        reply = _Reply(self.model_id, chat, parsed, echo,
                       [_Choice(i, s) for i, s in enumerate(states)])
        if parsed.stream:
            return await self._stream(request, reply)
        return await self._unary(request, reply)

    async def _echo_texts(self, parsed: ParsedOpenAI) -> list[str] | None:
        """Per choice, the text echo prepends (token-id prompts are decoded here)."""
        if parsed.echo is None:
            return None
        texts = [p if isinstance(p, str) else await self.tokenizer.decode(p)
                 for p in parsed.echo]
        return [t for t in texts for _ in range(parsed.n)]

    async def _unary(self, request: Request, reply: "_Reply") -> Response:
        early = await settle(request, self.dispatcher, [c.state for c in reply.choices],
                             [c.state.wait_finished() for c in reply.choices], error_response)
        return early or JSONResponse(reply.unary())

    async def _stream(self, request: Request, reply: "_Reply") -> Response:
        # Wait for each choice's admission (or first output) so that a rejected prompt is a
        # plain HTTP error.
        early = await settle(request, self.dispatcher, [c.state for c in reply.choices],
                             [c.state.next() for c in reply.choices], error_response)
        if early is not None:
            return early
        return SSEResponse(self._events(reply), self.config.args.send_timeout)

    async def _events(self, reply: "_Reply") -> AsyncIterator[str]:
        """Chunks for each choice that changed since the previous write; a choice that
        fails once the stream has started ends it with an error event (the rest are
        aborted)."""
        states = [c.state for c in reply.choices]
        started: set[int] = set()
        try:
            async for changed in changes(states):
                if not changed:
                    yield KEEPALIVE
                    continue
                failed = next((states[i].error for i in changed if states[i].error), None)
                if failed is not None:
                    yield sse(error_json(failed.message or "The request failed.",
                                         failed.status_code or 500))
                    break
                for i in changed:
                    for chunk in reply.chunks(reply.choices[i], i not in started):
                        yield sse(chunk)
                    started.add(i)
            else:
                if reply.parsed.include_usage:
                    yield sse(reply.envelope([], usage=reply.usage()))
            yield DONE
        finally:
            self.dispatcher.abort_unfinished(states)


class _Reply:
    """Builds the response objects of one OpenAI request from its choices."""

    def __init__(self, model: str, chat: bool, parsed: ParsedOpenAI,
                 echo: list[str] | None, choices: list[_Choice]):
        self.model = model
        self.chat = chat
        self.parsed = parsed
        self.echo = echo
        self.choices = choices
        self.id = parsed.requests[0].rid.rsplit("_", 1)[0]
        self.created = int(time.time())
        self.offsets = [0] * len(choices)         # completions: text_offset so far, per choice
        self.splitters: dict[int, StreamSplitter] = {}  # chat stream, --reasoning-parser
        self.held: dict[int, str] = {}            # chat stream, tool_choice "auto": its text

    def usage(self) -> dict:
        return _usage(self.choices, self.parsed.n)

    def envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        if self.parsed.stream and self.chat:
            obj = "chat.completion.chunk"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if usage is not None or not self.parsed.stream or self.parsed.include_usage:
            out["usage"] = usage
        return out

    def _completion_logprobs(self, c: _Choice, lp: Logprobs, with_prompt: bool) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        if not with_prompt:
            obj, self.offsets[c.index] = completion_logprobs(lp, self.offsets[c.index])
            return obj
        # The first logprobs of a choice: with echo, the prompt's tokens come first (offsets
        # from 0) and the generated ones start after the echoed text.
        prompt = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo:
            if c.input_logprobs is not None:
                prompt, _ = completion_logprobs(c.input_logprobs, 0)
            self.offsets[c.index] = len(self.echo[c.index])
        obj, self.offsets[c.index] = completion_logprobs(lp, self.offsets[c.index])
        return {k: prompt[k] + obj[k] for k in obj}

    def unary(self) -> dict:
        items = []
        for c in self.choices:
            last = c.state.last
            item: dict[str, Any] = {"index": c.index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.state.text}
                item["logprobs"] = None if self.parsed.logprobs is None else \
                    chat_logprobs(c.logprobs)
                calls = self._tool_calls(c)
                if calls:
                    item["message"] = {"role": "assistant", "content": None,
                                       "tool_calls": calls}
                    item["finish_reason"] = "tool_calls"
                else:
                    self._split_message(c, item)
            else:
                item["text"] = (self.echo[c.index] if self.echo else "") + c.state.text
                item["logprobs"] = self._completion_logprobs(c, c.logprobs, True)
            item.setdefault("finish_reason", _finish_reason(last.finish))
            item["matched_stop"] = _matched_stop(last.finish)
            items.append(item)
        return self.envelope(items, usage=self.usage())

    def _split_message(self, c: _Choice, item: dict) -> None:
        """--reasoning-parser and tool_choice "auto": the text's reasoning, calls and
        content, each where OpenAI clients look for it."""
        content = c.state.text
        p = self.parsed
        if p.reasoning_parser is not None:
            reasoning, content = split_reasoning(content, p.reasoning_parser)
            item["message"]["reasoning_content"] = reasoning
            item["message"]["content"] = content
        if p.tool_parser is not None:
            content, calls = parse_tool_calls(content, p.tool_parser)
            if calls:
                item["message"]["content"] = content or None
                item["message"]["tool_calls"] = [call.to_json(i)
                                                 for i, call in enumerate(calls)]
                item["finish_reason"] = "tool_calls"

    def _tool_calls(self, c: _Choice) -> list[dict]:
        """A forced tool call's OpenAI form, once the choice finished with a whole call
        ([] otherwise: the text stays content)."""
        if self.parsed.tool_choice is None or c.state.last.finish is None or \
                c.state.last.finish.type != "stop":
            return []
        return [call.to_json(i) for i, call in
                enumerate(forced_calls(c.state.text, self.parsed.tool_choice))]

    def chunks(self, c: _Choice, first: bool) -> list[dict]:
        """The stream chunks for what a choice received since its previous chunks (possibly
        none)."""
        new_text, _, lp = c.state.unsent()
        out = c.state.last
        finish = _finish_reason(out.finish)
        if self.chat:
            return self._chat_chunks(c, out, new_text, first, lp, finish)
        text = (self.echo[c.index] if first and self.echo else "") + new_text
        if not text and finish is None and not lp.token_ids:
            return []
        item = {"index": c.index, "text": text,
                "logprobs": self._completion_logprobs(c, lp, first),
                "finish_reason": finish, "matched_stop": _matched_stop(out.finish)}
        return [self.envelope([item])]

    def _chat_chunks(self, c: _Choice, out: TextOutput, text: str, first: bool,
                     lp: Logprobs, finish: str | None) -> list[dict]:
        def chunk(delta: dict, logprobs: dict | None = None, finish_reason=None,
                  matched=None) -> dict:
            return self.envelope([{"index": c.index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish_reason, "matched_stop": matched}])
        chunks = []
        if first:
            chunks.append(chunk({"role": "assistant", "content": ""}))
        if self.parsed.tool_choice is not None:
            # A forced call streams as one tool_calls delta once it is whole (its
            # arguments are only known to be a call when the grammar ends them).
            if finish is None:
                return chunks
            calls = self._tool_calls(c)
            if calls:
                return chunks + [chunk({"tool_calls": calls}), chunk({}, None, "tool_calls")]
            text = c.state.text             # not a whole call: the text, as content
        if self.parsed.reasoning_parser is not None:
            splitter = self.splitters.setdefault(
                c.index, StreamSplitter(self.parsed.reasoning_parser))
            reasoning, text = splitter.feed(text, final=finish is not None)
            if reasoning:
                chunks.append(chunk({"reasoning_content": reasoning}))
        if self.parsed.tool_parser is not None:
            # "auto": whether the text holds calls is known at its end; it is held till then.
            self.held[c.index] = self.held.get(c.index, "") + text
            if finish is None:
                return chunks
            content, calls = parse_tool_calls(self.held.pop(c.index), self.parsed.tool_parser)
            if calls:
                if content:
                    chunks.append(chunk({"content": content}))
                return chunks + [chunk({"tool_calls": [call.to_json(i) for i, call in
                                                       enumerate(calls)]}),
                                 chunk({}, None, "tool_calls")]
            text = content
        if text or lp.token_ids:
            logprobs = None if self.parsed.logprobs is None else chat_logprobs(lp)
            chunks.append(chunk({"content": text}, logprobs))
        if finish is not None:
            chunks.append(chunk({}, None, finish, _matched_stop(out.finish)))
        return chunks
