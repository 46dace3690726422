"""The training loop one worker runs: a vanilla AdamW loop plus one ``diloco.step()`` per step.

Used by ``local`` (M workers as threads over a LocalSwarm) and ``peer`` (one worker over hivemind,
or K ranks of one worker with DDP: ``train/ranks.py``): the CLI trainer is one user of the public
StreamingDiLoCo API, not a separate code path. ``train.precision``: the forward passes run under
bf16 autocast on CUDA by default (fp32 on CPU); parameters, optimizer and outer state keep their dtypes.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from opendiloco_stream.algorithm.diloco import StreamingDiLoCo
from opendiloco_stream.algorithm.fragments import partition
from opendiloco_stream.algorithm.staging import OuterPlacement
from opendiloco_stream.config import ConfigError, RunConfig
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.train.devices import resolve_device
from opendiloco_stream.train.checkpoint import checkpoint_path, restore_checkpoint, save_checkpoint
from opendiloco_stream.train.export import save_model_at_end
from opendiloco_stream.train.loss import evaluate, lm_loss, use_bf16_autocast
from opendiloco_stream.train.metrics_file import MetricsWriter, read_metrics  # noqa: F401 (re-exported)
from opendiloco_stream.train.models import build_model, transformer_blocks
from opendiloco_stream.testing import faults
from opendiloco_stream.train.sharded import Sharded, agree_on_fragments, load_shard, save_shard, shard_model
from opendiloco_stream.train.wrapper import Wrapper, build_wrapper
from opendiloco_stream.transport.base import Transport

if TYPE_CHECKING:
    from opendiloco_stream.train.ranks import Ranks


# Model init seeds torch's process-global RNG: workers running as threads must not interleave it.
_BUILD_LOCK = threading.Lock()
logger = logging.getLogger(__name__)
JOIN_ATTEMPTS = 3  # state downloads a joiner tries before it trains on from a state a round old


def lr_factor(step: int, warmup: int, total: int, final: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine decay to ``final`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class WorkerReport:
    """What one worker did; the CLI aggregates these into the summary record."""

    rank: int
    steps: int = 0
    tokens: int = 0
    eval_loss_initial: float = float("nan")
    eval_loss: float = float("nan")
    eval_loss_before_finish: float = float("nan")  # before the in-flight rounds landed (eager, overlap)
    eval_loss_global: float = float("nan")  # the outer parameters theta_bar (not data-parallel)
    train_loss: float = float("nan")
    compute_s: float = 0.0
    wall_s: float = 0.0
    stats: SyncStats = field(default_factory=SyncStats)
    params: int = 0
    outer_gradient_numel: int = 0
    rank_digests: list[str] = field(default_factory=list)  # a multi-rank peer: each rank's parameter digest
    device: str = ""  # where it trained (train.device resolved)
    peak_gpu_memory: int = 0  # torch.cuda.max_memory_allocated of a CUDA worker (bytes; 0 elsewhere)
    outer_device: str = ""  # where its outer state lived: "cuda:0", "cpu (pinned)", "cpu"
    prematch: str = ""  # how far ahead its groups formed at the end, and why (PrematchChoice.describe)
    prematch_steps: int = 0


def inner_step(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, *, bf16: bool = False,
               clip_grad_norm: float = 0.0, scheduler: Any = None, set_to_none: bool = True) -> torch.Tensor:
    """One inner AdamW step on ``batch``: loss, backward, clipping, ``opt.step()``, schedule; the loss.

    ``net`` is the module the forward pass runs through (a DDP wrapper on a multi-rank peer). The
    trainer and every benchmark call this, so a benchmark measures the loop users run. A
    data-parallel wrapper averages the gradients inside ``opt.step()``."""
    loss = lm_loss(net, batch, bf16)
    loss.backward()
    if clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip_grad_norm)
    opt.step()
    if scheduler is not None:
        scheduler.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss


@dataclass
class _Worker:
    """One worker's parts, built once (:func:`_build`) and used by the loop and the finish."""

    rank: int
    cfg: RunConfig
    model: torch.nn.Module
    net: torch.nn.Module  # what the forward pass runs through (DDP on a multi-rank peer)
    opt: torch.optim.Optimizer
    sched: Any
    diloco: Wrapper
    device: Any
    bf16: bool
    val: torch.Tensor
    emit: Callable[[dict[str, Any]], None]
    should_stop: Optional[Callable[[], bool]]
    ranks: Optional["Ranks"] = None
    placement: Optional[OuterPlacement] = None  # where the outer state lives (rank 0; None: data-parallel)
    streaming: Optional[StreamingDiLoCo] = None  # the streaming wrapper itself (rank 0; None: data-parallel)
    sharded: bool = False
    ckpt: Optional[Any] = None  # rank 0's checkpoint file
    shard_ckpt: Optional[Any] = None  # a sharded peer: every rank's model and optimizer shards
    batches: Any = None
    vocab_size: int = 0

    @property
    def leader(self) -> bool:
        return self.ranks is None or self.ranks.leader

    def evaluate(self) -> float:
        """The validation loss; rank 0's alone (a sharded peer's forward pass needs every rank)."""
        if not (self.leader or self.sharded):
            return float("nan")
        tc = self.cfg.train
        return evaluate(self.model, self.val, tc.batch_size, self.cfg.data.max_val_batches, self.device, self.bf16)

    def save(self, at: int) -> None:
        """Rank 0's checkpoint; a sharded peer's ranks add their shards."""
        if self.ckpt is not None:
            position = self.batches.position() if hasattr(self.batches, "position") else None  # a stream's
            save_checkpoint(self.ckpt, model=None if self.sharded else self.model,
                            optimizer=None if self.sharded else self.opt, scheduler=self.sched, diloco=self.diloco,
                            step=at, data=position, config=self.cfg.model_dump(mode="json"))
        if self.shard_ckpt is not None:
            save_shard(self.shard_ckpt, self.model, self.opt, self.ranks.rank, self.ranks.world, step=at)


