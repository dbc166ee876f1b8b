"""The base of every type that crosses a socket: `WireStruct`, a msgspec Struct that goes on
the wire as the msgpack array of its field values, in declaration order, and that decodes
only from an array with exactly one value per field.

Why a metaclass: msgspec fills a missing trailing array element from the field's default,
so a message whose last fields have defaults would decode from a short array. Wire types
therefore declare no msgspec defaults at all; `WireMeta` takes the defaults out of the class
body and puts them into a generated constructor instead (as dataclasses generate __init__):
`AbortRequest("r")` still works, while decoding `[2, "r"]` is an error. Too many values are
an error too (forbid_unknown_fields).

A default is written as usual: `x: int = 0`, or `x: list[int] = field(default_factory=list)`
for a mutable one (msgspec.field; an empty [] or {} literal is taken as a factory too).
`__wire_defaults__` maps each defaulted field to its default (a factory is a `Factory`).
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

field = msgspec.field
_Field = type(msgspec.field())
_NODEFAULT = msgspec.NODEFAULT
_MISSING = object()


class Factory:
    """A default made fresh for every instance (a list, a dict)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def __repr__(self) -> str:
        return f"Factory({self.make!r})"


def _default(name: str, value: Any) -> Any:
    if isinstance(value, _Field):
        if value.name is not None:
            raise TypeError(f"{name}: wire fields are positional; they cannot be renamed")
        if value.default_factory is not _NODEFAULT:
            return Factory(value.default_factory)
        value = value.default
    if type(value) in (list, dict, set, bytearray):
        if value:
            raise TypeError(f"{name}: a mutable default must be a field(default_factory=...)")
        return Factory(type(value))
    return value


def _constructor(cls: type, defaults: dict[str, Any]) -> Callable:
    """`__call__(cls, f1, f2=d2, ...)` that fills defaults, then builds the struct with every
    field given (the generated signature keeps construction as fast as a dataclass's)."""
    names = cls.__struct_fields__
    env: dict[str, Any] = {"_wire_new": msgspec.StructMeta.__call__, "_wire_missing": _MISSING}
    params, fills = ["_wire_cls"], []
    for name in names:
        if name not in defaults:
            if "=" in params[-1]:
                raise TypeError(f"{cls.__name__}.{name}: a field without a default cannot "
                                f"follow one with a default")
            params.append(name)
            continue
        value = defaults[name]
        if isinstance(value, Factory):
            env[f"_wire_make_{name}"] = value.make
            params.append(f"{name}=_wire_missing")
            fills.append(f"    if {name} is _wire_missing: {name} = _wire_make_{name}()\n")
        else:
            env[f"_wire_default_{name}"] = value
            params.append(f"{name}=_wire_default_{name}")
    src = (f"def __call__({', '.join(params)}):\n" + "".join(fills)
           + f"    return _wire_new(_wire_cls, {', '.join(names)})\n")
    exec(src, env)                                     # noqa: S102 - our own field names
    return env["__call__"]


class WireMeta(msgspec.StructMeta):
    """Makes each wire type array-like with an exact field count, and gives it a generated
    constructor holding its defaults (each type gets its own metaclass for that)."""

    def __new__(mcls, name: str, bases: tuple, ns: dict, **config: Any):
        defaults: dict[str, Any] = {}
        for base in reversed(bases):
            defaults.update(getattr(base, "__wire_defaults__", {}))
        for key in ns.get("__annotations__", {}):
            if key in ns:
                defaults[key] = _default(f"{name}.{key}", ns.pop(key))
            else:
                defaults.pop(key, None)        # redeclared without a default: required
        for option in ("array_like", "forbid_unknown_fields"):
            if not config.setdefault(option, True):
                raise TypeError(f"{name}: wire types are always {option}")
        meta = type(f"{name}Meta", (mcls,), {"__module__": mcls.__module__})
        cls = super().__new__(meta, name, bases, ns, **config)
        unknown = set(defaults) - set(cls.__struct_fields__)
        if unknown:
            raise TypeError(f"{name}: defaults for what are not fields: {sorted(unknown)}")
        # The point of it all: msgspec itself knows no default, so decoding needs every field.
        assert not cls.__struct_defaults__, f"{name}: msgspec defaults left in the class body"
        cls.__wire_defaults__ = defaults
        meta.__call__ = _constructor(cls, defaults)
        return cls


class WireStruct(msgspec.Struct, metaclass=WireMeta):
    """Base of every wire type (messages and the types nested in them)."""
