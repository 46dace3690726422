"""Shared fixtures, and the check that keeps the tiers honest: a test that starts peer processes
(found from its code by ``tests/support/markers.py``) must carry the ``network`` marker, or
collection fails. ``scripts/test.sh --fast`` runs the tests without ``network`` and ``slow``.

``scripts/test.sh`` runs two pytest-xdist workers, a file at a time each (``--dist loadfile``: a
module's shared fixtures start once), except the files of :data:`SWARM_FILES`: swarms of ``peer``
processes whose assertions depend on when each peer reaches each round. Those files are one unit,
run first and one test at a time on one worker while the other worker takes the other files, so
two swarms never share the machine (as in a one-process run). Collection fails when a file whose
every test is marked ``network`` and ``slow`` is missing from the list.
"""

from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

from tests.support import ports
from tests.support import peers as _peers  # noqa: F401  (registers the peer launchers)
from tests.support.hivemind_locks import unstick_hivemind_locks
from tests.support.markers import unmarked_peer_tests


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    unmarked = unmarked_peer_tests(items)
    if unmarked:
        raise pytest.UsageError("these tests start peer processes but lack @pytest.mark.network: "
                                + ", ".join(unmarked))
    swarm_like = {item.path.stem for item in items if _is_swarm(item)} - {
        item.path.stem for item in items if not _is_swarm(item)}
    if swarm_like - set(SWARM_FILES):
        raise pytest.UsageError("every test of these files is marked network and slow: add them to SWARM_FILES in "
                                "tests/conftest.py: " + ", ".join(sorted(swarm_like - set(SWARM_FILES))))
    if hasattr(config, "workerinput"):  # an xdist worker: the swarms first, the rest in file order
        items.sort(key=lambda item: item.path.stem not in SWARM_FILES)


#: files of peer swarms, run one test at a time on one xdist worker (see the module docstring)
SWARM_FILES = ("test_meeting_peers", "test_nat", "test_nat_direct", "test_peer_ranks", "test_peers_hivemind",
               "test_stragglers", "test_wan_distance")
SWARMS = "swarms"


def _is_swarm(item: pytest.Item) -> bool:
    return item.get_closest_marker("network") is not None and item.get_closest_marker("slow") is not None


class _SwarmsApart(LoadFileScheduling):
    """``--dist loadfile`` with the files of :data:`SWARM_FILES` as one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        scope = super()._split_scope(nodeid)
        return SWARMS if Path(scope).stem in SWARM_FILES else scope


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") == "loadfile":
        return _SwarmsApart(config, log)
    return None  # another --dist: xdist's own


@pytest.fixture
def free_port_range():
    """``free_port_range(count)``: the first of ``count`` consecutive free TCP ports (tests/support/ports.py)."""
    return ports.free_port_range


@pytest.fixture(autouse=True)
def _hivemind_locks_free():
    """Before every test: hivemind's cross-process locks are not held by a DHT process an earlier
    test killed (tests/support/hivemind_locks.py: the test process starts many DHTs, a peer one)."""
    unstick_hivemind_locks()
    yield