def train_worker(rank: int, world_size: int, cfg: RunConfig, transport: Transport, train_source, val: torch.Tensor,
                 vocab_size: int, emit: Callable[[dict[str, Any]], None],
                 on_step: Optional[Callable[[int, float, SyncStats], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None, join_running: bool = False,
                 before_join: Optional[Callable[[torch.nn.Module], None]] = None,
                 ranks: Optional["Ranks"] = None) -> WorkerReport:
    """Train one worker for ``cfg.train.steps`` inner steps; return its report.

    ``join_running``: download the run's state from peers first (late joiner) and start at the
    swarm's step. ``should_stop`` is polled after every step (graceful shutdown). ``on_step(rank,
    loss, stats)`` is called after every inner step with the worker's sync counters so far.
    ``before_join(model)`` runs once the model is built, before the transport is prepared, any state
    is downloaded or any round runs (the join checks of ``train/join.py``); it may raise to refuse.
    ``ranks``: this worker is one rank of a multi-rank peer (``train/ranks.py``): DDP inner steps on
    ``ranks.device``; only rank 0 has a transport (None elsewhere), evaluates and saves checkpoints.

    Four parts: :func:`_build`, :func:`_restore_or_join`, :func:`_train_loop`, :func:`_finish`.
    """
    w = _build(rank, cfg, transport, val, emit, should_stop, before_join, ranks, vocab_size)
    start_step, data_position = _restore_or_join(w, transport, join_running)
    report = WorkerReport(rank=rank, params=sum(p.numel() for p in w.model.parameters()),
                          outer_gradient_numel=sum(f.numel for f in w.diloco.fragments), device=str(w.device))
    if w.placement is not None:
        report.outer_device = w.placement.device + (" (pinned)" if w.placement.pinned else "")
    report.eval_loss_initial = w.evaluate()
    emit({"event": "eval", "rank": rank, "step": start_step, "eval_loss": report.eval_loss_initial, "wall_s": 0.0})
    if data_position is not None:  # a streamed dataset resumes at the recorded position, not by re-reading
        w.batches = train_source.batches(rank, world_size, cfg.train.batch_size, position=data_position)
    else:
        w.batches = train_source.batches(rank, world_size, cfg.train.batch_size, start_step=start_step)
    recent = _train_loop(w, report, start_step, on_step)
    return _finish(w, report, start_step, recent)


def _build(rank: int, cfg: RunConfig, transport: Transport, val: torch.Tensor, emit: Callable, should_stop,
           before_join, ranks: Optional["Ranks"], vocab_size: int) -> _Worker:
    """The model, optimizer, schedule and wrapper (a sharded or multi-rank one where asked)."""
    tc = cfg.train
    device = ranks.device if ranks is not None else resolve_device(tc.device)  # 'auto': the CLI resolved it already
    leader = ranks is None or ranks.leader
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    with _BUILD_LOCK:
        model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len, seed=tc.seed,
                            dtype=dtype, init_from_config=cfg.model.init_from_config).to(device)
    model.train()
    if before_join is not None:
        before_join(model)
    blocks = transformer_blocks(model)
    sharded = ranks is not None and tc.sharding == "fsdp"
    access = None
    if sharded:  # FSDP2: parameters, gradients and AdamW state split over the ranks (train/sharded.py)
        shard_model(model, blocks, device, ranks.world)
        frags = partition(model, blocks, cfg.diloco.fragments_for(len(blocks)), cfg.diloco.fragment_pattern)
        agree_on_fragments(frags)
        access = Sharded.access(device)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc.warmup_steps, tc.steps))
    diloco = build_wrapper(model, opt, transport, cfg.diloco, blocks, param_access=access,
                           on_event=lambda rec: emit({**rec, "rank": rank})) if leader else None
    wrapped = diloco
    net = model
    if sharded:
        diloco = Sharded(device, frags, diloco, stop_source=should_stop)  # serves rank 0's reads above
        should_stop = lambda: diloco.stopped  # noqa: E731 (rank 0's flag, the same on every rank)
    elif ranks is not None:
        net = ranks.ddp(model)
        diloco = ranks.replicate(model, diloco, stop_source=should_stop)
        should_stop = lambda: diloco.stopped  # noqa: E731 (rank 0's flag, the same on every rank)
    placement = wrapped.placement if isinstance(wrapped, StreamingDiLoCo) else None
    if placement is not None:  # where the outer state went (outer_device 'auto' decides by free GPU memory)
        emit({"event": "outer_state", "rank": rank, "device": str(device), "outer_device": placement.device,
              "pinned": placement.pinned, "bytes": placement.outer_bytes, "reason": placement.reason})
        if torch.device(device).type == "cuda" and rank == 0:
            print(placement.line(), file=sys.stderr, flush=True)
    w = _Worker(rank=rank, cfg=cfg, model=model, net=net, opt=opt, sched=sched, diloco=diloco, device=device,
                bf16=use_bf16_autocast(tc.precision, device), val=val, emit=emit, should_stop=should_stop,
                ranks=ranks, sharded=sharded, vocab_size=vocab_size, placement=placement,
                streaming=wrapped if isinstance(wrapped, StreamingDiLoCo) else None)
    w.ckpt = checkpoint_path(tc.checkpoint_dir, rank) if tc.checkpoint_dir and leader else None
    if sharded and tc.checkpoint_dir:
        w.shard_ckpt = checkpoint_path(tc.checkpoint_dir, ranks.share(rank))
    return w


