"""How a round cuts a flat fragment: one part per reducer, each part in chunks (step 1 of
``transport/reduce.py``). Every member computes the same layout from (numel, group order, codec)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from opendiloco_stream.compression import Codec
from opendiloco_stream.config import CHUNK_BYTES_BOUNDS

DEFAULT_CHUNK_BYTES = 1 << 20  # the smallest derived chunk (slow links), and the local transport's default
MAX_CHUNK_BYTES = 8 << 20  # the largest derived chunk (MAX_ANNOUNCED_CHUNK_BYTES: the largest taken)
CHUNK_SECONDS = 0.04  # a derived chunk is what the link carries in this long
MIN_CHUNK_BYTES, MAX_ANNOUNCED_CHUNK_BYTES = CHUNK_BYTES_BOUNDS  # net.chunk_bytes's; no larger size is taken


@dataclass(frozen=True)
class GroupLayout:
    """Which reducer owns which elements, cut into chunks; identical on every member of the group.

    ``parts[i]`` is the ``(lo, hi)`` range reduced by member ``i`` (empty for client-mode peers);
    ``chunks[i]`` the ``(lo, hi)`` ranges of that part, in order.
    """

    numel: int
    parts: tuple[tuple[int, int], ...]
    chunks: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def build(cls, numel: int, is_reducer: Sequence[bool], align: int, chunk_numel: int) -> "GroupLayout":
        reducers = [i for i, r in enumerate(is_reducer) if r]
        if not reducers:
            raise ValueError("a group needs at least one reducer (a peer not in client mode)")
        align = max(1, int(align))
        chunk_numel = max(align, chunk_numel // align * align)
        n_blocks = -(-numel // align)
        parts: list[tuple[int, int]] = [(0, 0)] * len(is_reducer)
        for k, i in enumerate(reducers):  # equal shares, whole blocks each
            lo = min(numel, n_blocks * k // len(reducers) * align)
            hi = min(numel, n_blocks * (k + 1) // len(reducers) * align)
            parts[i] = (lo, hi)
        chunks = tuple(
            tuple((c, min(c + chunk_numel, hi)) for c in range(lo, hi, chunk_numel)) for lo, hi in parts
        )
        return cls(numel, tuple(parts), chunks)

    @classmethod
    def for_codec(cls, codec: Codec, numel: int, is_reducer: Sequence[bool],
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "GroupLayout":
        """The layout every transport uses: parts and chunks on whole blocks of ``codec``."""
        align = codec_alignment(codec)
        return cls.build(numel, is_reducer, align, chunk_numel_for(codec, chunk_bytes, align))


def group_chunk_bytes(users: Sequence) -> int:
    """The group's chunk size: the smallest one its members announced at matchmaking (``chunk``).

    Sizes derive from each peer's own link rate, so a group mixes them. With the smallest, no
    chunk is larger than any member would cut for its own link, and a chunk from a slow member
    arrives within the silence bound a fast reducer derived for its own chunks (as when every
    peer cut 1 MiB). A member that does not say, or says something outside
    ``MIN_CHUNK_BYTES``-``MAX_ANNOUNCED_CHUNK_BYTES``, counts as ``DEFAULT_CHUNK_BYTES`` (what
    peers used before the size was announced)."""
    sizes = []
    for user in users:
        c = user.get("chunk") if isinstance(user, dict) else None
        ok = isinstance(c, int) and not isinstance(c, bool) and MIN_CHUNK_BYTES <= c <= MAX_ANNOUNCED_CHUNK_BYTES
        sizes.append(c if ok else DEFAULT_CHUNK_BYTES)
    return min(sizes, default=DEFAULT_CHUNK_BYTES)


def chunk_bytes_for_link(link_mbit: float) -> int:
    """The default chunk size: what a ``link_mbit`` link carries in ``CHUNK_SECONDS``, within
    ``DEFAULT_CHUNK_BYTES`` (1 MiB, up to ~200 Mbit/s) and ``MAX_CHUNK_BYTES`` (8 MiB, from ~1.7 Gbit/s).

    Every chunk costs a message, a check and a result on each side, whatever its size: a 10M fp32
    loopback round (3 peers, group formed ahead) took 0.17-0.18 s in 1 MiB chunks and 0.14 s in
    8 MiB (docs/benchmarks.md, "Chunk size"). A chunk that takes at most 40 ms on its link keeps the
    pipeline (a reducer checks chunk j while j+1 arrives) and ``next_chunk_timeout`` (derived from
    the chunk's transfer time) as they were on slow links."""
    if not link_mbit > 0:
        raise ValueError(f"link_mbit must be > 0, got {link_mbit}")
    wanted = int(link_mbit * 1e6 / 8 * CHUNK_SECONDS)
    return max(DEFAULT_CHUNK_BYTES, min(MAX_CHUNK_BYTES, wanted))


def resolve_chunk_bytes(chunk_bytes: Optional[int], link_mbit: float) -> int:
    """A peer's chunk size: ``chunk_bytes`` if given (``MIN_CHUNK_BYTES``-``MAX_ANNOUNCED_CHUNK_BYTES``,
    else ``ValueError``), or the one derived from the link (:func:`chunk_bytes_for_link`)."""
    if chunk_bytes is None:
        return chunk_bytes_for_link(link_mbit)
    if not MIN_CHUNK_BYTES <= int(chunk_bytes) <= MAX_ANNOUNCED_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_ANNOUNCED_CHUNK_BYTES} (or None), "
                         f"got {chunk_bytes}")
    return int(chunk_bytes)


def chunk_numel_for(codec: Codec, chunk_bytes: int, align: int) -> int:
    """Elements per chunk so that a chunk encodes to about ``chunk_bytes`` bytes."""
    probe = 1 << 20
    bytes_per_value = codec.encoded_size(probe) / probe
    return max(align, int(chunk_bytes / bytes_per_value) // align * align)


def codec_alignment(codec: Codec) -> int:
    """Part and chunk boundaries fall on whole codec blocks, so encoding chunk by chunk gives the
    same values as encoding the whole tensor (for deterministic rounding)."""
    return codec.block_size if codec.is_blockwise else 1
