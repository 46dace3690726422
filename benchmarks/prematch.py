"""Groups formed ahead (``--prematch-steps K``) against groups formed at each round, in the trainer.

    python -m benchmarks.prematch --out benchmarks/results/prematch-blocking-local.json

Runs ``opendiloco-stream local --transport hivemind`` (real peers on 127.0.0.1, the built-in
corpus) with ``--prematch-steps 0`` and ``--prematch-steps K``, alternating, ``--repeats`` times
each, same seed and schedule. Blocking mode by default: there every round's wait is on the
critical path, matchmaking included, so the difference shows as waiting time and compute
utilization. Per run: the eval losses, the rounds (ok / all), the median and total wait per round
and peer (the sync records' ``wait_s``), the compute utilization and the wall time. The eval
losses should match: in a steady run the weight predicted K steps ahead is the round's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.results import markdown_table, write_result


def run_once(k: int, args: argparse.Namespace, workdir: Path) -> dict:
    metrics = workdir / f"k{k}-{time.monotonic_ns()}.jsonl"
    cmd = [sys.executable, "-m", "opendiloco_stream", "local", "--transport", "hivemind", "--workers",
           str(args.workers), "--mode", args.mode, "--codec", args.codec, "--fragments", str(args.fragments),
           "--inner-steps", str(args.inner_steps), "--steps", str(args.steps), "--model", args.model,
           "--prematch-steps", str(k), "--no-progress", "--metrics-file", str(metrics)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"prematch_steps={k}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    syncs = [r for r in recs if r["event"] == "sync"]
    summary = recs[-1]
    waits = [r["wait_s"] for r in syncs]
    return dict(prematch_steps=k, rounds=len(syncs), rounds_ok=sum(1 for r in syncs if r["ok"]),
                wait_s_median=statistics.median(waits) if waits else 0.0,
                wait_s_per_peer=sum(waits) / args.workers,
                utilization=summary.get("compute_utilization"), eval_loss=summary.get("eval_loss"),
                eval_loss_global=summary.get("eval_loss_global"), wall_s=wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ahead", type=int, default=4, help="K: prematch_steps of the runs with groups formed ahead")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--mode", default="blocking")
    p.add_argument("--codec", default="fp32")
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", default="tiny")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="ods-prematch-") as tmp:
        for rep in range(args.repeats):
            for k in (0, args.ahead):
                runs.append(dict(run_once(k, args, Path(tmp)), repeat=rep))
                r = runs[-1]
                print(f"repeat {rep} prematch_steps={k}: rounds {r['rounds_ok']}/{r['rounds']}, wait median "
                      f"{r['wait_s_median']:.3f} s, {r['wait_s_per_peer']:.2f} s per peer, utilization "
                      f"{r['utilization']}, eval loss {r['eval_loss']}", flush=True)
    print(markdown_table(["repeat", "prematch_steps", "rounds ok", "wait median s", "wait s / peer", "utilization",
                          "eval loss", "wall s"],
                         [[r["repeat"], r["prematch_steps"], f"{r['rounds_ok']}/{r['rounds']}",
                           f"{r['wait_s_median']:.3f}", f"{r['wait_s_per_peer']:.2f}", r["utilization"],
                           r["eval_loss"], f"{r['wall_s']:.1f}"] for r in runs]))
    if args.out:
        write_result(args.out, settings=vars(args), rows=runs, benchmark="prematch")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
