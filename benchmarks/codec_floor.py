"""The codec work of one round, without a transport: how fast a round could be on this machine.

    python -m benchmarks.codec_floor --codecs fp32 fp4-e3m0 --numels 10000000 --peers 3

For one peer of an ``n``-member group, ``peer_work`` (``benchmarks/harness/codec_work.py``) does, on one thread, every computation the
networked round (``transport/hivemind/runner.py``) does in that peer, with the same functions and
the same layout: encode its tensor for every part (and, for a lossy codec, decode what it sent);
check every sender's contribution to its own part; reduce and encode that part; decode the other
parts' results; and the host's copy of the result. The other members' bytes are made beforehand
and not timed: no sockets, no framing, no waiting. The process keeps freed memory for reuse as
earlier versions' averager processes did (``harness.codec_work.keep_freed_chunks``).

``floor_s`` is the sum of the ``n`` peers' work divided by ``min(n, cores)``: the time the codec
work alone takes when the peers' computation is spread perfectly over this machine's cores. No
implementation of the same round (same codec, same checks) on the same cores finishes faster;
``transport_rounds.py`` prints it next to each round. Each run checks that every peer's
average is, bit for bit, the in-process round's (``reduce_in_process``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness.codec_work import measure
from benchmarks.harness.results import RESULTS_DIR, write_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=["fp32", "fp4-e3m0"])
    p.add_argument("--numels", nargs="+", type=int, default=[10_000_000])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "codec-floor.json",
                   help="JSON results (default: %(default)s)")
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
    write_result(args.out, settings=vars(args), rows=rows, argv=argv, benchmark="codec_floor")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
