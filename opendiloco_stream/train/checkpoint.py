"""Atomic, complete checkpoints: model, inner optimizer and schedule, StreamingDiLoCo state (outer
parameters and optimizers, eager state, error-feedback residuals, schedule position), data position,
RNG and the run's configuration (``train/export.py`` reads theta_bar and the config back). Written to a temporary file and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

FILENAME = "worker-{rank}.pt"


def checkpoint_path(directory: str, rank: int) -> Path:
    return Path(directory) / FILENAME.format(rank=rank)


def save_checkpoint(path: Path, *, model, optimizer, scheduler, diloco, step: int,
                    data: Optional[dict] = None, config: Optional[dict] = None) -> None:
    """``data``: the data position (``StreamBatches.position()`` for a streamed dataset); in-memory
    sources need none, their position is the step. ``model`` and ``optimizer`` None: they are saved
    elsewhere (a sharded peer's ranks write their shards, ``train/sharded.py``). ``config``: the run's
    configuration (``RunConfig.model_dump(mode="json")``), what ``export`` rebuilds the model from."""
    state: dict[str, Any] = {
        "format": 1,
        "step": step,
        "config": config,
        "data": data if data is not None else {"kind": "windows", "batches": step},
        "model": None if model is None else model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "diloco": diloco.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }
    atomic_save(state, path)


def atomic_save(state: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, rename: ``path`` is the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass
class Restored:
    """What a checkpoint says about where to continue."""

    step: int
    data: Optional[dict]  # the data position recorded with it (None in checkpoints that predate it)


def load_checkpoint(path: Path, *, model, optimizer, scheduler, diloco) -> Optional[int]:
    """Restore everything from ``path``; return the step to continue from (None if no file)."""
    restored = restore_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, diloco=diloco)
    return None if restored is None else restored.step


def restore_checkpoint(path: Path, *, model, optimizer, scheduler, diloco) -> Optional[Restored]:
    """Restore everything from ``path``; return the step and data position (None if no file).
    ``model`` and ``optimizer`` None: a sharded peer's, restored from the ranks' shard files."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    for part, target in (("model", model), ("optimizer", optimizer)):
        if (state[part] is None) != (target is None):
            raise ValueError(f"{path}: the checkpoint {'lacks' if state[part] is None else 'holds'} the {part} "
                             "state (written by a sharded peer, or read by one?): resume with the same "
                             "train.sharding as the run that wrote it")
        if target is not None:
            target.load_state_dict(state[part])
    scheduler.load_state_dict(state["scheduler"])
    diloco.load_state_dict(state["diloco"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return Restored(step=int(state["step"]), data=state.get("data"))
