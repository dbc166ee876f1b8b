"""The OpenAI dialect: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

A body becomes one GenerateRequest per prompt per sample (n=1 each; choice index =
prompt * n + sample), built through `SamplingParams.from_json` so a bad value gets SGLang's
message, as on /generate. Errors use OpenAI's nested shape with the right HTTP status.
Chat bodies are the chat core's own form (api_proc/chat.py: parsing, tools, reasoning,
structured outputs, the choices made there); this module renders its replies and deltas
in OpenAI's shapes, and does completions.

Each choice is its request's RequestState (`_Choice` adds the index), which accumulates
the text, ids and logprobs; streams send what arrived since their previous chunk.

Choices made where OpenAI, vLLM and SGLang leave room (README lists them):
- GET /v1/models/{id} answers the served model's card.
- completions: `max_tokens` null means 16, OpenAI's default; `suffix` and best_of != n
  are a 400; `response_format` and SGLang's `regex` / `ebnf` / `json_schema` work as on chat.
- Chat: tool calls answer `tool_calls` with finish_reason "tool_calls"; a streamed call
  comes as one `tool_calls` delta once whole; --reasoning-parser text goes to
  `reasoning_content`.
- finish_reason: length -> "length", stop -> "stop" (plus SGLang's `matched_stop`), an abort
  with no HTTP status (e.g. /abort_request) -> "abort"; an abort with a status is an error
  response, or an `{"error": ...}` event in a stream that has started.
- Logprobs: at most 20. Completions' `top_logprobs` dicts hold the top k plus the sampled
  token (vLLM), so `logprobs: 0` gives the sampled token only. `echo` with `logprobs` also
  returns the prompt's logprobs (first one null), as vLLM. -inf is sent as -9999.0 (JSON
  has no infinity).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, read_json
from api_proc.chat import (ChatCore, Deltas, OpenAIError, ParsedOpenAI, bool_field,
                           check_model, is_ids, finish_reason, logprobs_num, matched_stop,
                           openai_priority, parse_chat, reject_unsupported, reply,
                           sampling_params, stream_options)
from api_proc.pipeline import Prompt, expand, settle
from api_proc.state import Dispatcher, RequestState, SubmitError
from api_proc.streaming import DONE, KEEPALIVE, SSEResponse, changes, sse
from wire.messages import LogprobRequest, Logprobs, TextOutput
from wire.server_args import ServerConfig

__all__ = ["OpenAIHandler", "OpenAIError", "parse_chat", "parse_completion", "error_json",
           "error_response"]

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MIN_LOGPROB = -9999.0

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError",
               403: "PermissionDeniedError", 404: "NotFoundError", 409: "ConflictError",
               422: "UnprocessableEntityError", 429: "RateLimitError",
               503: "ServiceUnavailableError"}

def error_json(message: str, status: int, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else
                           "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> Response:
    return JSONResponse(error_json(message, status, param), status_code=status)


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIError("prompt is required.", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_ids(p) for p in prompt):
            return list(prompt)
    raise OpenAIError("prompt must be a string, a non-empty list of strings, a non-empty "
                      "list of token ids, or a non-empty list of such lists.", param="prompt")


def parse_completion(body: Any, model_id: str, loras: bool = False) -> ParsedOpenAI:
    if not isinstance(body, dict):
        raise OpenAIError("The request body must be a JSON object.")
    lora = check_model(body, model_id, loras)
    reject_unsupported(body, {"suffix": lambda v: v == "",
                               "best_of": lambda v: v == body.get("n", 1) or v == 1})
    prompts = _prompts(body)
    stream = bool_field(body, "stream")
    include_usage = stream_options(body, stream)
    echo = bool_field(body, "echo")
    logprobs = None if body.get("logprobs") is None else logprobs_num(body, "logprobs")
    params = sampling_params(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    logprob_req = None
    if logprobs is not None:
        logprob_req = LogprobRequest(top_logprobs_num=logprobs, start_len=0 if echo else -1)
    base = uuid.uuid4().hex
    rids = [f"cmpl-{base}_{i}" for i in range(len(prompts) * params.n)]
    reqs, warmups = expand([Prompt(text=p) if isinstance(p, str) else Prompt(input_ids=p)
                            for p in prompts], [params] * len(prompts), rids,
                           stream=stream, logprob=logprob_req, priority=openai_priority(body),
                           lora=[lora] * len(prompts))
    return ParsedOpenAI(reqs, params.n, stream, include_usage, logprobs,
                        echo=prompts if echo else None, warmups=warmups, lora=lora)


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
    def __init__(self, config: ServerConfig, dispatcher: Dispatcher, core: ChatCore):
        self.config = config
        self.model_id = config.served_model_name
        self.dispatcher = dispatcher
        self.core = core
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

    def _adapter_card(self, name: str) -> dict:
        """A LoRA adapter (--enable-lora) is a model of its own, over the served one."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "zserve",
                "root": name, "parent": self.model_id,
                "max_model_len": self.config.context_length,
                "input_modalities": self._card()["input_modalities"]}

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            self._card(), *(self._adapter_card(n) for n in self.dispatcher.lora_adapters)]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card, or a loaded adapter's; any other
        id is a 404."""
        name = request.path_params["model"]
        if name in self.dispatcher.lora_adapters:
            return JSONResponse(self._adapter_card(name))
        if name not in (self.model_id, "default"):
            return error_response(f"The model `{name}` does not exist.", 404, "model")
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            parsed = (self.core.parse(body) if chat else
                      parse_completion(body, self.model_id, self.config.args.enable_lora))
            echo = await self._echo_texts(parsed)
            states = await self.core.start(request, parsed,
                                           "chat_completions" if chat else "completions")
        except OpenAIError as e:
            return error_response(str(e), e.status, e.param)
        except (BadRequest, SubmitError) as e:
            return error_response(str(e), getattr(e, "status", 400))
        reply = _Reply(parsed.model(self.model_id), chat, parsed, echo,
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
        self.deltas = [Deltas(parsed) for _ in choices] if chat and parsed.stream else []

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
                r = reply(self.parsed, c.state)
                message = item["message"] = {"role": "assistant", "content": r.content}
                item["logprobs"] = None if self.parsed.logprobs is None else \
                    chat_logprobs(c.logprobs)
                if self.parsed.reasoning_parser is not None and not r.forced:
                    message["reasoning_content"] = r.reasoning
                if r.calls:
                    message["tool_calls"] = [call.to_json(i) for i, call in enumerate(r.calls)]
                item["finish_reason"] = r.finish
            else:
                item["text"] = (self.echo[c.index] if self.echo else "") + c.state.text
                item["logprobs"] = self._completion_logprobs(c, c.logprobs, True)
            item.setdefault("finish_reason", finish_reason(last.finish))
            item["matched_stop"] = matched_stop(last.finish)
            items.append(item)
        return self.envelope(items, usage=self.usage())

    def chunks(self, c: _Choice, first: bool) -> list[dict]:
        """The stream chunks for what a choice received since its previous chunks (possibly
        none)."""
        new_text, _, lp = c.state.unsent()
        out = c.state.last
        finish = finish_reason(out.finish)
        if self.chat:
            return self._chat_chunks(c, out, new_text, first, lp, finish)
        text = (self.echo[c.index] if first and self.echo else "") + new_text
        if not text and finish is None and not lp.token_ids:
            return []
        item = {"index": c.index, "text": text,
                "logprobs": self._completion_logprobs(c, lp, first),
                "finish_reason": finish, "matched_stop": matched_stop(out.finish)}
        return [self.envelope([item])]

    def _chat_chunks(self, c: _Choice, out: TextOutput, text: str, first: bool,
                     lp: Logprobs, finish: str | None) -> list[dict]:
        def chunk(delta: dict, logprobs: dict | None = None, finish_reason=None,
                  matched=None) -> dict:
            return self.envelope([{"index": c.index, "delta": delta, "logprobs": logprobs,
                                   "finish_reason": finish_reason, "matched_stop": matched}])
        chunks = [chunk({"role": "assistant", "content": ""})] if first else []
        deltas = self.deltas[c.index]
        for event in deltas.feed(c.state, text, lp):
            if event[0] == "reasoning":
                chunks.append(chunk({"reasoning_content": event[1]}))
            elif event[0] == "content":
                logprobs = None if self.parsed.logprobs is None or event[2] is None else \
                    chat_logprobs(event[2])
                chunks.append(chunk({"content": event[1]}, logprobs))
            else:
                chunks.append(chunk({"tool_calls": [call.to_json(i) for i, call in
                                                    enumerate(event[1])]}))
        if finish is not None:
            reason = deltas.finish(c.state)
            chunks.append(chunk({}, None, reason,
                                None if reason == "tool_calls" else matched_stop(out.finish)))
        return chunks
