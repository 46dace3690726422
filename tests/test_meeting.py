"""Peers that fall a round apart meet again (in-process half; the real peers are in
tests/test_meeting_peers.py).

A blocking peer waiting for a round the swarm has moved past gives the round up (it fails at once)
and catches up with the swarm's round, instead of waiting out its matchmaking window and reaching
every later round one window after the others gave up on it. A peer that averages with nobody for
several rounds says so.

The transport here is a stand-in: a round that never forms is a failure hivemind produces only with
real timing (tests/test_meeting_peers.py runs it for real); this one lets the test say exactly when
the swarm is ahead.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from opendiloco_stream.algorithm import StreamingDiLoCo
from opendiloco_stream.algorithm.data_parallel import DataParallel
from opendiloco_stream.algorithm.sync_log import ALONE_WARN_AFTER, SyncLog
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult, Transport


class _PendingHandle(SyncHandle):
    """A round that forms only if ``form()`` is called; ``abandon`` fails it at once."""

    def __init__(self, key, tensor):
        self.key, self.tensor = key, tensor
        self.event = threading.Event()
        self.outcome = None

    def done(self):
        return self.event.is_set()

    def settle(self, timeout):
        return self.event.wait(timeout)

    def form(self):
        self.outcome = SyncResult(average=self.tensor.clone(), group_size=2, weight_share=0.5, sent=self.tensor.clone())
        self.event.set()

    def abandon(self):
        if not self.event.is_set():
            self.outcome = "abandoned"
            self.event.set()
        return True

    def wait(self, timeout=None):
        if not self.event.wait(timeout):
            raise SyncFailed("no group in time", key=self.key, reason="matchmaking")
        if self.outcome == "abandoned":
            raise SyncFailed("abandoned", key=self.key, reason="matchmaking")
        return self.outcome


class _SwarmView(Transport):
    """Rounds wait for a group; ``late`` holds the rounds the other peers launched a while ago.
    Rounds listed in ``forms`` form at once; the others never do unless abandoned."""

    watches_swarm = True

    def __init__(self):
        self.late, self.forms, self.launched, self.abandoned = set(), set(), [], []

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        handle = _PendingHandle(key, tensor)
        self.launched.append(key)
        if key in self.forms:
            handle.form()
        else:
            abandon = handle.abandon

            def recorded():
                self.abandoned.append(key)
                return abandon()
            handle.abandon = recorded
        return handle

    def round_late(self, key):
        return key in self.late


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _inner_step(model, opt, wrapper):
    model(torch.ones(2, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    wrapper.step(tokens=10)


def test_a_blocking_peer_gives_up_a_round_the_swarm_moved_past_and_joins_the_swarms_round():
    """H = 10, P = 2: fragment 0 syncs at 5, 15...; fragment 1 at 10, 20. The peer waits in round 0
    of fragment 1 (step 10), which nobody else is in; the other peer launched round 1 of fragment 0
    (step 15) a while ago. The wait gives the round up within a poll, and the peer jumps to step 15
    and launches the round the other peer waits in (which forms)."""
    link = _SwarmView()
    link.forms |= {(0, 0), (0, 1)}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = StreamingDiLoCo(model, opt, transport=link, config=DiLoCoConfig(
        inner_steps=10, num_fragments=2, mode="blocking", sync_timeout=60.0), blocks=list(model))
    for _ in range(9):
        _inner_step(model, opt, wrapper)
    link.late.add((0, 1))  # the other peer waits at step 15 already
    start = time.monotonic()
    _inner_step(model, opt, wrapper)  # step 10: round 0 of fragment 1, then the catch-up
    assert time.monotonic() - start < 30  # (not the 60 s sync timeout: a loose bound, not a timing claim)
    assert link.abandoned == [(1, 0)]
    assert wrapper.step_count == 15 and link.launched == [(0, 0), (1, 0), (0, 1)]
    syncs = [(e["fragment"], e["round"], e["ok"]) for e in wrapper.events if e["event"] == "sync"]
    assert syncs == [(0, 0, True), (1, 0, False), (0, 1, True)]
    assert [(e["from_step"], e["to_step"]) for e in wrapper.events if e["event"] == "catch_up"] == [(10, 15)]


def test_a_round_the_swarm_is_not_past_is_waited_for():
    """Nobody launched a later round: the blocking wait keeps waiting (here until its bound), it is
    never abandoned for nothing."""
    link = _SwarmView()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = StreamingDiLoCo(model, opt, transport=link, config=DiLoCoConfig(
        inner_steps=2, num_fragments=1, mode="blocking", sync_timeout=1.0), blocks=list(model))
    _inner_step(model, opt, wrapper)
    _inner_step(model, opt, wrapper)
    assert link.launched == [(0, 0)] and link.abandoned == []
    (sync,) = [e for e in wrapper.events if e["event"] == "sync"]
    assert not sync["ok"] and sync["wait_s"] >= 1.0


def test_data_parallel_peer_behind_the_swarm_gives_up_and_takes_the_swarms_step():
    """Data-parallel rounds are keyed by the inner step: a peer whose round (0, 3) nobody joins while
    the swarm launched (0, 4) and (0, 5) gives it up and moves its key to the swarm's latest step."""
    link = _SwarmView()
    link.forms |= {(0, 1), (0, 2), (0, 5), (0, 6)}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = DataParallel(model, opt, transport=link, config=DiLoCoConfig(mode="data-parallel", sync_timeout=60.0))
    _inner_step(model, opt, wrapper)
    _inner_step(model, opt, wrapper)
    link.late |= {(0, 4), (0, 5)}
    _inner_step(model, opt, wrapper)  # round (0, 3): given up; the wrapper jumps to step 4
    assert link.abandoned == [(0, 3)] and wrapper.step_count == 4
    _inner_step(model, opt, wrapper)
    assert link.launched == [(0, 1), (0, 2), (0, 3), (0, 5)]
    assert wrapper.stats.caught_up_steps == 1


