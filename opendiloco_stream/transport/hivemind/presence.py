"""Live peers of a run on the DHT, per fragment and round: how many peers a round waits for.

Without it a round either waits ``matchmaking_time`` for whoever comes, or starts at a fixed
``target_group_size`` (and a swarm larger than that splits into disjoint groups, with no global
average). With it the target of every round is the number of live peers of the run::

    key = f"{run_id}_live_f{fragment}_r{round}"   subkey = peer id   value = [ahead, launched_at]
    expiration = now + ttl, refreshed every ``poll_s`` while the peer lives

- *Ahead.* When a peer launches round k of a fragment it announces round k+1 (``ahead=True``,
  ``launched_at`` = the DHT time it launched k) and refreshes that announcement until it launches
  k+1. The target of round k is the number of live ahead announcements for k: the peers that took
  part in round k-1, this one included. hivemind's leader (the peer that launched first) starts
  the round as soon as that many joined; one missing (it died in between) costs the others
  ``matchmaking_time``, after which the round runs with whoever is there.
- *Death.* A peer that dies stops refreshing: its announcement expires ``ttl`` later and it is not
  counted in any round the others launch after that. A peer that closes marks its announcements
  as left at once.
- *Joiners.* A donor serving its state announces the joiner ahead in the round after the
  state's step of every fragment (``reserve``, with ``launched_at`` = 0: it launched nothing),
  under its state's lock, before it launches them; the joiner announces itself there too as soon
  as its download's first message names that step (``expect``, which its heartbeat refreshes), so
  the others count it in the rounds right after the state it gets. Such a round (its plan says
  ``joiner``) waits for its group longer than a window (``RoundTimeouts.joiner_wait``): long
  enough for a download across a long link, and the group starts as soon as the joiner is in. A
  joiner whose download outlasted that wait missed the round (``launched_by_others``) and
  downloads what changed again; one that died costs the round that wait once (its announcements
  expire ``ttl`` later).
- *First round* of a fragment without that (a fresh start, a restart from a checkpoint): the peer
  also announces round k itself (``ahead=False``). If others announced k ahead (the run is going),
  it sits round k out (``SyncFailed`` reason "joining") and is counted from k+1 on: the others did
  not count it, so it could take the place of one they did. If nobody did (every peer is new: a
  cold start), round k has no target and forms at ``matchmaking_time`` with everyone there. A
  peer that joined such a swarm with the initial-model marker announced its first rounds
  ahead (``expect``, ``launched_at`` = 0) but plans them as a cold start too: a count of the
  marker joiners alone would leave out the fresh peers, whose group would then start without a
  joiner still on its way (and from the initial model it would stay that round apart for good).
- *Late.* Ahead announcements say when their peer launched the round before, so a slower peer
  learns that the others launched round k ``late_after`` seconds ago while it has not reached
  that round's sync step: ``is_late`` tells the algorithm, which syncs at once (catch-up) and
  contributes the tokens it processed, weighted as such. Once the watched round was launched, a
  beat also looks at the rounds after it (up to ``LOOK_AHEAD``), so a peer several rounds behind
  jumps to the swarm's latest round at once; the rounds it passes, still looking for a group the
  others left, are abandoned (``SyncHandle.abandon``) rather than waited for.

All DHT calls run in the caller's thread (a fragment's worker, before its round) or in this
object's heartbeat thread; never in the training loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from hivemind.dht import DHT
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 10.0
LOOK_AHEAD = 4  # rounds per fragment one beat looks at when the watched one was launched
UPKEEP_EVERY_S = 30.0  # how often the heartbeat prunes the DHT process's finished lookups


@dataclass(frozen=True)
class RoundPlan:
    """What presence says about one round before it starts."""

    target: Optional[int]   # start as soon as this many peers are in the group (None: at the deadline)
    skip: bool = False      # first round of this fragment in a running swarm: sit it out
    joiner: bool = False    # a joiner still on its way is counted or awaited: wait ``joiner_wait`` for it
    # without a target: the joiners announced there (peer ids), whom the group waits for past its
    # window (up to ``joiner_wait``) before it forms with everyone there
    awaited: frozenset = frozenset()


async def prune_pending_gets(_dht: DHT, node: Any) -> int:
    """Runs in the DHT process: drop the empty entries of ``DHTNode.pending_get_requests``.

    hivemind 1.1.12 keeps one (empty, once the lookup finished) ``SortedSet`` per key ever looked up
    and never deletes it. Every round of a run looks up new keys (this module's per-round keys, the
    matchmaking's per-round keys), so a long run's DHT process grew by ~8 kB per round (71-74 MB/h in
    the 30-minute soak, docs/benchmarks.md). Removing an empty entry is what hivemind would do if it
    cleaned up: a later lookup of the key makes a new one."""
    pending = node.pending_get_requests
    empty = [key for key, searches in pending.items() if not searches]
    for key in empty:
        del pending[key]
    return len(empty)


def live_key(run_id: str, fragment: int, round_index: int) -> str:
    return f"{run_id}_live_f{fragment}_r{round_index}"


class Presence:
    """This peer's announcements and its view of the others' (see the module docstring).

    Args:
        dht: the running DHT (the caller owns it).
        run_id, peer_id: the run and this peer (the subkey of its announcements).
        ttl: seconds an announcement outlives the last refresh (how long a dead peer stays counted).
        late_after: a round the others launched this long ago is late for a peer that has not.
        window: the matchmaking window of a round (``matchmaking_time``).
        joiner_wait: how long a round that counts an expected joiner waits for it (``RoundTimeouts.joiner_wait``).
        poll_s: refresh and poll period (default ``min(1, ttl / 4)``).
        dht_timeout: bound on one DHT store or lookup (a stuck DHT costs a refresh, never a hang).
        dht_lock: held around every call down the DHT's pipe (the transport shares one with its service).
    """

    def __init__(self, dht: DHT, run_id: str, peer_id: str, *, ttl: float = DEFAULT_TTL_S, late_after: float = 1.0,
                 poll_s: Optional[float] = None, dht_timeout: float = 3.0, window: float = 5.0,
                 joiner_wait: Optional[float] = None, dht_lock: Optional[threading.Lock] = None):
        if not ttl > 0 or not late_after >= 0:
            raise ValueError(f"presence ttl must be > 0 and late_after >= 0, got {ttl}, {late_after}")
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.ttl, self.late_after = float(ttl), float(late_after)
        self.window = float(window)  # a round's matchmaking window: how long an open round forms
        self.joiner_wait = max(self.window, float(joiner_wait if joiner_wait is not None else window))
        self.poll_s = min(1.0, self.ttl / 4) if poll_s is None else float(poll_s)
        self.dht_timeout = float(dht_timeout)
        self._lock = threading.Lock()
        # the DHT's control pipe is not safe for concurrent senders (shared with the averaging service)
        self._dht_lock = threading.Lock() if dht_lock is None else dht_lock
        self._ahead: dict[int, tuple[int, float]] = {}    # fragment -> (round announced ahead, launched_at)
        self._expires: dict[tuple[int, int], float] = {}  # (fragment, round) -> our last expiration there
        self._watch: dict[int, int] = {}                  # fragment -> the round is_late was asked about
        self._launched: dict[tuple[int, int], float] = {}  # (fragment, round) -> earliest launch by others
        self._expected_at: dict[tuple[int, int], float] = {}  # (fragment, round) -> when expect() was stored
        self._pending: dict[tuple[int, int], Any] = {}  # (fragment, round) -> the heartbeat's last store, unanswered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="hv-presence", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ DHT records
    def _store(self, fragment: int, round_index: int, value: Optional[list], wait: bool = True) -> Any:
        """Announce ``value`` for a round; ``wait=False`` sends it without waiting for the DHT's
        answer (a lost one costs one heartbeat: the next refresh stores it again) and returns the
        DHT's future (None if it could not be sent)."""
        with self._lock:
            key = (fragment, round_index)
            # a later expiration wins on the DHT: "left" must outlive the last refresh
            expiration = max(get_dht_time() + self.ttl, self._expires.get(key, 0.0) + 1e-3)
            self._expires[key] = expiration
        try:
            with self._dht_lock:
                future = self.dht.store(live_key(self.run_id, fragment, round_index), subkey=self.peer_id,
                                        value=value, expiration_time=expiration, return_future=True)
            if wait:
                future.result(timeout=self.dht_timeout)
            return future
        except Exception as e:  # a DHT hiccup costs one refresh, not the round
            logger.info("presence: could not announce fragment %d round %d: %r", fragment, round_index, e)
            return None

    def _entries(self, fragment: int, round_index: int) -> dict[str, tuple[bool, float]]:
        """Live announcements for a round: peer id -> (ahead, launched_at); malformed ones are ignored."""
        try:
            with self._dht_lock:
                future = self.dht.get(live_key(self.run_id, fragment, round_index), latest=True, return_future=True)
            found = future.result(timeout=self.dht_timeout)
        except Exception as e:
            logger.info("presence: could not read fragment %d round %d: %r", fragment, round_index, e)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            if (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], bool)
                    and isinstance(value[1], (int, float))):
                out[str(subkey)] = (value[0], float(value[1]))
        return out

    # ------------------------------------------------------------------ rounds
    def before_round(self, fragment: int, round_index: int, plan: bool = True) -> Optional[RoundPlan]:
        """Announce this peer for the round after ``round_index`` and plan ``round_index``.

        The announcements go out without waiting for the DHT's answers (the heartbeat stores them
        again); the plan is one DHT lookup. ``plan=False`` (a fixed group size: nothing to plan):
        no lookup and None, so the round's critical path holds no DHT round trip at all."""
        launched_at = get_dht_time()
        with self._lock:
            new = fragment not in self._ahead
            self._ahead[fragment] = (round_index + 1, launched_at)
        if new:
            self._store(fragment, round_index, [False, launched_at], wait=False)
        self._store(fragment, round_index + 1, [True, launched_at], wait=False)
        return self._plan(fragment, round_index, new) if plan else None

    def announced(self, fragment: int) -> bool:
        """Whether this peer launched a round of ``fragment`` before (so the next is not its first:
        its plan never says skip)."""
        with self._lock:
            return fragment in self._ahead

    def plan_round(self, fragment: int, round_index: int) -> RoundPlan:
        """Plan ``round_index`` (one DHT lookup) without announcing it: for a group formed ahead
        of the round (``_Lane.prematch``), whose announcement waits for the round's launch."""
        with self._lock:
            new = fragment not in self._ahead
        return self._plan(fragment, round_index, new)

    def _plan(self, fragment: int, round_index: int, new: bool) -> RoundPlan:
        entries = self._entries(fragment, round_index)
        ahead = {peer for peer, (is_ahead, _) in entries.items() if is_ahead}
        # a peer ahead at t = 0 launched nothing yet: a joiner announced by its donor or by itself
        joiners = frozenset(peer for peer, (is_ahead, t) in entries.items()
                            if is_ahead and t == 0 and peer != self.peer_id)
        launched = {peer for peer, (is_ahead, t) in entries.items() if is_ahead and t > 0}
        # a new peer: the run is going if others launched the round before (a joiner's t = 0 says
        # only that it will be there: with joiners alone, the round still forms at its deadline,
        # once they are in)
        if new and launched - {self.peer_id}:
            return RoundPlan(target=None, skip=True)
        if new or not launched:
            # a cold start (no size known), or its first round "announced" here only by marker
            # joiners (module docstring, "First round"): at its deadline, as the fresh do
            return RoundPlan(target=None, joiner=bool(joiners), awaited=joiners)
        count = len(ahead | {self.peer_id})
        return RoundPlan(target=count if count >= 2 else None, joiner=count >= 2 and bool(joiners))

    def reserve(self, joiner: str, keys: list[tuple[int, int]]) -> Optional[float]:
        """A donor serving ``joiner`` its state: announce the joiner ahead for these rounds (the
        next ones after that state) as its own ``expect`` will, before this peer launches them;
        the DHT time they were stored, None if a store failed (the joiner's own ``expect`` counts then)."""
        expiration = get_dht_time() + self.ttl  # the joiner's own announcement takes over within it
        try:
            with self._dht_lock:
                futures = [self.dht.store(live_key(self.run_id, f, k), subkey=joiner, value=[True, 0.0],
                                          expiration_time=expiration, return_future=True) for f, k in keys]
            stored = [future.result(timeout=self.dht_timeout) for future in futures]
        except Exception as e:
            logger.info("presence: could not reserve rounds %s for joiner %s: %r", keys, joiner, e)
            return None
        return get_dht_time() if all(stored) else None

    def expect(self, fragment: int, round_index: int, since: Optional[float] = None) -> None:
        """A joiner: announce this peer ahead for ``round_index``, its first round of ``fragment``
        (``since``: its donor announced it there already, at that DHT time)."""
        with self._lock:
            if fragment in self._ahead and self._ahead[fragment][1] != 0.0:
                return  # it launched a round of this fragment already: its own announcements count
            self._ahead[fragment] = (round_index, 0.0)  # a joiner that downloaded again moves on
        if self._store(fragment, round_index, [True, 0.0]) is not None:
            with self._lock:  # the first store counts: the rounds launched after it waited for this peer
                first = min(t for t in (since, get_dht_time(), self._expected_at.get((fragment, round_index)))
                            if t is not None)
                self._expected_at[(fragment, round_index)] = first

    def launched_by_others(self, fragment: int, round_index: int) -> bool:
        """Whether another peer launched this round without counting this peer, so that its group
        may form without it (a blocking DHT lookup: for a joiner checking, once, that the state it
        downloaded is not a round behind the swarm). Not missed: a round launched after this
        peer's ``expect`` was stored (planned with this peer in it: it waits for it there, for
        ``joiner_wait`` seconds, less the few this peer needs to get to the round after this
        check), and an open round, one that nobody else was counted in (it forms at the end of
        its window with whoever is there) launched less than ``window`` seconds ago."""
        with self._lock:
            expected_at = self._expected_at.get((fragment, round_index), float("inf"))
        launched = [t for peer, (is_ahead, t) in self._entries(fragment, round_index + 1).items()
                    if is_ahead and t > 0 and peer != self.peer_id]
        now = get_dht_time()
        waited = [t for t in launched if t >= expected_at]
        if waited:
            # the time to reach the round after this check (is_late knows it now, below), launch it
            # and join the group: a beat and the round's own lookups, a few round trips
            reach_s = min(self.late_after + 2 * self.poll_s, self.joiner_wait / 4)
            if now - min(waited) > self.joiner_wait - reach_s:
                return True  # it waited for this peer, but will have formed without it by the time it gets there
            with self._lock:  # the first step's is_late knows it at once, without waiting for a beat
                self._watch[fragment] = round_index
                self._launched[(fragment, round_index)] = min(waited)
        launches = [t for t in launched if t < expected_at]
        if not launches:
            return False
        counted = {peer for peer, (is_ahead, t) in self._entries(fragment, round_index).items()
                   if is_ahead and peer != self.peer_id}
        still_open = len(counted) <= 1 and now - min(launches) < self.window
        return not still_open

    def is_late(self, fragment: int, round_index: int) -> bool:
        """Whether other peers launched this round at least ``late_after`` seconds ago (non-blocking:
        answers from the last poll and asks the heartbeat to watch this round)."""
        with self._lock:
            if self._watch.get(fragment) != round_index:
                self._watch[fragment] = round_index
            launched = self._launched.get((fragment, round_index))
        return launched is not None and get_dht_time() - launched >= self.late_after

    def _heartbeat(self) -> None:
        last_upkeep = time.monotonic()
        while not self._stop.wait(self.poll_s):
            self.beat()
            if time.monotonic() - last_upkeep >= UPKEEP_EVERY_S:
                last_upkeep = time.monotonic()
                self.upkeep()

    def upkeep(self) -> int:
        """Prune the DHT process's bookkeeping of finished lookups (``prune_pending_gets``); how
        many entries went (-1 if the DHT did not answer)."""
        try:
            with self._dht_lock:
                future = self.dht.run_coroutine(prune_pending_gets, return_future=True)
            return int(future.result(timeout=self.dht_timeout))
        except Exception as e:
            logger.info("presence: DHT upkeep failed: %r", e)
            return -1

    def beat(self) -> None:
        """One refresh of this peer's announcements and one look at the watched rounds."""
        with self._lock:
            ahead, watch = dict(self._ahead), dict(self._watch)
        # refreshes are not waited for: on a slow DHT, waiting would delay the look at the watched
        # rounds (a slower peer's catch-up) by a store round trip per fragment. A refresh whose
        # predecessor is still unanswered is skipped, so a stuck DHT queues at most one per round.
        for fragment, (round_index, launched_at) in ahead.items():
            key = (fragment, round_index)
            previous = self._pending.get(key)
            if previous is not None and not previous.done():
                continue
            if previous is not None and previous.exception() is not None:
                logger.info("presence: could not refresh fragment %d round %d: %r", fragment, round_index,
                            previous.exception())
            self._pending[key] = self._store(fragment, round_index, [True, launched_at], wait=False)
        current = {(f, r) for f, (r, _) in ahead.items()}
        for key in [k for k in self._pending if k not in current]:
            del self._pending[key]  # rounds this peer moved past
        for fragment, round_index in watch.items():
            # the watched round, and while others launched it, the next ones (LOOK_AHEAD per beat):
            # a peer several rounds behind learns how far, and catches up in one jump
            for r in range(round_index, round_index + LOOK_AHEAD):
                if self._stop.is_set():
                    return
                # others announce k+1 ahead when they launch k
                others = [t for peer, (is_ahead, t) in self._entries(fragment, r + 1).items()
                          if is_ahead and t > 0 and peer != self.peer_id]  # t = 0: a joiner's, nothing launched
                if not others:
                    break
                with self._lock:
                    self._launched[(fragment, r)] = min(others)
                    for key in [k for k in self._launched if k[0] == fragment and k[1] < round_index]:
                        del self._launched[key]

    def close(self) -> None:
        """Stop refreshing and mark this peer's announcements as left (others stop counting it now)."""
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 5)
        with self._lock:
            ahead, self._ahead = dict(self._ahead), {}
        for fragment, (round_index, _) in ahead.items():
            self._store(fragment, round_index, None)
