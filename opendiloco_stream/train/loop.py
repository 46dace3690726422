"""The training loop one worker runs: a vanilla AdamW loop plus one ``diloco.step()`` per step.

Used by ``local`` (M workers as threads over a LocalSwarm) and ``peer`` (one worker over hivemind,
or K ranks of one worker with DDP: ``train/ranks.py``): the CLI trainer is one user of the public
StreamingDiLoCo API, not a separate code path. ``train.precision``: the forward passes run under
bf16 autocast on CUDA by default (fp32 on CPU); parameters, optimizer and outer state keep their dtypes.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

from opendiloco_stream.algorithm.diloco import wrap
from opendiloco_stream.algorithm.fragments import partition
from opendiloco_stream.config import ConfigError, RunConfig
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.train.checkpoint import checkpoint_path, restore_checkpoint, save_checkpoint
from opendiloco_stream.train.export import save_model_at_end
from opendiloco_stream.train.metrics_file import MetricsWriter, read_metrics  # noqa: F401 (re-exported)
from opendiloco_stream.train.models import build_model, transformer_blocks
from opendiloco_stream.train.sharded import Sharded, agree_on_fragments, load_shard, save_shard, shard_model
from opendiloco_stream.transport.base import Transport

if TYPE_CHECKING:
    from opendiloco_stream.train.ranks import Ranks


# Model init seeds torch's process-global RNG: workers running as threads must not interleave it.
_BUILD_LOCK = threading.Lock()
JOIN_ATTEMPTS = 3  # state downloads a joiner tries before it trains on from a state a round old


def lr_factor(step: int, warmup: int, total: int, final: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine decay to ``final`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


def use_bf16_autocast(precision: str, device: Any) -> bool:
    """``train.precision``: 'bf16' always, 'auto' on CUDA, 'fp32' never."""
    return precision == "bf16" or (precision == "auto" and torch.device(device).type == "cuda")


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, batch_size: int, max_batches: int, device: Any,
             bf16: bool = False) -> float:
    """Mean next-token cross-entropy over the first ``max_batches`` validation batches."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(0, min(len(val), batch_size * max_batches), batch_size):
        batch = val[i:i + batch_size].to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)).item())
    model.train(was_training)
    return float(sum(losses) / max(1, len(losses)))


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
    is downloaded or any round runs (the join checks of ``net/join.py``); it may raise to refuse.
    ``ranks``: this worker is one rank of a multi-rank peer (``train/ranks.py``): DDP inner steps on
    ``ranks.device``; only rank 0 has a transport (None elsewhere), evaluates and saves checkpoints.
    """
    tc = cfg.train
    device = ranks.device if ranks is not None else tc.device
    leader = ranks is None or ranks.leader
    bf16 = use_bf16_autocast(tc.precision, device)
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
        frags = partition(model, blocks, cfg.diloco.num_fragments, cfg.diloco.fragment_pattern)
        agree_on_fragments(frags)
        access = Sharded.access(device)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc.warmup_steps, tc.steps))
    diloco = wrap(model, opt, transport=transport, config=cfg.diloco, blocks=blocks, param_access=access,
                  on_event=lambda rec: emit({**rec, "rank": rank})) if leader else None
    net = model
    if sharded:
        diloco = Sharded(device, frags, diloco, stop_source=should_stop)  # serves rank 0's reads above
        should_stop = lambda: diloco.stopped  # noqa: E731 (rank 0's flag, the same on every rank)
    elif ranks is not None:
        net = ranks.ddp(model)
        diloco = ranks.replicate(model, diloco, stop_source=should_stop)
        should_stop = lambda: diloco.stopped  # noqa: E731 (rank 0's flag, the same on every rank)
    report = WorkerReport(rank=rank, params=sum(p.numel() for p in model.parameters()),
                          outer_gradient_numel=sum(f.numel for f in diloco.fragments))
    start_step, data_position, resumed = 0, None, None
    ckpt = checkpoint_path(tc.checkpoint_dir, rank) if tc.checkpoint_dir and leader else None
    shard_ckpt = None  # a sharded peer: every rank's model and optimizer shards, next to rank 0's file
    if sharded and tc.checkpoint_dir:
        shard_ckpt = checkpoint_path(tc.checkpoint_dir, ranks.share(rank))
    if ckpt is not None and tc.resume:
        resumed = restore_checkpoint(ckpt, model=None if sharded else model, optimizer=None if sharded else opt,
                                     scheduler=sched, diloco=diloco)
        if resumed is not None:
            start_step = resumed.step
            if resumed.data is not None and resumed.data.get("kind") == "stream":
                data_position = resumed.data
            join_running = False
            emit({"event": "resumed", "rank": rank, "step": start_step, "path": str(ckpt)})
    if shard_ckpt is not None and tc.resume:
        shard_step = load_shard(shard_ckpt, model, opt, ranks.rank, ranks.world)
        leader_step = ranks.share(start_step if resumed is not None else None)
        if shard_step != leader_step:
            raise ConfigError(f"{shard_ckpt}: rank {ranks.rank}'s shards are from step {shard_step}, rank 0's "
                              f"checkpoint from step {leader_step} (a crash between the two writes?): remove "
                              "the checkpoints or restore a consistent set")
    if join_running:
        # the swarm trains on while the state downloads: if one of our next rounds went without us,
        # the state is a round old (we would run that round alone): download again, a few times
        for attempt in range(1, JOIN_ATTEMPTS + 1):
            state = transport.load_state_from_peers(
                timeout=cfg.diloco.sync_timeout,
                progress=lambda rec: emit({"event": "state_download", "rank": rank, "attempt": attempt, **rec}))
            if state is None:
                break
            diloco.load_state_dict(state, joiner=True)
            missed = diloco.missed_rounds() if hasattr(diloco, "missed_rounds") else []
            if not missed or attempt == JOIN_ATTEMPTS:
                start_step = diloco.step_count
                for _ in range(start_step):
                    sched.step()
                # missed_rounds not empty: every attempt was a round late (a download slower than the
                # gap between two rounds); the peer trains on, one outer step apart in those fragments
                emit({"event": "joined", "rank": rank, "step": start_step, "attempts": attempt,
                      "missed_rounds": [list(k) for k in missed]})
                break
            emit({"event": "join_stale", "rank": rank, "step": diloco.step_count, "attempt": attempt,
                  "missed_rounds": [list(k) for k in missed]})
    if sharded:
        diloco.barrier()  # the other ranks served rank 0's writes of a join
    if ranks is not None:
        start_step = ranks.share_start(model, opt, sched, start_step, sharded=sharded)

    def ev() -> float:  # evaluations are rank 0's (a sharded peer's forward pass needs every rank)
        if not (leader or sharded):
            return float("nan")
        return evaluate(model, val, tc.batch_size, cfg.data.max_val_batches, device, bf16)

    report.eval_loss_initial = ev()
    emit({"event": "eval", "rank": rank, "step": start_step, "eval_loss": report.eval_loss_initial})
    wall_start, eval_s = time.perf_counter(), 0.0  # utilization counts the training loop, not evals
    if data_position is not None:  # a streamed dataset resumes at the recorded position, not by re-reading
        batches = train_source.batches(rank, world_size, tc.batch_size, position=data_position)
    else:
        batches = train_source.batches(rank, world_size, tc.batch_size, start_step=start_step)

    def position() -> Optional[dict]:
        return batches.position() if hasattr(batches, "position") else None

    def save(at: int) -> None:  # rank 0's checkpoint; a sharded peer's ranks add their shards
        if ckpt is not None:
            save_checkpoint(ckpt, model=None if sharded else model, optimizer=None if sharded else opt,
                            scheduler=sched, diloco=diloco, step=at, data=position(), config=cfg.model_dump(mode="json"))
        if shard_ckpt is not None:
            save_shard(shard_ckpt, model, opt, ranks.rank, ranks.world, step=at)
    recent: list[float] = []
    step = start_step
    while step < tc.steps:
        t0 = time.perf_counter()
        batch = next(batches).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = net(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if tc.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad_norm)
        opt.step()  # data-parallel mode averages gradients inside this call (counted as communication)
        sched.step()
        opt.zero_grad(set_to_none=True)
        if tc.step_delay_s > 0:  # benchmarks and tests only: a slower peer (the delay counts as compute)
            time.sleep(tc.step_delay_s)
        t1 = time.perf_counter()
        tokens = batch[:, 1:].numel() * (ranks.world if ranks is not None else 1)  # the peer's, all ranks
        diloco.step(tokens=tokens)
        # a peer behind the swarm caught up (StreamingDiLoCo.step): its schedule jumps with it
        for _ in range(getattr(diloco, "step_count", step + 1) - (step + 1)):
            sched.step()
            step += 1
        t2 = time.perf_counter()
        loss_value = loss.item()
        report.steps += 1
        report.tokens += tokens
        report.compute_s += (t1 - t0)
        recent = (recent + [loss_value])[-20:]
        emit({"event": "step", "rank": rank, "step": step + 1, "loss": round(loss_value, 5),
              "lr": sched.get_last_lr()[0], "tokens": tokens, "compute_s": round(t1 - t0, 5),
              "sync_s": round(t2 - t1, 5)})
        if on_step is not None:
            on_step(rank, loss_value, diloco.stats)
        if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < tc.steps:
            e0 = time.perf_counter()
            ev_loss = ev()
            eval_s += time.perf_counter() - e0
            emit({"event": "eval", "rank": rank, "step": step + 1, "eval_loss": ev_loss})
        if tc.checkpoint_dir and tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0:
            save(step + 1)
        if should_stop is not None and should_stop():
            emit({"event": "stopped", "rank": rank, "step": step + 1})
            break
        step += 1
    end_step = getattr(diloco, "step_count", start_step + report.steps)
    # the data-parallel wait happens inside opt.step(): move it from compute to communication
    if diloco.waits_in_optimizer_step:
        report.compute_s = max(0.0, report.compute_s - diloco.stats.wait_s)
    report.wall_s = time.perf_counter() - wall_start - eval_s
    if tc.checkpoint_dir:
        save(end_step)
    if diloco.in_flight:
        # the rounds still in flight land in the final model (finish); the loss before is kept for comparison
        report.eval_loss_before_finish = ev()
        emit({"event": "eval", "rank": rank, "step": end_step, "stage": "before-finish",
              "eval_loss": report.eval_loss_before_finish})
        diloco.finish()
    report.eval_loss = ev()
    emit({"event": "eval", "rank": rank, "step": end_step, "eval_loss": report.eval_loss})
    if hasattr(diloco, "global_params"):  # the run's consensus model: theta_bar in every fragment
        with diloco.global_params():
            report.eval_loss_global = ev()
        emit({"event": "eval", "rank": rank, "step": end_step, "stage": "global",
              "eval_loss": report.eval_loss_global})
    if tc.save_model and leader:  # theta_bar as a transformers model directory (train/export.py)
        save_model_at_end(cfg, diloco, model, vocab_size, report)
    report.train_loss = float(sum(recent) / max(1, len(recent)))
    # SyncStats.of also takes the dict of counters a wrapper kept before SyncStats (compatibility)
    report.stats = SyncStats.of(diloco.stats)
    if ranks is not None:
        report.rank_digests = ranks.digests(model, sharded=sharded)
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
        "compute_utilization": compute / walls if walls > 0 else 0.0,
        "wall_time_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
    }


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(sum(xs) / len(xs)) if xs else float("nan")
