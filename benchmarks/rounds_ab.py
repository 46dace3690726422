"""Round time of two commits side by side: ``transport_rounds`` run alternately from each.

    python -m benchmarks.rounds_ab --base 0b86ffe --pairs 8 --codecs fp32 \\
        --out benchmarks/results/transport-rounds-ab.json

A change to the transport is judged against the commit before it on the same machine, in the same
hour: this checks both commits out (``git worktree add --detach`` under ``--workdir``, removed at
the end), then runs ``python -m benchmarks.transport_rounds --no-kill`` from each in turn, ``--pairs``
times, the order swapped every pair (base first in odd pairs), so drift in the machine's load
falls on both alike. Each run starts its own 3 peers on 127.0.0.1 with that checkout's code (the
same Python environment). Rows: one per run and codec (its median round time and phases, the
load average when it started); ``summary``: per side and codec, the median of the runs' medians and
how many pairs the head was faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.results import REPO_ROOT, write_result


def checkout(commit: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-f", str(where), commit],
                   check=True, capture_output=True, text=True)
    return where


def one_run(tree: Path, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """``transport_rounds`` from ``tree``; its rows (one per codec), or a failed row per codec."""
    cmd = [sys.executable, "-m", "benchmarks.transport_rounds", "--codecs", *args.codecs, "--numels",
           str(args.numel), "--rounds", str(args.rounds), "--no-kill", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.run_timeout,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode != 0 or not out.exists():
        return [{"codec": c, "failed": (proc.stderr or proc.stdout)[-400:]} for c in args.codecs]
    return json.loads(out.read_text())["rows"]


def summarize(rows: list[dict[str, Any]], codecs: list[str]) -> dict[str, Any]:
    out = {}
    for codec in codecs:
        by_pair: dict[int, dict[str, float]] = {}
        for r in rows:
            if r["codec"] == codec and "round_s_median" in r:
                by_pair.setdefault(r["pair"], {})[r["side"]] = r["round_s_median"]
        both = [p for p in by_pair.values() if len(p) == 2]
        med = {side: statistics.median([p[side] for p in both]) if both else None for side in ("base", "head")}
        out[codec] = {"pairs": len(both), "base_median_s": med["base"], "head_median_s": med["head"],
                      "head_over_base": med["head"] / med["base"] if both else None,
                      "head_faster_in": sum(1 for p in both if p["head"] < p["base"])}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--head", default="HEAD", help="the commit measured (default HEAD)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--codecs", nargs="+", default=["fp32"])
    p.add_argument("--numel", type=int, default=10_000_000, help="fragment size (default 10M values)")
    p.add_argument("--rounds", type=int, default=12, help="measured rounds per run (default 12)")
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--workdir", type=Path, help="where the checkouts go (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "transport-rounds-ab.json")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ods-ab-"))
    trees = {"base": work / "base", "head": work / "head"}
    commits = {}
    try:
        for side, commit in (("base", args.base), ("head", args.head)):
            checkout(commit, trees[side])
            commits[side] = subprocess.run(["git", "-C", str(trees[side]), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, check=True).stdout.strip()
        rows: list[dict[str, Any]] = []
        for pair in range(1, args.pairs + 1):
            for side in (("base", "head") if pair % 2 else ("head", "base")):
                load = os.getloadavg()[0]
                for r in one_run(trees[side], args, work / f"{side}-{pair}.json"):
                    rows.append({"side": side, "commit": commits[side], "pair": pair, "loadavg_1m_at_start": load,
                                 **{k: r[k] for k in ("codec", "numel", "round_s_median", "phases_s_median", "failed")
                                    if k in r}})
                last = rows[-1]
                print(f"pair {pair} {side:<4} ({commits[side]}) {last['codec']}: "
                      f"{last.get('round_s_median', float('nan')):.3f} s  load {load:.1f}", file=sys.stderr, flush=True)
                write_result(args.out, settings=vars(args) | {"commits": commits}, rows=rows, benchmark="rounds_ab",
                             summary=summarize(rows, args.codecs))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    summary = summarize(rows, args.codecs)
    for codec, s in summary.items():
        if s["pairs"]:
            print(f"{codec}: base {commits['base']} {s['base_median_s']:.3f} s, head {commits['head']} "
                  f"{s['head_median_s']:.3f} s ({s['head_over_base']:.2f}x), head faster in {s['head_faster_in']} "
                  f"of {s['pairs']} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
