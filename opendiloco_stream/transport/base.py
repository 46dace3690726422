"""The Transport protocol: how the algorithm talks to "the group" without knowing about networks.

The algorithm (``opendiloco_stream.algorithm``) hands a transport one flat fp32 tensor per
(fragment, round) and gets back a handle. The transport quantizes what goes on the wire with the
configured codec, reduces in fp32 and returns the *dequantized bytes of the quantized average*, so
every member of a group holds bit-identical results.

Contract (docs/architecture.md, "The transport contract"):

* ``all_reduce(key, tensor, weight)`` returns immediately with a :class:`SyncHandle`; the work runs
  in the background (a thread, an event loop, ...).
* Groups form only among peers calling with the same ``key`` (and, for networked transports, the
  same run id). ``key = (fragment, round)``; data-parallel uses ``(fragment, inner_step)``.
* ``handle.wait(timeout)`` returns a :class:`SyncResult` or raises :class:`SyncFailed`; it never
  blocks longer than ``timeout`` (``None`` means the transport's own bound, never "forever").
* A partial reduction (some part of the tensor not averaged) is a failure, never a success.
* ``SyncResult.sent`` is ``deQ(Q(tensor))`` exactly as this peer put it on the wire: the eager
  estimate and error feedback are computed against it.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Protocol

import torch

from opendiloco_stream.compression.codecs import Codec
from opendiloco_stream.transport.failure import FailureReason


@dataclass(frozen=True)
class OuterDigest:
    """A member's fingerprint of the fragment's theta_bar as it stood after the last round of that
    fragment it consumed (``round``): equal digests of the same round, bit-identical theta_bar.
    ``steps``: the member's inner steps when it told it (the repair's tie break,
    ``algorithm/repair.py``). Carried in the round's member metadata, so that after the round
    every member knows every groupmate's."""

    digest: str  # BLAKE2b-8 of theta_bar's fp32 bytes, hex
    steps: int
    #: the last round of the fragment consumed before theta_bar was hashed (-1: none yet); None:
    #: not told (a member of an older release, which sends [digest, steps]): it neither votes nor
    #: is judged
    round: Optional[int] = -1

    def to_wire(self) -> list:
        return [self.digest, int(self.steps), self.round]

    @classmethod
    def from_wire(cls, value: Any) -> Optional["OuterDigest"]:
        """The digest a groupmate sent, or None where it sent none (or garbage); an older release's
        [digest, steps] comes with ``round`` None."""
        if not (isinstance(value, (list, tuple)) and len(value) in (2, 3) and isinstance(value[0], str)
                and _is_int(value[1])):
            return None
        if len(value) == 2:
            return cls(value[0], value[1], None)
        return cls(value[0], value[1], value[2]) if _is_int(value[2]) else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class FetchedFragment:
    """One fragment's outer state as a groupmate served it (``StateSource.fetch_fragment``):
    the state its provider returned and the bytes that crossed the wire for it."""

    state: dict
    received_bytes: int = 0


class SyncFailed(RuntimeError):
    """A round did not produce a complete, validated average (timeout, partial, lost peer...)."""

    def __init__(self, message: str, *, key: Hashable = None, reason: str = FailureReason.FAILED):
        super().__init__(message)
        self.key = key
        #: short machine-readable cause (``failure.FailureReason``; a plain string is read as its value)
        self.reason = FailureReason(reason)


