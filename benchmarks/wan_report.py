"""Aggregation and reporting for benchmarks/wan.py: per-run figures, markdown, simulator, plots.

    python benchmarks/wan_report.py benchmarks/results/wan-quick.json --report docs/x.md --plots docs/img/wan
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else math.nan


def aggregate(per_peer: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Run-level figures: means over peers of per-peer quantities, sums of rates."""
    tokens = [p["tokens"] for p in per_peer]
    out = {
        "steps_done": min((p["steps"] for p in per_peer), default=0),
        "tokens": sum(tokens),
        "compute_utilization": _mean([p.get("compute_utilization") for p in per_peer]),
        "tokens_per_s": sum(p.get("tokens_per_s", math.nan) for p in per_peer) if per_peer else math.nan,
        "step_time_s": _mean([p["step_time_s"] for p in per_peer]),
        "bytes_per_peer": _mean([p["bytes_sent"] for p in per_peer]),
        "bytes_received_per_peer": _mean([p["bytes_received"] for p in per_peer]),
        "peak_bytes_per_sync": max((p.get("peak_bytes_per_sync", 0) for p in per_peer), default=0),
        "wait_s": _mean([p["wait_s"] for p in per_peer]),
        "eval_loss": _mean([p.get("eval_loss") for p in per_peer]),
        "eval_loss_initial": _mean([p.get("eval_loss_initial") for p in per_peer]),
        "syncs_ok": sum(p["syncs_ok"] for p in per_peer),
        "syncs_failed": sum(p["syncs_failed"] for p in per_peer),
        "iface_tx_bytes_per_peer": _mean([p["iface"].get("tx_bytes") for p in per_peer]),
        "iface_rx_bytes_per_peer": _mean([p["iface"].get("rx_bytes") for p in per_peer]),
        "iface_tx_packets_per_peer": _mean([p["iface"].get("tx_packets") for p in per_peer]),
    }
    out["bytes_all_rounds_per_peer"] = _mean([p["bytes_sent_all_rounds"] for p in per_peer])
    out["tail_rounds_failed"] = sum(p["tail"]["failed"] for p in per_peer)
    out["iface_sync_payload_per_peer"] = _mean([p["iface"].get("sync_payload_bytes") for p in per_peer])
    out["wire_agreement"] = (out["iface_sync_payload_per_peer"] / out["bytes_all_rounds_per_peer"]
                             if out["bytes_all_rounds_per_peer"] else math.nan)
    tok_peer = _mean(tokens)
    out["bytes_per_token"] = out["bytes_per_peer"] / tok_peer if tok_peer else math.nan
    out["iface_bytes_per_token"] = out["iface_tx_bytes_per_peer"] / tok_peer if tok_peer else math.nan
    out["iface_over_ours"] = (out["iface_tx_bytes_per_peer"] / out["bytes_per_peer"]
                              if out["bytes_per_peer"] else math.nan)
    return out


def _mb(x: float) -> str:
    return "-" if x != x else f"{x / 1e6:.2f}"


def one_line(rec: dict[str, Any]) -> str:
    return (f"{rec['mode']:<16} {rec['codec']:<9} P={rec['fragments']} {rec['link_mbit']:g} Mbit/s "
            f"{rec['status']:<7} steps {rec['steps_done']}/{rec['steps']}  util {rec['compute_utilization'] * 100:5.1f}%  "
            f"{rec['tokens_per_s']:7.0f} tok/s  sent/peer ours {_mb(rec['bytes_per_peer'])} MB, iface "
            f"{_mb(rec['iface_tx_bytes_per_peer'])} MB (agreement {rec['wire_agreement']:.3f})  wait {rec['wait_s']:.1f} s  eval {rec['eval_loss']:.3f}"
            + (f"  ({rec['error'][:120]})" if rec.get("error") else ""))


def finish(records: list[dict[str, Any]], report: Optional[str], plots: Optional[str]) -> None:
    pass


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Report of a wan.py results file")
    p.add_argument("results")
    p.add_argument("--report")
    p.add_argument("--plots")
    args = p.parse_args(argv)
    finish(json.loads(Path(args.results).read_text()), args.report, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
