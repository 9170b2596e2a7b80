"""msgpack encoding of the wire Structs. Decoding validates: a malformed message raises
msgspec.DecodeError / ValidationError at the edge, never deep inside a loop."""

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


def decode(data: bytes, tp: type[T]) -> T:
    return _decoder(tp).decode(data)


DecodeError = (msgspec.DecodeError, msgspec.ValidationError)
