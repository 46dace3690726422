"""StreamingDiLoCo: wraps a model and its inner optimizer; decides when to send and what to apply.

The user's training loop stays vanilla; call ``diloco.step()`` once after every inner optimizer step::

    diloco = StreamingDiLoCo(model, opt, transport=..., config=DiLoCoConfig(...))
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        diloco.step(tokens=batch.numel())
    diloco.close()

In ``data-parallel`` mode it instead averages gradients inside ``opt.step()`` (a pre-step hook), so
the same loop runs the baseline. No networking here: everything goes through a Transport.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.outer import OuterOptimizer, eager_estimate, joiner_estimate, overlap_merge
from opendiloco_stream.config import DiLoCoConfig
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult, Transport


@dataclass
class _Pending:
    """A launched round whose result is not consumed yet."""

    handle: SyncHandle
    round: int
    launched_at: int        # inner step
    apply_at: int           # inner step at which overlap mode applies it
    outer_grad: torch.Tensor  # fp32 d_k (what the local-only fallback uses)
    sent_input: torch.Tensor  # what was handed to the transport (d_k + residual under EF)


@dataclass
class _Previous:
    """Round k-1's outcome as the eager / naive-delayed rules need it."""

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


class StreamingDiLoCo:
    """Streaming DiLoCo over any Transport: blocking, tau-overlap, eager, naive-delayed or data-parallel.

    Args:
        model: the local model (its parameters are the inner parameters theta_m).
        optimizer: the inner optimizer; its state stays local and is never reset.
        transport: one peer's view of the group (LocalSwarm.transport(rank), HivemindTransport...).
        config: the algorithm's knobs (DiLoCoConfig).
        blocks: the transformer blocks for the fragment partition; auto-detected if omitted.
        on_event: called with a dict for every consumed sync (the per-sync metrics record).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                 config: DiLoCoConfig, blocks: Optional[list[nn.Module]] = None,
                 on_event: Optional[Callable[[dict[str, Any]], None]] = None):
        self.model, self.optimizer, self.transport, self.config = model, optimizer, transport, config
        self.on_event = on_event
        self.step_count = 0  # t: inner steps taken
        self.events: list[dict[str, Any]] = []
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "peak_bytes_per_sync": 0, "syncs": 0,
                      "failed_syncs": 0, "local_only_steps": 0, "wait_s": 0.0, "rejected": 0}
        self._closed = False
        # state_dict() may run in another thread (a late joiner's download): it must never see a
        # half-applied step, e.g. the step counter advanced but a fragment's outer step not yet done
        self._lock = threading.RLock()
        H, P = config.inner_steps, config.num_fragments

        if config.mode == "data-parallel":
            self.fragments = [fr.Fragment(index=0, names=[n for n, p in model.named_parameters() if p.requires_grad],
                                          params=[p for p in model.parameters() if p.requires_grad])]
            self.offsets = [0]
            self.transport.prepare({0: self.fragments[0].numel})
            self._dp_hook = optimizer.register_step_pre_hook(self._average_gradients)
            return

        if blocks is None:
            blocks = fr.find_blocks(model)
        self.fragments = fr.partition(model, blocks, P, config.fragment_pattern)
        self.offsets = fr.fragment_offsets(H, P)
        self.transport.prepare({f.index: f.numel for f in self.fragments})
        # theta_bar: fp32 outer parameters, one Nesterov SGD per fragment
        self.outer_params = [[p.detach().float().clone() for p in f.params] for f in self.fragments]
        self.outer_opts = [OuterOptimizer(ps, config.outer_lr, config.outer_momentum, config.outer_nesterov)
                           for ps in self.outer_params]
        self._tokens = [0] * P
        self._pending: list[Optional[_Pending]] = [None] * P
        self._previous: list[Optional[_Previous]] = [None] * P
        self._residual: list[Optional[torch.Tensor]] = [None] * P  # error feedback
        self.transport.set_state_provider(self.state_dict)

    # ------------------------------------------------------------------ the per-step entry point
    def step(self, tokens: Optional[int] = None) -> None:
        """Call once after every inner optimizer step; ``tokens`` = tokens in that step's batch."""
        if self._closed:
            raise RuntimeError("StreamingDiLoCo.step() after close()")
        with self._lock:
            self._step(tokens)

    def _step(self, tokens: Optional[int]) -> None:
        self.step_count += 1
        t = self.step_count
        if self.config.mode == "data-parallel":
            return
        for p in range(self.config.num_fragments):
            self._tokens[p] += int(tokens) if tokens else 0
        mode = self.config.mode
        if mode == "overlap":
            for p, pending in enumerate(self._pending):
                if pending is not None and pending.apply_at == t:
                    self._apply_overlap(p, pending)
        for p, offset in enumerate(self.offsets):
            if fr.syncs_at(t, offset, self.config.inner_steps):
                self._sync(p, fr.round_index(t, offset, self.config.inner_steps))

    # ------------------------------------------------------------------ per fragment
    def _outer_grad(self, p: int) -> torch.Tensor:
        """d = theta_bar - theta_local, flat fp32 (old minus new)."""
        return torch.cat([(tb - q.detach().float()).reshape(-1)
                          for tb, q in zip(self.outer_params[p], self.fragments[p].params)])

    def _weight(self, p: int) -> float:
        if self.config.weighting == "equal" or self._tokens[p] == 0:
            return 1.0
        return float(self._tokens[p])

    def _launch(self, p: int, k: int, d: torch.Tensor) -> _Pending:
        send = d
        if self.config.error_feedback and self._residual[p] is not None:
            send = d + self._residual[p]
        handle = self.transport.all_reduce((p, k), send, weight=self._weight(p))
        self._tokens[p] = 0
        t = self.step_count
        return _Pending(handle, k, t, t + self.config.overlap_steps, d, send)

    def _wait(self, p: int, pending: _Pending) -> tuple[Optional[SyncResult], Optional[str], float]:
        start = time.perf_counter()
        try:
            result = pending.handle.wait(timeout=self.config.sync_timeout)
            reason = None
        except SyncFailed as e:
            result, reason = None, e.reason
        waited = time.perf_counter() - start
        self.stats["wait_s"] += waited
        if self.config.error_feedback:
            # residual = what we meant to send minus what went on the wire; dropped if the round failed
            self._residual[p] = (pending.sent_input - result.sent) if result is not None else None
        return result, reason, waited

    def _apply_outer(self, p: int, outer_grad: torch.Tensor) -> None:
        """theta_bar_p <- OuterOpt_p(theta_bar_p, outer_grad)."""
        self.outer_opts[p].step(outer_grad)

    def _copy_outer_to_local(self, p: int) -> None:
        with torch.no_grad():
            for q, tb in zip(self.fragments[p].params, self.outer_params[p]):
                q.copy_(tb)

    def _sync(self, p: int, k: int) -> None:
        mode = self.config.mode
        d = self._outer_grad(p)
        if mode == "blocking":
            pending = self._launch(p, k, d)
            result, reason, waited = self._wait(p, pending)
            self._apply_outer(p, result.average if result is not None else d)
            self._copy_outer_to_local(p)
            self._record(p, k, result, reason, waited, "average" if result is not None else "local-only")
        elif mode == "overlap":
            self._pending[p] = self._launch(p, k, d)
        else:  # eager / naive-delayed: consume round k-1, launch round k, step with the estimate
            prev_pending = self._pending[p]
            if prev_pending is not None:
                result, reason, waited = self._wait(p, prev_pending)
                if result is not None:
                    self._previous[p] = _Previous(result.average, result.sent, result.weight_share,
                                                  result.group_size, result.included_self)
                else:
                    self._previous[p] = None
                self._record(p, prev_pending.round, result, reason, waited, None)
            self._pending[p] = self._launch(p, k, d)
            prev = self._previous[p]
            if prev is None:
                estimate, kind = d, "local-only"
            elif mode == "naive-delayed":
                estimate, kind = prev.average, "delayed"
            elif prev.included_self and prev.sent is not None:
                estimate, kind = eager_estimate(d, prev.average, prev.sent, prev.share), "eager"
            else:
                estimate, kind = joiner_estimate(d, prev.average, prev.group_size), "eager-joiner"
            self._previous[p] = None  # each round's result is used exactly once
            if kind == "local-only":
                self.stats["local_only_steps"] += 1
            self._apply_outer(p, estimate)
            self._copy_outer_to_local(p)
            self._emit({"event": "outer_step", "fragment": p, "round": k, "step": self.step_count,
                        "estimate": kind})

    def _apply_overlap(self, p: int, pending: _Pending) -> None:
        result, reason, waited = self._wait(p, pending)
        self._apply_outer(p, result.average if result is not None else pending.outer_grad)
        with torch.no_grad():
            for q, tb in zip(self.fragments[p].params, self.outer_params[p]):
                q.copy_(overlap_merge(q.detach().float(), tb, self.config.alpha))
        self._pending[p] = None
        self._record(p, pending.round, result, reason, waited, "average" if result is not None else "local-only")
        if result is None:
            self.stats["local_only_steps"] += 1

    # ------------------------------------------------------------------ data-parallel baseline
    def _average_gradients(self, optimizer, args, kwargs) -> None:
        params = self.fragments[0].params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = fr.flatten(grads)
        t = self.step_count + 1
        handle = self.transport.all_reduce((0, t), flat, weight=1.0)
        start = time.perf_counter()
        try:
            result, reason = handle.wait(timeout=self.config.sync_timeout), None
        except SyncFailed as e:
            result, reason = None, e.reason
        waited = time.perf_counter() - start
        self.stats["wait_s"] += waited
        if result is not None:
            for p, g in zip(params, fr.unflatten(result.average, grads)):
                if p.grad is None:
                    p.grad = g.to(p.dtype).clone()
                else:
                    p.grad.copy_(g)
        self._record(0, t, result, reason, waited, "average" if result is not None else "local-only")

    # ------------------------------------------------------------------ metrics
    def _record(self, p: int, k: int, result: Optional[SyncResult], reason: Optional[str], waited: float,
                estimate: Optional[str]) -> None:
        self.stats["syncs"] += 1
        rec: dict[str, Any] = {"event": "sync", "fragment": p, "round": k, "step": self.step_count,
                               "ok": result is not None, "wait_s": round(waited, 6)}
        if result is not None:
            rec.update(group_size=result.group_size, bytes_sent=result.bytes_sent,
                       bytes_received=result.bytes_received, weight_share=round(result.weight_share, 6),
                       included_self=result.included_self, rejected=result.rejected)
            self.stats["bytes_sent"] += result.bytes_sent
            self.stats["bytes_received"] += result.bytes_received
            self.stats["peak_bytes_per_sync"] = max(self.stats["peak_bytes_per_sync"], result.bytes_sent)
            self.stats["rejected"] += result.rejected
            if self.config.record_digests:
                rec["digest"] = hashlib.blake2b(result.average.detach().cpu().float().numpy().tobytes(),
                                                digest_size=16).hexdigest()
        else:
            rec.update(group_size=0, reason=reason)
            self.stats["failed_syncs"] += 1
        if estimate is not None:
            rec["estimate"] = estimate
        self._emit(rec)

    def _emit(self, rec: dict[str, Any]) -> None:
        self.events.append(rec)
        if self.on_event is not None:
            self.on_event(rec)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (or to seed a late joiner): schedule position,
        outer parameters and optimizer state, eager state, error-feedback residuals.

        In-flight rounds are waited for (bounded by ``sync_timeout``) and stored as finished.
        Thread-safe: a snapshot is taken between two steps, never in the middle of one.
        """
        with self._lock:
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step_count, "mode": self.config.mode}
        if self.config.mode == "data-parallel":
            return state
        pending = []
        for p, pend in enumerate(self._pending):
            if pend is None:
                pending.append(None)
                continue
            try:
                res = pend.handle.wait(timeout=self.config.sync_timeout)
                res_state = {"average": res.average.clone(), "sent": res.sent.clone(), "share": res.weight_share,
                             "group_size": res.group_size, "included_self": res.included_self,
                             "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received}
            except SyncFailed:
                res_state = None
            pending.append({"round": pend.round, "launched_at": pend.launched_at, "apply_at": pend.apply_at,
                            "outer_grad": pend.outer_grad.clone(), "sent_input": pend.sent_input.clone(),
                            "result": res_state})
        state.update(
            outer_params=[[t.clone() for t in ps] for ps in self.outer_params],
            outer_opt=[o.state_dict() for o in self.outer_opts],
            tokens=list(self._tokens),
            pending=pending,
            previous=[None if pr is None else dict(pr.__dict__) for pr in self._previous],
            residual=[None if r is None else r.clone() for r in self._residual],
        )
        return state

    def load_state_dict(self, state: dict[str, Any], *, joiner: bool = False) -> None:
        """Restore from ``state_dict()``. With ``joiner=True`` (state from another peer) the local
        parameters are set to the outer parameters, the donor's own contributions are not taken
        as ours, and error-feedback residuals start empty."""
        with self._lock:
            self._load_state_dict(state, joiner)

    def _load_state_dict(self, state: dict[str, Any], joiner: bool) -> None:
        self.step_count = int(state["step"])
        if self.config.mode == "data-parallel":
            return
        with torch.no_grad():
            for mine, theirs in zip(self.outer_params, state["outer_params"]):
                for a, b in zip(mine, theirs):
                    a.copy_(b)
        for opt, s in zip(self.outer_opts, state["outer_opt"]):
            opt.load_state_dict(s)
        self._tokens = [0] * len(self._tokens) if joiner else list(state["tokens"])
        for p, pend in enumerate(state["pending"]):
            if pend is None:
                self._pending[p] = None
                continue
            res = pend["result"]
            result = None
            if res is not None:
                result = SyncResult(average=res["average"], group_size=res["group_size"],
                                    weight_share=res["share"], sent=res["sent"],
                                    included_self=res["included_self"] and not joiner,
                                    bytes_sent=0 if joiner else res["bytes_sent"],
                                    bytes_received=0 if joiner else res["bytes_received"])
            self._pending[p] = _Pending(_ResolvedHandle((p, pend["round"]), result), pend["round"],
                                        pend["launched_at"], pend["apply_at"], pend["outer_grad"], pend["sent_input"])
        self._previous = [None if pr is None else _Previous(**{**pr, "included_self": pr["included_self"] and not joiner})
                          for pr in state["previous"]]
        self._residual = [None] * len(self._residual) if joiner else list(state["residual"])
        if joiner:
            for p in range(len(self.fragments)):
                self._copy_outer_to_local(p)

    def close(self) -> None:
        """Stop using the transport. Rounds still in flight are left to the transport to cancel."""
        if self._closed:
            return
        self._closed = True
        if self.config.mode == "data-parallel":
            self._dp_hook.remove()
