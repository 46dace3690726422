"""A round's work on executor threads, so that the round ends only once none of it still runs.

The runner encodes, checks, reduces and decodes chunks on the averaging service's executor threads
(``run_in_executor``), and several of those jobs write the round's tensors: what was sent, the
average. Cancelling the task that awaits a job does not stop the thread. Each round decodes into
tensors of its own, so a late write cannot reach another round; still, a round (and the lane
waiting for it) must not end while its threads work on the trainer's outer gradient or compete
with the next round for the codec threads.

:class:`RoundJobs` counts the jobs running; :meth:`RoundJobs.finish` refuses new ones (a job queued
before it but started after it does nothing) and waits until the running ones are done. The runner
calls it in ``run()``'s ``finally``, so a step is over only once its threads are.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)


class RoundClosed(RuntimeError):
    """A job asked for after the round ended."""


class RoundJobs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self.closed = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the event loop's default executor; ``RoundClosed`` once the round ended."""
        if self.closed:
            raise RoundClosed("the round is over")
        return await asyncio.get_event_loop().run_in_executor(None, self._job, fn, args)

    def _job(self, fn: Callable[..., Any], args: tuple) -> Any:  # (executor thread)
        with self._lock:
            if self.closed:  # queued before the round ended, started after
                raise RoundClosed("the round is over")
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1

    @property
    def running(self) -> int:
        return self._running

    def close(self) -> None:
        """No job starts from now on (under the lock: a job either counted itself first, or sees this)."""
        with self._lock:
            self.closed = True

    async def finish(self, what: str, timeout: float = 30.0, poll: float = 0.001) -> bool:
        """:meth:`close`, then wait until no job runs; False (and a warning) if some still ran after
        ``timeout`` (a job never takes that long: one chunk's work is milliseconds)."""
        self.close()
        deadline = time.monotonic() + timeout
        while self._running:
            if time.monotonic() >= deadline:
                logger.warning("%s: %d job(s) still running %.0f s after it ended", what, self._running, timeout)
                return False
            await asyncio.sleep(poll)
        return True
