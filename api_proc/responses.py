"""The OpenAI Responses dialect: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/input_tokens.

A Responses body is translated to the chat core's form (api_proc/chat.py); its reply is
rendered as a `response` object whose `output` holds a `reasoning` item (with
--reasoning-parser, when the output thought), a `message` item with one `output_text` part,
and `function_call` items; a stream is Responses' typed event sequence (`response.created`,
`response.in_progress`, per item `response.output_item.added` ... `.done`, with
`response.content_part.*`, `response.output_text.delta/.done`,
`response.reasoning_text.delta/.done`, `response.function_call_arguments.delta/.done`, then
`response.completed` or `response.incomplete`), every event numbered (`sequence_number`).

Translation (what is taken, what is refused):
- `input`: a string (one user message) or items: messages (roles user, assistant, system,
  developer; content a string or input_text / output_text / input_image parts),
  `function_call` and `function_call_output` items; `reasoning` items are dropped; other
  item types (item_reference, ...) are a 400. `instructions` is a system message first.
- `tools`: function tools only (web_search, file_search, ... are refused); `tool_choice`
  "auto" / "none" / "required" / {"type": "function", "name"}: as the chat form's ("auto"
  needs --tool-call-parser).
- `max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object,
  json_schema), `reasoning` (accepted; effort "none" sets the template variable
  enable_thinking false), `metadata` (echoed), SGLang's `regex` / `ebnf`.
- `store` (default true) and `previous_response_id`: a stored response keeps its whole
  conversation (earlier turns, its input, its output as an assistant turn; not its
  instructions, which OpenAI does not carry over either), and a follow-up is rendered after
  it, so `input_tokens` counts the earlier turns. The store is per API process (with
  --api-server-count > 1 a follow-up may reach another process: 404), bounded to
  STORE_MAX_RESPONSES responses and STORE_MAX_BYTES of JSON, the oldest dropped first.
- status "completed", or "incomplete" with incomplete_details.reason "max_output_tokens".
- `background` and `conversation` (the Conversations API) are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, dumps, read_json
from api_proc.chat import (CONSTRAINT_EXTRAS, ChatCore, OpenAIError, ParsedOpenAI, Reply,
                           pieces, reply)
from api_proc.openai_api import error_json, error_response
from api_proc.state import RequestState, SubmitError
from api_proc.streaming import SSEResponse

STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 << 20
ECHOED = ("instructions", "max_output_tokens", "metadata", "previous_response_id",
          "reasoning", "temperature", "text", "tool_choice", "tools", "top_p")


class ResponseStore:
    """Stored responses: id -> (the response object, its conversation in the chat form),
    oldest first; bounded in count and in bytes."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES,
                 max_bytes: int = STORE_MAX_BYTES):
        self.items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.max_responses, self.max_bytes, self.bytes = max_responses, max_bytes, 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(dumps(response)) + len(dumps(conversation))
        self.items[response["id"]] = (response, conversation, size)
        self.bytes += size
        while len(self.items) > self.max_responses or self.bytes > self.max_bytes:
            self.bytes -= self.items.popitem(last=False)[1][2]

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        item = self.items.get(rid)
        return None if item is None else item[:2]

    def delete(self, rid: str) -> bool:
        item = self.items.pop(rid, None)
        if item is not None:
            self.bytes -= item[2]
        return item is not None


# ---- request: Responses body -> chat form -----------------------------------------------------

def _parts(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where}.content must be a string or a list of parts.",
                          param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise OpenAIError(f"{where}: only input_text, output_text and input_image (with "
                              f"an image_url) parts are supported, got {json.dumps(kind)}.",
                              param="input")
    return parts


def _input_messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise OpenAIError("input must be a string or a non-empty list of items.", param="input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system",
                                                      "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _parts(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise OpenAIError(f"{where}: a function_call needs string call_id, name and "
                                  f"arguments.", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise OpenAIError(f"{where}: a function_call_output needs a string call_id "
                                  f"and output.", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else
                        "\n".join(p.get("text", "") for p in output if isinstance(p, dict))})
        elif kind == "reasoning":
            continue
        else:
            raise OpenAIError(f"{where}: items of type {json.dumps(kind)} are not supported "
                              f"(message, function_call, function_call_output, reasoning).",
                              param="input")
    return out