def _restore_or_join(w: _Worker, transport: Transport, join_running: bool) -> tuple[int, Optional[dict]]:
    """Resume from this worker's checkpoint, or join the running swarm by downloading its state;
    the step to start at and a stream's data position (None: start the data at that step)."""
    tc, ranks = w.cfg.train, w.ranks
    start_step, data_position, resumed = 0, None, None
    if w.ckpt is not None and tc.resume:
        resumed = restore_checkpoint(w.ckpt, model=None if w.sharded else w.model,
                                     optimizer=None if w.sharded else w.opt, scheduler=w.sched, diloco=w.diloco)
        if resumed is not None:
            start_step = resumed.step
            if resumed.data is not None and resumed.data.get("kind") == "stream":
                data_position = resumed.data
            join_running = False
            w.emit({"event": "resumed", "rank": w.rank, "step": start_step, "path": str(w.ckpt)})
    if w.shard_ckpt is not None and tc.resume:
        shard_step = load_shard(w.shard_ckpt, w.model, w.opt, ranks.rank, ranks.world)
        leader_step = ranks.share(start_step if resumed is not None else None)
        if shard_step != leader_step:
            raise ConfigError(f"{w.shard_ckpt}: rank {ranks.rank}'s shards are from step {shard_step}, rank 0's "
                              f"checkpoint from step {leader_step} (a crash between the two writes?): remove "
                              "the checkpoints or restore a consistent set")
    if join_running:
        start_step = _join(w, transport, start_step)
    if w.sharded:
        w.diloco.barrier()  # the other ranks served rank 0's writes of a join
    if ranks is not None:
        start_step = ranks.share_start(w.model, w.opt, w.sched, start_step, sharded=w.sharded)
    return start_step, data_position


