"""``monitor --html``: the page's curves and numbers come from the records, and it works offline.

The rendering itself (headless Chromium screenshot) is checked by ``benchmarks/monitor_page.py``,
which writes docs/img/monitor_page.png; CI does not install Chromium.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from opendiloco_stream.cli import main
from opendiloco_stream.commands.monitor_page import History, load_history, render_page, svg_chart, write_page


def _record(name, t, step, loss, util, tps=1000.0):
    return {"name": name, "peer_id": "Qm" + name, "time": t, "step": step, "loss": loss,
            "compute_utilization": util, "tokens_per_s": tps}


def _polylines(page: str) -> dict[str, list[list[tuple[float, float]]]]:
    """peer -> the point lists of its polylines, in chart order (loss, utilization)."""
    out: dict[str, list] = {}
    for points, peer in re.findall(r'<polyline points="([^"]+)"[^>]*data-peer="([^"]+)"', page):
        out.setdefault(peer, []).append([tuple(map(float, p.split(","))) for p in points.split()])
    return out


def test_page_draws_one_loss_and_one_utilization_curve_per_peer_from_the_dht_records():
    h = History("demo")
    for i in range(10):
        h.add_records([_record("peerA", 1000.0 + 2 * i, 10 * i, 5.0 - 0.2 * i, 0.9),
                       _record("peerB", 1001.0 + 2 * i, 10 * i, 5.5 - 0.25 * i, 0.5 + 0.04 * i)])
    assert h.add_records([_record("peerA", 1018.0, 90, 3.2, 0.9)]) == 0  # the same record again: no point
    page = render_page(h, now=2000.0)
    lines = _polylines(page)
    assert set(lines) == {"peerA", "peerB"} and all(len(v) == 2 and len(v[0]) == 10 for v in lines.values())
    # SVG y grows downwards: falling loss -> rising y; peerB's utilization climbs -> falling y
    loss_a, util_a = lines["peerA"]
    loss_b, util_b = lines["peerB"]
    assert all(b[1] > a[1] for a, b in zip(loss_a, loss_a[1:]))
    assert all(b[1] < a[1] for a, b in zip(util_b, util_b[1:]))
    assert len({y for _, y in util_a}) == 1  # constant 90%
    # the utilization axis is 0..100 %: 90 % sits at 10 % of the plot height from the top
    top, height = 34, 300 - 34 - 46
    assert abs(util_a[0][1] - (top + 0.1 * height)) < 0.2
    # x is time: peerB's points start 1 s after peerA's (t0 = the first record)
    assert loss_b[0][0] > loss_a[0][0]
    # the table holds each peer's latest numbers
    assert "<td>peerA</td><td>90</td><td>3.2000</td><td>90.0%</td>" in page
    assert "<td>peerB</td><td>90</td><td>3.2500</td><td>86.0%</td>" in page
    # self-contained: no external resource, no script to run
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script src" not in page
    data = json.loads(re.search(r'id="ods-history">(.*?)</script>', page, re.S).group(1))
    assert data["series"]["peerB"][-1]["loss"] == 3.25


def test_a_restarted_monitor_continues_the_curves_of_the_same_run(tmp_path):
    page = tmp_path / "swarm.html"
    h = History("demo")
    h.add_records([_record("peerA", 10.0, 5, 4.0, 0.8)])
    write_page(page, h, refresh_s=5)
    assert '<meta http-equiv="refresh" content="5">' in page.read_text()
    again = load_history(page, "demo")
    again.add_records([_record("peerA", 12.0, 6, 3.9, 0.8)])
    assert [p["step"] for p in again.series["peerA"]] == [5, 6]
    assert load_history(page, "other-run").series == {}  # another run starts fresh


def test_empty_and_missing_values_render_without_errors():
    assert "no data yet" in svg_chart({}, "loss", "loss")
    h = History("demo")
    h.add_records([_record("p", 1.0, 0, float("nan"), None)])  # no loss yet, no utilization yet
    page = render_page(h, now=0)
    assert "<td>p</td><td>0</td><td>-</td><td>-</td>" in page


def test_monitor_html_from_metrics_files(tmp_path, capsys):
    """The CLI path: ``monitor --html F --from-metrics`` over two peers' JSON-lines files (the page
    from ``main`` in this process; the bad file from a real process, whose whole stderr is one line)."""
    for name, base in (("us-east", 5.0), ("eu-west", 5.3)):
        recs = [{"event": "config"}] + [
            {"event": "step", "rank": 0, "step": s, "loss": base - 0.1 * s, "tokens": 256, "compute_s": 0.5,
             "sync_s": 0.5 if s % 5 == 0 else 0.0} for s in range(1, 21)] + [{"event": "summary"}]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "page.html"
    code = main(["monitor", "--run-id", "demo", "--html", str(out),
                 "--from-metrics", str(tmp_path / "us-east.jsonl"), str(tmp_path / "eu-west.jsonl")])
    assert code == 0, capsys.readouterr().err
    page = out.read_text()
    lines = _polylines(page)
    assert set(lines) == {"us-east", "eu-west"} and len(lines["us-east"][0]) == 20
    data = json.loads(re.search(r'id="ods-history">(.*?)</script>', page, re.S).group(1))
    east = data["series"]["us-east"]
    assert east[-1]["t"] == 20 * 0.5 + 4 * 0.5  # training time: compute + sync of every step
    assert abs(east[4]["util"] - 2.5 / 3.0) < 1e-9  # steps 1..5: 2.5 s compute of 3.0 s
    bad = subprocess.run([sys.executable, "-m", "opendiloco_stream", "monitor", "--html", str(out),
                          "--from-metrics", str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr
