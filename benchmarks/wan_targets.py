"""Two peers across a delayed link, as a new user starts them: do they average every round, and how
long does a round wait? The scenario of docs/networking.md, "At distance" (root; network namespaces
and the user-space WAN emulator of ``benchmarks/harness/netns.py``).

    python -m benchmarks.wan_targets --rtt-ms 300 --loss 0.01 --modes blocking eager --out runs/wan-300.json
    python -m benchmarks.wan_targets --rtt-ms 150 --late-s 5 --modes eager      # the second peer 5 s late

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
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import netns
from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.wan_emulator import Regions

COMMON = ["--codec", "fp4-e3m0", "--fragments", "2", "--inner-steps", "10", "--model", "tiny", "--threads", "1",
          "--no-progress"]


def peer_row(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One peer's figures from its metrics records."""
    syncs = [r for r in recs if r.get("event") == "sync"]
    reasons: dict[str, int] = {}
    for r in syncs:
        if not r.get("ok"):
            reasons[r.get("reason", "?")] = reasons.get(r.get("reason", "?"), 0) + 1
    waits = [r["wait_s"] for r in syncs if r.get("ok")]
    rtts = [v for r in syncs for v in (r.get("rtt_ms") or {}).values() if v is not None]
    phases: dict[str, list] = {}
    for r in syncs:
        for k, v in (r.get("phases") or {}).items():
            phases.setdefault(k, []).append(v)
    summary = next((r for r in recs if r.get("event") == "summary"), {})
    steps = [r for r in recs if r.get("event") == "step"]
    joins = [r for r in recs if r.get("event") in ("joined", "join_stale")]
    downloads = [r for r in recs if r.get("event") == "state_download" and r.get("done")]
    return {"rounds": len(syncs), "averaged": sum(1 for r in syncs if r.get("ok") and r.get("group_size", 0) >= 2),
            "failed": reasons, "wait_s_median": statistics.median(waits) if waits else None,
            "rtt_ms_median": statistics.median(rtts) if rtts else None,
            "phases_s_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
            "steps_trained": len(steps), "compute_utilization": summary.get("compute_utilization"),
            "wall_time_s": summary.get("wall_time_s"),
            "join": [{k: r.get(k) for k in ("event", "attempts", "attempt", "missed_rounds", "step")} for r in joins],
            "downloads": [{k: r.get(k) for k in ("attempt", "seconds", "bytes", "received_bytes", "reused_bytes",
                                                 "mib_per_s")} for r in downloads]}


def run_once(workdir: Path, rtt_ms: float, loss: float, mode: str, late_s: float, code: Optional[str],
             timeout: float, steps: int = 60, keep_window: bool = False, extra: tuple = ()) -> dict[str, Any]:
    regions = Regions.pair(rtt_ms, loss=loss)
    env = {"PYTHONPATH": code} if code else None
    with netns.Topology(2, regions=regions, place={"boot": "a", "p0": "a", "p1": "b"}) as topo:
        if keep_window:  # what doctor advises at a distance: kept-open connections keep their window
            for node in topo.nodes:
                subprocess.run(topo.exec_argv(node, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"]),
                               check=True)
        with PeerProcesses(workdir, topology=topo) as run:
            run_id = f"wt{int(time.time())}"
            run.bootstrap(run_id, node="boot")
            flags = ["--run-id", run_id, "--mode", mode, "--steps", str(steps), *COMMON, *extra]
            ip = lambda n: ["--host-maddrs", f"/ip4/{topo.ip(n)}/tcp/0"]  # noqa: E731
            p0 = run.peer("peer-0", *flags, *ip("p0"), node="p0", env=env)
            if late_s:
                time.sleep(late_s)
            p1 = run.peer("peer-1", *flags, *ip("p1"), node="p1", env=env)
            t0 = time.monotonic()
            error = None
            try:
                run.wait([p0, p1], timeout)
            except Exception as e:  # a peer that failed or ran out of time: its records still count
                error = str(e)[-600:]
            rows = [peer_row(run.records(f"peer-{i}")) for i in range(2)]
            stats = topo.emulator_stats()
    return {"rtt_ms": rtt_ms, "loss": loss, "mode": mode, "late_s": late_s, "code": code or "this checkout",
            "keep_window": keep_window, "extra_flags": list(extra),
            "seconds": round(time.monotonic() - t0, 1), "peers": rows, "error": error,
            "emulator": {k: stats.get(k) for k in ("frames", "dropped_loss", "late_ms_mean", "late_ms_max")
                         if k in stats}}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[300.0])
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--modes", nargs="+", default=["blocking", "eager"])
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--keep-window", action="store_true",
                    help="sysctl net.ipv4.tcp_slow_start_after_idle=0 in every namespace (what doctor advises)")
    ap.add_argument("--prematch-steps", type=int, default=0, help="peer --prematch-steps N (groups formed ahead)")
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
                               ("--prematch-steps", str(args.prematch_steps)) if args.prematch_steps else ())
                results.append(res)
                line = "; ".join(f"peer {j}: {p['averaged']}/{p['rounds']} averaged, failed {p['failed']}, "
                                 f"wait {p['wait_s_median']}, steps {p['steps_trained']}, join {p['join']}"
                                 for j, p in enumerate(res["peers"]))
                print(f"RTT {rtt:g} ms loss {args.loss:g} {mode} late {args.late_s:g}s: {line}"
                      + (f" ERROR {res['error'][-200:]}" if res["error"] else ""), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine_note": "2 shared cores, other work running beside",
                                              "results": results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
