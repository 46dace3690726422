"""The memory a landing takes (issue 41, "Memory": the wrapper's memory over the plain loop is the
outer state plus one fragment in flight): for every rule, a fragment's sync and its landing on
arrival add at most one fragment over what the wrapper held when they began. Measured with
torch's profiler by ``benchmarks/landing_memory.py`` (its docstring says how; its table is in
docs/benchmarks.md), run here as a subprocess.

The bound is one fragment (fp32) plus one of its largest tensors: the outer gradient of the round
launched at the sync is the fragment in flight, and a landing works one parameter at a time. 1 KiB
more covers the scalar tensors torch makes for Python numbers (8 bytes each). Before the landings
worked parameter by parameter they took 2 to 7 fragments, and this test failed for every rule.
"""

from __future__ import annotations

import json

import pytest

from tests.support.peers import run_benchmark

RULES = ["blocking", "overlap", "eager-merge", "eager-overlap", "eager-corrected", "eager-corrected-mixed",
         "eager-corrected-on-arrival", "eager-paper", "naive-delayed"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("landing") / "landing-memory.json"
    proc = run_benchmark("landing_memory", "--out", str(out), timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| rule | sync | landing on arrival |" in proc.stdout
    return {row["rule"]: row for row in json.loads(out.read_text())["rows"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rule", RULES + ["blocking + error feedback (parameters)",
                                          "eager-merge + error feedback (parameters)"])
def test_a_sync_and_a_landing_hold_at_most_one_fragment_over_what_was_there(rows, rule):
    row = rows[rule]
    fragment = row["fragment_bytes"]
    bound = fragment + row["largest_tensor_bytes"] + 1024
    assert "sync_bytes" in row, "no sync was measured"
    for kind in ("sync", "on_step", "finish"):
        peak = row.get(f"{kind}_bytes")
        assert peak is None or peak <= bound, f"{rule} {kind}: {peak / fragment:.2f} fragments (bound {bound / fragment:.2f})"
    # the rules that land on arrival were measured doing it
    if rule not in ("blocking", "blocking + error feedback (parameters)"):
        assert "on_step_bytes" in row and "finish_bytes" in row, row