@dataclass
class SyncResult:
    """The outcome of one all-reduce, as seen by one peer."""

    #: flat fp32 average, deQ of the bytes every member received (bit-identical across the group)
    average: torch.Tensor
    #: number of peers whose contribution entered the average (this peer included if it did)
    group_size: int
    #: this peer's share of the total weight (1 / group_size with equal weights)
    weight_share: float
    #: deQ(Q(tensor)) of what this peer sent, fp32, same shape as ``average``; for a lossless
    #: codec (fp32) it may be a flat view of the tensor given to ``all_reduce`` itself (no copy)
    sent: torch.Tensor
    #: bytes this peer put on / took off the wire for this round
    bytes_sent: int = 0
    bytes_received: int = 0
    #: identifiers of the peers in the group (rank strings locally, peer ids over hivemind)
    peers: list[str] = field(default_factory=list)
    #: whether this peer's own contribution is part of ``average``
    included_self: bool = True
    #: contributions dropped by validation (non-finite, wrong size, norm out of bound)
    rejected: int = 0
    #: the group size the round waited for (the live peers counted for it); None: not known
    expected_size: Optional[int] = None
    #: seconds per phase of the round, where the transport measures them (hivemind: prepare,
    #: matchmaking, contributions, verdicts, reduce, results, drain, finish); empty otherwise
    phases: dict = field(default_factory=dict)
    #: per groupmate, what this round measured of the link to it (hivemind's direct path:
    #: ``{"rtt_ms": ..., "rate_mbit": ..., "reused": ...}``, ``link.py``); empty where not measured
    links: dict = field(default_factory=dict)
    #: per group member (peer id as ``Transport.peer_id`` spells it), the digest of theta_bar it
    #: launched the round with (:class:`OuterDigest`); empty where the transport does not carry them
    digests: dict = field(default_factory=dict)


class SyncHandle(abc.ABC):
    """A pending all-reduce. Transports' handles and test doubles subclass it: the defaults of
    ``settle``, ``takes_newcomers`` and ``abandon`` are those of a transport without matchmaking."""

    #: the round's key, ``(fragment, round)``
    key: Hashable = None

    @abc.abstractmethod
    def done(self) -> bool:
        """True once ``wait`` would return (or raise) without blocking."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        """Block until the result is there, at most ``timeout`` seconds; raise SyncFailed."""

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the round's outcome without taking it; True once
        ``done()``. Transports with an event to wait on override this polling default."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.005, left))
        return True

    def takes_newcomers(self) -> bool:
        """Whether a peer that was not counted in this round can still be in its group: the round
        is queued, or matching with no count of peers to wait for (a cold start's first round,
        which waits its whole window for whoever comes) long enough for a newcomer to reach it.
        Transports without matchmaking: False."""
        return False

    def abandon(self) -> bool:
        """Give the round up if it is still waiting for its group (queued, or in matchmaking): it
        then fails at once with reason "matchmaking" instead of waiting out its window. A peer that
        catches up calls this for a round the swarm has moved past. Returns True if the round is
        over or now fails at once; False for a round already exchanging data (never stopped) and
        for a transport without matchmaking."""
        return False


class AllReduce(Protocol):
    """The all-reduce itself: what every transport offers and every algorithm needs."""

    #: a printable identifier of this peer
    peer_id: str

    @abc.abstractmethod
    def all_reduce(self, key: tuple[int, int], tensor: torch.Tensor, weight: float = 1.0,
                   digest: Optional[OuterDigest] = None) -> SyncHandle:
        """Start averaging ``tensor`` (flat, fp32) with the peers that use the same ``key``.

        ``weight`` is this peer's weight in the average (tokens processed in the round, or 1.0).
        ``digest``: this peer's theta_bar fingerprint, told to the group with the round's metadata
        (``SyncResult.digests``); None: none told. The caller must not modify ``tensor``
        afterwards; the transport may keep a reference.
        """

    def prepare(self, numels: dict[int, int]) -> None:
        """Declare up front the flat size of every fragment this peer will reduce.

        Called once by StreamingDiLoCo before the first ``all_reduce``. Networked transports build
        their per-fragment state here (the hivemind transport: one endpoint per fragment).
        """

    def wire_codec(self) -> Optional[Codec]:
        """The codec this transport encodes contributions with, or None where it has none to tell:
        a peer whose outer gradients live on a GPU encodes them there first with it
        (``algorithm/staging.py``), so that only the encoded bytes cross to the host."""
        return None

    def close(self) -> None:
        """Release background resources; pending handles fail with reason "closed"."""


class SwarmView(Protocol):
    """What this peer sees of the other peers' rounds: lateness, launches, expected rounds, groups
    formed ahead. The defaults are a transport without a view of the swarm (in-process, a test
    double): nothing is late, nothing launched, announcements go nowhere."""

    #: whether ``round_late`` sees the other peers' rounds (a networked transport with a live view
    #: of the swarm); a wait for a round then gives it up once the swarm has moved past it
    watches_swarm: bool = False

    def round_late(self, key: tuple[int, int]) -> bool:
        """Whether the other peers launched round ``key`` long enough ago that this peer, not yet at
        that round's sync step, would miss its group: the algorithm then syncs at once (catch-up).
        Must answer at once (it is asked every inner step); transports without a view of the
        swarm say False."""
        return False

    def rounds_launched(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Of these rounds, those other peers launched already (a joiner's check that the state it
        downloaded is still current: one of its next rounds gone without it would leave its outer
        parameters a step apart from the swarm's for good). May block briefly; transports without
        a view of the swarm say none."""
        return []

    def expect_rounds(self, keys: list[tuple[int, int]], since: Optional[float] = None) -> None:
        """This peer is loading a running swarm's state and takes part in these rounds (its next
        round of every fragment): a networked transport announces it now, so the others wait for it.
        ``since``: when its donor reserved them for it (``reserve_rounds``), if it did: the rounds
        launched after that waited for it."""

    def reserve_rounds(self, keys: list[tuple[int, int]]) -> Optional[float]:
        """Called by the state provider, in its thread, with its state's lock held: the joiner
        it serves takes part in these rounds (the next ones after the state; with the
        initial-model marker, the first ones, which may be forming already). A networked
        transport announces the joiner there now, before this peer trains on and launches them,
        so that they wait for it; it returns the time it did (carried to the joiner in the state:
        ``expect_rounds``'s ``since``). None: nothing reserved."""
        return None

    def groupmate_rtt_s(self) -> Optional[float]:
        """The largest round-trip time (s) to this peer's groupmates as the transport measured it in
        its rounds (what ``prematch_steps = "auto"`` sizes the lead from), or before its first
        rounds its own probe of the swarm's peers; None while nothing is measured. Must answer at
        once. Transports without a network say None."""
        return None

    def prematch(self, key: tuple[int, int], weight: float = 1.0, lead_s: float = 0.0,
                 digest: Optional[OuterDigest] = None) -> None:
        """Round ``key`` comes soon, in about ``lead_s`` seconds: a transport with matchmaking may
        form its group now, so that ``all_reduce(key, ...)`` starts exchanging at once. ``weight``
        is the weight predicted for the round; such a transport uses it instead of the round's own
        (and ``digest``, the theta_bar fingerprint known now, or None, instead of the round's).
        The caller must launch ``key`` next on that fragment: a group formed ahead and never used
        fails that round for its other members. Transports without matchmaking ignore it."""


