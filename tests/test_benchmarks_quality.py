"""The benchmark scripts' ``--smoke`` presets run end to end and write what the docs are built from.

The real numbers come from ``--preset full`` (docs/benchmarks-quality.md, docs/benchmarks-overhead.md);
these tests pin the scripts' contracts on a few training steps: every variant runs at equal tokens,
the byte accounting compares modes fairly, and the JSON, markdown and PNG outputs exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.peers import run_benchmark

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # training runs of every variant: minutes
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path


@pytest.fixture(scope="module")
def quality(tmp_path_factory) -> tuple[dict, str, Path]:
    out_dir = tmp_path_factory.mktemp("quality")
    proc = run_benchmark("quality", "--smoke", "--out", str(out_dir / "q.json"), "--img-dir", str(out_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out_dir / "q.json").read_text()), proc.stdout, out_dir


def test_quality_smoke_runs_every_variant_at_equal_tokens(quality):
    result, stdout, _ = quality
    names = {r["variant"] for r in result["rows"]}
    expected = {"data-parallel", "diloco", "streaming", "streaming-tau1", "eager", "naive-delayed"}
    expected |= {f"eager-{c}{ef}" for c in ("fp16", "int8", "fp4-e3m0", "fp4-e2m1") for ef in ("", "-ef")}
    expected |= {f"{m}-{c}" for m in ("streaming", "eager", "naive-delayed") for c in ("olr0.4", "mom0")}
    expected |= {"streaming-fp4-e3m0", "streaming-fp4-e2m1"}
    assert names == expected
    tokens = {r["summary"]["tokens"] for r in result["rows"]}
    assert len(tokens) == 1, tokens  # equal tokens across modes is the point of the comparison
    for r in result["rows"]:
        s = r["summary"]
        assert s["eval_loss"] < s["eval_loss_initial"], (r["variant"], s["eval_loss_initial"], s["eval_loss"])
        steps = [step for step, _ in r["eval_curve"]]
        assert steps[0] == 0 and steps[-1] == result["settings"]["preset"]["steps"] and steps == sorted(steps)
    assert result["command"].startswith("python -m benchmarks.quality --smoke")
    for label in ("naive-delayed", "streaming tau=1", "data-parallel", "fp4-e2m1"):
        assert label in stdout


def test_quality_bytes_per_token_count_rounds_still_in_flight(quality):
    agg = quality[0]["aggregate"]
    # eager and tau-overlap leave each fragment's last round in flight; the same rounds go on the
    # wire as in blocking mode, so the bytes per token must match exactly
    assert agg["eager"]["bytes_per_token"] == agg["streaming"]["bytes_per_token"] > 0
    assert agg["streaming-tau1"]["bytes_per_token"] == agg["streaming"]["bytes_per_token"]
    assert agg["data-parallel"]["bytes_per_token"] > agg["diloco"]["bytes_per_token"]
    wire = [agg[n]["bytes_per_token"] for n in ("eager", "eager-fp16", "eager-int8", "eager-fp4-e3m0")]
    assert wire == sorted(wire, reverse=True) and wire[-1] < wire[0] / 7  # 4.25 bits vs 32


def test_quality_smoke_writes_plots(quality):
    result, _, out_dir = quality
    names = ["quality-modes-eval-loss.png", "quality-codecs-eval-loss.png", "quality-outer-olr0.4-eval-loss.png",
             "quality-outer-mom0-eval-loss.png", "quality-bytes-per-token.png"]
    for name in names:
        assert_png(out_dir / name)
    assert sorted(Path(p).name for p in result["plots"]) == sorted(names)


def test_quality_resume_runs_only_what_is_missing(quality, tmp_path):
    result, _, _ = quality
    partial = dict(result, rows=[r for r in result["rows"] if r["variant"] != "eager-int8"])
    out = tmp_path / "q.json"
    out.write_text(json.dumps(partial))
    proc = run_benchmark("quality", "--smoke", "--resume", "--no-plots", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("seed 0: eval loss") == 1 and "eager-int8 seed 0" in proc.stderr
    resumed = json.loads(out.read_text())
    assert len(resumed["rows"]) == len(result["rows"])
    # the local swarm is deterministic: the re-run reproduces the first run's numbers exactly
    again = next(r for r in resumed["rows"] if r["variant"] == "eager-int8")["summary"]
    first = next(r for r in result["rows"] if r["variant"] == "eager-int8")["summary"]
    assert again["eval_loss"] == first["eval_loss"] and again["bytes_sent"] == first["bytes_sent"]


def test_quality_unknown_variant_is_one_line_and_exit_code_2(tmp_path):
    proc = run_benchmark("quality", "--smoke", "--only", "eagre", "--out", str(tmp_path / "q.json"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "eagre" in proc.stderr
    assert not (tmp_path / "q.json").exists()


def test_overhead_smoke_measures_loops_and_every_codec(tmp_path):
    proc = run_benchmark("overhead", "--smoke", "--out", str(tmp_path / "o.json"), "--img-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "o.json").read_text())
    summary = result["loop"]["summary"]
    assert set(summary) == {"plain", "eager-fp4-e3m0", "blocking-fp32"}
    assert all(s["tokens_per_s_median"] > 0 for s in summary.values())
    # the wrapped loops spend measurable time in diloco.step(); the plain loop has none
    assert summary["eager-fp4-e3m0"]["wrapper_share_pct_median"] > 0
    # the benchmark's mirrored loop is train_worker's body: same losses, step for step
    check = result["loop"]["mirror_check"]
    assert check["same_length"] and check["max_abs_loss_diff"] == 0.0, check
    preset = result["settings"]["preset"]
    assert {r["timed_steps"] for r in result["rows"]} == {preset["steps"] - preset["warmup"]}
    codecs = result["codecs"]["codecs"]
    from opendiloco_stream.compression.wire import CODEC_NAMES

    assert set(codecs) == set(CODEC_NAMES)  # every registered codec, the sparse ones included
    assert {"fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1"} <= set(codecs)
    assert codecs["fp32"]["relative_error"] == 0.0
    assert 4.2 < codecs["fp4-e3m0"]["bits_per_value"] < 4.3
    assert all(c["roundtrip_gb_per_s"] > 0 for c in codecs.values())
    assert result["codecs"]["memcpy"]["copy_"]["gb_per_s"] > 0
    assert_png(tmp_path / "overhead-codec-throughput.png")
    assert "time in diloco.step()" in proc.stdout and "memcpy" in proc.stdout
