"""Tokenizer worker: turns GenerateRequests into TokenizedRequests for the scheduler.

Validation that needs token counts lives here (context length, vocabulary range); a
rejected request goes straight back to the API as a terminal output with status 400, the
same path as any other output. Aborts pass through to the scheduler in order.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

from wire.addresses import Addresses
from wire.messages import (AbortRequest, FinishReason, FlushCacheRequest, GenerateRequest,
                           TextBatch, TextOutput, TokenizedRequest)
from wire.proc import run_child
from wire.server_args import ServerArgs
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the client got wrong; its message is shown to the client."""


def load_chat_template(arg: str | None) -> str | None:
    """--chat-template is a file path or the template itself."""
    if arg is None:
        return None
    path = Path(arg)
    return path.read_text() if path.is_file() else arg


class Tokenizer:
    def __init__(self, tokenizer_path: str, vocab_size: int, context_len: int,
                 chat_template: str | None = None):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(tokenizer_path)
        if chat_template is not None:
            self.tok.chat_template = chat_template
        self.vocab_size = vocab_size
        self.context_len = context_len

    def apply_chat_template(self, messages) -> list[int]:
        if not self.tok.chat_template:
            raise RequestError("This model has no chat template; pass --chat-template.")
        try:
            out = self.tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True, tokenize=True)
        except Exception as e:   # jinja raises its own types (e.g. raise_exception in templates)
            raise RequestError(f"The chat template failed on these messages: {e}") from None
        # transformers returns a list, or a BatchEncoding-like mapping in some versions.
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        if req.messages is not None:
            ids = self.apply_chat_template(req.messages)
        elif req.input_ids is not None:
            ids = req.input_ids
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"Token id {bad} in input_ids is outside the vocabulary "
                                   f"[0, {self.vocab_size}).")
        else:
            ids = self.tok.encode(req.text)
        if not ids:
            raise RequestError("The input is empty.")
        n, s = len(ids), req.sampling
        if req.fit_context and n + s.max_new_tokens >= self.context_len:
            room = max(self.context_len - n - 1, 0)
            s = replace(s, max_new_tokens=room, min_new_tokens=min(s.min_new_tokens, room))
        if n >= self.context_len:
            raise RequestError(f"The input ({n} tokens) is longer than the model's context "
                               f"length ({self.context_len} tokens).")
        if n + s.max_new_tokens >= self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {n + s.max_new_tokens} "
                f"tokens: {n} tokens from the input messages and {s.max_new_tokens} tokens for "
                f"the completion. Please reduce the number of tokens in the input messages or "
                f"the completion to fit within the limit.")
        bad = next((t for t in s.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids contains {bad}, outside the vocabulary "
                               f"[0, {self.vocab_size}).")
        try:
            s.verify_vocab(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return TokenizedRequest(rid=req.rid, input_ids=ids, sampling=s, stream=req.stream,
                                logprob=req.logprob)


def main(args: ServerArgs, addrs: Addresses, conn: Connection) -> None:
    def body(ready) -> None:
        from scheduler_proc.models.config import ModelConfig
        config = ModelConfig.from_dir(args.model_path)
        tokenizer = Tokenizer(args.resolved_tokenizer_path, config.vocab_size,
                              args.context_length, load_chat_template(args.chat_template))
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.tokenizer)
        to_scheduler = Outbox(ctx, addrs.scheduler)
        to_api = Outbox(ctx, addrs.api)
        ready()
        while True:
            for msg in inbox.recv(timeout_ms=None):
                if isinstance(msg, (AbortRequest, FlushCacheRequest)):
                    to_scheduler.send(msg)      # control messages pass through, in order
                    continue
                if not isinstance(msg, GenerateRequest):
                    log.error("unexpected message %s", type(msg).__name__)
                    continue
                try:
                    to_scheduler.send(tokenizer.tokenize(msg))
                except RequestError as e:
                    reject = FinishReason("abort", message=str(e), status_code=400)
                    to_api.send(TextBatch([TextOutput(msg.rid, "", [], reject)]))
    run_child("tokenizer", args.log_level, conn, body)
