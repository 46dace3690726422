"""What the training loop asks of the wrapper around the model and optimizer, as one typed protocol.

``StreamingDiLoCo`` (``algorithm/diloco.py``), the data-parallel baseline (:class:`LoopDataParallel`
here: ``DataParallel`` with the two answers it has no use for itself), a multi-rank peer's
``Replicated`` (``train/ranks.py``) and a sharded peer's ``Sharded`` (``train/sharded.py``) all
satisfy :class:`Wrapper`, so the loop calls them alike and never looks for an attribute.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import nn

from opendiloco_stream.algorithm.data_parallel import DataParallel
from opendiloco_stream.algorithm.diloco import wrap
from opendiloco_stream.algorithm.fragments import Fragment
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.transport.base import Transport


class Wrapper(Protocol):
    """The wrapper's side of the training loop (one ``step`` per inner step, then ``finish``)."""

    waits_in_optimizer_step: bool  # the average is awaited inside optimizer.step() (data-parallel)

    @property
    def fragments(self) -> list[Fragment]: ...
    @property
    def step_count(self) -> int: ...  # inner steps taken; jumps ahead when a late peer catches up
    @property
    def in_flight(self) -> bool: ...  # rounds launched whose result has not landed yet
    @property
    def stats(self) -> SyncStats: ...

    def step(self, tokens: Optional[int] = None) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], *, joiner: bool = False) -> None: ...

    def missed_rounds(self) -> list[tuple[int, int]]:
        """Rounds a joiner's downloaded state is already behind (empty: none, or no rounds)."""
        ...

    def expect_rounds_after(self, step: int, since: Optional[float] = None) -> None:
        """A joiner downloading a state of ``step``: announce now that it takes part in the rounds
        after that step, so the swarm waits for it there (no-op where there are no rounds)."""
        ...

    def global_params(self) -> Optional[ContextManager[None]]:
        """A block in which the model holds the run's consensus parameters, or None where the model
        is that consensus already (data-parallel) or this rank keeps none (a mirror rank)."""
        ...


class LoopDataParallel(DataParallel):
    """``DataParallel`` as a :class:`Wrapper`: every step is averaged, so nothing is ever missed and
    the model itself is the consensus."""

    def missed_rounds(self) -> list[tuple[int, int]]:
        return []

    def expect_rounds_after(self, step: int, since: Optional[float] = None) -> None:
        return None

    def global_params(self) -> None:
        return None


def build_wrapper(model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport, config: DiLoCoConfig,
                  blocks: list[nn.Module], param_access: Any = None,
                  on_event: Optional[Callable[[dict[str, Any]], None]] = None) -> Wrapper:
    """``algorithm.wrap``'s wrapper for ``config.mode``, as a :class:`Wrapper`."""
    if config.mode == "data-parallel" and param_access is None:
        return LoopDataParallel(model, optimizer, transport, config, blocks=blocks, on_event=on_event)
    return wrap(model, optimizer, transport, config, blocks=blocks, on_event=on_event, param_access=param_access)
