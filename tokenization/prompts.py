"""Prompts to token ids, as the tokenizer workers and the API's /tokenize routes do it: the
model's tokenizer (hf_tokenizer.py), its chat template, and every check that needs a token
count (context length, vocabulary range, the characters-per-token bound below). Shared by
tokenizer_proc (each worker holds one Tokenizer) and api_proc (/tokenize, /detokenize), so
neither imports the other's package.

Prompts are bounded before they are tokenized: `chars_per_token_bound` derives from the
tokenizer's own definition the most characters one token can stand for, so a text longer
than that times the context length is refused without tokenizing it (a 50 MB text costs a
length check, not a minute and gigabytes).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from grammars.checker import Verdicts
from media.processors import expand, image_processor, placeholders
from media.sources import MediaError, MediaPolicy, load_image
from tokenization.hf_tokenizer import HFTokenizer
from wire.messages import (MAX_TOP_LOGPROBS, TEMPLATE_RESERVED, GenerateRequest,
                           ImageFeatures, TokenizedRequest, replace)
from wire.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from wire.server_args import ServerConfig

log = logging.getLogger(__name__)


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
                 chat_template: str | None = None, images=None,
                 media: MediaPolicy = MediaPolicy(), max_images: int = 16):
        """images: the model's image processor (media/processors.py; None: a text
        model); media, max_images: what a request's images may be and cost."""
        self.tok = HFTokenizer.from_dir(tokenizer_path)
        if chat_template is not None:
            self.tok.chat_template = chat_template
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.images = images
        if images is not None:
            images.bind(lambda text: list(self.tok.encode(text, add_special_tokens=False)))
        self.media, self.max_images = media, max_images
        self.verdicts = Verdicts()          # the grammar checker's, by grammar
        bound = chars_per_token_bound(self.tok)
        # Invariant: a text longer than this has more than context_len tokens (None: no
        # such length is known, every text is tokenized).
        self.max_text_chars = None if bound is None else bound * context_len
        log.info("texts over %s characters are refused before tokenizing",
                 self.max_text_chars)

    # -- validation of what a GenerateRequest carries, before any tokenizing --------------------


    @classmethod
    def of(cls, config: ServerConfig) -> "Tokenizer":
        """As the server's processes build it: everything from the resolved record (the
        vocabulary size included: config.json is not read again here)."""
        args, facts = config.args, config.model
        return cls(config.tokenizer_path, config.vocab_size, config.context_length,
                   load_chat_template(args.chat_template),
                   image_processor(config.model_path, facts.architecture, facts.image_token_id),
                   MediaPolicy.of(args), args.max_images_per_request)
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
        if req.vector is not None:
            problem = req.vector.problem(self.vocab_size)
            if problem is None and s.max_new_tokens != 0:
                problem = "An embedding or score request is prefill-only (max_new_tokens 0)."
            if problem is not None:
                raise RequestError(problem)

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
        images = None
        if req.image_data is not None:
            ids, images = self.add_images(ids, req.image_data)
        elif self.images is not None:       # placeholders without images: as many as none
            try:
                placeholders(ids, 0, self.images.image_token_id)
            except MediaError as e:
                raise RequestError(str(e)) from None
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
                                api=req.api, images=images, vector=req.vector,
                                priority=req.priority, lora=req.lora)

    def add_images(self, ids: list[int], sources: list[str]
                   ) -> tuple[list[int], list[ImageFeatures]]:
        """Load and preprocess a prompt's images and expand its placeholders: the prompt's
        ids with each image's tokens, and the images as the scheduler takes them."""
        if self.images is None:
            raise RequestError("This model does not take images.")
        if len(sources) > self.max_images:
            raise RequestError(f"The prompt has {len(sources)} images, more than the limit of "
                               f"{self.max_images} (--max-images-per-request).")
        try:
            placeholders(ids, len(sources), self.images.image_token_id)   # before loading
            processed = [self.images.process(load_image(src, self.media)) for src in sources]
            ids, spans = expand(ids, processed, self.images.image_token_id)
        except MediaError as e:
            raise RequestError(str(e)) from None
        if len(ids) >= self.context_len:
            raise self._too_long(len(ids))
        return ids, [ImageFeatures(hash=p.digest(), offset=off, length=n,
                                   pixels=p.pixels.tobytes(), shape=list(p.pixels.shape),
                                   dtype=str(p.pixels.dtype), grid=p.grid)
                     for p, (off, n) in zip(processed, spans)]
