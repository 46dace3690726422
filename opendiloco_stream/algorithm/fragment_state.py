"""Per-fragment state of StreamingDiLoCo: outer parameters and optimizer, the look-ahead start
point (eager 'corrected'), the round in flight, and checkpoint / donor state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.outer import OuterOptimizer
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


class FragmentState:
    """Everything one fragment carries between its syncs.

    ``outer`` are the fp32 outer parameters theta_bar_p with their outer optimizer. Under eager
    'corrected' they step only with group averages, and ``start`` holds the point the local
    parameters restarted from (theta_bar plus the one-off estimate step): outer gradients are
    taken against it.
    """

    def __init__(self, fragment: fr.Fragment, offset: int, config: DiLoCoConfig):
        self.fragment, self.offset = fragment, offset
        self.index = fragment.index
        self.outer = [p.detach().float().clone() for p in fragment.params]
        self.opt = OuterOptimizer(self.outer, config.outer_lr, config.outer_momentum, config.outer_nesterov)
        self.start: Optional[list[torch.Tensor]] = None
        if config.mode == "eager" and config.eager_rule == "corrected":
            self.start = [t.clone() for t in self.outer]
        self.tokens = 0
        self.pending: Optional[_Pending] = None
        self.previous: Optional[_Previous] = None
        self.last: Optional[SyncResult] = None  # eager 'corrected': the last round that landed
        # error feedback in the parameters: what the last consumed round did not send, until the
        # local parameters take it (within the same step, so never part of a checkpoint)
        self.unsent: Optional[torch.Tensor] = None

    def outer_grad(self) -> torch.Tensor:
        """d = reference - theta_local, flat fp32 (old minus new); the reference is ``start`` if kept."""
        ref = self.start if self.start is not None else self.outer
        return torch.cat([(r - q.detach().float()).reshape(-1) for r, q in zip(ref, self.fragment.params)])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat fp32 fragment vector as one view per parameter (the outer optimizer's layout)."""
        return self.opt.split(flat)

    def set_local(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for q, v in zip(self.fragment.params, values):
                q.copy_(v)

    def restart_from(self, values: list[torch.Tensor]) -> None:
        """Local parameters (and ``start``, if kept) <- values."""
        if self.start is not None:
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
                "last": None if self.last is None else {"average": self.last.average.clone(),
                                                        "sent": self.last.sent.clone(),
                                                        "share": self.last.weight_share,
                                                        "group_size": self.last.group_size},
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
                result = SyncResult(average=res["average"], group_size=res["group_size"], weight_share=res["share"],
                                    sent=res["sent"], included_self=res["included_self"] and not joiner,
                                    bytes_sent=0 if joiner else res["bytes_sent"],
                                    bytes_received=0 if joiner else res["bytes_received"])
            self.pending = _Pending(_ResolvedHandle((self.index, pend["round"]), result), pend["round"],
                                    pend["launched_at"], pend["apply_at"], pend["outer_grad"], pend["sent_input"])
        last = st.get("last")
        self.last = None if last is None or joiner else SyncResult(
            average=last["average"], group_size=last["group_size"], weight_share=last["share"], sent=last["sent"])
        pr = st["previous"]
        self.previous = None if pr is None else _Previous(**{**pr, "included_self": pr["included_self"] and not joiner})
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
