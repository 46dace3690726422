"""One fragment's lane: its averager process and the worker thread that runs its rounds in order,
and the handle of a pending round (``HivemindTransport`` in ``transport.py`` owns one lane per fragment).

A round on the lane: wait for the fragment's previous step, check the outer gradient and copy it
into the averager's shared buffer (one pass), plan the group size (``presence.py``), send the
round's settings and step down the averager's pipe, wait, and copy the result out.

A round may have its group formed ahead (``prematch``, a few inner steps before its sync): the
lane then starts the step with hivemind's ``require_trigger`` as soon as the fragment's previous
round is over, and the round itself only copies its tensor in and triggers the all-reduce, so
matchmaking (a DHT declaration and lookups, a join request: 60-110 ms on loopback, several round
trips over a WAN) leaves the round's critical path. The group's metadata then holds the weight
predicted at that time.
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
from opendiloco_stream.transport.hivemind.averager import FragmentAverager, cancel_step
from opendiloco_stream.transport.hivemind.presence import Presence, RoundPlan
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

    def settle(self, timeout: float) -> bool:
        return self._event.wait(max(0.0, timeout))

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


class _Early:
    """A step started ahead of its round (``_Lane.prematch``): matchmaking, then waiting for the trigger."""

    def __init__(self, key: tuple, step: StepControl, settings: list, weight: float):
        self.key, self.step, self.settings, self.weight = key, step, settings, weight


class _Prematch:
    """A queued request to form round ``key``'s group ahead (``_Lane.prematch``)."""

    def __init__(self, key: tuple, weight: float, lead_s: float):
        self.key, self.weight, self.lead_s = key, weight, lead_s


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
        self._early: Optional[_Early] = None  # a group formed ahead of its round (worker thread only)
        self._thread = threading.Thread(target=self._loop, name=f"hv-fragment-{fragment}", daemon=True)
        self._thread.start()

    def submit(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float) -> None:
        handle._lane = self
        self._queue.put((handle, tensor, weight))

    def prematch(self, key: tuple, weight: float, lead_s: float = 0.0) -> None:
        """Form round ``key``'s group before the round is submitted (in order with the rounds:
        after the previous one is over), expected in ``lead_s`` seconds: the group waits for its
        members as long after that moment as a round's matchmaking does. ``weight`` goes into the
        group's metadata now; the round's own weight, if it differs, is not used. If no group
        forms in time, or the next round submitted is another one, the early step is dropped and
        the round matches as usual."""
        self._queue.put(_Prematch(tuple(key), float(weight), float(lead_s)))

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
                cancel_step(step)
            return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._drop_early()
                return
            if isinstance(item, _Prematch):
                try:
                    self._prematch(item.key, item.weight, item.lead_s)
                except BaseException:  # the round itself still runs (and matches as usual)
                    logger.exception("forming the group of round %s ahead failed", item.key)
                continue
            handle = item[0]
            if handle.done():
                if self._early is not None and self._early.key == tuple(handle.key):
                    self._drop_early()  # abandoned: its group must not wait for us longer than needed
                continue
            self._current = handle
            try:
                self._run(*item)
            except BaseException as e:  # a bug must fail the round, not kill the lane
                logger.exception("round %s crashed", handle.key)
                handle.fail("failed", repr(e))
            finally:
                self._current = None

    def _drop_early(self) -> None:
        """Cancel the step formed ahead, if any (its group, if it formed, loses this peer)."""
        early, self._early = self._early, None
        if early is None:
            return
        if not early.step.done():
            logger.info("fragment %d: dropping the group formed ahead for round %s", self.fragment, early.key)
        if not early.step.triggered:  # (a step that found no group too: hivemind warns of untriggered steps)
            cancel_step(early.step)

    def _previous_over(self) -> bool:
        """Whether the fragment's last step is over (a cancelled one: its coroutine ended too)."""
        step = self._step
        return step is None or (step.done() and (not step.cancelled() or self._stopped(step, 0.0)))

    def _prematch(self, key: tuple, weight: float, lead_s: float) -> None:
        fragment, round_index = key
        self._drop_early()
        if not self._previous_over() or not self.averager.is_alive():
            return  # the round matches when it is submitted
        plan = self.presence.plan_round(fragment, int(round_index)) if self.live_target else None
        if plan is not None and plan.skip:
            return  # the round is skipped (``_run`` says why)
        step, settings, _ = self._start_step(key, weight, plan, lead_s)
        self._early = _Early(key, step, settings, weight)

    def _start_step(self, key: tuple, weight: float, plan: Optional[RoundPlan], lead_s: float = 0.0,
                    handle: Optional[HivemindSyncHandle] = None) -> tuple[Optional[StepControl], list, float]:
        """Send round ``key``'s settings (group bits, the planned group size) and its step down the
        averager's pipe; its matchmaking window ends ``matchmaking`` after ``lead_s`` from now.
        With ``handle``, the step of that submitted round (None if it was abandoned meanwhile);
        without, a step formed ahead, waiting for its trigger. Returns the step, the settings'
        futures and when the step was sent."""
        gather = member_metadata(self.averager.codec, self.numel, key, weight, self.averager.chunk_bytes)
        with self._pipe_lock:
            # No round trip for the settings: the averager runs its pipe's commands in order, and
            # these setters finish before the step's matchmaking starts (``_check_settings``).
            settings = [self.averager.set_group_bits(round_group_bits(int(key[1])), wait=False)]
            if plan is not None and plan.target != self._target:
                settings.append(self.averager.set_target_group_size(plan.target))
                self._target = plan.target
            t_step = time.time()
            args = dict(gather=gather, weight=float(weight), allow_retries=False, wait=False,
                        scheduled_time=get_dht_time() + lead_s + self.timeouts.matchmaking,
                        timeout=lead_s + self.timeouts.group_deadline, require_trigger=handle is None)
            if handle is None:
                return self.averager.step(**args), settings, t_step
            with self._step_lock:
                if handle.done():  # abandoned (or closed) while it was prepared
                    return None, settings, t_step
                self._step = step = self.averager.step(**args)
                self._step_handle = handle
            return step, settings, t_step

    def _take_early(self, key: tuple) -> Optional[_Early]:
        """The step formed ahead for round ``key`` if it is still good (matching or waiting for
        the trigger); any other is dropped."""
        early = self._early
        if early is None:
            return None
        if early.key != tuple(key) or early.step.done():
            if early.step.done() and early.key == tuple(key):
                logger.info("fragment %d: no group formed ahead for round %s (%r): matching now", self.fragment,
                            key, early.step.exception())
            self._drop_early()
            return None
        self._early = None
        return early

    def _run(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float) -> None:
        fragment, round_index = handle.key
        early = self._take_early(handle.key)
        if early is not None:
            self._run_early(handle, tensor, weight, early)
            return
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
        flat = self._stage(handle, tensor)  # the buffer is free: the previous step is done
        if flat is None:
            return
        # the announcement others' catch-up reads; a plan (a DHT lookup) only for a live group size
        plan = None if self.presence is None else self.presence.before_round(fragment, int(round_index),
                                                                             plan=self.live_target)
        if self.live_target and plan.skip:
            handle.fail("joining", f"first round of fragment {fragment} in a running swarm: this peer takes "
                                   f"part from round {round_index + 1} on (the others did not count it)")
            return
        step, settings, t_step = self._start_step(handle.key, weight, plan, handle=handle)
        if step is not None:
            self._finish(handle, step, settings, flat, t_start, t_step)

    def _stage(self, handle: HivemindSyncHandle, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """Check the tensor and copy it into the averager's input buffer; None (``handle``
        failed) if it is not finite or the averager is gone."""
        flat = tensor.detach().reshape(-1)
        buffer = self.averager.input_buffer
        if flat.dtype == torch.float32 and native.usable(flat):
            finite = native.copy_finite(flat, buffer)  # the check and the copy in one pass
        else:
            finite = all_finite(flat)
            if finite:
                buffer.copy_(flat)
        if not finite:
            handle.fail("rejected", "the outer gradient holds NaN or Inf: not sent")
            return None
        if not self.averager.is_alive():
            handle.fail("closed", f"the averager of fragment {self.fragment} is gone")
            return None
        return flat

    def _run_early(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float, early: _Early) -> None:
        """The round of a group formed ahead: the runner reads the input buffer only once triggered."""
        fragment, round_index = handle.key
        t_start = time.time()
        flat = self._stage(handle, tensor)
        if flat is None:
            cancel_step(early.step)
            return
        logger.debug("round %s: triggering its group formed ahead (%s; weight %s, the round's own %s)",
                     handle.key, early.step.stage.name, early.weight, weight)
        if self.presence is not None:  # the announcement others' catch-up reads, at the launch
            self.presence.before_round(fragment, int(round_index), plan=False)
        with self._step_lock:
            if handle.done():  # abandoned (or closed) while it was prepared
                cancel_step(early.step)
                return
            self._step, self._step_handle = early.step, handle
            t_step = time.time()
            early.step.allow_allreduce()
        self._finish(handle, early.step, early.settings, flat, t_start, t_step)

    def _finish(self, handle: HivemindSyncHandle, step: StepControl, settings: list, flat: torch.Tensor,
                t_start: float, t_step: float) -> None:
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
        # lossless fp32: the averager sent our tensor as it is; lossy: it wrote deQ(Q(.)) over its input
        cpu32 = flat.device.type == "cpu" and flat.dtype == torch.float32
        sent = flat if summary.get("sent_is_input") and cpu32 else native.fresh_copy(self.averager.input_buffer)
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
            if item is not None and not isinstance(item, _Prematch):
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
