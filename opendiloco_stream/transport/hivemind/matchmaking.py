"""Group formation for one fragment's rounds, on hivemind's DHT and p2p (public APIs only).

A peer that wants round ``r`` of a fragment announces itself on the DHT under ``{prefix}_r{r}.match``
(subkey: its peer id; value: ``[can_lead, grouped]``) and reads the others' announcements every
``poll_s``. The round's **leader** is the smallest peer id among the announced peers that can lead
(not client mode) and are not in a group yet; every announcing peer computes it from what it reads.

* The leader accepts join requests (``{prefix}::join``, a stream: ACCEPTED at once, then the group)
  until the group holds ``target`` peers (the live peers counted by ``presence.py``, or the fixed
  ``target_group_size``) or the round's matchmaking window ends; then it sends every member the
  ordered peer ids and their sealed metadata (``BEGIN_ALLREDUCE``). A group of one fails.
* A peer that reads a smaller leader than itself joins it. A leader that sees a smaller one appear
  (announcements propagate in a few ms, so two peers may briefly both think they lead) steps down:
  its members are told to follow the new leader (``NOT_A_LEADER`` with a suggested leader).
* A leader whose group is full answers ``GROUP_IS_FULL``, and every member of a formed group
  re-announces itself as grouped: the peers left over (a swarm larger than a fixed target) elect
  the next smallest and form their own group.
* The run key (``net/auth.py`` ``Admission``): each member's metadata carries its proof; the leader
  refuses a joiner without one and every member checks the whole group before it reduces with it.

Nothing here holds a tensor: a group is a list of peers and their metadata (``Group``); the round
itself is ``runner.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time

from opendiloco_stream.transport.failure import FailureReason

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often a matching peer re-reads the round's announcements
EXCLUDE_S = 1.0  # how long a peer that refused us (full, not leading) is passed over


class MatchmakingFailed(Exception):
    """No group formed for the round within its window."""

    reason = FailureReason.MATCHMAKING  # the round's failure reason (``SyncResult.reason``)


class NoPeerAcceptsConnections(MatchmakingFailed):
    """Other peers reached the round, but none of them (nor this one) accepts connections: every one
    of them is a client, so nobody could lead the group or reduce a part."""

    reason = FailureReason.CLIENTS


@dataclass(frozen=True)
class Group:
    """A formed group: the same on every member (the leader sent it)."""

    group_id: bytes
    peer_ids: tuple  # hivemind PeerIDs, in the group's order
    gathered: tuple  # per member: msgpack bytes of its sealed metadata (``reduce.member_metadata`` + fields)
    leader: PeerID


def match_key(prefix: str, round_index: int) -> str:
    return f"{prefix}_r{int(round_index)}.match"


def pack_meta(meta: dict) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def unpack_meta(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


@dataclass
class _Round:
    """This peer's matching of one round (leader or follower), shared with the join handler."""

    index: int
    gathered: bytes
    target: Optional[int]
    deadline: float  # event-loop time the window ends
    started: float = 0.0  # event-loop time it began forming
    # without a target: joiners on their way (peer ids, base58) that a leader waits for past the
    # window (``open_until``, the window's end without them) up to ``deadline``
    awaited: frozenset = frozenset()
    open_until: float = 0.0
    # as a follower accepted by a leader: how long to wait for its group (a leader may hold the
    # round for a joiner this peer was not told of, up to then)
    hold_until: float = 0.0
    leading: bool = False
    following: Optional[PeerID] = None  # the leader this peer last chose, if not itself
    decided: asyncio.Event = field(default_factory=asyncio.Event)  # it has chosen once
    members: dict = field(default_factory=dict)  # follower PeerID -> gathered bytes, in join order
    outcome: Optional[asyncio.Future] = None  # Group, or a PeerID to follow instead, or an exception
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    clients: set = field(default_factory=set)  # other peers seen announcing the round in client mode
    led: bool = False  # some peer that can lead was seen (or this peer can lead)


