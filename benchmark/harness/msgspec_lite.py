"""A working pure-Python subset of msgspec, carried by the msgspec stand-in.

sglang 0.5.23 declares its records as msgspec Structs and uses them for real: at import
(the kernel registry's entries, ``ServerArgs`` assembled by ``defstruct`` from its field
groups) and in what the harness builds (``SamplingParams``, the device pools' buffer
descriptions). msgspec is compiled and has no wheel on the harness machine, so a
placeholder cannot stand in for it; this module can, for everything except wire formats:

- ``Struct`` subclasses become dataclasses: construction (positional and keyword),
  defaults (an empty list/dict/set default is copied per instance, as msgspec does),
  ``__post_init__``, ``frozen``, ``kw_only``, equality, hashing of frozen structs,
  ``__struct_fields__`` and ``__struct_config__`` (inherited and overridden per class);
- ``field``, ``NODEFAULT``, ``UNSET``, ``defstruct``, the error classes, and
  ``structs.fields/replace/asdict/astuple``.

Encoding and decoding (``msgspec.json``, ``msgspec.msgpack``, ``convert``) are not here:
they stay placeholders of the stand-in and fail when called.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

_CONFIG_DEFAULTS: dict[str, Any] = {
    "frozen": False,
    "eq": True,
    "order": False,
    "kw_only": False,
    "omit_defaults": False,
    "forbid_unknown_fields": False,
    "tag": None,
    "tag_field": None,
    "rename": None,
    "repr_omit_defaults": False,
    "array_like": False,
    "gc": True,
    "weakref": False,
    "dict": False,
    "cache_hash": False,
}


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __bool__(self) -> bool:
        return False


NODEFAULT: Any = _Sentinel("NODEFAULT")
UNSET: Any = _Sentinel("UNSET")
UnsetType = _Sentinel


class MsgspecError(Exception):
    """msgspec's base error (never raised here: nothing here encodes or decodes)."""


class EncodeError(MsgspecError):
    pass


class DecodeError(MsgspecError):
    pass


class ValidationError(DecodeError):
    pass


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    default: Any = NODEFAULT
    default_factory: Any = NODEFAULT
    name: str | None = None


def field(
    *, default: Any = NODEFAULT, default_factory: Any = NODEFAULT, name: str | None = None
) -> Any:
    """``msgspec.field``: a default, a default factory, or a wire name for one field."""
    return _FieldSpec(default, default_factory, name)


