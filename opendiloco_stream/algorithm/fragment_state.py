"""Per-fragment state of StreamingDiLoCo: outer parameters and optimizer, tokens, and checkpoint /
donor state. What a mode keeps besides (the round in flight, eager's look-ahead start...) is its
rule's (``algorithm/rules.py``).

The outer state (theta_bar, its momentum, ``start``) is fp32 on the outer device
(``DiLoCoConfig.outer_device``, decided by ``staging.place_outer_state``): the model's device when
it fits there, or the CPU, in pinned memory when the model is on CUDA (copies to and from the GPU
are then DMA transfers). Outer gradients leave it through ``staging.py``; a landed round's tensors
stay where the transport left them and come to it one parameter at a time, when a rule reads them
(``self.opt.pieces``: ``staging.OuterView``); the local parameters are written back with
``copy_``, which casts and moves.

The outer gradient and every update of the local parameters go one parameter at a time
(:meth:`FragmentState.outer_grad`, :meth:`FragmentState.update_local`): besides the flat outer
gradient (the fragment in flight) they hold at most one parameter converted to fp32 on the outer
device, never a fragment-sized copy of the local parameters (a sharded peer's access reads and
writes whole fragments: :meth:`ParamAccess.update`).

The local parameters are read and written through a :class:`ParamAccess`: the fragment's own
parameters by default (:class:`DirectAccess`), or, on a sharded peer (FSDP2, ``train/sharded.py``),
full tensors gathered from and scattered to the peer's ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, overload

import torch

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.outer import OuterOptimizer
from opendiloco_stream.algorithm.staging import OuterPlacement, place_outer_state
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
class Unsent:
    """What a consumed round did not send, ``(sent_input - sent) * decay``, kept as its two
    tensors (the round's, already held) and made one parameter at a time when the local
    parameters take it (:meth:`FragmentState.take_unsent`), not as a fragment-sized tensor."""

    sent_input: torch.Tensor
    sent: torch.Tensor
    decay: float


class ParamAccess:
    """How the outer logic reads and writes a fragment's local parameters (full tensors, in the
    order of ``fragment.params``)."""

    def read(self, fragment: fr.Fragment) -> list[torch.Tensor]:
        raise NotImplementedError

    def write(self, fragment: fr.Fragment, values: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def update(self, fragment: fr.Fragment, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Parameter i <- ``fn(i, its value)``; ``fn`` may work in place on the value it is given and
        return it. This form reads every parameter, then writes every one (one read, one write);
        :class:`DirectAccess` goes one parameter at a time."""
        self.write(fragment, [fn(i, q) for i, q in enumerate(self.read(fragment))])


