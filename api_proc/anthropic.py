"""The Anthropic Messages dialect: POST /v1/messages and /v1/messages/count_tokens.

A Messages body is translated to the chat core's form (api_proc/chat.py) and its reply
rendered as Anthropic's message, or its stream as Anthropic's event sequence:
`message_start`, `ping`, per content block `content_block_start` / `content_block_delta`
(`text_delta`, `thinking_delta`, `input_json_delta`) / `content_block_stop`, then
`message_delta` (stop_reason, stop_sequence, usage.output_tokens) and `message_stop`; a
`ping` every streaming.KEEPALIVE_S seconds without news; a failure once the stream has
started is an `error` event. Errors are `{"type": "error", "error": {"type", "message"}}`
with Anthropic's error types. The key may come as `x-api-key` (api_proc/guard.py).

Translation (what is taken, what is refused):
- `system` (a string or text blocks), `messages` with text, image (base64 or url source),
  tool_use (assistant) and tool_result (user; string or text blocks; a tool message each,
  before the user's text) blocks; thinking blocks of earlier turns are dropped. A final
  assistant message (a prefill) is refused: the chat template would close it.
- `max_tokens` (required; a cap: agents send 32000 or more, so it is lowered to the room
  the prompt leaves in the context rather than refused), `stop_sequences`, `temperature`, `top_p`, `top_k` (which the
  2026 SDKs no longer send but older clients do: `extra_body` with the current ones), and
  SGLang's `regex` / `ebnf`; `output_config.format` {"type": "json_schema", "schema"}
  (structured outputs; `effort` ignored); `metadata` and `service_tier` are accepted and
  ignored.
- `tools` (custom tools: name, description, input_schema; server tools such as
  web_search are refused) and `tool_choice` auto / any / tool / none (the chat form's
  "auto", "required", a named function, "none": "auto" needs --tool-call-parser).
- `thinking`: with --reasoning-parser, the output's reasoning is a thinking block;
  {"type": "disabled"} sets the template variable enable_thinking false (Qwen3's switch),
  {"type": "enabled"} sets it true. budget_tokens is not enforced.
- stop_reason: "end_turn" (end of sequence, or an abort without an error), "stop_sequence"
  (with `stop_sequence`), "max_tokens", "tool_use".
- usage.input_tokens is the whole prompt (no cache_* fields: zserve's prefix cache is not
  Anthropic's prompt caching), and equals what count_tokens answers for the same body.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, dumps, read_json
from api_proc.chat import (CONSTRAINT_EXTRAS, ChatCore, OpenAIError, ParsedOpenAI, Reply,
                           call_arguments, matched_stop, pieces, reply)
from api_proc.state import SubmitError
from api_proc.streaming import SSEResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
SAMPLING = ("temperature", "top_p", "top_k")


def error_json(message: str, status: int) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(message: str, status: int = 400) -> Response:
    return JSONResponse(error_json(message, status), status_code=status)


def event(kind: str, obj: dict) -> str:
    return f"event: {kind}\ndata: {dumps({'type': kind, **obj})}\n\n"


# ---- request: Messages body -> chat form ------------------------------------------------------

def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks joined with newlines."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in blocks):
        return "\n".join(b["text"] for b in blocks)
    raise BadRequest(f"{where} must be a string or a list of text blocks.")


def _image(block: dict, where: str) -> dict:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and \
            isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" and \
            isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise BadRequest(f"{where}: an image block needs a source {{\"type\": \"base64\", "
                         f"\"media_type\", \"data\"}} or {{\"type\": \"url\", \"url\"}}.")
    return {"type": "image_url", "image_url": {"url": url}}


def _message(m: Any, i: int) -> list[dict]:
    """One Messages message -> its chat-form messages (tool results first, as their own
    tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise BadRequest(f"{where} must be an object with role \"user\" or \"assistant\".")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks.")
    tools, parts, calls = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(b, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                    not isinstance(b.get("input"), dict):
                raise BadRequest(f"{at}: a tool_use block needs a string id and name and an "
                                 f"object input.")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise BadRequest(f"{at}: a tool_result block needs a string tool_use_id.")
            result = b.get("content", "")
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                          "content": _text(result, f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue                    # earlier reasoning: not shown to the template
        else:
            raise BadRequest(f"{at}: a {json.dumps(kind)} block is not supported in a "
                             f"{role} message (text, image and tool_result in user "
                             f"messages; text, tool_use and thinking in assistant ones).")
    out = tools
    if role == "assistant":
        text = "\n".join(p["text"] for p in parts)
        if text or calls:
            out.append({"role": "assistant", "content": text or None,
                        **({"tool_calls": calls} if calls else {})})
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _tools(body: dict) -> dict:
    tools, choice = body.get("tools"), body.get("tool_choice")
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("tools must be a list.")
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or \
                    not isinstance(t.get("name"), str):
                raise BadRequest(f"tools[{i}]: only custom tools ({{\"name\", "
                                 f"\"description\", \"input_schema\"}}) are supported.")
            f = {"name": t["name"], "parameters": t.get("input_schema",
                                                         {"type": "object"})}
            if isinstance(t.get("description"), str):
                f["description"] = t["description"]
            functions.append({"type": "function", "function": f})
        out["tools"] = functions or None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise BadRequest("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} "
                             "or {\"type\": \"tool\", \"name\": ...}.")
    return out


def to_chat(body: Any, count_only: bool = False) -> dict:
    """A Messages body as the chat core's form (BadRequest for what it cannot take)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list.")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": []}
    if body.get("system") is not None:
        chat["messages"].append({"role": "system",
                                 "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        chat["messages"] += _message(m, i)
    if messages[-1].get("role") == "assistant":
        raise BadRequest("A final assistant message (a prefill) is not supported: end with "
                         "a user message.")
    if not count_only:
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest("max_tokens is required: an integer >= 1.")
        chat["max_tokens"] = max_tokens
        chat["stream"] = body.get("stream")
        chat["priority"] = body.get("priority")     # zserve's (SGLang's) extra field
        for key in SAMPLING + CONSTRAINT_EXTRAS:
            chat[key] = body.get(key)
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise BadRequest("stop_sequences must be a list of strings.")
            chat["stop"] = stops or None
    chat.update(_tools(body))
    fmt = (body.get("output_config") or {}).get("format") if isinstance(
        body.get("output_config") or {}, dict) else False
    if fmt is False or (fmt is not None and not (
            isinstance(fmt, dict) and fmt.get("type") == "json_schema")):
        raise BadRequest("output_config must be an object whose format, when given, is "
                         "{\"type\": \"json_schema\", \"schema\": {...}}.")
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.get("schema")}}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                             "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}.")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return chat


# ---- reply: chat core -> Messages -------------------------------------------------------------

def stop_reason(reason: str | None, matched: int | str | None) -> str | None:
    if reason is None:
        return None
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(matched, str) else "end_turn"


def content_blocks(r: Reply) -> list[dict]:
    blocks: list[dict] = []
    if r.reasoning:
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.content or not (blocks or r.calls):
        blocks.append({"type": "text", "text": r.content or ""})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": call_arguments(c)}
               for c in r.calls]
    return blocks


class AnthropicHandler:
    def __init__(self, core: ChatCore, send_timeout: float):
        self.core = core
        self.send_timeout = send_timeout

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    def _parse(self, body: Any, count_only: bool = False) -> ParsedOpenAI:
        try:
            return self.core.parse(to_chat(body, count_only), cap_max_tokens=True)
        except OpenAIError as e:            # the chat form's message, as Anthropic's error
            raise BadRequest(str(e), e.status) from None

    async def count_tokens(self, request: Request) -> Response:
        try:
            parsed = self._parse(await read_json(request), count_only=True)
            return JSONResponse({"input_tokens": await self.core.input_tokens(parsed)})
        except BadRequest as e:
            return error_response(str(e), e.status)

    async def messages(self, request: Request) -> Response:
        try:
            parsed = self._parse(await read_json(request))
            (state,) = await self.core.start(request, parsed, "messages")
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        rid = "msg_" + parsed.requests[0].rid.split("-", 1)[-1].rsplit("_", 1)[0]
        model = parsed.model(self.core.model_id)       # an adapter's name, when it ran one
        early = await self.core.settled(request, parsed, state, error_response)
        if early is not None:
            return early
        if not parsed.stream:
            r = reply(parsed, state)
            last = state.last
            return JSONResponse({
                "id": rid, "type": "message", "role": "assistant", "model": model,
                "content": content_blocks(r),
                "stop_reason": stop_reason(r.finish, matched_stop(last.finish)),
                "stop_sequence": _stop_sequence(last),
                "usage": {"input_tokens": last.prompt_tokens,
                          "output_tokens": last.completion_tokens}})
        return SSEResponse(self._events(parsed, state, rid, model), self.send_timeout)

    async def _events(self, parsed: ParsedOpenAI, state, rid: str, model: str
                      ) -> AsyncIterator[str]:
        yield event("message_start", {"message": {
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": state.last.prompt_tokens, "output_tokens": 0}}})
        yield event("ping", {})
        index, open_kind = -1, None

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", {"index": index})]

        def start(kind: str, block: dict) -> list[str]:
            nonlocal index, open_kind
            frames = close()
            index, open_kind = index + 1, kind
            return frames + [event("content_block_start",
                                   {"index": index, "content_block": block})]

        async for piece in pieces(self.core.dispatcher, parsed, state):
            kind = piece[0]
            frames: list[str] = []
            if kind == "keepalive":
                frames.append(event("ping", {}))
            elif kind == "error":
                failed = piece[1]
                frames.append(event("error", {"error": error_json(
                    failed.message or "The request failed.",
                    failed.status_code or 500)["error"]}))
            elif kind == "reasoning":
                if open_kind != "thinking":
                    frames += start("thinking", {"type": "thinking", "thinking": "",
                                                 "signature": ""})
                frames.append(event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": piece[1]}}))
            elif kind == "content":
                if piece[1]:
                    if open_kind != "text":
                        frames += start("text", {"type": "text", "text": ""})
                    frames.append(event("content_block_delta", {"index": index, "delta": {
                        "type": "text_delta", "text": piece[1]}}))
            elif kind == "calls":
                for call in piece[1]:
                    frames += start("tool_use", {"type": "tool_use", "id": call.id,
                                                 "name": call.name, "input": {}})
                    frames.append(event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(call_arguments(call),
                                                   ensure_ascii=False)}}))
            else:                           # finish
                if index < 0:               # no block at all: an empty text block
                    frames += start("text", {"type": "text", "text": ""})
                frames += close()
                last = state.last
                frames.append(event("message_delta", {
                    "delta": {"stop_reason": stop_reason(piece[1], piece[2]),
                              "stop_sequence": _stop_sequence(last)},
                    "usage": {"input_tokens": last.prompt_tokens,
                              "output_tokens": last.completion_tokens}}))
                frames.append(event("message_stop", {}))
            for frame in frames:
                yield frame


def _stop_sequence(last) -> str | None:
    f = last.finish
    return f.matched_str if f is not None and f.type == "stop" else None
