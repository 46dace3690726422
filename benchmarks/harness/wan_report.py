"""The report of a wan.py results file: table, headline, bytes per token, wire accounting, simulator, plots.

    python -m benchmarks.harness.wan_report benchmarks/results/wan-quick.json --report out.md --plots docs/img/wan-quick

The simulator comparison runs ``opendiloco-stream simulate`` (in-process, same flags as the CLI)
with each run's measured step time, link rate, H, P, payload bits and group size, once with no
latency and once with the per-round latency measured on the blocking runs at that link.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.results import markdown_table, plot_bars, read_result
from benchmarks.harness import wan_time_to_loss as ttl
from benchmarks.harness.wan_records import LABELS, clean, mean, rounds_per_peer

SIM_METHOD = {"data-parallel": "data-parallel", "diloco": "diloco", "streaming": "streaming",
              "streaming-tau1": "streaming-overlap-fp4", "streaming-eager": "eager-fp4"}
CODEC_BITS = {"fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "int8": 8.0, "fp8-e4m3": 8.0, "fp4-e3m0": 4.0, "fp4-e2m1": 4.0}
TINY_LAYERS = 4


def wire_bits(codec: str, block: int = 64) -> float:
    """Bits per value on the wire, the fp16 per-block scale of the <= 8-bit codecs included."""
    if codec.startswith("topk-"):  # the sparse codecs' defaults: 2 % of 1024-value chunks, fp16 scales
        return 16.0 / 1024 + 0.02 * (10 + (2 if codec == "topk-int2" else 4))
    bits = CODEC_BITS[codec]
    return bits + (16.0 / block if bits <= 8 else 0.0)


def runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The benchmark runs proper (not the no-sync baseline): by link, mode, then widest codec first."""
    out = [r for r in records if r["mode"] in LABELS]
    return sorted(out, key=lambda r: (r["link_mbit"], LABELS.index(r["mode"]), -wire_bits(r["codec"])))


def _mb(x: float) -> str:
    return "-" if x != x else f"{x / 1e6:.2f}"


def _pct(x: float) -> str:
    return "-" if x != x else f"{x * 100:.1f}%"


def one_line(rec: dict[str, Any]) -> str:
    """Progress line printed after each run."""
    agree = f"{rec['wire_agreement']:.3f}" if clean(rec) else "n/a"
    return (f"{rec['mode']:<16} {rec['codec']:<9} P={rec['fragments']} {rec['link_mbit']:g} Mbit/s {rec['status']:<7} "
            f"steps {rec['steps_done']}/{rec['steps']}  util {_pct(rec['compute_utilization']):>6}  "
            f"{rec['tokens_per_s']:6.0f} tok/s  sent/peer {_mb(rec['bytes_per_peer'])} MB (iface tx "
            f"{_mb(rec['iface_tx_bytes_per_peer'])}, agreement {agree})  blocked {rec['wait_s']:.1f} s  "
            f"failed {rec['syncs_failed'] + rec['tail_rounds_failed']}  eval {rec['eval_loss']:.3f}"
            + (f"  ({rec['error'][:160]})" if rec.get("error") else ""))


# ---------------------------------------------------------------------------------------- analyses


