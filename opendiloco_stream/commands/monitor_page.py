"""``monitor --html F``: a self-contained page of the swarm's loss and utilization curves over time.

The page is one HTML file with inline SVG (no script, no CDN, no network: it opens offline and
in a mail attachment). ``monitor`` rewrites it atomically at every refresh, and the page reloads
itself every ``refresh_s`` seconds while the monitor runs. The data the curves are drawn from is
embedded as JSON (``<script type="application/json" id="ods-history">``), so a restarted monitor
continues the same curves and scripts can read the numbers back (``load_history``).

Sources of points: the peers' metrics records on the DHT (what ``monitor`` reads; one point per
peer per refresh, at the record's DHT time) or, after a run, the peers' ``--metrics-file`` JSON
lines (``History.add_metrics_file``: the time axis is the training time the records account for).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Optional

#: Colour-blind-safe palette (Okabe-Ito), cycled over peers.
COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
MAX_POINTS = 2000  # per peer and curve; older points are thinned to keep the page small

Point = dict[str, float]  # {"t": seconds, "step": ..., "loss": ..., "util": ..., "tps": ...}


class History:
    """Per-peer time series of step, loss, compute utilization and tokens/s."""

    def __init__(self, run_id: str, series: Optional[dict[str, list[Point]]] = None, t0: Optional[float] = None):
        self.run_id = run_id
        self.series: dict[str, list[Point]] = {k: list(v) for k, v in (series or {}).items()}
        self.t0 = t0  # time origin of the x axis (the first point seen)

    def add_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Add DHT metrics records (``read_swarm_metrics``); a record already seen is skipped."""
        added = 0
        for r in records:
            name, t = str(r.get("name") or r.get("peer_id", "?")[-8:]), float(r["time"])
            points = self.series.setdefault(name, [])
            if points and points[-1]["t"] >= t:
                continue  # the same record (re-stored to keep it alive) or an older one
            points.append({"t": t, "step": int(r.get("step") or 0), "loss": _num(r.get("loss")),
                           "util": _num(r.get("compute_utilization")), "tps": _num(r.get("tokens_per_s"))})
            self.t0 = t if self.t0 is None else min(self.t0, t)
            added += 1
            _thin(points)
        return added

    def add_metrics_file(self, path: "str | Path", name: Optional[str] = None, window: int = 20) -> None:
        """Add the step records of a ``--metrics-file`` (one curve per rank in it).

        Time is the training time accounted by the records (compute + sync of each step);
        utilization is compute / (compute + sync) over the last ``window`` steps.
        """
        from opendiloco_stream.train.loop import read_metrics  # lazy: loads torch; --help stays light

        steps = [r for r in read_metrics(path) if r.get("event") == "step"]
        ranks = {int(r.get("rank", 0)) for r in steps}
        label = name or Path(path).stem
        clock: dict[int, float] = {}
        recent: dict[int, list[tuple[float, float]]] = {}
        tokens: dict[int, int] = {}
        for rec in steps:
            rank = int(rec.get("rank", 0))
            compute, sync = float(rec.get("compute_s", 0.0)), float(rec.get("sync_s", 0.0))
            clock[rank] = clock.get(rank, 0.0) + compute + sync
            tokens[rank] = tokens.get(rank, 0) + int(rec.get("tokens", 0))
            win = recent.setdefault(rank, [])
            win.append((compute, sync))
            del win[:-window]
            busy, total = sum(c for c, _ in win), sum(c + s for c, s in win)
            points = self.series.setdefault(label if len(ranks) == 1 else f"{label}/rank{rank}", [])
            points.append({"t": clock[rank], "step": int(rec["step"]), "loss": float(rec["loss"]),
                           "util": busy / total if total > 0 else None, "tps": tokens[rank] / max(clock[rank], 1e-9)})
            _thin(points)
        self.t0 = 0.0 if self.t0 is None else min(self.t0, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "t0": self.t0, "series": self.series}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "History":
        return cls(data["run_id"], data.get("series"), data.get("t0"))


def _num(value: Any) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _thin(points: list[Point]) -> None:
    if len(points) > MAX_POINTS:  # drop every other point of the older half
        half = len(points) // 2
        points[:half] = points[:half:2]


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step) + 1)]


def _fmt_tick(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.2g}"


