"""Timeouts of the hivemind transport, derived from the link rate, its round-trip time and the
schedule window.

Every wait of a round has a bound, and the bounds nest (each must fit in the next)::

    request_timeout  <  matchmaking_time  <  allreduce_timeout
    next_chunk_timeout  <  allreduce_timeout
    round_bound = matchmaking_time + request_timeout + allreduce_timeout + BACKSTOP_S + GRACE_S  <=  window_s

- ``request_timeout``: one matchmaking request to a potential leader, or one DHT call.
- ``matchmaking_time``: how long a peer waits for others to join its group before the round
  starts with whoever is there (at once when ``target_group_size`` peers are there).
- ``next_chunk_timeout``: the longest silence tolerated inside a stream (between two chunks, and
  before the first contribution); a sender or reducer silent for longer is dropped.
- ``allreduce_timeout``: the whole exchange once the group is formed.
- ``window_s``: how long the caller can wait for a round (H inner steps under eager, tau under
  overlap); ``handle.wait`` never blocks past ``round_bound``.

Defaults (when a value is not given)::

    transfer_s         = 2 * encoded_bytes * 8 / (link_mbit * 1e6)   # a peer sends and receives ~2x its contribution
    cpu_s              = numel * CPU_S_PER_ELEMENT                   # encode, decode, reduce
    next_chunk_timeout = NEXT_CHUNK_FLOOR_S + SAFETY * (chunk_bytes * 8 * STREAMS / (link_mbit * 1e6) + CHUNK_RTTS * rtt_s)
    allreduce_timeout  = max(2 * next_chunk_timeout,
                             ALLREDUCE_FLOOR_S + SAFETY * (transfer_s + cpu_s + EXCHANGE_RTTS * rtt_s))

and, with ``window_s``, ``allreduce_timeout`` is clipped so that ``round_bound <= window_s`` (a
window too short for the hierarchy is a configuration error).

``rtt_s`` is the largest round-trip time to the groupmates (``link.py``'s ``LinkBook``: measured
in this peer's own rounds; 0 before any). It also raises the two bounds that are always given,
never lowering them: ``request_timeout`` to at least ``REQUEST_RTTS * rtt_s`` (a join request on
a new p2p stream, or a DHT lookup of a hop or two and its store) and ``matchmaking_time`` to at
least ``request_timeout + MATCH_RTTS * rtt_s``, so the hierarchy holds at any distance.
:func:`link_timeouts` is the same with a measured rate in place of ``link_mbit`` where it is slower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

SAFETY = 3.0
NEXT_CHUNK_FLOOR_S = 5.0
ALLREDUCE_FLOOR_S = 10.0
# encode + decode + reduce per element on one CPU core: fp4 costs ~0.35 us on a 2-core VM.
CPU_S_PER_ELEMENT = 5e-7
# A chunk may share the link with this many concurrent streams (one per groupmate).
STREAMS = 8
# slack between the runner's own deadline and the handle's bound (the round's last messages)
BACKSTOP_S = 2.0
# Thread wake-ups between the lane and the service loop, scheduling.
GRACE_S = 1.0
# Sequential round trips (docs/networking.md, "At distance"): one request; what matchmaking adds
# after it; one exchange at most (connect, contributions, verdicts, results, a slow start);
# a silence between two chunks (a retransmission after a loss, a window's worth of waiting).
REQUEST_RTTS = 6
MATCH_RTTS = 4
EXCHANGE_RTTS = 10
CHUNK_RTTS = 4

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundTimeouts:
    """The bounds of one fragment's rounds (seconds)."""

    request: float
    matchmaking: float
    next_chunk: float
    allreduce: float

    @property
    def group_deadline(self) -> float:
        """From the start of a round: a group must be formed by then."""
        return self.matchmaking + self.request

    @property
    def joiner_wait(self) -> float:
        """From the start of a round that counts an expected joiner (a peer still downloading the
        run's state, ``presence.py``): how long its group waits for it. Three quarters of the
        all-reduce bound past the window: the exchange after it still fits in ``round_bound``."""
        return self.matchmaking + 0.75 * self.allreduce

    @property
    def round_bound(self) -> float:
        """From ``all_reduce``: the longest a handle can stay pending."""
        return self.matchmaking + self.request + self.allreduce + BACKSTOP_S + GRACE_S


