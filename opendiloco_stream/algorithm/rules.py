"""One policy per sync rule: what a mode does with one fragment's rounds.

A rule is a policy over one fragment's state (``FragmentState``: theta_bar, its outer optimizer,
the local parameters) plus whatever its mode keeps between rounds (eager 'corrected': the
look-ahead start and the last landed round; eager 'paper' and naive-delayed: the last consumed
round). It never launches, waits or logs: the fragment's sync (``algorithm/fragment_sync.py``)
owns the round in flight, puts rounds on the wire, waits for them and records them, and asks the
rule

* ``reference`` -- what the outer gradient is taken against;
* ``due(pending, t)`` -- at inner step t, whether the round in flight lands now (overlap at
  t_k + tau, the on-arrival rules once it arrived);
* ``land(pending, result, at_sync)`` -- the round's result (None: it failed) landed: apply it and
  say what was done (a :class:`Landing`);
* ``after_launch(k, d)`` -- round k was launched with outer gradient d: the estimate step, if the
  rule takes one (its kind, for the record).

``rule_class(config)`` picks the class; a new rule is one class here plus its config choice.
docs/algorithm.md states each rule's formulas.

Memory: a rule applies a landed round one parameter at a time, in place where it can (the outer
step: ``OuterOptimizer.step_param``; the merges and restarts: ``FragmentState.update_local``), and
reads the average (and what this peer sent) only through ``f.opt.pieces``
(``staging.OuterView``): per-parameter views of the transport's result on the CPU, one
parameter's copy at a time from the transport's host buffer on a GPU peer, never the whole
fragment on the device. Besides the state it keeps, a landing holds at most two temporaries
shaped like one parameter (e.g. theta_bar before its step and the merge's term), never one shaped
like the fragment (tests/test_landing_memory.py); the record's comparison of the estimate with
the average is summed parameter by parameter. The one exception is eager 'corrected' with the
'scaled' estimate: its coefficient is two reductions over the whole fragment
(``projection_coefficient``), kept as they are because the coefficient's bits decide the next
estimate's; they read whole copies on the outer device (on a GPU peer the average and what was
sent, copied whole) and each makes one fragment-sized temporary, one after the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from opendiloco_stream.algorithm.fragment_state import FragmentState, _Pending
from opendiloco_stream.algorithm.outer import eager_estimate_each, joiner_estimate_each, projection_coefficient
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncResult


def _sq(t: torch.Tensor) -> float:
    """The squared norm of ``t`` (no temporary: a reduction to one number)."""
    return float(torch.linalg.vector_norm(t)) ** 2


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.reshape(-1), b.reshape(-1)))


def _cos(dot: float, sq_a: float, sq_b: float) -> float:
    return 0.0 if sq_a == 0.0 or sq_b == 0.0 else dot / math.sqrt(sq_a * sq_b)


def _ratio(sq_a: float, sq_b: float) -> float:
    return 0.0 if sq_b == 0.0 else math.sqrt(sq_a / sq_b)


@dataclass
class _Fields:
    """A landed round's record fields, summed parameter by parameter: how the outer gradient's
    estimate compared with the average (``estimate_cos``), and the size of the local parameters'
    correction against the outer step's (``correction_ratio``). Reductions only: no temporary
    larger than one parameter is made for them."""

    dot: float = 0.0
    sq_estimate: float = 0.0
    sq_average: float = 0.0
    sq_correction: float = 0.0
    sq_step: float = 0.0

    def compare(self, estimate: torch.Tensor, average: torch.Tensor) -> None:
        self.dot += _dot(estimate, average)
        self.sq_estimate += _sq(estimate)
        self.sq_average += _sq(average)

    def record(self) -> dict[str, Any]:
        return {"estimate_cos": round(_cos(self.dot, self.sq_estimate, self.sq_average), 6),
                "correction_ratio": round(_ratio(self.sq_correction, self.sq_step), 6)}


@dataclass
class Landing:
    """What a rule did with a landed round, for the fragment's sync to finish it.

    ``fields``: extra fields of the round's record (how the average compared with what the peer
    went on with meanwhile). ``unsent_scale``: the part of this peer's unsent progress (error
    feedback in the parameters) the local parameters take now; None: at the end of the sync step
    (the rule restarts the local parameters after the launch). ``local_only``: a failed round
    counts as an outer step taken with this peer's own outer gradient."""

    fields: dict[str, Any] = field(default_factory=dict)
    unsent_scale: Optional[float] = 1.0
    local_only: bool = False


