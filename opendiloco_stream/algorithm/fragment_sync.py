"""One fragment's sync: its state, its rule and its round in flight (:class:`FragmentSync`), and the
round services every fragment shares (:class:`Rounds`: launch, wait, record).

``StreamingDiLoCo`` keeps the schedule and calls, for every fragment, ``on_step(t)`` at every inner
step and ``sync(k)`` at the fragment's sync step of round k. The fragment's sync puts rounds on
the wire and waits for them; its rule (``algorithm/rules.py``) is a policy that only says what a
landed round does to the fragment's state, so neither calls back into ``StreamingDiLoCo``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from opendiloco_stream.algorithm.fragment_state import (
    FragmentState, Unsent, _Pending, pending_from_state, pending_state,
)
from opendiloco_stream.algorithm.repair import Repairs
from opendiloco_stream.algorithm.rules import Landing, SyncRule
from opendiloco_stream.algorithm.staging import Staging
from opendiloco_stream.algorithm.sync_log import SyncLog
from opendiloco_stream.compression.error_feedback import ErrorFeedback
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import OuterDigest, SyncResult, Transport


class Rounds:
    """Rounds on the wire for every fragment of one peer: launch (with error feedback, through
    staging), wait (giving a round up once the swarm moved past it) and record in the sync log.

    Args:
        transport, staging, config, log: the peer's.
        now: the inner step counter t (rounds record when they launched and landed).
        catching_up: whether the peer is jumping to the swarm's round (``StreamingDiLoCo.step``).
        swarm_past: whether the swarm launched a round past this peer's next sync (a wait for a
            round then gives it up).
        repairs: detection and repair of a drifted theta_bar (``repair.py``); None: off.
    """

    def __init__(self, transport: Transport, staging: Staging, config: DiLoCoConfig, log: SyncLog,
                 now: Callable[[], int], catching_up: Callable[[], bool], swarm_past: Callable[[], bool],
                 repairs: Optional[Repairs] = None):
        self.transport, self.staging, self.config, self.log = transport, staging, config, log
        # theta_bar's digest with every round, and the repair of a fragment that drifted (repair.py)
        self.repairs = repairs if repairs is not None else Repairs(transport, log, False, 0.0, now)
        self.now, self.catching_up, self.swarm_past = now, catching_up, swarm_past
        # error feedback: what the codec did not send waits in a residual buffer added to the next
        # outer gradient ('buffer'), or in this peer's local parameters ('parameters', see keep_unsent)
        self.unsent_in_params = config.use_error_feedback and config.error_feedback_mode == "parameters"
        self.error_feedback = (ErrorFeedback(config.error_feedback_decay)
                               if config.use_error_feedback and not self.unsent_in_params else None)

    def weight(self, tokens: int) -> float:
        """A round's weight in the average: its tokens, or 1 with equal weighting."""
        return 1.0 if self.config.weighting == "equal" or tokens == 0 else float(tokens)

    def round_late(self, fragment: int, k: int) -> bool:
        return self.transport.round_late((fragment, k))

    def launch(self, f: FragmentState, k: int, d: torch.Tensor, digest: Optional[OuterDigest] = None) -> _Pending:
        """Put round k of fragment ``f`` on the wire with outer gradient ``d`` (and ``digest``,
        theta_bar's fingerprint, for the group: ``repair.py``)."""
        send = d if self.error_feedback is None else self.error_feedback.compensate(f.index, d)
        key, weight = (f.index, k), self.weight(f.tokens)
        handle = self.staging.launch(key, send, lambda host: self.transport.all_reduce(key, host, weight=weight,
                                                                                       digest=digest))
        f.tokens = 0
        t = self.now()
        return _Pending(handle, k, t, t + self.config.overlap_steps, d, send)

    def wait(self, f: FragmentState, pending: _Pending) -> tuple[Optional[SyncResult], Optional[str], float]:
        """Wait for a round (bounded by ``sync_timeout``): its result, or None and why; the
        error-feedback residual (or the unsent part) follows what went on the wire.

        The result's tensors stay where the transport left them (its host buffers on a GPU peer):
        the rule reads them one parameter at a time on the outer device (``staging.OuterView``).
        One exception: error feedback in a buffer moves what was sent to the outer device whole
        for its residual (``ErrorFeedback.update``: one fragment-sized temporary at the landing)."""
        if self.catching_up() and not pending.handle.done() and self.round_late(f.index, pending.round + 1):
            # the others launched this fragment's next round a while ago: this round is over for
            # them, and waiting for its group would only make this peer late again
            pending.handle.abandon()
        give_up = self.swarm_past if self.transport.watches_swarm else None
        result, reason, waited = self.log.wait(pending.handle, self.config.sync_timeout, give_up=give_up)
        if self.error_feedback is not None:
            # residual = what we meant to send minus what went on the wire; dropped if the round failed
            if result is not None:
                self.error_feedback.update(f.index, pending.sent_input, result.sent)
            else:
                self.error_feedback.reset(f.index)
        elif self.unsent_in_params and result is not None:
            # a failed round leaves nothing unsent: theta_bar steps with the whole d (local-only)
            f.unsent = Unsent(pending.sent_input, result.sent, self.config.error_feedback_decay)
        return result, reason, waited

    def consume(self, f: FragmentState, pending: _Pending, applied: bool,
                apply: Callable[[Optional[SyncResult]], dict[str, Any]]) -> Optional[SyncResult]:
        """Wait for a round, ``apply(result)`` (fields for the record) and record it. ``applied``:
        the record says what the sync applies ("average", or "local-only" if the round failed).
        Every record says ``land_steps``: inner steps from the round's launch to this step."""
        result, reason, waited = self.wait(f, pending)
        step = self.now()
        extra: dict[str, Any] = {"land_steps": step - pending.launched_at}
        if result is not None:
            stats = self.log.stats
            stats.land_steps += extra["land_steps"]
            stats.peak_land_steps = max(stats.peak_land_steps, extra["land_steps"])
        extra.update(apply(result))
        estimate = ("average" if result is not None else "local-only") if applied else None
        self.log.record(f.index, pending.round, step, result, reason, waited, estimate, extra)
        return result

    def keep_unsent(self, f: FragmentState, scale: float = 1.0) -> None:
        """Error feedback in the parameters: after a round's result is applied, the local
        parameters move by minus what this peer did not send, so the inner loop goes on from its
        own unsent progress and the next outer gradient (taken against theta_bar, or ``start``)
        carries it, instead of re-learning it and adding it to a residual buffer.

        ``scale``: the part of it still to move. A rule that restarts the local parameters moves
        all of it (1). A merge that keeps alpha of the local parameters' deviation from theta_bar
        has already kept alpha of the unsent part (it is in that deviation): it moves the rest,
        ``1 - alpha``, so the unsent part is carried exactly once (moving all of it carried
        ``1 + alpha`` of it into the next outer gradient: a part never sent grew by that factor
        every round until the run diverged)."""
        f.take_unsent(scale)

    def log_outer_step(self, f: FragmentState, k: int, kind: str) -> None:
        """Record an outer step taken at a sync with an estimate ``kind``."""
        if kind == "local-only":
            self.log.stats.local_only_steps += 1
        self.log.emit({"event": "outer_step", "fragment": f.index, "round": k, "step": self.now(),
                       "estimate": kind})


