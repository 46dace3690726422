"""Repair of a fragment whose theta_bar drifted from its group's (the idea of PCCL's shared-state
sync: compare a hash of the shared state every round, and have the odd ones out download it).

*Why.* theta_bar_p is the same on every peer only as long as every peer applies the same averages
to it. A round that fails for a whole group (timeouts on a lossy link, a reducer lost) makes every
member take its own local-only outer step, and a peer that missed a round its groupmates averaged
steps alone too: from then on each applies the same later averages to a different theta_bar_p,
and the replicas never meet again.

*Detect.* With every round each member tells the group the fingerprint of the latest theta_bar_p
it hashed and the round of p it follows (``OuterDigest.round``, j: theta_bar "after consuming
round j"): :func:`outer_digest`, BLAKE2b-8 of its fp32 bytes (hashed on a worker thread as soon as
a round changed theta_bar, so the launch finds it ready), in the round's member metadata
(``Transport.all_reduce``'s or ``prematch``'s ``digest``). At a launch that is theta_bar as the
round's average will find it; a group formed ahead (``prematch_steps``) while the previous round
is still in flight (eager, overlap) tells the one before that round lands, one round older. After
the round every member reads everyone's (``SyncResult.digests``) and computes the same round
(:func:`voting_round`: the j most members told, a tie to the later) and winner among the digests
of that j (:func:`winning_digest`); a member whose own digest of that j is not the winner is out
of sync for fragment p. A member whose digest follows another j neither votes nor is judged this
time (it is at a later round), nor is one whose digest a repair has replaced since.

*Repair.* It fetches fragment p's theta_bar and outer optimizer state from a groupmate holding the
winning digest, as that groupmate holds them after consuming the same round as the requester has
(the round just checked, which may be a round or two after j: both applied the same averages
since, so the holder's is still the group's; ``Transport.fetch_fragment``: over hivemind, the
joiners' state download scoped to one fragment, moving only the tensors that differ), on a
worker thread, bounded in time; the training thread adopts it at the start of a later step
(:meth:`Repairs.poll`, :func:`adopt`). Rounds go on during the download (eager at a distance:
a round can be shorter than the download), so the groupmate is asked for the state after the
round this peer consumed last, and a state of a round this peer has not consumed yet is kept
until it has, then adopted: what counts is that both hold theta_bar after the same round. A
fetch that fails, or whose state is of a round this peer has passed, is recorded and left to the
fragment's next round's check.

Only rules whose theta_bar steps with group averages alone take part (``SyncRule.shares_outer``):
eager 'paper' and naive-delayed step theta_bar with each peer's own estimate, so theirs differ by
design. A digest of an older release (no round) neither votes nor is judged.
"""

from __future__ import annotations

import concurrent.futures
import enum
import hashlib
import logging
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from opendiloco_stream.algorithm.fragment_state import FragmentState
from opendiloco_stream.algorithm.sync_log import SyncLog
from opendiloco_stream.transport.base import FetchedFragment, OuterDigest, SyncResult, Transport

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 60.0  # bound on one repair's download (and on sync_timeout, if smaller)
SERVE_WAIT_S = 2.0  # how long a groupmate waits to have consumed the round asked for before it serves
RETRY_S = 0.2  # a groupmate that still has not consumed it is asked again after this long
RETRIES = 5  # ... at most this many times, then the repair waits for the fragment's next round
#: the longest a landing of a fragment waits for that fragment's repair under way (``before_landing``)
LANDING_WAIT_S = 10.0


class RepairOutcome(str, enum.Enum):
    """How a repair ended (the ``outcome`` of its ``repair`` record)."""

    REPAIRED = "repaired"  # the groupmate's state was adopted
    FAILED = "failed"  # no state came (groupmate gone, refused, timed out)
    STALE = "stale"  # the state came, but not of the round this peer consumed (either side moved on)


def outer_digest(tensors: Sequence[torch.Tensor], steps: int, round_index: int = -1) -> OuterDigest:
    """theta_bar's fingerprint (:func:`theta_digest`) with the inner step count ``steps``, as it
    stands after consuming round ``round_index`` (-1: none yet)."""
    return OuterDigest(theta_digest(tensors), int(steps), int(round_index))


