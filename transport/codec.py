"""The one codec: message dataclass <-> msgpack bytes. No pickle, no extension types.

Wire format of one message (one frame's body): a msgpack map with exactly two keys,
    {"t": <tag str>, "f": [<field values in declaration order>]}
where a `Record` field value (e.g. a `TokenUpdate` row) is itself an array of its field values, bytes travel
as msgpack bin, and strings as msgpack str (UTF-8). Positional fields keep per-token traffic small; the tag
plus `PROTOCOL_VERSION` (exchanged in `Hello`) make the layout unambiguous.

Both directions check every field against its annotation (exact types; bool is not int; a float field takes
ints), the nesting depth and the sizes in `Limits`. Anything wrong raises `ProtocolError`, the only error
type this module raises.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NoReturn

import msgpack

from transport.errors import ProtocolError
from transport.messages import MESSAGE_TYPES, Message
from transport.schema import RecordSpec, record_spec

MAX_MESSAGE_BYTES = 64 << 20
_SPLIT_BYTES = 1 << 20
_BIN32 = struct.Struct(">BI")  # msgpack bin 32: 0xc6, then the big-endian length


@dataclass(frozen=True)
class Limits:
    """Bounds on one message. `max_bytes` caps the encoded size and every str/bin inside it; the array and map
    caps bound the memory a small frame can expand into (a 1-byte msgpack int is a 28-byte Python int)."""

    max_bytes: int = MAX_MESSAGE_BYTES
    max_array_len: int = 1 << 21  # a 2M-token prompt
    max_map_len: int = 1 << 12
    max_depth: int = 8  # containers inside one field, e.g. updates -> row -> top_logprobs -> pair is 4

    def __post_init__(self) -> None:
        if not 0 < self.max_bytes < 1 << 32:  # frames carry a 4-byte length
            raise ValueError(f"max_bytes must be in (0, 2**32), got {self.max_bytes}")


DEFAULT_LIMITS = Limits()

_SPECS: Mapping[str, RecordSpec] = MappingProxyType({tag: record_spec(cls) for tag, cls in MESSAGE_TYPES.items()})


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The message's wire bytes; ProtocolError if it is not a registered message or breaks a limit."""
    return b"".join(encode_parts(msg, limits))


def encode_parts(msg: Message, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    """`encode` as a list of buffers to write back to back. A large `bytes` field at the end of a message
    (KV pages) comes back as its own, uncopied part: the envelope is length-prefixed, so the payload is the
    tail of the encoding, and copying tens of MiB costs more than the syscall that sends them."""
    spec = _spec_of(msg)
    fields = spec.to_wire(msg, limits.max_depth)
    tail = fields[-1] if fields else None
    if type(tail) is not bytes or len(tail) < _SPLIT_BYTES:
        return [_pack_envelope(msg.TAG, fields, len(fields), limits)]
    _check_size(len(tail), limits)
    head = _pack_envelope(msg.TAG, fields[:-1], len(fields), limits) + _BIN32.pack(0xC6, len(tail))
    _check_size(len(head) + len(tail), limits)
    return [head, tail]


def _pack_envelope(tag: str, fields: list[object], count: int, limits: Limits) -> bytes:
    """`{"t": tag, "f": [...]}` with an array header for `count` fields, of which `fields` are packed here."""
    packer = msgpack.Packer(use_bin_type=True, strict_types=True)
    try:
        parts = [packer.pack_map_header(2), packer.pack("t"), packer.pack(tag), packer.pack("f"),
                 packer.pack_array_header(count), *(packer.pack(f) for f in fields)]
    except (OverflowError, ValueError, TypeError) as exc:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"{tag}: cannot encode: {exc}") from None
    data = b"".join(parts)
    _check_size(len(data), limits)
    return data


def decode(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The message in `data` (exactly one, nothing after it); ProtocolError for anything else."""
    _check_size(len(data), limits)
    tag, fields = _envelope(_unpack(data, limits))
    spec = _SPECS.get(tag)
    if spec is None:
        raise ProtocolError(f"unknown message tag {tag[:40]!r}")
    return spec.from_wire(fields, limits.max_depth)  # type: ignore[return-value]


def _spec_of(msg: object) -> RecordSpec:
    spec = _SPECS.get(getattr(type(msg), "TAG", None))  # type: ignore[arg-type]
    if spec is None or spec.cls is not type(msg):
        raise ProtocolError(f"{type(msg).__name__} is not a registered message")
    return spec


def _check_size(size: int, limits: Limits) -> None:
    if size > limits.max_bytes:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {limits.max_bytes}")


def _reject_ext(code: int, data: bytes) -> NoReturn:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def _unpack(data: bytes | bytearray | memoryview, limits: Limits) -> object:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
            max_str_len=limits.max_bytes, max_bin_len=limits.max_bytes, max_ext_len=limits.max_bytes,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len)
    except ProtocolError:
        raise
    except Exception as exc:  # the C decoder raises several types; all mean "not a valid message"
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}"[:200]) from None


def _envelope(obj: object) -> tuple[str, list[object]]:
    if type(obj) is not dict or obj.keys() != {"t", "f"}:  # type: ignore[attr-defined]
        raise ProtocolError("expected a map with keys 't' and 'f'")
    tag, fields = obj["t"], obj["f"]  # type: ignore[index]
    if type(tag) is not str or type(fields) is not list:
        raise ProtocolError("'t' must be a str and 'f' an array")
    return tag, fields