class SyncRule:
    """One fragment's rounds under one mode (the module docstring says what it is asked)."""

    #: the round is waited for at its own sync (blocking), not left in flight
    waits_at_sync = False
    #: the round's record says what it applied ("average", or "local-only" if it failed)
    records_applied = False
    #: theta_bar steps with group averages only, so it is the same on every peer in sync and a
    #: peer whose theta_bar differs can be repaired (``repair.py``); not eager 'paper', naive-delayed
    shares_outer = True

    def __init__(self, f: FragmentState, config: DiLoCoConfig):
        self.f, self.config = f, config

    @property
    def reference(self) -> list[torch.Tensor]:
        """What outer gradients are taken against: ``d = reference - theta_local``."""
        return self.f.outer

    def restart_from(self, values: list[torch.Tensor]) -> None:
        """The local parameters restart from ``values``."""
        self.f.set_local(values)

    def due(self, pending: _Pending, t: int) -> bool:
        """Whether the round in flight lands at inner step t (before the syncs due at t)."""
        return False

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        """The round landed (``at_sync``: at the fragment's next sync, before its launch; else on
        arrival, or at the end of training). The base records it and applies nothing."""
        return Landing(unsent_scale=None if at_sync else 1.0)

    def after_launch(self, k: int, d: torch.Tensor) -> Optional[str]:
        """Round k was launched with outer gradient ``d``: the estimate step, if any (its kind)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The rule's part of the fragment's checkpoint (None where unused)."""
        return {"start": None, "last": None, "previous": None}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        if joiner:  # a joiner has not trained: it starts from the outer parameters
            self.restart_from(self.f.outer)


class Blocking(SyncRule):
    """tau = 0: wait for round k at its sync, step theta_bar with the average, restart from it."""

    waits_at_sync = True
    records_applied = True

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        self.f.opt.step(result.average if result is not None else pending.outer_grad)
        self.restart_from(self.f.outer)
        return Landing()


class Overlap(SyncRule):
    """Launch at the sync, keep training; when the round is applied, step theta_bar with the
    average and merge: ``theta <- alpha * theta + (1 - alpha) * theta_bar``. Overlap applies at
    t_k + tau; the eager rules below at the first step after the round landed (and a round not
    landed by the fragment's next sync is waited for there)."""

    records_applied = True
    on_arrival = False

    def due(self, pending: _Pending, t: int) -> bool:
        if self.on_arrival:
            return pending.launched_at < t and pending.handle.done()
        return pending.apply_at == t

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        """Parameter by parameter: step theta_bar_i (keeping a copy of it before, for the record
        and for 'merge'), then merge it into the local parameter in place. At most two of one
        parameter's temporaries at a time."""
        f = self.f
        # per-parameter pieces, each made (if it must be converted) when it is reached
        grads = f.opt.pieces(result.average if result is not None else pending.outer_grad)
        outgrads = f.opt.pieces(pending.outer_grad)
        fields = None if result is None else _Fields()

        def land_one(i: int, q: torch.Tensor) -> torch.Tensor:
            before = f.outer[i].clone()
            g, d = next(grads), next(outgrads)
            if fields is not None:
                fields.compare(d, g)  # the round's outer gradient against the average, summed per parameter
            f.opt.step_param(i, g)
            del g
            if fields is not None:
                change = torch.sub(before, f.outer[i])
                fields.sq_step += _sq(change)
                del change
            return self.merge_into(q, before, f.outer[i], d, fields)

        f.update_local(land_one)
        f.opt.count_step()
        # the merge kept alpha of the unsent part (it is in the local deviation): the rest moves
        return Landing({} if fields is None else fields.record(), unsent_scale=1.0 - self.config.alpha,
                       local_only=True)

    def merge_into(self, q: torch.Tensor, before: torch.Tensor, outer: torch.Tensor, d: torch.Tensor,
                   fields: Optional[_Fields]) -> torch.Tensor:
        """One local parameter ``q`` after the merge, written into ``q`` (``before``: theta_bar_i
        before the round's step, a scratch copy the merge may overwrite; ``outer``: after it; ``d``:
        the round's outer gradient): ``q * alpha + theta_bar * (1 - alpha)`` (``overlap_merge``)."""
        a = self.config.alpha
        term = torch.mul(outer, 1.0 - a, out=before)
        merged = torch.mul(q, a)
        merged.add_(term)
        if fields is not None:
            fields.sq_correction += _sq(q.sub_(merged))
        return q.copy_(merged)


