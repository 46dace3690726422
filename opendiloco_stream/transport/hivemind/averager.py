"""``FragmentAverager``: a hivemind ``DecentralizedAverager`` that runs our all-reduce for one fragment.

What we keep from hivemind 1.1.12: the background process, matchmaking (group keys, leaders,
``target_group_size``), the step control (``step(wait=False)``), P2P handlers under the averager's
prefix. What we replace: the all-reduce itself (``_aggregate_with_group`` runs ``HvAllReduceRunner``
and ``rpc_aggregate_part`` routes streams to it), the shutdown (hivemind's calls ``finalize`` on
futures), the signal handling (hivemind ignores SIGINT in the *host* when it forks), and a
matchmaking that found no group fails the step at once instead of first waiting for its trigger.
Two fixes around a cancelled step: the averager's event loop holds its pending tasks
(``_hold_pending_tasks``), and the host cancels a step with ``cancel_step``, which marks it
cancelled before it wakes the averager.

Buffers (shared memory, fixed size): ``input_buffer`` (the host writes the tensor to send before a
step; a lossy codec's runner overwrites each chunk, once encoded, with ``deQ(Q(chunk))``: what was
sent) and ``output_buffer`` (the runner writes the average). The host reads them only after a step
succeeded, and touches them only between steps, never mid-round. Two fragment-sized buffers per
fragment: 2 x model fp32 of host memory over all fragments.

Data path: a round's streams go over direct TCP connections between groupmates where they can
be opened (``direct.py``; each reducing averager listens on a port advertised in its gathered
metadata; every message sealed with AES-256-GCM, ``seal.py``), else through the p2p daemon.

These overrides touch hivemind internals, hence the exact pin ``hivemind==1.1.12`` and
``tests/test_hivemind_transport.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any, AsyncIterator, Optional

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.dht import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter
from hivemind.utils.mpfuture import MPFuture

from opendiloco_stream.compression import Codec, native
from opendiloco_stream.transport.hivemind.direct import DirectListener, FailedAddresses, RunningGroups, serve_connections
from opendiloco_stream.transport.hivemind.forked import renew_torch_thread_pool
from opendiloco_stream.transport.hivemind.protocol import as_protobufs
from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner, RoundError
from opendiloco_stream.transport.hivemind.seal import DirectSecurity
from opendiloco_stream.transport.hivemind.timeouts import BACKSTOP_S, RoundTimeouts

logger = logging.getLogger(__name__)

# hivemind logs every failed step with a traceback; the host reports it as SyncFailed instead.
_NOISY_LOGGERS = ("hivemind.averaging.averager", "hivemind.averaging.matchmaking", "hivemind.averaging.allreduce",
                  "hivemind.averaging.key_manager",
                  "hivemind.averaging.partition", "hivemind.p2p.p2p_daemon")


def _keep_freed_memory() -> None:
    """In the averager process: let glibc's malloc keep freed chunks for reuse rather than hand them
    back to the kernel. A round allocates and frees a few buffers per ~1 MB chunk; paging fresh
    memory back in cost more than the copies themselves (9k page faults per 10M-element round)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: keep its defaults
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum: chunk-sized buffers come from the heap
    libc.mallopt(m_trim_threshold, 512 << 20)  # and stay there once freed


def _hold_pending_tasks() -> None:
    """In the averager process's event loop: keep every task it creates until the task is done.
    asyncio holds tasks only weakly. hivemind cancels a step's matchmaking without awaiting it
    (``DecentralizedAverager._step``); the cancelled search then withdraws this peer's DHT
    declaration, awaiting the DHT process through an ``MPFuture`` that is held only weakly too.
    A garbage collection in that moment destroyed the pending tasks ("Task was destroyed but it
    is pending!") and left the matchmaking half torn down: every later step of the fragment failed
    at once and its groupmates found no group (tests/test_hivemind_transport.py, the abandoned round)."""
    loop = asyncio.get_running_loop()
    held: set = set()
    make = loop.get_task_factory()

    def make_held(loop, coro, **kwargs):
        task = make(loop, coro, **kwargs) if make is not None else asyncio.Task(coro, loop=loop, **kwargs)
        held.add(task)
        task.add_done_callback(held.discard)
        return task

    loop.set_task_factory(make_held)


def cancel_step(step: StepControl) -> None:
    """``StepControl.cancel`` with its signals in the order that makes the averager stop. hivemind
    wakes the averager (the step's cancel future) before it marks the step cancelled (its shared
    state), and the woken averager goes on matching unless the step reads as cancelled. An averager
    woken in between (the host's thread descheduled there, on a busy machine) kept the abandoned
    round matching until its window ended. The fragment's next round then waited for it, and its
    groupmates waited as long (3 of 30 rounds after an abandoned one, 5.6 s each, on loopback).
    Marking first, then waking, closes that gap."""
    if step._trigger is not None:
        step._trigger.cancel()
    MPFuture.cancel(step)  # the shared state: this process created the step
    if step._cancel is not None and not step._cancel.done():
        step._cancel.set_result(None)


