"""Tokenizer worker: turns GenerateRequests into TokenizedRequests for the scheduler.

Validation that needs token counts lives here (context length, vocabulary range). The
tokenizer also re-checks everything else a GenerateRequest carries (sampling ranges, logprob
ranges, exactly one prompt form): its socket is a trust boundary like any other, and nothing
reaches the scheduler unchecked. A rejected request goes straight back to the API as a
terminal output with status 400, the same path as any other output; an unexpected failure
while handling one request (a bug here) ends that request with a 500 and a logged
traceback, never the process. Aborts pass through to the scheduler in order.

A json_schema, regex or ebnf constraint is checked here to compile, so a bad grammar is a
400 before the request is queued; the scheduler then compiles it over the vocabulary. The
check runs in this worker's grammar checker, a child process (grammars/checker.py: a grammar
that crashes llguidance kills only the child, and is a 400), while the worker goes on with
other requests: a request waits for its grammar's verdict in `parked` (verdicts are cached,
so a grammar seen before costs nothing), then is tokenized and sent on as any other.

With --tokenizer-worker-num N there are N such processes, each with its own inbox; the
API's one PUSH socket hands them messages in turn. Order then holds per worker only: an
abort can overtake its request through another worker (the scheduler keeps such an abort
until its request arrives: scheduler.py, early aborts), and a batch's items can reach the
scheduler in any order (the API puts outputs back in input order).

Prompts are bounded before they are tokenized: `chars_per_token_bound` derives from the
tokenizer's own definition the most characters one token can stand for, so a text longer
than that times the context length is refused without tokenizing it (a 50 MB text costs a
length check, not a minute and gigabytes).
"""

from __future__ import annotations

import json
import logging
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

from grammars.checker import Checker, Verdicts
from tokenizer_proc.hf_tokenizer import HFTokenizer
from wire.addresses import Addresses, worker_title
from wire.codec import TOKENIZER_INBOX, encode
from wire.messages import (MAX_TOP_LOGPROBS, TEMPLATE_RESERVED, AbortRequest, FinishReason,
                           FlushCacheRequest,
                           GenerateRequest, TextBatch, TextOutput, TokenizedRequest, replace)
from wire.proc import run_child
from wire.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from wire.server_args import ServerConfig
from wire.sockets import Inbox, Outbox

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 1000   # of an exception's text quoted back to a client


class RequestError(ValueError):
    """A request the client got wrong; its message is shown to the client."""


class NeedsCheck(Exception):
    """The request's grammar has no verdict yet: the worker parks it until the checker's."""

    def __init__(self, kind: str, text: str):
        super().__init__(kind)
        self.kind, self.text = kind, text


def load_chat_template(arg: str | None) -> str | None:
    """--chat-template is a file path or the template itself."""
    if arg is None:
        return None
    path = Path(arg)
    return path.read_text() if path.is_file() else arg


# ---- how many characters can one token stand for? -------------------------------------------
#
# For a Hugging Face fast tokenizer the answer follows from its tokenizer.json when each
# stage keeps (or grows) the text: every character of the normalized text then ends up in
# exactly one token, and a token covers at most len(its vocabulary string) characters
# (byte-level vocabularies spell one byte per character, so there it is at most that many
# bytes, hence characters). What a normalizer can shrink is bounded per kind below. Stages
# that can drop text without bound (strip, accent or control-character removal, whitespace
# splitters that discard, WordPiece's [UNK] for a whole word, fused unknowns, added tokens
# that swallow neighbouring whitespace) mean no bound: such texts are simply tokenized.

# Normalizers by how many input characters can become one output character. NFC/NFKC
# compose at most a canonical decomposition (at most 4 code points: e.g. U+1F82 is
# alpha + 3 marks) into one character; the others never shorten the text.
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1,
                      "ByteLevel": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation"}


