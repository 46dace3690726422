"""The Prometheus endpoint (``net/prometheus.py``, on ``prometheus_client``): records become typed,
labelled series; a live peer's scrape passes Prometheus's own ``promtool check metrics``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from opendiloco_stream.net.prometheus import PeerMetrics, PrometheusExporter, samples
from tests.support.ports import free_port
from tests.support.tools import require_tool


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        return r.read().decode()


def promtool_check(text: str) -> subprocess.CompletedProcess:
    """``promtool check metrics`` (Prometheus's linter of the exposition format) on a scrape."""
    promtool = require_tool("promtool")
    return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


RECORDS = [
    {"event": "step", "step": 1, "loss": 5.5, "tokens": 256, "compute_s": 0.1, "sync_s": 0.0},
    {"event": "step", "step": 2, "loss": 5.25, "tokens": 256, "compute_s": 0.1, "sync_s": 0.0},
    {"event": "sync", "fragment": 0, "round": 0, "ok": True, "wait_s": 0.25, "group_size": 3,
     "bytes_sent": 1000, "bytes_received": 2000, "land_steps": 2},
    {"event": "sync", "fragment": 1, "round": 0, "ok": False, "wait_s": 1.5, "group_size": 0, "reason": "timeout"},
    {"event": "eval", "step": 2, "eval_loss": 4.75},
]


def test_records_become_typed_series_labelled_by_peer_and_fragment():
    metrics = PeerMetrics({"run": "demo"}, info={"mode": "eager", "codec": "fp4-e3m0"})
    metrics.relabel(peer='Qm"x')
    for rec in RECORDS:
        metrics.observe(rec)
    text = metrics.exposition()
    got = samples(text)
    lab = (("peer", 'Qm"x'), ("run", "demo"))

    def frag(p, **extra):
        return tuple(sorted(lab + (("fragment", str(p)),) + tuple(extra.items())))

    assert got[("ods_step", lab)] == 2
    assert got[("ods_loss", lab)] == 5.25 and got[("ods_eval_loss", lab)] == 4.75
    assert got[("ods_tokens_total", lab)] == 512
    assert got[("ods_bytes_sent_total", frag(0))] == 1000 and got[("ods_bytes_received_total", frag(0))] == 2000
    assert got[("ods_rounds_total", frag(0, result="ok"))] == 1
    assert got[("ods_rounds_total", frag(1, result="failed"))] == 1
    assert got[("ods_group_size", frag(0))] == 3 and ("ods_group_size", frag(1)) not in got  # failed: no group
    assert got[("ods_sync_wait_seconds_total", frag(1))] == 1.5 and got[("ods_last_sync_wait_seconds", frag(0))] == 0.25
    assert got[("ods_round_land_steps", frag(0))] == 2 and ("ods_round_land_steps", frag(1)) not in got
    assert 0 < got[("ods_compute_utilization", lab)] <= 1 and got[("ods_tokens_per_second", lab)] > 0
    assert "# TYPE ods_tokens_total counter" in text and "# TYPE ods_loss gauge" in text
    assert "# HELP ods_round_land_steps " in text
    info = [k for k in got if k[0] == "ods_info"]
    assert len(info) == 1 and dict(info[0][1])["codec"] == "fp4-e3m0" and dict(info[0][1])["peer"] == 'Qm"x'
    assert not [k for k in got if dict(k[1]).get("peer") == ""]  # relabel replaced the series, none left behind
    with pytest.raises(ValueError):  # counters only go up: the library refuses a decrease
        metrics.tokens.labels(**metrics.labels).inc(-1)
    check = promtool_check(text)
    assert check.returncode == 0, check.stdout + check.stderr


def test_exporter_serves_metrics_and_refuses_a_taken_port():
    with PrometheusExporter(0, host="127.0.0.1", labels={"run": "t"}) as exp:
        exp.observe(RECORDS[0])
        got = samples(_get(exp.url))
        lab = (("peer", ""), ("run", "t"))
        assert got[("ods_step", lab)] == 1
        assert math.isnan(got[("ods_eval_loss", lab)])  # no eval yet: NaN, not 0
        with pytest.raises(OSError):
            PrometheusExporter(exp.port, host="127.0.0.1")


@pytest.mark.network
def test_scrape_the_endpoint_of_running_peers(tmp_path):
    """Two real peers on 127.0.0.1 train; their endpoints are scraped while they run."""
    from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes

    boot, addrs = start_bootstrap(tmp_path, "promtest")
    procs, ports = [boot], [free_port(), free_port()]
    try:
        for r, port in enumerate(ports):
            cmd = [sys.executable, "-m", "opendiloco_stream", "peer", "--initial-peers", *addrs, "--run-id", "promtest",
                   "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--no-progress",
                   "--mode", "blocking", "--codec", "fp32", "--fragments", "2", "--inner-steps", "6", "--steps", "400",
                   "--shard", f"{r}/2", "--no-join", "--metrics-port", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=open(tmp_path / f"p{r}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ}))
        url = f"http://127.0.0.1:{ports[0]}/metrics"
        deadline, found = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            for p in procs[1:]:
                assert p.poll() is None, (tmp_path / "p0.log").read_text()[-2000:]
            try:
                text = _get(url)
                scrape = {}
                for (name, labels), v in samples(text).items():  # summed over the fragments
                    key = name if name != "ods_rounds_total" else f"rounds_{dict(labels)['result']}"
                    merge = max if key == "ods_group_size" else lambda a, b: a + b
                    scrape[key] = merge(scrape.get(key, 0), v)
                found = scrape
            except (urllib.error.URLError, ConnectionError):
                found = {}  # not up yet (the peer builds its model, then joins the DHT)
            if found.get("rounds_ok", 0) >= 2 and found.get("ods_group_size") == 2:
                break
            time.sleep(1.0)
        assert found.get("rounds_ok", 0) >= 2, found
        assert found["ods_group_size"] == 2
        # the second round is at step 6; a scrape may land between its sync record and its step record.
        # tokens: 2 x 32 a trained step; a step skipped to catch up with the other peer (under load) has none
        assert found["ods_step"] >= 5 and found["ods_tokens_total"] % (2 * 32) == 0
        assert 0 < found["ods_tokens_total"] <= found["ods_step"] * 2 * 32
        assert found["ods_bytes_sent_total"] > 0 and found["ods_bytes_received_total"] > 0
        assert 0 < found["ods_compute_utilization"] <= 1 and found["ods_tokens_per_second"] > 0
        assert math.isfinite(found["ods_loss"]) and found["ods_sync_wait_seconds_total"] >= 0
        other = samples(_get(f"http://127.0.0.1:{ports[1]}/metrics"))
        peers = {dict(k[1]).get("peer") for k in other} | {dict(k[1]).get("peer") for k in samples(_get(url))}
        assert len(peers) == 2 and "" not in peers  # each endpoint is labelled with its own peer id
        check = promtool_check(text)  # Prometheus's own linter passes the live scrape
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        stop_processes(procs, grace=10)


ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
EXPORTED = {"ods_step", "ods_loss", "ods_eval_loss", "ods_tokens_total", "ods_tokens_per_second",
            "ods_compute_utilization", "ods_bytes_sent_total", "ods_bytes_received_total", "ods_rounds_total",
            "ods_group_size", "ods_sync_wait_seconds_total", "ods_last_sync_wait_seconds", "ods_round_land_steps",
            "ods_info"}


def _exported_names() -> set[str]:
    """The metric names a peer's endpoint serves, read from a real exposition."""
    m = PeerMetrics({"run": "r", "peer": "p"}, info={"mode": "eager"})
    for rec in RECORDS:
        m.observe(rec)
    return {name for name, _ in samples(m.exposition()) if not name.endswith("_created")}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(ods_[a-z_]+)\b", expr))


def test_the_shipped_prometheus_config_and_alert_rules_pass_promtool():
    promtool = require_tool("promtool")
    config = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True,
                            text=True, timeout=60)
    assert config.returncode == 0 and "SUCCESS: 1 rule files found" in config.stdout, config.stdout + config.stderr
    rules = subprocess.run([promtool, "check", "rules", str(DOCKER / "alerts.yml")], capture_output=True, text=True,
                           timeout=60)
    assert rules.returncode == 0 and "SUCCESS: 5 rules found" in rules.stdout, rules.stdout + rules.stderr


def test_each_alert_fires_on_its_series_and_not_on_a_healthy_peer():
    """promtool's rule unit tests (tests/data/alerts_test.yml): alone for 3+ rounds, failed rounds,
    eager landing near H, low compute utilization, a peer that stops answering."""
    promtool = require_tool("promtool")
    proc = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT / "tests" / "data")
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_alerts_and_dashboard_query_only_metrics_the_peers_export():
    exported = _exported_names()
    assert exported == EXPORTED
    rules = yaml.safe_load((DOCKER / "alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"PeerTrainsAlone", "RoundsFailing", "EagerLandingNearH",
                                          "ComputeUtilizationLow", "PeerDown"}
    for rule in rules:
        assert _metric_names(rule["expr"]) <= exported, rule["alert"]
    board = json.loads((DOCKER / "grafana" / "opendiloco-stream.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and all(_metric_names(e) and _metric_names(e) <= exported for e in exprs), exprs


def test_the_dashboard_json_is_what_grafanas_sdk_builds():
    """docker/grafana/opendiloco-stream.json is generated by scripts/gen_dashboard.py with Grafana's
    Python SDK (grafana-foundation-sdk) and is up to date."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    board = json.loads((DOCKER / "grafana" / "opendiloco-stream.json").read_text())
    assert board["uid"] == "opendiloco-stream"
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "run", "peer"]


@pytest.mark.network
def test_prometheus_scrapes_a_live_peer_with_the_shipped_config(tmp_path):
    """A real Prometheus server, started with docker/prometheus.yml and docker/alerts.yml (only the
    targets changed to this peer's port), scrapes a training peer: its series are queryable and the
    five alert rules are loaded."""
    from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes

    prometheus = require_tool("prometheus")
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    metrics_port, web_port = free_port(), free_port()
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    config["global"]["scrape_interval"] = "1s"
    config["rule_files"] = [str(DOCKER / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    boot, addrs = start_bootstrap(tmp_path, "promlive")
    procs = [boot]
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "opendiloco_stream", "peer", "--initial-peers", *addrs, "--run-id", "promlive",
             "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--no-progress",
             "--inner-steps", "6", "--steps", "100000", "--shard", "0/1", "--no-join", "--metrics-port",
             str(metrics_port)], stdout=open(tmp_path / "peer.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True))
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web_port}"], stdout=open(tmp_path / "prometheus.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True))
        api = f"http://127.0.0.1:{web_port}/api/v1"
        deadline, steps = time.monotonic() + 240, []
        while time.monotonic() < deadline and not steps:
            assert procs[1].poll() is None, (tmp_path / "peer.log").read_text()[-2000:]
            assert procs[2].poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{api}/query?query=ods_step%7Brun%3D%22promlive%22%7D", timeout=5) as r:
                    steps = [s for s in json.load(r)["data"]["result"] if float(s["value"][1]) >= 1]
            except (urllib.error.URLError, ConnectionError):
                pass
            if not steps:
                time.sleep(1.0)
        assert steps, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert steps[0]["metric"]["job"] == "opendiloco-stream" and steps[0]["metric"]["peer"]
        with urllib.request.urlopen(f"{api}/rules", timeout=5) as r:
            loaded = [rule["name"] for g in json.load(r)["data"]["groups"] for rule in g["rules"]]
        assert sorted(loaded) == sorted(["PeerTrainsAlone", "RoundsFailing", "EagerLandingNearH",
                                         "ComputeUtilizationLow", "PeerDown"])
    finally:
        stop_processes(procs, grace=10)
