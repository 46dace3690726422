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
import time
from typing import Any, Optional

import torch
from torch import nn

from benchmarks.harness import netns
from benchmarks.harness.loopback import LoopbackSwarm, peer_signal
from benchmarks.harness.results import write_result
from benchmarks.harness.wan_emulator import Regions
from opendiloco_stream import DiLoCoConfig, wrap

MODULE = __name__  # peers import train_through_outage from here by name
WIDTH = 8
#: short bounds, so that a cut round fails in seconds (request < matchmaking < allreduce, next chunk < allreduce)
TRANSPORT = dict(codec="fp32", target_group_size=2, matchmaking_time=2.0, request_timeout=1.0,
                 next_chunk_timeout=1.5, allreduce_timeout=4.0, state_timeout=10.0)


def _config(mode: str) -> DiLoCoConfig:
    extra = {"eager_rule": "merge"} if mode == "eager" else {}
    return DiLoCoConfig(mode=mode, inner_steps=4, num_fragments=2, record_digests=True, **extra)


def train_through_outage(peer, rank: int, mode: str, steps: int, cut_after: int, step_s: float) -> dict[str, Any]:
    """Inside a peer: train the seeded MLP ``steps`` steps over the peer's hivemind transport; peer
    0 signals the parent (which cuts the link) once it finished step ``cut_after``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])  # the same start on both peers
    data = [torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(100 * rank + i)) for i in range(3)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = wrap(model, opt, transport=peer.transport, config=_config(mode), blocks=list(model))
    t0 = time.monotonic()
    step_at: list[float] = []
    for i in range(steps):
        model(data[i % 3]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=5)
        step_at.append(round(time.monotonic() - t0, 3))
        if rank == 0 and diloco.step_count == cut_after:
            peer_signal().set()
        time.sleep(step_s)
    diloco.finish()
    diloco.close()
    return dict(events=diloco.events, peer_id=peer.transport.peer_id, stats=diloco.stats.to_record(),
                step_at=step_at)


def peer_view(out: dict[str, Any]) -> dict[str, Any]:
    """One peer's rounds, repairs, first ``prematch`` record and digests, from its events."""
    events = out["events"]
    syncs = [e for e in events if e["event"] == "sync"]
    first_sync = next((i for i, e in enumerate(events) if e["event"] == "sync"), len(events))
    prematch = next((e for e in events[:first_sync] if e["event"] == "prematch"), None)
    return {"peer_id": out["peer_id"],
            "rounds": [{"fragment": e["fragment"], "round": e["round"], "step": e.get("step"), "ok": e["ok"],
                        "group_size": e.get("group_size"), "reason": e.get("reason")} for e in syncs],
            "repairs": [{k: e.get(k) for k in ("fragment", "round", "step", "from", "outcome", "bytes", "seconds", "served_round", "asked",
                                                "consumed")}
                        for e in events if e["event"] == "repair"],
            "prematch_before_first_round": None if prematch is None else
            {k: prematch.get(k) for k in ("steps", "rtt_ms", "why")},
            "digests": {f"{e['fragment']}/{e['round']}": e["digest"] for e in events if e["event"] == "outer_digest"},
            "steps_s": out["step_at"][-1] if out["step_at"] else None, "stats": out["stats"]}


def checks(views: list[dict[str, Any]]) -> dict[str, Any]:
    """What the scenario must show: a round failed on both peers, their theta_bar then differed,
    a repair brought them back, and the last rounds' digests agree."""
    failed = [{(r["fragment"], r["round"]) for r in v["rounds"] if not r["ok"]} for v in views]
    both_failed = sorted(failed[0] & failed[1])
    d0, d1 = views[0]["digests"], views[1]["digests"]
    common = sorted(set(d0) & set(d1), key=lambda k: tuple(map(int, k.split("/"))))
    differ = [k for k in common if d0[k] != d1[k]]
    last = {f: max((k for k in common if k.startswith(f"{f}/")), key=lambda k: int(k.split("/")[1]), default=None)
            for f in (0, 1)}
    repaired = [r for v in views for r in v["repairs"] if r["outcome"] == "repaired"]
    return {"failed_on_both": [list(k) for k in both_failed], "digests_differed_after": differ,
            "repairs": len(repaired), "last_compared": last,
            "equal_at_the_end": all(k is not None and d0[k] == d1[k] for k in last.values()),
            "ok": bool(both_failed) and bool(differ) and bool(repaired)
            and all(k is not None and d0[k] == d1[k] for k in last.values())}


def run_scenario(rtt_ms: float, mode: str = "blocking", steps: int = 26, cut_after: int = 5, outage_s: float = 4.0,
                 step_s: float = 0.05, timeout: float = 120.0) -> dict[str, Any]:
    """The scenario of the module docstring, once; the result's ``checks["ok"]`` says whether it showed it."""
    regions = Regions.pair(rtt_ms)
    t0 = time.monotonic()
    with netns.Topology(2, regions=regions, place={"boot": "a", "p0": "a", "p1": "b"}) as topo:
        overrides = {i: dict(netns=topo.ns(f"p{i}"), host=topo.ip(f"p{i}")) for i in range(2)}
        with LoopbackSwarm(2, run_id=f"outage_{mode}", transport_kwargs=TRANSPORT, peer_overrides=overrides) as swarm:
            swarm.signal.clear()
            for rank, peer in enumerate(swarm.peers):
                peer.send("call", f"{MODULE}:train_through_outage", rank=rank, mode=mode, steps=steps,
                          cut_after=cut_after, step_s=step_s)
            cut_at: Optional[float] = None
            if swarm.signal.wait(timeout):
                cut_at = time.monotonic() - t0
                topo.outage(True)
                time.sleep(outage_s)
                topo.outage(False)
            out = [peer.recv(timeout) for peer in swarm.peers]
        stats = topo.emulator_stats()
    views = [peer_view(o) for o in out]
    return {"rtt_ms": rtt_ms, "mode": mode, "steps": steps, "inner_steps": 4, "fragments": 2,
            "cut_after_step": cut_after, "outage_s": outage_s, "cut_at_s": None if cut_at is None else round(cut_at, 2),
            "seconds": round(time.monotonic() - t0, 1), "transport": TRANSPORT,
            "emulator": {k: stats.get(k) for k in ("frames_out", "outage_drops", "lost", "late_max_ms")},
            "peers": views, "checks": checks(views)}


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
