"""POST /tokenize and /detokenize (also under /v1/): the model's tokenizer over HTTP, in
SGLang's shapes, with vLLM's chat form accepted too.

    /tokenize    {"prompt": str | [str, ...], "add_special_tokens": true}
                 or {"messages": [...], "add_generation_prompt": true} (the chat template)
              -> {"tokens": [ids] | [[ids], ...], "count": n | [n, ...], "max_model_len": N}
    /detokenize  {"tokens": [ids] | [[ids], ...], "skip_special_tokens": false}
              -> {"text": str | [str, ...], "prompt": the same (vLLM's name)}

The tokenizer is the tokenizer workers' own (tokenizer_proc/process.py: the same files, the
same chat template and the same length bound), loaded in this process on the first call (it
is torch-free), and run off the event loop. `model`, when given, must name the served model
(or be "default", as SGLang accepts).
"""

from __future__ import annotations

import asyncio
import threading

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, JSONResponse, error_response, read_json
from wire.messages import ChatMessage
from wire.server_args import ServerConfig

MAX_PROMPTS = 1024          # prompts (or id lists) in one call


class TokenizeHandler:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._tokenizer = None
        self._lock = threading.Lock()

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=["POST"])
                for prefix in ("", "/v1")
                for path, handler in ((f"{prefix}/tokenize", self.tokenize),
                                      (f"{prefix}/detokenize", self.detokenize))]

    def tokenizer(self):
        """The tokenizer workers' Tokenizer, built on first use (in a worker thread)."""
        with self._lock:
            if self._tokenizer is None:
                from tokenizer_proc.process import make_worker
                self._tokenizer = make_worker(self.config).tokenizer
            return self._tokenizer

    async def _body(self, request: Request) -> dict:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model not in ("default", self.config.served_model_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404)
        return body

    async def _answer(self, request: Request, work, render) -> Response:
        """Read and check the body, run work(body) off the event loop, answer
        render(result); the client's mistakes are 4xx with their message."""
        from tokenizer_proc.process import RequestError
        try:
            body = await self._body(request)
            result = await asyncio.to_thread(work, body)
        except BadRequest as e:
            return error_response(str(e), e.status)
        except RequestError as e:
            return error_response(str(e), 400)
        return JSONResponse(render(result))

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self._tokenize, lambda ids: {
            "tokens": ids, "count": [len(x) for x in ids] if _is_batch(ids) else len(ids),
            "max_model_len": self.config.context_length})

    def _tokenize(self, body: dict) -> list:
        tok = self.tokenizer()
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("Give exactly one of prompt or messages.")
        if "messages" in body:
            if body.get("add_generation_prompt", True) is not True:
                raise BadRequest("add_generation_prompt: only true is supported (the chat "
                                 "routes always add the generation prompt).")
            return tok.apply_chat_template(_messages(body["messages"]))
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise BadRequest("add_special_tokens must be a boolean.")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return tok.encode(prompt, add_special_tokens=special)
        if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS and \
                all(isinstance(p, str) for p in prompt):
            return [tok.encode(p, add_special_tokens=special) for p in prompt]
        raise BadRequest(f"prompt must be a string or a list of 1 to {MAX_PROMPTS} strings.")

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self._detokenize,
                                  lambda text: {"text": text, "prompt": text})

    def _detokenize(self, body: dict) -> str | list[str]:
        skip = body.get("skip_special_tokens", False)
        if not isinstance(skip, bool):
            raise BadRequest("skip_special_tokens must be a boolean.")
        tokens = body.get("tokens")
        vocab = self.config.vocab_size
        if _ids(tokens, vocab):
            return self.tokenizer().tok.decode(tokens, skip_special_tokens=skip)
        if isinstance(tokens, list) and tokens and len(tokens) <= MAX_PROMPTS and \
                all(_ids(t, vocab) for t in tokens):
            tok = self.tokenizer().tok
            return [tok.decode(t, skip_special_tokens=skip) for t in tokens]
        raise BadRequest(f"tokens must be a list of token ids in [0, {vocab}), or a list of "
                         f"1 to {MAX_PROMPTS} such lists.")


def _ids(value, vocab: int) -> bool:
    return isinstance(value, list) and all(
        type(t) is int and 0 <= t < vocab for t in value)


def _is_batch(ids: list) -> bool:
    return bool(ids) and isinstance(ids[0], list)


def _messages(value) -> list[ChatMessage]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        raise BadRequest("messages must be a non-empty list of {role, content} objects with "
                         "string values.")
    return [ChatMessage(m["role"], m["content"]) for m in value]
