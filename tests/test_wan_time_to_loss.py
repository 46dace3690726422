"""benchmarks/wan.py --time-to-loss: the runs it plans, and how the report reads a run's eval curve.

The curves here come from a real ``local`` run's metrics (4 workers, their ``eval`` records with
``wall_s``); the WAN runs themselves need root and namespaces (tests/test_wan_netns.py covers that layer).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.harness import wan_time_to_loss as ttl
from opendiloco_stream.train.loop import read_metrics
from tests.support.peers import REPO


def _plan(*flags: str) -> list[dict]:
    """``python -m benchmarks.wan --plan``: prints the runs and exits, starting nothing (no root)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.wan", "--plan", "--no-baseline", *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_time_to_loss_plans_the_five_runs_per_link_on_one_schedule():
    specs = _plan("--time-to-loss")
    assert [s["link_mbit"] for s in specs] == [5.0] * 5 + [20.0] * 5 + [100.0] * 5
    at5 = {(s["label"], s["codec"]): s for s in specs if s["link_mbit"] == 5.0}
    assert set(at5) == {("data-parallel", "fp32"), ("diloco", "fp32"), ("streaming", "fp32"),
                        ("streaming-eager", "fp4-e3m0"), ("streaming-eager", "topk-int2")}
    # one schedule for all: the same steps (data-parallel: as many as its link budget allows)
    assert {s["steps"] for s in at5.values() if s["label"] != "data-parallel"} == {100}
    assert at5["data-parallel", "fp32"]["steps"] < 100
    flags = at5["streaming-eager", "fp4-e3m0"]["peer_flags"]
    assert flags[flags.index("--eval-every") + 1] == "10" and flags[flags.index("--mode") + 1] == "eager"
    # without the flag nothing changes: no evaluations, the same steps for every streaming run
    plain = _plan("--quick")
    assert all(s["eval_every"] == 0 and "--eval-every" not in s["peer_flags"] for s in plain)
    assert {s["steps"] for s in plain if s["label"] != "data-parallel"} == {40}


def test_reach_time_interpolates_between_evaluations_and_says_when_never():
    points = [[0, 0.0, 5.0], [10, 10.0, 3.0], [20, 20.0, 2.0], [30, 30.0, 2.5]]
    assert ttl.reach_time(points, 2.5) == pytest.approx(15.0)
    assert ttl.reach_time(points, 3.0) == pytest.approx(10.0)
    assert ttl.reach_time(points, 1.9) is None
    assert ttl.reach_time(points, 6.0) == 0.0


@pytest.mark.slow
def test_curves_from_a_real_run_give_each_mode_its_time_to_the_reference_loss(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", "local", "--workers", "2", "--mode", "blocking",
                           "--fragments", "2", "--inner-steps", "5", "--steps", "20", "--model", "tiny", "--seq-len",
                           "32", "--batch-size", "4", "--eval-every", "5", "--no-progress", "--metrics-file",
                           str(metrics)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = read_metrics(metrics)
    per_rank = [[r for r in recs if r.get("rank") == k] for k in (0, 1)]
    curve = ttl.curve(per_rank)
    assert [p[0] for p in curve] == [0, 5, 10, 15, 20]  # the evaluated steps, the final one included
    walls = [p[1] for p in curve]
    assert walls[0] == 0.0 and walls == sorted(walls) and walls[-1] > 0
    summary = next(r for r in recs if r["event"] == "summary")
    assert curve[-1][2] == pytest.approx(summary["eval_loss"], rel=1e-4)
    # the same run as the reference and as a run that stops learning half-way
    ref = {"mode": "streaming", "codec": "fp32", "link_mbit": 5.0, "status": "ok", "eval_curve": curve}
    stalled = {**ref, "mode": "streaming-eager", "codec": "fp4-e3m0",
               "eval_curve": [p if i < 3 else [p[0], p[1], curve[2][2]] for i, p in enumerate(curve)]}
    rows = {r["mode"]: r for r in ttl.rows([ref, stalled])}
    # time_s is interpolated between two points of the curve: at the last one it may exceed its wall by 1 ulp
    assert rows["streaming"]["time_s"] <= curve[-1][1] + 1e-9 and rows["streaming"]["vs_reference"] == 1.0
    assert rows["streaming-eager"]["time_s"] is None and rows["streaming-eager"]["best_loss"] == curve[2][2]
    text = "\n".join(ttl.section([ref, stalled]))
    assert "not reached" in text and f"{rows['streaming']['time_s']:.1f} s" in text
    ttl.draw([ref, stalled], str(tmp_path / "ttl.png"))
    assert (tmp_path / "ttl.png").stat().st_size > 10_000


def test_distance_plans_one_topology_per_place_with_the_grid_modes():
    """--distance --rtt-ms 0,300 --regions us/eu/asia: blocking and overlap fp32, eager fp4, DiLoCo
    and data-parallel at each place; 2 peers RTT apart, 3 in the regions preset; the time bounds
    grow with the RTT (15 round trips a round)."""
    specs = _plan("--distance", "--rtt-ms", "0,300", "--regions", "us/eu/asia", "--rates", "20")
    assert [s["place"] for s in specs] == [""] * 5 + ["rtt300"] * 5 + ["us/eu/asia"] * 5
    assert {s["peers"] for s in specs if s["place"] == "us/eu/asia"} == {3} and {s["peers"] for s in specs[:10]} == {2}
    assert {(s["label"], s["codec"]) for s in specs[:5]} == {
        ("data-parallel", "fp32"), ("diloco", "fp32"), ("streaming", "fp32"), ("streaming-tau1", "fp32"),
        ("streaming-eager", "fp4-e3m0")}
    assert all(s["eval_every"] == 10 for s in specs) and specs[5]["name"].endswith("-rtt300")
    dp = {s["place"]: s["steps"] for s in specs if s["label"] == "data-parallel"}
    assert dp["rtt300"] < dp[""]  # each step's round costs ~15 round trips more at 300 ms


def test_distance_figures_count_rounds_with_the_whole_group_and_split_the_round():
    from benchmarks.harness.wan_records import distance_figures

    phases = {"prepare": 0.0, "matchmaking": 1.0, "contributions": 2.0, "verdicts": 0.0, "reduce": 0.5,
              "results": 0.5, "drain": 0.0, "finish": 0.0}
    recs = [{"event": "sync", "fragment": f, "round": k, "ok": True, "group_size": 3, "phases": phases}
            for f in (0, 1) for k in (0, 1, 2)]
    recs[3] = {"event": "sync", "fragment": 1, "round": 0, "ok": False, "group_size": 0, "reason": "matchmaking"}
    recs[5] = {**recs[5], "group_size": 2}
    got = distance_figures(recs, group=3)
    assert (got["rounds"], got["rounds_with_all"], got["rounds_after_first"], got["rounds_with_all_after_first"]) == \
        (6, 4, 4, 3)
    assert got["failure_counts"] == {"matchmaking": 1}
    assert (got["phase_matchmaking_s"], got["phase_exchange_s"], got["round_s"]) == (1.0, 3.0, 4.0)