def _join(w: _Worker, transport: Transport, start_step: int) -> int:
    """Download the swarm's state; the step to start at. The swarm trains on meanwhile: if one of
    our next rounds went without us, the state is a round old (we would run that round alone), so
    download again, up to ``JOIN_ATTEMPTS`` times: each time only what changed since the state
    before (``since``: the fragments that synced meanwhile), so an attempt is shorter than the
    one before and catches up with a swarm that moves faster than a whole download.

    The donor reserved this peer in the rounds after the state it serves, and as soon as the
    download's first message says which step that is, this peer announces them too
    (``expect_rounds_after``): the swarm's next rounds count it and wait for it (``presence.py``,
    "Joiners"), so a download slower than the gap between two rounds still lands in time."""
    previous = None
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        state = transport.load_state_from_peers(
            timeout=w.cfg.diloco.sync_timeout,
            progress=lambda rec: _download_progress(w, attempt, rec), since=previous)
        refresh_failed = state is None and previous is not None
        if state is None and previous is None:
            break
        if refresh_failed:
            state = previous  # train on from the state we have (rounds apart, as below)
        previous = state
        w.diloco.load_state_dict(state, joiner=True)
        missed = w.diloco.missed_rounds()
        if not missed or attempt == JOIN_ATTEMPTS or refresh_failed:
            start_step = w.diloco.step_count
            for _ in range(start_step):
                w.sched.step()
            # missed_rounds not empty: every attempt was a round late (a download slower than the
            # gap between two rounds); the peer trains on, one outer step apart in those fragments
            w.emit({"event": "joined", "rank": w.rank, "step": start_step, "attempts": attempt,
                    "missed_rounds": [list(k) for k in missed]})
            break
        w.emit({"event": "join_stale", "rank": w.rank, "step": w.diloco.step_count, "attempt": attempt,
                "missed_rounds": [list(k) for k in missed]})
    return start_step


