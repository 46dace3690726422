"""The outer optimizer and the update rules of each mode (pure tensor math, no I/O).

Notation (docs/algorithm.md): ``theta_bar`` outer parameters (fp32), ``d`` outer gradient
``theta_bar - theta_local`` (old minus new), ``avg`` the group's average of quantized outer
gradients, ``q`` deQ(Q(d)) exactly as this peer sent it, ``share`` this peer's weight share.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch

from opendiloco_stream.algorithm.staging import OuterView


class OuterOptimizer:
    """SGD with (Nesterov) momentum on one fragment's fp32 outer parameters.

    ``step(outer_grad)`` steps every parameter with its part of a flat outer gradient. The step
    works one parameter at a time (:meth:`step_each`), in place: besides the momentum buffers (outer
    state, made at the first step) it holds at most one parameter's temporary, never a
    fragment-sized one. Its arithmetic is torch's SGD (``torch.optim.sgd``'s single-tensor form),
    op for op, so the values are those ``torch.optim.SGD.step`` gives on the CPU, bit for bit; the
    state lives in ``self.opt`` (a ``torch.optim.SGD``: its ``state_dict`` is the checkpoint's).
    It never writes into a gradient it was lent: torch's foreach form (its default on CUDA) adds
    the momentum into the gradients in place, so stepping with views of a landed average, as
    ``SGD.step`` was used before, overwrote that average on a GPU.
    """

    def __init__(self, outer_params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        self.params = outer_params
        self.steps = 0  # outer steps taken since construction (a restored state counts as one)
        # flat fragment tensors (a landed average, what was sent, an outer gradient) per parameter
        self.view = OuterView(outer_params)
        self.opt = torch.optim.SGD(outer_params, lr=lr, momentum=momentum,
                                   nesterov=nesterov and momentum > 0)

    def split(self, outer_grad: torch.Tensor) -> list[torch.Tensor]:
        """The flat outer gradient as one view per parameter (its shape, device and dtype)."""
        return list(self.pieces(outer_grad))

    def pieces(self, outer_grad: torch.Tensor) -> Iterator[torch.Tensor]:
        """:meth:`split` one parameter at a time (:meth:`OuterView.pieces`): a piece on another
        device (a landed average in the transport's host buffer, for a GPU outer state) or in
        another dtype is copied only when it is reached, so at most one copied piece exists at
        once; a piece already where the parameter is, is a view (zero copies)."""
        return self.view.pieces(outer_grad)

    def step(self, outer_grad: torch.Tensor) -> None:
        self.step_each(self.pieces(outer_grad))

    def step_each(self, grads: Iterable[torch.Tensor], owned: bool = False) -> None:
        """One outer step, parameter i stepped with the i-th of ``grads`` (one per parameter, in
        order; a generator may make each when it is asked for). ``owned``: the grads are scratch
        tensors the step may overwrite (Nesterov's ``g + m * buf`` is then made in place, as
        torch's foreach SGD does); otherwise it makes one parameter's temporary."""
        count = 0
        for i, g in enumerate(grads):
            self.step_param(i, g, owned)
            count += 1
            del g  # before the next is made
        if count != len(self.params):
            raise ValueError(f"outer step with {count} gradients for {len(self.params)} parameters")
        self.count_step()

    def step_param(self, i: int, g: torch.Tensor, owned: bool = False) -> None:
        """Parameter i's part of an outer step (a rule that works parameter by parameter calls it
        for each, then :meth:`count_step` once). Holds at most one temporary shaped like it."""
        group = self.opt.param_groups[0]
        if group["weight_decay"] != 0 or group["maximize"]:
            raise ValueError("the outer optimizer has no weight decay and does not maximize")
        lr, momentum, dampening, nesterov = group["lr"], group["momentum"], group["dampening"], group["nesterov"]
        p = self.params[i]
        with torch.no_grad():
            if momentum != 0:
                state = self.opt.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.detach().clone()
                else:
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                if nesterov:
                    g = g.add_(buf, alpha=momentum) if owned else g.add(buf, alpha=momentum)
                else:
                    g = buf
            p.add_(g, alpha=-lr)

    def count_step(self) -> None:
        """An outer step was taken (every parameter stepped)."""
        self.steps += 1

    def lookahead(self, outer_grad: torch.Tensor, scale: Optional[float] = None,
                  out: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
        """The parameters ``step(outer_grad * scale)`` would produce, without changing any state.

        ``out`` (tensors shaped like the parameters) receives the result; with it the look-ahead
        holds one parameter's temporary at a time (:meth:`lookahead_each`)."""
        return self.lookahead_each(self.pieces(outer_grad), scale=scale, out=out)

    def lookahead_each(self, grads: Iterable[torch.Tensor], scale: Optional[float] = None,
                       out: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
        """:meth:`lookahead` with one gradient per parameter (a generator may make each in
        ``out[i]`` itself: ``out[i]`` is written only once its gradient was read, and last).

        Per parameter: ``g <- g * scale``; ``buf <- buf * beta + g`` (``g`` at the first step);
        ``g <- g + buf * beta`` (Nesterov) or ``buf``; the result ``p - g * lr``. The same ops as
        ever, some in place on one scratch tensor (additions are commutative in IEEE arithmetic,
        so ``x + g`` in place is ``g + x``): the values are the same, bit for bit."""
        group = self.opt.param_groups[0]
        lr, beta, nesterov = group["lr"], group["momentum"], group["nesterov"]
        result = []
        for i, (p, g) in enumerate(zip(self.params, grads)):
            o = out[i] if out is not None else None
            if scale is not None:
                g = torch.mul(g, scale, out=o) if o is not None else g * scale
            if beta > 0:
                old = self.opt.state.get(p, {}).get("momentum_buffer")
                if old is None:  # buf = g.clone(); g + buf * beta
                    t = g * beta if nesterov else g.clone()
                else:  # buf * beta + g
                    t = old * beta
                    t.add_(g)
                    if nesterov:
                        t.mul_(beta)
                if nesterov:
                    t.add_(g)
                t.mul_(lr)
            else:
                t = g * lr
            result.append(torch.sub(p, t, out=o) if o is not None else p - t)
            del t, g
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


def eager_estimate_each(d: torch.Tensor, prev_avg: torch.Tensor, prev_sent: torch.Tensor, prev_share: float,
                        pieces: Callable[[torch.Tensor], Iterable[torch.Tensor]],
                        out: Optional[list[torch.Tensor]] = None) -> Iterator[torch.Tensor]:
    """:func:`eager_estimate` one parameter at a time (``pieces`` splits a flat fragment tensor
    into per-parameter views): each made in ``out[i]``, or in a new temporary, when it is asked
    for. The same ops; the addition of ``avg`` in place (IEEE addition is commutative): the same
    bits."""
    for i, (d_, avg, sent) in enumerate(zip(pieces(d), pieces(prev_avg), pieces(prev_sent))):
        t = torch.sub(d_, sent) if out is None else torch.sub(d_, sent, out=out[i])
        t.mul_(prev_share)
        yield t.add_(avg)
        del t, d_, avg, sent  # before the next pieces are made (copies, on a GPU peer)


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


def joiner_estimate_each(d: torch.Tensor, prev_avg: torch.Tensor, prev_group_size: int,
                         pieces: Callable[[torch.Tensor], Iterable[torch.Tensor]]) -> Iterator[torch.Tensor]:
    """:func:`joiner_estimate` one parameter at a time, each in a new temporary (as
    :func:`eager_estimate_each`)."""
    for d_, avg in zip(pieces(d), pieces(prev_avg)):
        t = torch.sub(d_, avg)
        t.div_(prev_group_size + 1)
        yield t.add_(avg)
        del t, d_, avg


def overlap_merge(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """``theta_local <- alpha * theta_local + (1 - alpha) * theta_tilde`` (inner-step overlap)."""
    return local * alpha + global_ * (1.0 - alpha)
