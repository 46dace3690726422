"""One all-reduce round of one fragment, run on the averaging service's loop (``service.py``).

Replaces hivemind's ``AllReduceRunner`` (whose ``avg - decoded(part)`` deltas leave peers with
different results under lossy codecs, and which keeps local values for parts whose reducer failed).
The reduction is ``transport/reduce.py`` (shared with ``LocalSwarm``); this module moves it between
peers in ``protocol.py``'s frames: each sender opens one stream per remote reducer (direct TCP,
``direct.py``, else the ``{prefix}::aggregate`` handler through the p2p daemon), sends its contribution chunks and,
if it reduces a part itself, its verdict on it, then reads the averaged chunks back on that stream.
Every wait is bounded: ``next_chunk`` between two messages of a stream (and for a sender to show
up), the round deadline (``allreduce``) for the verdicts and the first result. Any part that does
not arrive complete and consistent fails the whole round with ``RoundError(reason=FailureReason.PARTIAL)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional, Union

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

from opendiloco_stream.compression import Codec, all_finite, native
from opendiloco_stream.transport.base import OuterDigest
from opendiloco_stream.transport.failure import FailureReason
from opendiloco_stream.transport.hivemind.direct import (
    ConnectionPool, DirectStream, FailedAddresses, make_hello, parse_address,
)
from opendiloco_stream.transport.hivemind.link import LinkBook, size_buffers
from opendiloco_stream.transport.hivemind.seal import DirectSecurity, new_salt
from opendiloco_stream.transport.hivemind.jobs import RoundClosed, RoundJobs
from opendiloco_stream.transport.hivemind.matchmaking import Group, unpack_meta
from opendiloco_stream.transport.hivemind.punch import Puncher, direct_reducers, punch_info, reaches
from opendiloco_stream.transport.hivemind.protocol import (
    CONTRIB, DONE, RESULT, VERDICT, ProtocolError, RoundError, as_protobufs, frame_parts, pack_frame, unpack_frame,
)
from opendiloco_stream.transport.hivemind.protocol import error_message as _error, message as _message
from opendiloco_stream.transport.hivemind.round_report import RoundSummary
from opendiloco_stream.transport.hivemind.timeouts import RoundTimeouts
from opendiloco_stream.transport.layout import GroupLayout, group_chunk_bytes
from opendiloco_stream.transport.reduce import (
    MISSING, OK, GroupMismatch, PartReducer, combine_verdicts, decode_result, judge_members, sum_of_squares,
    summarize_verdict,
)

logger = logging.getLogger(__name__)

RATE_MIN_BYTES = 1 << 20  # an exchange that moved less says little about the link's rate (slow start)


class HvAllReduceRunner:
    """Reduce-scatter, verdict exchange and all-gather of one group (see ``transport/reduce.py``).

    ``run()`` returns the round's :class:`RoundSummary`: group size, weight share, bytes..., the
    average (``self.result``) and what this peer sent, ``deQ(Q(tensor))``: ``self.sent``, where each
    chunk's decoded bytes are written once it is encoded, or ``tensor`` itself under a lossless codec.
    Subclasses may override ``encode_contribution`` (tests use it to fake bad senders).
    """

    def __init__(self, *, p2p: P2P, handler: str, prefix: str, group: Group, tensor: torch.Tensor,
                 codec: Codec, timeouts: RoundTimeouts, norm_bound: Optional[float],
                 direct_failed: Optional[FailedAddresses] = None, result: Optional[torch.Tensor] = None,
                 sent: Optional[torch.Tensor] = None, direct_security: Optional[DirectSecurity] = None,
                 direct_pool: Optional[ConnectionPool] = None, links: Optional[LinkBook] = None,
                 link_mbit: Optional[float] = None, puncher: Optional[Puncher] = None):
        self.p2p, self.handler, self.prefix = p2p, handler, prefix  # handler: groupmates' p2p fallback
        self.group_id, self.peer_ids = group.group_id, tuple(group.peer_ids)
        self.me = self.peer_ids.index(p2p.peer_id)
        self.tensor, self.codec, self.t, self.norm_bound = tensor, codec, timeouts, norm_bound
        n = len(self.peer_ids)
        users = []
        for blob in group.gathered:
            try:
                users.append(unpack_meta(blob))
            except Exception:
                users.append(None)  # judge_members names it
        self.key = users[self.me]["key"]
        try:
            self.weights, status = judge_members(users, self.me, [False] * n)
        except GroupMismatch as e:
            raise RoundError(FailureReason.REJECTED, f"round {self.key}: {e}") from None
        # client-mode peers accept no connections: they send and receive, but reduce no part; and
        # where some members reach every other one directly (listening, or by a punch), only those
        # reduce (punch.py): the parts' bytes then avoid the relay
        self.direct = [parse_address(u.get("direct")) if isinstance(u, dict) else None for u in users]
        self.users, self.names = users, [str(p) for p in self.peer_ids]
        self.punch = [punch_info(u) for u in users]
        self.relayed = [isinstance(u, dict) and bool(u.get("relayed")) for u in users]
        self.is_reducer = direct_reducers(users, self.names, self.direct,
                                          [isinstance(u, dict) and not u.get("client", False) for u in users])
        self.senders = list(range(n))
        # chunks of the smallest size a member announced (sizes derive from each one's link rate)
        self.layout = GroupLayout.for_codec(codec, tensor.numel(), self.is_reducer, group_chunk_bytes(users))
        # direct TCP streams (direct.py): None where disabled; addresses whose connection failed;
        # how they are sealed (seal.py; default: sealed, no run key)
        self.direct_failed, self.direct_security = direct_failed, direct_security or DirectSecurity()
        self.puncher = puncher if direct_failed is not None else None  # hole punching (punch.py), None: none
        self.paths: dict[int, str] = {}  # reducer -> how our exchange with it went: direct, punched, relayed, p2p
        # connections kept open between rounds (direct.py); the groupmates' links as measured in
        # our rounds (link.py): new connections' buffers are sized from them, and this round adds to them
        self.direct_pool, self.links, self.link_mbit = direct_pool, links, link_mbit
        self.links_seen: dict[int, dict] = {}  # groupmate -> what this round measured of its link
        self._bytes_with = [0] * n  # bytes moved with each reducer on our stream to it
        largest = max((hi - lo for chunks in self.layout.chunks for lo, hi in chunks), default=0)
        self.max_message_bytes = n * codec.encoded_size(largest) + 65536  # a result bundles <= n contributions
        self.my_chunks = self.layout.chunks[self.me]
        # fp32 is lossless: what we send is the tensor itself, sent without a copy, and ``sent`` is
        # not written (the trainer uses its own tensor). Not for test doubles that fake what they send.
        self.sent_is_input = (codec.lossless
                              and type(self).encode_contribution is HvAllReduceRunner.encode_contribution)
        # the average is decoded straight into the tensor the trainer receives; what we sent, into
        # its own (none under fp32): a round holds no copy of the outer gradient
        self.result = native.empty_huge(tensor.numel()) if result is None else result
        if sent is None and not self.sent_is_input:
            sent = native.empty_huge(tensor.numel())
        self.sent = sent
        self.bytes_sent = self.bytes_received = 0
        # reducer state: decoded contributions to my part, their squared norms, per-sender status
        self.part = PartReducer(codec, self.my_chunks, status, norm_bound)
        self.sender_done = {s: asyncio.Event() for s in self.senders}
        self.connected: set[int] = set()
        loop = asyncio.get_event_loop()
        self.verdicts = {r: loop.create_future() for r in range(n) if self.is_reducer[r] and r != self.me}
        self.my_verdict, self.final = loop.create_future(), loop.create_future()  # final: (status, total weight)
        self.result_chunks = [loop.create_future() for _ in self.my_chunks]
        self.part_status: dict[int, tuple[bytes, float]] = {}
        self.serving: dict[int, asyncio.Event] = {}
        self.finished = False
        self.jobs = RoundJobs()  # the round's work on executor threads: run() ends once none runs (jobs.py)
        self._deadline = loop.time() + timeouts.allreduce
        # wall-clock marks of the round's phases (time.time(): the host compares them with its own)
        self.marks: dict[str, float] = {"group": time.time()}

    # ------------------------------------------------------------------ helpers
    def _remaining(self) -> float:
        return max(0.0, self._deadline - asyncio.get_event_loop().time())

    def _name(self, i: int) -> str:
        return str(self.peer_ids[i])

    def encode_contribution(self, chunk: torch.Tensor) -> bytes:
        """What goes on the wire for one chunk of this peer's tensor."""
        return self.codec.encode(chunk)

    def _encode_chunk(self, lo: int, hi: int) -> Union[bytes, tuple]:
        """Encode one chunk of our tensor and record what it decodes to in ``sent`` (executor).

        Lossless fp32 (``sent_is_input``): the header and a view of the tensor itself, and ``sent``
        is left alone: what we sent is the tensor."""
        if self.sent_is_input:
            return self.codec.encode_parts(self.tensor[lo:hi])
        payload = self.encode_contribution(self.tensor[lo:hi])
        try:
            self.codec.decode_into(payload, self.sent[lo:hi])
        except ValueError:  # only a faked sender gets here: what it sent is not a tensor
            self.sent[lo:hi] = float("nan")
        return payload

    async def _take_contribution(self, s: int, j: int, payload: Union[bytes, tuple]) -> None:
        if self.part.status[s] != OK:
            return  # already rejected (or abstaining): the rest of its stream is drained unread
        if s == self.me and self.sent_is_input:  # our own fp32 (header, view): the tensor itself,
            lo, hi = self.my_chunks[j]           # found finite by encode_parts
            values = self.tensor[lo:hi]
            checked = (values, "", await self.jobs.run(sum_of_squares, values), None)
        else:
            checked = await self.jobs.run(self.part.check, j, payload)
        why = self.part.accept(s, j, checked)  # ignored if s was dropped meanwhile
        if why:
            logger.info("round %s: rejecting the contribution of %s: %s", self.key, self._name(s), why)

    def _record_part(self, q: int, status: bytes, total_weight: float) -> None:
        seen = self.part_status.setdefault(q, (status, total_weight))
        if seen != (status, total_weight):
            raise RoundError(FailureReason.PARTIAL, f"reducer {self._name(q)} changed its verdict between chunks")

    # ------------------------------------------------------------------ reducer: incoming streams
    async def serve(self, stream: AsyncIterator[averaging_pb2.AveragingData], remote: PeerID
                    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Handle one sender's stream: take its contribution chunks and verdict, return the averages."""
        s = self.peer_ids.index(remote) if remote in self.peer_ids else -1
        if s < 0 or s not in self.sender_done or not self.is_reducer[self.me] or s in self.connected:
            logger.info("round %s: refusing a stream from %s (not a sender of ours, or a second stream)", self.key, remote)
            yield _error(averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self.finished or self.sender_done[s].is_set():  # too late: already counted as missing
            logger.info("round %s: %s connected too late", self.key, remote)
            yield _error(averaging_pb2.CANCELLED)
            return
        self.connected.add(s)
        self.serving[s] = done_serving = asyncio.Event()
        try:
            async for message in self._serve(stream, s):
                yield message
        finally:
            done_serving.set()

    async def _serve(self, stream: AsyncIterator[averaging_pb2.AveragingData], s: int
                     ) -> AsyncIterator[averaging_pb2.AveragingData]:
        it = stream.__aiter__()
        try:
            for j in range(len(self.my_chunks)):
                msg = await asyncio.wait_for(it.__anext__(), min(self.t.next_chunk, self._remaining()))
                self.bytes_received += msg.ByteSize()
                frame = unpack_frame(msg.tensor_part.buffer)
                if msg.code != averaging_pb2.PART_FOR_AVERAGING or frame.kind != CONTRIB or frame.chunk != j:
                    raise ProtocolError(f"expected contribution chunk {j}, got kind {frame.kind} chunk {frame.chunk}")
                await self._take_contribution(s, j, frame.payload)
            self.sender_done[s].set()
            if s in self.verdicts:
                msg = await asyncio.wait_for(it.__anext__(), self._remaining())
                self.bytes_received += msg.ByteSize()
                frame = unpack_frame(msg.tensor_part.buffer)
                if frame.kind != VERDICT or len(frame.status) != len(self.peer_ids):
                    raise ProtocolError(f"expected a verdict, got frame kind {frame.kind}")
                if not self.verdicts[s].done():  # done: we already counted this peer as lost
                    self.verdicts[s].set_result(frame.status)
            # the sender's end of stream first: closing while it still writes would break its pipe
            try:
                msg = await asyncio.wait_for(it.__anext__(), min(self.t.next_chunk, self._remaining()))
                raise ProtocolError(f"unexpected message after the contribution (code {msg.code})")
            except StopAsyncIteration:
                pass
        except (Exception, asyncio.CancelledError) as e:
            why = "stalled" if isinstance(e, asyncio.TimeoutError) else "left" if isinstance(e, StopAsyncIteration) else repr(e)
            logger.info("round %s: stream from %s broke: %s", self.key, self._name(s), why)
            self._sender_lost(s, why)
            if isinstance(e, asyncio.CancelledError):
                raise
            yield _error()
            return
        try:
            final, total_weight = await asyncio.wait_for(asyncio.shield(self.final), self._remaining())
            for j in range(len(self.my_chunks)):
                payload = await asyncio.wait_for(asyncio.shield(self.result_chunks[j]), self._remaining())
                msg = _message(frame_parts(RESULT, j, payload, final, total_weight), code=averaging_pb2.AVERAGED_PART)
                self.bytes_sent += msg.ByteSize()
                yield msg
            msg = _message(pack_frame(DONE, len(self.my_chunks), b"", final, total_weight), code=averaging_pb2.AVERAGED_PART)
            self.bytes_sent += msg.ByteSize()
            yield msg
        except Exception as e:  # our reduction failed: tell the sender instead of going silent
            logger.debug("round %s: no result for %s: %r", self.key, self._name(s), e)
            yield _error()
            return
        # Linger until the sender closes the stream (which cancels us): closing first could drop
        # the frames above while they are still in flight.
        await asyncio.sleep(min(self.t.next_chunk, self._remaining()))

    def _sender_lost(self, s: int, why: str) -> None:
        if not self.sender_done[s].is_set():
            logger.info("round %s: sender %s %s before its contribution was complete", self.key, self._name(s), why)
            self.part.drop(s, MISSING)
            self.sender_done[s].set()
        verdict = self.verdicts.get(s)
        if verdict is not None and not verdict.done():
            verdict.set_exception(RoundError(FailureReason.PARTIAL,
                                             f"reducer {self._name(s)} {why} before sending its verdict"))
            verdict.exception()  # retrieved: our reduction may have stopped waiting already

    async def _watch_for_absent_senders(self) -> None:
        """A sender that never opens its stream within next_chunk is missing (it may be dead)."""
        await asyncio.sleep(min(self.t.next_chunk, self._remaining()))
        for s in self.senders:
            if s != self.me and s not in self.connected:
                self._sender_lost(s, "never connected")

    # ------------------------------------------------------------------ reducer: own part
    async def _contribute_locally(self) -> None:
        for j, (lo, hi) in enumerate(self.my_chunks):
            payload = await self.jobs.run(self._encode_chunk, lo, hi)
            # the same checks as a remote contribution: our own part is no exception
            await self._take_contribution(self.me, j, payload)
        self.sender_done[self.me].set()

    async def _reduce(self) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.sender_done.values())), self._remaining())
            self.marks["contributions"] = time.time()
            self.my_verdict.set_result(verdict := self.part.verdict())
            others = [await asyncio.wait_for(asyncio.shield(self.verdicts[r]), self._remaining())
                      for r in sorted(self.verdicts)]
            final = combine_verdicts([verdict, *others])
            outcome = summarize_verdict(final, self.weights, self.me)
            if not outcome.accepted or (total_weight := outcome.total_weight) <= 0:
                raise RoundError(FailureReason.REJECTED, f"round {self.key}: no valid contribution left")
            self.marks["verdicts"] = time.time()
            self.final.set_result((final, total_weight))
            for j in range(len(self.my_chunks)):
                payload = await self.jobs.run(self._reduce_chunk, j, final)
                self.result_chunks[j].set_result(payload)
            self.marks["reduced"] = time.time()
            self._record_part(self.me, final, total_weight)
        except BaseException as e:
            failure = e if isinstance(e, RoundError) else RoundError(
                FailureReason.TIMEOUT if isinstance(e, asyncio.TimeoutError) else FailureReason.PARTIAL,
                f"round {self.key}: reduction failed: {e!r}")
            for fut in (self.my_verdict, self.final, *self.result_chunks):
                if not fut.done():
                    fut.set_exception(failure)
                    fut.exception()  # mark retrieved: handlers may never look
            if isinstance(e, asyncio.CancelledError):
                raise
            raise failure

    def _reduce_chunk(self, j: int, final: bytes) -> Union[bytes, tuple]:
        lo, hi = self.my_chunks[j]
        payload, self.result[lo:hi] = self.part.reduce_chunk(j, final, self.weights, parts=True)  # quantized ONCE, same bytes for all
        return payload

    # ------------------------------------------------------------------ sender side
    async def _contributions_for(self, q: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        for j, (lo, hi) in enumerate(self.layout.chunks[q]):
            try:
                payload = await self.jobs.run(self._encode_chunk, lo, hi)
            except Exception as e:  # the reducer only sees our stream end: say why here (unless the round is over)
                if not isinstance(e, RoundClosed):
                    logger.warning("round %s: encoding chunk %d for %s failed", self.key, j, self._name(q), exc_info=True)
                raise
            msg = _message(frame_parts(CONTRIB, j, payload), self.group_id)  # payload: bytes or fp32 (header, view)
            self.bytes_sent += msg.ByteSize()
            self._bytes_with[q] += msg.ByteSize()
            yield msg
        if self.is_reducer[self.me]:
            try:
                verdict = await asyncio.shield(self.my_verdict)
            except Exception:
                return  # our reduction failed; ending the stream tells the reducer
            msg = _message(pack_frame(VERDICT, 0, status=verdict), self.group_id)
            self.bytes_sent += msg.ByteSize()
            yield msg

    async def _open_stream(self, q: int) -> AsyncIterator:
        """A stream to reducer ``q``: direct TCP to the address it advertised, else (or while that
        address is in its back-off, ``direct.FailedAddresses``) the p2p daemon."""
        address = self.direct[q] if self.direct_failed is not None else None
        if address is not None and not self.direct_failed.blocked(address):
            security, salt = self.direct_security, new_salt()  # a fresh salt: fresh keys for each connection
            hello = make_hello(security, self.group_id, self.prefix, self.me, q, salt)
            try:
                stream = await DirectStream.open(address, hello, lambda: self._contributions_for(q),
                                                 min(self.t.request, self._remaining()), self.max_message_bytes,
                                                 security.channel(self.group_id, self.prefix, self.me, q, salt, "sender"),
                                                 pool=self.direct_pool, buffers=self._buffers_for(q))
                self.direct_failed.succeeded(address)
                self.paths[q] = "direct"
                return stream
            except (OSError, asyncio.TimeoutError) as e:
                logger.info("round %s: no direct connection to %s at %s (%r): using the p2p daemon (direct again "
                            "in %.0f s)", self.key, self._name(q), address, e, self.direct_failed.failed(address))
        elif address is None and self._punches(self.me, q):
            stream = await self._punched_stream(q)
            if stream is not None:
                return stream
        self.paths[q] = "relayed" if self.relayed[q] or self.relayed[self.me] else "p2p"
        return await asyncio.wait_for(
            self.p2p.iterate_protobuf_handler(self.peer_ids[q], self.handler, as_protobufs(self._contributions_for(q)),
                                              averaging_pb2.AveragingData),
            min(self.t.next_chunk, self._remaining()))

    def _punches(self, s: int, q: int) -> bool:
        """Whether sender ``s`` and reducer ``q`` punch a connection this round: ``q`` has no address
        of its own and a punch can work between them (``punch.reaches``; both sides decide alike,
        from the same metadata)."""
        return (self.puncher is not None and s != q and self.is_reducer[q] and self.direct[q] is None
                and reaches(self.users, self.names, self.direct, s, q))

    async def _punched_stream(self, q: int) -> Optional[DirectStream]:
        """A direct stream to reducer ``q`` over a punched connection (``punch.py``), kept open
        between rounds like any other; None where the punch failed (the p2p daemon carries it)."""
        puncher, remote = self.puncher, tuple(self.punch[q]["recv"])
        timeout = min(self.t.request, self._remaining())
        security, salt = self.direct_security, new_salt()
        hello = make_hello(security, self.group_id, self.prefix, self.me, q, salt)
        try:
            stream = await DirectStream.open(("punch", remote), hello, lambda: self._contributions_for(q), timeout,
                                             self.max_message_bytes,
                                             security.channel(self.group_id, self.prefix, self.me, q, salt, "sender"),
                                             pool=self.direct_pool,
                                             connect=lambda: puncher.dial(puncher.send_port, remote, timeout))
        except (OSError, asyncio.TimeoutError) as e:
            backoff = puncher.mark_unreached(self.names[q])
            logger.info("round %s: no punched connection to %s at %s:%d (%r): using the p2p daemon (punching "
                        "again in %.0f s)", self.key, self._name(q), remote[0], remote[1], e, backoff)
            return None
        if not stream.reused:
            puncher.punched += 1
        self.paths[q] = "punched"
        return stream

    async def _answer_punches(self) -> None:
        """The reducer's side of the punches of this round (``_punches``): towards each sender with
        no punched connection to us still open, at the same time as it punches towards us."""
        puncher, answers = self.puncher, []
        for s in self.senders:
            if self._punches(s, self.me):
                remote = tuple(self.punch[s]["send"])
                if not puncher.serving(remote):
                    answers.append((s, puncher.answer(remote, min(self.t.request, self._remaining()))))
        for s, ok in zip([s for s, _ in answers], await asyncio.gather(*(a for _, a in answers))):
            if ok:
                puncher.mark_reached(self.names[s])
            else:
                puncher.mark_unreached(self.names[s])

    def _buffers_for(self, q: int):
        """What sizes a new connection's buffers to reducer ``q`` (``link.size_buffers``), from
        its link as measured in earlier rounds; None before any measure."""
        known = self.links.get(self.peer_ids[q]) if self.links is not None else None
        if known is None or self.link_mbit is None:
            return None
        rate = self.link_mbit if known.rate_mbit is None else max(self.link_mbit, known.rate_mbit)
        return lambda sock: size_buffers(sock, rate, known.rtt_s)

    def _measure(self, q: int, stream: AsyncIterator, elapsed_s: float) -> None:
        """Record what the exchange with reducer ``q`` showed of its link: the kernel's RTT of a
        direct connection (else its handshake's time), and a rate where enough bytes moved."""
        rtt = rate = None
        if isinstance(stream, DirectStream):
            info = stream.tcp_info()
            rtt = info.rtt_s if info is not None and info.rtt_s > 0 else stream.connect_s
        moved = self._bytes_with[q]
        if moved >= RATE_MIN_BYTES and elapsed_s > 0:
            rate = moved * 8 / elapsed_s / 1e6
        if rtt is None and rate is None:
            return
        self.links_seen.setdefault(q, {}).update(rtt_ms=None if rtt is None else round(rtt * 1e3, 2),
                                                 rate_mbit=None if rate is None else round(rate, 2),
                                                 reused=bool(getattr(stream, "reused", False)))
        if self.links is not None:
            self.links.record(self.peer_ids[q], rtt_s=rtt, rate_mbit=rate)

    async def _next_result(self, q: int, it: AsyncIterator, kind: int, j: int, timeout: float):
        """Reducer ``q``'s next frame, which must be ``kind`` (RESULT chunk ``j``, or DONE)."""
        msg = await asyncio.wait_for(it.__anext__(), timeout)
        self.bytes_received += msg.ByteSize()
        self._bytes_with[q] += msg.ByteSize()
        if msg.code != averaging_pb2.AVERAGED_PART:
            raise RoundError(FailureReason.PARTIAL,
                             f"reducer {self._name(q)} answered {averaging_pb2.MessageCode.Name(msg.code)}")
        frame = unpack_frame(msg.tensor_part.buffer)
        if frame.kind != kind or (kind == RESULT and frame.chunk != j) or len(frame.status) != len(self.peer_ids):
            raise ProtocolError(f"expected {'result chunk %d' % j if kind == RESULT else 'the end of results'}, "
                                f"got kind {frame.kind} chunk {frame.chunk}")
        self._record_part(q, frame.status, frame.total_weight)
        return frame

    async def _exchange_with(self, q: int) -> None:
        stream = None
        t0 = asyncio.get_event_loop().time()
        try:
            stream = await self._open_stream(q)
            it = stream.__aiter__()
            for j, (lo, hi) in enumerate(self.layout.chunks[q]):
                timeout = self._remaining() if j == 0 else min(self.t.next_chunk, self._remaining())
                frame = await self._next_result(q, it, RESULT, j, timeout)
                await self.jobs.run(self._take_result, frame.payload, lo, hi, frame.status)
            # DONE (with the verdict when the part is empty) ends it; then we close: the reducer waits
            timeout = min(self.t.next_chunk, self._remaining()) if self.layout.chunks[q] else self._remaining()
            await self._next_result(q, it, DONE, len(self.layout.chunks[q]), timeout)
            self.links_seen.setdefault(q, {})["path"] = self.paths.get(q)
            self._measure(q, stream, asyncio.get_event_loop().time() - t0)
            if self.paths.get(q) == "punched":  # a punched connection carried a whole exchange
                self.puncher.mark_reached(self.names[q])
        except RoundError:
            raise
        except StopAsyncIteration:
            self._peer_unreachable(q, "ended its stream")
            raise RoundError(FailureReason.PARTIAL,
                             f"round {self.key}: reducer {self._name(q)} ended its results early") from None
        except asyncio.TimeoutError:
            raise RoundError(FailureReason.PARTIAL, f"round {self.key}: reducer {self._name(q)} stalled") from None
        except Exception as e:
            self._peer_unreachable(q, repr(e))
            raise RoundError(FailureReason.PARTIAL,
                             f"round {self.key}: exchange with {self._name(q)} failed: {e!r}") from None
        finally:
            if stream is not None:
                await stream.aclose()

    def _peer_unreachable(self, q: int, why: str) -> None:
        # All streams between two peers share one connection: if ours to q broke, q's to us is
        # broken too (or will never open). Count q as lost now rather than after next_chunk.
        if q in self.sender_done and q != self.me:
            self._sender_lost(q, f"unreachable ({why})")

    def _take_result(self, payload: bytes, lo: int, hi: int, final: bytes) -> None:
        # the result's format follows from the verdict (sparse codecs: the accepted contributions)
        decode_result(self.codec, payload, final, self.weights, hi - lo, out=self.result[lo:hi])  # ValueError -> partial

    # ------------------------------------------------------------------ the round
    def summary(self) -> RoundSummary:
        """The finished round for the host; ``RoundError`` if its parts do not agree or the
        average is not finite."""
        verdicts = set(self.part_status.values())
        if len(verdicts) != 1:
            raise RoundError(FailureReason.PARTIAL, f"round {self.key}: parts were averaged over different groups")
        final, total_weight = verdicts.pop()
        outcome = summarize_verdict(final, self.weights, self.me)
        if not all_finite(self.result):
            raise RoundError(FailureReason.PARTIAL, f"round {self.key}: the average holds non-finite values")
        return RoundSummary(
            average=self.result, sent=self.tensor if self.sent_is_input else self.sent,
            group_size=outcome.group_size,
            weight_share=self.weights[self.me] / total_weight if outcome.included_self else 0.0,
            included_self=outcome.included_self, peers=[str(self.peer_ids[s]) for s in outcome.accepted],
            rejected=outcome.rejected, missing=outcome.missing,
            bytes_sent=self.bytes_sent, bytes_received=self.bytes_received,
            marks=dict(self.marks, end=time.time()), sent_is_input=self.sent_is_input,
            links={str(self.peer_ids[q]): seen for q, seen in self.links_seen.items()},
            digests=self.digests())

    def digests(self) -> dict:
        """Every member's theta_bar fingerprint from its metadata (``OuterDigest``), by peer id."""
        out = {}
        for name, user in zip(self.names, self.users):
            digest = OuterDigest.from_wire(user.get("outer")) if isinstance(user, dict) else None
            if digest is not None:
                out[name] = digest
        return out

    def progress(self) -> str:
        """Where the round stands, for a timeout's message: what we got from whom, and the phases done."""
        start = self.marks["group"]
        marks = ", ".join(f"{k} at +{v - start:.2f}s" for k, v in self.marks.items() if k != "group")
        items = []
        for i in range(len(self.peer_ids)):
            if i == self.me:
                continue
            got = []
            if i in self.sender_done:
                got.append("contribution " + ("in" if self.sender_done[i].is_set() else
                                              "streaming" if i in self.connected else "not connected"))
            if i in self.verdicts:
                got.append("verdict " + ("in" if self.verdicts[i].done() else "awaited"))
            if self.is_reducer[i]:
                got.append("results " + ("begun" if i in self.part_status else "awaited"))
            items.append(f"peer {i}: {', '.join(got) or 'nothing expected'}")
        return f"I am {self.me}; {'; '.join(items)}; {marks or 'no phase done'}"

    async def run(self) -> RoundSummary:
        tasks = [asyncio.ensure_future(self._exchange_with(q)) for q in range(len(self.peer_ids))
                 if self.is_reducer[q] and q != self.me]
        helpers = []
        if self.is_reducer[self.me]:
            tasks += [asyncio.ensure_future(self._contribute_locally()), asyncio.ensure_future(self._reduce())]
            helpers.append(asyncio.ensure_future(self._watch_for_absent_senders()))
            if self.puncher is not None:
                helpers.append(asyncio.ensure_future(self._answer_punches()))
        try:
            try:
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), self._remaining())
            except asyncio.TimeoutError:
                raise RoundError(FailureReason.TIMEOUT, f"round {self.key}: not finished within "
                                                        f"{self.t.allreduce:.1f}s ({self.progress()})") from None
            self.marks["results"] = time.time()
            # others may still be reading our results: let them finish (bounded) before reporting
            pending = [e.wait() for e in self.serving.values()]
            if pending:
                await asyncio.wait([asyncio.ensure_future(p) for p in pending], timeout=self._remaining())
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            if errors:
                first = next((e for e in errors if isinstance(e, RoundError) and e.reason != FailureReason.PARTIAL),
                             errors[0])
                raise first if isinstance(first, RoundError) else RoundError(FailureReason.PARTIAL, repr(first))
            return self.summary()
        finally:
            self.finished = True
            for task in tasks + helpers:
                task.cancel()
            await self.jobs.finish(f"round {self.key}")  # threads may still write our buffers: wait for them