class EagerOverlap(Overlap):
    """Eager 'overlap': overlap's merge at whatever step the round lands (tau = the link's delay);
    a round not landed by the fragment's next sync is waited for there, merged, and only then is
    the next outer gradient taken. The merge keeps alpha of the progress made while the round was
    in flight and drops the rest: the later the round lands, the more it drops."""

    on_arrival = True


class EagerMerge(EagerOverlap):
    """Eager 'merge' (the default): as 'overlap', but the merge is the one overlap would have made
    at the launch, moved to the landing: ``theta <- theta + (1 - alpha) * (theta_bar_new - theta_k)``
    with ``theta_k = theta_bar_old - d_k`` the local parameters at the launch. The progress made
    while the round was in flight is kept whole, whenever it lands."""

    def merge_into(self, q: torch.Tensor, before: torch.Tensor, outer: torch.Tensor, d: torch.Tensor,
                   fields: Optional[_Fields]) -> torch.Tensor:
        """``q + (theta_bar - (theta_bar_before - d)) * (1 - alpha)``, the term made in ``before``."""
        term = before.sub_(d)  # theta_k, the local parameters at the launch
        torch.sub(outer, term, out=term)
        term.mul_(1.0 - self.config.alpha)
        if fields is None:
            return q.add_(term)
        merged = torch.add(q, term)
        fields.sq_correction += _sq(torch.sub(merged, q, out=term))
        return q.copy_(merged)


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


