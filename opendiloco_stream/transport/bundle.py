"""A result chunk that carries several encoded contributions (sparse codecs, ``transport/reduce.py``):
a little-endian uint32 count, one uint64 length per payload, then the payloads in member order."""

from __future__ import annotations

import struct
from typing import Sequence

_COUNT, _LENGTH = struct.Struct("<I"), struct.Struct("<Q")


def pack_bundle(payloads: Sequence[bytes]) -> bytes:
    """Several encoded chunks as one result payload: count, each length, the payloads in order."""
    return b"".join([_COUNT.pack(len(payloads)), *(_LENGTH.pack(len(p)) for p in payloads), *payloads])


def unpack_bundle(data: bytes, count: int) -> list[bytes]:
    """Inverse of :func:`pack_bundle`; ``ValueError`` unless it holds exactly ``count`` payloads."""
    data = bytes(data)
    head = _COUNT.size + count * _LENGTH.size
    if len(data) < head or _COUNT.unpack_from(data, 0)[0] != count:
        raise ValueError(f"result bundle does not hold the {count} contributions of the verdict")
    lengths = [_LENGTH.unpack_from(data, _COUNT.size + i * _LENGTH.size)[0] for i in range(count)]
    if head + sum(lengths) != len(data):
        raise ValueError(f"result bundle has {len(data)} bytes, its lengths say {head + sum(lengths)}")
    out, offset = [], head
    for n in lengths:
        out.append(data[offset:offset + n])
        offset += n
    return out
