"""StreamingDiLoCo: wraps a model and its inner optimizer; decides when to send and what to apply.

The user's training loop stays vanilla; call ``diloco.step()`` once after every inner optimizer step::

    diloco = wrap(model, opt, transport=..., config=DiLoCoConfig(...))
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        diloco.step(tokens=batch.numel())
    diloco.close()

``wrap`` returns a :class:`StreamingDiLoCo` (blocking, overlap, eager, naive-delayed) or, for the
``data-parallel`` baseline, a :class:`~opendiloco_stream.algorithm.data_parallel.DataParallel`.
No networking here: everything goes through a Transport. docs/algorithm.md states every rule.
"""

from __future__ import annotations

import contextlib
import logging
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.fragment_state import DirectAccess, FragmentState, ParamAccess, _Pending
from opendiloco_stream.algorithm.prematch import Prematcher
from opendiloco_stream.algorithm.rules import SyncRule, rule_class
from opendiloco_stream.algorithm.staging import (
    OuterPlacement, Staging, adamw_pending_bytes, outer_state_bytes, place_outer_state,
)
from opendiloco_stream.algorithm.sync_log import HasSyncLog, SyncLog
from opendiloco_stream.compression.error_feedback import ErrorFeedback
from opendiloco_stream.config import DiLoCoConfig, check_data_parallel
from opendiloco_stream.transport.base import SyncResult, Transport

logger = logging.getLogger(__name__)

MAX_ROUNDS_BEHIND = 16  # how many rounds of one fragment a catch-up looks past the next one