def svg_chart(series: dict[str, list[tuple[float, float]]], title: str, y_label: str, x_label: str = "time (s)",
              y_range: Optional[tuple[float, float]] = None, y_format=_fmt_tick, width: int = 880,
              height: int = 300) -> str:
    """One line chart as an inline ``<svg>``: a polyline per series, axes with ticks, a legend."""
    left, right, top, bottom = 64, 150, 34, 46
    pw, ph = width - left - right, height - top - bottom
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}" class="chart">',
           f'<text x="{left}" y="20" class="title">{html.escape(title)}</text>']
    if not xs:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="empty">no data yet</text>')
        return "\n".join(out + ["</svg>"])
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x1 = x0 + 1.0
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if not y_range:
        pad = (y1 - y0) * 0.05 or abs(y0) * 0.05 or 0.5
        y0, y1 = y0 - pad, y1 + pad
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: top + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>')
    for v in _nice_ticks(y0, y1):
        if y0 <= v <= y1:
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" class="grid"/>'
                       f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end" class="tick">{y_format(v)}</text>')
    for v in _nice_ticks(x0, x1, 8):
        if x0 <= v <= x1:
            out.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{top}" y2="{top + ph}" class="grid"/>'
                       f'<text x="{sx(v):.1f}" y="{top + ph + 16}" text-anchor="middle" class="tick">{_fmt_tick(v)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" class="axis">{html.escape(x_label)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" text-anchor="middle" class="axis" '
               f'transform="rotate(-90 14 {top + ph / 2})">{html.escape(y_label)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        if pts:
            coords = " ".join(f"{sx(x):.1f},{sy(min(max(y, y0), y1)):.1f}" for x, y in pts)
            out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2" '
                       f'data-peer="{html.escape(name)}"/>')
            if len(pts) == 1:
                out.append(f'<circle cx="{sx(pts[0][0]):.1f}" cy="{sy(pts[0][1]):.1f}" r="3" fill="{color}"/>')
        ly = top + 14 + 18 * i
        out.append(f'<line x1="{left + pw + 12}" x2="{left + pw + 32}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="3"/><text x="{left + pw + 38}" y="{ly}" class="legend">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #666; margin-bottom: 16px; }
.chart { display: block; margin: 8px 0 20px; }
.chart .title { font-size: 15px; font-weight: 600; } .chart .plot { fill: #fafafa; stroke: #bbb; }
.chart .grid { stroke: #e4e4e4; } .chart .tick, .chart .legend { font-size: 12px; fill: #444; }
.chart .axis { font-size: 12px; fill: #222; } .chart .empty { fill: #999; }
table { border-collapse: collapse; } td, th { padding: 4px 12px; text-align: right; border-bottom: 1px solid #ddd; }
td:first-child, th:first-child { text-align: left; }
"""


def render_page(history: History, now: Optional[float] = None, refresh_s: Optional[float] = None) -> str:
    """The whole HTML page of ``history`` (see module doc)."""
    now = time.time() if now is None else now
    t0 = history.t0 or 0.0
    loss = {n: [(p["t"] - t0, p["loss"]) for p in pts if p.get("loss") is not None] for n, pts in history.series.items()}
    util = {n: [(p["t"] - t0, 100 * p["util"]) for p in pts if p.get("util") is not None]
            for n, pts in history.series.items()}
    rows = []
    for name, pts in history.series.items():
        last = pts[-1] if pts else {}
        cells = [name, str(last.get("step", "-")),
                 "-" if last.get("loss") is None else f"{last['loss']:.4f}",
                 "-" if last.get("util") is None else f"{100 * last['util']:.1f}%",
                 "-" if last.get("tps") is None else f"{last['tps']:,.0f}", str(len(pts))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in ("peer", "step", "loss", "utilization", "tokens/s", "points"))
    refresh = f'<meta http-equiv="refresh" content="{refresh_s:g}">' if refresh_s else ""
    data = json.dumps(history.to_json()).replace("</", "<\\/")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    run = html.escape(history.run_id)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{refresh}
<title>opendiloco-stream: run '{run}'</title><style>{_STYLE}</style></head>
<body>
<h1>run '{run}'</h1>
<div class="sub">{len(history.series)} peer(s); updated {stamp}</div>
{svg_chart(loss, "training loss", "loss")}
{svg_chart(util, "compute utilization", "utilization (%)", y_range=(0.0, 100.0))}
<table><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>
<script type="application/json" id="ods-history">{data}</script>
</body></html>
"""


def write_page(path: "str | Path", history: History, refresh_s: Optional[float] = None) -> None:
    """Write the page atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(render_page(history, refresh_s=refresh_s))
    os.replace(tmp, path)


def load_history(path: "str | Path", run_id: str) -> History:
    """The history embedded in an existing page of the same run, else an empty one."""
    path = Path(path)
    if path.is_file():
        m = re.search(r'<script type="application/json" id="ods-history">(.*?)</script>', path.read_text(), re.S)
        if m:
            try:
                data = json.loads(m.group(1).replace("<\\/", "</"))
                if data.get("run_id") == run_id:
                    return History.from_json(data)
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
    return History(run_id)
