"""POST /tokenize and /detokenize (also under /v1/): the model's tokenizer over HTTP, in
SGLang's shapes, with vLLM's chat form accepted too.

    /tokenize    {"prompt": str | [str, ...], "add_special_tokens": true}
                 or {"messages": [...], "add_generation_prompt": true} (the chat template)
              -> {"tokens": [ids] | [[ids], ...], "count": n | [n, ...], "max_model_len": N}
    /detokenize  {"tokens": [ids] | [[ids], ...], "skip_special_tokens": false}
              -> {"text": str | [str, ...], "prompt": the same (vLLM's name)}

The tokenizer is the tokenizer workers' own (tokenization/prompts.py: the same files, the
same chat template and the same length bound), loaded in this process on the first call (it
is torch-free), and run off the event loop on one thread, one call at a time. A call's
memory is its body and its answer: each prompt's ids are written out as JSON as soon as
they are known (never all held as Python ints), and the heap a big answer freed is handed
back to the system (TRIM_AFTER). `model`, when given, must name the served model
(or be "default", as SGLang accepts).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api_proc.boundary import BadRequest, dumps, error_response, read_json
from wire.messages import ChatMessage, GenerateRequest
from wire.proc import return_freed_heap
from wire.server_args import ServerConfig

MAX_PROMPTS = 1024          # prompts (or id lists) in one call


class TokenizeHandler:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._tokenizer = None
        self._lock = threading.Lock()
        # One thread does the work, one call at a time (as the tokenizer worker does, and
        # SGLang's tokenizer manager): calls in parallel threads held their working sets at
        # once, and glibc kept the heaps those threads freed.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=["POST"])
                for prefix in ("", "/v1")
                for path, handler in ((f"{prefix}/tokenize", self.tokenize),
                                      (f"{prefix}/detokenize", self.detokenize))]

    def tokenizer(self):
        """The tokenizer workers' Tokenizer, built on first use (in a worker thread)."""
        with self._lock:
            if self._tokenizer is None:
                from tokenization.prompts import Tokenizer
                self._tokenizer = Tokenizer.of(self.config)
            return self._tokenizer

    async def _body(self, request: Request) -> dict:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        model = body.get("model")
        if model is not None and model not in ("default", self.config.served_model_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404)
        return body

    async def _answer(self, request: Request, work) -> Response:
        """Read and check the body, run work(body) off the event loop (it returns the JSON
        answer's bytes), answer them; the client's mistakes are 4xx with their message."""
        from tokenization.prompts import RequestError
        try:
            body = await self._body(request)
            content = await asyncio.get_running_loop().run_in_executor(
                self._worker, _then_trim, work, body)
        except BadRequest as e:
            return error_response(str(e), e.status)
        except RequestError as e:
            return error_response(str(e), 400)
        return Response(content, media_type="application/json")

    async def count(self, req: GenerateRequest) -> int:
        """The prompt tokens of a request, as the tokenizer workers count them (its chat
        template, tools and images included); BadRequest for what they would refuse."""
        from tokenization.prompts import RequestError

        def work() -> int:
            return len(self.tokenizer().tokenize(req).input_ids)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, work)
        except RequestError as e:
            raise BadRequest(str(e)) from None

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self._tokenize)

    def _tokenize(self, body: dict) -> bytes:
        """The answer, written as it is worked out: each prompt's ids become JSON text as
        soon as they are known, so a batch holds its answer's bytes (~3 times, at the
        peak), never all its ids as Python ints (~36 bytes a token; with their JSON text,
        ~15 times the answer)."""
        tail = b',"max_model_len":%d}' % self.config.context_length
        ids = self._token_ids(body)
        if isinstance(ids, list):
            return b'{"tokens":%s,"count":%d%s' % (_json(ids), len(ids), tail)
        parts, counts = [b'{"tokens":['], []
        for one in ids:
            parts += (_json(one), b",")
            counts.append(len(one))
        parts[-1:] = [b'],"count":', _json(counts), tail]        # the last "," off
        return b"".join(parts)

    def _token_ids(self, body: dict):
        """One prompt's (or the chat form's) ids, or an iterator over a batch's."""
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
            return (tok.encode(p, add_special_tokens=special) for p in prompt)
        raise BadRequest(f"prompt must be a string or a list of 1 to {MAX_PROMPTS} strings.")

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self._detokenize)

    def _detokenize(self, body: dict) -> bytes:
        text = _json(self._texts(body))           # once, for both names
        return b'{"text":%s,"prompt":%s}' % (text, text)

    def _texts(self, body: dict) -> str | list[str]:
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


TRIM_AFTER = 1 << 20        # an answer this big: the heap it freed goes back to the system


def _then_trim(work, body: dict) -> bytes:
    """work(body); after a big answer, glibc's malloc_trim (where there is one): the process
    otherwise keeps the heap the call freed (4 x 1,024 x 7 KB: 36 MB more)."""
    content = work(body)
    if len(content) > TRIM_AFTER:
        return_freed_heap()
    return content


def _json(value) -> bytes:
    return dumps(value).encode("utf-8")


def _ids(value, vocab: int) -> bool:
    return isinstance(value, list) and all(
        type(t) is int and 0 <= t < vocab for t in value)


def _messages(value) -> list[ChatMessage]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in value):
        raise BadRequest("messages must be a non-empty list of {role, content} objects with "
                         "string values.")
    return [ChatMessage(m["role"], m["content"]) for m in value]