def _normalizer_shrink(spec: dict | None) -> float | None:
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        if "String" not in pattern or not content:     # a regex, or a removal
            return None
        return max(1.0, len(pattern["String"]) / len(content))
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizers(spec: dict | None) -> list[dict] | None:
    """The pre-tokenizer chain if every step keeps all of the text, else None."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        out = []
        for part in spec.get("pretokenizers", []):
            chain = _pre_tokenizers(part)
            if chain is None:
                return None
            out += chain
        return out
    if spec.get("type") not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        return None
    return [spec]


def chars_per_token_bound(tok) -> float | None:
    """A number b such that, for every text t, len(tok.encode(t)) >= len(t) / b; None when
    the tokenizer's definition does not bound it (or is not a fast tokenizer's JSON)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:        # an unusual backend: no bound rather than no server
        log.warning("cannot read the tokenizer's definition; prompts are not pre-bounded")
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    chain = _pre_tokenizers(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if shrink is None or chain is None:
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in chain) or \
        (spec.get("normalizer") or {}).get("type") == "ByteLevel"
    kind = model.get("type")
    if kind == "BPE":
        # Without byte-level or byte fallback, an unknown character is an unk token (one
        # per character unless fused) or, with no unk token, dropped.
        if not (byte_level or model.get("byte_fallback")
                or (model.get("unk_token") is not None and not model.get("fuse_unk"))):
            return None
        pieces = list(model.get("vocab", {}))
    elif kind == "Unigram":
        if not (model.get("byte_fallback") or model.get("fuse_unk") is False):
            return None
        pieces = [piece for piece, _score in model.get("vocab", [])]
    else:                    # WordPiece, WordLevel: one [UNK] may stand for a whole word
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None          # such a token also swallows any run of whitespace beside it
    longest = max([len(p) for p in pieces] + [len(a.get("content", "")) for a in added],
                  default=0)
    return shrink * longest if longest else None


# ---- the tokenizer ----------------------------------------------------------------------------

def template_extras(template_json: str | None) -> tuple[list | None, dict]:
    """GenerateRequest.template_json -> (tools, extra template variables); RequestError for
    anything else (the API checked it; this socket trusts nobody)."""
    if template_json is None:
        return None, {}
    try:
        extras = json.loads(template_json)
    except (ValueError, RecursionError):
        raise RequestError("template_json is not JSON.") from None
    tools = extras.get("tools") if isinstance(extras, dict) else None
    kwargs = extras.get("kwargs", {}) if isinstance(extras, dict) else None
    if not isinstance(kwargs, dict) or not (tools is None or isinstance(tools, list)) or \
            TEMPLATE_RESERVED & kwargs.keys():
        raise RequestError(f"chat_template_kwargs must be an object whose keys are none of "
                           f"{sorted(TEMPLATE_RESERVED)}.")
    return tools, kwargs