class StreamingDiLoCo(HasSyncLog):
    """Streaming DiLoCo over any Transport: blocking, tau-overlap, eager or naive-delayed.

    Args:
        model: the local model (its parameters are the inner parameters theta_m).
        optimizer: the inner optimizer; its state stays local and is never reset.
        transport: one peer's view of the group (LocalSwarm.transport(rank), HivemindTransport...).
        config: the algorithm's knobs (DiLoCoConfig); ``data-parallel`` is :func:`wrap`'s job.
        blocks: the transformer blocks for the fragment partition; auto-detected if omitted.
        on_event: called with a dict for every consumed sync (the per-sync metrics record).
        param_access: how the local parameters are read and written (``fragment_state.ParamAccess``);
            ``None``: the model's own parameters. A sharded peer passes ``train/sharded.py``'s.
    """

    waits_in_optimizer_step = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                 config: DiLoCoConfig, blocks: Optional[list[nn.Module]] = None,
                 on_event: Optional[Callable[[dict[str, Any]], None]] = None,
                 param_access: Optional[ParamAccess] = None):
        if config.mode == "data-parallel":
            raise ValueError("mode 'data-parallel' is the DataParallel wrapper: build it with "
                             "opendiloco_stream.algorithm.wrap(...)")
        self.model, self.optimizer, self.transport, self.config = model, optimizer, transport, config
        self.step_count = 0  # t: inner steps taken
        self.log = SyncLog(on_event, config.record_digests)
        # error feedback: what the codec did not send waits in a residual buffer added to the next
        # outer gradient ('buffer'), or in this peer's local parameters ('parameters', see keep_unsent)
        self._unsent_in_params = config.use_error_feedback and config.error_feedback_mode == "parameters"
        self.error_feedback = (ErrorFeedback(config.error_feedback_decay)
                               if config.use_error_feedback and not self._unsent_in_params else None)
        self._closed = False
        self._catching_up = False  # inside step()'s jump to the swarm's round
        self._loaded = False  # a state was loaded (resume or join): theta_bar is not the initial model
        self._prematcher = Prematcher(transport, config.prematch_steps, self._weight)  # groups formed ahead
        # state_dict() may run in another thread (a late joiner's download): it must never see a
        # half-applied step, e.g. the step counter advanced but a fragment's outer step not yet done
        self._lock = threading.RLock()
        if blocks is None:
            blocks = fr.find_blocks(model)
        config = self.config = config.resolved(len(blocks))  # num_fragments "auto": from the model's blocks
        fragments = fr.partition(model, blocks, config.num_fragments, config.fragment_pattern)
        offsets = fr.fragment_offsets(config.inner_steps, config.num_fragments)
        # before the outer state exists: a forking transport's children would keep its old pages (docs/benchmarks.md)
        self.transport.prepare({f.index: f.numel for f in fragments})
        self.placement = self._place_outer_state(fragments, optimizer, param_access)
        self.frags = [FragmentState(f, o, config, param_access, self.placement) for f, o in zip(fragments, offsets)]
        # outer gradients to the transport and averages back, off the training thread (staging.py)
        wire_codec = getattr(transport, "wire_codec", None)  # duck-typed transports may lack it
        self.staging = Staging(self.frags[0].device, wire_codec() if wire_codec is not None else None)
        rule = rule_class(config)  # what each fragment's rounds do: algorithm/rules.py
        self.rules: list[SyncRule] = [rule(self, f, config) for f in self.frags]
        self.transport.set_state_provider(self._shared_state)

    def _place_outer_state(self, fragments: list[fr.Fragment], optimizer: torch.optim.Optimizer,
                           param_access: Optional[ParamAccess]) -> OuterPlacement:
        """Where the outer state of every fragment lives (``diloco.outer_device``, decided once for
        the whole model: ``staging.place_outer_state``)."""
        c = self.config
        numel = sum(f.numel for f in fragments)
        outer = outer_state_bytes(numel, c.outer_momentum > 0,
                                  c.mode == "eager" and c.eager_rule == "corrected")
        access = param_access if param_access is not None else DirectAccess()
        device = access.read(fragments[0])[0].device
        return place_outer_state(c.outer_device, device, outer, adamw_pending_bytes(optimizer))

    @property
    def fragments(self) -> list[fr.Fragment]:
        return [f.fragment for f in self.frags]

    @property
    def outer_params(self) -> list[list[torch.Tensor]]:  # theta_bar per fragment (fp32)
        return [f.outer for f in self.frags]

    # ------------------------------------------------------------------ the per-step entry point
    def step(self, tokens: Optional[int] = None) -> None:
        """Call once after every inner optimizer step; ``tokens`` = tokens in that step's batch.

        A peer behind the swarm catches up: when the transport says the others launched the next
        round of a fragment a while ago (``Transport.round_late``), the step counter jumps to that
        round's sync step and the syncs it passes run at once, with the tokens processed so far.
        A slower peer so takes part in the swarm's rounds, weighted by the work it did."""
        if self._closed:
            raise RuntimeError("StreamingDiLoCo.step() after close()")
        self._prematcher.tick()
        with self._lock:
            self._advance(int(tokens) if tokens else 0)
            target = self._late_sync_step()
            if target is not None:
                start = self.step_count
                self._catching_up = True
                try:
                    while self.step_count < target:
                        self._advance(0)
                finally:
                    self._catching_up = False
                self.log.stats.caught_up_steps += target - start
                self.log.emit({"event": "catch_up", "from_step": start, "to_step": target})

    def _late_sync_step(self) -> Optional[int]:
        """The latest sync step among fragments whose next round the swarm launched already: that
        round's, or a later one's if the swarm launched later rounds of the fragment too (a peer
        several rounds behind jumps to the swarm's round in one go, not one round per look)."""
        t, H = self.step_count, self.config.inner_steps
        late = []
        for f in self.frags:
            s = fr.next_sync(t, f.offset, H)
            k = fr.round_index(s, f.offset, H)
            if not self._round_late(f.index, k):
                continue
            for _ in range(MAX_ROUNDS_BEHIND):
                if not self._round_late(f.index, k + 1):
                    break
                s, k = s + H, k + 1
            late.append(s)
        return max(late, default=None)

    def _swarm_past(self) -> bool:
        """Whether the other peers launched a round whose sync step comes after this peer's step:
        they are past the round this peer waits for, which can no longer form with them. Waiting
        it out would put this peer a matchmaking window behind them for good (in blocking and
        overlap modes each peer then reaches every round as the other gives up on it); given up,
        the round fails at once and ``step`` catches up with the swarm's round."""
        t, H = self.step_count, self.config.inner_steps
        return any(self._round_late(g.index, fr.round_index(fr.next_sync(t, g.offset, H), g.offset, H))
                   for g in self.frags)

    def _advance(self, tokens: int) -> None:
        """One inner step of the schedule: count the tokens, apply or land what is due, sync."""
        self.step_count += 1
        t, H = self.step_count, self.config.inner_steps
        for f in self.frags:
            f.tokens += tokens
        for r in self.rules:  # overlap's merge at t_k + tau; on-arrival rules land what arrived
            r.on_step(t)
        for f, r in zip(self.frags, self.rules):
            if fr.syncs_at(t, f.offset, H):
                r.sync(fr.round_index(t, f.offset, H))
                self.keep_unsent(f)
        if not self._catching_up:
            self._prematcher.after_step(t, self.frags, H, tokens)

    def _weight(self, tokens: int) -> float:
        return 1.0 if self.config.weighting == "equal" or tokens == 0 else float(tokens)

    # ------------------------------------------------------------------ rounds
    def _round_late(self, fragment: int, k: int) -> bool:
        round_late = getattr(self.transport, "round_late", None)  # duck-typed transports may lack it
        return round_late is not None and bool(round_late((fragment, k)))

    def launch(self, f: FragmentState, k: int, d: torch.Tensor) -> _Pending:
        """Put round k of fragment ``f`` on the wire with outer gradient ``d`` (for the rules)."""
        send = d if self.error_feedback is None else self.error_feedback.compensate(f.index, d)
        key, weight = (f.index, k), self._weight(f.tokens)
        handle = self.staging.launch(key, send, lambda host: self.transport.all_reduce(key, host, weight=weight))
        f.tokens = 0
        t = self.step_count
        return _Pending(handle, k, t, t + self.config.overlap_steps, d, send)

    def _wait(self, f: FragmentState, pending: _Pending) -> tuple[Optional[SyncResult], Optional[str], float]:
        if self._catching_up and not pending.handle.done() and self._round_late(f.index, pending.round + 1):
            # the others launched this fragment's next round a while ago: this round is over for
            # them, and waiting for its group would only make this peer late again
            abandon = getattr(pending.handle, "abandon", None)  # duck-typed handles may lack it
            if abandon is not None:
                abandon()
        watches = getattr(self.transport, "watches_swarm", False)  # duck-typed transports may lack it
        give_up = self._swarm_past if watches else None
        result, reason, waited = self.log.wait(pending.handle, self.config.sync_timeout, give_up=give_up)
        if result is not None and result.average.device != f.device:  # transports hand back CPU tensors
            result = dataclasses.replace(result, average=f.to_outer_device(result.average),
                                         sent=f.to_outer_device(result.sent))
        if self.error_feedback is not None:
            # residual = what we meant to send minus what went on the wire; dropped if the round failed
            if result is not None:
                self.error_feedback.update(f.index, pending.sent_input, result.sent)
            else:
                self.error_feedback.reset(f.index)
        elif self._unsent_in_params and result is not None:
            # a failed round leaves nothing unsent: theta_bar steps with the whole d (local-only)
            f.unsent = (pending.sent_input - result.sent) * self.config.error_feedback_decay
        return result, reason, waited

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
        if f.unsent is not None:
            f.set_local([q - scale * u for q, u in zip(f.local(), f.split(f.unsent))])
            f.unsent = None

    def consume(self, f: FragmentState, pending: _Pending, applied: bool = False,
                apply: Optional[Callable[[Optional[SyncResult]], dict[str, Any]]] = None) -> Optional[SyncResult]:
        """Wait for a round and record it (for the rules). ``applied``: the record says what this
        sync applies ("average", or "local-only" if the round failed), as blocking and overlap do.
        ``apply(result)``, if given, runs before the record is emitted and returns fields for it
        (how the landed average compared with what the peer went on with meanwhile). Every record
        says ``land_steps``: inner steps from the round's launch to this step."""
        result, reason, waited = self._wait(f, pending)
        extra = {"land_steps": self.step_count - pending.launched_at}
        if result is not None:
            stats = self.log.stats
            stats.land_steps += extra["land_steps"]
            stats.peak_land_steps = max(stats.peak_land_steps, extra["land_steps"])
        if apply is not None:
            extra.update(apply(result))
        estimate = ("average" if result is not None else "local-only") if applied else None
        self.log.record(f.index, pending.round, self.step_count, result, reason, waited, estimate, extra)
        return result

    def log_outer_step(self, f: FragmentState, k: int, kind: str) -> None:
        """Record an outer step taken at a sync with an estimate ``kind`` (for the rules)."""
        if kind == "local-only":
            self.log.stats.local_only_steps += 1
        self.log.emit({"event": "outer_step", "fragment": f.index, "round": k, "step": self.step_count,
                       "estimate": kind})

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (or to seed a late joiner): schedule position,
        outer parameters and optimizer state, eager state, error-feedback residuals.

        In-flight rounds are waited for (bounded by ``sync_timeout``) and stored as finished.
        Thread-safe: a snapshot is taken between two steps, never in the middle of one.
        """
        with self._lock:
            return {"step": self.step_count, "mode": self.config.mode,
                    "fragments": [{**f.state_dict(), **r.state_dict(self.config.sync_timeout)}
                                  for f, r in zip(self.frags, self.rules)],
                    "error_feedback": None if self.error_feedback is None else self.error_feedback.state_dict()}

    def at_initial_model(self) -> bool:
        """Whether theta_bar is still the initial model: no outer step taken, no state loaded."""
        return not self._loaded and all(f.opt.steps == 0 for f in self.frags)

    def _shared_state(self) -> dict[str, Any]:
        """What a late joiner downloads: ``state_dict()``, or, while theta_bar is still the initial
        model (peers started together), ``{"step": 0, "initial": True}`` at once, without waiting
        for a step that holds the lock (a blocking round's matchmaking): the joiner keeps its own
        initial model, the same for the same seed, and meets this peer in the first rounds.

        Not the marker while one of this peer's launched rounds is closed to newcomers (a
        non-blocking rule trains on while its first rounds run; a round that has its group, or
        waits only for the peers it counted): the joiner could not be in it, and from the
        initial model it would stay that round's outer step behind everyone. It gets the state
        after the round landed instead, as any late joiner."""
        if self.at_initial_model() and not self._rounds_closed():
            return {"step": 0, "initial": True}
        t0 = time.monotonic()
        state = self.state_dict()  # waits for a step in progress, then for the rounds in flight
        logger.info("state of step %d for a joiner in %.2fs (a step in progress and the rounds in flight "
                    "land first)", state["step"], time.monotonic() - t0)
        return state

    def _rounds_closed(self) -> bool:
        """Whether a launched round not yet applied is closed to newcomers (``takes_newcomers``)."""
        for r in self.rules:
            pending = r.pending
            takes = getattr(pending.handle, "takes_newcomers", None) if pending is not None else None
            if takes is not None and takes() is False:  # duck-typed handles may lack it (or answer None)
                return True
        return False

    def load_state_dict(self, state: dict[str, Any], *, joiner: bool = False) -> None:
        """Restore from ``state_dict()``. With ``joiner=True`` (state from another peer) the local
        parameters are set to the outer parameters, the donor's own contributions are not taken
        as ours, and error-feedback residuals start empty."""
        expect_rounds = getattr(self.transport, "expect_rounds", None)
        if state.get("initial"):  # a donor still at the initial model: nothing to adopt (``_shared_state``)
            if joiner and expect_rounds is not None:
                # but this peer takes part in the first rounds: counted there, it does not sit them
                # out as a fresh peer in a running swarm would (the donor waits for it in them)
                expect_rounds(self.next_rounds())
            return
        with self._lock:
            self._loaded = True
            if len(state["fragments"]) != len(self.frags):
                raise ValueError(f"state has {len(state['fragments'])} fragments, this model has {len(self.frags)}")
            self.step_count = int(state["step"])
            for f, r, st in zip(self.frags, self.rules, state["fragments"]):
                f.load_state_dict(st, joiner)
                r.load_state_dict(st, joiner)
            if self.error_feedback is not None:
                self.error_feedback = ErrorFeedback(self.config.error_feedback_decay)
                if not joiner and state.get("error_feedback") is not None:
                    self.error_feedback.load_state_dict(state["error_feedback"])
            if joiner and expect_rounds is not None:  # so that the others count this peer in them
                expect_rounds(self.next_rounds())

    def next_rounds(self) -> list[tuple[int, int]]:
        """(fragment, round) of the next round of every fragment from the current step."""
        t, H = self.step_count, self.config.inner_steps
        return [(f.index, fr.round_index(fr.next_sync(t, f.offset, H), f.offset, H)) for f in self.frags]

    def missed_rounds(self) -> list[tuple[int, int]]:
        """After a join: those of this peer's next rounds that the swarm launched already. A joiner
        whose download took longer than the gap to a round would run that round alone and its outer
        parameters would stay a step apart from everyone's: it downloads again (``train/loop.py``)."""
        if self.at_initial_model():
            return []  # the donor was at the initial model too: the others' first rounds are still forming
        launched = getattr(self.transport, "rounds_launched", None)  # duck-typed transports may lack it
        return [] if launched is None else list(launched(self.next_rounds()))

    @property
    def in_flight(self) -> bool:
        """Whether a launched round has not been applied yet (what ``finish`` would apply)."""
        return any(r.pending is not None for r in self.rules)

    def finish(self) -> None:
        """End of training: let the rounds still in flight land and apply them, so the final model
        holds every round's group average (waits at most ``sync_timeout`` per round; no inner step
        waits). Eager 'corrected' commits each average to theta_bar and swaps the estimate step for
        it, keeping the local progress since the restart; overlap applies its pending merge now.
        Eager 'paper' and naive-delayed have no correction step and only record the rounds.
        Call it once, after the last ``step()``; the state is no longer an exact resume point."""
        with self._lock:
            for r in self.rules:
                if r.pending is not None:
                    r.finish()

    @contextlib.contextmanager
    def global_params(self) -> Iterator[None]:
        """Within the block the model holds theta_bar in every fragment (the outer parameters every
        peer agrees on, without this peer's local progress since its last restart); restored after."""
        with self._lock:
            saved = [f.local_copy() for f in self.frags]
            try:
                for f in self.frags:
                    f.set_local(f.outer)
                yield
            finally:
                for f, values in zip(self.frags, saved):
                    f.set_local(values)

    def close(self) -> None:
        """Stop using the transport. Rounds still in flight are left to the transport to cancel."""
        self._closed = True
        self.staging.close()




def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport, config: DiLoCoConfig,
         blocks: Optional[list[nn.Module]] = None, on_event: Optional[Callable[[dict[str, Any]], None]] = None,
         param_access: Optional[ParamAccess] = None):
    """The wrapper for ``config.mode``: DataParallel for 'data-parallel', else StreamingDiLoCo."""
    if config.mode == "data-parallel":
        check_data_parallel(config.mode, sharded=param_access is not None)
        from opendiloco_stream.algorithm.data_parallel import DataParallel

        return DataParallel(model, optimizer, transport, config, blocks=blocks, on_event=on_event)
    return StreamingDiLoCo(model, optimizer, transport, config, blocks=blocks, on_event=on_event,
                           param_access=param_access)
