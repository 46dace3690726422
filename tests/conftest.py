"""Shared fixtures, and the check that keeps the tiers honest: a test that starts peer processes
(found from its code by ``tests/support/markers.py``) must carry the ``network`` marker, or
collection fails. ``scripts/test.sh --fast`` runs the tests without ``network`` and ``slow``."""

import socket

import pytest

from tests.support import peers as _peers  # noqa: F401  (registers the peer launchers)
from tests.support.hivemind_locks import unstick_hivemind_locks
from tests.support.markers import unmarked_peer_tests


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    unmarked = unmarked_peer_tests(items)
    if unmarked:
        raise pytest.UsageError("these tests start peer processes but lack @pytest.mark.network: "
                                + ", ".join(unmarked))


def _free_port_range(count: int, host: str = "0.0.0.0") -> int:
    """A base port with ``count`` consecutive TCP ports free on ``host`` (checked by binding each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


@pytest.fixture
def free_port_range():
    """``free_port_range(count)``: the first of ``count`` consecutive free TCP ports."""
    return _free_port_range


@pytest.fixture(autouse=True)
def _hivemind_locks_free():
    """Before every test: hivemind's cross-process locks are not held by a DHT process an earlier
    test killed (tests/support/hivemind_locks.py: the test process starts many DHTs, a peer one)."""
    unstick_hivemind_locks()
    yield
