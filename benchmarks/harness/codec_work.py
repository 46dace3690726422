"""The codec work of one peer's round, without a transport (``benchmarks.codec_floor`` times it;
``benchmarks.transport_rounds --gloo`` prints its floor next to each round).

:func:`peer_work` does, on one thread, every computation the networked round
(``transport/hivemind/runner.py``) does in one peer, with the same functions and the same layout;
:func:`measure` times it for every peer of a group and checks each peer's average, bit for bit,
against the in-process round's (``reduce_in_process``).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time

import torch

from opendiloco_stream.compression import get_codec, native
from opendiloco_stream.transport.reduce import (
    DEFAULT_CHUNK_BYTES, DEFAULT_NORM_BOUND, OK, GroupLayout, PartReducer, decode_result, reduce_in_process,
    sum_of_squares,
)


def keep_freed_chunks() -> None:
    """Let glibc's malloc keep freed chunk-sized buffers for reuse (as the forked averager processes
    of earlier versions did) rather than hand them back to the kernel; no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 512 << 20)


def _own_chunk(codec, tensor: torch.Tensor, sent: torch.Tensor, lo: int, hi: int):
    """The runner's ``_encode_chunk``: fp32 goes out as a view; a lossy codec also decodes what it sent."""
    if codec.name == "fp32":
        return codec.encode_parts(tensor[lo:hi])
    payload = codec.encode(tensor[lo:hi])
    codec.decode_into(payload, sent[lo:hi])
    return payload


def _round_bytes(codec, tensors, weights, layout, norm_bound):
    """Every member's contributions and every part's result bytes (made once, not timed)."""
    n = len(tensors)
    contrib = [[[codec.encode(tensors[s][lo:hi]) for lo, hi in layout.chunks[q]] for q in range(n)] for s in range(n)]
    results = []
    for q in range(n):
        part = PartReducer(codec, layout.chunks[q], [OK] * n, norm_bound)
        for s in range(n):
            for j in range(len(layout.chunks[q])):
                part.take(s, j, contrib[s][q][j])
        final = part.verdict()
        results.append([part.reduce_chunk(j, final, weights)[0] for j in range(len(layout.chunks[q]))])
    return contrib, results


def peer_work(codec, tensors, weights, me: int, layout, contrib, results, norm_bound=DEFAULT_NORM_BOUND):
    """Peer ``me``'s computation in one round; returns (seconds, its average)."""
    n, numel = len(tensors), tensors[me].numel()
    t0 = time.perf_counter()
    # as the runner: fresh tensors for the average (and, lossy, what was sent), the trainer's own
    sent, average = native.empty_huge(numel), native.empty_huge(numel)
    own = [[_own_chunk(codec, tensors[me], sent, lo, hi) for lo, hi in layout.chunks[q]] for q in range(n)]
    part = PartReducer(codec, layout.chunks[me], [OK] * n, norm_bound)
    for s in range(n):
        for j, (lo, hi) in enumerate(layout.chunks[me]):
            if s == me and codec.name == "fp32":  # the runner takes its own fp32 chunk as it is
                values = tensors[me][lo:hi]
                part.accept(s, j, (values, "", sum_of_squares(values), None))
            else:
                part.take(s, j, own[me][j] if s == me else contrib[s][me][j])
    final = part.verdict()
    for j, (lo, hi) in enumerate(layout.chunks[me]):
        _payload, average[lo:hi] = part.reduce_chunk(j, final, weights, parts=True)
    for q in range(n):
        if q != me:
            for j, (lo, hi) in enumerate(layout.chunks[q]):
                decode_result(codec, results[q][j], final, weights, hi - lo, out=average[lo:hi])
    return time.perf_counter() - t0, average


def measure(codec_name: str, numel: int, peers: int = 3, repeats: int = 3, seed: int = 0,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_freed_memory: bool = True) -> dict:
    """Median over ``repeats`` of each peer's work, and the floor; checks the averages.

    ``keep_freed_memory``: set this process's malloc as the forked averagers of earlier
    versions had it (it stays so afterwards)."""
    torch.set_num_threads(1)  # as the peers
    if keep_freed_memory:
        keep_freed_chunks()
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(peers)]
    weights = [1.0 + i for i in range(peers)]
    layout = GroupLayout.for_codec(codec, numel, [True] * peers, chunk_bytes)
    contrib, results = _round_bytes(codec, tensors, weights, layout, DEFAULT_NORM_BOUND)
    expected = reduce_in_process(codec, tensors, weights, (0, 0), chunk_bytes=chunk_bytes)[0].average
    peer_work(codec, tensors, weights, 0, layout, contrib, results)  # warm-up: first-touch of the heap
    per_peer = []
    for me in range(peers):
        times = []
        for _ in range(repeats):
            seconds, average = peer_work(codec, tensors, weights, me, layout, contrib, results)
            if not torch.equal(average, expected):
                raise AssertionError(f"{codec_name}: peer {me}'s average differs from the in-process round's")
            times.append(seconds)
        per_peer.append(statistics.median(times))
    cores = min(peers, os.cpu_count() or 1)
    return dict(codec=codec_name, numel=numel, peers=peers, cores=cores, peer_work_s=per_peer,
                floor_s=sum(per_peer) / cores)