class Tokenizer:
    def __init__(self, tokenizer_path: str, vocab_size: int, context_len: int,
                 chat_template: str | None = None):
        self.tok = HFTokenizer.from_dir(tokenizer_path)
        if chat_template is not None:
            self.tok.chat_template = chat_template
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.verdicts = Verdicts()          # the grammar checker's, by grammar
        bound = chars_per_token_bound(self.tok)
        # Invariant: a text longer than this has more than context_len tokens (None: no
        # such length is known, every text is tokenized).
        self.max_text_chars = None if bound is None else bound * context_len
        log.info("texts over %s characters are refused before tokenizing",
                 self.max_text_chars)

    # -- validation of what a GenerateRequest carries, before any tokenizing --------------------

    def validate(self, req: GenerateRequest) -> None:
        """Everything that can be checked without tokens; raises RequestError."""
        forms = [req.text is not None, req.input_ids is not None, req.messages is not None]
        if sum(forms) != 1:
            raise RequestError("Exactly one of text, input_ids or messages must be provided.")
        if req.messages is not None and not req.messages:
            raise RequestError("messages must not be empty.")
        s = req.sampling
        try:
            s._verify()          # the API's range checks, again: this socket trusts nobody
        except ValueError as e:
            raise RequestError(str(e)) from None
        if len(s.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop may have at most {MAX_STOP_STRINGS} entries, got "
                               f"{len(s.stop)}.")
        if any(not stop or len(stop) > MAX_STOP_LENGTH for stop in s.stop):
            raise RequestError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long.")
        if len(s.stop_token_ids) > self.vocab_size:
            raise RequestError(f"stop_token_ids has {len(s.stop_token_ids)} entries, more "
                               f"than the vocabulary ({self.vocab_size}).")
        bad = next((t for t in s.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids contains {bad}, outside the vocabulary "
                               f"[0, {self.vocab_size}).")
        try:
            s.verify_vocab(self.vocab_size)
            s.verify_grammar()
        except ValueError as e:
            raise RequestError(str(e)) from None
        if s.grammar is not None:
            verdict = self.verdicts.get(*s.grammar)
            if verdict is None:
                raise NeedsCheck(*s.grammar)
            if verdict:                           # a grammar that does not compile: 400
                raise RequestError(verdict)
        lp = req.logprob
        if lp is not None:
            if not 0 <= lp.top_logprobs_num <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs_num must be an integer in [0, "
                                   f"{MAX_TOP_LOGPROBS}], got {lp.top_logprobs_num}.")
            if lp.start_len < -1:
                raise RequestError(f"logprob_start_len must be an integer >= -1, got "
                                   f"{lp.start_len}.")

    def _too_long(self, n: int | None) -> RequestError:
        count = f"more than {self.context_len}" if n is None else str(n)
        return RequestError(f"The input ({count} tokens) is longer than the model's context "
                            f"length ({self.context_len} tokens).")

    def _check_text_length(self, text: str) -> None:
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise self._too_long(None)

    # -- tokenizing ---------------------------------------------------------------------------

    def _encode(self, text: str, **kwargs) -> list[int]:
        self._check_text_length(text)
        try:
            out = self.tok.encode(text, **kwargs)
        except Exception as e:   # the library choking on odd input is the input's fault
            raise RequestError(f"The tokenizer failed on this input: {type(e).__name__}: "
                               f"{e}") from None
        return list(out)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, within the length bound (RequestError otherwise)."""
        return self._encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, template_json: str | None = None) -> list[int]:
        if not self.tok.chat_template:
            raise RequestError("This model has no chat template; pass --chat-template.")
        tools, kwargs = template_extras(template_json)
        try:
            # Rendered first, so the length bound applies before tokenizing; this is what
            # transformers' apply_chat_template(tokenize=True) does inside.
            text = self.tok.apply_chat_template(
                [m.to_template() for m in messages],
                add_generation_prompt=True, tools=tools, **kwargs)
        except Exception as e:   # jinja raises its own types (e.g. raise_exception in templates)
            raise RequestError(f"The chat template failed on these messages: {e}") from None
        return self._encode(text, add_special_tokens=False)

    def tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        self.validate(req)
        if req.messages is not None:
            ids = self.apply_chat_template(req.messages, req.template_json)
        elif req.input_ids is not None:
            ids = req.input_ids
            if len(ids) >= self.context_len:      # before scanning a forged huge list
                raise self._too_long(len(ids))
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"Token id {bad} in input_ids is outside the vocabulary "
                                   f"[0, {self.vocab_size}).")
        else:
            ids = self._encode(req.text)
        if not ids:
            raise RequestError("The input is empty.")
        n, s = len(ids), req.sampling
        if req.fit_context and n + s.max_new_tokens >= self.context_len:
            room = max(self.context_len - n - 1, 0)
            s = replace(s, max_new_tokens=room, min_new_tokens=min(s.min_new_tokens, room))
        if n >= self.context_len:
            raise self._too_long(n)
        if n + s.max_new_tokens >= self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {n + s.max_new_tokens} "
                f"tokens: {n} tokens from the input messages and {s.max_new_tokens} tokens for "
                f"the completion. Please reduce the number of tokens in the input messages or "
                f"the completion to fit within the limit.")
        return TokenizedRequest(rid=req.rid, input_ids=ids, sampling=s, stream=req.stream,
                                logprob=req.logprob, fit_context=req.fit_context,
                                api=req.api)


# ---- the loop body ----------------------------------------------------------------------------

SCHEDULER = -1      # a destination: the scheduler; an int >= 0 is that API process


def _client_text(text: str) -> str:
    """An error text that is safe to send (encodable, bounded)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def error_frame(rid: str, message: str, status_code: int) -> bytes:
    finish = FinishReason("abort", message=_client_text(message), status_code=status_code)
    return encode(TextBatch([TextOutput(rid, "", [], finish)]))


class Worker:
    """What the tokenizer process does with each inbox message, without sockets.

    `handle(msg)` returns (destination, frame) or None (dropped, or parked until its grammar's
    verdict: `collect()` returns what parked requests become) and never raises; the
    destination is SCHEDULER or the index of the API process that owns the request.
    Counters: `rejected` (requests answered with a 400), `failed` (answered with a 500:
    a bug here), `dropped` (messages that are not for the tokenizer, or that name an API
    process that does not exist).
    """

    def __init__(self, tokenizer: Tokenizer, api_servers: int = 1,
                 checker: Checker | None = None):
        self.tokenizer = tokenizer
        self.api_servers = api_servers
        self.checker = checker if checker is not None else Checker()
        # check number -> the grammar and the requests waiting for its verdict
        self.parked: dict[int, tuple[str, str, list[GenerateRequest]]] = {}
        self.rejected = self.failed = self.dropped = 0

    def collect(self) -> list[tuple[int, bytes]]:
        """What the parked requests whose grammar now has a verdict become (never blocks)."""
        out = []
        for seq, verdict in self.checker.collect():
            kind, text, reqs = self.parked.pop(seq)
            self.tokenizer.verdicts.put(kind, text, verdict)
            for req in reqs:
                routed = self.handle(req)
                if routed is not None:
                    out.append(routed)
        return out

    def _park(self, req: GenerateRequest, kind: str, text: str) -> None:
        same = next((p for p in self.parked.values() if p[0] == kind and p[1] == text), None)
        if same is not None:
            same[2].append(req)             # the same grammar is being checked already
        else:
            self.parked[self.checker.submit(kind, text)] = (kind, text, [req])

    def handle(self, msg) -> tuple[int, bytes] | None:
        try:
            if isinstance(msg, (AbortRequest, FlushCacheRequest)):
                return SCHEDULER, encode(msg)   # control messages pass through, in order
            if isinstance(msg, GenerateRequest) and 0 <= msg.api < self.api_servers:
                return self._generate(msg)
        except Exception:
            log.exception("failed on a %s", type(msg).__name__)
        self.dropped += 1
        log.error("dropped a %s (%d dropped so far)", type(msg).__name__, self.dropped)
        return None

    def _generate(self, msg: GenerateRequest) -> tuple[int, bytes]:
        try:
            return SCHEDULER, encode(self.tokenizer.tokenize(msg))
        except NeedsCheck as e:
            self._park(msg, e.kind, e.text)
            return None
        except RequestError as e:
            self.rejected += 1
            log.info("rejected request %s (%d so far): %s", msg.rid, self.rejected, e)
            return msg.api, error_frame(msg.rid, str(e), 400)
        except Exception as e:
            self.failed += 1
            log.exception("internal error on request %s (%d so far)", msg.rid, self.failed)
            return msg.api, error_frame(msg.rid, f"Internal error in the tokenizer "
                                             f"({type(e).__name__}).", 500)


def make_worker(config: ServerConfig) -> Worker:
    """The worker as the process builds it: everything from the resolved record (the
    vocabulary size included: config.json is not read again here)."""
    return Worker(Tokenizer(config.tokenizer_path, config.vocab_size, config.context_length,
                            load_chat_template(config.args.chat_template)),
                  config.args.api_server_count)


def wait(inbox: Inbox, checker: Checker) -> list:
    """The inbox's messages, blocking until there are some, or until the grammar checker has
    a verdict (or its current check runs out of time) while checks are pending."""
    fd = checker.fileno()
    if fd is None:
        return inbox.recv(timeout_ms=None)
    poller = zmq.Poller()
    poller.register(inbox.sock, zmq.POLLIN)
    poller.register(fd, zmq.POLLIN)
    poller.poll(max(1, int(checker.wait_s() * 1000) + 1))
    return inbox.recv(timeout_ms=0)


def main(config: ServerConfig, addrs: Addresses, index: int, conn: Connection) -> None:
    """Tokenizer worker `index` of --tokenizer-worker-num: binds its own inbox; every worker
    pushes to the same scheduler and API inboxes (PULL sockets fair-queue their peers)."""
    name = worker_title("tokenizer", index)

    def body(ready) -> None:
        worker = make_worker(config)
        ctx = zmq.Context()
        inbox = Inbox(ctx, addrs.tokenizer[index], TOKENIZER_INBOX)
        outboxes = {SCHEDULER: Outbox(ctx, addrs.scheduler),
                    **{k: Outbox(ctx, a) for k, a in enumerate(addrs.api)}}
        ready()
        while True:
            for routed in [worker.handle(m) for m in wait(inbox, worker.checker)] + \
                    worker.collect():
                if routed is not None:
                    outboxes[routed[0]].send_frame(routed[1])
    run_child(name, config.args.log_level, conn, body, ipc_dir=addrs.ipc_dir)
