"""A group formed ahead forms while the fragment's previous round still runs (``lane.py``, ``_wait``).

Before, a lane's worker took the next round's ``prematch`` only once the running round had ended:
eager and overlap rounds run behind the steps, so the next group's formation (several round trips
at a distance) came after the previous round's exchange, and the round waited for it at its
launch. Here peers 0 and 1 launch round (0, 0) of a group of three and announce (0, 1) ahead; peer 2
forms (0, 1) ahead *before* it launches (0, 0). Round (0, 0) cannot end before peer 2 launches it,
so (0, 1)'s group can form only while (0, 0) is running on peers 0 and 1. No wall-clock assertion:
the waits are bounded, and the test checks what happened in which order.
"""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.harness.loopback import LoopbackSwarm, make_tensor

MODULE = __name__
N = 4096


def launch_then_prematch(peer, seed: int, weight: float, wait_s: float) -> dict:
    """(In a peer.) Launch round (0, 0), announce (0, 1) ahead, then wait for (0, 0): whether
    (0, 1)'s group formed while (0, 0) still ran."""
    handle = peer.transport.all_reduce((0, 0), make_tensor(seed, N), weight=1.0)
    peer.transport.prematch((0, 1), weight)
    formed_while_running, deadline = False, time.monotonic() + wait_s
    while not handle.done() and time.monotonic() < deadline:
        if peer.early_stage(0) == "FORMED":
            formed_while_running = not handle.done()
            break
        time.sleep(0.02)
    result = handle.wait()
    return dict(formed_while_running=formed_while_running, group_size=result.group_size)


def prematch_then_launch(peer, seed: int, weight: float, wait_s: float) -> dict:
    """(In a peer.) Form (0, 1)'s group ahead first (bounded wait), then launch round (0, 0)."""
    stage = peer.prematch((0, 1), weight, wait_formed_s=wait_s)
    result = peer.transport.all_reduce((0, 0), make_tensor(seed, N), weight=1.0).wait()
    return dict(stage_before_launch=stage, group_size=result.group_size)


@pytest.mark.network
@pytest.mark.timeout(300)
def test_the_next_group_forms_ahead_while_the_fragments_previous_round_runs():
    swarm = LoopbackSwarm(3, run_id="hvoverlap", transport_kwargs=dict(codec="fp32", target_group_size=3,
                                                                      matchmaking_time=30.0, allreduce_timeout=60.0,
                                                                      request_timeout=1.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: N}, timeout=120)
        weights = (1.0, 1.0, 2.0)
        for i, peer in enumerate(swarm.peers):
            fn = launch_then_prematch if i < 2 else prematch_then_launch
            peer.send("call", function=f"{MODULE}:{fn.__name__}", seed=10 + i, weight=weights[i], wait_s=20.0)
        first = [peer.recv(timeout=180) for peer in swarm.peers]
        # peer 2 found (0, 1)'s group formed before it launched (0, 0): peers 0 and 1 formed it
        # while their (0, 0) waited for peer 2 (before, their lanes took the prematch only after)
        assert first[2]["stage_before_launch"] == "FORMED", first
        assert all(r["formed_while_running"] for r in first[:2]), first
        assert all(r["group_size"] == 3 for r in first), first
        # and round (0, 1) uses that group: the weights given ahead count, not the launch's
        out = swarm.call_all("all_reduce", (0, 1), numel=N, timeout=60,
                             per_peer=[dict(seed=20 + i, weight=5.0) for i in range(3)])
        assert all(r["ok"] and r["group_size"] == 3 for r in out), out
        assert [r["weight_share"] for r in out] == pytest.approx([0.25, 0.25, 0.5])
        expected = sum(make_tensor(20 + i, N) * w for i, w in enumerate(weights)) / sum(weights)
        for r in out:
            assert torch.allclose(r["average"], expected, rtol=1e-6, atol=1e-7)
    finally:
        swarm.close()