def _tools(body: dict) -> dict:
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise OpenAIError("tools must be a list.", param="tools")
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or \
                    not isinstance(t.get("name"), str):
                raise OpenAIError(f"tools[{i}]: only function tools ({{\"type\": \"function\", "
                                  f"\"name\", \"parameters\"}}) are supported.", param="tools")
            functions.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}})
        out["tools"] = functions
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError("tool_choice must be \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}.", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else False
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise OpenAIError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                      "or {\"type\": \"json_schema\", \"name\", \"schema\"}.", param="text")


def to_chat(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat form, the conversation it continues with: history + this input)."""
    conversation = history + _input_messages(body.get("input"))
    messages = list(conversation)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise OpenAIError("instructions must be a string.", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            "max_tokens": body.get("max_output_tokens"),
                            "stream": body.get("stream"), "temperature": body.get("temperature"),
                            "top_p": body.get("top_p"), "response_format": _format(body),
                            "priority": body.get("priority"),     # as on chat completions
                            **{k: body.get(k) for k in CONSTRAINT_EXTRAS}, **_tools(body)}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise OpenAIError("reasoning must be an object.", param="reasoning")
        if reasoning.get("effort") == "none":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat, conversation


# ---- reply: chat core -> response object ------------------------------------------------------

def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str, item_id: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call, item_id: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(r: Reply) -> list[dict]:
    items = []
    if r.reasoning:
        items.append(reasoning_item(r.reasoning, _item_id("rs")))
    if r.content or not r.calls:
        items.append(message_item(r.content or "", _item_id("msg")))
    items += [call_item(c, _item_id("fc")) for c in r.calls]
    return items


def assistant_turn(items: list[dict]) -> list[dict]:
    """The output as the conversation's next turn (chat form; reasoning is dropped)."""
    text = "".join(p["text"] for it in items if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None,
             **({"tool_calls": calls} if calls else {})}]


