"""Stragglers: the fast peers' compute utilization with and without a peer twice as slow.

    .venv/bin/python -m benchmarks.straggler --out benchmarks/results/straggler.json

Each scenario starts a ``bootstrap`` node and N real ``peer`` processes on 127.0.0.1 (no
``--target-group-size``: groups follow the run's live peers), eager mode, tiny model. Inner steps
are made regular with the test-only fault hook ``step_delay_s`` (``opendiloco_stream/testing/faults.py``,
set through ``ODS_TEST_FAULTS``: a sleep in every inner step, counted as compute): the fast peers sleep ``D`` per step, the
straggler ``2 D`` plus the measured time of a bare step, so it is about twice as slow; the ratio
actually measured is reported.

Reported per peer: compute utilization (whole run, and *steady*: compute / (compute + time
blocked in ``diloco.step``) after the first ``2 H`` steps, which leaves out the start-up, when
peers come up seconds apart), steps trained, steps skipped to catch up with the swarm, rounds ok
/ failed, mean group size, and the peer's mean weight share in the groups it was in (weights are
tokens: the straggler processed fewer per round). All peers share this machine's cores.

``--cpu-load K`` starves the machine of CPU: K busy processes (one pure-Python spin loop each,
started before the scenario's peers and killed by PID after them) compete with the peers, their
DHTs and p2p daemons for the cores. ``--straggler-cpu PCT`` starves the straggler
alone: it runs, with the DHT and p2p daemon processes it starts, in a cgroup limited to
PCT % of one core (root; the cgroup is removed afterwards). ``--scenarios`` picks which scenarios run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from benchmarks.harness.peers import TINY, train_peers
from opendiloco_stream.testing import faults
from benchmarks.harness.results import markdown_table, write_result

def run_scenario(workdir: Path, run_id: str, delays: list[float], *, steps: int, inner_steps: int, fragments: int,
                 codec: str = "fp32", matchmaking_time: float = 5.0, request_timeout: float = 3.0,
                 timeout: float = 600.0, cgroups: Optional[dict[int, Path]] = None) -> list[dict[str, Any]]:
    """Train ``len(delays)`` peers (peer i sleeps ``delays[i]`` per inner step); their metrics records.
    ``cgroups``: peer index -> a cgroup directory the peer (and all it forks) runs in."""
    n = len(delays)
    common = ["--mode", "eager", "--codec", codec, "--fragments", str(fragments), "--inner-steps", str(inner_steps),
              "--steps", str(steps), "--matchmaking-time", str(matchmaking_time), "--request-timeout",
              str(request_timeout), "--no-join", *TINY, "--log-level", os.environ.get("ODS_BENCH_LOG_LEVEL", "WARNING")]
    per_peer = [["--shard", f"{i}/{n}"] for i in range(n)]
    envs = {i: faults.env(step_delay_s=f"{d:.4f}") for i, d in enumerate(delays)}
    # enter the cgroup before python starts: its children inherit it
    prefixes = {i: ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(g)] for i, g in (cgroups or {}).items()}
    records = train_peers(workdir, run_id, per_peer, common=common, timeout=timeout, prefixes=prefixes, envs=envs)
    return [{"records": r, "delay_s": d} for r, d in zip(records, delays)]


_SPIN = "import time\nend = time.monotonic() + float(__import__('sys').argv[1])\nwhile time.monotonic() < end: pass\n"


@contextlib.contextmanager
def cpu_cgroup(percent: float, name: str) -> Iterator[Path]:
    """A cgroup (v1 ``cpu`` controller, root) whose processes together get ``percent`` % of one core;
    removed on exit once its processes are gone (they are killed if still there)."""
    root = Path("/sys/fs/cgroup/cpu")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        raise RuntimeError("--straggler-cpu needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    group = root / name
    group.mkdir()
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(period * percent / 100))))
        yield group
    finally:
        for _ in range(50):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        group.rmdir()


def start_cpu_load(count: int, limit_s: float) -> list[subprocess.Popen]:
    """``count`` busy processes; each ends by itself after ``limit_s`` if it is not killed first."""
    return [subprocess.Popen([sys.executable, "-c", _SPIN, str(limit_s)], start_new_session=True)
            for _ in range(count)]


def peer_figures(records: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """One peer's figures from its metrics records (see the module docstring)."""
    summary = next(r for r in records if r.get("event") == "summary")
    steps = [r for r in records if r.get("event") == "step"]
    steady = [r for r in steps if r["step"] > warmup_steps]
    compute = sum(r["compute_s"] for r in steady)
    blocked = sum(r["sync_s"] for r in steady)
    syncs = [r for r in records if r.get("event") == "sync"]
    ok = [r for r in syncs if r["ok"]]
    return dict(
        compute_utilization=summary["compute_utilization"],
        steady_utilization=compute / (compute + blocked) if compute + blocked > 0 else float("nan"),
        step_s=statistics.median(r["compute_s"] for r in steps) if steps else float("nan"),
        steps_trained=summary["steps"], caught_up_steps=summary.get("caught_up_steps", 0),
        blocked_s=summary["wait_s"], rounds_ok=len(ok), rounds_failed=len(syncs) - len(ok),
        mean_group_size=statistics.fmean(r["group_size"] for r in ok) if ok else float("nan"),
        mean_weight_share=statistics.fmean(r["weight_share"] for r in ok) if ok else float("nan"),
        tokens=summary["tokens"], eval_loss=summary["eval_loss"])


