"""One fragment's lane: its averager process and the worker thread that runs its rounds in order,
and the handle of a pending round (``HivemindTransport`` in ``transport.py`` owns one lane per fragment).

A round on the lane: wait for the fragment's previous step, check the outer gradient and copy it
into the averager's shared buffer (one pass), plan the group size (``presence.py``), send the
round's settings and step down the averager's pipe, wait, and copy the result out.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Hashable, Optional

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.timed_storage import get_dht_time

from opendiloco_stream.compression import all_finite, native
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult
from opendiloco_stream.transport.hivemind.averager import FragmentAverager
from opendiloco_stream.transport.hivemind.presence import Presence
from opendiloco_stream.transport.hivemind.protocol import round_group_bits
from opendiloco_stream.transport.hivemind.round_report import round_phases
from opendiloco_stream.transport.hivemind.runner import RoundError
from opendiloco_stream.transport.hivemind.timeouts import RoundTimeouts
from opendiloco_stream.transport.reduce import member_metadata

logger = logging.getLogger(__name__)


class HivemindSyncHandle(SyncHandle):
    """A pending round; ``wait`` never blocks past ``deadline`` (monotonic seconds)."""

    def __init__(self, key: Hashable, deadline: float):
        self.key, self.deadline = key, deadline
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result: Optional[SyncResult] = None
        self._failure: Optional[tuple[str, str]] = None
        self._lane: Optional["_Lane"] = None  # set when submitted

    def done(self) -> bool:
        return self._event.is_set()

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def abandon(self) -> bool:
        return self.done() or (self._lane is not None and self._lane.abandon(self))

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        bound = self.remaining() if timeout is None else min(max(0.0, timeout), self.remaining())
        if not self._event.wait(bound):
            raise SyncFailed(f"round {self.key}: no result within {bound:.1f}s", key=self.key, reason="timeout")
        if self._failure is not None:
            reason, message = self._failure
            raise SyncFailed(message, key=self.key, reason=reason)
        return self._result

    def _settle(self, result: Optional[SyncResult], failure: Optional[tuple[str, str]]) -> bool:
        with self._lock:  # the first outcome wins (close() may race the worker)
            if self._event.is_set():
                return False
            self._result, self._failure = result, failure
            self._event.set()
            return True

    def succeed(self, result: SyncResult) -> None:
        self._settle(result, None)

    def fail(self, reason: str, message: str) -> None:
        if self._settle(None, (reason, message)):
            logger.info("round %s failed (%s): %s", self.key, reason, message)


def _classify(error: BaseException, step: StepControl) -> tuple[str, str]:
    if isinstance(error, RoundError):
        return error.reason, error.message
    if isinstance(error, TimeoutError):
        return "timeout", f"all-reduce did not finish in time: {error!r}"
    if not step.began_allreduce:
        return "matchmaking", f"no group formed: {error}"
    return "failed", repr(error)


def _check_settings(settings: list, timeout: float) -> None:
    """The settings sent before a step were applied (their answers came before the step's: one pipe)."""
    for future in settings:
        future.result(timeout=timeout)  # raises what the averager raised


class _Lane:
    """One fragment: its averager process and the worker thread that runs its rounds in order."""

    def __init__(self, fragment: int, averager: FragmentAverager, timeouts: RoundTimeouts,
                 presence: Optional[Presence] = None, target: Optional[int] = None):
        self.fragment, self.averager, self.timeouts = fragment, averager, timeouts
        # a fixed target_group_size wins over the live count of presence.py
        self.presence, self._target, self.live_target = presence, target, presence is not None and target is None
        self.numel = averager.input_buffer.numel()
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._current: Optional[HivemindSyncHandle] = None
        self._step: Optional[StepControl] = None  # the last step; never touch the buffers before it is done
        self._pipe_lock = threading.Lock()  # hivemind's control pipe is not safe for concurrent senders
        # abandon() against the worker creating the step: a handle either gets no step or is cancelled
        self._step_lock = threading.Lock()
        self._step_handle: Optional[HivemindSyncHandle] = None
        self._thread = threading.Thread(target=self._loop, name=f"hv-fragment-{fragment}", daemon=True)
        self._thread.start()

    def submit(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float) -> None:
        handle._lane = self
        self._queue.put((handle, tensor, weight))

    def abandon(self, handle: HivemindSyncHandle) -> bool:
        """Fail ``handle`` now if its round has no group yet: queued or being prepared (the worker
        then creates no step for it), or its step still in matchmaking (cancelled; the next round
        waits until the averager has stopped it before touching the buffers)."""
        with self._step_lock:
            step = self._step if self._step_handle is handle else None
            if step is not None and (step.done() or step.began_allreduce):
                return step.done()
            handle.fail("matchmaking", f"round {handle.key} abandoned before its group formed: this peer caught "
                                       f"up with the swarm, which moved past it")
            if step is not None:
                step.cancel()
            return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle = item[0]
            if handle.done():
                continue
            self._current = handle
            try:
                self._run(*item)
            except BaseException as e:  # a bug must fail the round, not kill the lane
                logger.exception("round %s crashed", handle.key)
                handle.fail("failed", repr(e))
            finally:
                self._current = None

    def _run(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float) -> None:
        fragment, round_index = handle.key
        if self._step is not None and not self._step.done():
            try:
                self._step.result(timeout=handle.remaining())
            except TimeoutError:
                if not self._step.done():
                    handle.fail("timeout", f"the previous round of fragment {fragment} is still running")
                    return
            except BaseException:
                pass  # it failed; it is over, which is all we need
        if self._step is not None and self._step.cancelled() and not self._stopped(self._step, handle.remaining()):
            handle.fail("timeout", f"the abandoned round of fragment {fragment} did not stop in time")
            return
        t_start = time.time()
        flat = tensor.detach().reshape(-1)
        buffer = self.averager.input_buffer  # free: the previous step is done
        if flat.dtype == torch.float32 and native.usable(flat):
            finite = native.copy_finite(flat, buffer)  # the check and the copy in one pass
        else:
            finite = all_finite(flat)
            if finite:
                buffer.copy_(flat)
        if not finite:
            handle.fail("rejected", "the outer gradient holds NaN or Inf: not sent")
            return
        if not self.averager.is_alive():
            handle.fail("closed", f"the averager of fragment {fragment} is gone")
            return
        # the announcement others' catch-up reads; a plan (a DHT lookup) only for a live group size
        plan = None if self.presence is None else self.presence.before_round(fragment, int(round_index),
                                                                             plan=self.live_target)
        if self.live_target and plan.skip:
            handle.fail("joining", f"first round of fragment {fragment} in a running swarm: this peer takes "
                                   f"part from round {round_index + 1} on (the others did not count it)")
            return
        gather = member_metadata(self.averager.codec, self.numel, (fragment, round_index), weight)
        with self._pipe_lock:
            # No round trip for the settings: the averager runs its pipe's commands in order, and
            # these setters finish before the step's matchmaking starts (``_check_settings`` below).
            settings = [self.averager.set_group_bits(round_group_bits(int(round_index)), wait=False)]
            if self.live_target and plan.target != self._target:
                settings.append(self.averager.set_target_group_size(plan.target))
                self._target = plan.target
            t_step = time.time()
            with self._step_lock:
                if handle.done():  # abandoned (or closed) while it was prepared
                    return
                self._step = step = self.averager.step(
                    gather=gather, weight=float(weight), scheduled_time=get_dht_time() + self.timeouts.matchmaking,
                    timeout=self.timeouts.group_deadline, allow_retries=False, wait=False)
                self._step_handle = handle
        try:
            summary = step.result(timeout=handle.remaining())
        except TimeoutError:
            if not step.done():
                handle.fail("timeout", f"round not finished within {self.timeouts.round_bound:.1f}s")
                return
            reason, message = _classify(step.exception(), step)
            handle.fail(reason, message)
            return
        except BaseException as e:
            reason, message = _classify(e, step)
            handle.fail(reason, message)
            return
        _check_settings(settings, self.timeouts.request)
        average = native.fresh_copy(self.averager.output_buffer)
        if summary.get("sent_is_input"):  # lossless fp32: the averager sent our tensor as it is
            cpu32 = flat.device.type == "cpu" and flat.dtype == torch.float32
            sent = flat if cpu32 else native.fresh_copy(self.averager.input_buffer)  # (not sent_buffer: unwritten)
        else:
            sent = native.fresh_copy(self.averager.sent_buffer)
        handle.succeed(SyncResult(
            average=average, sent=sent, phases=round_phases(t_start, t_step, summary.get("marks", {}), time.time()),
            group_size=summary["group_size"], weight_share=summary["weight_share"],
            bytes_sent=summary["bytes_sent"], bytes_received=summary["bytes_received"], peers=summary["peers"],
            included_self=summary["included_self"], rejected=summary["rejected"], expected_size=self._target))

    @staticmethod
    def _stopped(step: StepControl, timeout: float) -> bool:
        """Whether a cancelled step's coroutine in the averager has ended (it no longer reads the
        buffers), waiting up to ``timeout``: a cancel that raced the group's start lets it run on."""
        deadline = time.monotonic() + timeout
        while step.stage != AveragingStage.FINISHED:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        while True:  # fail what is queued, then stop the worker
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].fail("closed", "transport closed")
        current = self._current
        if current is not None:
            current.fail("closed", "transport closed")
        self._queue.put(None)
        got_pipe = self._pipe_lock.acquire(timeout=self.timeouts.request)
        try:
            self.averager.close()
        finally:
            if got_pipe:
                self._pipe_lock.release()
        self._thread.join(timeout=self.timeouts.request)
