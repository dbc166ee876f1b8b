"""The Ollama dialect: GET /api/tags, /api/ps, /api/version; POST /api/show, /api/chat,
/api/generate, /api/embed and the older /api/embeddings.

/api/chat and /api/generate are translated to the chat core's form (api_proc/chat.py) and
answered as Ollama does: NDJSON lines by default (`{"model", "created_at", "message" |
"response", "done": false}` per piece of text or thinking), one JSON object with
`"stream": false`; the last object has `done: true`, `done_reason` ("stop", "length"),
`prompt_eval_count`, `eval_count` and the durations in nanoseconds (total = end to end,
prompt_eval = to the first token, eval = the rest; load_duration 0: the model is always
loaded). Errors are `{"error": message}` with the HTTP status; a failure once a stream has
started is a last line `{"error": ...}` (what the ollama client raises on).

Translation (what is taken, what is refused):
- Model names as Ollama clients send them: the served model's name, or "default", with or
  without a `:tag` (`name:latest`); /api/tags lists it as `<served name>:latest`.
- `messages` (roles system, user, assistant, tool; `images` as base64; an assistant's
  `tool_calls` with object arguments), `tools` (OpenAI's shape, as Ollama takes it; calls
  are parsed from the output with --tool-call-parser), `format` ("json" or a JSON schema),
  `think` (false sets the template variable enable_thinking false; with
  --reasoning-parser the reasoning goes to `thinking`), `options`: temperature, top_p,
  top_k, min_p, num_predict (-1 or -2: until the context ends; more than the context
  leaves is lowered to that, as Ollama does), stop, seed, repeat_penalty,
  presence_penalty, frequency_penalty (others, num_ctx among them, are ignored).
- /api/generate: `prompt` and `system` rendered with the chat template (as Ollama renders
  its template); `raw`, `template`, `suffix` and `context` are refused. An empty prompt
  (or empty messages on /api/chat) is Ollama's "load" request: `done_reason: "load"`.
- /api/embed (`input`: a string or a list of strings) and /api/embeddings (`prompt`) answer
  the served model's embeddings (api_proc/embeddings.py: --pooling, L2-normalized, the
  older route's too); an input longer than the context is a 400 (`truncate` is not done),
  `dimensions` is refused.
- `keep_alive` is accepted and ignored.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, dumps, read_json
from api_proc.chat import ChatCore, OpenAIError, ParsedOpenAI, call_arguments, pieces, reply
from api_proc.embeddings import MAX_INPUTS, EmbeddingsHandler
from api_proc.state import RequestState, SubmitError
from api_proc.streaming import SSEResponse

OLLAMA_VERSION = "0.14.0"       # the Ollama API level answered on /api/version
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "num_predict": "max_tokens", "stop": "stop", "seed": "seed",
           "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}
NS = 1_000_000_000


def error_response(message: str, status: int = 400) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---- request: Ollama body -> chat form --------------------------------------------------------

def _sampling(body: dict) -> dict:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("options must be an object.")
    out = {OPTIONS[k]: v for k, v in options.items() if k in OPTIONS and v is not None}
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]           # -1 / -2: until the context ends
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest("format must be \"json\" or a JSON schema object.")
    think = body.get("think")
    if think is False:
        out["chat_template_kwargs"] = {"enable_thinking": False}
    elif think not in (None, True, "low", "medium", "high"):
        raise BadRequest("think must be a boolean or \"low\", \"medium\", \"high\".")
    return out


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"messages[{i}] must be an object with role system, user, assistant "
                         f"or tool.")
    content = m.get("content", "")
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string.")
    images = m.get("images") or []
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise BadRequest(f"messages[{i}].images must be a list of base64 strings.")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    if images:
        out["content"] = [{"type": "text", "text": content}] + [
            {"type": "image_url", "image_url": {"url": x}} for x in images]
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise BadRequest(f"messages[{i}].tool_calls must be a list of {{\"function\": "
                             f"{{\"name\", \"arguments\"}}}}.")
        out["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function", "function": {
            "name": c["function"]["name"],
            "arguments": json.dumps(c["function"].get("arguments") or {}, ensure_ascii=False)}}
            for k, c in enumerate(calls)]
    return out


def chat_body(body: dict, model: str | None) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise BadRequest("messages must be a list.")
    tools = body.get("tools") or None
    return {"model": model, "messages": [_message(m, i) for i, m in enumerate(messages)],
            "tools": tools, "stream": body.get("stream", True) is not False,
            "priority": body.get("priority"), **_sampling(body)}


def generate_body(body: dict, model: str | None) -> dict:
    for key in ("raw", "template", "suffix", "context"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported: the prompt is rendered with the "
                             f"model's chat template.")
    prompt, system = body.get("prompt", ""), body.get("system")
    if not isinstance(prompt, str) or not (system is None or isinstance(system, str)):
        raise BadRequest("prompt and system must be strings.")
    images = body.get("images") or []
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt, "images": images}]
    return chat_body({**body, "messages": messages}, model)


# ---- the routes -------------------------------------------------------------------------------

class OllamaHandler:
    def __init__(self, core: ChatCore, embeddings: EmbeddingsHandler, send_timeout: float):
        self.core = core
        self.embeddings = embeddings
        self.send_timeout = send_timeout
        config = core.config
        self.name = f"{core.model_id}:latest"
        self.digest = hashlib.sha256(core.model_id.encode()).hexdigest()
        path = Path(config.model_path)
        files = [path] if path.is_file() else list(path.glob("*.safetensors")) + \
            list(path.glob("*.gguf"))
        self.size = sum(f.stat().st_size for f in files if f.is_file())
        self.modified = _now()
        arch = config.model.architecture
        self.details = {"parent_model": "", "format": "gguf" if path.suffix == ".gguf"
                        else "safetensors", "family": arch, "families": [arch],
                        "parameter_size": "", "quantization_level": ""}

    def routes(self) -> list[Route]:
        return [Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/version", self.version, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/embed", self.embed, methods=["POST"]),
                Route("/api/embeddings", self.embed, methods=["POST"])]

    def _model(self, body: Any, adapters: bool = False) -> str:
        """The served model's id for the name a client sent (404 for any other); adapters:
        (the generation routes, --enable-lora) another name is a LoRA adapter's, its tag
        dropped (the scheduler refuses one that is not loaded: 404)."""
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        name = body.get("model", body.get("name"))
        base = name.split(":", 1)[0] if isinstance(name, str) else None
        if base in (self.core.model_id, "default"):
            return self.core.model_id
        if base and adapters and self.core.config.args.enable_lora:
            return base
        raise BadRequest(f"model '{name}' not found", 404)

    def _card(self) -> dict:
        return {"name": self.name, "model": self.name, "modified_at": self.modified,
                "size": self.size, "digest": self.digest, "details": self.details}

    async def tags(self, _: Request) -> Response:
        adapters = [{**self._card(), "name": f"{n}:latest", "model": f"{n}:latest",
                     "details": {**self.details, "parent_model": self.name}}
                    for n in self.core.dispatcher.lora_adapters]
        return JSONResponse({"models": [self._card(), *adapters]})

    async def ps(self, _: Request) -> Response:
        return JSONResponse({"models": [{**self._card(), "expires_at": "9999-12-31T00:00:00Z",
                                         "size_vram": 0,
                                         "context_length": self.core.config.context_length}]})

    async def version(self, _: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request) -> Response:
        try:
            self._model(await read_json(request))
        except BadRequest as e:
            return error_response(str(e), e.status)
        config, args = self.core.config, self.core.config.args
        arch = config.model.architecture
        capabilities = ["completion"] + (["tools"] if args.tool_call_parser else []) + \
            (["thinking"] if args.reasoning_parser else []) + \
            (["vision"] if config.model.image_token_id is not None else [])
        return JSONResponse({
            "modelfile": f"FROM {config.model_path}\n", "parameters": "", "template": "",
            "details": self.details, "modified_at": self.modified,
            "model_info": {"general.architecture": arch,
                           f"{arch}.context_length": config.context_length},
            "capabilities": capabilities})

    async def embed(self, request: Request) -> Response:
        """/api/embed {"input": text or texts} -> {"embeddings"}; the older /api/embeddings
        {"prompt": text} -> {"embedding"}."""
        legacy = request.url.path.endswith("/embeddings")
        started = time.monotonic()
        try:
            body = await read_json(request)
            self._model(body)
            inputs = body.get("prompt" if legacy else "input")
            if isinstance(inputs, str):
                inputs = [inputs]
            if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_INPUTS or \
                    not all(isinstance(x, str) and x for x in inputs):
                raise BadRequest(("prompt must be a non-empty string." if legacy else
                                  f"input must be a non-empty string or a list of 1 to "
                                  f"{MAX_INPUTS} non-empty strings."))
            if body.get("dimensions") is not None:
                raise BadRequest("dimensions is not supported: the embeddings have the "
                                 "model's hidden size.")
            vectors, tokens = await self.embeddings.embed(request, inputs, "ollama_embed")
        except BadRequest as e:
            return error_response(str(e), e.status)
        if legacy:
            return JSONResponse({"embedding": vectors[0]})
        return JSONResponse({"model": self.name, "embeddings": vectors,
                             "total_duration": int((time.monotonic() - started) * NS),
                             "load_duration": 0, "prompt_eval_count": tokens})

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def generate(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            model = self._model(body, adapters=True)
            form = chat_body(body, model) if chat else generate_body(body, model)
            if chat and not form["messages"] or not chat and not body.get("prompt"):
                return JSONResponse(self._line(chat, "", done=True, done_reason="load"))
            parsed = self.core.parse(form, cap_max_tokens=True)
            (state,) = await self.core.start(request, parsed, "ollama_chat" if chat
                                             else "ollama_generate")
        except OpenAIError as e:
            return error_response(str(e), e.status)
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        early = await self.core.settled(request, parsed, state, error_response)
        if early is not None:
            return early
        if not parsed.stream:
            r = reply(parsed, state)
            return JSONResponse(self._line(chat, r.content or "", r.reasoning, r.calls,
                                           **self._done(state, r.finish)))
        return SSEResponse(self._lines(chat, parsed, state), self.send_timeout,
                           media_type="application/x-ndjson")

    def _line(self, chat: bool, text: str, thinking: str | None = None, calls=(),
              **extra) -> dict:
        out: dict[str, Any] = {"model": self.name, "created_at": _now()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [{"function": {
                    "name": c.name, "arguments": call_arguments(c)}} for c in calls]
            out["message"] = message
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        return {**out, "done": False, **extra}

    def _done(self, state: RequestState, reason: str | None) -> dict:
        t, last = state.timing, state.last
        total = t.e2e_latency or 0.0
        first = t.first_token_latency or total
        return {"done": True, "done_reason": "length" if reason == "length" else "stop",
                "total_duration": int(total * NS), "load_duration": 0,
                "prompt_eval_count": last.prompt_tokens,
                "prompt_eval_duration": int(first * NS),
                "eval_count": last.completion_tokens,
                "eval_duration": int((total - first) * NS)}

    async def _lines(self, chat: bool, parsed: ParsedOpenAI, state: RequestState
                     ) -> AsyncIterator[str]:
        async for piece in pieces(self.core.dispatcher, parsed, state):
            kind = piece[0]
            if kind == "reasoning":
                line = self._line(chat, "", piece[1])
            elif kind == "content" and piece[1]:
                line = self._line(chat, piece[1])
            elif kind == "calls":
                line = self._line(chat, "", calls=piece[1])
            elif kind == "finish":
                line = self._line(chat, "", **self._done(state, piece[1]))
            elif kind == "error":
                line = {"error": piece[1].message or "The request failed."}
            else:               # nothing to show: keep-alive (the ollama client would
                continue        # choke on a blank line) or a logprobs-only piece
            yield dumps(line) + "\n"
