"""Time to loss over real links: how long each run takes to reach blocking streaming's final eval loss.

Each peer's metrics hold ``eval`` records with ``wall_s``: its training time so far, evaluations
excluded (the last one includes landing the rounds still in flight at the end). A run's curve is,
at each step every peer evaluated, the mean eval loss over its peers and the latest peer's
``wall_s`` (the swarm has a loss when its slowest peer has it). At each link rate the target is the
last point of the reference run (streaming, blocking, fp32) at the same rate and place (RTT); a run reaches it at its first crossing,
interpolated linearly between the two evaluations around it. A run that never gets there within its
steps says so, with the best loss it had and when.

Evaluations are taken out of the time because a peer cannot train while it evaluates, and the
modes compared here do not gain from the pause: blocking modes wait at the launch step itself,
before any evaluation, and eager's rounds land before they are needed (its wait is ~0 on these
links; the run table's "blocked" column shows it). Overlap with tau >= 1 would gain (its wait comes
steps after the launch), which is why it is not in this comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.results import markdown_table
from benchmarks.harness.wan_records import LABELS, mean

REFERENCE = ("streaming", "fp32")


def curve(metrics: list[list[dict[str, Any]]]) -> list[list[float]]:
    """``[step, wall_s, eval_loss]`` of a run from its peers' metrics records (steps all peers evaluated)."""
    per_peer = []
    for recs in metrics:
        points = {x["step"]: (x["wall_s"], x["eval_loss"]) for x in recs
                  if x.get("event") == "eval" and "wall_s" in x and x.get("stage") is None}
        per_peer.append(points)
    if not per_peer:
        return []
    steps = sorted(set.intersection(*(set(p) for p in per_peer)))
    return [[s, round(max(p[s][0] for p in per_peer), 3), round(mean([p[s][1] for p in per_peer]), 5)] for s in steps]


def reach_time(points: list[list[float]], target: float) -> Optional[float]:
    """Wall seconds at which the curve first reaches ``target`` (linear between evaluations), or None."""
    for i, (_, t1, l1) in enumerate(points):
        if l1 <= target:
            if i == 0:
                return t1
            _, t0, l0 = points[i - 1]
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def link(r: dict[str, Any]) -> tuple[float, str]:
    """What a run's target depends on: its link rate and where its peers are (``place``: RTT, regions)."""
    return r["link_mbit"], r.get("place", "")


def _runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [r for r in records if r["mode"] in LABELS and len(r.get("eval_curve") or []) >= 2]
    return sorted(out, key=lambda r: (*link(r), LABELS.index(r["mode"]), r["codec"]))


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run with a curve: its target (the reference's final loss at its link) and time to it."""
    runs, out = _runs(records), []
    refs = {link(x): x for x in runs if (x["mode"], x["codec"]) == REFERENCE and x["status"] == "ok"}
    for r in runs:
        ref = refs.get(link(r))
        if ref is None:
            continue
        target = ref["eval_curve"][-1][2]
        t = reach_time(r["eval_curve"], target)
        t_ref = reach_time(ref["eval_curve"], target)
        best = min(r["eval_curve"], key=lambda p: p[2])
        out.append({"link_mbit": r["link_mbit"], "place": r.get("place", ""), "mode": r["mode"], "codec": r["codec"],
                    "status": r["status"],
                    "steps": r["eval_curve"][-1][0], "target": target, "time_s": t,
                    "vs_reference": t / t_ref if t is not None and t_ref else None,
                    "final_loss": r["eval_curve"][-1][2], "final_wall_s": r["eval_curve"][-1][1],
                    "best_loss": best[2], "best_wall_s": best[1]})
    return out


def section(records: list[dict[str, Any]]) -> list[str]:
    """The markdown section (empty without eval curves: runs made before ``--eval-every``)."""
    table = rows(records)
    if not table:
        return []
    head = ["link", "mode", "codec", "steps", "target (streaming fp32's final eval loss)", "time to target",
            "x streaming", "final eval loss (at s)"]
    body = [[f"{x['link_mbit']:g} Mbit/s", x["mode"], x["codec"], x["steps"], f"{x['target']:.3f}",
             f"**{x['time_s']:.1f} s**" if x["time_s"] is not None else
             f"not reached (best {x['best_loss']:.3f} at {x['best_wall_s']:.0f} s)",
             f"{x['vs_reference']:.2f}" if x["vs_reference"] is not None else "-",
             f"{x['final_loss']:.3f} ({x['final_wall_s']:.0f} s)"
             + ("" if x["status"] == "ok" else f", run {x['status']}")] for x in table]
    return ["Training time (evaluations excluded, the slowest peer's) until the run's mean eval loss first reaches "
            "streaming fp32's final eval loss at the same link (linear between evaluations; "
            "benchmarks/harness/wan_time_to_loss.py).", "", markdown_table(head, body), ""]


def draw(records: list[dict[str, Any]], path: str) -> None:
    """Eval loss against training time, one panel per link rate, the target as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _runs(records)
    rates = sorted({r["link_mbit"] for r in runs})
    if not rates:
        return
    fig, axes = plt.subplots(1, len(rates), figsize=(4.6 * len(rates), 4.0), dpi=120, sharey=True, squeeze=False)
    targets = {x["link_mbit"]: x["target"] for x in rows(records)}
    for ax, rate in zip(axes[0], rates):
        for r in (r for r in runs if r["link_mbit"] == rate):
            pts = r["eval_curve"][1:]  # step 0 is the same initial model for every run
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=f"{r['mode']} {r['codec']}")
        if rate in targets:
            ax.axhline(targets[rate], linestyle="--", color="0.4", linewidth=0.8)
        ax.set_title(f"{rate:g} Mbit/s", fontsize=10)
        ax.set_xlabel("training time, evaluations excluded (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("eval loss (mean over peers)")
    fig.suptitle("Eval loss against wall time per link (dashed: streaming fp32's final eval loss)", fontsize=11)
    fig.text(0.01, 0.01, "benchmarks/wan.py --time-to-loss", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
