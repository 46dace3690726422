"""Why a round failed: ``SyncFailed.reason`` (``base.py``), one name per cause.

The values are the strings the metrics records (``reason``), the Prometheus labels, the logs and
the docs show; a ``StrEnum`` compares, formats and serializes as its value, so ``reason ==
"timeout"`` and a JSON record read the same as before the enum.
"""

from __future__ import annotations

from enum import StrEnum


class FailureReason(StrEnum):
    """The cause of a failed round (``SyncFailed.reason``)."""

    #: no result within the round's bound (or a caller's shorter one)
    TIMEOUT = "timeout"
    #: some part of the average did not arrive complete and consistent: never a success
    PARTIAL = "partial"
    #: no group formed in the matchmaking window (or the round was given up before one formed)
    MATCHMAKING = "matchmaking"
    #: only peers that accept no connections (client mode) reached the round: none can reduce a part
    CLIENTS = "clients"
    #: this peer's contribution, or the group, was refused (non-finite values, mismatched peers)
    REJECTED = "rejected"
    #: the transport was closed (or the in-process swarm aborted) before the round ended
    CLOSED = "closed"
    #: a peer's first round in a running swarm: it sits that round out and joins the next one
    JOINING = "joining"
    #: the round was in flight when a checkpoint was taken: it is not resumed (``algorithm/``)
    RESTORED = "restored"
    #: anything else (a bug in the round's code: its message says what)
    FAILED = "failed"
