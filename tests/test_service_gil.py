"""benchmarks/service_gil.py: the trainer's tokens/s with rounds in its own averaging service, in
other processes, or none; a short run as a module, and its per-round accounting."""

from __future__ import annotations

import pytest

from benchmarks.harness.results import read_result
from tests.support.peers import run_benchmark


@pytest.mark.network
@pytest.mark.timeout(300)
def test_service_gil_runs_the_three_conditions_with_real_peers(tmp_path):
    out = tmp_path / "gil.json"
    proc = run_benchmark("service_gil", "--seconds", "3", "--repeats", "1", "--numel", "200000", "--out", str(out),
                         timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    r = read_result(out)
    rounds = {row["condition"]: row.get("rounds_ok", 0) for row in r["rows"]}
    assert rounds["alone"] == 0 and rounds["rounds elsewhere"] > 0 and rounds["rounds in the trainer"] > 0, rounds
    assert all(row["steps"] > 0 for row in r["rows"])
    # the cost per round is taken against the same repeat's "alone"
    tps = {row["condition"]: row["tokens_per_s"] for row in r["rows"]}
    for condition in ("rounds elsewhere", "rounds in the trainer"):
        want = (tps["alone"] - tps[condition]) / tps["alone"] / rounds[condition]
        assert r["loss_per_round"][condition] == [pytest.approx(want)]
    want = (r["loss_per_round"]["rounds in the trainer"][0] - r["loss_per_round"]["rounds elsewhere"][0]) \
        * rounds["rounds elsewhere"]
    assert r["extra_at_equal_rounds"] == [pytest.approx(want)]
