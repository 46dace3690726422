"""Round trips to the initial peers: TCP handshakes timed (``doctor`` and ``--dry-run``).

Whether a round fits its window at that distance is the dry run's (``commands/link_fit.py``).
"""

from __future__ import annotations

from typing import Optional

from opendiloco_stream.net.dht import ip4_of
from opendiloco_stream.net.tcp import probe_rtt


def probe_peers(initial_peers: list[str], samples: int = 5, timeout: float = 5.0) -> dict[str, Optional[float]]:
    """Round-trip time (s) to each initial peer's TCP address (``net.tcp.probe_rtt``: TCP
    handshakes; None where none completed)."""
    out: dict[str, Optional[float]] = {}
    for maddr in initial_peers:
        host, port = ip4_of(maddr), _tcp_port(maddr)
        out[maddr] = probe_rtt(host, port, samples, timeout) if host and port else None
    return out


def _tcp_port(maddr: str) -> Optional[int]:
    parts = maddr.split("/")
    for i, part in enumerate(parts[:-1]):
        if part == "tcp":
            try:
                return int(parts[i + 1])
            except ValueError:
                return None
    return None