class StructConfig(types.SimpleNamespace):
    """``__struct_config__``: the class's options, its bases' merged with its own."""


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One field of a Struct, as ``msgspec.structs.fields`` describes it."""

    name: str
    encode_name: str
    type: Any
    default: Any = NODEFAULT
    default_factory: Any = NODEFAULT

    @property
    def required(self) -> bool:
        return self.default is NODEFAULT and self.default_factory is NODEFAULT


def _factory_for(value: Any) -> Callable[[], Any]:
    if isinstance(value, list | dict | set | bytearray) and not value:
        return type(value)
    return lambda: copy.copy(value)


def _dataclass_field(value: Any) -> Any:
    """A class attribute of a Struct (a default or a ``field``) as a dataclass field."""
    if isinstance(value, _FieldSpec):
        metadata = {"encode_name": value.name} if value.name else {}
        if value.default_factory is not NODEFAULT:
            return dataclasses.field(default_factory=value.default_factory, metadata=metadata)
        if value.default is NODEFAULT:
            return dataclasses.field(metadata=metadata)
        value_field = _dataclass_field(value.default)
        if metadata:
            return dataclasses.field(
                default=value_field.default,
                default_factory=value_field.default_factory,
                metadata=metadata,
            )
        return value_field
    if type(value).__hash__ is None:  # dataclasses refuse these as shared defaults
        return dataclasses.field(default_factory=_factory_for(value))
    return dataclasses.field(default=value)


def _is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.replace("typing.", "").startswith("ClassVar")
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


class Struct:
    """``msgspec.Struct``: each subclass is made a dataclass with its merged options."""

    __struct_fields__: tuple[str, ...] = ()
    __struct_config__ = StructConfig(**_CONFIG_DEFAULTS)

    def __init_subclass__(cls, **options: Any) -> None:
        super().__init_subclass__()
        config = {**vars(cls.__struct_config__), **options}
        cls.__struct_config__ = StructConfig(**config)
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            value = cls.__dict__.get(name, NODEFAULT)
            if _is_classvar(annotation) or value is NODEFAULT:
                continue
            if isinstance(value, _FieldSpec) or type(value).__hash__ is None:
                setattr(cls, name, _dataclass_field(value))
        before = set(cls.__dict__)
        dataclasses.dataclass(
            cls,
            eq=config["eq"],
            order=config["order"],
            frozen=config["frozen"],
            kw_only=config["kw_only"],
        )
        cls.__struct_generated__ = frozenset(set(cls.__dict__) - before)
        cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))


def defstruct(
    name: str,
    fields: Iterable[str | tuple[Any, ...]],
    *,
    bases: tuple[type, ...] | None = None,
    module: str | None = None,
    namespace: dict[str, Any] | None = None,
    **options: Any,
) -> type:
    """``msgspec.defstruct``: a Struct class from field specs and a namespace (a copied
    class's namespace loses what the copy's dataclass machinery generated)."""
    source = dict(namespace or {})
    generated = source.get("__struct_generated__", frozenset())
    body = {
        key: value
        for key, value in source.items()
        if key not in generated and not key.startswith(("__struct_", "__dataclass_"))
    }
    annotations: dict[str, Any] = {}
    for spec in fields:
        entry = (spec,) if isinstance(spec, str) else tuple(spec)
        annotations[entry[0]] = entry[1] if len(entry) > 1 else Any
        if len(entry) > 2:
            body[entry[0]] = entry[2]
        else:
            body.pop(entry[0], None)
    body["__annotations__"] = annotations
    body.setdefault("__module__", module or sys._getframe(1).f_globals.get("__name__"))
    return types.new_class(name, bases or (Struct,), options, lambda ns: ns.update(body))


def _struct_type(obj: Any) -> type:
    cls = obj if isinstance(obj, type) else type(obj)
    if not issubclass(cls, Struct):
        raise TypeError(f"{obj!r} is not a Struct type or instance")
    return cls


def _fields(obj: Any) -> tuple[FieldInfo, ...]:
    cls = _struct_type(obj)
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # an annotation naming something this machine lacks
        hints = {}
    infos = []
    for f in dataclasses.fields(cls):
        infos.append(
            FieldInfo(
                name=f.name,
                encode_name=f.metadata.get("encode_name", f.name),
                type=hints.get(f.name, f.type),
                default=NODEFAULT if f.default is dataclasses.MISSING else f.default,
                default_factory=(
                    NODEFAULT if f.default_factory is dataclasses.MISSING else f.default_factory
                ),
            )
        )
    return tuple(infos)


def _replace(obj: Any, **changes: Any) -> Any:
    _struct_type(obj)
    return dataclasses.replace(obj, **changes)


def _asdict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in _struct_type(obj).__struct_fields__}


def _astuple(obj: Any) -> tuple[Any, ...]:
    return tuple(getattr(obj, name) for name in _struct_type(obj).__struct_fields__)


# What each module of the stand-in carries for real (the rest are placeholders).
MODULES: dict[str, dict[str, Any]] = {
    "msgspec": {
        "Struct": Struct,
        "field": field,
        "defstruct": defstruct,
        "NODEFAULT": NODEFAULT,
        "UNSET": UNSET,
        "UnsetType": UnsetType,
        "MsgspecError": MsgspecError,
        "EncodeError": EncodeError,
        "DecodeError": DecodeError,
        "ValidationError": ValidationError,
    },
    "msgspec.structs": {
        "FieldInfo": FieldInfo,
        "StructConfig": StructConfig,
        "fields": _fields,
        "replace": _replace,
        "asdict": _asdict,
        "astuple": _astuple,
    },
}
