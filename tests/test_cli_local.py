"""``opendiloco-stream local`` end to end on the built-in corpus (threads + LocalSwarm), and the
CLI's contract for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco_stream.train.loop import read_metrics

SMALL = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--no-progress", "--threads", "1"]


def run_local(tmp_path: Path, name: str, *flags: str, timeout: float = 300) -> dict:
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", "local", *SMALL, *flags,
                           "--metrics-file", str(metrics)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert len(records) == len(metrics.read_text().splitlines())  # every line is a whole JSON record
    summary = records[-1]
    assert summary["event"] == "summary"
    summary["_records"] = records
    summary["_stdout"] = proc.stdout
    return summary


@pytest.mark.slow
def test_local_eager_fp4_learns_and_writes_the_metrics_contract(tmp_path):
    s = run_local(tmp_path, "eager", "--workers", "4", "--mode", "eager", "--fragments", "2", "--inner-steps", "10",
                  "--codec", "fp4-e3m0", "--steps", "60", "--seed", "0", "--eager-rule", "corrected")
    for key in ("mode", "workers", "steps", "tokens", "eval_loss", "train_loss", "bytes_sent", "peak_bytes_per_sync",
                "compute_utilization", "wall_time_s", "tokens_per_s"):
        assert key in s, key
    assert s["mode"] == "eager" and s["workers"] == 4 and s["steps"] == 60
    assert s["eval_loss"] < s["eval_loss_initial"] - 0.5, (s["eval_loss_initial"], s["eval_loss"])
    syncs = [r for r in s["_records"] if r["event"] == "sync"]
    # 60 steps, H = 10, 2 fragments -> 6 rounds each launched; each lands the step after its launch
    # (the 'corrected' rule, which logs its estimate at each sync; the default 'merge' takes none)
    # and the trainer's finish() lands the last: 6 consumed
    assert len(syncs) == 4 * 2 * 6
    assert all(r["ok"] and r["group_size"] == 4 for r in syncs)
    estimates = [r["estimate"] for r in s["_records"] if r["event"] == "outer_step"]
    assert estimates.count("local-only") == 4 * 2 and estimates.count("eager") == 4 * 2 * 5
    assert "eval loss" in s["_stdout"]


@pytest.mark.slow
def test_fp4_sends_about_one_eighth_of_fp32_and_fragments_cut_the_peak(tmp_path):
    common = ["--workers", "2", "--mode", "eager", "--inner-steps", "10", "--steps", "20"]
    fp32 = run_local(tmp_path, "fp32", *common, "--codec", "fp32", "--fragments", "1")
    fp4 = run_local(tmp_path, "fp4", *common, "--codec", "fp4-e3m0", "--fragments", "1")
    fp4_p2 = run_local(tmp_path, "fp4p2", *common, "--codec", "fp4-e3m0", "--fragments", "2")
    ratio = fp4["bytes_sent"] / fp32["bytes_sent"]
    assert 0.12 < ratio < 0.15, ratio  # 4.25 bits / 32 bits = 0.133 (block 64, fp16 scales)
    peak_ratio = fp4_p2["peak_bytes_per_sync"] / fp4["peak_bytes_per_sync"]
    assert 0.4 < peak_ratio < 0.6, peak_ratio  # ~1/P


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    cases = [
        ["local", "--mode", "overlap", "--overlap-steps", "0"],
        ["local", "--dataset", str(tmp_path / "missing.jsonl")],
        ["local", "--config", str(tmp_path / "nope.toml")],
        ["local", "--workers", "0"],
    ]
    (tmp_path / "bad.toml").write_text("[diloco]\ninner_step = 3\n")
    cases.append(["local", "--config", str(tmp_path / "bad.toml")])
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", *argv], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)
        assert "error" in proc.stderr
