"""benchmarks/soak.py in miniature: a few seconds of rounds, then the JSON has its fields.
(The soak itself, 3 or 30 minutes, is not run in CI.)"""

from __future__ import annotations

import json
import pytest

from tests.support.peers import run_benchmark


@pytest.mark.network
@pytest.mark.timeout(180)
def test_soak_runs_briefly_and_writes_its_report(tmp_path):
    out = tmp_path / "soak.json"
    proc = run_benchmark("soak", "--minutes", "0.1", "--numel", "100000", "--sample-s", "1", "--out", str(out),
                         timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for key in ("duration_s", "rounds", "failed_rounds", "failures", "round_s", "per_peer", "rows"):
        assert key in r, key
    assert r["rounds"] >= 1 and set(r["per_peer"]) >= {"peer0", "peer1", "peer2", "parent"}
    for p in r["rows"]:  # one per process
        assert {"pid", "owner", "name", "rss_first_mb", "rss_last_mb", "growth_mb_per_hour",
                "growth_second_half_mb_per_hour", "samples"} <= set(p)
    assert any(p["name"] == "p2pd" for p in r["rows"]), [p["name"] for p in r["rows"]]
    assert "MB/hour" in proc.stdout
