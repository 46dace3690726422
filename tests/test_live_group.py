"""Group size from the live peers of a run (transport/hivemind/presence.py), no --target-group-size.

Real peers on 127.0.0.1 (``LoopbackSwarm``: one process per peer, its own DHT, averager and p2p
daemon), tiny tensors. The swarm is closed, every peer's process group SIGKILLed, in ``finally``.
"""

from __future__ import annotations

import time

import pytest

from hv_loopback import LoopbackSwarm  # benchmarks/ (on sys.path: conftest.py)

NUMEL = 1000
LIVE_AHEAD = "live_group:live_ahead"  # benchmarks/live_group.py: run inside a peer, its count of a round
EXPECT = "live_group:expect"  # inside a peer: what a joiner does after its state download


def run_round(swarm, peers, rnd):
    args = [dict(seed=10 * rnd + p.index, numel=NUMEL, return_tensors=False) for p in peers]
    return swarm.call_all("all_reduce", (0, rnd), per_peer=args, peers=peers, timeout=60)


def sizes(results):
    return [(r["ok"], r.get("group_size"), r.get("expected_size")) for r in results]


@pytest.mark.network
@pytest.mark.timeout(240)
def test_one_group_of_every_live_peer_follows_deaths_and_joins():
    """6 peers, no target: round 0 (cold start) forms one group of 6 at the matchmaking deadline,
    later rounds start with the 6 announced peers; two SIGKILLed peers drop out once their
    announcements expire (groups of 4 that expect 4); a joiner that announced its first round (as
    after a state download) is in it (5); a fresh peer that did not sits it out and is in the
    next one (6)."""
    swarm = LoopbackSwarm(6, run_id="live6", transport_kwargs=dict(
        codec="fp32", matchmaking_time=3.0, request_timeout=1.0, presence_ttl=3.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        for rnd in (0, 1, 2):
            results = run_round(swarm, swarm.peers, rnd)
            expected = None if rnd == 0 else 6
            assert sizes(results) == [(True, 6, expected)] * 6, (rnd, results)
            assert len({r["sha256"] for r in results}) == 1
        for victim in swarm.peers[4:]:
            victim.kill()
        survivors = swarm.peers[:4]
        deadline = time.monotonic() + 60
        while swarm.peers[0].call("call", LIVE_AHEAD, fragment=0, round_index=3) != 4:
            assert time.monotonic() < deadline, "the killed peers' announcements never expired"
            time.sleep(0.5)
        for rnd in (3, 4):
            assert sizes(run_round(swarm, survivors, rnd)) == [(True, 4, 4)] * 4, rnd
        joiner = swarm.add_peer()
        joiner.call("prepare", {0: NUMEL}, timeout=120)
        joiner.call("call", EXPECT, fragment=0, round_index=5)
        survivors.append(joiner)
        assert sizes(run_round(swarm, survivors, 5)) == [(True, 5, 5)] * 5
        fresh = swarm.add_peer()
        fresh.call("prepare", {0: NUMEL}, timeout=120)
        results = run_round(swarm, survivors + [fresh], 6)
        assert sizes(results[:5]) == [(True, 5, 5)] * 5 and results[5]["reason"] == "joining", results
        assert sizes(run_round(swarm, survivors + [fresh], 7)) == [(True, 6, 6)] * 6
    finally:
        swarm.close()
