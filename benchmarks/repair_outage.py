"""Repair meets a real failed round: the link between two peers goes down during a round.

    sudo .venv/bin/python -m benchmarks.repair_outage --rtt-ms 150 --modes blocking,eager \\
        --out benchmarks/results/repair-outage-150.json

Two hivemind peers in two regions of the WAN emulator (``benchmarks/harness/netns.py``, the
bootstrap DHT is peer 0's), each training a small MLP (H = 4, P = 2: fragment 0 syncs at steps 2,
6, 10 ..., fragment 1 at 4, 8, 12 ...) with ``record_digests``. When peer 0 finished step
``--cut-after`` (5: fragment 0's round 1 comes next, its group formed ahead), the emulator cuts the
link (every frame between the regions dropped) for ``--outage-s`` seconds: that round fails for
both peers, each takes its local-only outer step (its own outer gradient), and their theta_bar of
fragment 0 differ (and of fragment 1 if its next round fails too). After the link is back, the
next rounds carry both digests: the tie goes to the peer with more inner steps, then to the
smaller peer id, and the other one repairs (a ``repair`` record); from then on the
``outer_digest`` records agree again. The scenario reports, per peer, its rounds (ok or the
failure reason), its repairs and the rounds after which both theta_bar agree, and the checks.

The transport's timeouts are set short (a round cut off fails in ~2-4 s instead of the derived
10+ s) so the run stays short; ``docs/benchmarks-wan.md`` ("Repair after a real failed round").
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from benchmarks.harness import netns
from benchmarks.harness.repair_outage import run_scenario
from benchmarks.harness.results import write_result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", type=float, default=150.0)
    p.add_argument("--modes", default="blocking", help="comma-separated: blocking, eager ('merge')")
    p.add_argument("--steps", type=int, help="inner steps per peer (default: blocking 26, eager 40: eager's rounds "
                   "land a window late and the outage spans more of its steps)")
    p.add_argument("--cut-after", type=int, default=5, help="peer 0's step after which the link goes down")
    p.add_argument("--outage-s", type=float, default=4.0)
    p.add_argument("--out", help="write the JSON list of runs here")
    args = p.parse_args(argv)
    reason = netns.unavailable_reason()
    if reason:
        print(f"repair_outage: {reason}", file=sys.stderr)
        return 2
    runs = []
    for mode in args.modes.split(","):
        steps = args.steps or (40 if mode == "eager" else 26)
        res = run_scenario(args.rtt_ms, mode, steps, args.cut_after, args.outage_s)
        runs.append(res)
        c = res["checks"]
        print(f"{mode} at {args.rtt_ms:g} ms, link down {args.outage_s:g} s after step {args.cut_after}: "
              f"failed on both {c['failed_on_both']}, digests differed after {c['digests_differed_after']}, "
              f"repairs {c['repairs']}, equal at the end {c['equal_at_the_end']} ({res['seconds']} s)", flush=True)
        if args.out:  # after every run: a later one that fails keeps the earlier ones
            write_result(args.out, settings=vars(args), rows=runs, benchmark="repair_outage")
    return 0 if all(r["checks"]["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
