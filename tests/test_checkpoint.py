"""Checkpoints are complete: stopping and resuming gives bit-identical parameters."""

from __future__ import annotations

import torch

from opendiloco_stream.commands.local import prepare_data
from opendiloco_stream.config import load_config
from opendiloco_stream.train.loop import train_worker
from opendiloco_stream.transport.local import LocalSwarm


def _train(cfg_over, tmp_path, steps, resume=False, stop_after=None):
    over = {"model": {"name": "tiny", "seq_len": 32},
            "diloco": {"mode": "eager", "inner_steps": 4, "num_fragments": 2, "codec": "int8",
                       "error_feedback": True},
            "train": {"steps": steps, "batch_size": 2, "warmup_steps": 2, "checkpoint_dir": str(tmp_path),
                      "resume": resume}, "data": {"max_val_batches": 1}}
    for k, v in cfg_over.items():
        over[k].update(v)
    cfg = load_config(None, over)
    train_source, val, vocab = prepare_data(cfg)
    swarm = LocalSwarm(num_workers=2, codec="int8")
    models = {}

    def worker(rank):
        done = []

        def should_stop():  # a run that is stopped (e.g. SIGTERM) after `stop_after` steps
            done.append(1)
            return stop_after is not None and len(done) >= stop_after

        report = train_worker(rank, 2, cfg, swarm.transport(rank), train_source, val, vocab, lambda rec: None,
                              should_stop=should_stop)
        models[rank] = torch.load(tmp_path / f"worker-{rank}.pt", weights_only=False)["model"]
        return report

    swarm.run(worker)
    return models


def test_resume_is_bit_exact(tmp_path):
    torch.set_num_threads(1)
    straight = _train({}, tmp_path / "a", 14)
    _train({}, tmp_path / "b", 14, stop_after=6)  # stopped at step 6 (mid-round: eager rounds in flight)
    resumed = _train({}, tmp_path / "b", 14, resume=True)
    for rank in (0, 1):
        for key, value in straight[rank].items():
            assert torch.equal(value, resumed[rank][key]), key
