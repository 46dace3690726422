"""The distance report of benchmarks/wan.py (``--rtt-ms``, ``--regions``): what round-trip time does to a round.

Per run: where the peers were (RTT between two regions, or a region preset), the link rate, the
mode; the rounds every peer averaged with the whole group (the worst peer, from each fragment's
second round: the first may meet a peer still starting), the failed rounds summed over peers with
their reasons, the median matchmaking, exchange and round time of successful rounds (the
transport's phases), compute utilization, and the training time to blocking streaming fp32's
final eval loss at the same rate and place (``benchmarks/harness/wan_time_to_loss.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import wan_time_to_loss as ttl
from benchmarks.harness.results import markdown_table
from benchmarks.harness.wan_records import LABELS

#: how the table names the benchmark's modes (the issue's words)
MODE_NAMES = {"data-parallel": "data-parallel", "diloco": "DiLoCo", "streaming": "blocking",
              "streaming-tau1": "overlap (tau=1)", "streaming-eager": "eager"}


def place_name(r: dict[str, Any]) -> str:
    place = r.get("place", "")
    return f"RTT {r['rtt_ms']:g} ms" if place.startswith("rtt") else (place or "RTT 0")


def _order(r: dict[str, Any]) -> tuple:
    place = r.get("place", "")
    return (place != "" and not place.startswith("rtt"), r.get("rtt_ms", 0.0), r["link_mbit"],
            LABELS.index(r["mode"]) if r["mode"] in LABELS else -1, r["codec"])


def _s(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def table(records: list[dict[str, Any]]) -> str:
    ttl_rows = {(x["link_mbit"], x["place"], x["mode"], x["codec"]): x for x in ttl.rows(records)}
    head = ["place", "link", "mode", "codec", "run", "rounds with all (worst peer, after the first)",
            "failed rounds (all peers)", "matchmaking (s)", "exchange (s)", "round (s)", "compute util.",
            "time to blocking's loss"]
    body = []
    for r in sorted((r for r in records if r["mode"] in MODE_NAMES), key=_order):
        t = ttl_rows.get((r["link_mbit"], r.get("place", ""), r["mode"], r["codec"]))
        reach = "-" if t is None else (f"{t['time_s']:.0f} s" if t["time_s"] is not None else "not reached")
        fails = r.get("failure_counts") or {}
        body.append([place_name(r), f"{r['link_mbit']:g} Mbit/s", MODE_NAMES[r["mode"]], r["codec"], r["status"],
                     f"{r.get('rounds_with_all_after_first_min', 0)}/{r.get('rounds_after_first', 0)}",
                     ", ".join(f"{n} {k}" for k, n in sorted(fails.items())) or "0",
                     _s(r.get("phase_matchmaking_s")), _s(r.get("phase_exchange_s")), _s(r.get("round_s")),
                     f"{r['compute_utilization']:.0%}" if r.get("compute_utilization") == r.get("compute_utilization")
                     else "-", reach])
    return markdown_table(head, body)


def draw(records: list[dict[str, Any]], path: str) -> None:
    """Round time and compute utilization against RTT (2-region places), one line per mode and rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["mode"] in MODE_NAMES and (r.get("place") or "rtt").startswith("rtt")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for (mode, codec, rate) in sorted({(r["mode"], r["codec"], r["link_mbit"]) for r in runs}):
        pts = sorted((r["rtt_ms"], r.get("round_s"), r.get("compute_utilization")) for r in runs
                     if (r["mode"], r["codec"], r["link_mbit"]) == (mode, codec, rate))
        label = f"{MODE_NAMES[mode]} {codec} {rate:g} Mbit/s"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax2.plot([p[0] for p in pts], [100 * (p[2] if p[2] == p[2] else 0) for p in pts], marker="o", label=label)
    ax1.set(xlabel="RTT between the two peers (ms)", ylabel="median round time (s)", title="round time")
    ax2.set(xlabel="RTT between the two peers (ms)", ylabel="compute utilization (%)", title="compute utilization")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.text(0.01, 0.01, "python -m benchmarks.wan --distance --rtt-ms ...", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def finish(records: list[dict[str, Any]], report: Optional[str], plots: Optional[str]) -> str:
    """Print the table; write it to ``report`` and the plot to ``plots``-rtt.png when asked."""
    text = table(records)
    print(text)
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(text + "\n")
    if plots:
        draw(records, f"{plots}-rtt.png")
    return text


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m benchmarks.harness.wan_rtt RESULT.json... [--report MD] [--plots PREFIX]``: the
    distance table and plot again, from one or more ``wan`` results (e.g. a grid run in parts)."""
    import argparse

    from benchmarks.harness.results import read_result

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("results", nargs="+")
    p.add_argument("--report")
    p.add_argument("--plots")
    args = p.parse_args(argv)
    records = [r for path in args.results for r in read_result(path)["rows"]]
    finish(records, args.report, args.plots)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
