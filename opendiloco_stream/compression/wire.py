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
    20      4     sparse codecs: k, the values kept per chunk (1..block); 0 for every other codec
    24      ...   per-block scales (block and sparse codecs): ceil(numel / block) x 2 or 4 bytes
    ...     ...   codes: 4 / 2 / 1 / 0.5 bytes per element (4-bit: ceil(numel / 2) bytes)

Sparse codecs (``topk-int2``, ``topk-int4``; the block is the chunk) replace the codes with
``K = sum over chunks of min(k, chunk length)`` kept entries: first their in-chunk indices
(``index_bits(block)`` bits each, ascending within a chunk), then their values (2 or 4 bits each),
each stream packed LSB-first and padded with zero bits to a whole byte (``compression/sparse.py``).

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

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1", "topk-int2", "topk-int4")
# Wire ids are part of the format: never renumber, only append.
CODEC_IDS = {name: i + 1 for i, name in enumerate(CODEC_NAMES)}
_NAMES_BY_ID = {i: name for name, i in CODEC_IDS.items()}

# Bits per element of the code payload (sparse codecs: per kept value, indices not included).
CODE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "fp8-e4m3": 8, "fp4-e3m0": 4, "fp4-e2m1": 4,
             "topk-int2": 2, "topk-int4": 4}
BLOCK_CODECS = frozenset({"int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1"})
# Top-k per chunk (the block), kept values at 2 or 4 bits with a per-chunk scale.
SPARSE_CODECS = frozenset({"topk-int2", "topk-int4"})

SCALE_DTYPES = ("fp16", "fp32")
_SCALE_IDS = {"fp16": 1, "fp32": 2}
_SCALE_NAMES_BY_ID = {i: name for name, i in _SCALE_IDS.items()}
SCALE_BYTES = {"fp16": 2, "fp32": 4}

MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 4096
# Guards the size arithmetic against absurd headers (2**48 elements is far beyond any fragment).
MAX_NUMEL = 1 << 48


def index_bits(block_size: int) -> int:
    """Bits of one in-chunk index of a sparse codec (enough for 0..block_size-1)."""
    return max(1, (block_size - 1).bit_length())


class NonFiniteError(ValueError):
    """A tensor holding NaN or Inf was given to ``encode`` (or such values were found in encoded bytes)."""


@dataclass(frozen=True)
class WireHeader:
    """What the first ``HEADER_SIZE`` bytes of an encoded tensor say."""

    codec: str
    numel: int
    block_size: int  # 0 for plain casts
    scale_dtype: str | None  # None for plain casts
    k: int = 0  # sparse codecs: values kept per chunk

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.block_size) if self.block_size else 0

    @property
    def scales_nbytes(self) -> int:
        return self.n_blocks * SCALE_BYTES[self.scale_dtype] if self.scale_dtype else 0

    @property
    def kept(self) -> int:
        """Sparse codecs: entries on the wire (k per chunk, the short last chunk at most its length)."""
        if not self.k:
            return 0
        full, rest = divmod(self.numel, self.block_size)
        return full * self.k + min(self.k, rest)

    @property
    def indices_nbytes(self) -> int:
        return (self.kept * index_bits(self.block_size) + 7) // 8 if self.k else 0

    @property
    def codes_nbytes(self) -> int:
        if self.k:
            return (self.kept * CODE_BITS[self.codec] + 7) // 8
        return (self.numel * CODE_BITS[self.codec] + 7) // 8

    @property
    def total_nbytes(self) -> int:
        return HEADER_SIZE + self.scales_nbytes + self.indices_nbytes + self.codes_nbytes

    def pack(self) -> bytes:
        scale_id = _SCALE_IDS[self.scale_dtype] if self.scale_dtype else 0
        return _HEADER.pack(MAGIC, VERSION, CODEC_IDS[self.codec], scale_id, 0, self.block_size, self.numel, self.k)


def read_header(data: bytes | bytearray | memoryview) -> WireHeader:
    """Parse and validate the header of ``data``, including that the total length matches.

    Raises ``ValueError`` with one line saying what is wrong.
    """
    size = len(data)
    if size < HEADER_SIZE:
        raise ValueError(f"encoded tensor truncated: {size} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, codec_id, scale_id, reserved0, block_size, numel, k = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"not an encoded tensor: bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ValueError(f"unsupported wire version {version} (this build reads version {VERSION})")
    codec = _NAMES_BY_ID.get(codec_id)
    if codec is None:
        raise ValueError(f"unknown codec id {codec_id} in header (known: 1..{len(CODEC_NAMES)})")
    if reserved0 or (k and codec not in SPARSE_CODECS):
        raise ValueError("malformed header: reserved fields are not zero")
    if numel > MAX_NUMEL:
        raise ValueError(f"malformed header: numel {numel} exceeds the limit {MAX_NUMEL}")
    if codec in BLOCK_CODECS or codec in SPARSE_CODECS:
        scale_dtype = _SCALE_NAMES_BY_ID.get(scale_id)
        if scale_dtype is None:
            raise ValueError(f"malformed header: scale dtype id {scale_id} is not valid for {codec}")
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"malformed header: block size {block_size} outside {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"
            )
        if codec in SPARSE_CODECS and not 1 <= k <= block_size:
            raise ValueError(f"malformed header: {codec} keeps k={k} values per chunk, outside 1..{block_size}")
    else:
        if scale_id or block_size:
            raise ValueError(f"malformed header: {codec} carries no scales but the header declares some")
        scale_dtype = None
    header = WireHeader(codec=codec, numel=numel, block_size=block_size, scale_dtype=scale_dtype, k=k)
    if size != header.total_nbytes:
        raise ValueError(
            f"encoded tensor has {size} bytes but its header ({codec}, numel={numel}, "
            f"block={block_size}, scales={scale_dtype}) implies {header.total_nbytes}"
        )
    return header
