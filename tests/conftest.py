"""Test support shared with the benchmarks lives in ``benchmarks/`` (e.g. ``hv_loopback``, ``netns``):
put that directory on ``sys.path`` so tests import those modules by name, as the benchmark scripts do."""

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
