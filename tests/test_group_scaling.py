"""benchmarks/group_scaling.py: the phase groups it reports (``benchmarks/harness/loopback.py``),
the process-tree CPU it measures (``benchmarks/harness/procfs.py``), and a two-peer run as a module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from benchmarks.harness.loopback import GROUP_NAMES, group_phases
from benchmarks.harness.procfs import tree_cpu_seconds
from benchmarks.harness.results import read_result
from tests.support.peers import run_benchmark


def test_phases_are_grouped_into_matchmaking_exchange_reduce_host_and_other():
    phases = dict(prepare=0.01, matchmaking=0.1, contributions=0.2, verdicts=0.02, reduce=0.05, results=0.03,
                  drain=0.004, finish=0.006, handshake=0.5)
    got = group_phases(phases)
    assert list(got) == list(GROUP_NAMES)
    assert got == pytest.approx(dict(matchmaking=0.1, exchange=0.254, reduce=0.05, host=0.016, other=0.5))
    assert sum(got.values()) == pytest.approx(sum(phases.values()))  # nothing lost, nothing counted twice


_BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('burnt', flush=True)\ntime.sleep(60)"


def test_tree_cpu_counts_a_grandchild_in_the_session():
    # the root (a shell in its own session) starts python, which burns 0.3 s of CPU and stays alive
    root = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0"; true', _BURN], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert root.stdout.readline().strip() == "burnt"
        tree = tree_cpu_seconds([root.pid])[root.pid]
        assert len(tree) == 2 and root.pid in tree
        assert sum(tree.values()) >= 0.29
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(10)
    with pytest.raises(ProcessLookupError):
        tree_cpu_seconds([root.pid])


@pytest.mark.network
@pytest.mark.timeout(300)
def test_two_peers_run_as_a_module_and_extrapolate(tmp_path):
    out = tmp_path / "scaling.json"
    run = run_benchmark("group_scaling", "--sizes", "2", "--codecs", "fp32", "--numel", "20000", "--rounds", "2",
                        "--no-plot", "--out", str(out), timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    payload = read_result(out)
    (row,) = payload["rows"]
    assert row["ok_rounds"] == 2 and row["failures"] == [] and row["peers"] == 2
    assert row["bytes_sent_per_peer"] > 20000 * 4 / 2 and row["cpu_s_per_peer_round"] >= 0
    assert set(row["phase_groups_s_median"]) == set(GROUP_NAMES)
    predicted = payload["extrapolation"]["fp32"]["predicted"]
    assert [p["peers"] for p in predicted] == [2, 64, 256] and all(p["round"] > 0 for p in predicted)
