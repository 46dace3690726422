"""benchmarks/memory.py in its --quick form (tiny model, blocking and eager, fp32): the table and the
JSON have their fields, and the bytes the wrapper holds (torch accounting, no allocator involved)
stay within the documented target and follow the algorithm: eager 'corrected' holds ``start`` on
top of blocking's outer parameters and momentum. (The 35M / 100M table is the benchmark's own run.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MEMORY = Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py"


@pytest.mark.timeout(300)
def test_memory_quick_reports_extra_rss_and_held_bytes_within_the_target(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(MEMORY), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| model | params | mode | codec | extra peak MiB" in proc.stdout
    r = json.loads(out.read_text())
    rows = {row["mode"]: row for row in r["rows"]}
    assert set(rows) == {"plain", "blocking", "eager"}
    model_mib = rows["plain"]["params"] * 4 / (1 << 20)
    for mode in ("blocking", "eager"):
        row = rows[mode]
        for key in ("extra_peak_mib", "extra_end_mib", "held_mib", "sync_extra_mib", "target_mib", "fragment_numels"):
            assert key in row, (mode, key)
        assert sum(row["fragment_numels"]) == rows["plain"]["params"]
        assert row["held_mib"] <= row["target_mib"], row
    # blocking holds outer parameters + momentum (2 x model fp32); eager also the restart point
    assert rows["blocking"]["held_mib"] == pytest.approx(2 * model_mib, rel=0.01)
    assert rows["eager"]["held_mib"] >= rows["blocking"]["held_mib"] + 0.99 * model_mib