def _download_progress(w: _Worker, attempt: int, rec: dict) -> None:
    """A state download's progress: a ``state_download`` record and one log line (shown as it goes).
    The first record names the state's step (``state_step``): the rounds after it are announced
    then, off the download's thread (a DHT store, one or two round trips at a distance)."""
    if rec.get("state_step") is not None:
        threading.Thread(target=w.diloco.expect_rounds_after, args=(int(rec["state_step"]), rec.get("reserved_at")),
                         name="join-expect", daemon=True).start()
    w.emit({"event": "state_download", "rank": w.rank, "attempt": attempt, **rec})
    total = max(1, int(rec.get("total_bytes", 0)))
    logger.info("joining: state %s %.1f/%.1f MB (%.0f%%, %.1f MiB/s, %.1f MB reused)%s",
                "refresh" if attempt > 1 else "download", rec.get("bytes", 0) / 1e6, total / 1e6,
                100.0 * rec.get("bytes", 0) / total, rec.get("mib_per_s", 0.0), rec.get("reused_bytes", 0) / 1e6,
                " done" if rec.get("done") else "")


def _train_loop(w: _Worker, report: WorkerReport, start_step: int,
                on_step: Optional[Callable[[int, float, SyncStats], None]]) -> list[float]:
    """Inner steps with one ``diloco.step()`` each, until ``train.steps`` or a stop; the last losses."""
    tc, diloco = w.cfg.train, w.diloco
    wall_start, eval_s = time.perf_counter(), 0.0  # utilization counts the training loop, not evals
    recent: list[float] = []
    step = start_step
    while step < tc.steps:
        t0 = time.perf_counter()
        batch = next(w.batches).to(w.device)
        loss = inner_step(w.net, w.opt, batch, bf16=w.bf16, clip_grad_norm=tc.clip_grad_norm, scheduler=w.sched)
        faults.slow_step()  # tests and benchmarks only (ODS_TEST_FAULTS): a slower peer, counted as compute
        t1 = time.perf_counter()
        tokens = batch[:, 1:].numel() * (w.ranks.world if w.ranks is not None else 1)  # the peer's, all ranks
        diloco.step(tokens=tokens)
        for _ in range(diloco.step_count - (step + 1)):  # a peer behind the swarm caught up: so does its schedule
            w.sched.step()
            step += 1
        t2 = time.perf_counter()
        loss_value = loss.item()
        report.steps, report.tokens, report.compute_s = report.steps + 1, report.tokens + tokens, report.compute_s + t1 - t0
        recent = (recent + [loss_value])[-20:]
        w.emit({"event": "step", "rank": w.rank, "step": step + 1, "loss": round(loss_value, 5),
                "lr": w.sched.get_last_lr()[0], "tokens": tokens, "compute_s": round(t1 - t0, 5),
                "sync_s": round(t2 - t1, 5), "t": round(t2 - wall_start - eval_s, 5)})
        if on_step is not None:
            on_step(w.rank, loss_value, diloco.stats)
        if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < tc.steps:
            e0 = time.perf_counter()
            ev_loss = w.evaluate()
            w.emit({"event": "eval", "rank": w.rank, "step": step + 1, "eval_loss": ev_loss,
                    "wall_s": round(e0 - wall_start - eval_s, 3)})
            eval_s += time.perf_counter() - e0
        if tc.checkpoint_dir and tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0:
            w.save(step + 1)
        if w.should_stop is not None and w.should_stop():
            w.emit({"event": "stopped", "rank": w.rank, "step": step + 1})
            break
        step += 1
    report.wall_s = time.perf_counter() - wall_start - eval_s
    return recent


