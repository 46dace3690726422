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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from opendiloco_stream.algorithm.fragment_state import FragmentState, _Pending
from opendiloco_stream.algorithm.outer import eager_estimate, joiner_estimate, overlap_merge, projection_coefficient
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncResult


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return 0.0 if na == 0.0 or nb == 0.0 else float((a * b).sum()) / (na * nb)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.norm())
    return 0.0 if nb == 0.0 else float(a.norm()) / nb


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
        f = self.f
        before = [t.clone() for t in f.outer]
        f.opt.step(result.average if result is not None else pending.outer_grad)
        local = f.local()
        merged = self.merged(local, before, pending)
        fields = {} if result is None else {
            "estimate_cos": round(_cos(pending.outer_grad, result.average), 6),
            "correction_ratio": round(_ratio(_flat(merged) - _flat(local), _flat(before) - _flat(f.outer)), 6)}
        f.set_local(merged)
        # the merge kept alpha of the unsent part (it is in the local deviation): the rest moves
        return Landing(fields, unsent_scale=1.0 - self.config.alpha, local_only=True)

    def merged(self, local: list[torch.Tensor], before: list[torch.Tensor], pending: _Pending) -> list[torch.Tensor]:
        """The local parameters after the merge (``before``: theta_bar before the round's step)."""
        return [overlap_merge(q, tb, self.config.alpha) for q, tb in zip(local, self.f.outer)]


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

    def merged(self, local: list[torch.Tensor], before: list[torch.Tensor], pending: _Pending) -> list[torch.Tensor]:
        a = self.config.alpha
        return [q + (tb - (old - d)) * (1.0 - a)
                for q, tb, old, d in zip(local, self.f.outer, before, self.f.split(pending.outer_grad))]


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
        prev, scale = self.last, None
        if prev is None:
            estimate, kind = d, "local-only"
        elif self.config.eager_estimate == "mixed" and prev.average is not None and prev.sent is not None:
            estimate, kind = eager_estimate(d, prev.average, prev.sent, prev.share), "eager"
        elif self.config.eager_estimate == "scaled" and prev.coef is not None:
            estimate, scale, kind = d, prev.coef, "eager"  # projected_estimate: d * its coefficient kept at landing
        else:
            estimate, kind = d, "eager"
        # the look-ahead is written straight into ``start``, param by param
        self.restart_from(self.f.opt.lookahead(estimate, scale=scale, out=self.start))
        return kind

    def land(self, pending: _Pending, result: Optional[SyncResult], at_sync: bool) -> Landing:
        """Round k's average lands: theta_bar <- OuterOpt(theta_bar, avg_k) (a failed round: this
        peer's own outer gradient). Mid-round (on arrival, or at the end of training) the estimate
        step is swapped for the true one at once: local parameters and ``start`` move by
        theta_bar - start, keeping the local progress made since the restart."""
        f = self.f
        before = _flat(f.outer)
        f.opt.step(result.average if result is not None else pending.outer_grad)
        fields: dict[str, Any] = {}
        if result is not None:
            after = _flat(f.outer)  # the correction: the true step minus the estimate's look-ahead step
            fields = {"estimate_cos": round(_cos(self._estimate_of(pending), result.average), 6),
                      "correction_ratio": round(_ratio(after - _flat(self.start), after - before), 6)}
        self.keep_last(result)
        if at_sync:
            return Landing(fields, unsent_scale=None)
        local = [q + o - s_ for q, o, s_ in zip(f.local(), f.outer, self.start)]
        self.restart_from(f.outer)
        f.set_local(local)
        return Landing(fields)

    def _estimate_of(self, pending: _Pending) -> torch.Tensor:
        """The estimate round ``pending`` was given at its sync (up to the 'scaled' coefficient,
        which a cosine does not see)."""
        prev = self.last
        if (self.config.eager_estimate == "mixed" and prev is not None and prev.average is not None
                and prev.sent is not None):
            return eager_estimate(pending.outer_grad, prev.average, prev.sent, prev.share)
        return pending.outer_grad

    def keep_last(self, result: Optional[SyncResult]) -> None:
        self.last = None if result is None or not result.included_self else _Last.of(
            result.average, result.sent, result.weight_share, result.group_size, self.config.eager_estimate)

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
        prev = self.previous
        if prev is None:
            estimate, kind = d, "local-only"
        elif self.naive:
            estimate, kind = prev.average, "delayed"
        elif prev.included_self and prev.sent is not None:
            estimate, kind = eager_estimate(d, prev.average, prev.sent, prev.share), "eager"
        else:
            estimate, kind = joiner_estimate(d, prev.average, prev.group_size), "eager-joiner"
        self.previous = None  # each round's result is used exactly once
        self.f.opt.step(estimate)
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
