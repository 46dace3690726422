"""Per-fragment state of StreamingDiLoCo: outer parameters and optimizer, the look-ahead start
point (eager 'corrected'), the round in flight, and checkpoint / donor state.

The outer state (theta_bar, its momentum, ``start``) is fp32 on the outer device
(``DiLoCoConfig.outer_device``): the model's device by default, or the CPU, in pinned memory when
the model is on CUDA (copies to and from the GPU are then DMA transfers). Outer gradients and
transport results are brought there; the local parameters are written back with ``copy_``, which
casts and moves.

The local parameters are read and written through a :class:`ParamAccess`: the fragment's own
parameters by default (:class:`DirectAccess`), or, on a sharded peer (FSDP2, ``train/sharded.py``),
full tensors gathered from and scattered to the peer's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.outer import OuterOptimizer, projection_coefficient
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult


@dataclass
class _Pending:
    """A launched round whose result is not consumed yet."""

    handle: SyncHandle
    round: int
    launched_at: int          # inner step
    apply_at: int             # inner step at which overlap mode applies it
    outer_grad: torch.Tensor  # fp32 d_k (what the local-only fallback uses)
    sent_input: torch.Tensor  # what was handed to the transport (d_k + residual under EF)


@dataclass
class _Previous:
    """Round k-1's outcome as the 'paper' eager rule and naive-delayed need it."""

    average: torch.Tensor
    sent: Optional[torch.Tensor]
    share: float
    group_size: int
    included_self: bool


@dataclass
class _Last:
    """Eager 'corrected': what the next estimate needs from the last round that landed, and no
    more: 'scaled' keeps one coefficient, 'mixed' the round's average and what this peer sent,
    'own' nothing (keeping the two tensors for every fragment cost 2 x the model in fp32)."""

    share: float
    group_size: int
    coef: Optional[float] = None            # 'scaled': projection_coefficient(average, sent)
    average: Optional[torch.Tensor] = None  # 'mixed'
    sent: Optional[torch.Tensor] = None     # 'mixed'

    @classmethod
    def of(cls, average: torch.Tensor, sent: torch.Tensor, share: float, group_size: int, rule: str) -> "_Last":
        if rule == "mixed":
            return cls(share, group_size, average=average, sent=sent)
        return cls(share, group_size, coef=projection_coefficient(average, sent) if rule == "scaled" else None)


class ParamAccess:
    """How the outer logic reads and writes a fragment's local parameters (full tensors, in the
    order of ``fragment.params``)."""

    def read(self, fragment: fr.Fragment) -> list[torch.Tensor]:
        raise NotImplementedError

    def write(self, fragment: fr.Fragment, values: list[torch.Tensor]) -> None:
        raise NotImplementedError


