"""A peer twice as slow as the others: real ``peer`` processes on 127.0.0.1 (benchmarks/harness/peers.py
starts them, each in its own session, and stops every session on the way out)."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

from benchmarks.harness.peers import TINY, train_peers
from opendiloco_stream.testing import faults

pytestmark = [pytest.mark.network, pytest.mark.slow]

STEPS = 60


@pytest.mark.timeout(400)
def test_fast_peers_keep_training_and_the_straggler_counts_by_its_tokens(tmp_path):
    """2 peers sleep 0.1 s per inner step, the third 0.6 s (several times slower, the knob counts as
    compute; with 0.3 s a run of the full suite under load 13 made the fast peers as slow as it). No target group size. The fast peers train to the end without waiting for it; the
    straggler catches up with their rounds (skipping steps of its schedule) and is in their groups
    with the tokens it processed, so its weight share is below theirs."""
    common = ["--mode", "eager", "--codec", "fp32", "--fragments", "2", "--inner-steps", "10", "--steps", str(STEPS),
              "--matchmaking-time", "3.0", "--request-timeout", "1.0", "--no-join", *TINY, "--log-level", "WARNING"]
    per_peer = [["--shard", f"{i}/3"] for i in range(3)]
    slow = {i: faults.env(step_delay_s=d) for i, d in enumerate([0.1, 0.1, 0.6])}  # test-only hook
    peers = [{"records": r} for r in train_peers(tmp_path, f"stragglers-{os.getpid()}", per_peer, common=common,
                                                  envs=slow, timeout=360)]
    summaries = [next(r for r in p["records"] if r.get("event") == "summary") for p in peers]
    for s in summaries:  # every peer reached the end of the schedule (trained or caught up)
        assert s["steps"] + s["caught_up_steps"] == STEPS, s
    assert summaries[2]["caught_up_steps"] > 0
    assert summaries[2]["steps"] < min(s["steps"] for s in summaries[:2])
    rounds = defaultdict(dict)
    for i, p in enumerate(peers):
        for r in p["records"]:
            if r.get("event") == "sync":
                rounds[(r["fragment"], r["round"])][i] = r
    # rounds 0-1 are the start-up (peers come up seconds apart, late ones catch up too)
    together = [by_peer for (_, k), by_peer in rounds.items() if k >= 2 and len(by_peer) == 3
                and all(r["ok"] and r["group_size"] == 3 for r in by_peer.values())]
    assert len(together) >= 4, {k: [(i, r["ok"], r.get("group_size")) for i, r in v.items()] for k, v in rounds.items()}
    for by_peer in together:  # weights are tokens: the straggler did about half the work of a fast peer
        assert by_peer[2]["weight_share"] < 1 / 3, by_peer
