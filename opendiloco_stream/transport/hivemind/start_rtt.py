"""The round-trip time to the swarm's peers before this peer's rounds measured its groupmates'.

``prematch_steps = "auto"`` sizes how far ahead groups form from the worst groupmate RTT
(``SwarmView.groupmate_rtt_s``), which the rounds measure (``link.py``); without an earlier figure
a peer's first round of each fragment at a distance would form its group at the round, paying
about four round trips of matchmaking. :class:`StartRtt` fills that gap: from the transport's
start it DHT-pings the peers in the DHT's routing table (``net/ping.py``: the initial peers and
the run's DHT servers met so far), again after 1, 2, 4 ... 30 s (so a peer that comes later is
measured before the rounds with it), and once more when the transport is prepared for its first
rounds (:meth:`probe_now`: a peer met since the last probe counts for them), until the rounds
measure groupmates (``measured()``); the transport answers with that figure until then. Its worst peer (the bootstrap counts too: each
round's matchmaking reads and writes the DHT) is what it reports.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

REFRESH_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # waits between probes; the last repeats


class StartRtt:
    """Probes ``probe()`` (``{peer: RTT s}``) in a thread of its own, on the schedule of the
    module docstring, until ``measured()`` is true or :meth:`close`; :meth:`rtt_s` answers at once
    with the worst RTT of the latest probe of every peer (None before one answered)."""

    def __init__(self, probe: Callable[[], dict[str, float]], measured: Callable[[], bool],
                 refresh_s: tuple[float, ...] = REFRESH_S):
        self.probe, self.measured, self.refresh_s = probe, measured, refresh_s
        self._rtts: dict[str, float] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # probe now (probe_now), not at the next time of the schedule
        self._counts = threading.Condition()
        self._started = self._done = 0  # probes started, probes finished (answered or not)
        self._thread = threading.Thread(target=self._run, name="ods-start-rtt", daemon=True)
        self._thread.start()

    def rtt_s(self) -> Optional[float]:
        rtts = dict(self._rtts)
        return max(rtts.values()) if rtts else None

    def peers(self) -> dict[str, float]:
        """The latest RTT (s) probed to each peer."""
        return dict(self._rtts)

    def wait_first(self, timeout: float) -> Optional[float]:
        """Wait up to ``timeout`` s for the first probe; :meth:`rtt_s` then."""
        self._wait_done(1, timeout)
        return self.rtt_s()

    def probe_now(self, timeout: float) -> Optional[float]:
        """Probe again at once (every peer of the routing table now, met since the last probe or
        not) and wait up to ``timeout`` s for that probe; :meth:`rtt_s` then (at once when the
        probing has ended: the rounds measure)."""
        if not self._thread.is_alive():
            return self.rtt_s()
        with self._counts:
            wanted = self._started + 1
            self._wake.set()
        self._wait_done(wanted, timeout)
        return self.rtt_s()

    def _wait_done(self, probes: int, timeout: float) -> None:
        """Wait up to ``timeout`` s until ``probes`` probes finished (or the probing stopped)."""
        with self._counts:
            self._counts.wait_for(lambda: self._done >= probes or self._stop.is_set(), timeout)

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the probing to end (the rounds measured, or closed); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            with self._counts:
                self._started += 1
                self._wake.clear()
            try:
                self._rtts.update(self.probe())
            except Exception as e:  # a probe is a hint: the rounds measure anyway
                logger.debug("start RTT probe failed: %r", e)
            with self._counts:
                self._done += 1
                self._counts.notify_all()
            self._wake.wait(self.refresh_s[min(i, len(self.refresh_s) - 1)])
            if self._stop.is_set() or self.measured():
                return
            i += 1

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._counts:
            self._counts.notify_all()
