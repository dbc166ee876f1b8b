"""The chat core: one request form, one pipeline, one reading of the output, for every
dialect (OpenAI chat completions, Anthropic Messages, OpenAI Responses, Ollama).

Each dialect is a thin translation (api_proc/openai_api.py, anthropic.py, responses.py,
ollama.py): its body becomes the **chat form**, OpenAI's chat-completions body, which
`parse_chat` validates into GenerateRequests; `ChatCore.start` runs them through the
pipeline (warm-ups, submission, metrics and the request log under the dialect's route);
and the dialect renders what the core reads out of the requests' states:
- `reply(parsed, state)`: a finished choice as content, reasoning and tool calls, with its
  finish reason ("stop", "length", "abort", or "tool_calls" when calls were made);
- `Deltas`: the same for a stream, piece by piece (reasoning and content as they come; a
  forced call, or an "auto" output's calls, once the output is whole).
So tools, reasoning, structured outputs, logprobs, stop strings, timing and metrics work
the same in every dialect. Errors are `OpenAIError`s (message, HTTP status, the field);
each dialect writes them in its own shape.

Choices made for the chat form where OpenAI, vLLM and SGLang leave room (README lists them):
- `model` may be omitted or "default" (SGLang); any other name than the served one is a 404.
- No `max_tokens` / `max_completion_tokens` means "until the context length" (vLLM,
  SGLang): the tokenizer process fits it to the room the templated prompt leaves.
- `seed` with n > 1: sample j uses seed + j, so the samples differ yet are reproducible.
- Text content parts are joined with "\\n" (vLLM); image_url parts go to the chat template
  as {"type": "image"} parts (transformers' form), their URLs to the tokenizer process,
  which loads them (media/sources.py: what may be fetched); any other part type is a 400.
- Unknown fields are ignored (as vLLM and SGLang do); known OpenAI features we do not have
  (tool_choice "auto" without --tool-call-parser, audio, ...) are a 400.
- Tools: a named function in `tool_choice`, or "required", constrains the output to a call
  (api_proc/tools.py: the function's parameters schema, or {name, arguments} over the
  tools); a stream gives the call once whole. An output cut by max_tokens stays content.
  tool_choice "auto" (with --tool-call-parser): the tools go to the chat template and the
  output's calls are parsed (api_proc/tools.py); a stream holds the text to its end.
- --reasoning-parser: `<think>` text is the reasoning (api_proc/reasoning.py);
  `chat_template_kwargs` are template variables (not the template's own names).
- Structured outputs: `response_format` {"type": "json_object"} (any JSON object) or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (the schema is
  always enforced, whatever `strict` says), and SGLang's extra fields `regex`, `ebnf`,
  `json_schema`; at most one constraint per request (grammars/llg.py).
- Logprobs: at most 20 (vLLM's default max).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api_proc.boundary import BadRequest
from api_proc.pipeline import Pipeline, Prompt, expand, priority_of, settle
from api_proc.reasoning import StreamSplitter
from api_proc.reasoning import split as split_reasoning
from api_proc.state import Dispatcher, RequestState
from api_proc.streaming import changes
from api_proc.tools import ToolCall, ToolError, check_tools, forced_calls, forced_schema
from api_proc.tools import parse as parse_tool_calls
from wire.messages import (MAX_LORA_NAME, MAX_TOP_LOGPROBS, TEMPLATE_RESERVED, ChatMessage,
                           ContentPart, FinishReason, GenerateRequest, LogprobRequest, Logprobs)
from wire.sampling import GRAMMAR_KEYS, SamplingError, SamplingParams
from wire.server_args import ServerConfig

MAX_LOGPROBS = MAX_TOP_LOGPROBS
CONSTRAINT_EXTRAS = ("regex", "ebnf")   # SGLang's fields the other dialects pass through

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
    lora: str | None = None         # the LoRA adapter `model` named (None: the base model)

    def model(self, model_id: str) -> str:
        """The model id the answer names: the adapter's, else the served model's."""
        return self.lora or model_id


def check_model(body: dict, model_id: str, loras: bool = False) -> str | None:
    """The LoRA adapter `model` names (None: the base model). loras: the server serves
    adapters (--enable-lora): any other name is one, which the scheduler refuses with a 404
    if it is not loaded (only it knows: another API process may have just loaded it);
    without, any other name is a 404 here."""
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str):
        raise OpenAIError("model must be a string.", param="model")
    if model in (model_id, "default"):          # "default": SGLang's name for the one model
        return None
    if not loras or len(model) > MAX_LORA_NAME:
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
    return model


def is_ids(x: Any) -> bool:
    """A non-empty list of token ids (ints; their range is the tokenizer's to check)."""
    return isinstance(x, list) and len(x) > 0 and all(type(t) is int for t in x)


def bool_field(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise OpenAIError(f"{key} must be a boolean.", param=key)
    return value


def openai_priority(body: dict) -> int:
    """`priority` (vLLM's extra field on the OpenAI routes), as pipeline.priority_of."""
    try:
        return priority_of(body)
    except ValueError as e:
        raise OpenAIError(str(e), param="priority") from None


def stream_options(body: dict, stream: bool) -> bool:
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


def reject_unsupported(body: dict, checks: dict[str, Any]) -> None:
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


def sampling_params(body: dict, max_tokens_key: str | None,
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


def logprobs_num(body: dict, key: str) -> int:
    value = body[key]
    if type(value) is not int or not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"{key} must be an integer in [0, {MAX_LOGPROBS}], got "
                          f"{json.dumps(value)}.", param=key)
    return value


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
               reasoning_parser: str | None = None, takes_images: bool = False,
               cap_max_tokens: bool = False, loras: bool = False) -> ParsedOpenAI:
    """tool_parser / reasoning_parser: the server's --tool-call-parser and
    --reasoning-parser (None: not set); takes_images: the model is a vision one;
    cap_max_tokens: max_tokens is a cap, lowered to the room the prompt leaves (the
    dialects whose clients send a big fixed one: Anthropic's, Ollama's), not a 400."""
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    lora = check_model(body, model_id, loras)
    functions, choice = _tools(body, tool_parser)
    template_json = _template_json(body, choice)
    reject_unsupported(body, {
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
    stream = bool_field(body, "stream")
    include_usage = stream_options(body, stream)
    want_logprobs = bool_field(body, "logprobs")
    top = None
    if body.get("top_logprobs") is not None:
        top = logprobs_num(body, "top_logprobs")
        if not want_logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.",
                              param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
        "max_tokens"
    unset = body.get(key) is None
    if cap_max_tokens and not unset and type(body[key]) is int:
        body = {**body, key: min(body[key], context_length - 1)}
    # Unset: checked against the most it can be; the tokenizer process fits it to the room
    # the templated prompt leaves (fit_context).
    params = sampling_params(body, key, context_length - 1 if unset else None)
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
                           logprob=logprob_req, fit_context=unset or cap_max_tokens,
                           priority=openai_priority(body), lora=[lora])
    return ParsedOpenAI(reqs, params.n, stream, include_usage, logprobs, warmups=warmups,
                        tool_choice=choice if forced is not None else None,
                        tool_parser=tool_parser if choice == "auto" else None,
                        reasoning_parser=reasoning_parser, lora=lora)


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



# ---- the core ---------------------------------------------------------------------------------

class ChatCore:
    """Parses chat-form bodies with the server's parsers and runs them (one per server's API
    process, shared by the dialects)."""

    def __init__(self, config: ServerConfig, dispatcher: Dispatcher, count_tokens):
        """count_tokens(GenerateRequest) -> awaitable int: its prompt's tokens, as the
        tokenizer workers count them (tokenize_routes.TokenizeHandler.count)."""
        self.config = config
        self.model_id = config.served_model_name
        self.dispatcher = dispatcher
        self.pipeline = Pipeline(dispatcher, not config.args.disable_radix_cache)
        self.count_tokens = count_tokens

    def parse(self, body: Any, cap_max_tokens: bool = False) -> "ParsedOpenAI":
        args = self.config.args
        return parse_chat(body, self.model_id, self.config.context_length,
                          args.tool_call_parser, args.reasoning_parser,
                          self.config.model.image_token_id is not None, cap_max_tokens,
                          args.enable_lora)

    async def start(self, request: Request, parsed: "ParsedOpenAI", route: str
                    ) -> list[RequestState]:
        """Submit (pipeline.Pipeline.start); BadRequest / SubmitError to answer at once."""
        return await self.pipeline.start(request, parsed.requests, parsed.warmups, route)

    async def settled(self, request: Request, parsed: "ParsedOpenAI", state: RequestState,
                      error) -> Response | None:
        """Wait for a one-choice request to finish (unary) or be admitted (a stream: its
        HTTP response may start) unless the client leaves: pipeline.settle's early
        response (error(message, status) for a rejection), or None to answer."""
        wait = state.next() if parsed.stream else state.wait_finished()
        return await settle(request, self.dispatcher, [state], [wait], error)

    async def input_tokens(self, parsed: "ParsedOpenAI") -> int:
        """The prompt tokens the parsed body's prompt will count in its usage."""
        return await self.count_tokens(parsed.requests[0])


def finish_reason(finish: FinishReason | None) -> str | None:
    """"stop", "length", "abort" (an abort with no HTTP status), or None while running."""
    if finish is None:
        return None
    return {"length": "length", "stop": "stop"}.get(finish.type, "abort")


def matched_stop(finish: FinishReason | None) -> int | str | None:
    """The stop string, or the stop / EOS token id, that ended the output (SGLang's)."""
    if finish is None or finish.type != "stop":
        return None
    return finish.matched_str if finish.matched_str is not None else finish.matched_token


def with_ids(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls, each with an id of its own (every dialect answers with ids)."""
    return [c if c.id else dataclasses.replace(c, id=f"call_{uuid.uuid4().hex[:24]}")
            for c in calls]


def call_arguments(call: ToolCall) -> dict:
    """A call's arguments as an object (the dialects that send objects, not JSON text); a
    text that is not a JSON object is kept under "arguments"."""
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        value = None
    return value if isinstance(value, dict) else {"arguments": call.arguments}


def forced_reply_calls(parsed: "ParsedOpenAI", state: RequestState) -> list[ToolCall]:
    """A forced tool_choice's call, once the output finished as a whole call ([]
    otherwise: the text stays content)."""
    last = state.last
    if parsed.tool_choice is None or last.finish is None or last.finish.type != "stop":
        return []
    return with_ids(forced_calls(state.text, parsed.tool_choice))


@dataclass(slots=True)
class Reply:
    """A finished choice, read as every dialect shows it."""

    content: str | None
    reasoning: str | None         # None: no --reasoning-parser, or the output did not think
    calls: list[ToolCall]
    finish: str | None            # finish_reason's, or "tool_calls" when calls were made
    forced: bool = False          # the calls are a forced tool_choice's (no text beside)


def reply(parsed: "ParsedOpenAI", state: RequestState) -> Reply:
    forced = forced_reply_calls(parsed, state)
    if forced:
        return Reply(None, None, forced, "tool_calls", forced=True)
    content, reasoning = state.text, None
    finish = finish_reason(state.last.finish)
    if parsed.reasoning_parser is not None:
        reasoning, content = split_reasoning(content, parsed.reasoning_parser)
    calls: list[ToolCall] = []
    if parsed.tool_parser is not None:
        text, calls = parse_tool_calls(content, parsed.tool_parser)
        if calls:
            content, calls, finish = text or None, with_ids(calls), "tool_calls"
    return Reply(content, reasoning, calls, finish)


class Deltas:
    """One streamed choice, piece by piece: `feed` takes what arrived since the previous
    feed and returns events, in order: ("reasoning", text), ("content", text, logprobs or
    None), ("calls", [ToolCall]). A forced call comes once the output is whole; so does an
    "auto" output's text (held: whether it holds calls is known at its end)."""

    def __init__(self, parsed: "ParsedOpenAI"):
        self.parsed = parsed
        self.splitter = None if parsed.reasoning_parser is None else \
            StreamSplitter(parsed.reasoning_parser)
        self.held = ""
        self.called = False           # calls were given: the finish reason is "tool_calls"

    def finish(self, state: RequestState) -> str | None:
        reason = finish_reason(state.last.finish)
        return "tool_calls" if reason is not None and self.called else reason

    def feed(self, state: RequestState, text: str, lp: Logprobs) -> list[tuple]:
        done = state.last.finish is not None
        p, out = self.parsed, []
        if p.tool_choice is not None:
            if not done:
                return out
            calls = forced_reply_calls(p, state)
            if calls:
                self.called = True
                return [("calls", calls)]
            text = state.text               # not a whole call: the text, as content
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text, final=done)
            if reasoning:
                out.append(("reasoning", reasoning))
        if p.tool_parser is not None:
            self.held += text
            if not done:
                return out
            content, calls = parse_tool_calls(self.held, p.tool_parser)
            self.held = ""
            if calls:
                self.called = True
                if content:
                    out.append(("content", content, None))
                return out + [("calls", with_ids(calls))]
            text = content
        if text or lp.token_ids:
            out.append(("content", text, lp))
        return out


async def pieces(dispatcher: Dispatcher, parsed: "ParsedOpenAI", state: RequestState
                 ) -> AsyncIterator[tuple]:
    """One streamed choice (admitted: pipeline.settle on state.next()) as the events its
    dialect renders: ("keepalive",) after streaming.KEEPALIVE_S seconds without news, the
    `Deltas` events, then ("finish", reason, matched_stop) or ("error", FinishReason). The
    request is aborted if the consumer stops early (a client that left)."""
    deltas = Deltas(parsed)
    try:
        async for changed in changes([state]):
            if not changed:
                yield ("keepalive",)
                continue
            if state.error is not None:
                yield ("error", state.error)
                return
            text, _, lp = state.unsent()
            for event in deltas.feed(state, text, lp):
                yield event
            if state.finished:
                yield ("finish", deltas.finish(state), matched_stop(state.last.finish))
    finally:
        dispatcher.abort_unfinished([state])
