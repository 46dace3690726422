"""What a peer knows about the links to its groupmates: round-trip time and rate, measured in its
own rounds, and the socket buffers a link of that kind needs.

- *Measuring.* The kernel already measures every TCP connection: ``TCP_INFO`` holds the smoothed
  RTT, its variance, the smallest RTT seen, the delivery rate and the retransmissions
  (:func:`tcp_info`). The direct path (``direct.py``) reads it on each groupmate's connection at
  the end of a round; the runner also times the bytes it moved with that groupmate (a rate that
  counts the round's waits too, so it errs low: timeouts derived from it err long).
- *Remembering.* :class:`LinkBook` keeps one :class:`LinkEstimate` per groupmate (an exponential
  average, so one slow round does not decide the next rounds' bounds alone), and answers with the
  worst link of a group: a round waits for its slowest member.
- *Buffers.* A TCP connection moves at most one window per round trip, so a link of rate R and
  round-trip time T needs ``R * T`` bytes in flight (the bandwidth-delay product: 100 Mbit/s x
  300 ms = 3.75 MB). Linux grows a socket's buffers on its own up to ``tcp_rmem``/``tcp_wmem``'s
  maximum, and a buffer set by hand (``SO_SNDBUF``/``SO_RCVBUF``) switches that growth off and is
  capped at ``net.core.rmem_max``/``wmem_max``: :func:`buffer_bytes` asks for a size only where the
  product exceeds what the kernel would grow to by itself and the cap lets a hand-set buffer
  go further; elsewhere it leaves autotuning alone (a fixed smaller buffer would be slower).
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Optional

# struct tcp_info (linux/tcp.h) up to tcpi_delivery_rate: the fields read here and their offsets
_TCP_INFO_BYTES = 168
_RTT_AT, _RTTVAR_AT, _CWND_AT, _MIN_RTT_AT = 68, 72, 80, 148  # u32, microseconds / segments
_TOTAL_RETRANS_AT, _BYTES_ACKED_AT, _DELIVERY_RATE_AT = 100, 120, 160  # u32, u64, u64 (bytes/s)
EWMA = 0.3  # weight of a new sample in a groupmate's estimate
BUFFER_SLACK = 2.0  # a buffer holds this many BDPs: the kernel counts its bookkeeping in it too


@dataclass(frozen=True)
class TcpInfo:
    """What the kernel measured on one TCP connection."""

    rtt_s: float  # smoothed round-trip time
    rttvar_s: float
    min_rtt_s: float  # the smallest seen: the path's own delay, without queues
    cwnd: int  # congestion window, segments
    total_retrans: int  # segments sent again (losses)
    bytes_acked: int
    delivery_rate_bps: float  # the kernel's last estimate of what the connection delivered (bits/s)


def tcp_info(sock: socket.socket) -> Optional[TcpInfo]:
    """The kernel's ``TCP_INFO`` of a connected TCP socket; None where unavailable (not Linux, closed)."""
    level = getattr(socket, "TCP_INFO", None)
    if level is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, level, _TCP_INFO_BYTES)
    except OSError:
        return None
    return parse_tcp_info(raw)


def parse_tcp_info(raw: bytes) -> Optional[TcpInfo]:
    """``struct tcp_info`` bytes -> ``TcpInfo`` (None if too short: an old kernel)."""
    if len(raw) < _TCP_INFO_BYTES:
        return None
    u32 = lambda at: struct.unpack_from("<I", raw, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", raw, at)[0]  # noqa: E731
    min_rtt = u32(_MIN_RTT_AT)
    return TcpInfo(rtt_s=u32(_RTT_AT) / 1e6, rttvar_s=u32(_RTTVAR_AT) / 1e6,
                   min_rtt_s=(min_rtt if min_rtt != 0xFFFFFFFF else u32(_RTT_AT)) / 1e6,
                   cwnd=u32(_CWND_AT), total_retrans=u32(_TOTAL_RETRANS_AT), bytes_acked=u64(_BYTES_ACKED_AT),
                   delivery_rate_bps=8.0 * u64(_DELIVERY_RATE_AT))


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


def bdp_bytes(rate_mbit: float, rtt_s: float) -> int:
    """The bandwidth-delay product: bytes a link of that rate and round trip holds in flight."""
    return int(rate_mbit * 1e6 / 8 * max(0.0, rtt_s))


def buffer_bytes(rate_mbit: float, rtt_s: float, autotune_max: int, core_max: int) -> Optional[int]:
    """The ``SO_SNDBUF``/``SO_RCVBUF`` to set for such a link, or None: leave the kernel's
    autotuning (which grows a buffer up to ``autotune_max``) alone. A hand-set size is capped by
    ``core_max`` and switches autotuning off, so it pays only where the link needs more than
    autotuning reaches and the cap allows more than that (see the module docstring)."""
    want = int(BUFFER_SLACK * bdp_bytes(rate_mbit, rtt_s))
    if want <= autotune_max or core_max <= autotune_max:
        return None
    return min(want, core_max)


def _sysctl(name: str) -> Optional[list[int]]:
    try:
        return [int(x) for x in Path("/proc/sys", *name.split(".")).read_text().split()]
    except (OSError, ValueError):
        return None


def kernel_buffer_limits() -> dict[str, int]:
    """This network namespace's TCP buffer limits: autotuning maxima and hand-set caps (bytes;
    0 where unreadable), for :func:`buffer_bytes`."""
    rmem, wmem = _sysctl("net.ipv4.tcp_rmem"), _sysctl("net.ipv4.tcp_wmem")
    rmax, wmax = _sysctl("net.core.rmem_max"), _sysctl("net.core.wmem_max")
    return {"rcv_autotune_max": rmem[2] if rmem and len(rmem) == 3 else 0,
            "snd_autotune_max": wmem[2] if wmem and len(wmem) == 3 else 0,
            "rcv_core_max": rmax[0] if rmax else 0, "snd_core_max": wmax[0] if wmax else 0}


def slow_start_after_idle() -> Optional[bool]:
    """``net.ipv4.tcp_slow_start_after_idle``: whether a connection idle for a retransmission
    timeout starts again from the initial window (so each round of a kept-open connection pays the
    slow start again; 0 keeps the window it had). None where unreadable."""
    value = _sysctl("net.ipv4.tcp_slow_start_after_idle")
    return None if not value else bool(value[0])


def size_buffers(sock: socket.socket, rate_mbit: float, rtt_s: float, limits: Optional[dict] = None) -> dict:
    """Set ``sock``'s buffers for a link of ``rate_mbit`` and ``rtt_s`` where that helps
    (:func:`buffer_bytes`); returns what was set (``{"snd": n, "rcv": n}``, empty: autotuning)."""
    limits = kernel_buffer_limits() if limits is None else limits
    done = {}
    for name, opt, auto, cap in (("snd", socket.SO_SNDBUF, "snd_autotune_max", "snd_core_max"),
                                 ("rcv", socket.SO_RCVBUF, "rcv_autotune_max", "rcv_core_max")):
        size = buffer_bytes(rate_mbit, rtt_s, limits.get(auto, 0), limits.get(cap, 0))
        if size is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                done[name] = size
            except OSError:
                pass
    return done