def _finish(w: _Worker, report: WorkerReport, start_step: int, recent: list[float]) -> WorkerReport:
    """After the loop: the last checkpoint, the rounds in flight landed, the final evaluations."""
    diloco, rank = w.diloco, w.rank
    end_step = diloco.step_count
    t0, eval_s = time.perf_counter(), 0.0  # the final eval's wall_s: the loop's, plus landing what is in flight
    # the data-parallel wait happens inside opt.step(): move it from compute to communication
    if diloco.waits_in_optimizer_step:
        report.compute_s = max(0.0, report.compute_s - diloco.stats.wait_s)
    if w.cfg.train.checkpoint_dir:
        w.save(end_step)
    if diloco.in_flight:
        # the rounds still in flight land in the final model (finish); the loss before is kept for comparison
        e0 = time.perf_counter()
        report.eval_loss_before_finish = w.evaluate()
        eval_s = time.perf_counter() - e0
        w.emit({"event": "eval", "rank": rank, "step": end_step, "stage": "before-finish",
                "eval_loss": report.eval_loss_before_finish})
        diloco.finish()
    landed_s = time.perf_counter() - t0 - eval_s
    report.eval_loss = w.evaluate()
    w.emit({"event": "eval", "rank": rank, "step": end_step, "eval_loss": report.eval_loss,
            "wall_s": round(report.wall_s + landed_s, 3)})
    consensus = diloco.global_params()  # the run's consensus model: theta_bar in every fragment
    if consensus is not None:
        with consensus:
            report.eval_loss_global = w.evaluate()
        w.emit({"event": "eval", "rank": rank, "step": end_step, "stage": "global",
                "eval_loss": report.eval_loss_global})
    if w.cfg.train.save_model and w.leader:  # theta_bar as a transformers model directory (train/export.py)
        save_model_at_end(w.cfg, diloco, w.model, w.vocab_size, report)
    report.train_loss = float(sum(recent) / max(1, len(recent)))
    # SyncStats.of also takes the dict of counters a wrapper kept before SyncStats (compatibility)
    report.stats = SyncStats.of(diloco.stats)
    if w.streaming is not None:  # what prematch_steps chose ("auto" follows the measured link)
        report.prematch, report.prematch_steps = w.streaming.prematch.describe(), w.streaming.prematch.steps
    if w.ranks is not None:
        report.rank_digests = w.ranks.digests(w.model)
    if torch.device(w.device).type == "cuda":
        report.peak_gpu_memory = torch.cuda.max_memory_allocated(w.device)
    diloco.close()
    return report


def summarize(cfg: RunConfig, reports: list[WorkerReport], wall_s: float, codec_bytes: Callable[[int], int]) -> dict[str, Any]:
    """The ``{"event": "summary"}`` record (README.md, "Command line"; counters from ``SyncStats``)."""
    n = len(reports)
    tokens = sum(r.tokens for r in reports)
    stats = SyncStats.total(r.stats for r in reports)
    compute = sum(r.compute_s for r in reports)
    walls = sum(r.wall_s for r in reports)
    numel = reports[0].outer_gradient_numel if reports else 0
    d = cfg.diloco
    return {
        "event": "summary", "mode": d.mode, "workers": n, "steps": max((r.steps for r in reports), default=0),
        "tokens": tokens, "codec": d.codec, "fragments": d.num_fragments, "inner_steps": d.inner_steps,
        "overlap_steps": d.overlap_steps, "model": cfg.model.name, "params": reports[0].params if reports else 0,
        "eval_loss_initial": _mean([r.eval_loss_initial for r in reports]),
        "eval_loss": _mean([r.eval_loss for r in reports]),
        "eval_loss_before_finish": _mean([r.eval_loss_before_finish for r in reports]),
        "eval_loss_global": _mean([r.eval_loss_global for r in reports]),
        "train_loss": _mean([r.train_loss for r in reports]),
        **stats.summary_fields(n),
        "model_outer_gradient_bytes": codec_bytes(numel),
        **({"ranks": len(reports[0].rank_digests), "rank_digests": reports[0].rank_digests}
           if reports and reports[0].rank_digests else {}),
        "device": reports[0].device if reports else "", "outer_device": reports[0].outer_device if reports else "",
        "peak_gpu_memory_bytes": max((r.peak_gpu_memory for r in reports), default=0),
        **({"prematch": reports[0].prematch, "prematch_steps": reports[0].prematch_steps}
           if reports and reports[0].prematch else {}),
        "compute_utilization": compute / walls if walls > 0 else 0.0,
        "wall_time_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(sum(xs) / len(xs)) if xs else float("nan")
