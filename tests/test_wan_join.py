"""A peer joins a running swarm 150 ms away (network tier, in network namespaces with the WAN
emulator of ``benchmarks/harness/netns.py``): it starts 5 s after the first peer's first training
step (counted from that step, not from the first peer's start: on a loaded machine a start-up
longer than 5 s left it no running swarm to join, CI stop 49), downloads the
run's state across the link (in lanes, refreshing what changed if the swarm moved on meanwhile),
joins, and averages with the first peer afterwards.

Needs root and ``ip netns``; skipped with the reason otherwise. Bounded: two peers of the tiny
model, 100 inner steps each, under 4 minutes."""

from __future__ import annotations

import pytest

from benchmarks.harness import netns
from benchmarks.harness.wan_pair import run_once

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.network,
              pytest.mark.skipif(REASON is not None, reason=f"WAN emulation unavailable: {REASON}")]


@pytest.mark.timeout(300)
def test_a_joiner_5_s_late_at_150_ms_gets_the_state_and_joins(tmp_path):
    res = run_once(tmp_path, rtt_ms=150.0, loss=0.0, mode="eager", late_s=5.0, code=None, timeout=200.0, steps=100,
                   late_from="first-step")
    assert res["error"] is None, res["error"]
    first, joiner = res["peers"]
    assert joiner["downloads"], joiner  # it downloaded the state (not the initial model: the run was going)
    assert all(d["bytes"] is not None for d in joiner["downloads"])
    events = [j["event"] for j in joiner["join"]]
    assert events and events[-1] == "joined", joiner["join"]
    assert joiner["join"][-1]["missed_rounds"] == [], joiner["join"]  # joined in step with the swarm
    assert joiner["averaged"] >= 3 and first["averaged"] >= 3, res  # and averaged with the first peer after
    assert 140 <= joiner["rtt_ms_median"] <= 200, joiner  # the RTT its rounds measured: the emulator's 150 ms
