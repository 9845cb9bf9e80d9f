"""A closed-world encoding of nested dataclasses (a group's control plane across hosts).

`Comm.broadcast_object` and `gather_objects` carry each step's plan and each rank's results.
Where a group's ranks run on several hosts (`--placement remote`) they travel in this encoding
instead of pickle: msgpack of plain values, each dataclass as a map with its type's name, rebuilt
on the other side only as one of the classes the codec was made with (`TreeCodec(classes)`).
An unknown name, a field a class does not have, or bytes that are not msgpack raise `BadTree`:
decoding never imports, calls or looks up anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

_TYPE, _TUPLE = "__t", "__tuple"


class BadTree(ValueError):
    """Bytes that are not an encoding of the codec's classes."""


class TreeCodec:
    def __init__(self, classes: Iterable[type]) -> None:
        self._classes: dict[str, type] = {}
        for cls in classes:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls!r} is not a dataclass")
            self._classes[cls.__name__] = cls
        self._fields = {
            name: {f.name for f in dataclasses.fields(cls) if f.init}
            for name, cls in self._classes.items()
        }
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    def encode(self, obj: object) -> bytes:
        return self._encoder.encode(self._plain(obj))

    def decode(self, data: bytes) -> Any:
        try:
            tree = self._decoder.decode(data)
        except msgspec.DecodeError as e:
            raise BadTree(f"not msgpack: {e}") from None
        return self._build(tree)

    def _plain(self, obj: object) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            name = type(obj).__name__
            if self._classes.get(name) is not type(obj):
                raise TypeError(f"{name} is not one of the codec's classes")
            out: dict[str, Any] = {_TYPE: name}
            for f in dataclasses.fields(obj):
                if f.init:
                    out[f.name] = self._plain(getattr(obj, f.name))
            return out
        if isinstance(obj, tuple):
            return {_TUPLE: [self._plain(x) for x in obj]}
        if isinstance(obj, list):
            return [self._plain(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self._plain(v) for k, v in obj.items()}
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return obj
        raise TypeError(f"cannot encode a {type(obj).__name__}")

    def _build(self, tree: Any) -> Any:
        if isinstance(tree, list):
            return [self._build(x) for x in tree]
        if not isinstance(tree, dict):
            return tree
        if _TYPE in tree:
            name = tree[_TYPE]
            cls = self._classes.get(name) if isinstance(name, str) else None
            if cls is None:
                raise BadTree(f"unknown type {str(name)[:40]!r}")
            kwargs = {k: self._build(v) for k, v in tree.items() if k != _TYPE}
            extra = set(kwargs) - self._fields[name]
            if extra:
                raise BadTree(f"{name} has no field {sorted(extra)[0]!r}")
            try:
                return cls(**kwargs)
            except TypeError as e:
                raise BadTree(f"{name}: {e}") from None
        if set(tree) == {_TUPLE} and isinstance(tree[_TUPLE], list):
            return tuple(self._build(x) for x in tree[_TUPLE])
        return {k: self._build(v) for k, v in tree.items()}