class ResponsesHandler:
    def __init__(self, core: ChatCore, send_timeout: float):
        self.core = core
        self.send_timeout = send_timeout
        self.store = ResponseStore()

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
                Route("/v1/responses/{rid}", self.get, methods=["GET"]),
                Route("/v1/responses/{rid}", self.delete, methods=["DELETE"])]

    def _parse(self, body: Any) -> tuple[dict, ParsedOpenAI, list[dict]]:
        if not isinstance(body, dict):
            raise OpenAIError("The request body must be a JSON object.")
        history: list[dict] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                raise OpenAIError(f"Previous response with id '{previous}' not found.", 404,
                                  "previous_response_id")
            history = stored[1]
        for key in ("background", "conversation"):
            if body.get(key):
                raise OpenAIError(f"{key} is not supported: a response is made while the "
                                  f"request waits (use store and previous_response_id for "
                                  f"conversations).", param=key)
        if body.get("store") is not None and type(body["store"]) is not bool:
            raise OpenAIError("store must be a boolean.", param="store")
        chat, conversation = to_chat(body, history)
        return body, self.core.parse(chat), conversation

    async def input_tokens(self, request: Request) -> Response:
        try:
            _, parsed, _ = self._parse(await read_json(request))
            n = await self.core.input_tokens(parsed)
        except OpenAIError as e:
            return error_response(str(e), e.status, e.param)
        except BadRequest as e:
            return error_response(str(e), e.status)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    async def get(self, request: Request) -> Response:
        stored = self.store.get(request.path_params["rid"])
        if stored is None:
            return error_response(f"Response with id '{request.path_params['rid']}' not "
                                  f"found.", 404)
        return JSONResponse(stored[0])

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["rid"]
        if not self.store.delete(rid):
            return error_response(f"Response with id '{rid}' not found.", 404)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def create(self, request: Request) -> Response:
        try:
            body, parsed, conversation = self._parse(await read_json(request))
            (state,) = await self.core.start(request, parsed, "responses")
        except OpenAIError as e:
            return error_response(str(e), e.status, e.param)
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        head = {"id": "resp_" + uuid.uuid4().hex, "object": "response",
                "created_at": int(time.time()), "model": parsed.model(self.core.model_id),
                "parallel_tool_calls": True, "store": body.get("store") is not False,
                **{k: body.get(k) for k in ECHOED}}
        head["tool_choice"] = head["tool_choice"] or "auto"
        head["tools"] = head["tools"] or []
        early = await self.core.settled(request, parsed, state, error_response)
        if early is not None:
            return early
        if not parsed.stream:
            r = reply(parsed, state)
            return JSONResponse(self._finish(head, state, r.finish, output_items(r),
                                             conversation))
        return SSEResponse(self._events(head, parsed, state, conversation), self.send_timeout)

    def _finish(self, head: dict, state: RequestState, reason: str | None,
                items: list[dict], conversation: list[dict]) -> dict:
        """The whole response object; stored when asked to be."""
        last = state.last
        response = {**head, "status": "incomplete" if reason == "length" else "completed",
                    "incomplete_details": {"reason": "max_output_tokens"}
                    if reason == "length" else None, "error": None, "output": items,
                    "usage": {"input_tokens": last.prompt_tokens,
                              "input_tokens_details": {"cached_tokens": last.cached_tokens},
                              "output_tokens": last.completion_tokens,
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": last.prompt_tokens + last.completion_tokens}}
        if head["store"]:
            self.store.put(response, conversation + assistant_turn(items))
        return response

    async def _events(self, head: dict, parsed: ParsedOpenAI, state: RequestState,
                      conversation: list[dict]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        pending = {**head, "status": "in_progress", "output": [], "usage": None,
                   "incomplete_details": None, "error": None}
        yield event("response.created", response=pending)
        yield event("response.in_progress", response=pending)
        items: list[dict] = []
        open_item: dict | None = None           # the reasoning or message item being written

        def close() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            it, open_item = open_item, None
            i, text = len(items) - 1, it["content"][0]["text"]
            if it["type"] == "reasoning":
                return [event("response.reasoning_text.done", item_id=it["id"],
                              output_index=i, content_index=0, text=text),
                        event("response.output_item.done", output_index=i, item=it)]
            it["status"] = "completed"
            return [event("response.output_text.done", item_id=it["id"], output_index=i,
                          content_index=0, text=text, logprobs=[]),
                    event("response.content_part.done", item_id=it["id"], output_index=i,
                          content_index=0, part=it["content"][0]),
                    event("response.output_item.done", output_index=i, item=it)]

        def start(it: dict) -> list[str]:
            nonlocal open_item
            frames = close()
            items.append(it)
            open_item = it
            i, part = len(items) - 1, it["content"][0]
            shown = {**it, "content": []}
            frames.append(event("response.output_item.added", output_index=i, item=shown))
            if it["type"] == "message":
                frames.append(event("response.content_part.added", item_id=it["id"],
                                    output_index=i, content_index=0, part={**part, "text": ""}))
            return frames

        async for piece in pieces(self.core.dispatcher, parsed, state):
            kind, frames = piece[0], []
            if kind == "keepalive":
                frames.append(": keep-alive\n\n")
            elif kind == "error":
                failed = piece[1]
                frames.append(event("error", **error_json(
                    failed.message or "The request failed.", failed.status_code or 500)
                    ["error"]))
            elif kind in ("reasoning", "content") and piece[1]:
                want = "reasoning" if kind == "reasoning" else "message"
                if open_item is None or open_item["type"] != want:
                    frames += start(reasoning_item("", _item_id("rs")) if want == "reasoning"
                                    else {**message_item("", _item_id("msg"), "in_progress")})
                open_item["content"][0]["text"] += piece[1]
                frames.append(event("response.reasoning_text.delta" if want == "reasoning"
                                    else "response.output_text.delta",
                                    item_id=open_item["id"], output_index=len(items) - 1,
                                    content_index=0, delta=piece[1],
                                    **({} if want == "reasoning" else {"logprobs": []})))
            elif kind == "calls":
                frames += close()
                for call in piece[1]:
                    it = call_item(call, _item_id("fc"))
                    items.append(it)
                    i = len(items) - 1
                    frames += [
                        event("response.output_item.added", output_index=i,
                              item={**it, "arguments": "", "status": "in_progress"}),
                        event("response.function_call_arguments.delta", item_id=it["id"],
                              output_index=i, delta=call.arguments),
                        event("response.function_call_arguments.done", item_id=it["id"],
                              output_index=i, name=call.name, arguments=call.arguments),
                        event("response.output_item.done", output_index=i, item=it)]
            elif kind == "finish":
                if not items:                   # nothing written: an empty message
                    frames += start(message_item("", _item_id("msg"), "in_progress"))
                frames += close()
                done = self._finish(head, state, piece[1], items, conversation)
                frames.append(event("response.incomplete" if done["status"] == "incomplete"
                                    else "response.completed", response=done))
            for frame in frames:
                yield frame
