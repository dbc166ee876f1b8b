"""Per-request sampling parameters, as they travel from the API process to the scheduler.

`SamplingParams.from_json` is where a client's `sampling_params` object is checked. Defaults,
range checks and their messages follow SGLang's `SamplingParams` (`verify`), so an SGLang
client sees the same 400s here.

Differences from SGLang, on purpose:
- `max_new_tokens: null` ("until the context length" in SGLang) is rejected with a 400: our
  field is a plain int. Every other null means "the default", as in SGLang.
- `temperature` is kept as sent; greediness is the `is_greedy` property, not a rewrite of
  temperature to 1.0. As in SGLang, a greedy temperature makes top_k irrelevant, so top_k is
  then stored as 1 and not range-checked.
- SGLang parameters we do not implement (stop_regex, structural_tag, ...) are a 400 unless
  null.
- Constrained decoding: at most one of `json_schema` (a JSON object, or a string holding
  one, at most MAX_SCHEMA_DEPTH levels deep), `regex`, `ebnf`, each at most
  MAX_GRAMMAR_CHARS long. The schema travels as compact JSON text; whether a grammar
  compiles is checked by the tokenizer worker and the scheduler (the grammars package), not
  here.
- `stop` is always a list (a str becomes [str]); empty stop strings are rejected.
- Values the scheduler's float32 sampling cannot carry are a 400 too: a temperature above the
  float32 maximum, and a top_p or repetition_penalty below the smallest normal float32
  (they would round to infinity, zero or a denormal and poison the whole distribution).

`verify(vocab_size)` repeats every check for params that did not come through `from_json`
(the scheduler checks each TokenizedRequest it receives: anyone who can reach its socket
can forge one).
"""

import json
import math
from typing import Any

import msgspec

from wire.schema import WireStruct, field

SAMPLING_EPS = 1e-6          # temperature below this is greedy (SGLang's _SAMPLING_EPS)
FLOAT32_MAX = 3.4028234663852886e38      # the largest finite float32
FLOAT32_TINY = 1.1754943508222875e-38    # the smallest normal float32
MAX_STOP_STRINGS = 32
MAX_N = 128             # parallel samples per prompt (OpenAI's limit)
MAX_STOP_LENGTH = 256   # characters; the detokenizer keeps every prefix of each stop string
MAX_GRAMMAR_CHARS = 1_000_000   # of a json_schema, regex or ebnf text
MAX_SCHEMA_DEPTH = 64           # levels of JSON nesting (objects and arrays) in a json_schema
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")


