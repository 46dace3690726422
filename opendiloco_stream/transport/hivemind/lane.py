"""One fragment's lane: the worker thread that runs its rounds in order on the averaging service,
and the handle of a pending round (``HivemindSyncHandle``; ``HivemindTransport`` in ``transport.py``
owns one lane per fragment).

A round on the lane: wait until the fragment's previous round is over, check the outer gradient
(finite; a CPU fp32 view of it, copied only if it lives elsewhere), plan the group size
(``presence.py``), then hand the fragment's endpoint (``endpoint.py``, the lane's one collaborator
for a round) the round's coroutine (``FragmentEndpoint.group_for`` then ``run_round``) and wait
for it, never past the handle's deadline.

A round may have its group formed ahead (``prematch``, a few inner steps before its sync): the
lane starts forming it as soon as the fragment's previous round is over, and the round itself then
goes straight to the exchange, so matchmaking (a DHT announcement and lookups, a join request:
tens of ms on loopback, several round trips over a WAN) leaves the round's critical path. The
group's metadata then holds the weight predicted at that time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Hashable, Optional

import torch

from opendiloco_stream.compression import all_finite
from opendiloco_stream.transport.base import OuterDigest, SyncFailed, SyncHandle, SyncResult
from opendiloco_stream.transport.failure import FailureReason
from opendiloco_stream.transport.hivemind.endpoint import FragmentEndpoint, RoundSummary
from opendiloco_stream.transport.hivemind.presence import Presence, RoundPlan
from opendiloco_stream.transport.hivemind.timeouts import RoundTimeouts

logger = logging.getLogger(__name__)


class HivemindSyncHandle(SyncHandle):
    """A pending round; ``wait`` never blocks past ``deadline`` (monotonic seconds)."""

    def __init__(self, key: Hashable, deadline: float):
        self.key, self.deadline = key, deadline
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result: Optional[SyncResult] = None
        self._failure: Optional[tuple[FailureReason, str]] = None
        self.lane: Optional["_Lane"] = None  # set when submitted

    def done(self) -> bool:
        return self._event.is_set()

    def settle(self, timeout: float) -> bool:
        return self._event.wait(max(0.0, timeout))

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def takes_newcomers(self) -> bool:
        return not self.done() and self.lane is not None and self.lane.takes_newcomers(self)

    def abandon(self) -> bool:
        return self.done() or (self.lane is not None and self.lane.abandon(self))

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        bound = self.remaining() if timeout is None else min(max(0.0, timeout), self.remaining())
        if not self._event.wait(bound):
            raise SyncFailed(f"round {self.key}: no result within {bound:.1f}s", key=self.key,
                             reason=FailureReason.TIMEOUT)
        if self._failure is not None:
            reason, message = self._failure
            raise SyncFailed(message, key=self.key, reason=reason)
        return self._result

    def _settle(self, result: Optional[SyncResult], failure: Optional[tuple[FailureReason, str]]) -> bool:
        with self._lock:  # the first outcome wins (close() may race the worker)
            if self._event.is_set():
                return False
            self._result, self._failure = result, failure
            self._event.set()
            return True

    def succeed(self, result: SyncResult) -> None:
        self._settle(result, None)

    def fail(self, reason: FailureReason, message: str) -> None:
        if self._settle(None, (reason, message)):
            logger.info("round %s failed (%s): %s", self.key, reason, message)


# A peer that joins with the initial-model marker (peers started together) needs a few seconds to
# reach a round the others are matching: its start, a step, and presence's beat to see the round
# launched. A round whose window ends sooner is closed to it: it downloads the state after the round.
NEWCOMER_LEAD_S = 3.0


class _Early:
    """A group being formed ahead of its round (``_Lane.prematch``)."""

    def __init__(self, key: tuple, future: concurrent.futures.Future, weight: float):
        self.key, self.future, self.weight = key, future, weight


class _Prematch:
    """A queued request to form round ``key``'s group ahead (``_Lane.prematch``)."""

    def __init__(self, key: tuple, weight: float, lead_s: float, digest: Optional[OuterDigest] = None):
        self.key, self.weight, self.lead_s, self.digest = key, weight, lead_s, digest


