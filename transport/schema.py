"""Wire schemas derived from message annotations: each field type becomes a small node that checks a value
(and converts `Record`s between dataclass and positional array). Built once per class at import; used by the
codec in both directions, so a sender gets the same error a receiver would."""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from transport.errors import ProtocolError
from transport.messages import Record

_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)


class Node(Protocol):
    def convert(self, value: object, budget: int, decoding: bool) -> object:
        """Checks `value`; returns it in the other representation. `budget` is the nesting depth left."""


def _type_name(value: object) -> str:
    return type(value).__name__


def _enter(budget: int) -> int:
    if budget <= 0:
        raise ProtocolError("nesting too deep")
    return budget - 1


@dataclass(frozen=True)
class Scalar:
    types: frozenset[type]
    name: str

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        # Exact types: bool is not an int here, and str subclasses are not str.
        if type(value) not in self.types:
            raise ProtocolError(f"expected {self.name}, got {_type_name(value)}")
        return value


@dataclass(frozen=True)
class Nullable:
    inner: Node

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        return None if value is None else self.inner.convert(value, budget, decoding)


@dataclass(frozen=True)
class ListOf:
    item: Node

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        if type(value) is not list:
            raise ProtocolError(f"expected list, got {_type_name(value)}")
        budget = _enter(budget)
        if isinstance(self.item, Scalar):  # the hot case (token ids): check without copying
            if not all(type(v) in self.item.types for v in value):
                raise ProtocolError(f"expected list[{self.item.name}]")
            return value
        return [self.item.convert(v, budget, decoding) for v in value]


@dataclass(frozen=True)
class DictOf:
    value: Node

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        if type(value) is not dict:
            raise ProtocolError(f"expected dict, got {_type_name(value)}")
        budget = _enter(budget)
        if not all(type(k) is str for k in value):
            raise ProtocolError("dict keys must be str")
        return {k: self.value.convert(v, budget, decoding) for k, v in value.items()}


@dataclass(frozen=True)
class Plain:
    """`Any`: any nesting of msgpack-native values, with str dict keys, within the depth budget."""

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        _check_plain(value, budget)
        return value


def _check_plain(value: object, budget: int) -> None:
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return
    if kind is list:
        budget = _enter(budget)
        for item in value:  # type: ignore[attr-defined]
            _check_plain(item, budget)
    elif kind is dict:
        budget = _enter(budget)
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                raise ProtocolError("dict keys must be str")
            _check_plain(item, budget)
    else:
        raise ProtocolError(f"{kind.__name__} is not a wire type")


@dataclass(frozen=True)
class RecordSpec:
    """A `Record` class: a dataclass in Python, an array of its field values on the wire."""

    cls: type[Record]
    names: tuple[str, ...]
    nodes: tuple[Node, ...]

    def convert(self, value: object, budget: int, decoding: bool) -> object:
        budget = _enter(budget)
        return self.from_wire(value, budget) if decoding else self.to_wire(value, budget)

    def to_wire(self, value: object, budget: int) -> list[object]:
        if type(value) is not self.cls:
            raise ProtocolError(f"expected {self.cls.__name__}, got {_type_name(value)}")
        return [self._field(n, node, getattr(value, n), budget, False) for n, node in zip(self.names, self.nodes)]

    def from_wire(self, value: object, budget: int) -> Record:
        if type(value) is not list or len(value) != len(self.nodes):
            raise ProtocolError(f"{self.cls.__name__}: expected an array of {len(self.nodes)} fields")
        args = [self._field(n, node, v, budget, True) for n, node, v in zip(self.names, self.nodes, value)]
        return self.cls(*args)

    def _field(self, name: str, node: Node, value: object, budget: int, decoding: bool) -> object:
        try:
            return node.convert(value, budget, decoding)
        except ProtocolError as exc:
            raise ProtocolError(f"{self.cls.__name__}.{name}: {exc}") from None


_SCALAR_NODES: Mapping[object, Scalar] = MappingProxyType({
    int: Scalar(frozenset({int}), "int"),
    float: Scalar(frozenset({float, int}), "float"),  # 0 and 0.0 are the same number to every reader
    str: Scalar(frozenset({str}), "str"),
    bytes: Scalar(frozenset({bytes}), "bytes"),
    bool: Scalar(frozenset({bool}), "bool"),
    type(None): Scalar(frozenset({type(None)}), "None"),
})


def node_for(annotation: object) -> Node:
    """The node for one resolved field annotation; a TypeError here is a bug in `messages.py`."""
    if annotation in _SCALAR_NODES:
        return _SCALAR_NODES[annotation]
    if annotation is Any:
        return Plain()
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return record_spec(annotation)
    return _generic_node(annotation, typing.get_origin(annotation), typing.get_args(annotation))


def _generic_node(annotation: object, origin: object, args: tuple[object, ...]) -> Node:
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return Nullable(node_for(next(a for a in args if a is not type(None))))
    if annotation is list or origin is list:
        return ListOf(node_for(args[0]) if args else Plain())
    if (annotation is dict or origin is dict) and (not args or args[0] is str):
        return DictOf(node_for(args[1]) if args else Plain())
    raise TypeError(f"{annotation!r} is not a supported wire type")


def record_spec(cls: type[Record]) -> RecordSpec:
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return RecordSpec(cls, names, tuple(node_for(hints[n]) for n in names))
