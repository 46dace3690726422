"""``FragmentEndpoint``: one fragment's part of the averaging service (``service.py``).

It forms the fragment's groups (``matchmaking.Matchmaker``, handler ``{prefix}::join``), runs
each round's all-reduce (``runner.HvAllReduceRunner``) straight on the trainer's tensor, and serves
groupmates' streams: over its direct TCP listener (``direct.py``, sealed by ``seal.py``) or, as the
fallback, through the p2p daemon (handler ``{prefix}::aggregate``). Everything runs on the
service's event loop. It is the lane's (``lane.py``) one collaborator: the lane hands it the
coroutines of :meth:`form_group` / :meth:`group_for` and :meth:`run_round` (:meth:`submit`), gets
back a ``round_report.RoundSummary`` and asks it what a failure means (:meth:`failure`).

A round writes nothing the trainer holds: the average is decoded into a fresh tensor (returned
as ``SyncResult.average``) and, under a lossy codec, what this peer sent into another
(``SyncResult.sent``); the outer gradient is read, never written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, AsyncIterator, Coroutine, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter

from opendiloco_stream.compression import Codec
from opendiloco_stream.transport.base import OuterDigest
from opendiloco_stream.transport.failure import FailureReason
from opendiloco_stream.transport.hivemind.direct import (
    ConnectionPool, DirectListener, FailedAddresses, RunningGroups, serve_accepted, serve_connections,
)
from opendiloco_stream.transport.hivemind.punch import Puncher
from opendiloco_stream.transport.hivemind.link import LinkBook, notice_slow_start
from opendiloco_stream.transport.hivemind.matchmaking import Group, Matchmaker, MatchmakingFailed
from opendiloco_stream.transport.hivemind.protocol import RoundError, as_protobufs
from opendiloco_stream.transport.hivemind.round_report import RoundSummary
from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner
from opendiloco_stream.transport.hivemind.seal import DirectSecurity
from opendiloco_stream.transport.hivemind.service import AveragingService
from opendiloco_stream.transport.hivemind.timeouts import RoundTimeouts, link_timeouts
from opendiloco_stream.transport.reduce import member_metadata

logger = logging.getLogger(__name__)


class FragmentEndpoint:
    """The averaging of one fragment (prefix ``{run_id}_f{fragment}``); see the module docstring.

    Build it in a trainer thread (it binds the direct listener), then ``service.call(endpoint.start())``.
    ``runner_cls``: the round's runner (tests pass subclasses that fake bad senders or log paths).
    ``timeout_base`` and ``link_mbit``: ``derive_timeouts``' other arguments and the configured
    rate; with them, :meth:`refresh_timeouts` derives the next rounds' bounds from the links this
    fragment's rounds measured (``links``, ``link.py``). ``relayed``: this peer is reached through
    a relay (``--relay``): no listener (its addresses are private), and its groupmates are told.
    ``echoes``: echo servers (``punch.py``); with them, groupmates without an address of their own
    are reached by hole punching.
    """

    def __init__(self, service: AveragingService, numel: int, *, prefix: str, codec: Codec, timeouts: RoundTimeouts,
                 chunk_bytes: int, norm_bound: Optional[float], client_mode: bool, admission: Any = None,
                 direct: bool = True, direct_port: int = 0, direct_plaintext: bool = False,
                 runner_cls: type = HvAllReduceRunner, timeout_base: Optional[dict] = None,
                 link_mbit: Optional[float] = None, relayed: bool = False, echoes: tuple = ()):
        self.service, self.numel, self.prefix = service, int(numel), prefix
        self.codec, self.timeouts, self.chunk_bytes, self.norm_bound = codec, timeouts, chunk_bytes, norm_bound
        self.client_mode, self.admission, self.runner_cls = client_mode, admission, runner_cls
        self.direct, self.direct_failed = direct, FailedAddresses()
        self.direct_pool = ConnectionPool()  # connections to groupmates kept open between rounds
        self.links = LinkBook()  # groupmates' RTT and rate, from this fragment's rounds
        self.timeout_base, self.link_mbit = timeout_base, link_mbit
        self._timeouts_refused: Optional[str] = None  # the last measure that broke the hierarchy (logged once)
        self.direct_security = DirectSecurity(direct_plaintext, admission.auth if admission is not None else None)
        self.listener: Optional[DirectListener] = None
        if direct and not client_mode and not relayed:
            with service.dht_lock:  # (reads the DHT's visible addresses down its pipe)
                self.listener = DirectListener.for_dht(service.dht, direct_port)
        self.relayed = relayed
        self.puncher = Puncher.start(echoes) if direct and echoes else None
        self.running: dict[bytes, asyncio.Future] = {}  # group id -> future of its runner
        self.groups = RunningGroups(self.running)
        self.matchmaker = Matchmaker(service.p2p, service.dht_call, prefix, client_mode=client_mode,
                                     check_member=admission.check_member if admission is not None else None,
                                     request_timeout=timeouts.request)
        self.aggregate_name = f"{prefix}::aggregate"
        self._serving: Optional[asyncio.Task] = None

    @property
    def direct_addresses(self) -> Optional[list]:
        """Where groupmates stream their parts to us directly (None: p2p daemon only)."""
        return None if self.listener is None else self.listener.addresses

    # ------------------------------------------------------------------ lifecycle (on the loop)
    async def start(self) -> None:
        p2p = self.service.p2p
        if not self.client_mode:
            await p2p.add_protobuf_handler(self.matchmaker.handler_name, self.matchmaker.rpc_join,
                                           averaging_pb2.JoinRequest, stream_output=True)
            await p2p.add_protobuf_handler(self.aggregate_name, self.rpc_aggregate, averaging_pb2.AveragingData,
                                           stream_input=True, stream_output=True)
        if self.puncher is not None:  # a punched connection is served as an accepted one
            self.puncher.adopt = lambda sock: asyncio.ensure_future(serve_accepted(
                sock, self.groups, self.prefix, self.timeouts.next_chunk, self.direct_security))
        if self.listener is not None:
            self._serving = asyncio.ensure_future(serve_connections(
                self.listener, self.groups, self.prefix, self.timeouts.next_chunk, self.direct_security))

    async def close(self) -> None:
        self.direct_pool.close()
        if self.puncher is not None:
            self.puncher.close()
        if self._serving is not None:
            self._serving.cancel()  # ended before the socket closes: its fd may be reused at once
            await asyncio.gather(self._serving, return_exceptions=True)
            self.listener.close()
        for future in list(self.running.values()):
            if not future.done():
                future.cancel()
        if not self.client_mode:
            for name, streams in ((self.matchmaker.handler_name, dict(stream_output=True)),
                                  (self.aggregate_name, dict(stream_input=True, stream_output=True))):
                try:
                    await self.service.p2p.remove_protobuf_handler(name, **streams)
                except Exception as e:  # the daemon is gone already
                    logger.debug("%s: removing handler %s: %r", self.prefix, name, e)

    # ------------------------------------------------------------------ for the lane (its thread)
    @property
    def closed(self) -> bool:
        """Whether the service is closed: no round runs any more."""
        return self.service.closed

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        """Run ``coroutine`` (one of this endpoint's) on the service's loop."""
        return self.service.submit(coroutine)

    def set_target(self, round_index: int, target: int, wait_s: Optional[float] = None) -> None:
        """Hand a round already matching its group the size to wait for, and how long from its
        start (``Matchmaker.set_target``, on the loop); nothing once the loop is closed (the round
        then fails as closed)."""
        try:
            self.service.loop.call_soon_threadsafe(self.matchmaker.set_target, round_index, target, wait_s)
        except RuntimeError:  # the loop is closed
            pass

    def await_peers(self, round_index: int, peers: frozenset, wait_s: float) -> None:
        """Joiners round ``round_index`` waits for past its window, up to ``wait_s`` from its start
        (``Matchmaker.await_peers``, on the loop); nothing once the loop is closed."""
        try:
            self.service.loop.call_soon_threadsafe(self.matchmaker.await_peers, round_index, frozenset(peers), wait_s)
        except RuntimeError:  # the loop is closed
            pass

    @staticmethod
    def failure(error: BaseException, formed: bool) -> tuple[FailureReason, str]:
        """A round's exception as ``SyncFailed``'s (reason, message); ``formed``: whether its group formed."""
        if isinstance(error, RoundError):
            return error.reason, error.message
        if isinstance(error, MatchmakingFailed):  # its reason: MATCHMAKING, CLIENTS, ...
            return error.reason, f"no group formed: {error}"
        if not formed:
            return FailureReason.MATCHMAKING, f"no group formed: {error}"
        if isinstance(error, TimeoutError):
            return FailureReason.TIMEOUT, f"all-reduce did not finish in time: {error!r}"
        return FailureReason.FAILED, repr(error)

    # ------------------------------------------------------------------ rounds (on the loop)
    def metadata(self, key: tuple, weight: float, digest: Optional[OuterDigest] = None) -> dict:
        """What this peer tells its group about round ``key`` (sealed for the run key's checks);
        ``digest``: its theta_bar fingerprint (``SyncResult.digests``), if it has one to tell."""
        meta = member_metadata(self.codec, self.numel, key, weight, self.chunk_bytes)
        meta["client"] = bool(self.client_mode)
        if digest is not None:
            meta["outer"] = digest.to_wire()
        if self.listener is not None:
            meta["direct"] = self.listener.addresses  # where to stream our part (direct.py)
        if self.puncher is not None:
            meta["punch"] = self.puncher.meta()  # how to punch to us (punch.py)
        if self.relayed:
            meta["relayed"] = True
        return meta if self.admission is None else self.admission.seal(meta, self.service.peer_id.to_bytes())

    async def form_group(self, key: tuple, weight: float, target: Optional[int], window_s: float,
                         awaited: frozenset = frozenset(), open_s: Optional[float] = None,
                         hold_s: Optional[float] = None, digest: Optional[OuterDigest] = None) -> Group:
        """Round ``key``'s group, formed within ``window_s``; ``MatchmakingFailed`` if none formed
        (``awaited``, ``open_s``, ``hold_s``: ``Matchmaker.form``; ``digest``: :meth:`metadata`)."""
        return await self.matchmaker.form(int(key[1]), self.metadata(key, weight, digest), window_s, target, awaited,
                                          open_s, hold_s)

    async def group_for(self, key: tuple, weight: float, target: Optional[int], window_s: float,
                        early: Optional[concurrent.futures.Future] = None, awaited: frozenset = frozenset(),
                        open_s: Optional[float] = None, hold_s: Optional[float] = None,
                        digest: Optional[OuterDigest] = None) -> Group:
        """Round ``key``'s group: the one ``early`` formed ahead (a :meth:`form_group` submitted
        before the round) if it did, else one formed now (:meth:`form_group`) within a whole window:
        the others' groups formed ahead may have matched at other times than ours (a donor's
        before its joiner existed), and they reach this round at its launch as we do. (Matching
        only for what was left of the window since the launch failed a joiner's two last rounds
        at 300 ms, both peers "found none", 2026-11-29.)"""
        if early is not None:
            try:
                return await asyncio.wrap_future(early)
            except (MatchmakingFailed, asyncio.CancelledError, concurrent.futures.CancelledError):
                if asyncio.current_task().cancelling():  # this round was cancelled (abandoned), not the early group
                    raise
                logger.info("%s: no group formed ahead for round %s: matching now", self.prefix, key)
        return await self.form_group(key, weight, target, window_s, awaited, open_s, hold_s, digest)

    def refresh_timeouts(self) -> RoundTimeouts:
        """The next rounds' bounds from the worst link measured to the groupmates (``link_timeouts``);
        the current ones where nothing is measured, or where the measure does not fit the window
        (said once: rounds at that distance will likely time out)."""
        if len(self.links):
            notice_slow_start(self.links.worst()[0])  # once per process, where it applies
        if self.timeout_base is None or self.link_mbit is None or not len(self.links):
            return self.timeouts
        rtt, rate = self.links.worst()
        try:
            new = link_timeouts(self.timeout_base, link_mbit=self.link_mbit, rtt_s=rtt, measured_mbit=rate)
        except ValueError as e:
            if self._timeouts_refused is None:
                logger.warning("%s: the links measured (RTT %.0f ms) need longer bounds than the window allows "
                               "(%s): keeping the current ones", self.prefix, rtt * 1e3, e)
            self._timeouts_refused = str(e)
            return self.timeouts
        self.timeouts = new
        self.matchmaker.request_timeout = new.request
        return new

    def round_buffers(self, numel: int) -> tuple:
        """(average, sent): tensors of the service's pool (``buffers.py``) for a round of ``numel``
        elements to decode into (``sent`` None under fp32, where what was sent is the input itself)."""
        pool = self.service.buffers
        return pool.take(numel), (None if self.codec.lossless else pool.take(numel))

    async def run_round(self, group: Group, tensor: torch.Tensor, formed: Optional[Any] = None,
                        result: Optional[torch.Tensor] = None, sent: Optional[torch.Tensor] = None) -> RoundSummary:
        """The all-reduce of ``tensor`` (flat fp32, on the CPU) with ``group``.

        Returns the round's ``RoundSummary``, with the average (a fresh tensor: ``result`` if given)
        and what this peer sent (``tensor`` itself under a lossless codec; else ``sent`` if given).
        ``formed``: a ``threading.Event`` set once the group exists (the lane's abandon reads it)."""
        running = asyncio.get_event_loop().create_future()
        self.running[group.group_id] = running
        self.groups.notify()
        try:
            if formed is not None:
                formed.set()
            return await self._runner(group, tensor, running, result, sent).run()
        finally:
            self.running.pop(group.group_id, None)

    def _runner(self, group: Group, tensor: torch.Tensor, running: asyncio.Future,
                result: Optional[torch.Tensor] = None, sent: Optional[torch.Tensor] = None) -> HvAllReduceRunner:
        try:
            why = None if self.admission is None else self.admission.check_group(group.peer_ids, group.gathered)
            if why is not None:  # a leader that admitted an outsider: reduce nothing with it
                raise RoundError(FailureReason.REJECTED, f"group refused: {why}")
            runner = self.runner_cls(
                p2p=self.service.p2p, handler=self.aggregate_name, prefix=self.prefix, group=group, tensor=tensor,
                codec=self.codec, timeouts=self.timeouts, norm_bound=self.norm_bound,
                direct_failed=self.direct_failed if self.direct else None, direct_security=self.direct_security,
                result=result, sent=sent, direct_pool=self.direct_pool, links=self.links, link_mbit=self.link_mbit,
                **({"puncher": self.puncher} if self.puncher is not None else {}))
        except RoundError as e:
            running.set_exception(e)
            running.exception()  # retrieved: a late sender's handler may never look at it
            raise
        running.set_result(runner)
        return runner

    # ------------------------------------------------------------------ the p2p fallback path
    async def rpc_aggregate(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                            ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Route a groupmate's stream through the p2p daemon to the runner of its group."""
        try:
            request = await asyncio.wait_for(anext(stream), self.timeouts.next_chunk)
        except (Exception, StopAsyncIteration) as e:
            logger.info("%s: a stream from %s ended before its first message: %r", self.prefix, context.remote_id, e)
            return
        # A groupmate's stream may arrive before our own round's runner exists (its group answer
        # reached it first): wait as long as a sender may stay silent before its first contribution.
        loop = asyncio.get_event_loop()
        deadline = loop.time() + self.timeouts.next_chunk
        await self.groups.find(lambda g: g == request.group_id, deadline)
        future = self.running.get(request.group_id)
        if future is None or future.cancelled():
            code = averaging_pb2.BAD_GROUP_ID if future is None else averaging_pb2.CANCELLED
            yield averaging_pb2.AveragingData(code=code)
            return
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except Exception as e:  # the runner could not start (e.g. mismatching peers): the sender fails too
            logger.info("%s: no runner for the stream from %s: %r", self.prefix, context.remote_id, e)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        async for message in as_protobufs(runner.serve(achain(as_aiter(request), stream), context.remote_id)):
            yield message
