"""Per-sync metrics records and counters, shared by every wrapper (streaming and data-parallel)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from typing import Any, Callable, Optional

from opendiloco_stream.stats import SyncStats
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult

logger = logging.getLogger(__name__)


GIVE_UP_POLL_S = 0.25  # how often a pending round's wait asks whether the swarm moved past it
ALONE_WARN_AFTER = 3  # rounds in a row without another peer before a run says it trains alone


class SyncLog:
    """Counts syncs in a :class:`SyncStats` and emits one ``{"event": "sync"}`` record per round."""

    def __init__(self, on_event: Optional[Callable[[dict[str, Any]], None]] = None, record_digests: bool = False,
                 keep_consumed: bool = False):
        self.on_event = on_event
        self.record_digests = record_digests
        self.keep_consumed = keep_consumed  # collect ``consumed`` (its owner takes them after each step)
        self.stats = SyncStats()
        self.events: list[dict[str, Any]] = []
        self._messages: dict[Any, str] = {}  # round key -> why it failed, until its record is emitted
        self.consumed: list[tuple[int, int]] = []  # (fragment, round) recorded since the owner took them
        self.alone = AloneWatch(self.emit)

    def wait(self, handle: SyncHandle, timeout: float, give_up: Optional[Callable[[], bool]] = None
             ) -> tuple[Optional[SyncResult], Optional[str], float]:
        """(result or None, failure reason or None, seconds waited); a failed round is not an error.

        ``give_up``, asked every ``GIVE_UP_POLL_S`` while the round is pending, says the round can
        no longer form (the swarm moved past it): the round is then abandoned, and fails at once
        if it has no group yet, rather than waiting out its matchmaking window."""
        start = time.perf_counter()
        if give_up is not None:
            deadline = time.monotonic() + timeout
            while not handle.settle(min(GIVE_UP_POLL_S, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or (give_up() and handle.abandon()):
                    break
        try:
            result, reason = handle.wait(timeout=max(0.0, timeout - (time.perf_counter() - start))), None
        except SyncFailed as e:
            result, reason = None, e.reason
            self._messages[handle.key] = str(e)
        waited = time.perf_counter() - start
        self.stats.wait_s += waited
        return result, reason, waited

    def record(self, p: int, k: int, step: int, result: Optional[SyncResult], reason: Optional[str],
               waited: float, estimate: Optional[str], extra: Optional[dict[str, Any]] = None) -> None:
        """Count one consumed round of fragment ``p`` and emit its sync record (``extra``: the
        rule's fields, e.g. ``land_steps``)."""
        s = self.stats
        s.syncs += 1
        if self.keep_consumed:
            self.consumed.append((p, k))
        rec: dict[str, Any] = {"event": "sync", "fragment": p, "round": k, "step": step,
                               "ok": result is not None, "wait_s": round(waited, 6)}
        if result is not None:
            rec.update(group_size=result.group_size, bytes_sent=result.bytes_sent,
                       bytes_received=result.bytes_received, weight_share=round(result.weight_share, 6),
                       included_self=result.included_self, rejected=result.rejected)
            if result.expected_size is not None:
                rec["expected_size"] = result.expected_size
            if result.phases:  # seconds per phase (matchmaking, exchange...): what a round's time went to
                rec["phases"] = {k: round(v, 4) for k, v in result.phases.items()}
            rtts = {peer: link.get("rtt_ms") for peer, link in (result.links or {}).items() if link.get("rtt_ms")}
            if rtts:  # round-trip time per groupmate, as the round measured it (hivemind's direct path)
                rec["rtt_ms"] = rtts
                s.peak_rtt_ms = max(s.peak_rtt_ms, *rtts.values())
            s.bytes_sent += result.bytes_sent
            s.bytes_received += result.bytes_received
            s.peak_bytes_per_sync = max(s.peak_bytes_per_sync, result.bytes_sent)
            s.rejected += result.rejected
            paths = dict(Counter(v["path"] for v in result.links.values() if v.get("path")))
            if paths:  # how each exchange went (hivemind: direct, punched, relayed, p2p)
                rec["exchanges"] = paths
                s.count_exchanges(paths)
            if self.record_digests:
                rec["digest"] = hashlib.blake2b(result.average.detach().cpu().float().numpy().tobytes(),
                                                digest_size=16).hexdigest()
        else:
            rec.update(group_size=0, reason=reason)
            message = self._messages.pop((p, k), None)
            if message:  # the transport's own words: where the round stood when it failed
                rec["message"] = message[:500]
            s.failed_syncs += 1
        if estimate is not None:
            rec["estimate"] = estimate
        if extra:
            rec.update(extra)
        self.emit(rec)
        if self.alone.after_round(rec):
            s.alone_syncs += 1
        s.current_alone_streak = self.alone.streak

    def emit(self, rec: dict[str, Any]) -> None:
        self.events.append(rec)
        if self.on_event is not None:
            self.on_event(rec)


class AloneWatch:
    """Notices a peer that syncs alone: ``ALONE_WARN_AFTER`` rounds in a row that averaged with no
    other peer (failed for lack of a group, or a group of one). It then warns once on the console
    and in a ``{"event": "warning", "kind": "alone"}`` record, naming the cause, and again (as
    ``"kind": "not_alone"``) when a round averages with others again. ``streak`` is the current
    run of such rounds (published to the monitor)."""

    #: failure reasons that mean "no other peer was there", and what the user reads for them
    CAUSES = {
        "matchmaking": "no other peer of the run reached the same round in its matchmaking window "
                       "(none running, all out of reach, or all clients: a group needs one peer that "
                       "accepts connections; check --initial-peers and `doctor`)",
        "clients": "every peer that reached its rounds is a client (none accepts connections, e.g. all behind "
                   "NAT), so nobody can lead a group or reduce: give one peer a reachable address "
                   "(--announce-maddrs / --public-ip) or all of them a relay (peer --relay, bootstrap --relay)",
        "joining": "this peer sits out its first rounds in a running swarm",
        "timeout": "rounds time out before a group forms (a slow or unreachable swarm)",
        "alone": "a group of one: no other peer of the run joined its rounds",
    }

    def __init__(self, emit: Callable[[dict[str, Any]], None]):
        self.emit = emit
        self.streak = 0
        self.warned = False
        self._causes: dict[str, int] = {}

    def after_round(self, rec: dict[str, Any]) -> bool:
        """Take one sync record; True if that round averaged with no other peer."""
        if rec["ok"] and rec.get("group_size", 0) >= 2:
            if self.warned:
                self.emit({"event": "warning", "kind": "not_alone", "fragment": rec["fragment"],
                           "round": rec["round"], "step": rec["step"],
                           "message": f"averaging with {rec['group_size']} peers again after {self.streak} "
                                      f"rounds alone"})
                logger.warning("averaging with %d peers again after %d rounds alone", rec["group_size"], self.streak)
            self.streak, self.warned, self._causes = 0, False, {}
            return False
        cause = "alone" if rec["ok"] else rec.get("reason") or "failed"
        self.streak += 1
        self._causes[cause] = self._causes.get(cause, 0) + 1
        if self.streak >= ALONE_WARN_AFTER and not self.warned:
            self.warned = True
            top = max(self._causes, key=lambda c: self._causes[c])
            message = (f"this peer has synced alone for {self.streak} rounds in a row: "
                       f"{self.CAUSES.get(top, f'rounds fail ({top})')}; it is training alone, not with a swarm")
            self.emit({"event": "warning", "kind": "alone", "fragment": rec["fragment"], "round": rec["round"],
                       "step": rec["step"], "rounds": self.streak, "cause": top, "message": message})
            logger.warning("%s", message)
        return True


class HasSyncLog:
    """``stats`` and ``events`` of a wrapper that keeps its SyncLog in ``self.log``."""

    log: SyncLog

    @property
    def stats(self) -> SyncStats:
        return self.log.stats

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.log.events
