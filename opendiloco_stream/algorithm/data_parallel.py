"""The data-parallel baseline: gradients averaged through the same transport at every inner step.

It has the same surface as :class:`StreamingDiLoCo` (``step``, ``stats``, ``events``,
``state_dict``, ``close``) so one training loop runs both; build either with
:func:`opendiloco_stream.algorithm.wrap`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.step_hook import StepHooked
from opendiloco_stream.algorithm.sync_log import HasSyncLog, SyncLog
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import Transport


MAX_STEPS_BEHIND = 64  # how far past its next round one catch-up looks


class DataParallel(HasSyncLog, StepHooked):
    """Averages gradients inside ``optimizer.step()`` (a step pre-hook), every inner step.

    The wait for the average happens inside the optimizer step; ``waits_in_optimizer_step`` tells a
    training loop to count it as communication, not compute. ``with DataParallel(...)`` calls
    ``step()`` from a step post-hook as well (``step_hook.py``).
    """

    waits_in_optimizer_step = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                 config: DiLoCoConfig, blocks: Optional[list[nn.Module]] = None,
                 on_event: Optional[Callable[[dict[str, Any]], None]] = None):
        del blocks  # one fragment: the whole model
        self.model, self.optimizer, self.transport, self.config = model, optimizer, transport, config
        self.step_count = 0
        self.log = SyncLog(on_event, config.record_digests)
        self._lock = threading.RLock()
        self._closed = False
        params = [p for p in model.parameters() if p.requires_grad]
        self.fragments = [fr.Fragment(index=0, names=[n for n, p in model.named_parameters() if p.requires_grad],
                                      params=params)]
        self.transport.prepare({0: self.fragments[0].numel})
        self._hook = optimizer.register_step_pre_hook(self._average_gradients)

    def step(self, tokens: Optional[int] = None) -> None:
        """Call once after every inner optimizer step (the averaging already happened inside it)."""
        if self._closed:
            raise RuntimeError("DataParallel.step() after close()")
        with self._lock:
            self.step_count += 1
            self._catch_up()

    def _round_late(self, step: int) -> bool:
        return self.transport.round_late((0, step))

    def _catch_up(self) -> None:
        """A peer behind the swarm takes the swarm's step: when the others launched the round after
        this peer's next one a while ago, its next round is over for them, and this peer's next
        round key (and the training loop's step) jumps to the latest one they launched."""
        t = self.step_count
        if not self._round_late(t + 2):
            return
        target = t + 2
        while target < t + 1 + MAX_STEPS_BEHIND and self._round_late(target + 1):
            target += 1
        self.step_count = target - 1
        self.log.stats.caught_up_steps += target - 1 - t
        self.log.emit({"event": "catch_up", "from_step": t, "to_step": target - 1})

    def _average_gradients(self, optimizer, args, kwargs) -> None:
        params = self.fragments[0].params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        t = self.step_count + 1
        handle = self.transport.all_reduce((0, t), fr.flatten(grads), weight=1.0)
        # a round the swarm moved past (it launched the next one) is given up rather than waited out
        give_up = (lambda: self._round_late(t + 1)) if self.transport.watches_swarm else None
        result, reason, waited = self.log.wait(handle, self.config.sync_timeout, give_up=give_up)
        if result is not None:
            for p, g in zip(params, fr.unflatten(result.average, grads)):
                if p.grad is None:
                    p.grad = g.to(p.device, p.dtype, copy=True)  # the transport's result is on the CPU
                else:
                    p.grad.copy_(g)
        self.log.record(0, t, self.step_count, result, reason, waited, "average" if result is not None else "local-only")

    @property
    def in_flight(self) -> bool:
        return False

    def finish(self) -> None:
        """Nothing is ever in flight between two steps."""

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"step": self.step_count, "mode": "data-parallel"}

    def load_state_dict(self, state: dict[str, Any], *, joiner: bool = False) -> None:
        with self._lock:
            self.step_count = int(state["step"])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._hook.remove()