class FragmentAverager(DecentralizedAverager):
    """The averager of one fragment (prefix ``{run_id}_f{fragment}``); see the module docstring."""

    runner_cls = HvAllReduceRunner

    def __init__(self, numel: int, dht: DHT, *, prefix: str, codec: Codec, timeouts: RoundTimeouts,
                 chunk_bytes: int, norm_bound: Optional[float], target_group_size: Optional[int],
                 client_mode: bool, startup_timeout: float = 60.0, admission: Optional[Any] = None,
                 direct: bool = True, direct_port: int = 0, direct_plaintext: bool = False):
        self.admission = admission  # net/auth.py Admission: what groupmates must prove (None: nothing)
        self.input_buffer = torch.zeros(numel, dtype=torch.float32)
        super().__init__(
            [self.input_buffer], dht, start=False, prefix=prefix, target_group_size=target_group_size,
            min_group_size=2, min_matchmaking_time=timeouts.matchmaking, request_timeout=timeouts.request,
            allreduce_timeout=timeouts.allreduce + BACKSTOP_S, next_chunk_timeout=timeouts.next_chunk,
            client_mode=client_mode, allow_state_sharing=False, daemon=True, shutdown_timeout=5.0,
        )
        self.output_buffer = torch.zeros(numel, dtype=torch.float32).share_memory_()
        self.codec, self.timeouts = codec, timeouts
        self.chunk_bytes, self.norm_bound = chunk_bytes, norm_bound
        # direct TCP data path (direct.py): a listener if we reduce; addresses that failed us
        self.direct, self.direct_failed, self._direct_task = direct, FailedAddresses(), None
        self.direct_security = DirectSecurity(direct_plaintext, getattr(admission, "auth", None))  # seal.py
        self._direct = DirectListener.for_dht(dht, direct_port) if direct and not client_mode else None
        self._groups = RunningGroups(self._running_groups)  # (the same dict, in the averager process after the fork)
        native.available()  # build/load the codec kernels here: the averager inherits them loaded
        self.start()  # fork: the buffers above are shared, the host's threads are not copied
        if self._direct is not None:
            self._direct.sock.close()  # the averager process holds the listening socket now
        self.wait_until_ready(timeout=startup_timeout)

    def step(self, gather: Any = None, **kwargs: Any):
        """hivemind's step, with this peer's metadata sealed for its groupmates' admission checks."""
        if self._direct is not None and isinstance(gather, dict):
            gather = dict(gather, direct=self._direct.addresses)  # where to stream our part (direct.py)
        if self.admission is not None:
            gather = self.admission.seal(gather, self.peer_id.to_bytes())
        return super().step(gather=gather, **kwargs)

    # ------------------------------------------------------------------ matchmaking
    @property
    def _matchmaking(self) -> Matchmaking:
        return self._ods_matchmaking

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:
        """hivemind's matchmaking (made in the averager process), except that a search that found
        no group fails the step at once: hivemind would first wait for the step's trigger, so a
        step formed ahead (``require_trigger``, lane.py) that found nobody would look like one
        whose group formed until its round triggered it, and that round would then fail."""
        _hold_pending_tasks()  # hivemind sets this in its event loop before it takes any step
        look_for_group = matchmaking.look_for_group

        async def look_for_group_or_fail(step: StepControl) -> GroupInfo:
            group = await look_for_group(step)
            if group is None:
                raise MatchmakingException("Averaging step failed: could not find a group")
            return group

        matchmaking.look_for_group = look_for_group_or_fail
        self._ods_matchmaking = matchmaking

    # ------------------------------------------------------------------ process lifecycle
    def run(self) -> None:
        # The host handles Ctrl-C and shuts us down; if the host dies without doing so, so do we.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        renew_torch_thread_pool()  # before any thread of ours or hivemind's runs a torch op
        hivemind_level = os.environ.get("ODS_HIVEMIND_LOG", "CRITICAL").upper()  # DEBUG to debug matchmaking
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(hivemind_level)
        threading.Thread(target=self._exit_with_parent, daemon=True).start()
        _keep_freed_memory()
        super().run()

    def _exit_with_parent(self) -> None:
        parent = self._parent_pid
        while os.getppid() == parent:  # no event tells us: poll (Linux's PDEATHSIG follows the forking thread)
            time.sleep(1.0)
        os._exit(0)

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        """Serving starts here (in the averager process): hivemind's handlers and our direct listener."""
        await super().add_p2p_handlers(p2p, *args, **kwargs)
        if self._direct is not None and self._direct_task is None:
            self._direct_task = asyncio.ensure_future(
                serve_connections(self._direct, self._groups, self.prefix, self.timeouts.next_chunk,
                                  self.direct_security))

    async def _shutdown(self, timeout: Optional[float]) -> None:
        if self._direct_task is not None:
            self._direct_task.cancel()
            self._direct.close()
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if not future.done():
                future.cancel()
        await self._p2p.shutdown()  # closes our client of the p2p daemon and removes its socket file

    def close(self, timeout: float = 5.0) -> None:
        """Stop the averager process; SIGKILL it if it does not stop within ``timeout``."""
        if self.is_alive():
            try:
                self._outer_pipe.send(("_shutdown", [timeout], {}))
                self._inner_pipe.send(("_SHUTDOWN", None))  # ends hivemind's state-fetcher thread in the host
            except (OSError, ValueError):
                pass
            self.join(timeout)
        if self.is_alive():
            logger.warning("averager %s (pid %s) did not stop within %.0fs: killing it", self.prefix, self.pid, timeout)
            self.kill()
            self.join(timeout)

    def shutdown(self) -> None:
        self.close(self.shutdown_timeout)

    def set_target_group_size(self, size: Optional[int]) -> MPFuture:
        """From the next step on, a leader starts the round as soon as ``size`` peers are in its
        group (``None``: at the matchmaking deadline); set before each round (presence.py)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [size], dict(future=future)))
        return future

    async def _set_target_group_size(self, size: Optional[int], future: MPFuture) -> None:
        self._matchmaking.target_group_size = size
        # hivemind draws the next group bits from `target` buckets, which fails for a larger group
        # than this peer's own target; ours are set before every round anyway
        self._matchmaking.group_key_manager.target_group_size = None
        future.set_result(None)

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        # hivemind names handlers after the class; subclasses (test fakes) must reach plain peers
        name = f"FragmentAverager.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, but the leader keeps the stream open until the follower closes it:
        otherwise BEGIN_ALLREDUCE is sometimes lost in flight (see protocol.py, "Closing") and the
        follower misses a group the others run with it. A follower that fails this peer's
        admission (run key, fingerprint) is refused before hivemind sees it."""
        why = None if self.admission is None else self.admission.check_gathered(request.gather,
                                                                                context.remote_id.to_bytes())
        if why is not None:
            logger.info("%s: refused %s: %s", self.prefix, context.remote_id, why)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in self._matchmaking.rpc_join_group(request, context):
            yield response
        await asyncio.sleep(self.timeouts.request)  # cancelled as soon as the follower closes

    # ------------------------------------------------------------------ the all-reduce
    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """hivemind's registration of a running group, and a wake-up for the streams waiting for it."""
        with super()._register_allreduce_group(group_info):
            self._groups.notify()
            yield

    async def _aggregate_with_group(self, group_info: GroupInfo, **_allreduce_kwargs) -> dict:
        registered = self._running_groups[group_info.group_id]
        try:
            why = None if self.admission is None else self.admission.check_group(group_info.peer_ids,
                                                                                 group_info.gathered)
            if why is not None:  # a leader that admitted an outsider: reduce nothing with it
                raise RoundError("rejected", f"group refused: {why}")
            runner = self.runner_cls(
                p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, group_info=group_info,
                tensor=self.input_buffer, codec=self.codec, timeouts=self.timeouts,
                norm_bound=self.norm_bound, direct_failed=self.direct_failed if self.direct else None,
                result=self.output_buffer, sent=self.input_buffer,  # sent: in place of what it encoded
                direct_security=self.direct_security)
        except RoundError as e:
            registered.set_exception(e)
            registered.exception()  # retrieved: a late sender's handler may never look at it
            raise
        registered.set_result(runner)
        return await runner.run()  # it wrote output_buffer and, lossy, input_buffer (read only if it succeeds)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Route a groupmate's stream to the runner of its group."""
        try:
            request = await asyncio.wait_for(anext(stream), self.timeouts.next_chunk)
        except (Exception, StopAsyncIteration) as e:
            logger.info("%s: a stream from %s ended before its first message: %r", self.prefix, context.remote_id, e)
            return
        # A groupmate's stream may arrive before our own round is registered or its runner built
        # (our BEGIN_ALLREDUCE still in flight, or this process starved of CPU): wait as long as a
        # sender may stay silent before its first contribution, not just one matchmaking request.
        deadline = asyncio.get_event_loop().time() + self.timeouts.next_chunk
        await self._groups.find(lambda g: g == request.group_id, deadline)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        if future.cancelled():  # we are shutting down
            yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
            return
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - asyncio.get_event_loop().time()))
        except Exception as e:  # the runner could not start (e.g. mismatching peers): the sender fails too
            logger.info("%s: no runner for the stream from %s: %r", self.prefix, context.remote_id, e)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        async for message in as_protobufs(runner.serve(achain(as_aiter(request), stream), context.remote_id)):
            yield message
