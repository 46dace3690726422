"""What a peer knows about the links to its groupmates: round-trip time and rate, measured in its
own rounds (the kernel's side of it, ``TCP_INFO`` and socket buffers, is ``net/tcp.py``).

- *Measuring.* The kernel already measures every TCP connection: ``TCP_INFO`` holds the smoothed
  RTT (``net.tcp.tcp_info``). The direct path (``direct.py``) reads it on each groupmate's
  connection at the end of a round; the runner also times the bytes it moved with that groupmate
  (a rate that counts the round's waits too, so it errs low: timeouts derived from it err long).
- *Remembering.* :class:`LinkBook` keeps one :class:`LinkEstimate` per groupmate (an exponential
  average, so one slow round does not decide the next rounds' bounds alone), and answers with the
  worst link of a group: a round waits for its slowest member.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Hashable, Optional

from opendiloco_stream.net.tcp import (  # noqa: F401 (re-exported: what the direct path uses)
    TcpInfo, bdp_bytes, buffer_bytes, kernel_buffer_limits, parse_tcp_info, restarts_after_idle, size_buffers,
    slow_start_after_idle, tcp_info,
)

EWMA = 0.3  # weight of a new sample in a groupmate's estimate
SLOW_START_NOTICE_RTT_S = 0.02  # from this RTT on, a slow start per round costs a visible part of it

logger = logging.getLogger(__name__)
_slow_start_noticed = threading.Event()  # the notice below is said once per process


def notice_slow_start(rtt_s: float) -> None:
    """Say once, at the first groupmate measured ``SLOW_START_NOTICE_RTT_S`` or more away, that this
    machine's kept-open connections restart from the initial window after each idle gap between
    rounds and the peer cannot avoid it (``net.tcp.restarts_after_idle``), with the fix: it needs root."""
    if rtt_s < SLOW_START_NOTICE_RTT_S or _slow_start_noticed.is_set() or not restarts_after_idle():
        return
    _slow_start_noticed.set()
    logger.warning("a groupmate is %.0f ms away and this machine's TCP restarts each kept-open connection from its "
                   "initial window after the idle gap between rounds (net.ipv4.tcp_slow_start_after_idle = 1, and "
                   "BBR, which never does, is not in net.ipv4.tcp_allowed_congestion_control): each round pays a few "
                   "round trips of slow start; fix (root): sysctl -w net.ipv4.tcp_slow_start_after_idle=0, or allow "
                   "bbr (modprobe tcp_bbr; add it to net.ipv4.tcp_allowed_congestion_control)", rtt_s * 1e3)


@dataclass(frozen=True)
class LinkEstimate:
    """One groupmate's link as this peer measured it (``rate_mbit`` None: not measured yet)."""

    rtt_s: float
    rate_mbit: Optional[float] = None
    samples: int = 1

    def updated(self, rtt_s: Optional[float], rate_mbit: Optional[float]) -> "LinkEstimate":
        """With one more round's sample (either may be None: not measured this round)."""
        rtt = self.rtt_s if rtt_s is None else (1 - EWMA) * self.rtt_s + EWMA * rtt_s
        if rate_mbit is None:
            rate = self.rate_mbit
        else:
            rate = rate_mbit if self.rate_mbit is None else (1 - EWMA) * self.rate_mbit + EWMA * rate_mbit
        return LinkEstimate(rtt, rate, self.samples + 1)


class LinkBook:
    """This peer's estimates of its groupmates' links (peer -> ``LinkEstimate``), from its rounds.

    ``rtt_floor_s``: an RTT known before any round (``doctor``'s or a DHT ping's), used for a peer
    not measured yet. Thread-safe enough for its use: one writer (the service loop), readers that
    take a snapshot (``snapshot``)."""

    def __init__(self, rtt_floor_s: float = 0.0, clock=time.monotonic):
        self.rtt_floor_s, self.clock = float(rtt_floor_s), clock
        self._links: dict[Hashable, LinkEstimate] = {}
        self._seen: dict[Hashable, float] = {}

    def record(self, peer: Hashable, *, rtt_s: Optional[float] = None, rate_mbit: Optional[float] = None) -> None:
        if rtt_s is None and rate_mbit is None:
            return
        if rtt_s is not None and not rtt_s >= 0:
            raise ValueError(f"rtt_s must be >= 0, got {rtt_s}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        old = self._links.get(peer)
        if old is None:
            self._links[peer] = LinkEstimate(rtt_s if rtt_s is not None else self.rtt_floor_s, rate_mbit)
        else:
            self._links[peer] = old.updated(rtt_s, rate_mbit)
        self._seen[peer] = self.clock()

    def get(self, peer: Hashable) -> Optional[LinkEstimate]:
        return self._links.get(peer)

    def snapshot(self) -> dict:
        return dict(self._links)

    def worst(self, peers: Optional[list] = None) -> tuple[float, Optional[float]]:
        """``(rtt_s, rate_mbit)`` of the slowest link among ``peers`` (all known: None): the
        largest RTT (at least ``rtt_floor_s``) and the smallest measured rate (None if none)."""
        known = dict(self._links)  # a copy: the service loop may add a peer meanwhile
        links = [known[p] for p in (known if peers is None else peers) if p in known]
        rtt = max([self.rtt_floor_s, *(link.rtt_s for link in links)])
        rates = [link.rate_mbit for link in links if link.rate_mbit is not None]
        return rtt, (min(rates) if rates else None)

    def __len__(self) -> int:
        return len(self._links)
