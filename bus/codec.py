"""The one wire codec: msgpack through msgspec, with typed decoding.

Decoders are cached per type because building one costs more than decoding a small message.
"""

from __future__ import annotations

from functools import cache
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


@cache
def _decoder(message_type: type[msgspec.Struct]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(message_type)


def decode(data: bytes, message_type: type[T]) -> T:
    """Decode `data` as `message_type`; raises msgspec.ValidationError on a schema mismatch."""
    return _decoder(message_type).decode(data)
