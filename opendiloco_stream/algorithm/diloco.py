"""StreamingDiLoCo: wraps a model and its inner optimizer; decides when to send and what to apply.

The user's training loop stays vanilla; call ``diloco.step()`` once after every inner optimizer step::

    diloco = wrap(model, opt, transport=..., config=DiLoCoConfig(...))
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        diloco.step(tokens=batch.numel())
    diloco.close()

or let the optimizer call it (a step post-hook, ``algorithm/step_hook.py``)::

    with wrap(model, opt, transport=..., config=DiLoCoConfig(...)) as diloco:
        for batch in data:
            loss(model, batch).backward(); diloco.count_tokens(batch.numel()); opt.step(); opt.zero_grad()

``wrap`` returns a :class:`StreamingDiLoCo` (blocking, overlap, eager, naive-delayed) or, for the
``data-parallel`` baseline, a :class:`~opendiloco_stream.algorithm.data_parallel.DataParallel`.
No networking here: everything goes through a Transport. docs/algorithm.md states every rule.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.data_parallel import DataParallel
from opendiloco_stream.algorithm.fragment_state import DirectAccess, FragmentState, ParamAccess
from opendiloco_stream.algorithm.fragment_sync import FragmentSync, Rounds
from opendiloco_stream.algorithm.prematch import PrematchChoice, Prematcher
from opendiloco_stream.algorithm.repair import FETCH_TIMEOUT_S, SERVE_WAIT_S, Repairs, theta_digest
from opendiloco_stream.algorithm.rules import SyncRule, rule_class
from opendiloco_stream.algorithm.staging import (
    OuterPlacement, Staging, adamw_pending_bytes, outer_state_bytes, place_outer_state,
)
from opendiloco_stream.algorithm.step_hook import StepHooked
from opendiloco_stream.algorithm.sync_log import HasSyncLog, SyncLog
from opendiloco_stream.compression.error_feedback import ErrorFeedback
from opendiloco_stream.config import DiLoCoConfig, check_data_parallel
from opendiloco_stream.transport.base import Transport

logger = logging.getLogger(__name__)

MAX_ROUNDS_BEHIND = 16  # how many rounds of one fragment a catch-up looks past the next one


class StreamingDiLoCo(HasSyncLog, StepHooked):
    """Streaming DiLoCo over any Transport: blocking, tau-overlap, eager or naive-delayed.

    Call ``step(tokens)`` after every inner optimizer step and ``close()`` at the end, or use it
    as a context manager: ``with StreamingDiLoCo(...) as diloco:`` the optimizer's ``step()`` calls
    it (a step post-hook; ``count_tokens(n)`` before ``opt.step()`` gives the batch's tokens).

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
        # with digests, theta_bar's after each round consumed (``_digest_outer``)
        self.log = SyncLog(on_event, config.record_digests, keep_consumed=config.record_digests)
        self._closed = False
        self._catching_up = False  # inside step()'s jump to the swarm's round
        self._loaded = False  # a state was loaded (resume or join): theta_bar is not the initial model
        # state_dict() may run in another thread (a late joiner's download): it must never see a
        # half-applied step, e.g. the step counter advanced but a fragment's outer step not yet done
        self._lock = threading.RLock()
        if blocks is None:
            blocks = fr.find_blocks(model)
        config = self.config = config.resolved(len(blocks))  # num_fragments "auto": from the model's blocks
        num_fragments = config.num_fragments
        assert isinstance(num_fragments, int), "resolved() gives a number of fragments"
        fragments = fr.partition(model, blocks, num_fragments, config.fragment_pattern)
        offsets = fr.fragment_offsets(config.inner_steps, num_fragments)
        # before the outer state exists: a forking transport's children would keep its old pages (docs/benchmarks.md)
        self.transport.prepare({f.index: f.numel for f in fragments})
        self.placement = self._place_outer_state(fragments, optimizer, param_access)
        self.frags = [FragmentState(f, o, config, param_access, self.placement) for f, o in zip(fragments, offsets)]
        # outer gradients to the transport and averages back, off the training thread (staging.py)
        staging = Staging(self.frags[0].device, transport.wire_codec())
        rule = rule_class(config)  # what each fragment's rounds do: algorithm/rules.py
        # a fragment whose theta_bar drifted from its group's fetches the group's (repair.py)
        self.repairs = Repairs(transport, self.log, config.repair and rule.shares_outer,
                               min(config.sync_timeout, FETCH_TIMEOUT_S), lambda: self.step_count)
        self.rounds = Rounds(transport, staging, config, self.log, lambda: self.step_count,
                             lambda: self._catching_up, self._swarm_past, self.repairs)
        self.syncs = [FragmentSync(f, rule(f, config), self.rounds) for f in self.frags]
        self._prematcher = Prematcher(transport, config.prematch_steps, self.rounds.weight,  # groups formed ahead
                                      lambda p: self.repairs.early_digest(self.syncs[p]), on_change=self.log.emit)
        self.transport.set_state_provider(self._shared_state)
        self.transport.set_fragment_provider(self._fragment_state)

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
    def rules(self) -> list[SyncRule]:
        """Each fragment's rule (its policy)."""
        return [s.rule for s in self.syncs]

    @property
    def staging(self) -> Staging:
        """Outer gradients to the transport and averages back (``staging.py``)."""
        return self.rounds.staging

    @staging.setter
    def staging(self, staging: Staging) -> None:
        self.rounds.staging = staging

    @property
    def error_feedback(self) -> Optional[ErrorFeedback]:
        """The residual buffers of error feedback 'buffer' (None without it, or 'parameters')."""
        return self.rounds.error_feedback

    @property
    def prematch(self) -> PrematchChoice:
        """How many inner steps ahead groups form now, and why (``prematch_steps``, "auto" resolved)."""
        return self._prematcher.choice

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
            self.repairs.poll(self.syncs)  # repairs that arrived since the last step
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
            self._digest_outer()

    def _digest_outer(self) -> None:
        """``record_digests``: an ``outer_digest`` record (blake2b of theta_bar) for every fragment
        that consumed a round since the last call. Peers with equal digests hold the same global
        parameters bit for bit (what a joiner must reach: ``benchmarks/harness/wan_pair.py``)."""
        consumed, self.log.consumed = self.log.consumed, []
        if not self.config.record_digests:
            return
        for p, k in consumed:  # the repair's fingerprint of theta_bar, at 16 bytes
            self.log.emit({"event": "outer_digest", "fragment": p, "round": k, "step": self.step_count,
                           "digest": theta_digest(self.frags[p].outer, size=16)})

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
        for s in self.syncs:  # overlap's merge at t_k + tau; on-arrival rules land what arrived
            s.on_step(t)
        for s in self.syncs:
            if fr.syncs_at(t, s.f.offset, H):
                s.sync(fr.round_index(t, s.f.offset, H))
        if not self._catching_up:
            self._prematcher.after_step(t, self.frags, H, tokens)

    # ------------------------------------------------------------------ rounds
    def _round_late(self, fragment: int, k: int) -> bool:
        return self.transport.round_late((fragment, k))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (or to seed a late joiner): schedule position,
        outer parameters and optimizer state, eager state, error-feedback residuals.

        In-flight rounds are waited for (bounded by ``sync_timeout``) and stored as finished.
        Thread-safe: a snapshot is taken between two steps, never in the middle of one.
        """
        with self._lock:
            return {"step": self.step_count, "mode": self.config.mode,
                    "fragments": [s.state_dict(self.config.sync_timeout) for s in self.syncs],
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
        after the round landed instead, as any late joiner. With the marker the joiner is
        reserved in the first rounds (``reserve_rounds``): the one forming waits for it past its
        window, which a joiner across a long link needs (its step, lookups and join request take
        round trips)."""
        if self.at_initial_model() and not self._rounds_closed():
            marker: dict[str, Any] = {"step": 0, "initial": True}
            reserved_at = self.transport.reserve_rounds(self._rounds_after(0))  # the joiner's first ones
            if reserved_at is not None:
                marker["reserved_at"] = reserved_at
            return marker
        t0 = time.monotonic()
        with self._lock:
            state = self.state_dict()  # waits for a step in progress, then for the rounds in flight
            # the joiner takes part in the rounds after this state: reserved for it before this
            # peer trains on and launches them, so they wait for it however long its download takes
            reserved_at = self.transport.reserve_rounds(self.next_rounds())
        if reserved_at is not None:
            state["reserved_at"] = reserved_at
        logger.info("state of step %d for a joiner in %.2fs (a step in progress and the rounds in flight "
                    "land first)", state["step"], time.monotonic() - t0)
        return state

    def _fragment_state(self, fragment: int, round_index: int) -> dict[str, Any]:
        """What a groupmate repairing fragment ``fragment`` after round ``round_index`` downloads
        (``repair.py``): its theta_bar and outer optimizer state after the last round this peer
        consumed (``round``), taken between two steps; once that is ``round_index``, or after
        ``SERVE_WAIT_S`` (the groupmate, which landed it first, then asks again or gives up)."""
        if not 0 <= fragment < len(self.syncs):
            raise ValueError(f"no fragment {fragment} (this model has {len(self.syncs)})")
        s, deadline = self.syncs[fragment], time.monotonic() + SERVE_WAIT_S
        while (s.consumed is None or s.consumed < round_index) and time.monotonic() < deadline and not self._closed:
            time.sleep(0.01)  # it lands within a step or two: between the steps, without the lock
        with self._lock:
            st = s.f.state_dict()
            return {"fragment": fragment, "round": s.consumed, "outer_params": st["outer_params"],
                    "outer_opt": st["outer_opt"]}

    def _rounds_closed(self) -> bool:
        """Whether a launched round not yet applied is closed to newcomers (``takes_newcomers``)."""
        return any(s.pending is not None and not s.pending.handle.takes_newcomers() for s in self.syncs)

    def load_state_dict(self, state: dict[str, Any], *, joiner: bool = False) -> None:
        """Restore from ``state_dict()``. With ``joiner=True`` (state from another peer) the local
        parameters are set to the outer parameters, the donor's own contributions are not taken
        as ours, and error-feedback residuals start empty."""
        if state.get("initial"):  # a donor still at the initial model: nothing to adopt (``_shared_state``)
            if joiner:
                # but this peer takes part in the first rounds: counted there, it does not sit them
                # out as a fresh peer in a running swarm would (the donor waits for it in them)
                self.transport.expect_rounds(self.next_rounds(), since=state.get("reserved_at"))
            return
        with self._lock:
            self._loaded = True
            if len(state["fragments"]) != len(self.frags):
                raise ValueError(f"state has {len(state['fragments'])} fragments, this model has {len(self.frags)}")
            self.step_count = int(state["step"])
            for s, st in zip(self.syncs, state["fragments"]):
                s.load_state_dict(st, joiner)
            if self.rounds.error_feedback is not None:
                self.rounds.error_feedback = ErrorFeedback(self.config.error_feedback_decay)
                if not joiner and state.get("error_feedback") is not None:
                    self.rounds.error_feedback.load_state_dict(state["error_feedback"])
            if joiner:  # so that the others count this peer in them
                self.transport.expect_rounds(self.next_rounds(), since=state.get("reserved_at"))

    def next_rounds(self) -> list[tuple[int, int]]:
        """(fragment, round) of the next round of every fragment from the current step."""
        return self._rounds_after(self.step_count)

    def _rounds_after(self, step: int) -> list[tuple[int, int]]:
        H = self.config.inner_steps
        return [(f.index, fr.round_index(fr.next_sync(int(step), f.offset, H), f.offset, H)) for f in self.frags]

    def expect_rounds_after(self, step: int, since: Optional[float] = None) -> None:
        """A joiner that learned the step of the state it is downloading (before its tensors
        arrive): take part in the rounds that follow that step, announced now, so that the swarm's
        next rounds count this peer and wait for it instead of going on without it
        (``Transport.expect_rounds``; ``since``: when the donor reserved them, if it did: this
        keeps them alive). ``load_state_dict`` announces the same rounds again."""
        self.transport.expect_rounds(self._rounds_after(step), since=since)

    def missed_rounds(self) -> list[tuple[int, int]]:
        """After a join: those of this peer's next rounds that the swarm launched already. A joiner
        whose download took longer than the gap to a round would run that round alone and its outer
        parameters would stay a step apart from everyone's: it downloads again (``train/loop.py``)."""
        if self.at_initial_model():
            return []  # the donor was at the initial model too: the others' first rounds are still forming
        return list(self.transport.rounds_launched(self.next_rounds()))

    @property
    def in_flight(self) -> bool:
        """Whether a launched round has not been applied yet (what ``finish`` would apply)."""
        return any(s.pending is not None for s in self.syncs)

    def finish(self) -> None:
        """End of training: let the rounds still in flight land and apply them, so the final model
        holds every round's group average (waits at most ``sync_timeout`` per round; no inner step
        waits). Eager 'corrected' commits each average to theta_bar and swaps the estimate step for
        it, keeping the local progress since the restart; overlap applies its pending merge now.
        Eager 'paper' and naive-delayed have no correction step and only record the rounds.
        Call it once, after the last ``step()``; the state is no longer an exact resume point."""
        with self._lock:
            for s in self.syncs:
                s.finish()
            self._digest_outer()

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
        self.repairs.close()
        self.staging.close()




def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport, config: DiLoCoConfig,
         blocks: Optional[list[nn.Module]] = None, on_event: Optional[Callable[[dict[str, Any]], None]] = None,
         param_access: Optional[ParamAccess] = None):
    """The wrapper for ``config.mode``: DataParallel for 'data-parallel', else StreamingDiLoCo."""
    if config.mode == "data-parallel":
        check_data_parallel(config.mode, sharded=param_access is not None)
        return DataParallel(model, optimizer, transport, config, blocks=blocks, on_event=on_event)
    return StreamingDiLoCo(model, optimizer, transport, config, blocks=blocks, on_event=on_event,
                           param_access=param_access)
