"""The msgpack codec for wire messages (msgspec underneath). No pickle, ever.

A frame is the msgpack array `[tag, field values...]`: the message's integer tag (declared
on its class in wire/messages.py), then its fields in declaration order; a nested wire type
is the array of its own field values.

Each receiving process decodes with the decoder of its inbox (TOKENIZER_INBOX, ...), which
accepts exactly the messages of that inbox's union in wire/messages.py and checks every
value against the field annotations on the way in: exactly one value per field, no bool for
an int or a float, None only where the annotation says `| None`, str map keys, str never
bin; an int is accepted for a float and becomes one. So a receiver only ever sees
well-typed messages; anything else (bad msgpack, unknown tag, a message for another inbox,
wrong arity, wrong type) raises DecodeError, which receivers log and count instead of
crashing. Range checks are not the codec's: receivers validate values against what they
know (SamplingParams.verify, vocabulary, context length).
"""

from __future__ import annotations

import re
import typing
from typing import Any

import msgspec

from wire import messages as m

_MESSAGES: tuple[type, ...] = typing.get_args(m.Message)
TAGS: dict[type, int] = {cls: cls.__struct_config__.tag for cls in _MESSAGES}
_BY_TAG: dict[int, type] = {tag: cls for cls, tag in TAGS.items()}
assert len(_BY_TAG) == len(TAGS) == len(_MESSAGES), "message tags must be unique"


class DecodeError(ValueError):
    """A frame that is not a valid message. Never raised for a valid message."""


# ---- encoding -------------------------------------------------------------------------------

def _enc_hook(obj: Any) -> Any:
    # Subclasses of the plain types (a numpy float64 is a float) go out as the plain type,
    # as they did with msgpack; anything else is not a wire value.
    for plain in (float, int, str):
        if isinstance(obj, plain):
            return plain(obj)
    raise TypeError(f"{type(obj).__name__} is not a wire value")


_encode = msgspec.msgpack.Encoder(enc_hook=_enc_hook).encode


def encode(msg: m.Message) -> bytes:
    """The frame of a message. TypeError for anything that is not a message (a subclass of
    one included); OverflowError for an int outside [-2**63, 2**64); UnicodeEncodeError
    for a lone surrogate."""
    if type(msg) not in TAGS:
        raise TypeError(f"{type(msg).__name__} is not a wire message")
    return _encode(msg)


# ---- decoding -------------------------------------------------------------------------------

class InboxDecoder:
    """Decodes the frames one inbox may receive: exactly the messages of its union."""

    def __init__(self, name: str, union: Any):
        self.name = name
        self.accepts: frozenset[type] = frozenset(typing.get_args(union) or (union,))
        self._by_tag = {cls.__struct_config__.tag: cls for cls in self.accepts}
        self._decode = msgspec.msgpack.Decoder(union).decode

    def decode(self, frame: bytes) -> Any:
        """Rebuild a message from a frame. Raises DecodeError for anything that is not one
        of this inbox's messages."""
        try:
            return self._decode(frame)
        except msgspec.ValidationError as e:
            raise DecodeError(self._explain(frame, str(e))) from None
        except msgspec.DecodeError as e:
            raise DecodeError(f"not msgpack: {e}") from None
        except Exception as e:  # noqa: BLE001 - e.g. a __post_init__: still a bad frame
            raise DecodeError(f"{type(e).__name__}: {e}") from e

    def _explain(self, frame: bytes, error: str) -> str:
        """A validation error in words: which tag, which inbox, which field (slow path)."""
        try:
            head = _HEAD(frame)
            tag = _FIRST(head[0]) if head else None
        except Exception:  # noqa: BLE001 - e.g. too deeply nested to skip
            tag = None
        if type(tag) is not int:
            return f"frame is not [tag, fields...]: {error}"
        cls = self._by_tag.get(tag)
        if cls is not None:
            return _named_path(cls, error)
        if tag in _BY_TAG:
            return f"a {_BY_TAG[tag].__name__} (tag {tag}) is not for the {self.name} inbox"
        return f"unknown message tag {tag}"


_HEAD = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
_FIRST = msgspec.msgpack.Decoder().decode
_AT = re.compile(r"`\$((?:\[\d+\])*)([^`]*)`")
_INDEX = re.compile(r"\[(\d+)\]")


def _named_path(cls: type, error: str) -> str:
    """msgspec's `Expected int, got str - at $[1][1][2]` as
    `TokenBatch.outputs[1].new_ids[2]: expected int, got str`."""
    match = _AT.search(error)
    indices = [int(i) for i in _INDEX.findall(match.group(1))] if match else []
    path, tp = cls.__name__, cls
    if indices:
        indices[0] -= 1                                # the tag is element 0
    for i in indices:
        tp = _unwrap_optional(tp)
        if hasattr(tp, "__struct_fields__"):
            info = msgspec.structs.fields(tp)
            if not 0 <= i < len(info):
                path += f"[{i}]"
                break
            path, tp = f"{path}.{info[i].name}", info[i].type
        elif typing.get_origin(tp) is list:
            path, tp = f"{path}[{i}]", typing.get_args(tp)[0]
        else:
            path += f"[{i}]"
            break
    # Every field is required, so msgspec's "at least" / "at most" length is the exact one.
    error = re.sub(r"of at (?:least|most) length", "of length", error)
    if match:
        path += match.group(2)
        error = error[:match.start()].removesuffix(" - at ").removesuffix(" in ")
        if error.endswith("`key`"):
            path, error = f"a key of {path}", error.removesuffix(" - at `key`")
    return f"{path}: {error[:1].lower()}{error[1:]}"


def _unwrap_optional(tp: Any) -> Any:
    """X for `X | None`, else tp."""
    if typing.get_origin(tp) not in (typing.Union, type(int | None)):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


TOKENIZER_INBOX = InboxDecoder("tokenizer", m.TokenizerInbox)
SCHEDULER_INBOX = InboxDecoder("scheduler", m.SchedulerInbox)
DETOKENIZER_INBOX = InboxDecoder("detokenizer", m.DetokenizerInbox)
API_INBOX = InboxDecoder("api", m.ApiInbox)
DP_CONTROLLER_INBOX = InboxDecoder("dp-controller", m.DpControllerInbox)
NODE_LINK = InboxDecoder("node-link", m.NodeLinkInbox)     # a TCP link, not ZeroMQ
TP_FOLLOWER = InboxDecoder("tp", m.TpFollowerInbox)    # a broadcast, not a socket
ANY_MESSAGE = InboxDecoder("any", m.Message)      # tests and tools; no process binds this


def decode(frame: bytes, inbox: InboxDecoder = ANY_MESSAGE) -> Any:
    """Rebuild a message from a frame with an inbox's decoder (default: any message).
    Raises DecodeError for anything that is not one."""
    return inbox.decode(frame)
