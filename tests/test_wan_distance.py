"""Training across continents: three peers in three regions of the WAN emulator average every round.

The regions are the us/eu/asia preset (RTTs us-eu 75, us-asia 230, eu-asia 160 ms) with 1% loss
on the eu-asia link, one peer in each, the bootstrap in us (benchmarks/harness/netns.py,
benchmarks/harness/wan_emulator.py). Each test trains the tiny model with the ``peer`` command as
a user would (started together) and checks that from each fragment's
second round on (the first may meet a peer still starting) every peer averaged every round with
both others, with the same result everywhere (digests of the average).

The three start with ``--wait-for-peers 3`` and the default join, in both modes: each takes its
first step once all three have built their models, so none finds the others rounds in (before
that flag eager ran with ``--no-join``: the asia peer, whose start-up across 160-230 ms took
longer, found the others training, downloaded a state that was stale on arrival and trained
nothing, 1 of 2 runs). A joiner into a running swarm at distance is still open work
(docs/benchmarks-wan.md); ``tests/test_wan_join.py`` pins the join at 150 ms.

``test_a_late_joiner_at_300_ms_with_loss_takes_part_in_the_swarms_rounds`` pins the join at
distance on two peers: the second one starts later, 300 ms away with 1% loss, downloads the
running swarm's state (longer than the gap between two rounds), and its donor's next rounds wait
for it (the donor reserved it in them when it served the state), so it joins at once and its
theta_bar is the first peer's from then on.

Needs root and ``ip netns``; skipped with the reason otherwise. Bounded: 40 inner steps, 8
rounds, about a minute per 3-region test on 2 cores; the joiner test 60 or 80 steps, ~2 minutes.
"""

from __future__ import annotations

import pytest

from benchmarks.harness import netns
from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.wan_emulator import Link, Regions
from benchmarks.harness.wan_pair import run_once

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.network, pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=f"WAN emulation unavailable: {REASON}")]

H, P, STEPS = 10, 2, 40
PEERS = ["p0", "p1", "p2"]
TINY = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--no-progress",
        "--fragments", str(P), "--inner-steps", str(H), "--steps", str(STEPS), "--codec", "fp4-e3m0"]
DIGESTS = {"ODS_DILOCO__RECORD_DIGESTS": "true"}


def three_regions() -> Regions:
    """us/eu/asia at the preset's RTTs, 1% loss each way between eu and asia."""
    regions = Regions.preset("us/eu/asia")
    return regions.with_link("eu", "asia", Link(rtt_ms=regions.link("eu", "asia").rtt_ms, loss=0.01))


def _train(tmp, mode: str, run_id: str, timeout: float = 200, extra: tuple = ()) -> dict[str, list[dict]]:
    """One ``peer`` per region in ``mode``, all started together; each one's metrics records."""
    with netns.Topology(peers=3, regions=three_regions()) as topo:
        assert [topo.region_of(p) for p in PEERS] == ["us", "eu", "asia"]
        with PeerProcesses(tmp, topology=topo) as run:
            run.bootstrap(run_id, node="boot")
            procs = [run.peer(node, "--run-id", run_id, *TINY, "--mode", mode, "--shard", f"{i}/3",
                              "--host-maddrs", f"/ip4/{topo.ip(node)}/tcp/0", *extra, node=node, env=DIGESTS)
                     for i, node in enumerate(PEERS)]
            run.wait(procs, timeout)
            return {node: run.records(node) for node in PEERS}


