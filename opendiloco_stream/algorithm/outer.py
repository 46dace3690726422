"""The outer optimizer and the update rules of each mode (pure tensor math, no I/O).

Notation (docs/algorithm.md): ``theta_bar`` outer parameters (fp32), ``d`` outer gradient
``theta_bar - theta_local`` (old minus new), ``avg`` the group's average of quantized outer
gradients, ``q`` deQ(Q(d)) exactly as this peer sent it, ``share`` this peer's weight share.
"""

from __future__ import annotations

from typing import Optional

import torch


class OuterOptimizer:
    """SGD with (Nesterov) momentum on one fragment's fp32 outer parameters.

    ``step(outer_grad)`` sets ``.grad`` of the outer parameters from a flat tensor and steps.
    """

    def __init__(self, outer_params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        self.params = outer_params
        self.steps = 0  # outer steps taken since construction (a restored state counts as one)
        self.opt = torch.optim.SGD(outer_params, lr=lr, momentum=momentum,
                                   nesterov=nesterov and momentum > 0)

    def split(self, outer_grad: torch.Tensor) -> list[torch.Tensor]:
        """The flat outer gradient as one view per parameter (its shape, device and dtype)."""
        total = sum(p.numel() for p in self.params)
        if total != outer_grad.numel():
            raise ValueError(f"outer gradient has {outer_grad.numel()} elements, fragment has {total}")
        out, offset = [], 0
        for p in self.params:
            out.append(outer_grad[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype))
            offset += p.numel()
        return out

    def step(self, outer_grad: torch.Tensor) -> None:
        for p, g in zip(self.params, self.split(outer_grad)):
            p.grad = g
        self.opt.step()
        self.steps += 1
        for p in self.params:
            p.grad = None

    def lookahead(self, outer_grad: torch.Tensor, scale: Optional[float] = None,
                  out: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
        """The parameters ``step(outer_grad * scale)`` would produce, without changing any state.

        ``scale`` is applied one parameter at a time and ``out`` (tensors shaped like the
        parameters) receives the result: with both, no fragment-sized temporary is made. The values
        are the same either way, bit for bit."""
        group = self.opt.param_groups[0]
        lr, beta, nesterov = group["lr"], group["momentum"], group["nesterov"]
        result = []
        for i, (p, g) in enumerate(zip(self.params, self.split(outer_grad))):
            if scale is not None:
                g = g * scale
            if beta > 0:
                buf = self.opt.state.get(p, {}).get("momentum_buffer")
                buf = g.clone() if buf is None else buf * beta + g
                g = g + buf * beta if nesterov else buf
            result.append(torch.sub(p, g * lr, out=out[i]) if out is not None else p - g * lr)
        return out if out is not None else result  # ``out`` itself: callers may test identity

    def state_dict(self) -> dict:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state)
        self.steps = max(self.steps, 1)


def eager_estimate(d: torch.Tensor, prev_avg: torch.Tensor, prev_sent: torch.Tensor, prev_share: float) -> torch.Tensor:
    """``d_tilde = avg_{k-1} + (d_k - q_{k-1}) * share_{k-1}``.

    The peer swaps its own stale contribution ``q_{k-1}`` (weighted by its share of round k-1) for
    its fresh outer gradient ``d_k``; the others' contributions arrive one round late.
    """
    return prev_avg + (d - prev_sent) * prev_share


def projected_estimate(d: torch.Tensor, prev_avg: torch.Tensor, prev_sent: torch.Tensor) -> torch.Tensor:
    """``c * d_k`` with ``c = <q_{k-1}, avg_{k-1}> / |q_{k-1}|^2`` clipped to [0, 1].

    ``c`` is the least-squares coefficient of last round's average on this peer's own contribution
    to it: how much of the group's step the peer's own outer gradient predicted. Identical peers
    give c = 1; peers with orthogonal contributions give c = share.
    """
    return d * projection_coefficient(prev_avg, prev_sent)


def projection_coefficient(prev_avg: torch.Tensor, prev_sent: torch.Tensor) -> float:
    """The ``c`` of :func:`projected_estimate`: all it needs from round k-1, so a peer may keep
    this number instead of the round's two tensors."""
    denom = float(prev_sent.pow(2).sum())
    return 0.0 if denom == 0.0 else min(1.0, max(0.0, float((prev_sent * prev_avg).sum()) / denom))


def joiner_estimate(d: torch.Tensor, prev_avg: torch.Tensor, prev_group_size: int) -> torch.Tensor:
    """Eager estimate for a peer that was not in round k-1 (a late joiner holding a donor's avg).

    Treats the peer as if it had contributed the average itself in a group one larger:
    ``avg + (d - avg) / (M + 1)``.
    """
    return prev_avg + (d - prev_avg) / (prev_group_size + 1)


def overlap_merge(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """``theta_local <- alpha * theta_local + (1 - alpha) * theta_tilde`` (inner-step overlap)."""
    return local * alpha + global_ * (1.0 - alpha)
