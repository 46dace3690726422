"""The two-peer distance scenario of ``benchmarks/wan_targets.py`` and ``tests/test_wan_join.py``:
the bootstrap and peer 0 in region ``a``, peer 1 in region ``b`` of the user-space WAN emulator,
both running ``peer`` as a new user starts them; one row of figures per peer from its records."""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import netns
from benchmarks.harness.peers import PeerProcesses, wait_for
from benchmarks.harness.wan_emulator import Regions

DIGESTS = {"ODS_DILOCO__RECORD_DIGESTS": "true"}  # sync records carry the average's digest, outer_digest theta_bar's
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
            "failed": reasons,
            "failures_at": [f"{r.get('fragment')}/{r.get('round')} at step {r.get('step')}: {r.get('reason')}: "
                              f"{str(r.get('message', ''))[:160]}" for r in syncs if not r.get("ok")],
            "wait_s_median": statistics.median(waits) if waits else None,
            "rtt_ms_median": statistics.median(rtts) if rtts else None,
            "phases_s_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
            "steps_trained": len(steps), "compute_utilization": summary.get("compute_utilization"),
            "wall_time_s": summary.get("wall_time_s"),
            "join": [{k: r.get(k) for k in ("event", "attempts", "attempt", "missed_rounds", "step")} for r in joins],
            "downloads": [{k: r.get(k) for k in ("attempt", "seconds", "bytes", "received_bytes", "reused_bytes",
                                                 "mib_per_s")} for r in downloads]}


def outer_digests(recs: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """(fragment, round) -> digest of theta_bar after that round (``outer_digest`` records)."""
    return {(r["fragment"], r["round"]): r["digest"] for r in recs if r.get("event") == "outer_digest"}


def digest_check(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the two peers' theta_bar agree after the rounds both consumed, from the second
    peer's first round averaged with the first peer (per fragment) on: the rounds compared
    there, those that differ, and the first averaged round of each fragment."""
    a, b = outer_digests(first), outer_digests(second)
    together = {(r["fragment"], r["round"]) for r in second if r.get("event") == "sync" and r.get("ok")
                and r.get("group_size", 0) >= 2}
    start = {f: min(k for g, k in together if g == f) for f, _ in together}
    after = sorted(k for k in set(a) & set(b) if k[0] in start and k[1] >= start[k[0]])
    return {"first_averaged": [list(k) for k in sorted(start.items())], "compared": len(after),
            "differ": [list(k) for k in after if a[k] != b[k]],
            "equal": bool(after) and all(a[k] == b[k] for k in after)}


LATE_FROM = {"start": None, "first-step": "step", "first-sync": "sync"}  # what the late start counts from


def run_once(workdir: Path, rtt_ms: float, loss: float, mode: str, late_s: float, code: Optional[str],
             timeout: float, steps: int = 60, keep_window: bool = False, extra: tuple = (),
             late_from: str = "start") -> dict[str, Any]:
    """Peer 1 starts ``late_s`` after peer 0's process (``late_from="start"``, what the figures in
    docs/benchmarks-wan.md used), after peer 0's first training step (``"first-step"``: a swarm
    that is already training whatever peer 0's start-up took on a loaded machine) or after its
    first round landed (``"first-sync"``: a state past the initial model to download)."""
    if late_from not in LATE_FROM:
        raise ValueError(f"late_from is one of {', '.join(LATE_FROM)}, not {late_from!r}")
    regions = Regions.pair(rtt_ms, loss=loss)
    # PYTHONSAFEPATH: ``python -m`` would put the working directory (this checkout) ahead of
    # PYTHONPATH, and the peers would run this checkout's code instead of ``code``'s
    env = {**DIGESTS, **({"PYTHONPATH": code, "PYTHONSAFEPATH": "1"} if code else {})}
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
            if late_from != "start":
                event = LATE_FROM[late_from]
                wait_for(lambda: any(r.get("event") == event for r in run.records("peer-0")), 120.0,
                         f"peer-0's first {event} record", [p0])
            if late_s:
                time.sleep(late_s)
            p1 = run.peer("peer-1", *flags, *ip("p1"), node="p1", env=env)
            t0 = time.monotonic()
            error = None
            try:
                run.wait([p0, p1], timeout)
            except Exception as e:  # a peer that failed or ran out of time: its records still count
                error = str(e)[-600:]
            recs = [run.records(f"peer-{i}") for i in range(2)]
            rows = [peer_row(r) for r in recs]
            stats = topo.emulator_stats()
    return {"rtt_ms": rtt_ms, "loss": loss, "mode": mode, "late_s": late_s, "code": code or "this checkout",
            "keep_window": keep_window, "extra_flags": list(extra),
            "seconds": round(time.monotonic() - t0, 1), "peers": rows, "error": error,
            "outer_digests": digest_check(*recs),
            "emulator": {k: stats.get(k) for k in ("frames", "dropped_loss", "late_ms_mean", "late_ms_max")
                         if k in stats}}