class EagerCorrected(SyncRule):
    """Eager 'corrected': theta_bar steps only with group averages, one round late (a failed
    round falls back to this peer's own outer gradient); the local parameters restart from a
    one-off look-ahead step on top of theta_bar with an estimate of round k's average, which the
    true average replaces when it lands (on arrival, or at the next sync)."""

    def __init__(self, f: FragmentState, config: DiLoCoConfig):
        super().__init__(f, config)
        self.start = [f.fp32_copy(t) for t in f.outer]  # where the local parameters restarted from
        self.last: Optional[_Last] = None  # the last round that landed
        self.on_arrival = config.eager_correction == "on-arrival"

    @property
    def reference(self) -> list[torch.Tensor]:
        return self.start

    def restart_from(self, values: list[torch.Tensor]) -> None:
        if values is not self.start:
            for s, v in zip(self.start, values):
                s.copy_(v)
        self.f.set_local(values)

    def due(self, pending: _Pending, t: int) -> bool:
        return self.on_arrival and pending.launched_at < t and pending.handle.done()  # a non-blocking look

    def after_launch(self, k: int, d: torch.Tensor) -> Optional[str]:
        """The look-ahead, written into ``start`` parameter by parameter (the 'mixed' estimate made
        in ``start[i]`` itself first): one parameter's temporary at a time."""
        prev, scale = self.last, None
        grads = self.f.opt.pieces(d)
        if prev is None:
            kind = "local-only"
        elif self.config.eager_estimate == "mixed" and prev.average is not None and prev.sent is not None:
            grads, kind = self._mixed_into_start(d, prev), "eager"
        elif self.config.eager_estimate == "scaled" and prev.coef is not None:
            scale, kind = prev.coef, "eager"  # projected_estimate: d * its coefficient kept at landing
        else:
            kind = "eager"
        self.restart_from(self.f.opt.lookahead_each(grads, scale=scale, out=self.start))
        return kind

    def _mixed_into_start(self, d: torch.Tensor, prev: _Last) -> Iterator[torch.Tensor]:
        """``eager_estimate(d, avg, sent, share)`` per parameter, each made in ``start[i]``."""
        assert prev.average is not None and prev.sent is not None
        return eager_estimate_each(d, prev.average, prev.sent, prev.share, self.f.opt.pieces, out=self.start)

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        """Round k's average lands: theta_bar <- OuterOpt(theta_bar, avg_k) (a failed round: this
        peer's own outer gradient). Mid-round (on arrival, or at the end of training) the estimate
        step is swapped for the true one at once: local parameters and ``start`` move by
        theta_bar - start, keeping the local progress made since the restart. Parameter by
        parameter: at most two of one parameter's temporaries at a time."""
        f = self.f
        # the average is read once, piece by piece (one copy per parameter on a GPU peer): each
        # piece is compared with the round's estimate, then steps theta_bar
        grads = f.opt.pieces(result.average if result is not None else pending.outer_grad)
        fields = None if result is None else _Fields()
        estimates = self._estimates_of(pending) if fields is not None else None

        def step_one(i: int) -> None:
            g = next(grads)
            if fields is not None and estimates is not None:
                est = next(estimates)
                fields.compare(est, g)
                del est
            before = f.outer[i].clone() if fields is not None else None
            f.opt.step_param(i, g)
            del g
            if fields is not None and before is not None:
                # the correction: the true step minus the estimate's look-ahead step
                fields.sq_step += _sq(torch.sub(f.outer[i], before, out=before))
                fields.sq_correction += _sq(torch.sub(f.outer[i], self.start[i], out=before))

        def land_one(i: int, q: torch.Tensor) -> torch.Tensor:
            step_one(i)
            local = torch.add(q, f.outer[i])
            local.sub_(self.start[i])
            self.start[i].copy_(f.outer[i])
            return q.copy_(local)

        if at_sync:
            for i in range(len(f.outer)):
                step_one(i)
        else:
            f.update_local(land_one)
        f.opt.count_step()
        self.keep_last(result)
        return Landing({} if fields is None else fields.record(), unsent_scale=None if at_sync else 1.0)

    def _estimates_of(self, pending: _Pending) -> Iterator[torch.Tensor]:
        """Per parameter, the estimate round ``pending`` was given at its sync (up to the 'scaled'
        coefficient, which a cosine does not see): views of its outer gradient, or each 'mixed'
        estimate made in a temporary when it is asked for."""
        prev = self.last
        if (self.config.eager_estimate == "mixed" and prev is not None and prev.average is not None
                and prev.sent is not None):
            return eager_estimate_each(pending.outer_grad, prev.average, prev.sent, prev.share, self.f.opt.pieces)
        return self.f.opt.pieces(pending.outer_grad)

    def keep_last(self, result: Optional[SyncResult]) -> None:
        """What the next estimate needs of a landed round. 'mixed' keeps the round's two tensors
        where the transport left them (host buffers on a GPU peer: read per parameter when the
        estimate is made). 'scaled' computes its coefficient from whole copies on the outer device
        (none on the CPU): the two reductions' bits depend on where and how they run, so they run
        as they always did; on a GPU that is two fragment-sized temporaries at the landing."""
        if result is None or not result.included_self:
            self.last = None
            return
        average, sent, rule = result.average, result.sent, self.config.eager_estimate
        if rule == "scaled":
            average, sent = self.f.to_outer_device(average), self.f.to_outer_device(sent)
        self.last = _Last.of(average, sent, result.weight_share, result.group_size, rule)

    def state_dict(self) -> dict[str, Any]:
        last = self.last
        return {**super().state_dict(), "start": [t.clone() for t in self.start],
                "last": None if last is None else {
                    "share": last.share, "group_size": last.group_size, "coef": last.coef,
                    "average": None if last.average is None else last.average.clone(),
                    "sent": None if last.sent is None else last.sent.clone()}}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        f, last = self.f, st.get("last")
        if last is None or joiner:
            self.last = None
        elif last.get("average") is not None:  # 'mixed', or a checkpoint from before 'coef'
            self.last = _Last.of(f.to_outer_device(last["average"]), f.to_outer_device(last["sent"]),
                                 last["share"], last["group_size"], self.config.eager_estimate)
        else:  # a coefficient only: a 'mixed' estimate resumes from it as 'own' for one round
            self.last = _Last(last["share"], last["group_size"], coef=last.get("coef"))
        super().load_state_dict(st, joiner)
        if not joiner and st.get("start") is not None:
            for a, b in zip(self.start, st["start"]):
                a.copy_(b)