def theta_digest(tensors: Sequence[torch.Tensor], size: int = 8) -> str:
    """BLAKE2b-8 of theta_bar's fp32 bytes, parameter after parameter (equal digests: bit-identical
    theta_bar); hex. ~5 ms per million parameters on one core of the 2-core test machine, so
    :class:`Repairs` hashes on a worker thread as soon as theta_bar changed, not at the launch.
    ``size``: the digest's bytes (the ``outer_digest`` records use 16)."""
    h = hashlib.blake2b(digest_size=size)
    for t in tensors:
        flat = t.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def voting_round(digests: dict[str, OuterDigest]) -> Optional[int]:
    """The round the group's digests are compared after: the one most members' digests follow (a
    tie: the later round); None if no member told one. Only the members whose digest follows it
    vote and are judged: theta_bar after different rounds differs by design."""
    counts = Counter(d.round for d in digests.values() if d.round is not None)
    if not counts:
        return None
    best = max(counts.values())
    return max(j for j, n in counts.items() if n == best)


def winning_digest(digests: dict[str, OuterDigest]) -> Optional[str]:
    """The group's theta_bar, among the digests that follow the :func:`voting_round`: the digest
    most of those members hold. A tie goes to the digest of the member with the most inner steps
    (the one furthest along, likely the one that averaged the rounds the others missed), and among
    those to the smallest peer id: every member computes the same winner from the same digests.
    None for no digests."""
    j = voting_round(digests)
    digests = {p: d for p, d in digests.items() if d.round is not None and d.round == j}
    counts = Counter(d.digest for d in digests.values())
    if not counts:
        return None
    best = max(counts.values())
    tied = {d for d, n in counts.items() if n == best}
    if len(tied) == 1:
        return next(iter(tied))
    member = min((p for p, d in digests.items() if d.digest in tied), key=lambda p: (-digests[p].steps, p))
    return digests[member].digest


def _served(fetch: "_Fetch") -> tuple[Optional[Any], int]:
    """(The round of the state a finished download brought, its bytes); (None, 0) for none or an error."""
    try:
        fetched, received = fetch.future.result()
    except Exception:
        return None, 0
    return (None if fetched is None else fetched.state.get("round")), received


def _after(s: "Repairable") -> int:
    """The round ``s``'s theta_bar is after (-1: none consumed yet)."""
    return -1 if s.consumed is None else int(s.consumed)


class Repairable(Protocol):
    """What a repair needs of one fragment's sync (``fragment_sync.FragmentSync``)."""

    f: FragmentState
    consumed: Optional[int]  # the last round consumed (landed: averaged or failed)
    launch_digest: Optional[OuterDigest]  # theta_bar's digest at the last launch

    @property
    def reference(self) -> list[torch.Tensor]: ...

    @property
    def in_flight(self) -> bool: ...


def adopt(s: Repairable, theirs: list[torch.Tensor], outer_opt: dict[str, Any]) -> None:
    """theta_bar_p := ``theirs``, outer optimizer state := ``outer_opt``; the local parameters and
    the rule's reference (what the next outer gradient is taken against) move by
    ``theirs - theta_bar_p``, so that everything this peer keeps relative to theta_bar is kept:

    * blocking, overlap, eager 'merge' / 'overlap': the reference is theta_bar itself; the local
      parameters are theta_bar + the inner progress since the last restart or merge, and stay so.
      A merge still to come (a round in flight) uses theta_bar before and after its outer step and
      the outer gradient, all now on the adopted theta_bar: it lands as it would on a peer in sync.
    * eager 'corrected': the reference is ``start`` (theta_bar, or a look-ahead step on top of it
      that the true average replaces when it lands); it moves with theta_bar, so the progress
      since the restart (local - start) and the look-ahead step are kept.

    A round in flight keeps the outer gradient it sent (taken against the old theta_bar, i.e. the
    same progress); its average is applied to the adopted theta_bar."""
    f = s.f
    theirs = [f.to_outer_device(t).to(torch.float32) for t in theirs]
    if len(theirs) != len(f.outer) or any(a.shape != b.shape for a, b in zip(theirs, f.outer)):
        raise ValueError(f"fragment {f.index}: the served theta_bar does not match this model's fragment")
    delta = [t - o for t, o in zip(theirs, f.outer)]
    reference = s.reference
    f.update_local(lambda i, q: q.add_(delta[i]))  # one parameter at a time
    if reference is not f.outer:
        with torch.no_grad():
            for r, d in zip(reference, delta):
                r.add_(d)
    with torch.no_grad():
        for o, t in zip(f.outer, theirs):
            o.copy_(t)
    f.opt.load_state_dict(outer_opt)


