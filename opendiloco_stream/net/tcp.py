"""What the kernel knows and decides about a TCP connection at a distance: its measured round-trip
time (``TCP_INFO``), the buffers a link's bandwidth-delay product needs, the settings that decide
whether a kept-open connection starts each round from its initial window, and a round-trip probe
(a TCP handshake's time) for ``doctor`` and ``--dry-run``.

*Buffers.* A TCP connection moves at most one window per round trip, so a link of rate R and
round-trip time T needs ``R * T`` bytes in flight (the bandwidth-delay product: 100 Mbit/s x
300 ms = 3.75 MB). Linux grows a socket's buffers on its own up to ``tcp_rmem``/``tcp_wmem``'s
maximum, and a buffer set by hand (``SO_SNDBUF``/``SO_RCVBUF``) switches that growth off and is
capped at ``net.core.rmem_max``/``wmem_max``: :func:`buffer_bytes` asks for a size only where the
product exceeds what the kernel would grow to by itself and the cap lets a hand-set buffer go
further; elsewhere it leaves autotuning alone (a fixed smaller buffer would be slower).
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# struct tcp_info (linux/tcp.h) up to tcpi_delivery_rate: the fields read here and their offsets
_TCP_INFO_BYTES = 168
_RTT_AT, _RTTVAR_AT, _CWND_AT, _MIN_RTT_AT = 68, 72, 80, 148  # u32, microseconds / segments
_TOTAL_RETRANS_AT, _BYTES_ACKED_AT, _DELIVERY_RATE_AT = 100, 120, 160  # u32, u64, u64 (bytes/s)
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


def _sysctl_words(name: str) -> Optional[list[str]]:
    """A sysctl's value as its words (None where unreadable)."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().split()
    except OSError:
        return None


def _sysctl(name: str) -> Optional[list[int]]:
    try:
        words = _sysctl_words(name)
        return None if words is None else [int(x) for x in words]
    except ValueError:
        return None


def kernel_buffer_limits() -> dict[str, int]:
    """This network namespace's TCP buffer limits: autotuning maxima and hand-set caps (bytes;
    0 where unreadable), for :func:`buffer_bytes`."""
    rmem, wmem = _sysctl("net.ipv4.tcp_rmem"), _sysctl("net.ipv4.tcp_wmem")
    rmax, wmax = _sysctl("net.core.rmem_max"), _sysctl("net.core.wmem_max")
    return {"rcv_autotune_max": rmem[2] if rmem and len(rmem) == 3 else 0,
            "snd_autotune_max": wmem[2] if wmem and len(wmem) == 3 else 0,
            "rcv_core_max": rmax[0] if rmax else 0, "snd_core_max": wmax[0] if wmax else 0}


# Congestion controls with their own model of the path (a ``cong_control`` hook, as BBR's): the
# kernel never restarts their window after idle, whatever net.ipv4.tcp_slow_start_after_idle says
# (include/net/tcp.h, tcp_slow_start_after_idle_check; Linux >= 4.9).
NO_IDLE_RESTART = ("bbr",)


def congestion_control() -> Optional[str]:
    """``net.ipv4.tcp_congestion_control``: the congestion control new connections of this network
    namespace use (None where unreadable)."""
    words = _sysctl_words("net.ipv4.tcp_congestion_control")
    return words[0] if words else None


def slow_start_after_idle() -> Optional[bool]:
    """Whether a connection idle for a retransmission timeout starts again from the initial window,
    so that each round of a kept-open connection pays the slow start again:
    ``net.ipv4.tcp_slow_start_after_idle`` = 1 and a congestion control that does not skip that
    restart (:data:`NO_IDLE_RESTART`; BBR is the default of some kernels). None where unreadable."""
    value = _sysctl("net.ipv4.tcp_slow_start_after_idle")
    if not value:
        return None
    return bool(value[0]) and congestion_control() not in NO_IDLE_RESTART


def allowed_congestion_controls() -> tuple[str, ...]:
    """``net.ipv4.tcp_allowed_congestion_control``: the congestion controls any process may choose
    for its own sockets (``TCP_CONGESTION``); others need ``CAP_NET_ADMIN``."""
    return tuple(_sysctl_words("net.ipv4.tcp_allowed_congestion_control") or ())


def keep_window(sock: socket.socket) -> Optional[str]:
    """A kept-open connection's fix without root: where this namespace's connections restart from
    the initial window after idle (:func:`slow_start_after_idle`), switch ``sock`` to a congestion
    control that never does (:data:`NO_IDLE_RESTART`) if any process may choose it here
    (:func:`allowed_congestion_controls`). Returns the one set, None where nothing was needed or allowed."""
    if not slow_start_after_idle():
        return None
    for name in NO_IDLE_RESTART:
        if name in allowed_congestion_controls():
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
                return name
            except OSError:
                continue
    return None


def restarts_after_idle() -> Optional[bool]:
    """Whether this peer's kept-open connections will restart from the initial window after each
    idle gap: :func:`slow_start_after_idle`, unless :func:`keep_window` can switch them to a
    congestion control that does not (what ``doctor``, ``--dry-run`` and the peer's notice ask)."""
    slow = slow_start_after_idle()
    if not slow:
        return slow
    return not any(name in allowed_congestion_controls() for name in NO_IDLE_RESTART)


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


def probe_rtt(host: str, port: int, samples: int = 5, timeout: float = 5.0) -> Optional[float]:
    """The median time of ``samples`` TCP handshakes with ``host:port`` (one round trip each, plus
    the far end's accept; closed at once), in seconds; None if none completed within ``timeout``.
    The first handshake that fails ends the probe (a closed or filtered port fails them all)."""
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout):
                times.append(time.perf_counter() - t0)
        except OSError:
            break
    return statistics.median(times) if times else None