class DirectAccess(ParamAccess):
    """The fragment's own parameters (a model whose every parameter is whole on this process)."""

    def read(self, fragment: fr.Fragment) -> list[torch.Tensor]:
        return [p.detach() for p in fragment.params]

    def write(self, fragment: fr.Fragment, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for q, v in zip(fragment.params, values):
                q.copy_(v)


class _ResolvedHandle(SyncHandle):
    """A handle whose result is already known (restored from a checkpoint or a donor)."""

    def __init__(self, key, result: Optional[SyncResult]):
        self.key, self._result = key, result

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        if self._result is None:
            raise SyncFailed("round failed before the checkpoint", key=self.key, reason="restored")
        return self._result


def resolve_outer_device(setting: str, like: torch.Tensor) -> torch.device:
    """Where the outer state of a fragment whose parameters look like ``like`` lives."""
    if setting == "auto":
        return like.device
    if setting == "cpu":
        return torch.device("cpu")
    if like.device.type != "cuda":
        raise ValueError(f"outer_device 'cuda' needs the model on a CUDA device; it is on {like.device}")
    return like.device


class FragmentState:
    """Everything one fragment carries between its syncs.

    ``outer`` are the fp32 outer parameters theta_bar_p with their outer optimizer. Under eager
    'corrected' they step only with group averages, and ``start`` holds the point the local
    parameters restarted from (theta_bar plus the one-off estimate step): outer gradients are
    taken against it.
    """

    def __init__(self, fragment: fr.Fragment, offset: int, config: DiLoCoConfig,
                 access: Optional[ParamAccess] = None):
        self.fragment, self.offset = fragment, offset
        self.index = fragment.index
        self.access = access if access is not None else DirectAccess()
        params = self.access.read(fragment)
        first = params[0]
        self.device = resolve_outer_device(config.outer_device, first)
        self._pin = self.device.type == "cpu" and first.device.type == "cuda"
        self.outer = [self._fp32(p) for p in params]
        self.opt = OuterOptimizer(self.outer, config.outer_lr, config.outer_momentum, config.outer_nesterov)
        self.start: Optional[list[torch.Tensor]] = None
        if config.mode == "eager" and config.eager_rule == "corrected":
            self.start = [self._fp32(t) for t in self.outer]
        self.tokens = 0
        self.pending: Optional[_Pending] = None
        self.previous: Optional[_Previous] = None
        self.estimate_rule = config.eager_estimate
        self.last: Optional[_Last] = None  # eager 'corrected': the last round that landed (keep_last)
        # error feedback in the parameters: what the last consumed round did not send, until the
        # local parameters take it (within the same step, so never part of a checkpoint)
        self.unsent: Optional[torch.Tensor] = None

    def _fp32(self, t: torch.Tensor) -> torch.Tensor:
        """A new fp32 copy of ``t`` on the outer device (pinned if the outer state is pinned)."""
        if not self._pin:
            return t.detach().to(self.device, torch.float32, copy=True)
        return torch.empty(t.shape, dtype=torch.float32, pin_memory=True).copy_(t.detach())

    def keep_last(self, result: Optional[SyncResult]) -> None:
        """Eager 'corrected': remember what the next estimate needs of a landed round."""
        self.last = None if result is None or not result.included_self else _Last.of(
            result.average, result.sent, result.weight_share, result.group_size, self.estimate_rule)

    def local(self) -> list[torch.Tensor]:
        """The local parameters as fp32 tensors on the outer device (themselves if they already are)."""
        return [q.to(self.device, torch.float32) for q in self.access.read(self.fragment)]

    def to_outer_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(self.device)

    def outer_grad(self) -> torch.Tensor:
        """d = reference - theta_local, flat fp32 (old minus new); the reference is ``start`` if kept."""
        ref = self.start if self.start is not None else self.outer
        return torch.cat([(r - q).reshape(-1) for r, q in zip(ref, self.local())])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat fp32 fragment vector as one view per parameter (the outer optimizer's layout)."""
        return self.opt.split(flat)

    def local_copy(self) -> list[torch.Tensor]:
        """A copy of the local parameters in their own dtype, for ``set_local`` to restore."""
        return [q.clone() for q in self.access.read(self.fragment)]

    def set_local(self, values: list[torch.Tensor]) -> None:
        self.access.write(self.fragment, values)

    def restart_from(self, values: list[torch.Tensor]) -> None:
        """Local parameters (and ``start``, if kept) <- values."""
        if self.start is not None and values is not self.start:
            for s, v in zip(self.start, values):
                s.copy_(v)
        self.set_local(values)

    # checkpoint / donor state
    def state_dict(self, timeout: float) -> dict[str, Any]:
        pend = None
        if self.pending is not None:
            pend = {"round": self.pending.round, "launched_at": self.pending.launched_at,
                    "apply_at": self.pending.apply_at, "outer_grad": self.pending.outer_grad.clone(),
                    "sent_input": self.pending.sent_input.clone(), "result": _result_state(self.pending.handle, timeout)}
        return {"outer_params": [t.clone() for t in self.outer], "outer_opt": self.opt.state_dict(),
                "start": None if self.start is None else [t.clone() for t in self.start],
                "tokens": self.tokens, "pending": pend,
                "last": None if self.last is None else {
                    "share": self.last.share, "group_size": self.last.group_size, "coef": self.last.coef,
                    "average": None if self.last.average is None else self.last.average.clone(),
                    "sent": None if self.last.sent is None else self.last.sent.clone()},
                "previous": None if self.previous is None else dict(self.previous.__dict__)}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        with torch.no_grad():
            for a, b in zip(self.outer, st["outer_params"]):
                a.copy_(b)
        self.opt.load_state_dict(st["outer_opt"])
        self.tokens = 0 if joiner else int(st["tokens"])
        self.pending = None
        if st["pending"] is not None:
            pend, res, result = st["pending"], st["pending"]["result"], None
            if res is not None:
                result = SyncResult(average=self.to_outer_device(res["average"]), group_size=res["group_size"],
                                    weight_share=res["share"], sent=self.to_outer_device(res["sent"]),
                                    included_self=res["included_self"] and not joiner,
                                    bytes_sent=0 if joiner else res["bytes_sent"],
                                    bytes_received=0 if joiner else res["bytes_received"])
            self.pending = _Pending(_ResolvedHandle((self.index, pend["round"]), result), pend["round"],
                                    pend["launched_at"], pend["apply_at"], self.to_outer_device(pend["outer_grad"]),
                                    self.to_outer_device(pend["sent_input"]))
        last = st.get("last")
        if last is None or joiner:
            self.last = None
        elif last.get("average") is not None:  # 'mixed', or a checkpoint from before 'coef'
            self.last = _Last.of(self.to_outer_device(last["average"]), self.to_outer_device(last["sent"]),
                                 last["share"], last["group_size"], self.estimate_rule)
        else:  # a coefficient only: a 'mixed' estimate resumes from it as 'own' for one round
            self.last = _Last(last["share"], last["group_size"], coef=last.get("coef"))
        pr = st["previous"]
        self.previous = None if pr is None else _Previous(**{
            **pr, "average": self.to_outer_device(pr["average"]), "sent": self.to_outer_device(pr["sent"]),
            "included_self": pr["included_self"] and not joiner})
        if joiner:
            # a joiner has not trained: it starts from the outer parameters
            self.restart_from(self.outer)
        elif self.start is not None and st.get("start") is not None:
            for a, b in zip(self.start, st["start"]):
                a.copy_(b)


def _result_state(handle: SyncHandle, timeout: float) -> Optional[dict[str, Any]]:
    try:
        res = handle.wait(timeout=timeout)
    except SyncFailed:
        return None
    return {"average": res.average.clone(), "sent": res.sent.clone(), "share": res.weight_share,
            "group_size": res.group_size, "included_self": res.included_self,
            "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received}