class DirectAccess(ParamAccess):
    """The fragment's own parameters (a model whose every parameter is whole on this process)."""

    def read(self, fragment: fr.Fragment) -> list[torch.Tensor]:
        return [p.detach() for p in fragment.params]

    def write(self, fragment: fr.Fragment, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for q, v in zip(fragment.params, values):
                q.copy_(v)

    def update(self, fragment: fr.Fragment, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """One parameter at a time: ``fn`` gets the parameter itself (detached), so in-place work
        on it needs no copy; a new value returned is copied in."""
        with torch.no_grad():
            for i, p in enumerate(fragment.params):
                q = p.detach()
                v = fn(i, q)
                if v.data_ptr() != q.data_ptr():
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


class FragmentState:
    """Everything one fragment carries between its syncs, whatever the rule.

    ``outer`` are the fp32 outer parameters theta_bar_p with their outer optimizer; ``tokens`` the
    tokens processed since the fragment's last sync (the round's weight).
    """

    def __init__(self, fragment: fr.Fragment, offset: int, config: DiLoCoConfig,
                 access: Optional[ParamAccess] = None, placement: Optional[OuterPlacement] = None):
        self.fragment, self.offset = fragment, offset
        self.index = fragment.index
        self.access = access if access is not None else DirectAccess()
        params = self.access.read(fragment)
        first = params[0]
        if placement is None:  # decided for this fragment alone (StreamingDiLoCo decides for the model)
            placement = place_outer_state(config.outer_device, first.device, 0)
        self.device = torch.device(placement.device)
        self._pin = placement.pinned
        self.outer = [self.fp32_copy(p) for p in params]
        self.opt = OuterOptimizer(self.outer, config.outer_lr, config.outer_momentum, config.outer_nesterov)
        self.tokens = 0
        # error feedback in the parameters: what the last consumed round did not send, until the
        # local parameters take it (within the same step, so never part of a checkpoint)
        self.unsent: Optional[Unsent] = None

    def fp32_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A new fp32 copy of ``t`` on the outer device (pinned if the outer state is pinned)."""
        if not self._pin:
            return t.detach().to(self.device, torch.float32, copy=True)
        return torch.empty(t.shape, dtype=torch.float32, pin_memory=True).copy_(t.detach())

    @overload
    def to_outer_device(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def to_outer_device(self, t: None) -> None: ...
    @overload
    def to_outer_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]: ...

    def to_outer_device(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``t`` on the outer device (None stays None)."""
        return None if t is None else t.to(self.device)

    def outer_grad(self, reference: list[torch.Tensor]) -> torch.Tensor:
        """d = reference - theta_local, flat fp32 (old minus new); the reference is the rule's.

        Written one parameter at a time into the flat tensor: it holds the fragment (the round's
        outer gradient, in flight from now) and at most one parameter converted to fp32 on the
        outer device (none when the parameters already are)."""
        d = torch.empty(sum(r.numel() for r in reference), dtype=torch.float32, device=self.device)
        offset = 0
        for r, q in zip(reference, self.access.read(self.fragment)):
            torch.sub(r, q.to(self.device, torch.float32), out=d[offset:offset + r.numel()].view_as(r))
            offset += r.numel()
        return d

    def update_local(self, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Local parameter i <- ``fn(i, q)``, ``q`` its value as fp32 on the outer device (the
        parameter itself when it already is: ``fn`` may work on it in place and return it). One
        parameter at a time with :class:`DirectAccess`: at most one converted parameter exists."""
        self.access.update(self.fragment, lambda i, q: fn(i, q.to(self.device, torch.float32)))

    def take_unsent(self, scale: float) -> None:
        """Error feedback in the parameters: the local parameters move by ``-scale`` times what the
        last consumed round did not send (``Rounds.keep_unsent`` says why), one parameter at a
        time: ``q - scale * ((sent_input - sent) * decay)``, made in one parameter's temporary."""
        u, self.unsent = self.unsent, None
        if u is None:
            return
        pieces = zip(self.opt.pieces(u.sent_input), self.opt.pieces(u.sent))

        def move(i: int, q: torch.Tensor) -> torch.Tensor:
            meant, sent = next(pieces)
            t = torch.sub(meant, sent)
            t.mul_(u.decay).mul_(scale)
            return q.sub_(t)

        self.update_local(move)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat fp32 fragment vector as one view per parameter (the outer optimizer's layout)."""
        return self.opt.split(flat)

    def local_copy(self) -> list[torch.Tensor]:
        """A copy of the local parameters in their own dtype, for ``set_local`` to restore."""
        return [q.clone() for q in self.access.read(self.fragment)]

    def set_local(self, values: list[torch.Tensor]) -> None:
        self.access.write(self.fragment, values)

    # checkpoint / donor state (the rule adds its own keys)
    def state_dict(self) -> dict[str, Any]:
        """A snapshot: copies, not the live tensors (a donor streams it while it trains on)."""
        return {"outer_params": [t.clone() for t in self.outer], "outer_opt": copy.deepcopy(self.opt.state_dict()),
                "tokens": self.tokens}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        with torch.no_grad():
            for a, b in zip(self.outer, st["outer_params"]):
                a.copy_(b)
        self.opt.load_state_dict(st["outer_opt"])
        self.tokens = 0 if joiner else int(st["tokens"])


def pending_state(pending: Optional[_Pending], timeout: float) -> Optional[dict[str, Any]]:
    """A round in flight as a checkpoint holds it: waited for (bounded by ``timeout``), with its result."""
    if pending is None:
        return None
    return {"round": pending.round, "launched_at": pending.launched_at, "apply_at": pending.apply_at,
            "outer_grad": pending.outer_grad.clone(), "sent_input": pending.sent_input.clone(),
            "result": _result_state(pending.handle, timeout)}


def pending_from_state(pend: Optional[dict[str, Any]], f: FragmentState, joiner: bool) -> Optional[_Pending]:
    """The round in flight of a checkpoint (or a donor's, for a joiner: not its own contribution)."""
    if pend is None:
        return None
    res, result = pend["result"], None
    if res is not None:
        result = SyncResult(average=f.to_outer_device(res["average"]), group_size=res["group_size"],
                            weight_share=res["share"], sent=f.to_outer_device(res["sent"]),
                            included_self=res["included_self"] and not joiner,
                            bytes_sent=0 if joiner else res["bytes_sent"],
                            bytes_received=0 if joiner else res["bytes_received"])
    return _Pending(_ResolvedHandle((f.index, pend["round"]), result), pend["round"], pend["launched_at"],
                    pend["apply_at"], f.to_outer_device(pend["outer_grad"]), f.to_outer_device(pend["sent_input"]))


def _result_state(handle: SyncHandle, timeout: float) -> Optional[dict[str, Any]]:
    try:
        res = handle.wait(timeout=timeout)
    except SyncFailed:
        return None
    return {"average": res.average.clone(), "sent": res.sent.clone(), "share": res.weight_share,
            "group_size": res.group_size, "included_self": res.included_self,
            "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received}