def bare_step_s(workdir: Path, steps: int = 20) -> float:
    """Median time of one bare inner step of the tiny model here (one peer alone, no delay)."""
    out = run_scenario(workdir, f"straggler-probe-{os.getpid()}", [0.0], steps=steps, inner_steps=steps * 2,
                       fragments=1)
    return statistics.median(r["compute_s"] for r in out[0]["records"] if r.get("event") == "step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4, help="peers per scenario (one of them the straggler)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--delay", type=float, default=0.2, help="seconds slept per inner step by the fast peers")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--cpu-load", type=int, default=0, help="busy processes competing with the peers for the cores")
    ap.add_argument("--straggler-cpu", type=float, default=None, metavar="PCT",
                    help="run the straggler (with all it forks) in a cgroup limited to PCT %% of one core (root)")
    ap.add_argument("--scenarios", nargs="+", choices=["none", "straggler"], default=["none", "straggler"],
                    help="none: every peer at the same speed; straggler: the last peer 2x slower")
    ap.add_argument("--out", default=None, help="JSON results (e.g. benchmarks/results/straggler.json)")
    args = ap.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="ods-straggler-"))
    bare = bare_step_s(root / "probe")
    slow = 2 * args.delay + bare  # (bare + slow) = 2 (bare + delay)
    scenarios = {"none": ("no straggler", [args.delay] * args.peers),
                 "straggler": ("one peer 2x slower", [args.delay] * (args.peers - 1) + [slow])}
    results = []
    for name, delays in (scenarios[k] for k in scenarios if k in args.scenarios):
        t0 = time.perf_counter()
        load = start_cpu_load(args.cpu_load, limit_s=900.0)
        try:
            with contextlib.ExitStack() as stack:
                cgroups = None
                if args.straggler_cpu is not None and name != "no straggler":
                    group = stack.enter_context(cpu_cgroup(args.straggler_cpu, f"ods-straggler-{os.getpid()}"))
                    cgroups = {len(delays) - 1: group}
                peers = run_scenario(root / name.replace(" ", "-"), f"straggler-{os.getpid()}-{len(results)}", delays,
                                     steps=args.steps, inner_steps=args.inner_steps, fragments=args.fragments,
                                     codec=args.codec, cgroups=cgroups)
        finally:
            for proc in load:
                proc.kill()
                proc.wait(10)
        figures = [dict(peer_figures(p["records"], 2 * args.inner_steps), delay_s=p["delay_s"]) for p in peers]
        fast = figures[:-1] if name != "no straggler" else figures
        results.append(dict(scenario=name, wall_s=time.perf_counter() - t0, peers=figures,
                            fast_steady_utilization=statistics.fmean(f["steady_utilization"] for f in fast),
                            fast_compute_utilization=statistics.fmean(f["compute_utilization"] for f in fast)))
    with_straggler = next((r for r in results if r["scenario"] != "no straggler"), None)
    slowdown = float("nan") if with_straggler is None else (
        with_straggler["peers"][-1]["step_s"] / statistics.fmean(f["step_s"] for f in with_straggler["peers"][:-1]))
    rows = []
    for res in results:
        for i, f in enumerate(res["peers"]):
            role = "straggler" if res["scenario"] != "no straggler" and i == len(res["peers"]) - 1 else "fast"
            rows.append([res["scenario"], f"{i} ({role})", f"{f['step_s']:.3f}", f"{100 * f['compute_utilization']:.1f}%",
                         f"{100 * f['steady_utilization']:.1f}%", f["steps_trained"], f["caught_up_steps"],
                         f"{f['rounds_ok']}/{f['rounds_ok'] + f['rounds_failed']}", f"{f['mean_group_size']:.2f}",
                         f"{f['mean_weight_share']:.3f}", f"{f['blocked_s']:.1f}"])
    table = markdown_table(["scenario", "peer", "step s", "utilization", "steady util.", "steps", "skipped",
                            "rounds ok", "mean group", "weight share", "blocked s"], rows)
    print(table)
    print(f"\nstraggler step / fast step: {slowdown:.2f}x; fast peers' steady utilization: "
          + ", ".join(f"{r['scenario']} {100 * r['fast_steady_utilization']:.1f}%" for r in results))
    if args.out:
        write_result(args.out, settings=vars(args), rows=results, argv=argv, benchmark="straggler", bare_step_s=bare,
                     slowdown=slowdown, table=table)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
