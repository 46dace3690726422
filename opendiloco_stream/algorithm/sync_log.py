"""Per-sync metrics records and counters, shared by every wrapper (streaming and data-parallel)."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Optional

from opendiloco_stream.stats import SyncStats
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult


class SyncLog:
    """Counts syncs in a :class:`SyncStats` and emits one ``{"event": "sync"}`` record per round."""

    def __init__(self, on_event: Optional[Callable[[dict[str, Any]], None]] = None, record_digests: bool = False):
        self.on_event = on_event
        self.record_digests = record_digests
        self.stats = SyncStats()
        self.events: list[dict[str, Any]] = []
        self._messages: dict[Any, str] = {}  # round key -> why it failed, until its record is emitted

    def wait(self, handle: SyncHandle, timeout: float) -> tuple[Optional[SyncResult], Optional[str], float]:
        """(result or None, failure reason or None, seconds waited); a failed round is not an error."""
        start = time.perf_counter()
        try:
            result, reason = handle.wait(timeout=timeout), None
        except SyncFailed as e:
            result, reason = None, e.reason
            self._messages[getattr(handle, "key", None)] = str(e)
        waited = time.perf_counter() - start
        self.stats.wait_s += waited
        return result, reason, waited

    def record(self, p: int, k: int, step: int, result: Optional[SyncResult], reason: Optional[str],
               waited: float, estimate: Optional[str], extra: Optional[dict[str, Any]] = None) -> None:
        """Count one consumed round of fragment ``p`` and emit its sync record (``extra``: the
        rule's fields, e.g. ``land_steps``)."""
        s = self.stats
        s.syncs += 1
        rec: dict[str, Any] = {"event": "sync", "fragment": p, "round": k, "step": step,
                               "ok": result is not None, "wait_s": round(waited, 6)}
        if result is not None:
            rec.update(group_size=result.group_size, bytes_sent=result.bytes_sent,
                       bytes_received=result.bytes_received, weight_share=round(result.weight_share, 6),
                       included_self=result.included_self, rejected=result.rejected)
            if result.expected_size is not None:
                rec["expected_size"] = result.expected_size
            s.bytes_sent += result.bytes_sent
            s.bytes_received += result.bytes_received
            s.peak_bytes_per_sync = max(s.peak_bytes_per_sync, result.bytes_sent)
            s.rejected += result.rejected
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

    def emit(self, rec: dict[str, Any]) -> None:
        self.events.append(rec)
        if self.on_event is not None:
            self.on_event(rec)


class HasSyncLog:
    """``stats`` and ``events`` of a wrapper that keeps its SyncLog in ``self.log``."""

    log: SyncLog

    @property
    def stats(self) -> SyncStats:
        return self.log.stats

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.log.events
