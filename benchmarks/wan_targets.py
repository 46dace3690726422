"""Two peers across a delayed link, as a new user starts them: do they average every round, and how
long does a round wait? The scenario of docs/networking.md, "At distance" (root; network namespaces
and the user-space WAN emulator of ``benchmarks/harness/netns.py``).

    python -m benchmarks.wan_targets --rtt-ms 300 --loss 0.01 --modes blocking eager --out runs/wan-300.json
    python -m benchmarks.wan_targets --rtt-ms 150 --late-s 5 --modes eager      # the second peer 5 s late
    python -m benchmarks.wan_targets --rtt-ms 300 --loss 0.01 --late-s 1 --late-from first-step --modes eager

The bootstrap and peer 0 sit in region ``a``, peer 1 in region ``b`` (``--rtt-ms`` apart, ``--loss``
on that link each way); both run ``peer --codec fp4-e3m0 --fragments 2 --inner-steps 10 --steps 60
--model tiny`` and start together (or peer 1 ``--late-s`` later: it joins the running swarm and
downloads its state). Per peer: rounds averaged with the other (group of 2) of the rounds it
consumed, failures by reason, median round wait and matchmaking time as the sync records give them,
the join's records (attempts, missed rounds, download seconds), steps trained. ``--code DIR``
runs the peers from another checkout's ``opendiloco_stream`` (a before/after in one command).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

from benchmarks.harness import netns
from benchmarks.harness.results import write_result
from benchmarks.harness.wan_pair import LATE_FROM, run_once

def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[300.0])
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--modes", nargs="+", default=["blocking", "eager"])
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--late-from", choices=sorted(LATE_FROM), default="start",
                    help="what --late-s counts from: peer 0's start, its first training step or its first landed round")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--keep-window", action="store_true",
                    help="sysctl net.ipv4.tcp_slow_start_after_idle=0 in every namespace (what doctor advises)")
    ap.add_argument("--prematch-steps", type=int, default=0, help="peer --prematch-steps N (groups formed ahead)")
    ap.add_argument("--wait-for-peers", action="store_true",
                    help="peer --wait-for-peers 2: the two take their first step together (peers started together)")
    ap.add_argument("--code", help="run the peers from this checkout (a directory holding opendiloco_stream/)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--workdir", default="/tmp/wan_targets")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    reason = netns.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    results = []
    for rtt in args.rtt_ms:
        for mode in args.modes:
            for i in range(args.runs):
                res = run_once(Path(args.workdir) / f"{rtt:g}-{mode}-{i}", rtt, args.loss, mode, args.late_s,
                               args.code, args.timeout, args.steps, args.keep_window,
                               (("--prematch-steps", str(args.prematch_steps)) if args.prematch_steps else ())
                               + (("--wait-for-peers", "2") if args.wait_for_peers else ()), args.late_from)
                results.append(res)
                line = "; ".join(f"peer {j}: {p['averaged']}/{p['rounds']} averaged, failed {p['failed']}, "
                                 f"wait {p['wait_s_median']}, steps {p['steps_trained']}, join {p['join']}"
                                 for j, p in enumerate(res["peers"]))
                d = res["outer_digests"]
                line += f"; theta_bar equal from the first averaged round: {d['equal']} ({d['compared']} compared)"
                print(f"RTT {rtt:g} ms loss {args.loss:g} {mode} late {args.late_s:g}s from {args.late_from}: {line}"
                      + (f" ERROR {res['error'][-200:]}" if res["error"] else ""), flush=True)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
        write_result(args.out, settings=settings, rows=results, argv=argv, benchmark="wan_targets")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
