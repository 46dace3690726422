"""``prematch_steps = "auto"`` (the default): groups form ahead by as many inner steps as cover
matchmaking's round trips at the RTT the transport measured, and not at all near by or unmeasured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from opendiloco_stream.algorithm.prematch import PrematchChoice, Prematcher, auto_steps
from opendiloco_stream.cli import build_parser
from opendiloco_stream.config import PREMATCH_AUTO_MIN_RTT_MS, PREMATCH_AUTO_RTTS, DiLoCoConfig
from opendiloco_stream.config_cli import config_from_args
from opendiloco_stream.transport.base import SwarmView


def test_auto_steps_cover_matchmakings_round_trips_within_the_fragments_schedule():
    H = 10
    assert auto_steps(None, 0.1, H) == 0  # nothing measured yet: as before
    assert auto_steps(0.0, 0.1, H) == 0  # loopback
    assert auto_steps(PREMATCH_AUTO_MIN_RTT_MS / 1e3 * 0.99, 0.1, H) == 0
    assert auto_steps(0.3, 0.15, H) == 8  # ceil(4 x 0.3 / 0.15)
    assert PREMATCH_AUTO_RTTS == 4
    assert auto_steps(0.3, 0.05, H) == H - 1  # a group forms after its fragment's previous round
    assert auto_steps(0.05, 2.0, H) == 1  # long steps: one step ahead covers the round trips
    assert auto_steps(0.3, None, H) == 1  # no step timed yet
    assert auto_steps(0.3, 0.1, 1) == 0  # H = 1: no step between two rounds to form one in


class _Link(SwarmView):
    """A swarm view (what the Prematcher asks) whose measured groupmate RTT the test sets; records
    ``prematch`` calls."""

    def __init__(self):
        self.rtt_s, self.now, self.early = None, 0, []

    def groupmate_rtt_s(self):
        return self.rtt_s

    def prematch(self, key, weight=1.0, lead_s=0.0, digest=None):
        self.early.append((self.now, key, weight, lead_s))


def _run(link: _Link, steps, rtt_from: int, rtt_s: float, step_s: float = 0.125, H: int = 10):
    """Steps 1..``steps`` of H = 10, P = 2 (fragment 0 syncs at 5, 15, 25..., fragment 1 at 10, 20...),
    100 tokens a step, one step every ``step_s`` s; the transport measures ``rtt_s`` from step ``rtt_from``."""
    clock = SimpleNamespace(t=0.0)
    records = []
    pm = Prematcher(link, "auto", weight=float, on_change=records.append, clock=lambda: clock.t)
    frags = [SimpleNamespace(index=0, offset=5, tokens=0), SimpleNamespace(index=1, offset=0, tokens=0)]
    for t in range(1, steps + 1):
        clock.t += step_s
        pm.tick()
        link.now = t
        for f in frags:  # tokens since the fragment's last sync
            f.tokens = 0 if t > 1 and (t - 1 - f.offset) % H == 0 else f.tokens + 100
        if t >= rtt_from:
            link.rtt_s = rtt_s
        pm.after_step(t, frags, H, 100)
    return pm, records


def test_auto_forms_no_group_ahead_until_a_distant_groupmate_is_measured_then_each_round_once():
    link = _Link()
    pm, records = _run(link, 26, rtt_from=7, rtt_s=0.25)
    # nothing before step 7; K = ceil(4 x 0.25 / 0.125) = 8: fragment 1's round 0 (sync 10) from step 7
    # (3 steps ahead: K grew past it), then each round at its sync - 8, once
    assert [(t, key) for t, key, _, _ in link.early] == [(7, (0, 1)), (7, (1, 0)), (12, (1, 1)), (17, (0, 2)),
                                                         (22, (1, 2))]
    assert [lead for _, _, _, lead in link.early] == pytest.approx([8 * 0.125, 3 * 0.125] + [8 * 0.125] * 3)
    assert pm.choice == PrematchChoice(8, True, 0.25, 0.125)
    assert "auto: 8 inner steps ahead" in pm.choice.describe() and "250 ms" in pm.choice.describe()
    assert [(r["event"], r["steps"], r["rtt_ms"]) for r in records] == [("prematch", 8, 250.0)]


def test_auto_stays_off_on_a_near_link_and_turns_off_when_the_link_comes_near():
    link = _Link()
    pm, records = _run(link, 30, rtt_from=1, rtt_s=0.001)
    assert link.early == [] and records == [] and pm.choice.steps == 0
    assert "< 20 ms" in pm.choice.describe()
    link = _Link()
    pm, records = _run(link, 12, rtt_from=3, rtt_s=0.25)
    link.rtt_s = 0.002
    pm.after_step(13, [SimpleNamespace(index=0, offset=5, tokens=800)], 10, 100)
    assert [r["steps"] for r in records] == [8, 0] and pm.choice.steps == 0


def test_a_set_number_of_steps_still_means_exactly_that_many():
    link = _Link()
    link.rtt_s = 0.3  # ignored: not "auto"
    pm = Prematcher(link, 2, weight=float)
    frags = [SimpleNamespace(index=0, offset=5, tokens=0)]
    for t in range(1, 16):
        link.now = t
        pm.after_step(t, frags, 10, 100)
    assert [(t, key) for t, key, _, _ in link.early] == [(3, (0, 0)), (13, (0, 1))]
    assert pm.choice.describe() == "2 inner steps ahead (--prematch-steps 2)"


def test_prematch_steps_is_auto_by_default_and_takes_auto_or_a_number_from_the_command_line():
    assert DiLoCoConfig().prematch_steps == "auto"
    for argv, want in ((["--prematch-steps", "auto"], "auto"), (["--prematch-steps", "3"], 3), ([], "auto")):
        assert config_from_args(build_parser().parse_args(["local", *argv])).diloco.prematch_steps == want
    with pytest.raises(ValueError, match="prematch_steps must be >= 0 or 'auto'"):
        DiLoCoConfig(prematch_steps=-1)
    with pytest.raises(ValueError, match=r"prematch_steps \(10\) must be < inner_steps \(10\)"):
        DiLoCoConfig(prematch_steps=10, inner_steps=10)
    DiLoCoConfig(prematch_steps="auto", inner_steps=1, num_fragments=1)  # auto fits any H


def test_transports_without_a_network_measure_no_rtt():
    from opendiloco_stream.transport.local import LocalSwarm

    assert LocalSwarm(2).transport(0).groupmate_rtt_s() is None


def test_auto_sizes_the_lead_from_the_compute_step_not_from_blocking_rounds_waits():
    """Blocking: the step that waits for a round takes seconds, the others 0.125 s; the steps
    between an announcement and its sync are compute, so K comes from the median gap."""
    link = _Link()
    link.rtt_s = 0.25
    clock = SimpleNamespace(t=0.0)
    pm = Prematcher(link, "auto", weight=float, clock=lambda: clock.t)
    for t in range(1, 21):
        clock.t += 5.0 if t % 5 == 1 else 0.125  # a round's wait every fifth step
        pm.tick()
        pm.after_step(t, [SimpleNamespace(index=0, offset=5, tokens=0)], 10, 100)
    assert pm.step_s > 0.5  # the mean, which the lead in seconds still uses
    assert pm.choice.steps == 8 and pm.choice.step_s == 0.125
