"""The TensorBoard and W&B loggers against the real packages: a short run writes through each
(W&B offline) and the files are read back with the packages' own readers (TensorBoard's
EventAccumulator; the W&B run file's records parsed with wandb's own protobuf schema)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco_stream.config import ConfigError, load_config
from opendiloco_stream.train.loggers import build_loggers, scalars
from opendiloco_stream.train.loop import read_metrics

ROOT = Path(__file__).resolve().parent.parent


def wandb_records(path: Path):
    """The records of a ``run-*.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log blocks of 32 KiB (per chunk: crc32, length, type FULL/FIRST/MIDDLE/LAST) holding
    serialized ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("loggers")
    env = {**os.environ, "ODS_NET__RUN_ID": "ods-logged", "WANDB_MODE": "offline", "WANDB_DIR": str(d), "WANDB_SILENT": "true",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", "local", "--workers", "2", "--mode", "eager",
                           "--codec", "fp32", "--fragments", "2", "--inner-steps", "4", "--steps", "10", "--seq-len", "32",
                           "--batch-size", "2", "--max-val-batches", "1", "--eval-every", "5", "--no-progress",
                           "--threads", "1", "--tensorboard-dir", str(d / "tb"), "--wandb-project", "ods-test",
                           "--metrics-file", str(d / "m.jsonl")],
                          capture_output=True, text=True, env=env, cwd=d, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


def _expected(d: Path, tag: str, rank: int = 0) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` in the order the run emitted them (eval/loss: three at the last step)."""
    return [(step, value) for rec in read_metrics(d / "m.jsonl") if rec.get("rank", 0) == rank
            for t, value, step in scalars(rec) if t == tag]


def _same(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    return [s for s, _ in got] == [s for s, _ in expected] and all(
        a == pytest.approx(b, rel=1e-6) for (_, a), (_, b) in zip(got, expected))


def test_tensorboard_event_files_read_back_with_the_runs_scalars_steps_and_config(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in (0, 1):
        acc = EventAccumulator(str(logged_run / "tb" / f"worker-{rank}"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in ("train/loss", "eval/loss", "sync/ok", "sync/wait_s"):
            got = [(e.step, e.value) for e in acc.Scalars(tag)]
            assert _same(got, _expected(logged_run, tag, rank)), (tag, got)
        assert [s for s, _ in _expected(logged_run, "train/loss", rank)] == list(range(1, 11))
        text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert json.loads(text)["diloco"]["mode"] == "eager"


def test_wandb_offline_run_reads_back_with_the_runs_scalars_steps_and_config(logged_run):
    files = list((logged_run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files  # one run per process, rank 0's records
    config, history = {}, []
    for rec in wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):  # the run record carries the initial config, config records updates
            updates = rec.run.config.update if kind == "run" else rec.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.history.item})
    assert config["diloco"]["mode"] == "eager" and config["train"]["steps"] == 10
    run = next(rec.run for rec in wandb_records(files[0]) if rec.WhichOneof("record_type") == "run")
    assert run.run_group == "ods-logged" and run.display_name == "local"  # one group per run id
    for tag in ("train/loss", "eval/loss", "sync/ok"):
        # sync rows keep their (launch) steps, also where a later step was logged before them
        got = [(row["inner_step"], row[tag]) for row in history if tag in row]
        assert _same(got, _expected(logged_run, tag)), (tag, got)


def test_loggers_are_optional(monkeypatch):
    assert build_loggers(load_config(None, {})) == []
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("tensorboard", "wandb") else real(n, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        build_loggers(load_config(None, {"train": {"tensorboard_dir": "tb"}}))
    with pytest.raises(ConfigError, match="pip install wandb"):
        build_loggers(load_config(None, {"train": {"wandb_project": "p"}}))


def test_each_peer_gets_its_own_wandb_run_and_tensorboard_directory(tmp_path):
    """The peer command names its loggers after its peer id (``set_peer``): W&B runs of one run id
    share a group and carry the peer's name; TensorBoard writes DIR/<peer id>. One process per peer,
    as in a real run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "PYTHONPATH": str(ROOT)}
    script = ("import sys\n"
              "from opendiloco_stream.train.loggers import TensorBoardLogger, WandbLogger\n"
              "for logger in (TensorBoardLogger(sys.argv[1]), WandbLogger('ods-test', {'x': 1}, group='shared-run')):\n"
              "    logger.set_peer(sys.argv[2])\n"
              "    logger.observe({'event': 'step', 'step': 1, 'loss': 5.0, 'lr': 1e-4})\n"
              "    logger.close()\n")
    for peer in ("12D3KooWpeerA", "12D3KooWpeerB"):
        proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tb"), peer], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["12D3KooWpeerA", "12D3KooWpeerB"]
    acc = EventAccumulator(str(tmp_path / "tb" / "12D3KooWpeerA"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 5.0)]
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    runs = [next(r.run for r in wandb_records(f) if r.WhichOneof("record_type") == "run") for f in files]
    assert sorted((r.run_group, r.display_name) for r in runs) == [("shared-run", "12D3KooWpeerA"),
                                                                   ("shared-run", "12D3KooWpeerB")]
