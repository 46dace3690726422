"""A sharded peer (``train.sharding: fsdp``): FSDP2 inner steps over the peer's K ranks, outer logic on rank 0.

    opendiloco-stream peer --nproc-per-node 8 --sharding fsdp --outer-device cpu --initial-peers ...

DDP (``train/ranks.py``) keeps the whole model, its gradients and AdamW's two moments on every rank:
about 16 bytes per parameter. Here each block and the root are ``fully_shard``-ed (FSDP2) over a
one-dimensional mesh of the peer's ranks, so parameters, gradients and the inner optimizer's state
are split K ways; FSDP2 gathers a block's parameters only while it runs.

* Rank 0 alone runs the transport and StreamingDiLoCo, whose outer state (theta_bar, momentum,
  eager's ``start``) is whole, on rank 0: put it in CPU memory (``--outer-device cpu``, pinned) for
  big models. StreamingDiLoCo reads and writes the local parameters of one fragment at a time
  through :class:`ShardedAccess`: a read is an all-gather of that fragment's shards, a write a
  broadcast of the new full values from which every rank keeps its own shard.
* The other ranks do not know when rank 0's outer logic will touch which fragment (a round may land
  on arrival, a late peer catches up several syncs at once), so after each ``step()`` they *serve*:
  rank 0 broadcasts a command per read or write (``READ p`` / ``WRITE p``), and ``END`` with its step
  counter, stop flag and whether rounds are in flight. Each command is one collective both sides
  enter, so every rank runs the same sequence of collectives.
* A fragment's bytes on the wire are its full tensors in parameter order, as on any other peer: a
  sharded peer averages with single-process, DDP and differently sharded peers alike.
* Every rank evaluates (a forward pass needs all shards); ``global_params`` swaps theta_bar in on
  every rank and back.
* Checkpoints: rank 0's file holds what it holds on any peer (schedule, outer state, data
  position); the model and inner optimizer, sharded, go to one file per rank next to it
  (``worker-W.rank-R.pt``), so a sharded peer resumes with the same number of ranks.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm.fragment_state import ParamAccess
from opendiloco_stream.config import ConfigError
from opendiloco_stream.train.checkpoint import atomic_save
from opendiloco_stream.train.ranks import LeaderMirror, is_dtensor

END, READ, WRITE = 0, 1, 2


def shard_model(model: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device, world: int) -> None:
    """FSDP2 in place: every block, then the root (embeddings, final norm, head), over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: FSDP2 needs torch >= 2.6, pyproject allows 2.1
    from torch.distributed.fsdp import fully_shard  # lazy: FSDP2 needs torch >= 2.6, pyproject allows 2.1

    mesh = init_device_mesh(device.type, (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gather_full(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full values of (possibly sharded) parameters, on every rank (one all-gather each)."""
    with torch.no_grad():
        return [p.full_tensor() if is_dtensor(p) else p.detach() for p in params]


def scatter_full(params: list[torch.Tensor], values: Optional[list[torch.Tensor]], device: torch.device) -> None:
    """Rank 0's full ``values`` (None on the other ranks) into ``params``: one broadcast of the
    fragment, then every rank copies its own shard."""
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ConfigError("a sharded peer needs one dtype for all parameters of a fragment")
    sizes = [p.numel() for p in params]
    if values is not None:
        flat = torch.cat([v.detach().reshape(-1).to(device, dtype) for v in values])
    else:
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for p, full in zip(params, torch.split(flat, sizes)):
            full = full.view(p.shape)
            if is_dtensor(p):
                from torch.distributed.tensor import distribute_tensor  # lazy: FSDP2 needs torch >= 2.6, pyproject allows 2.1

                mine = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(mine)
            else:
                p.copy_(full)


def agree_on_fragments(fragments: list[fr.Fragment]) -> None:
    """Every rank, before rank 0 builds its wrapper: the same partition everywhere, or the
    collectives of reads and writes would not match (ConfigError)."""
    layout = [(f.index, f.numel) for f in fragments]
    box = [layout]
    dist.broadcast_object_list(box, src=0)
    if box[0] != layout:
        raise ConfigError(f"rank 0 split the model into fragments {box[0]}, this rank into {layout}")


class _Commands:
    """Rank 0's commands to the other ranks: ``[op, fragment, step, stop, in_flight]`` (int64)."""

    def __init__(self, device: torch.device):
        self.device = device

    def send(self, op: int, fragment: int = 0, step: int = 0, stop: bool = False, in_flight: bool = False) -> None:
        dist.broadcast(torch.tensor([op, fragment, step, int(stop), int(in_flight)], dtype=torch.int64,
                                    device=self.device), src=0)

    def receive(self) -> list[int]:
        msg = torch.zeros(5, dtype=torch.int64, device=self.device)
        dist.broadcast(msg, src=0)
        return msg.tolist()


class ShardedAccess(ParamAccess):
    """Rank 0's access to a fragment's full local parameters (see the module docstring)."""

    def __init__(self, commands: _Commands, device: torch.device):
        self.commands, self.device = commands, device

    def read(self, fragment: fr.Fragment) -> list[torch.Tensor]:
        self.commands.send(READ, fragment.index)
        return gather_full(fragment.params)

    def write(self, fragment: fr.Fragment, values: list[torch.Tensor]) -> None:
        self.commands.send(WRITE, fragment.index)
        scatter_full(fragment.params, values, self.device)


class Sharded(LeaderMirror):
    """``diloco`` as the training loop sees it on a rank of a sharded peer.

    Rank 0 builds it around its StreamingDiLoCo (built with :meth:`access`), the other ranks
    around nothing: they serve rank 0's reads and writes until its ``END``. Every rank calls the
    same methods at the same points: :func:`agree_on_fragments` before rank 0 builds its wrapper, the
    constructor (rank 0 read every fragment to build its outer state), ``barrier`` (after a resume or
    join), ``step``, ``finish`` and ``global_params``.
    """

    waits_in_optimizer_step = False

    def __init__(self, device: torch.device, fragments: list[fr.Fragment], inner: Any = None,
                 stop_source: Optional[Callable[[], bool]] = None):
        self._commands = _Commands(device)
        self._fragments = {f.index: f for f in fragments}
        self._inner, self._stop_source = inner, stop_source or (lambda: False)
        self._mirror = {"step_count": 0, "in_flight": False}
        self.stopped = False
        self.barrier()

    @staticmethod
    def access(device: torch.device) -> ShardedAccess:
        """What rank 0 passes to ``wrap(..., param_access=...)``; its reads and writes are served
        by the other ranks once they construct their ``Sharded``."""
        return ShardedAccess(_Commands(device), device)

    @property
    def fragments(self) -> list[fr.Fragment]:
        return self._inner.fragments if self._inner is not None else list(self._fragments.values())

    def barrier(self) -> None:
        """Rank 0: end a stretch of outer work (its reads and writes so far); the others: serve it."""
        if self._inner is not None:
            self.stopped = bool(self._stop_source())
            self._commands.send(END, 0, self._inner.step_count, self.stopped, self._inner.in_flight)
        else:
            self._serve()

    def _serve(self) -> None:
        device = self._commands.device
        while True:
            op, index, step, stop, in_flight = self._commands.receive()
            if op == END:
                self._mirror.update(step_count=step, in_flight=bool(in_flight))
                self.stopped = bool(stop)
                return
            params = self._fragments[index].params
            if op == READ:
                gather_full(params)
            elif op == WRITE:
                scatter_full(params, None, device)
            else:
                raise RuntimeError(f"unknown command {op} from rank 0")

    def step(self, tokens: Optional[int] = None) -> None:
        if self._inner is not None:
            self._inner.step(tokens=tokens)
        self.barrier()

    def finish(self) -> None:
        if self._inner is not None:
            self._inner.finish()
        self.barrier()

    @contextlib.contextmanager
    def global_params(self) -> Iterator[None]:
        """theta_bar in every fragment on every rank within the block (restored after)."""
        if self._inner is None:
            self._serve()
            try:
                yield
            finally:
                self._serve()
            return
        with self._inner.global_params():
            self.barrier()
            yield
        self.barrier()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


# ---------------------------------------------------------------------------------- checkpoints
def _local(obj: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (a plain CPU tensor)."""
    if isinstance(obj, torch.Tensor):
        return (obj.to_local() if is_dtensor(obj) else obj).detach().cpu()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj


def shard_path(path: Path, rank: int) -> Path:
    """Rank ``rank``'s shard file next to the worker checkpoint ``path``."""
    return path.with_name(f"{path.stem}.rank-{rank}{path.suffix}")


def save_shard(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int,
               step: int) -> None:
    """This rank's model and inner optimizer shards (atomic, like ``train/checkpoint.py``)."""
    state = {"format": 1, "rank": rank, "world": world, "step": step, "model": _local(model.state_dict()),
             "optimizer": _local(optimizer.state_dict()), "rng": {"torch": torch.get_rng_state(),
                                                                   "python": random.getstate(),
                                                                   "numpy": np.random.get_state()}}
    atomic_save(state, shard_path(path, rank))


def _into(current: Any, saved: Any) -> Any:
    """``saved`` (plain shards) shaped like ``current`` (DTensors where it has them)."""
    if isinstance(current, torch.Tensor) and is_dtensor(current):
        from torch.distributed.tensor import DTensor  # lazy: FSDP2 needs torch >= 2.6, pyproject allows 2.1

        local = saved.to(current.to_local().device, current.dtype)
        return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                  shape=current.shape, stride=current.stride())
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: _into(current[k], v) if k in current else v for k, v in saved.items()}
    if isinstance(current, (list, tuple)) and isinstance(saved, (list, tuple)) and len(current) == len(saved):
        return type(saved)(_into(c, s) for c, s in zip(current, saved))
    return saved


def _optimizer_into(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """An inner optimizer state of plain shards, its per-parameter tensors made DTensors shaped
    like their parameters (AdamW's moments; scalars such as ``step`` stay as they are)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        p = params[int(index)]
        if not is_dtensor(p):
            state[index] = entry
            continue
        shard = p.to_local()
        state[index] = {k: _into(p, v) if isinstance(v, torch.Tensor) and v.shape == shard.shape and v.dim() > 0
                        else v for k, v in entry.items()}
    return {**saved, "state": state}


def load_shard(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int,
               world: int) -> Optional[int]:
    """Restore this rank's shards; the step they were saved at, or None if there is no file."""
    target = shard_path(path, rank)
    if not target.is_file():
        return None
    state = torch.load(target, map_location="cpu", weights_only=False)
    if state["world"] != world:
        raise ConfigError(f"{target} was written by a peer of {state['world']} ranks; this one has {world} "
                          "(a sharded peer resumes with the same --nproc-per-node)")
    model.load_state_dict(_into(model.state_dict(), state["model"]))
    optimizer.load_state_dict(_optimizer_into(optimizer, state["optimizer"]))
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return int(state["step"])
