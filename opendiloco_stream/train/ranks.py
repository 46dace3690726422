"""Several local ranks for one peer (``train.nproc_per_node`` = K): DDP inner steps, outer logic on rank 0.

    opendiloco-stream peer --nproc-per-node 2 --initial-peers ... [--device cuda]

The peer command starts K processes of itself (``commands/peer_ranks.py``) with the torch.distributed
environment (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``); ``torchrun --nproc-per-node K -m opendiloco_stream peer ...`` sets the same.

* Every rank runs the same inner loop (``train/loop.py``) on its own share of the peer's data shard,
  the model wrapped in DistributedDataParallel (gloo on CPU, nccl on CUDA): gradients are averaged
  at every inner step, so every rank takes the same AdamW step.
* Rank 0 (the leader) alone joins the DHT, runs the transport and StreamingDiLoCo, evaluates and
  writes metrics and checkpoints. After each ``diloco.step()`` it broadcasts one small control
  tensor: its step counter (a catch-up jump moves every rank's schedule), the stop flag (a signal
  stops every rank after the same step), whether rounds are in flight, and which parameters the
  outer logic wrote during the step (``Tensor._version`` moved); those parameters follow, broadcast
  from rank 0 (same for ``finish()``).
* So the ranks' parameters stay bit-identical: DDP makes the inner steps identical and the broadcast
  copies each write of the outer logic byte for byte. At the start rank 0's parameters, inner
  optimizer and schedule (after a resume or a join) are copied the same way; at the end every rank
  hashes its parameters (the summary's ``rank_digests``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from opendiloco_stream.config import ConfigError, check_data_parallel
from opendiloco_stream.stats import SyncStats


@dataclass(frozen=True)
class RankEnv:
    """This process's place among the peer's ranks (from the torch.distributed environment)."""

    rank: int
    world: int
    local_rank: int


def rank_env(environ: Optional[Mapping[str, str]] = None) -> Optional[RankEnv]:
    """The rank this process was started as (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), or None for a
    single-process peer (no such variables, or a world of one)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    if local_world != world:
        raise ConfigError(f"a peer's ranks must all run on one machine: LOCAL_WORLD_SIZE={local_world}, "
                          f"WORLD_SIZE={world} (run one peer per machine)")
    return RankEnv(rank, world, local)


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device a rank trains on: ``cuda`` or ``cuda:N`` become ``cuda:<local_rank>``; others stay."""
    return torch.device(f"cuda:{local_rank}" if device.startswith("cuda") else device)


def data_shard(shard: tuple[int, int], rank: int, world: int) -> tuple[int, int]:
    """The data shard of rank ``rank`` of ``world`` in a peer reading shard ``r/W``: windows
    ``i = r + W * rank (mod W * world)``. The ranks' shards partition the peer's."""
    r, w = shard
    return r + w * rank, w * world


def collective_timeout(cfg: Any) -> float:
    """Seconds a rank may wait in one collective: rank 0 may spend a state download or a blocking
    round (``sync_timeout``), or ``finish()`` (one per fragment), between two of them. A rank that
    dies breaks its connections, which fails the others' collectives at once: this bounds a hang."""
    return max(1800.0, (cfg.diloco.num_fragments + 2) * cfg.diloco.sync_timeout + 600.0)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2-sharded parameter), told by its methods: the class moved
    between torch releases (``torch.distributed._tensor`` before 2.5)."""
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def params_digest(model: torch.nn.Module) -> str:
    """blake2b of every parameter's bytes, in order. A sharded (DTensor) parameter is gathered whole
    first, one at a time (a collective: every rank calls it), so a sharded peer's digest is the same
    on every rank and comparable with an unsharded peer's."""
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        with torch.no_grad():
            full = p.full_tensor() if is_dtensor(p) else p.detach()
        h.update(full.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Ranks:
    """The process group of one peer's ranks (``torch.distributed``, initialized from the environment)."""

    def __init__(self, env: RankEnv, device: str, timeout_s: float):
        self.env, self.rank, self.world = env, env.rank, env.world
        self.leader = env.rank == 0
        self.device = rank_device(device, env.local_rank)
        if self.device.type == "cuda":
            if env.world > torch.cuda.device_count():
                raise ConfigError(f"{env.world} ranks on '{device}' need {env.world} CUDA devices; this machine has "
                                  f"{torch.cuda.device_count()} (lower --nproc-per-node)")
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world,
                                timeout=timedelta(seconds=timeout_s))

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: small things)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank, in place."""
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.detach(), src=0)

    def ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def share_start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int,
                    sharded: bool = False) -> int:
        """Once rank 0 restored a checkpoint or joined: its parameters, inner optimizer state and
        schedule on every rank. Returns rank 0's start step. ``sharded`` (FSDP2): each rank keeps its
        own parameter and optimizer shards (restored from its shard file, or written by rank 0's
        join through ``train/sharded.py``); only the step and the schedule are shared."""
        if sharded:
            step, sched_state = self.share((step, scheduler.state_dict()) if self.leader else None)
            scheduler.load_state_dict(sched_state)
            return int(step)
        state = self.share((step, _to_cpu(optimizer.state_dict()), scheduler.state_dict()) if self.leader else None)
        if not self.leader:
            step, opt_state, sched_state = state
            optimizer.load_state_dict(opt_state)
            scheduler.load_state_dict(sched_state)
        self.broadcast(list(model.parameters()))
        return int(step)

    def replicate(self, model: torch.nn.Module, diloco: Any = None,
                  stop_source: Optional[Callable[[], bool]] = None) -> "Replicated":
        """What the loop uses as ``diloco`` on this rank: rank 0 passes its wrapper, the others None."""
        return Replicated(self, list(model.parameters()), diloco, stop_source)

    def digests(self, model: torch.nn.Module) -> list[str]:
        """Every rank's ``params_digest``, in rank order (on every rank); a sharded model's is of the
        gathered whole model, as each rank sees it (comparable with an unsharded peer's)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, params_digest(model))
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LeaderMirror:
    """What a rank's ``diloco`` shows the loop: rank 0's wrapper (``_inner``, every attribute passes
    through) or, on the other ranks, the step counter and rounds in flight rank 0 last broadcast
    (``_mirror``). Rank 0 alone counts the syncs."""

    _inner: Any
    _mirror: dict

    def __getattr__(self, name: str) -> Any:  # only reached for what this class does not define
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def step_count(self) -> int:
        return self._inner.step_count if self._inner is not None else self._mirror["step_count"]

    @property
    def in_flight(self) -> bool:
        return self._inner.in_flight if self._inner is not None else self._mirror["in_flight"]

    @property
    def stats(self) -> SyncStats:
        return self._inner.stats if self._inner is not None else SyncStats()

    def missed_rounds(self) -> list[tuple[int, int]]:
        return self._inner.missed_rounds() if self._inner is not None else []

    def expect_rounds_after(self, step: int, since: Optional[float] = None) -> None:
        if self._inner is not None:
            self._inner.expect_rounds_after(step, since)

    def global_params(self) -> Optional[ContextManager[None]]:
        """Rank 0's consensus block; the other ranks evaluate nothing, so they keep none."""
        return self._inner.global_params() if self._inner is not None else None


class Replicated(LeaderMirror):
    """``diloco`` as the training loop sees it on a rank of a multi-rank peer.

    On rank 0 it is the real wrapper (every attribute passes through) plus the broadcast after
    ``step()`` and ``finish()``; on the other ranks it is the receiving end, mirroring rank 0's step
    counter, stop flag and rounds in flight (``stopped`` is the loop's ``should_stop`` on every rank).
    """

    waits_in_optimizer_step = False

    def __init__(self, ranks: Ranks, params: list[torch.Tensor], inner: Any = None,
                 stop_source: Optional[Callable[[], bool]] = None):
        if inner is not None and inner.waits_in_optimizer_step:
            check_data_parallel("data-parallel", ranked=True)
        self._ranks, self._params, self._inner = ranks, params, inner
        self._stop_source = stop_source or (lambda: False)
        self._mirror = {"step_count": 0, "in_flight": False}
        self.stopped = False

    @property
    def fragments(self) -> list:
        return self._inner.fragments if self._inner is not None else []

    def step(self, tokens: Optional[int] = None) -> None:
        before = [p._version for p in self._params]
        if self._inner is not None:
            self._inner.step(tokens=tokens)
        self._exchange(before)

    def finish(self) -> None:
        before = [p._version for p in self._params]
        if self._inner is not None:
            self._inner.finish()
        self._exchange(before)

    def _exchange(self, before: list[int]) -> None:
        """Rank 0's control tensor, then the parameters it wrote since ``before``."""
        device = self._ranks.device
        if self._inner is not None:
            changed = [int(p._version != v) for p, v in zip(self._params, before)]
            msg = torch.tensor([self._inner.step_count, int(bool(self._stop_source())), int(self._inner.in_flight),
                                *changed], dtype=torch.int64, device=device)
        else:
            msg = torch.zeros(3 + len(self._params), dtype=torch.int64, device=device)
        dist.broadcast(msg, src=0)
        values = msg.tolist()
        self._mirror.update(step_count=values[0], in_flight=bool(values[2]))
        self.stopped = bool(values[1])
        self._ranks.broadcast([p for p, c in zip(self._params, values[3:]) if c])

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
