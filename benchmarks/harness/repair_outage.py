"""The outage scenario of ``benchmarks/repair_outage.py`` and ``tests/test_repair.py``: two hivemind
peers in two regions of the WAN emulator, a link cut during a round, and what repair made of it.

See ``benchmarks/repair_outage.py`` for the scenario and its reading."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn

from benchmarks.harness import netns
from benchmarks.harness.loopback import LoopbackSwarm, peer_signal
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
                                                "consumed", "waited_s")}
                        for e in events if e["event"] == "repair"],
            "prematch_before_first_round": None if prematch is None else
            {k: prematch.get(k) for k in ("steps", "rtt_ms", "why")},
            "digests": {f"{e['fragment']}/{e['round']}": e["digest"] for e in events if e["event"] == "outer_digest"},
            "steps_s": out["step_at"][-1] if out["step_at"] else None, "stats": out["stats"]}


def checks(views: list[dict[str, Any]]) -> dict[str, Any]:
    """What the scenario must show: a round failed on both peers, their theta_bar then differed,
    a repair brought them back, and the digests agree after the last round of each fragment both
    averaged (a round both fail at the very end, as one peer finishes, leaves each its own local
    step, which only the next round could repair)."""
    failed = [{(r["fragment"], r["round"]) for r in v["rounds"] if not r["ok"]} for v in views]
    both_failed = sorted(failed[0] & failed[1])
    averaged = [{f"{r['fragment']}/{r['round']}" for r in v["rounds"] if r["ok"] and r["group_size"] == 2}
                for v in views]
    d0, d1 = views[0]["digests"], views[1]["digests"]
    common = sorted(set(d0) & set(d1), key=lambda k: tuple(map(int, k.split("/"))))
    differ = [k for k in common if d0[k] != d1[k]]
    both = [k for k in common if k in averaged[0] & averaged[1]]
    last = {f: max((k for k in both if k.startswith(f"{f}/")), key=lambda k: int(k.split("/")[1]), default=None)
            for f in (0, 1)}
    repaired = [r for v in views for r in v["repairs"] if r["outcome"] == "repaired"]
    # every round both averaged after the round whose state a fragment's repair adopted (that
    # round's own digest record came before the repair): one theta_bar
    since = {r["fragment"]: max(x["round"], x.get("consumed") or 0) for r in repaired for x in repaired
             if x["fragment"] == r["fragment"]}
    after = [k for k in both if int(k.split("/")[0]) in since and int(k.split("/")[1]) > since[int(k.split("/")[0])]]
    equal_end = all(k is not None and d0[k] == d1[k] for k in last.values())
    return {"failed_on_both": [list(k) for k in both_failed], "digests_differed_after": differ,
            "repairs": len(repaired), "last_averaged_by_both": last, "equal_at_the_end": equal_end,
            "averaged_by_both_after_repair": len(after),
            "equal_after_repair": all(d0[k] == d1[k] for k in after),
            "ok": bool(both_failed) and bool(differ) and bool(repaired) and equal_end
            and all(d0[k] == d1[k] for k in after)}


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
