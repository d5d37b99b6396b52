"""``tf.train.Example`` encoding and decoding without TensorFlow (a few dozen lines of protobuf wire format).

An Example decodes to ``{feature name: list}`` of ``bytes``, ``float`` or ``int`` values.

Example:
    >>> decode_example(encode_example({"label": [1], "x": [0.5, 2.0], "id": [b"a"]}))
    {'label': [1], 'x': [0.5, 2.0], 'id': [b'a']}
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from vertexrt.errors import DataError

Value = bytes | float | int


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DataError("truncated varint in tf.train.Example")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DataError("varint longer than 10 bytes in tf.train.Example")


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` for each field of a message (value: int or bytes)."""
    out = []
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > n:
                raise DataError(f"field {number} overruns the tf.train.Example message")
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        else:
            raise DataError(f"unsupported protobuf wire type {wire}: the payload is not a tf.train.Example")
        out.append((number, wire, value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _feature(buf: bytes) -> list[Value]:
    for kind, _, body in _fields(buf):
        if kind == 1:  # BytesList
            return [v for number, wire, v in _fields(body) if number == 1 and wire == 2]
        if kind == 2:  # FloatList: packed (wire 2) or not (wire 5)
            floats: list[Value] = []
            for number, _wire, v in _fields(body):
                if number == 1:
                    floats.extend(struct.unpack(f"<{len(v) // 4}f", v))
            return floats
        if kind == 3:  # Int64List: packed (wire 2) or varints (wire 0)
            ints: list[Value] = []
            for number, wire, v in _fields(body):
                if number != 1:
                    continue
                if wire == 0:
                    ints.append(_signed(v))
                else:
                    pos = 0
                    while pos < len(v):
                        raw, pos = _varint(v, pos)
                        ints.append(_signed(raw))
            return ints
    return []


def decode_example(payload: bytes) -> dict[str, list[Value]]:
    """A serialized ``tf.train.Example`` as ``{name: [values]}``.

    Raises:
        DataError: the payload is not a valid Example.
    """
    features: dict[str, list[Value]] = {}
    for number, wire, body in _fields(bytes(payload)):
        if number != 1 or wire != 2:
            continue
        for entry_number, _, entry in _fields(body):
            if entry_number != 1:
                continue
            key, value = "", b""
            for field, _, item in _fields(entry):
                if field == 1:
                    key = item.decode("utf-8")
                elif field == 2:
                    value = item
            features[key] = _feature(value)
    return features


def _tag(number: int, wire: int) -> bytes:
    return _encode_varint((number << 3) | wire)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, body: bytes) -> bytes:
    return _tag(number, 2) + _encode_varint(len(body)) + body


def encode_example(features: Mapping[str, Sequence[Value] | Value]) -> bytes:
    """Serialize ``{name: values}`` as a ``tf.train.Example`` (the list kind follows the values' type).

    An empty list is written as a feature without a list kind, which ``tf.io.parse_example`` reads as an
    empty list under any declared dtype (int64, float32 or string).

    Raises:
        DataError: a feature mixes value types or has an unsupported type.
    """
    entries = []
    for name, values in features.items():
        items: list[Any] = list(values) if isinstance(values, list | tuple) else [values]
        if not items:  # a Feature with no list kind: TensorFlow parses it as empty under any dtype
            feature = b""
        elif all(isinstance(v, bytes | str) for v in items):
            blobs = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
            feature = _len_field(1, b"".join(_len_field(1, b) for b in blobs))
        elif all(isinstance(v, bool | int) for v in items):
            packed = b"".join(_encode_varint(int(v)) for v in items)
            feature = _len_field(3, _len_field(1, packed))
        elif all(isinstance(v, float | int) for v in items):
            feature = _len_field(2, _len_field(1, struct.pack(f"<{len(items)}f", *items)))
        else:
            raise DataError(f"feature {name!r}: values must all be bytes/str, all int, or all float")
        entry = _len_field(1, name.encode("utf-8")) + _len_field(2, feature)
        entries.append(_len_field(1, entry))
    return _len_field(1, b"".join(entries))
