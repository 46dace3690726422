"""The codec work of one round, without a transport: how fast a round could be on this machine.

    python benchmarks/codec_floor.py --codecs fp32 fp4-e3m0 --numels 10000000 --peers 3

For one peer of an ``n``-member group, :func:`peer_work` does, on one thread, every computation the
networked round (``transport/hivemind/runner.py``) does in that peer, with the same functions and
the same layout: encode its tensor for every part (and, for a lossy codec, decode what it sent);
check every sender's contribution to its own part; reduce and encode that part; decode the other
parts' results; and the host's copy of the result. The other members' bytes are made beforehand
and not timed: no sockets, no framing, no waiting. The process keeps freed memory for reuse as
the averager process does (``_keep_freed_memory``).

``floor_s`` is the sum of the ``n`` peers' work divided by ``min(n, cores)``: the time the codec
work alone takes when the peers' computation is spread perfectly over this machine's cores. No
implementation of the same round (same codec, same checks) on the same cores finishes faster;
``transport_rounds.py`` prints it next to each round. Each run checks that every peer's
average is, bit for bit, the in-process round's (``reduce_in_process``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from opendiloco_stream.compression import get_codec, native
from opendiloco_stream.transport.hivemind.averager import _keep_freed_memory
from opendiloco_stream.transport.reduce import (
    DEFAULT_CHUNK_BYTES, DEFAULT_NORM_BOUND, OK, GroupLayout, PartReducer, decode_result, reduce_in_process,
    sum_of_squares,
)


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
    sent, average = torch.empty(numel), torch.empty(numel)
    t0 = time.perf_counter()
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
    out = native.fresh_copy(average)  # the host's copy of the result (and of what was sent, if lossy)
    if codec.name != "fp32":
        native.fresh_copy(sent)
    return time.perf_counter() - t0, out


def measure(codec_name: str, numel: int, peers: int = 3, repeats: int = 3, seed: int = 0,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, keep_freed_memory: bool = True) -> dict:
    """Median over ``repeats`` of each peer's work, and the floor; checks the averages.

    ``keep_freed_memory``: set this process's malloc as the averager's (it stays so afterwards)."""
    torch.set_num_threads(1)  # as the peers
    if keep_freed_memory:
        _keep_freed_memory()  # as the averager process, where a round's decoding runs
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=["fp32", "fp4-e3m0"])
    p.add_argument("--numels", nargs="+", type=int, default=[10_000_000])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    print("| codec     | elements   | work per peer s        | cores | floor s |")
    print("|-----------|------------|------------------------|-------|---------|")
    for codec in args.codecs:
        for numel in args.numels:
            r = measure(codec, numel, args.peers, args.repeats)
            rows.append(r)
            print(f"| {codec:>9} | {numel:>10,} | {' '.join(f'{t:.3f}' for t in r['peer_work_s']):>22} "
                  f"| {r['cores']:>5} | {r['floor_s']:7.3f} |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(rows=rows), indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