class SamplingError(ValueError):
    """A client-facing message about one sampling parameter; `key` names it (the
    sampling_params key), so each route can point at its own field name."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class SamplingParams(WireStruct):
    """One request's sampling parameters. Field order is part of the wire format; decoding
    checks types only (ranges are `verify`'s job: the scheduler answers a bad one with an
    abort output for that request instead of dropping the frame)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                                  # -1: the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None      # token id (decimal str) -> added logit
    # Constrained decoding (at most one): a JSON schema as JSON text, a regex, an EBNF
    # (GBNF or Lark) grammar. The output is then a whole match (grammars/llg.py).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def stop_ids(self, eos_ids) -> set[int]:
        """The tokens that end this request: its stop_token_ids, and EOS unless ignored."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's constraint, kind one of GRAMMAR_KEYS, or None: the
        key that compiled grammars are cached by."""
        for kind in GRAMMAR_KEYS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    def with_json_schema(self, schema: dict) -> "SamplingParams":
        """A copy constrained to JSON that validates against `schema` (a decoded JSON
        Schema), any other constraint replaced: how a route constrains a request itself
        (response_format, a tool call's arguments). Raises SamplingError if the schema
        cannot travel."""
        text = _json_schema("json_schema", schema)
        return msgspec.structs.replace(self, json_schema=text, regex=None, ebnf=None)

    @classmethod
    def from_json(cls, obj: Any) -> "SamplingParams":
        """Build from a decoded JSON `sampling_params` object (or None for all defaults).
        Raises ValueError with a client-facing message for anything invalid."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError(f"sampling_params must be an object, got {_json_type(obj)}.")
        kwargs: dict[str, Any] = {}
        for key, value in obj.items():
            parse = _PARSERS.get(key)
            if parse is None:
                if key in _SGLANG_UNSUPPORTED:
                    if value is None:
                        continue
                    raise SamplingError(key, f"Sampling parameter '{key}' is not supported.")
                raise SamplingError(key, f"Unknown sampling parameter '{key}'.")
            if value is None:
                if key == "max_new_tokens":
                    raise SamplingError("max_new_tokens",
                                        "sampling_params.max_new_tokens=null (until the context "
                                        "length) is not supported; pass an integer.")
                continue                              # null means the default, as in SGLang
            kwargs[key] = parse(key, value)
        params = cls(**kwargs)
        params._verify()
        return params

    def verify(self, vocab_size: int | None = None) -> None:
        """Every check `from_json` makes, for params that did not come through it (decoded
        off a socket): the shapes the JSON parsers enforce, the ranges and, given the
        vocabulary size, `verify_vocab`. Raises ValueError with a client-facing message."""
        _stop("stop", self.stop)
        _token_ids("stop_token_ids", self.stop_token_ids)
        if self.logit_bias is not None:
            _logit_bias("logit_bias", self.logit_bias)
        self.verify_grammar()
        self._verify()
        if vocab_size is not None:
            self.verify_vocab(vocab_size)

    def verify_grammar(self) -> None:
        """The shape of the constraint fields (non-empty strings, a schema that is JSON);
        at most one being set is `_verify`'s check, and whether the grammar compiles is
        the grammars package's to say."""
        for kind in GRAMMAR_KEYS:
            if getattr(self, kind) is not None:
                _GRAMMAR_PARSERS[kind](kind, getattr(self, kind))

    def verify_vocab(self, vocab_size: int) -> None:
        """The checks that need the model's vocabulary size (SGLang's messages)."""
        bad = next((t for t in self.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise SamplingError("stop_token_ids",
                                f"stop_token_ids contains {bad}, outside the vocabulary "
                                f"[0, {vocab_size}).")
        for token_id in self.logit_bias or {}:
            if not 0 <= int(token_id) < vocab_size:      # keys are decimal digits (from_json)
                raise SamplingError("logit_bias",
                                    f"logit_bias must has keys in [0, {vocab_size - 1}], got "
                                    f"{token_id}.")

    def _verify(self) -> None:
        # Messages are SGLang's SamplingParams.verify, word for word, where it has one.
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise SamplingError("temperature",
                                f"temperature must be a non-negative finite number, got "
                                f"{self.temperature}.")
        if self.temperature > FLOAT32_MAX:
            raise SamplingError("temperature",
                                f"temperature must be at most {FLOAT32_MAX} (the float32 "
                                f"maximum), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_p < FLOAT32_TINY:
            raise SamplingError("top_p",
                                f"top_p must be at least {FLOAT32_TINY} (the smallest normal "
                                f"float32), got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.temperature < SAMPLING_EPS:
            self.top_k = 1                            # SGLang: greedy overrides top_k
        elif self.top_k != -1 and self.top_k < 1:
            raise SamplingError("top_k",
                                f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingError("frequency_penalty", f"frequency_penalty must be in [-2, 2], got "
                             f"{self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingError("presence_penalty", f"presence_penalty must be in [-2, 2], got "
                             f"{self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingError("repetition_penalty",
                                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got "
                                f"{self.repetition_penalty}.")
        if self.repetition_penalty < FLOAT32_TINY:
            raise SamplingError("repetition_penalty",
                                f"repetition_penalty must be at least {FLOAT32_TINY} (the "
                                f"smallest normal float32), got {self.repetition_penalty}.")
        if not 0 <= self.min_new_tokens:
            raise SamplingError("min_new_tokens",
                                f"min_new_tokens must be in [0, max_new_tokens], got "
                                f"{self.min_new_tokens}.")
        if self.max_new_tokens < 0:
            raise SamplingError("max_new_tokens",
                                f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not self.min_new_tokens <= self.max_new_tokens:
            raise SamplingError("min_new_tokens", f"min_new_tokens must be in [0, max_new_tokens("
                             f"{self.max_new_tokens})], got {self.min_new_tokens}.")
        if self.n < 1:
            raise SamplingError("n", f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise SamplingError("n", f"n must be at most {MAX_N}, got {self.n}.")
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed < 2**64:
            raise SamplingError("sampling_seed",
                                f"sampling_seed must fit in 64 bits, got {self.sampling_seed}.")
        if sum(getattr(self, kind) is not None for kind in GRAMMAR_KEYS) > 1:
            raise SamplingError(next(k for k in reversed(GRAMMAR_KEYS)
                                     if getattr(self, k) is not None),
                                "Only one of regex, json_schema, or ebnf can be set.")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not math.isfinite(bias):
                    raise SamplingError("logit_bias",
                                        f"logit_bias values must be finite, got {bias} for "
                                        f"token {token_id}.")


# ---- type checks at the JSON boundary ----------------------------------------------------

def _json_type(value: Any) -> str:
    return type(value).__name__


INT64 = 2**63   # msgpack carries ints in [-2**63, 2**64): anything wider is a client error


def _int(key: str, v: Any) -> int:
    if type(v) is not int:                            # bool is not an int here
        raise SamplingError(key, f"sampling_params.{key} must be an integer, got {_json_type(v)}.")
    if not -INT64 <= v < 2 * INT64:
        raise SamplingError(key, f"{key} must fit in 64 bits, got {v}.")
    return v


def _float(key: str, v: Any) -> float:
    if type(v) is not int and type(v) is not float:
        raise SamplingError(key, f"sampling_params.{key} must be a number, got {_json_type(v)}.")
    return float(v)


def _bool(key: str, v: Any) -> bool:
    if type(v) is not bool:
        raise SamplingError(key, f"sampling_params.{key} must be a boolean, got {_json_type(v)}.")
    return v


def _stop(key: str, v: Any) -> list[str]:
    stops = [v] if type(v) is str else v
    if type(stops) is not list or any(type(s) is not str for s in stops):
        raise SamplingError(key, f"sampling_params.{key} must be a string or a list of strings.")
    if len(stops) > MAX_STOP_STRINGS:
        raise SamplingError(key, f"sampling_params.{key} may have at most {MAX_STOP_STRINGS} "
                         f"entries, got {len(stops)}.")
    if any(s == "" for s in stops):
        raise SamplingError(key, f"sampling_params.{key} must not contain an empty string.")
    if any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise SamplingError(key, f"sampling_params.{key} strings may be at most {MAX_STOP_LENGTH} "
                         f"characters long.")
    return list(stops)


def _token_ids(key: str, v: Any) -> list[int]:
    if type(v) is not list or any(type(t) is not int or not 0 <= t < INT64 for t in v):
        raise SamplingError(key, f"sampling_params.{key} must be a list of non-negative integers.")
    return list(dict.fromkeys(v))                     # SGLang keeps a set; we keep order


def _logit_bias(key: str, v: Any) -> dict[str, float] | None:
    if type(v) is not dict:
        raise SamplingError(key, f"sampling_params.{key} must be an object mapping token ids to "
                         f"numbers, got {_json_type(v)}.")
    out: dict[str, float] = {}
    for token_id, bias in v.items():
        if type(token_id) is not str or not (token_id.isascii() and token_id.isdigit()):
            raise SamplingError(key, f"sampling_params.{key} keys must be token ids, got "
                             f"{token_id!r}.")
        out[str(int(token_id))] = _float(f"{key}[{token_id!r}]", bias)
    return out or None


def _grammar_text(key: str, v: Any) -> str:
    if type(v) is not str:
        raise SamplingError(key, f"sampling_params.{key} must be a string, got {_json_type(v)}.")
    if not v:
        raise SamplingError(key, f"sampling_params.{key} must not be empty.")
    if len(v) > MAX_GRAMMAR_CHARS:
        raise SamplingError(key, f"sampling_params.{key} may be at most {MAX_GRAMMAR_CHARS} "
                                 f"characters long, got {len(v)}.")
    return v


def _json_depth(v: dict | list) -> int:
    """Levels of nesting of a JSON object or array (1: no object or array inside), without
    recursion."""
    depth, todo = 0, [(v, 1)]
    while todo:
        node, d = todo.pop()
        depth = max(depth, d)
        todo += [(c, d + 1) for c in (node.values() if type(node) is dict else node)
                 if type(c) in (dict, list)]
    return depth


def _json_schema(key: str, v: Any) -> str:
    """A schema object as compact JSON text; a string must hold one. At most
    MAX_SCHEMA_DEPTH levels deep (checked before anything recurses over it: json.dumps,
    the grammar compiler)."""
    too_deep = SamplingError(key, f"{key} may be nested at most {MAX_SCHEMA_DEPTH} levels "
                                  f"deep (objects and arrays).")
    if type(v) is str:
        _grammar_text(key, v)
        try:
            v = json.loads(v)
        except RecursionError:
            raise too_deep from None
        except ValueError as e:
            raise SamplingError(key, f"{key} is not valid JSON: {e}.") from None
    if type(v) is not dict:
        raise SamplingError(key, f"{key} must be a JSON object (a JSON Schema), got "
                                 f"{_json_type(v)}.")
    if _json_depth(v) > MAX_SCHEMA_DEPTH:
        raise too_deep
    try:
        text = json.dumps(v, separators=(",", ":"), allow_nan=False)   # ASCII: no lone surrogate
    except ValueError as e:                              # NaN / Infinity in the schema
        raise SamplingError(key, f"{key} is not valid JSON: {e}.") from None
    return _grammar_text(key, text)


_GRAMMAR_PARSERS = {"json_schema": _json_schema, "regex": _grammar_text, "ebnf": _grammar_text}


_PARSERS = {
    "max_new_tokens": _int, "temperature": _float, "top_p": _float, "top_k": _int,
    "min_p": _float, "frequency_penalty": _float, "presence_penalty": _float,
    "repetition_penalty": _float, "min_new_tokens": _int, "stop": _stop,
    "stop_token_ids": _token_ids, "ignore_eos": _bool, "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool, "no_stop_trim": _bool, "n": _int,
    "sampling_seed": _int, "logit_bias": _logit_bias, **_GRAMMAR_PARSERS,
}
assert set(_PARSERS) == set(SamplingParams.__struct_fields__)

# SGLang accepts these; we do not implement them. Null is tolerated (clients send all keys).
_SGLANG_UNSUPPORTED = frozenset({
    "stop_regex", "structural_tag", "custom_params", "stream_interval",
})
