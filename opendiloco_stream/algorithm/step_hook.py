"""The ``with`` form of a wrapper: its ``step`` runs inside the inner optimizer's ``step()``.

::

    with StreamingDiLoCo(model, opt, transport=..., config=...) as diloco:
        for batch in data:
            loss(model, batch).backward()
            diloco.count_tokens(batch.numel())  # optional: the round's weight
            opt.step()                          # diloco.step() runs after it (a step post-hook)
            opt.zero_grad()

Entering registers a step post-hook on the optimizer (torch's ``register_step_post_hook``);
leaving removes it and closes the wrapper. It is the explicit loop -- ``opt.step()`` then
``diloco.step(tokens=...)`` -- with the call made by the optimizer, so both give the same bits.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any, Optional, TypeVar

import torch
from torch.utils.hooks import RemovableHandle


_W = TypeVar("_W", bound="StepHooked")


class StepHooked(abc.ABC):
    """A wrapper whose ``step(tokens)`` follows every inner optimizer step; as a context manager,
    the optimizer calls it (module docstring)."""

    optimizer: torch.optim.Optimizer
    _hook_tokens: int = 0  # tokens counted for the next optimizer step
    _step_hook: Optional[RemovableHandle] = None  # set inside a with block

    @abc.abstractmethod
    def step(self, tokens: Optional[int] = None) -> None:
        """Once after every inner optimizer step."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop using the transport."""

    def count_tokens(self, tokens: int) -> None:
        """Tokens of the batch the next optimizer step trains on (the ``with`` form's ``tokens``)."""
        self._hook_tokens += int(tokens)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tokens, self._hook_tokens = self._hook_tokens, 0
        self.step(tokens=tokens)

    def __enter__(self: _W) -> _W:
        if self._step_hook is not None:
            raise RuntimeError(f"{type(self).__name__} is already in a with block")
        self._step_hook = self.optimizer.register_step_post_hook(self._after_optimizer_step)
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        hook, self._step_hook = self._step_hook, None
        if hook is not None:
            hook.remove()
        self.close()
