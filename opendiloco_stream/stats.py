"""One typed record of a worker's synchronization counters.

``StreamingDiLoCo.stats`` (and ``DataParallel.stats``) is a ``SyncStats``. Everything that reports
sync counters builds on this one record:

- the run summary (``train/loop.py: summarize``) merges the workers' records (:meth:`SyncStats.total`)
  and writes :meth:`summary_fields`;
- the multi-peer combine (``commands/local_hivemind.py: combine``) reads each peer's summary back
  with :meth:`SyncStats.from_record` and merges them the same way;
- the live monitor (``net/metrics.py: live_values``) publishes a peer's record under the DHT
  schema's names.

To add a counter: add a field here (``merge`` sums it, or keeps the larger value for a ``peak_``
name), count it where syncs are counted (``algorithm/sync_log.py``), and it appears in every
summary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Union


@dataclass
class SyncStats:
    """Counters of one worker's syncs (or, after ``merge``, of several workers')."""

    bytes_sent: int = 0
    bytes_received: int = 0
    peak_bytes_per_sync: int = 0
    syncs: int = 0
    failed_syncs: int = 0
    local_only_steps: int = 0
    wait_s: float = 0.0
    rejected: int = 0
    caught_up_steps: int = 0  # inner steps skipped to catch up with the swarm (a slower peer)
    alone_syncs: int = 0  # rounds that averaged with no other peer (failed, or a group of one)
    current_alone_streak: int = 0  # such rounds in a row, up to the last one (merged: the largest)
    land_steps: int = 0  # inner steps from launch to landing, summed over the rounds that produced an average
    peak_land_steps: int = 0  # the longest of them
    # exchanges with groupmates by how they went (hivemind: one per reducer a peer sent to, per round):
    direct_exchanges: int = 0  # to a groupmate's data port
    punched_exchanges: int = 0  # over a hole-punched connection (transport/hivemind/punch.py)
    relayed_exchanges: int = 0  # through the p2p daemon, one side reached through a circuit relay
    p2p_exchanges: int = 0  # through the p2p daemon otherwise
    repairs: int = 0  # fragments whose drifted theta_bar was replaced by the group's (algorithm/repair.py)
    failed_repairs: int = 0  # repairs that got no state of the right round (retried at the next round)
    peak_rtt_ms: float = 0.0  # the largest round-trip time a round measured to a groupmate (0: none measured)

    def merge(self, other: "SyncStats") -> "SyncStats":
        """Counters of both workers: sums, except peaks and current values, which take the larger one."""
        out = SyncStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name.startswith(("peak_", "current_")) else a + b)
        return out

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "SyncStats":
        """The counters of a record (unknown keys are ignored, missing ones are zero)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    @classmethod
    def of(cls, stats: Union["SyncStats", dict[str, Any]]) -> "SyncStats":
        """A copy of ``stats``, given as a record or as a dict of counters."""
        return cls.from_record(stats if isinstance(stats, dict) else stats.to_record())

    @classmethod
    def total(cls, items: Iterable["SyncStats"]) -> "SyncStats":
        """All workers' counters merged (zeros for none)."""
        out = cls()
        for item in items:
            out = out.merge(item)
        return out

    @property
    def ok_syncs(self) -> int:
        """Rounds that produced an average."""
        return self.syncs - self.failed_syncs

    @property
    def mean_land_steps(self) -> float:
        """Inner steps a round took from its launch to landing, on average (how stale an eager
        update is: 1 on an instant link; at most H, where the fragment's next sync waits for it)."""
        return self.land_steps / self.ok_syncs if self.ok_syncs > 0 else float("nan")

    def count_exchanges(self, paths: dict[str, int]) -> None:
        """Add one round's exchanges by path (``direct``, ``punched``, ``relayed``, ``p2p``)."""
        self.direct_exchanges += paths.get("direct", 0)
        self.punched_exchanges += paths.get("punched", 0)
        self.relayed_exchanges += paths.get("relayed", 0)
        self.p2p_exchanges += paths.get("p2p", 0)

    def summary_fields(self, workers: int) -> dict[str, Any]:
        """The counters as the ``{"event": "summary"}`` record carries them (merged over ``workers``)."""
        return {**self.to_record(), "bytes_sent_per_worker": self.bytes_sent / max(1, workers),
                "mean_land_steps": self.mean_land_steps}
