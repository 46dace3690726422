"""The RTT a peer knows before its first round (``transport/hivemind/start_rtt.py``): probed from the
start until the rounds measure groupmates, so ``prematch_steps = "auto"`` forms the first round's
group ahead too when the swarm is far. The hivemind probe (DHT pings, ``net/ping.py``) is exercised
at a distance by tests/test_repair.py's network test; here the probe is a function the test gives
(an injectable RTT source, as an in-process transport has no network to ping)."""

from __future__ import annotations

import threading

import torch

from opendiloco_stream import DiLoCoConfig, wrap
from opendiloco_stream.transport.hivemind.start_rtt import StartRtt
from opendiloco_stream.transport.local import LocalSwarm, LocalTransport
from tests.support.two_workers import mlp

WIDTH = 8


def test_the_start_rtt_is_the_worst_peer_of_each_probe_and_probing_stops_once_rounds_measure():
    answers = [{"boot": 0.001, "far": 0.3}, {"boot": 0.001, "far": 0.25, "new": 0.28}]
    calls, measured, probed_twice = [], threading.Event(), threading.Event()

    def probe():
        calls.append(len(calls))
        if len(calls) >= 2:
            measured.set()  # the rounds measured groupmates meanwhile
            probed_twice.set()
        return answers[min(len(calls) - 1, 1)]

    rtt = StartRtt(probe, measured=measured.is_set, refresh_s=(0.01,))
    try:
        assert rtt.wait_first(10.0) in (0.3, 0.28)  # the first probe (or already the second)
        assert probed_twice.wait(10.0)
        assert rtt.wait_stopped(10.0) and len(calls) == 2  # it stops on its own once measured
        assert rtt.rtt_s() == 0.28 and rtt.peers() == {"boot": 0.001, "far": 0.25, "new": 0.28}
    finally:
        rtt.close()


def test_a_probe_that_fails_or_finds_nobody_leaves_the_rtt_unknown():
    def probe():
        raise OSError("the DHT is gone")

    rtt = StartRtt(probe, measured=lambda: False, refresh_s=(60.0,))
    try:
        assert rtt.wait_first(10.0) is None
    finally:
        rtt.close()
    empty = StartRtt(dict, measured=lambda: False, refresh_s=(60.0,))
    try:
        assert empty.wait_first(10.0) is None
    finally:
        empty.close()


def test_a_probe_at_prepare_counts_a_peer_met_since_the_last_probe():
    """The schedule's next probe may be seconds away when the first rounds are sized; ``probe_now``
    (what ``HivemindTransport.prepare`` calls) probes at once: a far peer that joined the routing
    table after the first probe counts. (The likely cause of a fresh-clone failure of test_repair's
    check that a group formed ahead of the first round at 100 ms: a peer beside the bootstrap
    whose last probe predated the far peer measures ~0 ms.)"""
    table = {"bootstrap": 0.001}
    rtt = StartRtt(lambda: dict(table), measured=lambda: False, refresh_s=(600.0,))
    try:
        assert rtt.wait_first(10.0) == 0.001
        table["far"] = 0.1  # met now; the schedule would probe again in 600 s
        assert rtt.probe_now(10.0) == 0.1
        assert rtt.peers() == {"bootstrap": 0.001, "far": 0.1}
    finally:
        rtt.close()
    assert rtt.wait_stopped(10.0)
    assert rtt.probe_now(10.0) == 0.1  # ended: what it measured, at once


class _Far(LocalTransport):
    """A LocalSwarm worker whose swarm is ``rtt_s`` away as a start probe measures it (the injected
    RTT source: LocalSwarm measures none), recording when each group is formed ahead."""

    def __init__(self, swarm: LocalSwarm, rank: int, rtt_s: float):
        super().__init__(swarm, rank)
        self.start = StartRtt(lambda: {"far": rtt_s}, measured=lambda: False, refresh_s=(60.0,))
        self.start.probe_now(10.0)  # as HivemindTransport.prepare does
        self.step = lambda: 0
        self.early: dict = {}  # (fragment, round) -> the inner step it was formed ahead at

    def groupmate_rtt_s(self):
        return self.start.rtt_s()

    def prematch(self, key, weight=1.0, lead_s=0.0, digest=None):
        self.early.setdefault(tuple(key), self.step())


def _first_rounds_formed_ahead(rtt_s: float) -> tuple[dict, list]:
    """Two in-process workers, H = 10, P = 2 (fragment 0 syncs at 5, 15; fragment 1 at 10, 20), 20
    steps; returns worker 0's groups formed ahead and its ``prematch`` records."""
    config = DiLoCoConfig(mode="blocking", inner_steps=10, num_fragments=2, prematch_steps="auto")
    swarm = LocalSwarm(2)
    torch.manual_seed(5)
    made = [(mlp(WIDTH), [torch.randn(4, WIDTH) for _ in range(3)]) for _ in range(2)]
    transports = [_Far(swarm, rank, rtt_s) for rank in range(2)]

    def train(rank: int):
        model, data = made[rank]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        diloco = wrap(model, opt, transport=transports[rank], config=config, blocks=list(model))
        transports[rank].step = lambda: diloco.step_count
        for i in range(20):
            model(data[i % 3]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step(tokens=4)
        diloco.close()
        return [e for e in diloco.events if e["event"] == "prematch"]

    try:
        records = swarm.run(train)
    finally:
        for t in transports:
            t.start.close()
    return transports[0].early, records[0]


def test_a_peer_whose_swarm_is_measured_far_at_start_forms_its_first_rounds_groups_ahead():
    """At 300 ms (>= 20 ms), K is known from the first inner step: the first round of each fragment
    is formed ahead, before its sync (step 5 for fragment 0, 10 for fragment 1), and the first
    ``prematch`` record (what the start-up lines print) comes at once with that RTT."""
    early, records = _first_rounds_formed_ahead(0.3)
    assert early.get((0, 0)) is not None and early[(0, 0)] < 5, early
    assert early.get((1, 0)) is not None and early[(1, 0)] < 10, early
    assert records and records[0]["steps"] >= 1 and records[0]["rtt_ms"] == 300.0


def test_a_swarm_measured_near_at_start_forms_no_group_ahead():
    early, records = _first_rounds_formed_ahead(0.005)
    assert early == {} and records == []
