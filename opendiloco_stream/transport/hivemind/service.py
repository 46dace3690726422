"""The averaging service: one asyncio loop in a background thread of the trainer process.

It owns what the rounds of every fragment share: a replica of the DHT's p2p daemon client
(``DHT.replicate_p2p``: hivemind's public API), the event loop the rounds, the group formation
(``matchmaking.py``), the direct data path (``direct.py``) and the late joiners' state service
(``state.py``) run on, the executor threads that encode, check and reduce chunks, and a lock
around the DHT's control pipe (which is not safe for concurrent senders: ``presence.py`` takes
the same lock).

Threads of the trainer (a fragment's lane, ``lane.py``) hand it coroutines with :meth:`submit`
and wait on the returned ``concurrent.futures.Future`` without touching the loop. Nothing is
forked: the tensors a round reads and writes are the trainer's own (no shared-memory copies).

The loop is uvloop's where it is importable (``new_loop``): its socket calls and callbacks cost
less CPU per message than the default selector loop's (``benchmarks/event_loop.py`` measures both
in one run), which counts on the 2-4 cores a peer shares with its training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Coroutine, Optional

from hivemind.p2p import P2P

from opendiloco_stream.transport.hivemind.buffers import BufferPool

logger = logging.getLogger(__name__)

# hivemind logs a stream broken by a peer that left with a traceback; the round reports it as SyncFailed.
_NOISY_LOGGERS = ("hivemind.p2p.p2p_daemon", "hivemind.p2p.p2p_daemon_bindings.control")

CODEC_THREADS = 4  # executor threads for a round's chunk work (encode, check, reduce, decode)
DHT_THREADS = 4  # threads that wait for the DHT's answers (a slow DHT must not hold up chunk work)
LOOP_KINDS = ("auto", "uvloop", "asyncio")


def new_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A fresh event loop: ``uvloop`` (ImportError if it is missing), ``asyncio`` (the default
    selector loop), or ``auto``: uvloop when importable, else asyncio's."""
    if kind not in LOOP_KINDS:
        raise ValueError(f"event loop kind must be one of {', '.join(LOOP_KINDS)}, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop  # lazy: optional (no Windows build); the default loop is the fallback
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: what ``new_loop`` made."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


class AveragingService:
    """The loop thread and the p2p client every fragment of one peer uses (see the module docstring).

    Args:
        dht: the running ``hivemind.DHT`` (the caller owns it).
        dht_lock: held around every call down the DHT's control pipe (shared with ``Presence``).
        request_timeout: bound on one DHT call made for the service.
        startup_timeout: bound on connecting to the p2p daemon.
        loop: which event loop (``new_loop``: ``auto`` takes uvloop when it is importable).
        pin_buffers: the rounds' result buffers in pinned host memory (a peer training on a GPU).
    """

    def __init__(self, dht: Any, dht_lock: threading.Lock, *, request_timeout: float, startup_timeout: float = 30.0,
                 loop: str = "auto", pin_buffers: bool = False):
        self.dht, self.dht_lock, self.request_timeout = dht, dht_lock, request_timeout
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.loop = new_loop(loop)
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(CODEC_THREADS, "ods-codec"))
        self._dht_pool = concurrent.futures.ThreadPoolExecutor(DHT_THREADS, "ods-dht")
        self.buffers = BufferPool(pinned=pin_buffers)  # what rounds decode into, shared by the fragments (buffers.py)
        self._thread = threading.Thread(target=self.loop.run_forever, name="ods-averaging", daemon=True)
        self._thread.start()
        self.closed = False
        try:
            self.p2p = self.call(self._connect(), startup_timeout)
        except BaseException:
            self._stop_loop()
            raise
        self.peer_id = self.p2p.peer_id

    async def _connect(self) -> Any:
        """A client of the DHT's p2p daemon of our own (bound to this loop; ``DHT.replicate_p2p``
        caches one per DHT object, which a second service in the process would share across loops)."""

        def ask() -> Any:
            with self.dht_lock:
                return self.dht.run_coroutine(daemon_listen_maddr)
        return await P2P.replicate(await self.loop.run_in_executor(self._dht_pool, ask))

    # ------------------------------------------------------------------ from other threads
    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run ``coro`` on the loop; cancelling the returned future cancels it there."""
        return asyncio.run_coroutine_threadsafe(_observed(coro), self.loop)

    def call(self, coro: Coroutine, timeout: float) -> Any:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the averaging service did not answer within {timeout:.1f}s") from None

    # ------------------------------------------------------------------ on the loop
    async def dht_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``dht.<method>(*args, **kwargs)`` (``store`` or ``get``) without blocking the loop."""
        def blocking() -> Any:
            with self.dht_lock:
                future = getattr(self.dht, method)(*args, return_future=True, **kwargs)
            return future.result(timeout=self.request_timeout)
        return await self.loop.run_in_executor(self._dht_pool, blocking)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float = 5.0) -> None:
        """Close the p2p client (the DHT and its daemon keep running) and stop the loop thread."""
        if self.closed:
            return
        self.closed = True
        try:
            self.call(self.p2p.shutdown(), timeout)  # our client of the daemon, and its socket file
        except Exception as e:
            logger.debug("the averaging service's p2p client did not close cleanly: %r", e)
        self._stop_loop(timeout)
        self.buffers.clear()

    def _stop_loop(self, timeout: float = 5.0) -> None:
        pending: Optional[concurrent.futures.Future] = None
        if self.loop.is_running():
            pending = asyncio.run_coroutine_threadsafe(_cancel_tasks(), self.loop)
            try:
                pending.result(timeout)
            except Exception as e:
                logger.debug("tasks of the averaging service did not stop cleanly: %r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self._dht_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.loop.close()  # (and shuts its executor down without waiting)


async def daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    """In the DHT process (``DHT.run_coroutine``): where its p2p daemon listens for clients."""
    return node.p2p.daemon_listen_maddr


async def _observed(coro: Coroutine) -> Any:
    """``coro``, in a task whose outcome is always read: a caller that cancelled its future (an
    abandoned round) no longer reads it, and an error the coroutine still ends with would be
    reported by asyncio as "never retrieved" (the caller's side already failed the round)."""
    asyncio.current_task().add_done_callback(_read_outcome)
    return await coro


def _read_outcome(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a call whose caller stopped waiting ended with %r", task.exception())


async def _cancel_tasks() -> None:
    """Cancel every task of the loop but the caller, and wait (bounded) until they ended."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=2.0)