@dataclass
class _Fetch:
    """A repair under way: fragment, the round it repairs, the groupmate asked, the download."""

    fragment: int
    round: int
    peer: str
    future: concurrent.futures.Future
    since: dict = field(default_factory=dict)  # what the peer held when it asked (equal tensors do not move)
    started: float = field(default_factory=time.monotonic)
    asked: int = 1  # downloads started (one more each time this peer consumed a round during one)
    received: int = 0  # bytes of the downloads before the last one
    waited: float = 0.0  # seconds the training thread waited for it at landings (``before_landing``)


class Repairs:
    """Detection and repair for every fragment of one peer (see the module docstring).

    Args:
        transport: the peer's (``peer_id``, ``fetch_fragment``).
        log: where ``repair`` records and counters go.
        enabled: ``DiLoCoConfig.repair`` and the rule shares theta_bar: otherwise no digest is
            sent and nothing is checked.
        timeout: bound on one repair's download (seconds).
        now: the inner step counter (a digest carries it for the tie break).
    """

    def __init__(self, transport: Transport, log: SyncLog, enabled: bool, timeout: float, now: Callable[[], int]):
        self.transport, self.log, self.enabled, self.timeout, self.now = transport, log, enabled, timeout, now
        self._fetches: dict[int, _Fetch] = {}
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # theta_bar's digest per fragment, hashed on a thread of its own since theta_bar last changed
        # (a download may take the other one for a minute); theta_bar stays as it is until the
        # training thread takes the digest (``_hash``) or waits for it (``_settle``)
        # (the round theta_bar is after, its hash)
        self._hashes: dict[int, tuple[int, concurrent.futures.Future]] = {}
        # per fragment, the round whose state the last repair adopted and that state's hash: a
        # digest this peer told of an earlier theta_bar is no longer its own (not judged)
        self._adopted: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self._hasher: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._closing = threading.Event()  # close(): a download under way asks no more

    def digest(self, s: Repairable) -> Optional[OuterDigest]:
        """theta_bar's digest to send with a round of ``s`` launched now (None when off)."""
        if not self.enabled:
            return None
        j, job = self._hash(s)
        return OuterDigest(job.result(), int(self.now()), j)

    def changed(self, s: Repairable) -> None:
        """theta_bar of ``s`` has just changed (a round landed, a state was loaded): hash it now on
        the worker, so that the next launch finds its digest ready."""
        if not self.enabled:
            return
        self._settle(s)
        if self._hasher is None:
            self._hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ods-digest")
        self._hashes[s.f.index] = (_after(s), self._hasher.submit(theta_digest, list(s.f.outer)))

    def forget(self, s: Repairable) -> None:
        """theta_bar of ``s`` is about to be overwritten (a checkpoint, a joiner's state): the next
        launch hashes it anew."""
        self._settle(s)
        self._adopted.pop(s.f.index, None)

    def _hash(self, s: Repairable) -> tuple[int, concurrent.futures.Future]:
        """(the round theta_bar is after, the job hashing it) of ``s``'s latest theta_bar."""
        entry = self._hashes.get(s.f.index)
        if entry is None:  # not hashed since it last changed (the first launch)
            job: concurrent.futures.Future = concurrent.futures.Future()
            job.set_result(theta_digest(s.f.outer))
            entry = self._hashes[s.f.index] = (_after(s), job)
        return entry

    def _settle(self, s: Repairable) -> None:
        """Wait for a hash of ``s``'s theta_bar still running: theta_bar is about to change."""
        entry = self._hashes.pop(s.f.index, None)
        if entry is not None:
            concurrent.futures.wait([entry[1]])

    def early_digest(self, s: Repairable) -> Optional[OuterDigest]:
        """The digest for a group formed ahead of ``s``'s next round: that of the latest theta_bar
        hashed, with the round it follows (a round still in flight lands later: the group compares
        the digests after the round most of them consumed, :func:`voting_round`); none while a
        repair is under way (this theta_bar is about to be replaced)."""
        if not self.enabled or s.f.index in self._fetches:
            return None
        return self.digest(s)

    # ------------------------------------------------------------------ detect (training thread)
    def check(self, s: Repairable, k: int, result: Optional[SyncResult]) -> None:
        """Round ``k`` of ``s`` was consumed with ``result``: start a repair if the digest this
        peer told the group (after the round the group compares, :func:`voting_round`; for a group
        formed ahead while a round was in flight, one round before the launch) was not the group's.
        The repair fetches the state after round ``k``: a holder of the group's theta_bar then
        applied the same averages since as this peer, so detection may lag a round."""
        me = self.transport.peer_id
        if not self.enabled or result is None or not result.digests:
            return
        mine = result.digests.get(me, s.launch_digest)  # what the group saw of this peer
        j = voting_round(result.digests)
        if mine is None or j is None or mine.round != j or s.f.index in self._fetches or self._superseded(s, mine):
            return
        winner = winning_digest(result.digests)
        if winner is None or winner == mine.digest:
            return
        holders = sorted(p for p, d in result.digests.items() if d.digest == winner and d.round == j and p != me)
        if not holders:
            return
        peer = holders[zlib.crc32(f"{me}/{k}".encode()) % len(holders)]  # spread the odd ones over the holders
        logger.info("fragment %d: theta_bar after round %d differs from the group's (%s, the group's %s; seen "
                    "in round %d): fetching it from %s", s.f.index, j, mine.digest, winner, k, peer)
        since = {"outer_params": [t.clone() for t in s.f.outer]}  # what we hold: equal tensors do not move
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ods-repair")
        future = self._pool.submit(self._fetch, peer, s.f.index, k, since, lambda: _after(s))
        self._fetches[s.f.index] = _Fetch(s.f.index, k, peer, future, since)

    def _superseded(self, s: Repairable, mine: OuterDigest) -> bool:
        """Whether ``mine`` describes a theta_bar a repair has replaced since (told before it)."""
        adopted = self._adopted.get(s.f.index)
        if adopted is None or mine.round is None or mine.round > adopted[0]:
            return False
        return mine.round < adopted[0] or mine.digest != adopted[1].result()

    def _fetch(self, peer: str, fragment: int, k: int, since: dict, consumed: Callable[[], int],
               timeout: Optional[float] = None) -> tuple[Optional[FetchedFragment], int]:
        """(Worker thread.) The groupmate's state of fragment ``fragment``, asked again (bounded)
        while it has not consumed round ``k`` yet, nor the round this peer consumed since
        (``consumed()``: this peer's rounds go on during the download); and the bytes all tries
        received."""
        deadline, received = time.monotonic() + (self.timeout if timeout is None else timeout), 0
        for _ in range(RETRIES + 1):
            left = deadline - time.monotonic()
            if left <= 0 or self._closing.is_set():
                break
            want = max(k, consumed())
            fetched = self.transport.fetch_fragment(peer, fragment, want, left, since=since)
            if fetched is None:
                return None, received
            received += fetched.received_bytes
            if fetched.state.get("fragment") != fragment:  # a groupmate of an older release served its whole state
                return None, received
            served = fetched.state.get("round")
            # later than this peer: adopted once it consumed that round too (``poll``); earlier (this
            # peer consumed another round during the download): asked again
            if isinstance(served, int) and served >= max(want, consumed()):
                return fetched, received
            self._closing.wait(min(RETRY_S, max(0.0, deadline - time.monotonic())))
        return None, received

    # ------------------------------------------------------------------ adopt (training thread)
    def poll(self, syncs: Sequence[Repairable]) -> None:
        """Adopt the repairs that arrived (call between steps, with the state's lock held)."""
        for p, fetch in list(self._fetches.items()):
            if fetch.future.done():
                self._settle_fetch(syncs[p], fetch)

    def _settle_fetch(self, s: Repairable, fetch: _Fetch) -> bool:
        """A download of ``s``'s repair ended: keep it (of a round still to come), ask again (of a
        round this peer consumed past), or adopt it (or record its failure). Whether it ended the
        repair."""
        if self._ahead(s, fetch) or self._ask_again(s, fetch):
            return False
        del self._fetches[s.f.index]
        self._finish(s, fetch)
        return True

    def before_landing(self, s: Repairable) -> None:
        """(Training thread, state lock held.) A round of ``s`` is about to be consumed while a
        repair of ``s`` is under way: wait for it (up to ``LANDING_WAIT_S`` and the repair's bound)
        and adopt it first. The download was asked for the state after the round this peer
        consumed last; consumed later, it would be a round old on arrival, and asked again, and so
        on: eager at a distance consumes a round of a fragment every few hundred milliseconds, less
        than a download takes, and in runs with a real failed round its repairs chased the rounds
        for their whole minute (``benchmarks/repair_outage.py``). Frozen here, the peer's last
        round is the one asked for; the groupmate serves it once it consumed that round too."""
        fetch = self._fetches.get(s.f.index)
        if fetch is None:
            return
        t0, before = time.monotonic(), fetch.waited
        deadline = t0 + min(LANDING_WAIT_S, max(0.0, self.timeout - (t0 - fetch.started)))
        while time.monotonic() < deadline and s.f.index in self._fetches:
            concurrent.futures.wait([fetch.future], timeout=max(0.0, deadline - time.monotonic()))
            if not fetch.future.done() or self._ahead(s, fetch):
                break  # not in time (it goes on; ``poll`` takes it), or of a round still to come
            fetch.waited = before + time.monotonic() - t0  # (told by the record ``_finish`` writes)
            self._settle_fetch(s, fetch)  # adopted, or asked again (the groupmate had not consumed it)
        fetch.waited = before + time.monotonic() - t0

    def _ask_again(self, s: Repairable, fetch: _Fetch) -> bool:
        """Whether the state that came is of a round this peer consumed past while it came (eager
        waits for its round in flight at the sync, and a download that lands meanwhile is one round
        old at the next step): then it is asked again for the round consumed now, within the
        repair's bound and at most ``RETRIES`` times."""
        served, received = _served(fetch)
        left = self.timeout - (time.monotonic() - fetch.started)
        if not isinstance(served, int) or served >= _after(s) or fetch.asked > RETRIES or left <= 0 \
                or self._closing.is_set() or self._pool is None:
            return False
        fetch.received += received
        fetch.asked += 1
        fetch.future = self._pool.submit(self._fetch, fetch.peer, s.f.index, _after(s), fetch.since,
                                         lambda: _after(s), left)
        return True

    @staticmethod
    def _ahead(s: Repairable, fetch: _Fetch) -> bool:
        """Whether the state that came is of a round this peer has not consumed yet (the groupmate
        moved on while it was asked: rounds shorter than the download, eager at a distance): it is
        kept until this peer consumed that round too, and adopted then (``_finish``)."""
        served, _ = _served(fetch)
        return isinstance(served, int) and served > _after(s)

    def _finish(self, s: Repairable, fetch: _Fetch) -> None:
        try:
            fetched, received = fetch.future.result()
        except Exception as e:  # a bug in the download must not stop training: recorded as a failure
            logger.warning("fragment %d: repair from %s failed: %r", fetch.fragment, fetch.peer, e)
            fetched, received = None, 0
        received += fetch.received
        outcome, served = RepairOutcome.FAILED, None
        if fetched is not None:
            served = fetched.state.get("round")
            state = fetched.state
            # the groupmate's theta_bar after the round this peer consumed last: the group's then (both
            # applied the same averages since the round checked); another round's is not
            if state.get("round") != s.consumed:
                outcome = RepairOutcome.STALE
            else:
                self._settle(s)
                adopt(s, list(state["outer_params"]), state["outer_opt"])
                self.changed(s)
                # a digest told of this fragment's theta_bar before (a round in flight, a group
                # formed ahead) no longer describes it: not judged (``_superseded``)
                self._adopted[s.f.index] = self._hash(s)
                outcome = RepairOutcome.REPAIRED
        stats = self.log.stats
        if outcome is RepairOutcome.REPAIRED:
            stats.repairs += 1
        else:
            stats.failed_repairs += 1
            logger.info("fragment %d: repair of round %d from %s %s; checked again at the next round",
                        fetch.fragment, fetch.round, fetch.peer, outcome.value)
        self.log.emit({"event": "repair", "fragment": fetch.fragment, "round": fetch.round, "step": self.now(),
                       "from": fetch.peer, "bytes": int(received),
                       "seconds": round(time.monotonic() - fetch.started, 3), "outcome": outcome.value,
                       "served_round": served, "consumed": s.consumed, "asked": fetch.asked,
                       "waited_s": round(fetch.waited, 3)})

    def close(self) -> None:
        """Stop the worker (a download under way ends on its own bound, asking no more)."""
        self._closing.set()
        for pool in (self._pool, self._hasher):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
