"""The GPU path as far as a CPU can check it: the outer-device and precision knobs, the multi-rank
plumbing (rank environment, data shards, two gloo ranks of one peer over a LocalSwarm), and the GPU
benchmark's loop and its one-line refusal without CUDA. Nothing here needs or skips for a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opendiloco_stream import DiLoCoConfig, wrap
from opendiloco_stream.cli import main as cli_main
from opendiloco_stream.config import ConfigError, load_config
from opendiloco_stream.train.loss import use_bf16_autocast
from opendiloco_stream.train.ranks import data_shard, rank_device, rank_env
from opendiloco_stream.transport.local import LocalSwarm
from tests.support.two_workers import mlp, train_two_workers
from tests.support.peers import run_benchmark

ROOT = Path(__file__).resolve().parent.parent
PEER_MADDR = "/ip4/127.0.0.1/tcp/31337/p2p/QmXcY4ZNkgxUS8Ca41UAYUdtqNjvHj6Lk2SHv9iBR5Yqgh"


# ---------------------------------------------------------------------------- outer device
def _mlp():
    return mlp(8)


def _train_two_workers(config: DiLoCoConfig, steps: int = 14):
    return train_two_workers(config, width=8, steps=steps)


@pytest.mark.parametrize("extra", [
    {"mode": "blocking"}, {"mode": "eager"}, {"mode": "eager", "eager_rule": "paper"},
    {"mode": "overlap", "overlap_steps": 1}, {"mode": "eager", "codec": "topk-int2"},
    {"mode": "eager", "codec": "fp4-e3m0", "error_feedback": True, "error_feedback_mode": "buffer"},
])
def test_outer_device_cpu_on_a_cpu_model_is_bit_identical_to_the_default(extra):
    base = dict(inner_steps=4, num_fragments=2, **{"codec": "fp32", **extra})  # fp32 unless the case names one
    (auto_models, auto_wrappers) = _train_two_workers(DiLoCoConfig(**base))
    (cpu_models, cpu_wrappers) = _train_two_workers(DiLoCoConfig(**base, outer_device="cpu"))
    for a_model, c_model in zip(auto_models, cpu_models):
        for a, c in zip(a_model.parameters(), c_model.parameters()):
            assert torch.equal(a, c)
    for a_w, c_w in zip(auto_wrappers, cpu_wrappers):
        for a_frag, c_frag in zip(a_w.outer_params, c_w.outer_params):
            assert all(torch.equal(a, c) and c.device.type == "cpu" and c.dtype == torch.float32
                       and not c.is_pinned() for a, c in zip(a_frag, c_frag))  # pinned only for a CUDA model


def test_outer_device_cuda_needs_a_model_on_cuda():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="outer_device 'cuda' needs the model on a CUDA device"):
        wrap(model, opt, transport=LocalSwarm(1).transport(0), config=DiLoCoConfig(inner_steps=4, outer_device="cuda"),
             blocks=list(model))


# ---------------------------------------------------------------------------- precision and flags
def test_precision_auto_is_bf16_autocast_on_cuda_only():
    assert use_bf16_autocast("auto", "cuda") and use_bf16_autocast("auto", torch.device("cuda:1"))
    assert not use_bf16_autocast("auto", "cpu")
    assert use_bf16_autocast("bf16", "cpu") and not use_bf16_autocast("fp32", "cuda:0")


def test_flags_reach_the_config():
    from opendiloco_stream.cli import build_parser
    from opendiloco_stream.config_cli import config_from_args

    args = build_parser().parse_args(["peer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--nproc-per-node",
                                      "2", "--precision", "bf16", "--outer-device", "cpu"])
    cfg = config_from_args(args)
    assert (cfg.train.nproc_per_node, cfg.train.precision, cfg.diloco.outer_device) == (2, "bf16", "cpu")
    assert load_config(environ={}).train.precision == "auto" and load_config(environ={}).diloco.outer_device == "auto"
    with pytest.raises(ConfigError):
        load_config(overrides={"train": {"nproc_per_node": 0}}, environ={})


def test_bf16_autocast_trains_a_fp32_model_on_cpu():
    from opendiloco_stream.commands._common import prepare_data
    from opendiloco_stream.train.loop import train_worker

    def run(precision):
        cfg = load_config(overrides={"model": {"name": "tiny", "seq_len": 32},
                                     "train": {"steps": 3, "batch_size": 2, "precision": precision},
                                     "diloco": {"inner_steps": 2, "mode": "blocking"},
                                     "data": {"max_val_batches": 1}}, environ={})
        train_source, val, vocab = prepare_data(cfg)
        records = []
        train_worker(0, 1, cfg, LocalSwarm(1).transport(0), train_source, val, vocab, records.append)
        return [r["loss"] for r in records if r["event"] == "step"]

    fp32, bf16 = run("fp32"), run("bf16")
    assert all(abs(a - b) < 0.1 for a, b in zip(fp32, bf16)) and fp32 != bf16  # the same run, in bf16 compute


def test_local_threads_refuse_several_ranks(capsys):
    assert cli_main(["local", "--workers", "2", "--nproc-per-node", "2", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nproc-per-node needs --transport hivemind" in err[0]


@pytest.mark.parametrize("flags, message", [
    (["--device", "gpu"], "device 'gpu': use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    (["--device", "cuda:one"], "device 'cuda:one': use"),
    (["--outer-device", "cuda"], "diloco.outer_device 'cuda' keeps the outer state on the model's GPU, but "
                                 "train.device is 'cpu'"),
])
def test_a_device_that_cannot_be_is_a_config_error(capsys, flags, message):
    assert cli_main(["local", "--workers", "2", "--steps", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_device_this_machine_lacks_fails_in_one_line_before_anything_starts(capsys, monkeypatch):
    """Whatever GPUs the machine running the tests has, torch is told what to report (the case of
    a GPU machine with too few GPUs cannot be produced on CI's CPU machine otherwise)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["local", "--workers", "2", "--steps", "1", "--no-progress", "--device", "cuda"]) == 2
    assert cli_main(["peer", "--initial-peers", PEER_MADDR, "--steps", "1", "--no-progress",
                     "--device", "cuda:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("torch sees no CUDA device here" in line and "use --device cpu" in line
                                 for line in err)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli_main(["local", "--workers", "2", "--steps", "1", "--no-progress", "--device", "cuda:2"]) == 2
    assert cli_main(["local", "--transport", "hivemind", "--workers", "2", "--steps", "1", "--no-progress",
                     "--device", "cuda", "--nproc-per-node", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "--device cuda:2: this machine has 2 CUDA device(s) (cuda:0 to cuda:1)" in err[0]
    assert "--nproc-per-node 4 --device cuda: rank r trains on cuda:r, and this machine has 2" in err[1]


# ---------------------------------------------------------------------------- device auto
def _stub_cuda(monkeypatch, count: int) -> None:
    """torch is told it sees ``count`` CUDA devices (no GPU here: the choice is what is tested)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: f"Stub GPU {index}")


def test_device_auto_is_the_first_cuda_device_when_torch_sees_one_else_the_cpu(monkeypatch):
    """No GPU here: torch's CUDA check is stubbed, both ways."""
    from opendiloco_stream.train.devices import describe_device, resolve_device

    assert load_config(environ={}).train.device == "auto"
    _stub_cuda(monkeypatch, 2)
    assert resolve_device("auto") == "cuda:0" and resolve_device("auto", ranks=2) == "cuda"
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert describe_device("auto", "cuda:0") == "cuda:0 (Stub GPU 0; auto)"
    _stub_cuda(monkeypatch, 0)
    assert resolve_device("auto") == "cpu" and resolve_device("auto", ranks=2) == "cpu"
    assert describe_device("auto", "cpu").startswith("cpu (auto: torch ") and "sees no CUDA device" in \
        describe_device("auto", "cpu")


def test_dry_run_says_a_peer_trains_on_the_gpu_with_no_flag(monkeypatch, capsys):
    """No GPU here: torch's CUDA check is stubbed. The device line of ``peer --dry-run``."""
    _stub_cuda(monkeypatch, 1)
    assert cli_main(["peer", "--dry-run", "--initial-peers", PEER_MADDR]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("[") and x.split("]")[1].split()[0] == "device"]
    assert "[ok]" in line and "cuda:0 (Stub GPU 0; auto)" in line
    assert "train.device" in out and " auto " in [x for x in out.splitlines() if "train.device" in x][0]


def test_explicit_cpu_on_a_machine_with_a_visible_gpu_gets_a_one_line_notice(monkeypatch, capsys):
    """No GPU here: torch's CUDA check is stubbed."""
    from opendiloco_stream.commands._common import print_device, require_device
    from opendiloco_stream.commands.dry_run import check_device
    from opendiloco_stream.train.devices import idle_gpu_notice

    _stub_cuda(monkeypatch, 1)
    notice = idle_gpu_notice("cpu")
    assert notice is not None and "\n" not in notice and "Stub GPU 0" in notice and "drop --device cpu" in notice
    assert idle_gpu_notice("auto") is None and idle_gpu_notice("cuda") is None
    level, text = check_device("cpu")
    assert level == "warn" and "drop --device cpu" in text
    cfg = load_config(overrides={"train": {"device": "cpu"}}, environ={})
    print_device("cpu", require_device(cfg))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["device: cpu (--device)", notice]
    auto = require_device(load_config(environ={}))
    assert auto.train.device == "cuda:0"
    print_device("auto", auto)
    assert capsys.readouterr().err.strip().splitlines() == ["device: cuda:0 (Stub GPU 0; auto)"]
    _stub_cuda(monkeypatch, 0)
    assert idle_gpu_notice("cpu") is None


def test_a_local_run_prints_its_device_and_puts_it_in_the_summary(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert cli_main(["local", "--workers", "2", "--steps", "2", "--inner-steps", "2", "--batch-size", "2",
                     "--seq-len", "16", "--no-progress", "--metrics-file", str(metrics)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0].startswith("device: cpu (auto: torch ")
    assert "outer state on cpu" in captured.out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["device"] == "cpu" and summary["outer_device"] == "cpu"
    placed = [r for r in records if r.get("event") == "outer_state"]
    assert len(placed) == 2 and all(r["outer_device"] == "cpu" and not r["pinned"] for r in placed)


# ---------------------------------------------------------------------------- ranks
def test_rank_environment_and_shards():
    assert rank_env({}) is None and rank_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    env = rank_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (env.rank, env.world, env.local_rank) == (1, 2, 1)
    with pytest.raises(ConfigError, match="one machine"):
        rank_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError):
        rank_env({"RANK": "2", "WORLD_SIZE": "2"})
    assert rank_device("cuda", 1) == torch.device("cuda:1") and rank_device("cuda:0", 3) == torch.device("cuda:3")
    assert rank_device("cpu", 1) == torch.device("cpu")
    # the K ranks' shards partition the peer's shard r/W
    W, K, windows = 3, 2, range(60)
    for r in range(W):
        peer = {i for i in windows if i % W == r}
        parts = [{i for i in windows if i % data_shard((r, W), k, K)[1] == data_shard((r, W), k, K)[0]}
                 for k in range(K)]
        assert set().union(*parts) == peer and sum(map(len, parts)) == len(peer)


def test_ranks_on_cuda_need_one_device_each(monkeypatch):
    from opendiloco_stream.train.ranks import RankEnv, Ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # checked before any process group exists
    with pytest.raises(ConfigError, match="2 ranks on 'cuda' need 2 CUDA devices; this machine has 1"):
        Ranks(RankEnv(0, 2, 0), "cuda", 10.0)


_RANK_SCRIPT = r"""
import json, os, sys
from opendiloco_stream.commands._common import prepare_data
from opendiloco_stream.config import load_config
from opendiloco_stream.train.loop import train_worker
from opendiloco_stream.train.ranks import Ranks, data_shard, rank_env
from opendiloco_stream.transport.local import LocalSwarm

ranks = Ranks(rank_env(), "cpu", 120)
out = []
for diloco in json.loads(sys.argv[1]):
    cfg = load_config(overrides={"model": {"name": "tiny", "seq_len": 32}, "data": {"max_val_batches": 1},
                                 "train": {"steps": 12, "batch_size": 2, "warmup_steps": 2}, "diloco": diloco},
                      environ={})
    train_source, val, vocab = prepare_data(cfg)
    rank, world = data_shard((0, 1), ranks.rank, ranks.world)
    transport = LocalSwarm(1, codec=cfg.diloco.codec).transport(0) if ranks.leader else None
    report = train_worker(rank, world, cfg, transport, train_source, val, vocab, lambda rec: None, ranks=ranks)
    out.append({"digests": report.rank_digests, "syncs": report.stats.syncs, "tokens": report.tokens})
ranks.close()
if ranks.leader:
    print(json.dumps(out))
"""


@pytest.mark.timeout(240)
def test_two_gloo_ranks_of_one_peer_keep_bit_identical_parameters():
    """Rank 0 runs StreamingDiLoCo over a one-worker LocalSwarm, rank 1 follows: after every mode's
    writes (eager on-arrival landings, error feedback in the parameters, overlap merges) the
    ranks end with the same bytes."""
    configs = [{"mode": "eager", "inner_steps": 4, "num_fragments": 2, "codec": "topk-int2"},
               {"mode": "overlap", "inner_steps": 4, "num_fragments": 2, "overlap_steps": 1, "codec": "fp4-e3m0"}]
    from opendiloco_stream.commands.peer_ranks import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, json.dumps(configs)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    results = json.loads(outs[0][0].strip().splitlines()[-1])
    for res in results:
        assert len(res["digests"]) == 2 and res["digests"][0] == res["digests"][1], res
        assert res["syncs"] >= 4 and res["tokens"] == 12 * 2 * 2 * 32  # steps x ranks x batch x seq


# ---------------------------------------------------------------------------- GPU benchmark
def test_gpu_benchmark_says_in_one_line_that_it_needs_cuda():
    proc = run_benchmark("gpu", "--out", os.devnull, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--smoke-cpu" in lines[0], proc.stderr


def test_gpu_benchmark_smoke_run_goes_through_the_peers_the_cpu_reference_and_the_loop_on_cpu(tmp_path):
    """``--smoke-cpu``: every part of the GPU benchmark on the CPU (tiny preset, a few steps): two
    real peers through the averaging service, two plain-loop processes, the CPU reference, the
    in-process loop and the codec check. The figures are CPU ones; only their shape is checked."""
    from opendiloco_stream.compression import CODEC_NAMES

    out = tmp_path / "gpu.json"
    proc = run_benchmark("gpu", "--smoke-cpu", "--steps", "4", "--warmup", "1", "--codec-repeats", "2",
                         "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CPU SMOKE RUN" in proc.stdout and "not a GPU figure" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "gpu" and result["smoke_cpu"] and result["device"] == "cpu"
    (peers,) = result["peer_rows"]
    assert peers["preset"] == "tiny" and len(peers["peers"]) == 2 and len(peers["plain"]) == 2
    for p in peers["peers"]:
        assert p["timed_steps"] == 4 and p["tokens_per_s"] > 0 and p["device"] == "cpu" and p["outer_device"] == "cpu"
        assert p["wrapper_ms_per_step"] >= 0 and 0 <= p["wrapper_share"] < 1
        assert p["peak_memory_gib"] == 0 and p["eval_loss"] == p["eval_loss"]  # no GPU; a finite loss
    assert peers["tokens_per_s_vs_plain"] > 0 and peers["memory_bound_gib"] > 0  # one fragment, the outer state on CPU
    assert peers["cpu_tokens"] == peers["peer_tokens"] == 2 * 5 * 2 * 32  # equal tokens: workers x steps x batch x seq
    assert abs(peers["eval_loss_vs_cpu"]) < 0.05  # both fp32 on the CPU here; same data and seed
    (row,) = result["rows"]
    assert row["steps"] == 4 and row["tokens_per_s"] > 0 and row["peak_memory_gib"] == 0
    assert 0 < row["wrapper_share"] < 1 and row["wrapper_step_ms_max"] >= row["wrapper_step_ms_mean"]
    # the one-member LocalSwarm's rounds ran inside diloco.step() (on the CPU the launch is inline)
    assert 0 < row["transport_in_process_ms_mean"] < row["wrapper_step_ms_mean"]
    (plain,) = result["plain_rows"]
    assert plain["steps"] == 4 and not plain["wrapper"] and plain["wrapper_share"] == 0
    codecs = result["codecs"]["rows"]
    assert [r["codec"] for r in codecs] == list(CODEC_NAMES)
    for r in codecs:  # the CPU against itself: every codec is deterministic without stochastic rounding
        assert r["same_bytes_as_cpu"] and r["same_values_as_cpu"], r
