"""The msgpack codec for wire messages. No pickle, ever.

A frame is the msgpack array `[tag, [field values...]]`. Nested message dataclasses are
plain arrays of their field values, in declaration order. Decoding rebuilds the dataclass
and checks every value against the field's annotation, so a receiver only ever sees
well-typed messages; anything else (bad msgpack, unknown tag, wrong arity, wrong type)
raises DecodeError, which receivers log and count instead of crashing.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

import msgpack

from wire import messages as m
from wire.sampling import SamplingParams

# Tags are part of the protocol: append, never renumber.
TAGS: dict[type, int] = {
    m.GenerateRequest: 1,
    m.AbortRequest: 2,
    m.TokenizedRequest: 3,
    m.ReleaseRequest: 4,
    m.TokenBatch: 5,
    m.TextBatch: 6,
    m.FlushCacheRequest: 7,
    m.ControlReply: 8,
}
_BY_TAG: dict[int, type] = {tag: cls for cls, tag in TAGS.items()}


class DecodeError(ValueError):
    """A frame that is not a valid message. Never raised for a valid message."""


# ---- encoding -------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_plain(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def encode(msg: Any) -> bytes:
    tag = TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a wire message")
    return msgpack.packb([tag, _plain(msg)], use_bin_type=True)


# ---- decoding -------------------------------------------------------------------------------

Check = Callable[[Any, str], Any]   # (value, path for messages) -> value of the right type


def _fail(path: str, want: str, value: Any) -> typing.NoReturn:
    raise DecodeError(f"{path}: expected {want}, got {type(value).__name__}")


def _scalar(tp: type) -> Check:
    def check(v: Any, path: str) -> Any:
        if tp is float and type(v) is int:
            return float(v)
        # bool is a subclass of int: an int field must not accept True.
        if type(v) is not tp:
            _fail(path, tp.__name__, v)
        return v
    return check


def _compile(tp: Any) -> Check:
    origin = typing.get_origin(tp)
    if tp in (int, float, str, bool):
        return _scalar(tp)
    if tp is type(None):
        def check_none(v: Any, path: str) -> None:
            if v is not None:
                _fail(path, "null", v)
        return check_none
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {tp}")
        inner = _compile(rest[0])

        def check_optional(v: Any, path: str) -> Any:
            return None if (v is None and optional) else inner(v, path)
        return check_optional
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _compile(item_tp)

        def check_list(v: Any, path: str) -> list:
            if type(v) is not list:
                _fail(path, "array", v)
            return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return check_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if key_tp is not str:
            raise TypeError(f"dict keys must be str, got {tp}")
        val = _compile(val_tp)

        def check_dict(v: Any, path: str) -> dict:
            if type(v) is not dict or any(type(k) is not str for k in v):
                _fail(path, "map with string keys", v)
            return {k: val(x, f"{path}.{k}") for k, x in v.items()}
        return check_dict
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp)
    raise TypeError(f"unsupported wire type {tp!r}")


_DATACLASS_CHECKS: dict[type, Check] = {}


def _dataclass(cls: type) -> Check:
    if cls in _DATACLASS_CHECKS:
        return _DATACLASS_CHECKS[cls]
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    checks: list[Check] = []

    def check(v: Any, path: str) -> Any:
        if type(v) is not list:
            _fail(path, f"{cls.__name__} array", v)
        if len(v) != len(names):
            raise DecodeError(f"{path}: {cls.__name__} has {len(names)} fields, got {len(v)}")
        return cls(**{n: c(x, f"{path}.{n}") for n, c, x in zip(names, checks, v)})

    _DATACLASS_CHECKS[cls] = check          # registered before compiling fields: recursion-safe
    checks.extend(_compile(hints[n]) for n in names)
    return check


_MESSAGE_CHECKS: dict[int, Check] = {tag: _dataclass(cls) for tag, cls in _BY_TAG.items()}
_compile(SamplingParams)   # fail at import, not at first use, if an annotation is unsupported


def decode(frame: bytes) -> Any:
    """Rebuild a message from a frame. Raises DecodeError for anything that is not one."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise DecodeError(f"not msgpack: {e}") from None
    if type(obj) is not list or len(obj) != 2 or type(obj[0]) is not int:
        raise DecodeError("frame is not [tag, fields]")
    check = _MESSAGE_CHECKS.get(obj[0])
    if check is None:
        raise DecodeError(f"unknown message tag {obj[0]}")
    return check(obj[1], _BY_TAG[obj[0]].__name__)