def _check_every_round_averaged_by_all(records: dict[str, list[dict]], mode: str) -> None:
    syncs = {node: {(r["fragment"], r["round"]): r for r in recs if r["event"] == "sync"}
             for node, recs in records.items()}
    every = set.union(*(set(s) for s in syncs.values()))
    first = {f: min(k for f2, k in every if f2 == f) for f in range(P)}
    later = sorted(key for key in every if key[1] > first[key[0]])
    # STEPS // H rounds per fragment, the first left out; eager does not consume its last one
    # (still in flight at the end: the final checkpoint lands it)
    per_fragment = STEPS // H - (2 if mode == "eager" else 1)
    assert len(later) >= P * per_fragment, {n: sorted(s) for n, s in syncs.items()}
    for key in later:
        rows = {node: s.get(key) for node, s in syncs.items()}
        assert all(r is not None for r in rows.values()), (key, "not consumed by every peer", rows)
        assert all(r["ok"] and r["group_size"] == 3 for r in rows.values()), (key, rows)
        assert len({r["digest"] for r in rows.values()}) == 1, (key, rows)
    for node, recs in records.items():
        assert recs and recs[-1]["event"] == "summary", (node, "did not finish")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["eager", "blocking"])
def test_three_regions_average_every_round_after_the_first(tmp_path, mode):
    """us, eu and asia (75/230/160 ms, 1% loss eu-asia), fp4, eager and blocking: from each
    fragment's second round, every peer's round averaged all three with the same result."""
    records = _train(tmp_path, mode, f"dist{mode}", extra=("--wait-for-peers", "3"))
    _check_every_round_averaged_by_all(records, mode)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, late_from, steps", [("eager", "first-step", 80), ("blocking", "first-sync", 60)])
def test_a_late_joiner_at_300_ms_with_loss_takes_part_in_the_swarms_rounds(tmp_path, mode, late_from, steps):
    """Two peers 300 ms apart with 1% loss each way (``benchmarks/harness/wan_pair.py``), the
    second started later (counted from the first peer's first training step, so that the swarm
    is running whatever the first peer's start-up took on a loaded machine): it downloads the running swarm's state (7-14 MB, 4-6 s across that
    link, longer than the gap between two rounds), its donor reserved it in the rounds after that
    state, and they waited for it. It joins without missing a round, averages with the first
    peer from then on, and its theta_bar is the first peer's bit for bit after every round both
    consumed (``outer_digest`` records).

    Eager starts it 1 s after the first peer's first training step, blocking 1 s after the first
    peer's first round landed (a ``sync`` record). Before CI stop 49 they counted 5 s and 15 s
    from the first peer's start, about the same on an idle machine; a loaded one's longer
    start-up left the 150 ms joiner of tests/test_wan_join.py no running swarm. The first peer's
    60 steps end a fixed time after its first step, so a later start leaves the two fewer rounds
    together (eager 5 s after the first step: 1 averaged round, seen once). Blocking waits for the
    first round: a blocking donor alone waits out a window in each round, and a joiner arriving
    in its first one gets the initial-model marker instead of a state, which this test is not
    about (that round now waits for it past its window: tests/test_live_group.py;
    docs/benchmarks-wan.md, "The join at distance").

    Eager runs 80 steps, not 60: beside two CPU burners the joiner's own start-up (process, DHT,
    model, a probe of the swarm, the donor lookup) took 20-25 s, the first peer meanwhile trained
    50 of its 60 steps alone, and the two had 2 rounds left together (2026-11-29, 2 runs of 2)."""
    res = run_once(tmp_path, rtt_ms=300.0, loss=0.01, mode=mode, late_s=1.0, code=None, timeout=240.0,
                   late_from=late_from, steps=steps)
    assert res["error"] is None, res["error"]
    first, joiner = res["peers"]
    assert any(d["bytes"] for d in joiner["downloads"]), joiner  # it downloaded a state: the swarm was running
    assert joiner["join"][-1]["event"] == "joined" and joiner["join"][-1]["missed_rounds"] == [], joiner["join"]
    assert joiner["steps_trained"] > 0, joiner
    # its own rounds averaged with the first peer; a failure it consumed is one of the donor's,
    # taken with the state (reason "restored")
    assert set(joiner["failed"]) <= {"restored"}, joiner
    assert joiner["averaged"] >= 3, joiner
    digests = res["outer_digests"]
    assert digests["compared"] >= 3 and digests["equal"], digests