def control_fit(records: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares ``iface sync payload = a * ours + c * rounds`` (per peer) over the clean runs,
    relative to each run's payload.

    ``a`` checks our payload accounting against the kernel's counters (1.0 = exact); ``c`` is what
    a round costs on the wire besides its payload (matchmaking, DHT lookups, stream set-up, verdicts).
    """
    import numpy as np

    rows = [(r["bytes_all_rounds_per_peer"], rounds_per_peer(r), r["iface_sync_payload_per_peer"])
            for r in runs(records) if clean(r)]
    if len(rows) < 2:
        return {"a": math.nan, "c_bytes_per_round": math.nan, "runs": len(rows)}
    # each row divided by its payload: every run counts the same, not only the largest ones (data-parallel)
    X = np.array([[1.0, n / b] for b, n, _ in rows])
    y = np.array([w / b for b, _, w in rows])
    (a, c), *_ = np.linalg.lstsq(X, y, rcond=None)
    return {"a": float(a), "c_bytes_per_round": float(c), "runs": len(rows)}


def round_latency(records: list[dict[str, Any]], rate: float) -> float:
    """Median time a blocking round takes beyond moving its payload at the measured link rate.

    Per round, the peer that waited least (the last to arrive waits only for the network); the
    first round of each fragment is skipped, as it also absorbs the peers' different start-up times.
    """
    lats = []
    for r in runs(records):
        if r["link_mbit"] != rate or r["mode"] not in ("diloco", "streaming") or not clean(r):
            continue
        link_bps = r["link_measured_mbit"] * 1e6
        if all("round_waits" in p for p in r["per_peer"]):
            waits: dict[tuple[int, int], list[float]] = {}
            for p in r["per_peer"]:
                for frag, k, wait, sent in p["round_waits"]:
                    waits.setdefault((frag, k), []).append(wait - sent * 8 / link_bps)
            lats += [min(v) for (frag, k), v in waits.items() if k > 0]
        else:  # older records: whole-run averages, first rounds included
            n = rounds_per_peer(r)
            lats.append(r["wait_s"] / n - r["bytes_per_peer"] / n * 8 / link_bps)
    if not lats:
        return 0.0
    lats.sort()
    mid = len(lats) // 2
    return max(0.0, lats[mid] if len(lats) % 2 else (lats[mid - 1] + lats[mid]) / 2)


def simulate_argv(r: dict[str, Any], latency_s: float) -> list[str]:
    """``opendiloco-stream simulate`` arguments that model run ``r``."""
    bits = f"{wire_bits(r['codec']):g}"
    params = next((p["params"] for p in r["per_peer"] if p.get("params")), 870_272)
    return ["simulate", "--params", str(params), "--layers", str(TINY_LAYERS), "--step-time", f"{r['step_time_s']:.4f}",
            "--inner-steps", str(r["inner_steps"]), "--fragment-layers", str(TINY_LAYERS // max(1, r["fragments"])),
            "--overlap-steps", str(max(1, r["overlap_steps"])), "--at-mbit", f"{r['link_mbit']:g}",
            "--allreduce-factor", f"{2 * (r['peers'] - 1) / r['peers']:g}", "--bits", bits, "--quant-bits", bits,
            "--latency-ms", f"{latency_s * 1e3:.0f}", "--methods", SIM_METHOD[r["mode"]], "--json"]


def predict(r: dict[str, Any], latency_s: float) -> float:
    from opendiloco_stream.cli import main as cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(simulate_argv(r, latency_s))
    return json.loads(buf.getvalue())[0]["utilization"] if rc == 0 else math.nan


def simulator_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in runs(records):
        if r["status"] == "ok" and r["step_time_s"] == r["step_time_s"]:
            lat = round_latency(records, r["link_mbit"])
            rows.append({"link_mbit": r["link_mbit"], "mode": r["mode"], "codec": r["codec"],
                         "step_time_s": r["step_time_s"], "measured": r["compute_utilization"],
                         "predicted": predict(r, 0.0), "predicted_with_latency": predict(r, lat), "latency_s": lat,
                         "command": "opendiloco-stream " + " ".join(simulate_argv(r, lat))})
    return rows


# ---------------------------------------------------------------------------------------- sections


def table(records: list[dict[str, Any]]) -> str:
    head = ["link", "mode", "codec", "P", "steps", "compute util.", "tokens/s", "MB sent/peer (ours)",
            "MB iface tx/peer", "iface / ours", "peak MB/sync", "blocked s/peer", "failed rounds", "eval loss", "status"]
    rows = [[f"{r['link_mbit']:g} Mbit/s", r["mode"], r["codec"], r["fragments"], f"{r['steps_done']}/{r['steps']}",
             _pct(r["compute_utilization"]), f"{r['tokens_per_s']:.0f}", _mb(r["bytes_per_peer"]),
             _mb(r["iface_tx_bytes_per_peer"]), f"{r['wire_agreement']:.3f}" if clean(r) else "n/a",
             _mb(r["peak_bytes_per_sync"]), f"{r['wait_s']:.1f}", r["syncs_failed"] + r["tail_rounds_failed"],
             f"{r['eval_loss']:.3f}", r["status"]] for r in runs(records)]
    return markdown_table(head, rows)


def headline(records: list[dict[str, Any]]) -> list[str]:
    """Eager fp4 beside every other mode, at each link where DiLoCo blocking fp32 is network-bound (< 80%)."""
    out = []
    bound = sorted({r["link_mbit"] for r in runs(records)
                    if r["mode"] == "diloco" and r["status"] == "ok" and r["compute_utilization"] < 0.8})
    for rate in bound:
        at = [r for r in runs(records) if r["link_mbit"] == rate]
        eager = next((r for r in at if r["mode"] == "streaming-eager" and r["codec"].startswith("fp4")), None)
        if eager is None:
            continue
        verdict = ">= 95%" if eager["compute_utilization"] >= 0.95 else "below 95%"
        out.append(f"At {rate:g} Mbit/s, where DiLoCo blocking fp32 is network-bound, streaming eager {eager['codec']} "
                   f"runs at **{_pct(eager['compute_utilization'])}** compute utilization ({verdict}). All modes there:")
        out += [f"- {r['mode']} {r['codec']}: {_pct(r['compute_utilization'])} (peers "
                f"{' / '.join(_pct(p.get('compute_utilization', math.nan)) for p in r['per_peer'])}; {r['steps_done']} "
                f"steps; blocked {r['wait_s']:.1f} s per peer; peers up to {r.get('max_step_lag', 0):.0f} steps apart)"
                + ("" if r["status"] == "ok" else f" - run {r['status']}") for r in at]
        out.append("")
    return out


def bytes_per_token(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for rate in sorted({r["link_mbit"] for r in runs(records)}):
        at = {(r["mode"], r["codec"]): r for r in runs(records) if r["link_mbit"] == rate and r["status"] == "ok"}
        dp = at.get(("data-parallel", "fp32"))
        if dp is None:
            continue
        for (mode, codec), eager in at.items():
            if mode != "streaming-eager" or codec not in ("fp4-e3m0", "topk-int2", "topk-int4"):
                continue
            expected = eager["inner_steps"] * 32 / wire_bits(codec)
            ours = dp["bytes_per_token"] / eager["bytes_per_token"]
            iface = dp["iface_bytes_per_token"] / eager["iface_bytes_per_token"]
            out.append(f"- {rate:g} Mbit/s: data-parallel fp32 {dp['bytes_per_token']:.0f} B/token, streaming eager "
                       f"{codec} (H = {eager['inner_steps']}) {eager['bytes_per_token']:.3f} B/token (ours, every "
                       f"round launched): **{ours:.0f}x**; interface tx bytes per token: {iface:.0f}x; payload "
                       f"arithmetic H x 32 / {wire_bits(codec):.3g} bits = {expected:.0f}x")
    return out


def accounting(records: list[dict[str, Any]], fit: dict[str, float]) -> list[str]:
    idle = next((r for r in records if r["mode"] == "idle" and "other_traffic_bytes_per_s" in r), None)
    out = [f"- traffic other than syncs (the no-sync run): {idle['other_traffic_bytes_per_s']:.0f} B/s of TCP payload "
           "per peer, subtracted per second of each run" if idle else "- no no-sync run: nothing subtracted",
           f"- fit over the {fit['runs']} runs whose every round succeeded: interface sync payload = "
           f"**{fit['a']:.4f} x ours + {fit['c_bytes_per_round'] / 1e3:.1f} kB per round**", ""]
    rows = []
    for r in runs(records):
        if clean(r):
            n = rounds_per_peer(r)
            corrected = (r["iface_sync_payload_per_peer"] - fit["c_bytes_per_round"] * n) / r["bytes_all_rounds_per_peer"]
            rows.append([f"{r['link_mbit']:g}", r["mode"], r["codec"], _mb(r["bytes_all_rounds_per_peer"]),
                         _mb(r["iface_sync_payload_per_peer"]), f"{r['wire_agreement']:.3f}", f"{n:g}",
                         f"{corrected:.3f}"])
    head = ["Mbit/s", "mode", "codec", "ours MB (all rounds)", "iface sync payload MB", "iface / ours", "rounds/peer",
            "(iface - c x rounds) / ours"]
    return out + [markdown_table(head, rows)]


def simulator(sims: list[dict[str, Any]]) -> list[str]:
    head = ["Mbit/s", "mode", "codec", "step s", "measured", "simulate, latency 0", "simulate, measured latency"]
    rows = [[f"{s['link_mbit']:g}", s["mode"], s["codec"], f"{s['step_time_s']:.3f}", _pct(s["measured"]),
             _pct(s["predicted"]), f"{_pct(s['predicted_with_latency'])} ({s['latency_s']:.2f} s)"] for s in sims]
    out = [markdown_table(head, rows)]
    if sims:
        out += ["", f"e.g. `{sims[0]['command']}`"]
    return out


def finish(records: list[dict[str, Any]], report: Optional[str], plots: Optional[str]) -> str:
    """Print (and write to ``report``) the markdown report; draw PNGs under the ``plots`` prefix."""
    fit = control_fit(records)
    env = next((r.get("environment") for r in records if r.get("environment")), {})
    parts = [f"Command: `{env.get('command', '?')}` (commit {env.get('git_commit')}, {env.get('cpu_count')} CPUs, "
             f"{env.get('date_utc')})", "", "### Runs", "", table(records), "", "### Headline", "", *headline(records),
             *(["### Time to loss", "", *ttl.section(records)] if ttl.rows(records) else []),
             "### Bytes per token", "", *bytes_per_token(records), "",
             "### Interface counters vs our accounting", "", *accounting(records, fit), "",
             "### Simulator vs measured", "", *simulator(simulator_rows(records))]
    text = "\n".join(parts) + "\n"
    print(text)
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(text)
    if plots:
        draw(records, plots)
        if ttl.rows(records):
            ttl.draw(records, f"{plots}-time-to-loss.png")
    return text


def draw(records: list[dict[str, Any]], prefix: str) -> None:
    """``<prefix>-utilization.png`` (fp32 for every mode | each streaming mode at fp4) and
    ``<prefix>-bytes-per-token.png`` (every run at the slowest link)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs(records) if r["status"] == "ok"]
    if not ok:
        return
    rate = min(r["link_mbit"] for r in ok)
    at = [r for r in ok if r["link_mbit"] == rate]
    plot_bars(f"{prefix}-bytes-per-token.png", [f"{r['mode']} {r['codec']}" for r in at],
              [r["bytes_per_token"] for r in at],
              title=f"Bytes sent per peer per token (ours, every round) at {rate:g} Mbit/s",
              ylabel="bytes / token (log scale)", log=True, note="benchmarks/wan.py")
    if len({r["link_mbit"] for r in ok}) == 1:  # one link: bars, not lines
        plot_bars(f"{prefix}-utilization.png", [f"{r['mode']} {r['codec']}" for r in at],
                  [r["compute_utilization"] * 100 for r in at], annotate="{:.1f}%", reference=("95%", 95.0),
                  title=f"Measured compute utilization at {rate:g} Mbit/s, {at[0]['peers']} peers",
                  ylabel="compute utilization (%)", note="benchmarks/wan.py; data-parallel runs fewer steps")
        return
    panels = [("fp32, every mode", [(m, "fp32") for m in LABELS]),
              ("fp4-e3m0 streaming (eager fp32 for reference)",
               [(m, "fp4-e3m0") for m in LABELS[2:]] + [("streaming-eager", "fp32")])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), dpi=120, sharey=True)
    for ax, (title, lines) in zip(axes, panels):
        for mode, codec in lines:
            pts = sorted((r["link_mbit"], r["compute_utilization"] * 100) for r in ok
                         if r["mode"] == mode and r["codec"] == codec)
            if pts:
                style = "--" if (mode, codec) == ("streaming-eager", "fp32") and "fp4" in title else "-"
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=f"{mode} {codec}")
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["link_mbit"] for r in ok}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("link rate per peer, each way (Mbit/s, tc tbf)")
        ax.legend(fontsize=7, loc="best")
    axes[0].set_ylabel("compute utilization (%)")
    fig.suptitle(f"Measured compute utilization, {ok[0]['peers']} peers in network namespaces", fontsize=11)
    fig.text(0.01, 0.01, "benchmarks/wan.py; data-parallel runs fewer steps (see the table)", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(f"{prefix}-utilization.png")
    plt.close(fig)


def _nan(x: Any, key: str = "") -> Any:
    """null -> NaN for the numbers wan.py wrote as null (strict JSON has no NaN)."""
    if x is None and key != "error":
        return math.nan
    if isinstance(x, dict):
        return {k: _nan(v, k) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan(v, key) for v in x]
    return x


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Report of a wan.py results file")
    p.add_argument("results", help="JSON written by benchmarks.wan --out (its rows: one record per run)")
    p.add_argument("--report", help="write the markdown here")
    p.add_argument("--plots", help="PNG path prefix, e.g. docs/img/wan-quick")
    args = p.parse_args(argv)
    finish(_nan(read_result(args.results)["rows"]), args.report, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