class FragmentSync:
    """One fragment's sync (torchft's ``_StreamingDiLoCoFragment``): it owns the fragment's state
    (:class:`FragmentState`), its rule (a policy, ``rules.py``) and its round in flight, and puts
    the rounds on the wire through the shared :class:`Rounds`."""

    def __init__(self, f: FragmentState, rule: SyncRule, rounds: Rounds):
        self.f, self.rule, self.rounds = f, rule, rounds
        self.pending: Optional[_Pending] = None
        self.consumed: Optional[int] = None  # the last round landed (averaged or failed)
        self.launch_digest: Optional[OuterDigest] = None  # theta_bar's digest at the last launch

    @property
    def reference(self) -> list[torch.Tensor]:
        """What the rule takes outer gradients against (theta_bar, or eager 'corrected''s start)."""
        return self.rule.reference

    @property
    def in_flight(self) -> bool:
        """Whether a launched round has not landed yet."""
        return self.pending is not None

    def on_step(self, t: int) -> None:
        """Inner step t, before the syncs due at t: land the round in flight if the rule says so."""
        if self.pending is not None and self.rule.due(self.pending, t):
            self._land(at_sync=False)

    def sync(self, k: int) -> None:
        """The fragment's sync step of round k: land the round still in flight (waiting for it),
        take the outer gradient, launch round k, let the rule take its estimate step."""
        if self.pending is not None:
            self._land(at_sync=True)
        d = self.f.outer_grad(self.rule.reference)
        self.launch_digest = self.rounds.repairs.digest(self)
        self.pending = self.rounds.launch(self.f, k, d, self.launch_digest)
        if self.rule.waits_at_sync:
            self._land(at_sync=True)
        kind = self.rule.after_launch(k, d)
        if kind is not None:
            self.rounds.log_outer_step(self.f, k, kind)
        self.rounds.keep_unsent(self.f)

    def finish(self) -> None:
        """End of training: land the round in flight, if any (its rule applies it, or records it)."""
        if self.pending is not None:
            self._land(at_sync=False)

    def _land(self, at_sync: bool) -> None:
        self.rounds.repairs.before_landing(self)  # a repair under way is of the round consumed last
        pending, self.pending = self.pending, None
        assert pending is not None, "no round in flight"
        landings: list[Landing] = []

        def apply(result: Optional[SyncResult]) -> dict[str, Any]:
            landings.append(self.rule.land(pending, result, at_sync))
            return landings[0].fields

        result = self.rounds.consume(self.f, pending, self.rule.records_applied, apply)
        landing = landings[0]
        if result is None and landing.local_only:
            self.rounds.log.stats.local_only_steps += 1
        if landing.unsent_scale is not None:
            self.rounds.keep_unsent(self.f, landing.unsent_scale)
        self.consumed = pending.round
        self.rounds.repairs.changed(self)  # theta_bar stepped: its digest, hashed for the next launch
        self.rounds.repairs.check(self, pending.round, result)

    def state_dict(self, timeout: float) -> dict[str, Any]:
        """The fragment's checkpoint: its state, the round in flight (waited for, bounded by
        ``timeout``) and the rule's keys."""
        st = self.f.state_dict()
        pending = pending_state(self.pending, timeout)
        rule = self.rule.state_dict()
        return {**st, "start": rule["start"], "pending": pending, "last": rule["last"], "previous": rule["previous"]}

    def load_state_dict(self, st: dict[str, Any], joiner: bool) -> None:
        self.consumed, self.launch_digest = None, None  # a restored round in flight is not checked
        self.rounds.repairs.forget(self)
        self.f.load_state_dict(st, joiner)
        self.pending = pending_from_state(st["pending"], self.f, joiner)
        self.rule.load_state_dict(st, joiner)
