"""ServerArgs: every server setting, parsed once by launch.py and handed to each process.

It lives in wire/ because it is part of what every process agrees on at startup. Flag
names follow SGLang's where SGLang has the flag (`--model-path`, `--port`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass, field


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def _refuse(message: str) -> typing.NoReturn:
    sys.stderr.write(f"zserve: {message}\n")
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """One line, no usage dump: the mistake and where to look."""
        sys.stderr.write(f"zserve: {message} (see python launch.py --help)\n")
        sys.exit(2)


@dataclass(slots=True)
class ServerArgs:
    model_path: str | None = _opt(None, "Hugging Face model directory. Default: the built-in "
                                  "tiny demo model, built on first use.")
    tokenizer_path: str | None = _opt(None, "Tokenizer directory (default: the model path).")
    served_model_name: str | None = _opt(None, "Model id in the OpenAI API (default: the model "
                                         "path).")
    chat_template: str | None = _opt(None, "A Jinja chat template file (or inline template) "
                                     "overriding the tokenizer's.")
    host: str = _opt("127.0.0.1", "HTTP host to bind.")
    port: int = _opt(30000, "HTTP port.")
    device: str = _opt("cpu", "Device for the model: cpu or cuda.", choices=["cpu", "cuda"])
    dtype: str = _opt("auto", "Weight and activation dtype (auto: bfloat16 on cuda, float32 "
                      "on cpu).", choices=["auto", "float32", "bfloat16", "float16"])
    context_length: int | None = _opt(None, "Context length (default: the model's "
                                      "max_position_embeddings).")
    max_total_tokens: int | None = _opt(None, "KV pool size in tokens (default: from a "
                                        "memory budget).")
    mem_fraction_static: float = _opt(0.8, "On CUDA: fraction of free GPU memory (after the "
                                      "weights) for the KV pool when --max-total-tokens is "
                                      "not given. On CPU a fixed 10% of RAM is used.")
    disable_radix_cache: bool = _opt(False, "Turn the radix prefix cache off.")
    max_running_requests: int = _opt(64, "Most requests in the running batch.")
    chunked_prefill_size: int = _opt(2048, "Most prompt tokens prefilled in one step.")
    incremental_streaming_output: bool = _opt(False, "Stream only new text and ids in each "
                                              "frame instead of the cumulative output.")
    random_seed: int = _opt(0, "Seed for sampling of requests without sampling_seed.")
    # ---- limits and protection (README: "Hardening") ----
    api_key: str | None = _opt(None, "If set, every route but /health needs "
                               "'Authorization: Bearer KEY'.")
    admin_api_key: str | None = _opt(None, "Key for the routes that act on other clients' "
                                     "work (/abort_request with abort_all or a prefix, "
                                     "/flush_cache). With any key set they need this one.")
    allowed_origins: str | None = _opt(None, "Comma-separated browser origins allowed to call "
                                       "the server (CORS), or '*'. Default: none; requests "
                                       "from another origin are refused.")
    max_request_bytes: int = _opt(8 * 1024 * 1024, "Largest request body accepted; larger "
                                  "ones get 413 before they are parsed.")
    read_timeout: float = _opt(30.0, "Seconds a client may take to send a request's headers, "
                               "and then its body.")
    send_timeout: float = _opt(60.0, "Seconds a stream may wait on a client that does not "
                               "read before the request is aborted.")
    max_queued_requests: int | None = _opt(None, "Most requests waiting to run; more are "
                                           "answered 503 at once (default: no limit).")
    request_timeout: float | None = _opt(None, "Seconds a request may take, waiting plus "
                                         "running, before it is aborted with 503 (default: "
                                         "no limit).")
    watchdog_timeout: float = _opt(300.0, "Seconds the scheduler may go without finishing a "
                                   "step while it has work before the server is taken down "
                                   "(with a stack dump in the log).")
    shutdown_timeout: float = _opt(30.0, "On SIGTERM/SIGINT, seconds in-flight requests may "
                                   "take to finish before they are aborted.")
    log_level: str = _opt("info", "Log level.",
                          choices=["debug", "info", "warning", "error", "critical"])
    # ---- resolved by the launcher from the model, not flags ----
    model_source: str = field(default="", metadata={"cli": False})   # for the banner
    num_params: int = field(default=0, metadata={"cli": False})

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """Every field is a flag; its type comes from the field's annotation."""
        parser = _Parser(prog="launch.py", description="zserve: an LLM server (SGLang-style "
                         "processes over ZeroMQ).",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = {**f.metadata, "help": f.metadata["help"].replace("%", "%%")}
            kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                        if t is not type(None))
            if kind is bool:
                parser.add_argument(flag, action="store_true", **meta)
            else:
                parser.add_argument(flag, type=kind, default=f.default,
                                    metavar=f.name.upper(), **meta)
        return parser

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        args = cls(**vars(cls.parser().parse_args(argv)))
        args.check()
        return args

    def check(self) -> None:
        for name in ("port", "max_running_requests", "chunked_prefill_size",
                     "max_request_bytes", "read_timeout", "send_timeout", "watchdog_timeout"):
            if not getattr(self, name) > 0 or getattr(self, name) == float("inf"):
                _refuse(f"--{name.replace('_', '-')} must be positive")
        for name in ("max_queued_requests", "request_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                _refuse(f"--{name.replace('_', '-')} must be positive")
        if self.shutdown_timeout < 0:
            _refuse("--shutdown-timeout must not be negative")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            _refuse("--max-total-tokens must be positive")
        if not 0 < self.mem_fraction_static <= 1:
            _refuse("--mem-fraction-static must be in (0, 1]")

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model_path  # type: ignore[return-value]

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path  # type: ignore[return-value]