class Matchmaker:
    """The group formation of one fragment (prefix ``{run_id}_f{fragment}``); runs in the service loop.

    Args:
        p2p: the service's replica of the DHT's p2p daemon (``DHT.replicate_p2p``).
        dht_call: runs a blocking DHT call (``dht.store`` / ``dht.get`` with ``return_future=True``)
            off the loop and returns its result (``service.AveragingService.dht_call``).
        prefix: the fragment's name in the run.
        client_mode: this peer cannot accept connections: it never leads.
        check_member: ``Admission.check_member`` (``None``: every peer of the run is admitted).
        request_timeout: bound on a join's first answer and on a DHT call.
    """

    def __init__(self, p2p: P2P, dht_call: Callable, prefix: str, *, client_mode: bool,
                 check_member: Optional[Callable[[Any, bytes], Optional[str]]], request_timeout: float,
                 poll_s: float = POLL_S):
        self.p2p, self.dht_call, self.prefix = p2p, dht_call, prefix
        self.client_mode, self.check_member = client_mode, check_member
        self.request_timeout, self.poll_s = request_timeout, poll_s
        self.me = p2p.peer_id
        self.rounds: dict[int, _Round] = {}
        self.handler_name = f"{prefix}::join"
        self._background: set = set()  # announcements sent without waiting (held: asyncio holds tasks weakly)
        # (target, wait_s) set before their round began forming
        self._targets: dict[int, tuple[Optional[int], Optional[float]]] = {}
        self._awaits: dict[int, tuple[frozenset, float]] = {}  # ``await_peers`` before their round began forming

    # ------------------------------------------------------------------ DHT
    async def _announce(self, r: _Round, grouped: bool) -> None:
        expiration = get_dht_time() + max(0.0, r.deadline - asyncio.get_event_loop().time()) + 2 * self.request_timeout
        try:
            await self.dht_call("store", match_key(self.prefix, r.index), subkey=self.me.to_base58(),
                                value=[not self.client_mode, grouped], expiration_time=expiration)
        except Exception as e:  # a missed announcement: others may not see us lead (we still join)
            logger.info("%s: could not announce round %d: %r", self.prefix, r.index, e)

    async def _candidates(self, r: _Round, excluded: dict) -> list[PeerID]:
        """Peers that may lead round ``r``, smallest id first (this peer included if it can lead)."""
        try:
            found = await self.dht_call("get", match_key(self.prefix, r.index), latest=True)
        except Exception as e:
            logger.info("%s: could not read round %d's announcements: %r", self.prefix, r.index, e)
            found = None
        now = time.monotonic()
        out = set()
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, item in entries.items():
            value = getattr(item, "value", None)
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and value[1] is False):
                continue
            try:
                peer = PeerID.from_base58(str(subkey))
            except Exception:
                continue
            if value[0] is not True:
                if peer != self.me:
                    r.clients.add(peer)
            elif excluded.get(peer, 0.0) <= now:
                out.add(peer)
        if not self.client_mode:
            out.add(self.me)
        r.led = r.led or bool(out)
        return sorted(out, key=lambda p: p.to_bytes())

    # ------------------------------------------------------------------ forming a group
    async def form(self, round_index: int, meta: dict, window_s: float, target: Optional[int],
                   awaited: frozenset = frozenset(), open_s: Optional[float] = None,
                   hold_s: Optional[float] = None) -> Group:
        """This peer's group for ``round_index`` (``meta``: its sealed metadata), formed within
        ``window_s`` seconds; ``MatchmakingFailed`` if none formed. ``target``: start as soon as
        that many peers are in (``None``: at the window's end with whoever joined). ``awaited``
        (without a target): joiners still on their way; as a leader, past ``open_s`` (the window
        without them) it starts once they are all in, or at ``window_s`` with whoever is there.
        ``hold_s``: as a follower, how long from the start it waits for the group of a leader that
        accepted it (at least its own window): other peers' leaders may wait for joiners too."""
        loop = asyncio.get_event_loop()
        early_target, wait_s = self._targets.pop(round_index, (None, None))
        if target is None:
            target = early_target
        now = loop.time()
        r = _Round(round_index, pack_meta(meta), target, now + window_s, started=now, outcome=loop.create_future(),
                   awaited=frozenset(awaited), open_until=now + (window_s if open_s is None else min(open_s, window_s)),
                   hold_until=now + max(window_s, hold_s or 0.0))
        self.rounds[round_index] = r
        if wait_s is not None:
            r.deadline = max(r.deadline, r.started + wait_s)
        more, more_wait_s = self._awaits.pop(round_index, (frozenset(), 0.0))
        if more:
            r.awaited |= more
            r.deadline = max(r.deadline, r.started + more_wait_s)
        # The announcement and the first read of the others' go out together: a DHT store is a
        # round trip or two at a distance, and waiting for it before reading would add them to
        # every round (the others read ours at their next poll, as they would anyway).
        announced = asyncio.ensure_future(self._announce(r, grouped=False))
        try:
            return await self._match(r)
        finally:
            self._end(r)
            # grouped, failed or cancelled: no longer a leader for this round (the others elect
            # another); sent after the first announcement, so it is the one that stays
            task = asyncio.ensure_future(self._announce_after(announced, r))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _announce_after(self, first: asyncio.Future, r: _Round) -> None:
        await asyncio.gather(first, return_exceptions=True)
        await self._announce(r, grouped=True)

    def set_target(self, round_index: int, target: Optional[int], wait_s: Optional[float] = None) -> None:
        """The group size round ``round_index`` waits for, known after it began forming (the lane
        plans a fragment's later rounds meanwhile): a leader with that many members starts now.
        ``wait_s``: the round waits that long from its start for them, if longer than its window
        (a joiner still downloading is among them: ``presence.py``)."""
        r = self.rounds.get(round_index)
        if r is None:  # its forming has not begun yet (or is over): kept for it, a few at most
            self._targets[round_index] = (target, wait_s)
            for old in sorted(self._targets)[:-4]:
                del self._targets[old]
            return
        r.target = target
        if wait_s is not None and r.started + wait_s > r.deadline:
            r.deadline = r.started + wait_s
            # its announcement must live as long as the window now does, for the joiner to find it
            task = asyncio.ensure_future(self._announce(r, grouped=False))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        r.changed.set()

    def await_peers(self, round_index: int, peers: frozenset, wait_s: float) -> None:
        """Joiners that round ``round_index`` waits for, learned after it was planned (a donor
        that handed out the initial-model marker while its first round formed): as a leader, past
        its window it starts once they are all in, and it waits up to ``wait_s`` from its start."""
        r = self.rounds.get(round_index)
        if r is None:  # its forming has not begun yet (or is over): kept for it, a few at most
            old, old_wait = self._awaits.get(round_index, (frozenset(), 0.0))
            self._awaits[round_index] = (old | frozenset(peers), max(old_wait, wait_s))
            for stale in sorted(self._awaits)[:-4]:
                del self._awaits[stale]
            return
        r.awaited |= frozenset(peers)
        if r.started + wait_s > r.deadline:
            r.deadline = r.started + wait_s
            task = asyncio.ensure_future(self._announce(r, grouped=False))  # as in set_target
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        r.changed.set()

    def _awaited_in(self, r: _Round) -> bool:
        """Whether the leader may close the round at its window's end: no target, and every
        awaited joiner is among its members."""
        return r.target is None and r.awaited <= {p.to_base58() for p in r.members}

    def _end(self, r: _Round) -> None:
        if self.rounds.get(r.index) is r:
            del self.rounds[r.index]
        if not r.outcome.done():  # our members must not wait for a group we no longer form
            r.outcome.set_exception(MatchmakingFailed(f"{self.prefix}: round {r.index}: the leader stopped matching"))
            r.outcome.exception()

    async def _match(self, r: _Round) -> Group:
        loop, excluded = asyncio.get_event_loop(), {}
        hint: Optional[PeerID] = None  # a leader suggested by the one we asked
        while True:
            if r.outcome.done():
                return r.outcome.result()
            if loop.time() >= r.deadline or (r.leading and loop.time() >= r.open_until and self._awaited_in(r)):
                return self._finish(r, at_deadline=True)
            candidates = await self._candidates(r, excluded)
            leader = hint if hint is not None and hint in candidates else (candidates[0] if candidates else None)
            hint = None
            r.following = None if leader == self.me else leader
            r.decided.set()
            if leader == self.me:
                self._lead(r)
                if r.target is not None and 1 + len(r.members) >= r.target:
                    return self._finish(r, at_deadline=False)
                if loop.time() >= r.open_until and self._awaited_in(r):
                    return self._finish(r, at_deadline=True)
                await self._wait_changed(r, min(self.poll_s, r.deadline - loop.time()))
                continue
            if r.leading:
                self._step_down(r, leader)
            if leader is None:
                await asyncio.sleep(min(self.poll_s, max(0.0, r.deadline - loop.time())))
                continue
            answer = await self._join(r, leader)
            if isinstance(answer, Group):
                return answer
            if isinstance(answer, PeerID):
                hint = answer
            else:  # refused (not leading: briefly; full, dead or stalled: for a while)
                excluded[leader] = time.monotonic() + (self.poll_s if answer == "not leading" else EXCLUDE_S)
                await asyncio.sleep(min(0.02, max(0.0, r.deadline - loop.time())))

    def _lead(self, r: _Round) -> None:
        if not r.leading:
            logger.debug("%s: leading round %d", self.prefix, r.index)
            r.leading = True

    def _step_down(self, r: _Round, leader: Optional[PeerID]) -> None:
        """A smaller leader appeared: our members follow it (we join it ourselves next)."""
        logger.debug("%s: round %d: stepping down for %s", self.prefix, r.index, leader)
        r.leading = False
        old, r.outcome = r.outcome, asyncio.get_event_loop().create_future()
        r.members = {}
        if not old.done():
            old.set_result(leader)

    async def _wait_changed(self, r: _Round, timeout: float) -> None:
        try:
            await asyncio.wait_for(r.changed.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        r.changed.clear()

    def _finish(self, r: _Round, at_deadline: bool) -> Group:
        """As the leader: the group of this peer and its members (``MatchmakingFailed`` if alone;
        ``NoPeerAcceptsConnections`` if only clients ever reached the round)."""
        if at_deadline and r.clients and not r.led:
            raise NoPeerAcceptsConnections(
                f"{self.prefix}: round {r.index}: no group formed: this peer and the {len(r.clients)} other(s) that "
                "reached the round are all clients (none accepts connections, so none can lead or reduce): give "
                "one peer a reachable address (--announce-maddrs / --public-ip) or all of them a relay "
                "(peer --relay, bootstrap --relay); see docs/networking.md")
        if not r.leading or not r.members:
            raise MatchmakingFailed(f"{self.prefix}: round {r.index}: no group formed"
                                    + (" (window over)" if at_deadline else ""))
        members = [(self.me, r.gathered), *r.members.items()]
        members.sort(key=lambda m: m[0].to_bytes())
        group = Group(os.urandom(20), tuple(p for p, _ in members), tuple(g for _, g in members), self.me)
        r.outcome.set_result(group)
        return group

    # ------------------------------------------------------------------ follower side
    async def _join(self, r: _Round, leader: PeerID) -> Any:
        """Ask ``leader`` to take us: the ``Group`` it formed, a ``PeerID`` it says to follow,
        "not leading" (it follows nobody we know of yet), or None (full, dead, stalled)."""
        loop = asyncio.get_event_loop()
        request = averaging_pb2.JoinRequest(group_key=match_key(self.prefix, r.index), gather=r.gathered,
                                            client_mode=self.client_mode, expiration=get_dht_time() + r.deadline - loop.time())
        stream = None
        try:
            stream = await asyncio.wait_for(self.p2p.iterate_protobuf_handler(
                leader, self.handler_name, request, averaging_pb2.MessageFromLeader), self.request_timeout)
            first = await asyncio.wait_for(stream.__anext__(), self.request_timeout)
            if first.code != averaging_pb2.ACCEPTED:
                return self._suggested(first)
            wait = max(0.0, max(r.deadline, r.hold_until) - loop.time()) + self.request_timeout
            second = await asyncio.wait_for(stream.__anext__(), wait)
            if second.code != averaging_pb2.BEGIN_ALLREDUCE:
                return self._suggested(second)
            return self._group_from(second, leader)
        except (Exception, StopAsyncIteration) as e:  # a dead or stalled leader: pass it over for a while
            logger.debug("%s: round %d: join with %s failed: %r", self.prefix, r.index, leader, e)
            return None
        finally:
            if stream is not None:
                await stream.aclose()

    @staticmethod
    def _suggested(msg: averaging_pb2.MessageFromLeader) -> Any:
        if msg.code != averaging_pb2.NOT_A_LEADER:
            return None
        if not msg.suggested_leader:
            return "not leading"
        try:
            return PeerID(msg.suggested_leader)
        except Exception:
            return None

    def _group_from(self, msg: averaging_pb2.MessageFromLeader, leader: PeerID) -> Optional[Group]:
        peer_ids = tuple(PeerID(p) for p in msg.ordered_peer_ids)
        if self.me not in peer_ids or leader not in peer_ids or len(msg.gathered) != len(peer_ids):
            logger.info("%s: leader %s sent a group without us (or malformed): ignored", self.prefix, leader)
            return None
        return Group(bytes(msg.group_id), peer_ids, tuple(bytes(g) for g in msg.gathered), leader)

    # ------------------------------------------------------------------ leader side (the handler)
    async def rpc_join(self, request: averaging_pb2.JoinRequest, context: P2PContext
                       ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        peer = context.remote_id
        r = self._round_of(request.group_key)
        if r is not None and not r.decided.is_set():  # announced, but it has not read the others yet
            try:
                await asyncio.wait_for(r.decided.wait(), 2 * self.poll_s)
            except asyncio.TimeoutError:
                pass
        if r is None or not r.leading or r.outcome.done():
            if r is not None and r.leading:
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            else:
                follows = r.following if r is not None and r.following != peer else None
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_A_LEADER,
                                                      suggested_leader=follows.to_bytes() if follows else b"")
            return
        if r.target is not None and 1 + len(r.members) >= r.target:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            return
        why = self._refusal(request, peer)
        if why is not None:
            logger.info("%s: refused %s: %s", self.prefix, peer, why)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        outcome = r.outcome
        r.members[peer] = bytes(request.gather)
        r.changed.set()
        try:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
            yield await self._answer(outcome, r)
            # keep the stream open until the follower closes it: closing first may drop the answer
            await asyncio.sleep(self.request_timeout)
        finally:
            if not outcome.done() and r.members.get(peer) is not None:
                del r.members[peer]  # it gave up before the group formed

    async def _answer(self, outcome: asyncio.Future, r: _Round) -> averaging_pb2.MessageFromLeader:
        loop = asyncio.get_event_loop()
        while True:  # until the window's end, read again: a joiner awaited or counted may extend it
            try:
                result = await asyncio.wait_for(asyncio.shield(outcome), max(0.0, r.deadline - loop.time()) + 1.0)
                break
            except asyncio.TimeoutError:
                if loop.time() >= r.deadline + 1.0:
                    return averaging_pb2.MessageFromLeader(code=averaging_pb2.CANCELLED)
            except Exception:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.CANCELLED)
        if isinstance(result, Group):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=result.group_id,
                                                   ordered_peer_ids=[p.to_bytes() for p in result.peer_ids],
                                                   gathered=list(result.gathered))
        suggested = result.to_bytes() if isinstance(result, PeerID) else b""
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_A_LEADER, suggested_leader=suggested)

    def _round_of(self, group_key: str) -> Optional[_Round]:
        head = f"{self.prefix}_r"
        if not group_key.startswith(head) or not group_key.endswith(".match"):
            return None
        try:
            return self.rounds.get(int(group_key[len(head):-len(".match")]))
        except ValueError:
            return None

    def _refusal(self, request: averaging_pb2.JoinRequest, peer: PeerID) -> Optional[str]:
        """Why the leader refuses a joiner (the run key's proof, the fingerprint), if it does."""
        if self.check_member is None:
            return None
        try:
            meta = unpack_meta(request.gather)
        except Exception:
            return "its metadata is unreadable"
        return self.check_member(meta, peer.to_bytes())
