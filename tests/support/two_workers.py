"""Two workers of a small MLP trained through ``LocalSwarm`` in one process (tests/test_devices.py,
tests/test_staging.py): the same seeds, data and loop, so two configurations compare bit for bit."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from opendiloco_stream import DiLoCoConfig, wrap
from opendiloco_stream.transport.local import LocalSwarm


def mlp(width: int) -> nn.Sequential:
    """Four ``width`` x ``width`` linear blocks, seeded: every call gives the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def train_two_workers(config: DiLoCoConfig, *, width: int, steps: int,
                      prepare: Optional[Callable] = None) -> tuple[list[nn.Module], list]:
    """Train two workers ``steps`` inner steps (a different data stream each, weights 5 and 6);
    ``prepare(diloco, transport)`` runs on each wrapper before its first step. Returns the models
    and the wrappers."""
    torch.manual_seed(3)
    data = [[torch.randn(5, width) for _ in range(3)] for _ in range(2)]
    swarm, models, wrappers = LocalSwarm(num_workers=2, codec=config.codec), [mlp(width), mlp(width)], [None, None]

    def worker(rank):
        model = models[rank]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        diloco = wrappers[rank] = wrap(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
        if prepare is not None:
            prepare(diloco, swarm.transport(rank))
        for i in range(steps):
            model(data[rank][i % 3]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step(tokens=5 + rank)
        diloco.finish()
        diloco.close()

    swarm.run(worker)
    return models, wrappers
