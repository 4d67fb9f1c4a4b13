"""A decoder of the `tf.train.Example` wire format, so TFF's files load without TensorFlow.

TFF's `SqlClientData` stores every example as a serialized `tf.train.Example`
(tensorflow/core/example/example.proto and feature.proto):

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }         # map entry: key = 1, value = 2
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                            Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }  FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

The wire format of those five messages is a few varints and length-delimited fields, so a small
decoder here beats a TensorFlow (or generated protobuf) dependency for reading a dataset. It
accepts packed and unpacked repeated scalars, as protobuf parsers must, and skips unknown fields.
"""

from __future__ import annotations

import struct

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class ExampleError(ValueError):
    """The bytes are not a well-formed `tf.train.Example`; the message says where."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ExampleError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ExampleError("varint longer than 10 bytes")


def _fields(buf: bytes):
    """(field number, wire type, value) of each field: an int for varints, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ExampleError("field number 0")
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire == _LEN:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ExampleError(f"field {number} claims {size} bytes, {len(buf) - pos} remain")
            value, pos = buf[pos : pos + size], pos + size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            if pos + width > len(buf):
                raise ExampleError(f"truncated fixed{width * 8} field {number}")
            value, pos = buf[pos : pos + width], pos + width
        else:
            raise ExampleError(f"unsupported wire type {wire} in field {number}")
        yield number, wire, value


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def _feature(buf: bytes) -> list:
    kinds = [(number, wire, value) for number, wire, value in _fields(buf) if number in (1, 2, 3)]
    if not kinds:
        return []  # a Feature with no kind set: an empty list, as TensorFlow reads it
    number, wire, body = kinds[-1]
    if wire != _LEN:
        raise ExampleError(f"Feature field {number} is not length-delimited")
    values: list = []
    for item_number, item_wire, item in _fields(body):
        if item_number != 1:
            continue
        if number == 1:  # bytes_list
            if item_wire != _LEN:
                raise ExampleError("BytesList value is not length-delimited")
            values.append(bytes(item))
        elif number == 2:  # float_list: packed (LEN) or one fixed32 each
            raw = item if item_wire in (_LEN, _I32) else None
            if raw is None or len(raw) % 4:
                raise ExampleError("FloatList values are not 4-byte floats")
            values.extend(struct.unpack(f"<{len(raw) // 4}f", raw))
        elif item_wire == _VARINT:  # int64_list, unpacked
            values.append(_signed64(item))
        elif item_wire == _LEN:  # int64_list, packed
            pos = 0
            while pos < len(item):
                value, pos = _varint(item, pos)
                values.append(_signed64(value))
        else:
            raise ExampleError("Int64List values are not varints")
    return values


def parse_example(buf: bytes) -> dict[str, list]:
    """{feature name: its values (bytes, float or int)} of one serialized `tf.train.Example`.

    Raises ExampleError on bytes that are not one (truncated, or the wrong message)."""
    features: dict[str, list] = {}
    for number, wire, body in _fields(bytes(buf)):
        if number != 1:
            continue
        if wire != _LEN:
            raise ExampleError("Example.features is not length-delimited")
        for entry_number, entry_wire, entry in _fields(body):
            if entry_number != 1:
                continue
            if entry_wire != _LEN:
                raise ExampleError("Features.feature entry is not length-delimited")
            key, value = b"", b""
            for part_number, part_wire, part in _fields(entry):
                if part_wire != _LEN:
                    raise ExampleError("a feature map entry's key or value is not length-delimited")
                if part_number == 1:
                    key = part
                elif part_number == 2:
                    value = part
            try:
                name = key.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ExampleError("a feature name is not UTF-8") from exc
            features[name] = _feature(value)
    return features