class StateSource(Protocol):
    """The run's state between peers: what this peer hands a late joiner, and the download of it."""

    def set_state_provider(self, provider: Callable[[], dict[str, Any]]) -> None:
        """Register a callable that returns the state a late joiner downloads from this peer."""

    def load_state_from_peers(self, timeout: float, progress: Optional[Callable[[dict[str, Any]], None]] = None,
                              since: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        """Download the run's state from peers already in it; ``None`` if there are none.
        ``progress(record)``, if given, hears how far a download is (bytes, total, rate).
        ``since``: a state this peer loaded before (stale now): a transport may fetch only what changed."""
        return None

    def set_fragment_provider(self, provider: Callable[[int, int], dict[str, Any]]) -> None:
        """Register ``provider(fragment, round)``: one fragment's outer state (theta_bar, outer
        optimizer state, the last round it consumed), once that round is consumed or after a short
        bounded wait, for a groupmate repairing its copy (``algorithm/repair.py``)."""

    def fetch_fragment(self, peer: str, fragment: int, round_index: int, timeout: float,
                       since: Optional[dict[str, Any]] = None) -> Optional[FetchedFragment]:
        """Fragment ``fragment``'s outer state after round ``round_index`` from groupmate ``peer``
        (a ``SyncResult.digests`` key), or None if it did not deliver within ``timeout``.
        ``since``: this peer's own copy of that state: a transport may fetch only the tensors that differ."""
        return None


class Transport(AllReduce, SwarmView, StateSource, Protocol):
    """One peer's view of the group: the all-reduce, the swarm's view and the state source.

    Transports (``LocalTransport``, ``HivemindTransport``) and test doubles subclass it and inherit
    the defaults of the parts they do not offer; a class that implements every method itself
    satisfies it structurally. The algorithm calls every method directly, never probing for one.
    """

    peer_id: str = "?"
