"""The self-describing wire header shared by every codec, and exact byte counts.

Layout of an encoded tensor (all integers little-endian)::

    offset  size  field
    0       4     magic  b"ODSQ"
    4       1     version (1)
    5       1     codec id (see ``CODEC_IDS``)
    6       1     scale dtype: 0 = none (plain casts), 1 = fp16, 2 = fp32
    7       1     reserved, must be 0
    8       4     block size (0 for plain casts, 8..4096 otherwise)
    12      8     numel (elements of the flattened tensor)
    20      4     reserved, must be 0
    24      ...   per-block scales (block codecs): ceil(numel / block) x 2 or 4 bytes
    ...     ...   codes: 4 / 2 / 1 / 0.5 bytes per element (4-bit: ceil(numel / 2) bytes)

The header is 24 bytes so that the scales (and fp32 payloads) start 8-byte aligned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"ODSQ"
VERSION = 1
HEADER_SIZE = 24
_HEADER = struct.Struct("<4sBBBBIQI")
assert _HEADER.size == HEADER_SIZE

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1")
# Wire ids are part of the format: never renumber, only append.
CODEC_IDS = {name: i + 1 for i, name in enumerate(CODEC_NAMES)}
_NAMES_BY_ID = {i: name for name, i in CODEC_IDS.items()}

# Bits per element of the code payload.
CODE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "fp8-e4m3": 8, "fp4-e3m0": 4, "fp4-e2m1": 4}
BLOCK_CODECS = frozenset({"int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1"})

SCALE_DTYPES = ("fp16", "fp32")
_SCALE_IDS = {"fp16": 1, "fp32": 2}
_SCALE_NAMES_BY_ID = {i: name for name, i in _SCALE_IDS.items()}
SCALE_BYTES = {"fp16": 2, "fp32": 4}

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 4096
# Guards the size arithmetic against absurd headers (2**48 elements is far beyond any fragment).
MAX_NUMEL = 1 << 48


class NonFiniteError(ValueError):
    """A tensor holding NaN or Inf was given to ``encode`` (or such values were found in encoded bytes)."""


@dataclass(frozen=True)
class WireHeader:
    """What the first ``HEADER_SIZE`` bytes of an encoded tensor say."""

    codec: str
    numel: int
    block_size: int  # 0 for plain casts
    scale_dtype: str | None  # None for plain casts

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.block_size) if self.block_size else 0

    @property
    def scales_nbytes(self) -> int:
        return self.n_blocks * SCALE_BYTES[self.scale_dtype] if self.scale_dtype else 0

    @property
    def codes_nbytes(self) -> int:
        return (self.numel * CODE_BITS[self.codec] + 7) // 8

    @property
    def total_nbytes(self) -> int:
        return HEADER_SIZE + self.scales_nbytes + self.codes_nbytes

    def pack(self) -> bytes:
        scale_id = _SCALE_IDS[self.scale_dtype] if self.scale_dtype else 0
        return _HEADER.pack(MAGIC, VERSION, CODEC_IDS[self.codec], scale_id, 0, self.block_size, self.numel, 0)


def read_header(data: bytes | bytearray | memoryview) -> WireHeader:
    """Parse and validate the header of ``data``, including that the total length matches.

    Raises ``ValueError`` with one line saying what is wrong.
    """
    size = len(data)
    if size < HEADER_SIZE:
        raise ValueError(f"encoded tensor truncated: {size} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, codec_id, scale_id, reserved0, block_size, numel, reserved1 = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"not an encoded tensor: bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"unsupported wire version {version} (this build reads version {VERSION})")
    if reserved0 or reserved1:
        raise ValueError("malformed header: reserved fields are not zero")
    codec = _NAMES_BY_ID.get(codec_id)
    if codec is None:
        raise ValueError(f"unknown codec id {codec_id} in header (known: 1..{len(CODEC_NAMES)})")
    if numel > MAX_NUMEL:
        raise ValueError(f"malformed header: numel {numel} exceeds the limit {MAX_NUMEL}")
    if codec in BLOCK_CODECS:
        scale_dtype = _SCALE_NAMES_BY_ID.get(scale_id)
        if scale_dtype is None:
            raise ValueError(f"malformed header: scale dtype id {scale_id} is not valid for {codec}")
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"malformed header: block size {block_size} outside {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"
            )
    else:
        if scale_id or block_size:
            raise ValueError(f"malformed header: {codec} carries no scales but the header declares some")
        scale_dtype = None
    header = WireHeader(codec=codec, numel=numel, block_size=block_size, scale_dtype=scale_dtype)
    if size != header.total_nbytes:
        raise ValueError(
            f"encoded tensor has {size} bytes but its header ({codec}, numel={numel}, "
            f"block={block_size}, scales={scale_dtype}) implies {header.total_nbytes}"
        )
    return header
