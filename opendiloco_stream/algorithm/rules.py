"""One object per sync rule: what a mode does with one fragment's rounds.

A rule owns the fragment's round in flight and whatever else its mode keeps between syncs (eager
'corrected': the look-ahead start and the last landed round; eager 'paper' and naive-delayed: the
last consumed round). ``StreamingDiLoCo`` keeps the schedule, the transport and the log, and calls:

* ``on_step(t)`` at every inner step, before the syncs due at t (overlap applies, on-arrival rules
  land what arrived);
* ``sync(k)`` at the fragment's sync step of round k (take the outer gradient, launch, step);
* ``finish()`` at the end of training (apply what is still in flight);
* ``state_dict`` / ``load_state_dict`` for checkpoints and late joiners.

``rule_class(config)`` picks the class; a new rule is one class here plus its config choice.
docs/algorithm.md states each rule's formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from opendiloco_stream.algorithm.fragment_state import FragmentState, _Pending, pending_from_state, pending_state
from opendiloco_stream.algorithm.outer import eager_estimate, joiner_estimate, overlap_merge, projection_coefficient
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncResult

if TYPE_CHECKING:  # the host: StreamingDiLoCo (launch, consume, keep_unsent, log_outer_step, log)
    from opendiloco_stream.algorithm.diloco import StreamingDiLoCo


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return 0.0 if na == 0.0 or nb == 0.0 else float((a * b).sum()) / (na * nb)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = float(b.norm())
    return 0.0 if nb == 0.0 else float(a.norm()) / nb


class SyncRule:
    """One fragment's rounds under one mode. The base keeps the round in flight (``pending``)."""

    def __init__(self, host: "StreamingDiLoCo", f: FragmentState, config: DiLoCoConfig):
        self.host, self.f, self.config = host, f, config
        self.pending: Optional[_Pending] = None

    @property
    def reference(self) -> list[torch.Tensor]:
        """What outer gradients are taken against: ``d = reference - theta_local``."""
        return self.f.outer

    def outer_grad(self) -> torch.Tensor:
        return self.f.outer_grad(self.reference)

    def restart_from(self, values: list[torch.Tensor]) -> None:
        """The local parameters restart from ``values``."""
        self.f.set_local(values)

    def take_pending(self) -> _Pending:
        """The round in flight, which the caller now consumes (there is one: the caller checked)."""
        pending, self.pending = self.pending, None
        assert pending is not None, "no round in flight"
        return pending

    def on_step(self, t: int) -> None:
        """Inner step t, before the syncs due at t."""

    def sync(self, k: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """End of training: record the round in flight (rules that apply it override this)."""
        pending = self.take_pending()
        self.host.consume(self.f, pending)
        self.host.keep_unsent(self.f)

    def state_dict(self, timeout: float) -> dict[str, Any]:
        """The rule's part of the fragment's checkpoint (the keys every rule writes, None if unused)."""
        return {"start": None, "pending": pending_state(self.pending, timeout), "last": None, "previous": None}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        self.pending = pending_from_state(st["pending"], self.f, joiner)
        if joiner:  # a joiner has not trained: it starts from the outer parameters
            self.restart_from(self.f.outer)


class Blocking(SyncRule):
    """tau = 0: wait for round k at its sync, step theta_bar with the average, restart from it."""

    def sync(self, k: int) -> None:
        d = self.outer_grad()
        pending = self.host.launch(self.f, k, d)
        result = self.host.consume(self.f, pending, applied=True)
        self.f.opt.step(result.average if result is not None else d)
        self.restart_from(self.f.outer)


class Overlap(SyncRule):
    """Launch at the sync, keep training; when the round is applied, step theta_bar with the
    average and merge: ``theta <- alpha * theta + (1 - alpha) * theta_bar``. Overlap applies at
    t_k + tau; the eager rules below at the first step after the round landed."""

    on_arrival = False

    def on_step(self, t: int) -> None:
        p = self.pending
        if p is None:
            return
        if p.apply_at == t if not self.on_arrival else (p.launched_at < t and p.handle.done()):
            self.apply()

    def sync(self, k: int) -> None:
        if self.pending is not None:  # not landed by the next sync: wait for it (never under overlap)
            self.apply()
        self.pending = self.host.launch(self.f, k, self.outer_grad())

    def finish(self) -> None:
        self.apply()

    def apply(self) -> None:
        f, pending = self.f, self.take_pending()

        def merge(result: Optional[SyncResult]) -> dict[str, Any]:
            before = [t.clone() for t in f.outer]
            f.opt.step(result.average if result is not None else pending.outer_grad)
            local = f.local()
            merged = self.merged(local, before, pending)
            fields = {} if result is None else {
                "estimate_cos": round(_cos(pending.outer_grad, result.average), 6),
                "correction_ratio": round(_ratio(_flat(merged) - _flat(local), _flat(before) - _flat(f.outer)), 6)}
            f.set_local(merged)
            return fields

        if self.host.consume(f, pending, applied=True, apply=merge) is None:
            self.host.log.stats.local_only_steps += 1
        self.host.keep_unsent(f, scale=1.0 - self.config.alpha)  # the merge kept alpha of it

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

    def __init__(self, host: "StreamingDiLoCo", f: FragmentState, config: DiLoCoConfig):
        super().__init__(host, f, config)
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

    def on_step(self, t: int) -> None:
        p = self.pending
        if self.on_arrival and p is not None and p.launched_at < t and p.handle.done():  # a non-blocking look
            self.land(shift=True)

    def sync(self, k: int) -> None:
        f, d = self.f, self.outer_grad()
        if self.pending is not None:
            self.land(shift=False)
        self.pending = self.host.launch(f, k, d)
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
        self.restart_from(f.opt.lookahead(estimate, scale=scale, out=self.start))
        self.host.log_outer_step(f, k, kind)

    def land(self, shift: bool) -> None:
        """Round k's average lands: theta_bar <- OuterOpt(theta_bar, avg_k) (a failed round: this
        peer's own outer gradient). With ``shift`` (mid-round, on arrival) the estimate step is
        swapped for the true one at once: local parameters and ``start`` move by
        theta_bar - start, keeping the local progress made since the restart."""
        f, pending = self.f, self.take_pending()

        def commit(result: Optional[SyncResult]) -> dict[str, Any]:
            before = _flat(f.outer)
            f.opt.step(result.average if result is not None else pending.outer_grad)
            if result is None:
                return {}
            after = _flat(f.outer)  # the correction: the true step minus the estimate's look-ahead step
            return {"estimate_cos": round(_cos(self._estimate_of(pending), result.average), 6),
                    "correction_ratio": round(_ratio(after - _flat(self.start), after - before), 6)}

        result = self.host.consume(f, pending, apply=commit)
        self.keep_last(result)
        if shift:
            local = [q + o - s_ for q, o, s_ in zip(f.local(), f.outer, self.start)]
            self.restart_from(f.outer)
            f.set_local(local)
            self.host.keep_unsent(f)

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

    def finish(self) -> None:
        self.land(shift=True)

    def state_dict(self, timeout: float) -> dict[str, Any]:
        last = self.last
        return {**super().state_dict(timeout), "start": [t.clone() for t in self.start],
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
    """Eager 'paper' (and, with ``naive``, naive-delayed): consume round k-1, launch round k, step
    theta_bar with the estimate (the outer optimizer's momentum consumes it) and restart from it."""

    naive = False

    def __init__(self, host: "StreamingDiLoCo", f: FragmentState, config: DiLoCoConfig):
        super().__init__(host, f, config)
        self.previous: Optional[_Previous] = None

    def sync(self, k: int) -> None:
        f, d = self.f, self.outer_grad()
        if self.pending is not None:
            result = self.host.consume(f, self.pending)
            self.previous = None if result is None else _Previous(
                result.average, result.sent, result.weight_share, result.group_size, result.included_self)
        self.pending = self.host.launch(f, k, d)
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
        f.opt.step(estimate)
        self.restart_from(f.outer)
        self.host.log_outer_step(f, k, kind)

    def state_dict(self, timeout: float) -> dict[str, Any]:
        return {**super().state_dict(timeout),
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


def rule_class(config: DiLoCoConfig) -> Callable[["StreamingDiLoCo", FragmentState, DiLoCoConfig], SyncRule]:
    """The rule of ``config.mode`` (and ``config.eager_rule`` for eager)."""
    if config.mode == "eager":
        return EAGER_RULES[config.eager_rule]
    if config.mode not in MODE_RULES:
        raise ValueError(f"mode {config.mode!r} has no streaming rule (choose from "
                         f"{', '.join(['eager', *MODE_RULES])})")
    return MODE_RULES[config.mode]