class _Current:
    """The round the worker runs now: its coroutine's future and whether its group formed."""

    def __init__(self, handle: HivemindSyncHandle, expected: Optional[int] = None, window: float = 0.0,
                 awaited: frozenset = frozenset()):
        self.handle, self.future, self.expected = handle, None, expected  # expected: the group's target
        self.window = window  # how long its group may take to form
        self.awaited = awaited  # joiners on their way it waits for (``RoundPlan.awaited``)
        self.match_deadline = time.monotonic() + window  # when its matchmaking window ends
        self.formed = threading.Event()


def cpu_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flat, fp32, contiguous, on the CPU: a view where it already is, else one copy."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous():
        return flat
    return flat.to(device="cpu", dtype=torch.float32).contiguous()


class _Lane:
    """One fragment: the worker thread that runs its rounds in order on the averaging service."""

    def __init__(self, fragment: int, endpoint: FragmentEndpoint, timeouts: RoundTimeouts,
                 presence: Optional[Presence] = None, target: Optional[int] = None):
        self.fragment, self.endpoint, self.timeouts = fragment, endpoint, timeouts
        # a fixed target_group_size wins over the live count of presence.py
        self.presence, self.target, self.live_target = presence, target, presence is not None and target is None
        self.numel = endpoint.numel
        self._queue: "queue.Queue[Optional[object]]" = queue.Queue()
        self._lock = threading.Lock()  # abandon() against the worker starting a round
        self._current: Optional[_Current] = None
        self._previous: Optional[concurrent.futures.Future] = None  # the last round's coroutine
        self._early: Optional[_Early] = None  # a group formed ahead of its round (worker thread only)
        self._thread = threading.Thread(target=self._loop, name=f"hv-fragment-{fragment}", daemon=True)
        self._thread.start()

    def submit(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float,
               digest: Optional[OuterDigest] = None) -> None:
        handle.lane = self
        self._queue.put((handle, tensor, weight, digest))

    def prematch(self, key: tuple, weight: float, lead_s: float = 0.0, digest: Optional[OuterDigest] = None) -> None:
        """Form round ``key``'s group before the round is submitted (in order with the rounds:
        after the previous one is over), expected in ``lead_s`` seconds: the group waits for its
        members as long after that moment as a round's matchmaking does. ``weight`` goes into the
        group's metadata now. If no group forms in time, or the next round submitted is another
        one, the early group is dropped and the round matches as usual. ``digest`` (theta_bar's
        fingerprint, if known this early) goes into the metadata too."""
        self._queue.put(_Prematch(tuple(key), float(weight), float(lead_s), digest))

    def takes_newcomers(self, handle: HivemindSyncHandle) -> bool:
        """Whether ``handle``'s round is queued, or matching with no target (see ``SyncHandle``)
        for at least ``NEWCOMER_LEAD_S`` more seconds."""
        with self._lock:
            current = self._current
            if current is None or current.handle is not handle:
                return True  # queued or being prepared: its plan counts whoever announced by then
            return (current.expected is None and not current.formed.is_set()
                    and current.match_deadline - time.monotonic() >= NEWCOMER_LEAD_S)

    def abandon(self, handle: HivemindSyncHandle) -> bool:
        """Fail ``handle`` now if its round has no group yet (queued, being prepared, or matching:
        its matchmaking is cancelled); False for a round already exchanging data."""
        with self._lock:
            current = self._current if self._current is not None and self._current.handle is handle else None
            if current is not None and current.formed.is_set():
                return handle.done()
            handle.fail(FailureReason.MATCHMAKING, f"round {handle.key} abandoned before its group formed: this "
                                                   f"peer caught up with the swarm, which moved past it")
            if current is not None and current.future is not None:
                current.future.cancel()
            return True

    def early_state(self) -> Optional[str]:
        """The group formed ahead, if any: "MATCHING", "FORMED" (waiting for its round) or "FAILED"."""
        early = self._early
        if early is None:
            return None
        if not early.future.done():
            return "MATCHING"
        return "FAILED" if early.future.cancelled() or early.future.exception() is not None else "FORMED"

    # ------------------------------------------------------------------ the worker
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._drop_early()
                return
            if isinstance(item, _Prematch):
                try:
                    self._prematch(item.key, item.weight, item.lead_s, item.digest)
                except BaseException:  # the round itself still runs (and matches as usual)
                    logger.exception("forming the group of round %s ahead failed", item.key)
                continue
            handle = item[0]
            if handle.done():
                if self._early is not None and self._early.key == tuple(handle.key):
                    self._drop_early()  # abandoned: its group must not wait for us longer than needed
                continue
            try:
                self._run(*item)
            except BaseException as e:  # a bug must fail the round, not kill the lane
                logger.exception("round %s crashed", handle.key)
                handle.fail(FailureReason.FAILED, repr(e))
            finally:
                self._current = None
                self.timeouts = self.endpoint.refresh_timeouts()  # the next rounds' bounds, from this round's links

    def _drop_early(self) -> None:
        """Stop forming the group ahead, if any (a group that formed loses this peer)."""
        early, self._early = self._early, None
        if early is not None and early.future.cancel():
            logger.info("fragment %d: dropping the group being formed ahead for round %s", self.fragment, early.key)

    def _previous_over(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the fragment's last round's coroutine has ended."""
        previous = self._previous
        if previous is None or previous.done():
            return True
        try:
            previous.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return previous.done()
        except BaseException:
            pass
        return True

    def _announce(self, round_index: int, plan: bool) -> Optional[RoundPlan]:
        """The round's announcement (which others' catch-up reads) and, for a live group size,
        its plan (one DHT lookup); None without presence or plan."""
        if self.presence is None:
            return None
        return self.presence.before_round(self.fragment, round_index, plan=plan and self.live_target)

    def _prematch(self, key: tuple, weight: float, lead_s: float, digest: Optional[OuterDigest] = None) -> None:
        self._drop_early()
        # the fragment's previous round may still be exchanging (eager, overlap: it runs behind the
        # steps); wait for it until the round is due at most, then form the group with what is left
        t0 = time.monotonic()
        if not self._previous_over(lead_s) or self.endpoint.closed:
            return  # the round matches when it is submitted
        lead_s = max(0.0, lead_s - (time.monotonic() - t0))
        plan = self.presence.plan_round(self.fragment, int(key[1])) if self.live_target else None
        if plan is not None and plan.skip:
            return  # the round is skipped (``_run`` says why)
        target = self.target if plan is None else plan.target
        future = self.endpoint.submit(self.endpoint.form_group(key, weight, target, lead_s + self.timeouts.matchmaking,
                                                               digest=digest))
        self._early = _Early(key, future, weight)

    def _take_early(self, key: tuple) -> Optional[_Early]:
        """The group formed ahead for round ``key`` if it is still good; any other is dropped."""
        early = self._early
        if early is None:
            return None
        if early.key != tuple(key) or (early.future.done() and (early.future.cancelled()
                                                                or early.future.exception() is not None)):
            if early.key == tuple(key):
                logger.info("fragment %d: no group formed ahead for round %s: matching now", self.fragment, key)
            self._drop_early()
            return None
        self._early = None
        return early

    def _run(self, handle: HivemindSyncHandle, tensor: torch.Tensor, weight: float,
             digest: Optional[OuterDigest] = None) -> None:
        fragment, round_index = handle.key
        if not self._previous_over(handle.remaining()):
            handle.fail(FailureReason.TIMEOUT, f"the previous round of fragment {fragment} is still running")
            return
        t_start = time.time()
        flat = self._stage(handle, tensor)
        if flat is None:
            self._drop_early()
            return
        early = self._take_early(handle.key)
        # A fragment's later rounds are never skipped: their plan (a DHT lookup, one or two round
        # trips at a distance) is made while the group forms, and its target reaches the
        # matchmaking when it is known (``_plan_later``); a first round is planned before it starts.
        later = early is None and self.live_target and self.presence.announced(fragment)
        expected, window, awaited = None, self.timeouts.matchmaking, frozenset()
        if not later:
            plan = self._announce(int(round_index), plan=early is None)  # a group formed ahead needs no plan
            if plan is not None and plan.skip:
                handle.fail(FailureReason.JOINING, f"first round of fragment {fragment} in a running swarm: this peer "
                                                   f"takes part from round {round_index + 1} on (the others did not "
                                                   f"count it)")
                return
            expected = self.target if plan is None else plan.target
            if plan is not None and plan.joiner:  # a joiner still on its way is counted or awaited: wait for it
                window, awaited = self.timeouts.joiner_wait, plan.awaited
        current = _Current(handle, expected, window, awaited)
        with self._lock:
            if handle.done():  # abandoned (or closed) while it was prepared
                if early is not None:
                    early.future.cancel()
                return
            self._current = current
            t_step = time.time()
            current.future = self._previous = self.endpoint.submit(
                self._round(handle.key, flat, weight, expected, early, current, digest))
        if later:
            self._plan_later(int(round_index), current)
        self._finish(handle, current, t_start, t_step)

    def _plan_later(self, round_index: int, current: _Current) -> None:
        """Announce and plan a round already forming its group; hand the plan's target to its
        matchmaking (``FragmentEndpoint.set_target``)."""
        plan = self._announce(round_index, plan=True)
        if plan is None or plan.skip:  # (a later round is never skipped)
            return
        current.expected = plan.target
        counted = plan.joiner and plan.target is not None
        self.endpoint.set_target(round_index, plan.target, self.timeouts.joiner_wait if counted else None)
        if plan.awaited:
            self.endpoint.await_peers(round_index, plan.awaited, self.timeouts.joiner_wait)

    def await_joiner(self, round_index: int, joiner: str) -> None:
        """A donor served ``joiner`` for round ``round_index`` (the initial-model marker while the
        round forms, or its state before it): the round, forming or not yet, waits for it past
        its window (``Matchmaker.await_peers``)."""
        self.endpoint.await_peers(round_index, frozenset([joiner]), self.timeouts.joiner_wait)

    async def _round(self, key: tuple, flat: torch.Tensor, weight: float, target: Optional[int],
                     early: Optional[_Early], current: _Current, digest: Optional[OuterDigest] = None) -> RoundSummary:
        """(On the service's loop.) The group, formed ahead or now, then the exchange."""
        # the buffers the round decodes into, faulted in on an executor thread while the group forms
        buffers = asyncio.get_event_loop().run_in_executor(None, self.endpoint.round_buffers, flat.numel())
        try:
            # live group sizes: a leader may hold the round for a joiner this peer did not count
            hold = self.timeouts.joiner_wait if self.live_target else None
            group = await self.endpoint.group_for(key, weight, target, current.window,
                                                  None if early is None else early.future, current.awaited,
                                                  self.timeouts.matchmaking, hold, digest)
        finally:
            result, sent = await buffers  # (also on failure: the executor thread is not left behind)
        return await self.endpoint.run_round(group, flat, formed=current.formed, result=result, sent=sent)

    def _stage(self, handle: HivemindSyncHandle, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The tensor as the round reads it (``cpu_fp32``); None (``handle`` failed) if it is not
        finite or the service is closed."""
        flat = cpu_fp32(tensor)
        if not all_finite(flat):
            handle.fail(FailureReason.REJECTED, "the outer gradient holds NaN or Inf: not sent")
            return None
        if self.endpoint.closed:
            handle.fail(FailureReason.CLOSED, "transport closed")
            return None
        return flat

    def _finish(self, handle: HivemindSyncHandle, current: _Current, t_start: float, t_step: float) -> None:
        try:
            summary = current.future.result(timeout=handle.remaining())
        except concurrent.futures.TimeoutError:
            current.future.cancel()
            handle.fail(FailureReason.TIMEOUT, f"round not finished within {self.timeouts.round_bound:.1f}s")
            return
        except concurrent.futures.CancelledError:
            handle.fail(FailureReason.MATCHMAKING, f"round {handle.key} was cancelled before its group formed")
            return
        except BaseException as e:
            handle.fail(*self.endpoint.failure(e, current.formed.is_set()))
            return
        handle.succeed(summary.sync_result(t_start, t_step, time.time(), current.expected))

    def close(self) -> None:
        """Fail what is queued and the running round ("closed"), stop the worker."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and not isinstance(item, _Prematch):
                item[0].fail(FailureReason.CLOSED, "transport closed")
        current = self._current
        if current is not None:
            current.handle.fail(FailureReason.CLOSED, "transport closed")
            if current.future is not None:
                current.future.cancel()
        self._queue.put(None)
        self._thread.join(timeout=self.timeouts.request)
