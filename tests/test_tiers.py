"""The tiers stay honest: a test that starts peer processes without the ``network`` marker fails
collection (tests/conftest.py with tests/support/markers.py), whichever way it reaches a launcher,
and tests that name none are left alone (naming one counts: the check reads code, it does not run it). Runs pytest on example files with the real conftest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EXAMPLES = '''
import pytest
from benchmarks.harness.loopback import LoopbackSwarm
from tests.support import peers

def _helper():
    return LoopbackSwarm(2, transport_kwargs={})

@pytest.fixture
def bootstrapped(tmp_path):
    return peers.start_peer(tmp_path, "p0", [])

MARK
def test_through_a_helper():
    _helper()

MARK
def test_through_a_fixture(bootstrapped):
    pass

MARK
def test_through_an_import_inside_the_test(tmp_path):
    from opendiloco_stream.commands.local_hivemind import start_bootstrap
    start_bootstrap(tmp_path, "x")

MARK
def test_a_benchmark_that_starts_peers():
    peers.run_benchmark("soak", "--minutes", "0")

def test_a_benchmark_in_process():
    peers.run_benchmark("memory", "--quick")

def test_nothing_of_the_sort():
    assert peers.SMALL
'''


def _collect(tmp_path: Path, mark: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_examples.py").write_text(textwrap.dedent(EXAMPLES).replace("MARK", mark))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--collect-only", "-q", str(tmp_path / "test_examples.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_unmarked_tests_that_start_peers_fail_collection_and_are_named(tmp_path):
    proc = _collect(tmp_path, "")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = next(line for line in proc.stderr.splitlines() if "lack @pytest.mark.network" in line)
    for name in ("through_a_helper", "through_a_fixture", "through_an_import_inside_the_test",
                 "a_benchmark_that_starts_peers"):
        assert f"test_{name}" in message, message
    for name in ("a_benchmark_in_process", "nothing_of_the_sort"):
        assert f"test_{name}" not in message, message


def test_the_same_tests_marked_network_collect(tmp_path):
    proc = _collect(tmp_path, "@pytest.mark.network")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "6 tests collected" in proc.stdout, proc.stdout[-2000:]



SWARM = '''
import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

def test_one():
    pass

def test_two():
    pass
'''

OTHER = '''
import pytest

def test_in_process():
    pass

@pytest.mark.network
def test_network():
    pass
'''


def _run(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", *args,
                           *files], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_two_workers_run_the_swarm_files_first_on_one_worker_and_the_other_files_beside(tmp_path):
    """scripts/test.sh's two workers (tests/conftest.py): the tests of the swarm files run on one
    worker, before anything else there; the other files go to the workers a file at a time."""
    files = {"test_a_other.py": OTHER, "test_nat.py": SWARM, "test_stragglers.py": SWARM, "test_z_other.py": OTHER}
    proc = _run(tmp_path, files, "-v", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ran = []  # (worker, test id) in the order they finished
    for line in proc.stdout.splitlines():
        if line.startswith("[gw") and " PASSED " in line:
            worker, _, nodeid = line.partition(" PASSED ")
            ran.append((worker.split("]")[0], nodeid.split()[0]))
    swarms = [f"test_{f}.py::test_{n}" for f in ("nat", "stragglers") for n in ("one", "two")]
    assert sorted(nodeid for _, nodeid in ran) == sorted([*swarms, *(f"test_{f}_other.py::test_{t}" for f in "az"
                                                                     for t in ("in_process", "network"))]), ran
    (worker,) = {w for w, nodeid in ran if nodeid in swarms}
    on_it = [nodeid for w, nodeid in ran if w == worker]
    assert on_it[:4] == swarms, ran
    for f in "az":  # a file at a time: both of its tests on one worker
        assert len({w for w, nodeid in ran if nodeid.startswith(f"test_{f}_other.py")}) == 1, ran


def test_a_file_of_swarm_tests_missing_from_the_list_fails_collection(tmp_path):
    proc = _run(tmp_path, {"test_new_swarms.py": SWARM}, "--collect-only", "-q")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "add them to SWARM_FILES in tests/conftest.py: test_new_swarms" in proc.stderr, proc.stderr[-2000:]
