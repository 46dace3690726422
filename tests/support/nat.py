"""The NAT topology for tests (:mod:`benchmarks.harness.nat`); nodes start in it through
:class:`benchmarks.harness.peers.PeerProcesses` (``run.bootstrap(run_id, node="boot")``)."""

from __future__ import annotations

from benchmarks.harness.nat import NatTopology, listen_flags, unavailable_reason  # noqa: F401 (re-exported)
