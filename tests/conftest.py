"""Test support shared with the benchmarks lives in ``benchmarks/`` (e.g. ``hv_loopback``, ``netns``):
put that directory on ``sys.path`` so tests import those modules by name, as the benchmark scripts do."""

import socket
import sys
from pathlib import Path

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)


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