def test_a_peer_that_syncs_alone_warns_once_naming_the_cause_and_says_when_it_is_back():
    events = []
    log = SyncLog(on_event=events.append)
    failure = None
    for k in range(ALONE_WARN_AFTER + 2):
        log.record(0, k, k, failure, "matchmaking", 8.0, None)
    warnings = [e for e in events if e["event"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["kind"] == "alone" and warnings[0]["cause"] == "matchmaking"
    assert warnings[0]["rounds"] == ALONE_WARN_AFTER and "alone" in warnings[0]["message"]
    assert log.stats.alone_syncs == ALONE_WARN_AFTER + 2 and log.alone.streak == ALONE_WARN_AFTER + 2
    average = torch.zeros(3)
    log.record(0, 9, 9, SyncResult(average=average, group_size=2, weight_share=0.5, sent=average), None, 0.1, None)
    assert [e["kind"] for e in events if e["event"] == "warning"] == ["alone", "not_alone"]
    assert log.alone.streak == 0 and log.stats.alone_syncs == ALONE_WARN_AFTER + 2


def test_two_alone_rounds_do_not_warn():
    events = []
    log = SyncLog(on_event=events.append)
    average = torch.zeros(3)
    alone = SyncResult(average=average, group_size=1, weight_share=1.0, sent=average)
    for k in range(ALONE_WARN_AFTER - 1):
        log.record(0, k, k, alone, None, 0.0, None)
    log.record(0, 5, 5, SyncResult(average=average, group_size=3, weight_share=0.3, sent=average), None, 0.0, None)
    for k in range(ALONE_WARN_AFTER - 1):
        log.record(0, 6 + k, 6 + k, None, "timeout", 1.0, None)
    assert not [e for e in events if e["event"] == "warning"]


def test_a_request_timeout_not_below_the_matchmaking_time_is_a_one_line_config_error():
    import pytest

    from opendiloco_stream.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="request_timeout .* must be below net.matchmaking_time"):
        load_config(None, {"net": {"matchmaking_time": 2.0}}, environ={})


def test_monitor_names_a_peer_that_trains_alone():
    from opendiloco_stream.commands.monitor import format_table

    record = {"name": "carol", "step": 42, "loss": 3.25, "tokens_per_s": 1000.0, "bytes_sent": 0,
              "compute_utilization": 0.3, "rounds": 0, "failed_rounds": 6, "time": 100.0}
    quiet = format_table([{**record, "alone_rounds": ALONE_WARN_AFTER - 1}], now=101.0, run_id="r")
    assert "WARNING" not in quiet
    loud = format_table([{**record, "alone_rounds": 6}, {**record, "name": "dave", "alone_rounds": 0}],
                        now=101.0, run_id="r").splitlines()
    assert loud[-1].startswith("WARNING: carol has averaged with no other peer for its last 6 rounds")
    assert not any("dave" in line and "WARNING" in line for line in loud)


def test_the_alone_streak_is_published_in_the_schema_checked_record():
    from opendiloco_stream.net.metrics import PeerMetrics, live_values, to_record
    from opendiloco_stream.stats import SyncStats

    stats = SyncStats(syncs=5, failed_syncs=5, alone_syncs=5, current_alone_streak=5)
    record = to_record(live_values(stats, step=50), name="carol", peer_id="p", time=1.0)
    assert record["alone_rounds"] == 5 and PeerMetrics(**record).alone_rounds == 5
    assert SyncStats.total([stats, SyncStats(current_alone_streak=2)]).current_alone_streak == 5
