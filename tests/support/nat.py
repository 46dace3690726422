"""The NAT topology for tests (:mod:`benchmarks.harness.nat`); nodes start in it through
:class:`benchmarks.harness.peers.PeerProcesses` (``run.bootstrap(run_id, node="boot")``)."""

from __future__ import annotations

from benchmarks.harness.nat import NatTopology, unavailable_reason  # noqa: F401 (re-exported)


def listen_flags(topo: NatTopology, node: str) -> list[str]:
    """A public peer listens on its bridge address; a private one on every interface (the default
    for remote initial peers), so what it announces is its private address, as behind a real NAT."""
    return [] if node in topo.private else ["--host-maddrs", f"/ip4/{topo.ip(node)}/tcp/0"]