def derive_timeouts(
    *,
    encoded_bytes: int,
    numel: int,
    chunk_bytes: int,
    link_mbit: float,
    request_timeout: float,
    matchmaking_time: float,
    allreduce_timeout: Optional[float] = None,
    next_chunk_timeout: Optional[float] = None,
    window_s: Optional[float] = None,
    rtt_s: float = 0.0,
) -> RoundTimeouts:
    """Fill in the unset timeouts of one fragment and check the hierarchy; ValueError (one line) if broken."""
    if link_mbit <= 0:
        raise ValueError(f"link_mbit must be positive, got {link_mbit}")
    if not rtt_s >= 0:
        raise ValueError(f"rtt_s must be >= 0, got {rtt_s}")
    for name, value in (("request_timeout", request_timeout), ("matchmaking_time", matchmaking_time),
                        ("allreduce_timeout", allreduce_timeout), ("next_chunk_timeout", next_chunk_timeout),
                        ("window_s", window_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if request_timeout >= matchmaking_time:
        raise ValueError(
            f"request_timeout ({request_timeout}s) must be < matchmaking_time ({matchmaking_time}s), "
            "or matchmaking can deadlock")
    request_timeout = max(request_timeout, REQUEST_RTTS * rtt_s)
    matchmaking_time = max(matchmaking_time, request_timeout + MATCH_RTTS * rtt_s)
    link_bps = link_mbit * 1e6
    if next_chunk_timeout is None:
        next_chunk_timeout = NEXT_CHUNK_FLOOR_S + SAFETY * (chunk_bytes * 8 * STREAMS / link_bps + CHUNK_RTTS * rtt_s)
    estimate = 2 * encoded_bytes * 8 / link_bps + numel * CPU_S_PER_ELEMENT + EXCHANGE_RTTS * rtt_s
    explicit = allreduce_timeout is not None
    if allreduce_timeout is None:
        allreduce_timeout = max(2 * next_chunk_timeout, ALLREDUCE_FLOOR_S + SAFETY * estimate)
    if window_s is not None:
        budget = window_s - matchmaking_time - request_timeout - BACKSTOP_S - GRACE_S
        if explicit and allreduce_timeout > budget:
            raise ValueError(
                f"allreduce_timeout ({allreduce_timeout:.1f}s) does not fit the window ({window_s:.1f}s): "
                f"at most {budget:.1f}s after matchmaking; lower it or lengthen the window (H or tau)")
        if budget <= matchmaking_time:
            raise ValueError(
                f"window_s ({window_s:.1f}s) is too short for a networked round: it must exceed "
                f"{2 * matchmaking_time + request_timeout + BACKSTOP_S + GRACE_S:.1f}s "
                f"(lower matchmaking_time or lengthen the window: H or tau)")
        if allreduce_timeout > budget:
            if budget < estimate:
                logger.warning("the window (%.1fs) leaves %.1fs for an all-reduce that needs ~%.1fs at %.0f Mbit/s "
                               "and %.0f ms RTT: rounds will likely time out", window_s, budget, estimate, link_mbit,
                               rtt_s * 1e3)
            allreduce_timeout = budget
        next_chunk_timeout = min(next_chunk_timeout, 0.5 * allreduce_timeout)
    if allreduce_timeout <= matchmaking_time:
        raise ValueError(f"allreduce_timeout ({allreduce_timeout:.1f}s) must be > matchmaking_time ({matchmaking_time}s)")
    if next_chunk_timeout >= allreduce_timeout:
        raise ValueError(
            f"next_chunk_timeout ({next_chunk_timeout:.1f}s) must be < allreduce_timeout ({allreduce_timeout:.1f}s)")
    return RoundTimeouts(request=request_timeout, matchmaking=matchmaking_time,
                         next_chunk=next_chunk_timeout, allreduce=allreduce_timeout)


def link_timeouts(base: dict, *, link_mbit: float, rtt_s: float, measured_mbit: Optional[float]) -> RoundTimeouts:
    """``derive_timeouts(**base)`` for the link this peer measured to its groupmates: ``rtt_s``,
    and the measured rate where it is below the configured ``link_mbit`` (a measured rate above
    it does not shorten any bound: a round's rate counts its waits too, and the configured rate is
    what the operator promised). ``base``: every other argument of ``derive_timeouts``."""
    rate = link_mbit if measured_mbit is None else min(link_mbit, max(measured_mbit, 1e-3))
    return derive_timeouts(link_mbit=rate, rtt_s=rtt_s, **base)
