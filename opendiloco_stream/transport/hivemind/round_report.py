"""What a round reports: its summary (:class:`RoundSummary`, built by the runner) and its phases.

The runner stamps wall-clock marks (``time.time()``, comparable with the host's on one machine) as
its phases end: ``group`` (the round started), ``contributions`` (every contribution to our part
arrived), ``verdicts``, ``reduced``, ``results`` (every part's average arrived), ``end``. The host
adds its own (before the checks and copy, before ``step``, and after its copy of the result) and
turns them into ``SyncResult.phases`` (:func:`round_phases`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from opendiloco_stream.transport.base import SyncResult


@dataclass(frozen=True)
class RoundSummary:
    """A finished round as the runner saw it (``HvAllReduceRunner.run``, returned by
    ``FragmentEndpoint.run_round``); the lane adds its own marks with :meth:`sync_result`."""

    #: the average (a fresh tensor) and what this peer sent (its input itself where ``sent_is_input``)
    average: torch.Tensor
    sent: torch.Tensor
    #: peers whose contribution entered the average (this peer included if it did)
    group_size: int
    #: this peer's share of the accepted weight (0 where its own contribution was not accepted)
    weight_share: float
    included_self: bool
    #: peer ids of the accepted contributions, in group order
    peers: list[str]
    #: contributions dropped by validation / never complete
    rejected: int
    missing: int
    bytes_sent: int
    bytes_received: int
    #: the runner's wall-clock marks (module docstring), ``end`` included
    marks: dict[str, float] = field(default_factory=dict)
    #: what this peer sent is its input tensor itself (lossless codec, no copy)
    sent_is_input: bool = False
    #: per groupmate (peer id), what this round measured of the link to it (``link.py``)
    links: dict[str, dict] = field(default_factory=dict)
    #: per member (peer id), the theta_bar fingerprint its metadata carried (``OuterDigest``)
    digests: dict = field(default_factory=dict)

    def sync_result(self, start: float, step: float, end: float, expected_size: Optional[int]) -> SyncResult:
        """The host's ``SyncResult``: ``start``, ``step`` and ``end`` are the host's marks
        (:func:`round_phases`), ``expected_size`` the group size the round waited for."""
        return SyncResult(
            average=self.average, sent=self.sent, phases=round_phases(start, step, self.marks, end),
            group_size=self.group_size, weight_share=self.weight_share, bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received, peers=self.peers, included_self=self.included_self,
            rejected=self.rejected, expected_size=expected_size, links=self.links, digests=self.digests)


# runner mark -> the phase it ends
_PHASE_ENDS = {"contributions": "contributions", "verdicts": "verdicts", "reduced": "reduce", "results": "results",
               "end": "drain"}


def round_phases(start: float, step: float, marks: dict, end: float) -> dict[str, float]:
    """Seconds spent in each phase of a round (``SyncResult.phases``), from the host's and the
    runner's wall-clock marks. A phase this peer did not run (no part to reduce) is left out.

    prepare: the finite check (and a copy to the CPU, if needed); matchmaking: until the group started its round;
    contributions: until every contribution to our part arrived; verdicts: until the reducers'
    verdicts did; reduce: our part averaged and encoded; results: until every part's average
    arrived; drain: until groupmates finished reading our part's average; finish: until the host
    holds its copy of the result."""
    phases = {"prepare": step - start}
    if "group" not in marks:
        return phases
    phases["matchmaking"] = marks["group"] - step
    last = marks["group"]
    for mark, phase in _PHASE_ENDS.items():  # in the order they end
        if mark in marks:
            phases[phase] = marks[mark] - last
            last = marks[mark]
    phases["finish"] = end - last
    return {k: max(0.0, v) for k, v in phases.items()}
