"""msgpack encoding of the wire Structs. Decoding validates: a malformed message raises
MalformedMessage at the edge, never deep inside a loop."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


@cache
def _decoder(tp: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(tp)


class MalformedMessage(msgspec.ValidationError):
    """`decode` was given bytes that are not a message of the type asked for: not msgpack, the
    wrong shape, a field of the wrong type. Its text says what is wrong (a dead letter quotes it)."""


def decode(data: bytes, tp: type[T]) -> T:
    try:
        return _decoder(tp).decode(data)
    except msgspec.DecodeError as e:  # ValidationError included (a subclass)
        raise MalformedMessage(str(e)) from None
