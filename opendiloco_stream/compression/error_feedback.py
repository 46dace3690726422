"""Error feedback: carry each round's quantization error into the next round's outer gradient.

Per key (e.g. a fragment index)::

    compensated = ef.compensate(key, delta)      # delta + decay * residual (residual starts at zero)
    sent = codec.roundtrip(compensated)          # what actually goes on the wire
    ef.update(key, compensated, sent)            # residual = compensated - sent

The sum of what was sent then tracks the sum of the true deltas up to one residual, however coarse
the codec: the error is delayed, never lost (with ``decay`` 1, the default; a decay below 1 lets
old residuals fade, as SparseLoCo's error-feedback momentum does).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class ErrorFeedback:
    """Per-key fp32 residuals ``d - deQ(Q(d))``, checkpointable through ``state_dict``.

    A residual lives on the device of the tensors it was computed from; ``state_dict`` returns CPU
    copies and loaded residuals move to the device of the next ``compensate`` call.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The current residual for ``key`` (None before the first ``update``); do not modify it."""
        return self._residuals.get(key)

    def compensate(self, key: Hashable, d: torch.Tensor) -> torch.Tensor:
        """Return a new fp32 tensor ``d + decay * residual[key]``; ``d`` itself is left untouched."""
        residual = self._residuals.get(key)
        if residual is None:
            return d.detach().to(torch.float32, copy=True)
        d32 = d.detach().to(torch.float32)
        if residual.shape != d32.shape:
            raise ValueError(
                f"error-feedback residual for {key!r} has shape {tuple(residual.shape)} but the tensor has "
                f"{tuple(d32.shape)}; call reset({key!r}) after changing what the key stands for"
            )
        if residual.device != d32.device:
            residual = residual.to(d32.device)
            self._residuals[key] = residual
        return d32 + residual if self.decay == 1.0 else d32 + residual * self.decay

    def update(self, key: Hashable, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Set ``residual[key] = compensated - sent`` (``sent`` may be flat, e.g. fresh from decode)."""
        if sent.numel() != compensated.numel():
            raise ValueError(
                f"error-feedback update for {key!r}: sent has {sent.numel()} elements, "
                f"compensated has {compensated.numel()}"
            )
        sent = sent.detach().to(device=compensated.device, dtype=torch.float32).reshape(compensated.shape)
        self._residuals[key] = compensated.detach().to(torch.float32) - sent

    def reset(self, key: Hashable) -> None:
        """Forget the residual of ``key`` (no-op if there is none)."""
        self._residuals.pop(key, None)

    def state_dict(self) -> dict:
        """CPU copies of all residuals: ``{"residuals": {key: tensor}}``."""
        return {"residuals": {key: r.detach().cpu().clone() for key, r in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace all residuals with those of ``state`` (as returned by ``state_dict``)."""
        if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
            raise ValueError("error-feedback state must be a dict with a 'residuals' dict")
        residuals = {}
        for key, r in state["residuals"].items():
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                raise ValueError(f"error-feedback state: residual for {key!r} is not a float tensor")
            residuals[key] = r.detach().to(torch.float32).clone()
        self._residuals = residuals