@dataclass
class _Previous:
    """Round k-1's outcome as the 'paper' eager rule and naive-delayed need it."""

    average: torch.Tensor
    sent: Optional[torch.Tensor]
    share: float
    group_size: int
    included_self: bool


class Delayed(SyncRule):
    """Eager 'paper' (and, with ``naive``, naive-delayed): consume round k-1 at the sync, launch
    round k, step theta_bar with the estimate (the outer optimizer's momentum consumes it) and
    restart from it."""

    naive = False
    shares_outer = False  # theta_bar steps with each peer's own estimate

    def __init__(self, f: FragmentState, config: DiLoCoConfig):
        super().__init__(f, config)
        self.previous: Optional[_Previous] = None

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        if at_sync:  # the estimate of the round launched next (the end of training launches none)
            self.previous = None if result is None else _Previous(
                result.average, result.sent, result.weight_share, result.group_size, result.included_self)
        return super().land(pending, result, at_sync)

    def after_launch(self, k: int, d: torch.Tensor) -> Optional[str]:
        """theta_bar steps with the estimate, parameter by parameter: each parameter's estimate is
        made in one temporary that the step then overwrites in place."""
        prev, split = self.previous, self.f.opt.pieces
        owned = True
        if prev is None:
            grads, kind, owned = split(d), "local-only", False
        elif self.naive:
            grads, kind, owned = split(prev.average), "delayed", False
        elif prev.included_self and prev.sent is not None:
            grads, kind = eager_estimate_each(d, prev.average, prev.sent, prev.share, split), "eager"
        else:
            grads, kind = joiner_estimate_each(d, prev.average, prev.group_size, split), "eager-joiner"
        self.previous = None  # each round's result is used exactly once
        self.f.opt.step_each(grads, owned=owned)
        self.restart_from(self.f.outer)
        return kind

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "previous": None if self.previous is None else dict(self.previous.__dict__)}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        pr, f = st["previous"], self.f
        self.previous = None if pr is None else _Previous(**{
            **pr, "average": f.to_outer_device(pr["average"]), "sent": f.to_outer_device(pr["sent"]),
            "included_self": pr["included_self"] and not joiner})
        super().load_state_dict(st, joiner)


class NaiveDelayed(Delayed):
    """Naive-delayed (ablation): eager 'paper' with the estimate ``avg_{k-1}``."""

    naive = True


EAGER_RULES: dict[str, type[SyncRule]] = {"corrected": EagerCorrected, "paper": Delayed, "merge": EagerMerge,
                                           "overlap": EagerOverlap}
MODE_RULES: dict[str, type[SyncRule]] = {"blocking": Blocking, "overlap": Overlap, "naive-delayed": NaiveDelayed}


def rule_class(config: DiLoCoConfig) -> type[SyncRule]:
    """The rule of ``config.mode`` (and ``config.eager_rule`` for eager)."""
    if config.mode == "eager":
        return EAGER_RULES[config.eager_rule]
    if config.mode not in MODE_RULES:
        raise ValueError(f"mode {config.mode!r} has no streaming rule (choose from "
                         f"{', '.join(['eager', *MODE_RULES])})")
    return MODE_RULES[config.mode]
