"""benchmarks/transport_rounds.py on loopback with ``--gloo``: gloo's reference timed before, between
and after our rounds by ranks that stay up (``benchmarks/harness/gloo.py``)."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks.harness.gloo import GlooRanks
from tests.support.peers import run_benchmark


@pytest.mark.network
@pytest.mark.timeout(120)
def test_gloo_ranks_time_rounds_on_command_and_stop():
    with GlooRanks(2) as ranks:
        first, second = ranks.times(10_000, 3), ranks.times(20_000, 2)
        procs = list(ranks.procs)
    assert len(first) == 3 and len(second) == 2 and all(t > 0 for t in first + second)
    assert not any(p.is_alive() for p in procs)


@pytest.mark.network
@pytest.mark.timeout(300)
def test_transport_rounds_on_loopback_times_gloo_between_its_rounds(tmp_path):
    out, rounds = tmp_path / "rounds.json", 2
    run = run_benchmark("transport_rounds", "--codecs", "fp32", "--numels", "200000", "--rounds", str(rounds),
                        "--no-kill", "--gloo", "--prematch", "--out", str(out), timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["prematch"] for r in rows] == [False, True]
    for row in rows:
        assert row["gloo_round_s"] > 0 and row["gloo_round_s_after"] > 0 and row["gloo_between_s_median"] > 0
        ratios = row["ours_over_gloo_between"]
        assert len(ratios) == rounds and all(r > 0 for r in ratios)
        assert row["ours_over_gloo_between_median"] == statistics.median(ratios)
    assert "gloo between rounds" in run.stdout
