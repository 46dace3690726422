"""What a round waits for beyond its bytes, in round trips, from ``benchmarks.wan`` result files.

    python -m benchmarks.harness.wan_round_trips benchmarks/results/wan-rtt-5mbit-300-auto-run1.json ...

One row per run: the phases' medians as ``benchmarks.wan`` records them (matchmaking, exchange,
round: averaged over the peers), the round's transfer time (the bytes a peer sends in one round,
``peak_bytes_per_sync``, at the link's nominal rate: with 2 peers each sends half its vector and
the averaged half of the other, one vector in all, in two sequential halves), and ``(round -
transfer) / RTT``: the issue's goal is a round within its transfer + 4 RTT.

    python -m benchmarks.harness.wan_round_trips --records WORKDIR/streaming-eager-fp4-e3m0-P2-5mbit-rtt300

``--records``: one run's directory (``benchmarks.wan --workdir``), its peers' sync records: per
round, the peer that waited least for its group (the last to launch it: an eager peer ahead of the
other waits in the background for the other to reach the round, drift and not round trips), its
matchmaking and its round; medians over the rounds after each fragment's first.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

MODE_NAMES = {"blocking": "blocking fp32", "eager": "eager fp4"}


def row(path: str, rec: dict[str, Any]) -> list[str]:
    rtt_s = float(rec["rtt_ms"]) / 1e3
    transfer_s = rec["peak_bytes_per_sync"] * 8 / (rec["link_mbit"] * 1e6)
    over = (rec["round_s"] - transfer_s) / rtt_s if rtt_s > 0 else float("nan")
    settings = rec.get("prematch_steps", 0)
    # "auto: 4 inner steps ahead (...)" per peer -> "auto (4, 4)": what auto came to at the end
    chosen = [re.match(r"auto: (\d+)", c) for c in rec.get("prematch_chosen") or [] if c]
    ahead = f"{settings}" + (f" ({', '.join(m.group(1) for m in chosen if m)})" if any(chosen) else "")
    window = "keep-window" if rec.get("keep_window") else "-"
    cc = rec.get("congestion_control") or "bbr (not recorded: this machine's default)"
    load = "-".join(f"{x:g}" for x in rec.get("loadavg_1m", []))
    return [MODE_NAMES.get(rec["trainer_mode"], rec["trainer_mode"]), ahead, f"{cc}, {window}", load,
            f"{rec['phase_matchmaking_s']:.2f}", f"{rec['phase_exchange_s']:.2f}", f"{rec['round_s']:.2f}",
            f"{transfer_s:.2f}", f"{over:.1f}", f"{100 * rec['compute_utilization']:.0f}%",
            f"{rec['rounds_with_all_after_first_min']}/{rec['rounds_after_first']}", Path(path).name]


def last_launchers(run_dir: Path) -> dict[str, Any]:
    """Per round of a run's directory, the phases of the peer that waited least for its group."""
    rounds: dict[tuple, list[dict]] = {}
    for path in sorted(run_dir.glob("peer-*.jsonl")):
        first: dict[int, int] = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") != "sync":
                continue
            first.setdefault(rec["fragment"], rec["round"])
            if rec.get("ok") and rec.get("phases") and rec["round"] != first[rec["fragment"]]:
                rounds.setdefault((rec["fragment"], rec["round"]), []).append(rec["phases"])
    picked = [min(phases, key=lambda ph: ph.get("matchmaking", 0.0)) for phases in rounds.values() if len(phases) > 1]

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else float("nan")
    return {"rounds": len(picked), "matchmaking_s": median([ph.get("matchmaking", 0.0) for ph in picked]),
            "round_s": median([sum(ph.values()) for ph in picked])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="benchmarks.wan --out files")
    p.add_argument("--records", nargs="*", default=[], help="run directories: the last launcher's figures (docstring)")
    args = p.parse_args(argv)
    for run_dir in args.records:
        print(json.dumps({"run": run_dir, **last_launchers(Path(run_dir))}))
    if not args.files:
        return 0
    head = ["mode", "--prematch-steps (chosen per peer)", "TCP", "1-min load", "matchmaking (s)", "exchange (s)",
            "round (s)", "transfer (s)", "(round - transfer) / RTT", "compute util.", "rounds with all", "file"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for path in args.files:
        data = json.loads(Path(path).read_text())
        for rec in data["rows"] if isinstance(data, dict) else data:
            if rec.get("status") == "ok" and rec.get("rtt_ms"):
                print("| " + " | ".join(row(path, rec)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
