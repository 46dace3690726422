"""The Prometheus endpoint (``peer --metrics-port``) and the optional TensorBoard / W&B loggers."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from opendiloco_stream.net.prometheus import PeerCounters, PrometheusExporter, parse_text, render
from opendiloco_stream.train.loggers import TensorBoardLogger, WandbLogger, build_loggers, scalars


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


RECORDS = [
    {"event": "step", "step": 1, "loss": 5.5, "tokens": 256, "compute_s": 0.1, "sync_s": 0.0},
    {"event": "step", "step": 2, "loss": 5.25, "tokens": 256, "compute_s": 0.1, "sync_s": 0.0},
    {"event": "sync", "fragment": 0, "round": 0, "ok": True, "wait_s": 0.25, "group_size": 3,
     "bytes_sent": 1000, "bytes_received": 2000},
    {"event": "sync", "fragment": 1, "round": 0, "ok": False, "wait_s": 1.5, "group_size": 0, "reason": "timeout"},
    {"event": "eval", "step": 2, "eval_loss": 4.75},
]


def test_records_become_prometheus_samples_with_labels():
    counters = PeerCounters()
    for rec in RECORDS:
        counters.observe(rec)
    text = render(counters, {"run": "demo", "peer": 'Qm"x'}, info={"mode": "eager", "codec": "fp4-e3m0"})
    samples = parse_text(text)
    lab = (("peer", 'Qm\\"x'), ("run", "demo"))
    assert samples[("ods_step", lab)] == 2
    assert samples[("ods_loss", lab)] == 5.25 and samples[("ods_eval_loss", lab)] == 4.75
    assert samples[("ods_tokens_total", lab)] == 512
    assert samples[("ods_bytes_sent_total", lab)] == 1000 and samples[("ods_bytes_received_total", lab)] == 2000
    assert samples[("ods_rounds_total", tuple(sorted(lab + (("result", "ok"),))))] == 1
    assert samples[("ods_rounds_total", tuple(sorted(lab + (("result", "failed"),))))] == 1
    assert samples[("ods_group_size", lab)] == 3  # the failed round does not reset it
    assert samples[("ods_sync_wait_seconds_total", lab)] == 1.75 and samples[("ods_last_sync_wait_seconds", lab)] == 1.5
    assert 0 < samples[("ods_compute_utilization", lab)] <= 1 and samples[("ods_tokens_per_second", lab)] > 0
    assert "# TYPE ods_tokens_total counter" in text and "# TYPE ods_loss gauge" in text
    info = [k for k in samples if k[0] == "ods_info"]
    assert info and dict(info[0][1])["codec"] == "fp4-e3m0"


def test_exporter_serves_metrics_and_refuses_a_taken_port():
    with PrometheusExporter(0, host="127.0.0.1", labels={"run": "t"}) as exp:
        exp.observe(RECORDS[0])
        samples = parse_text(_get(exp.url))
        assert samples[("ods_step", (("run", "t"),))] == 1
        assert math.isnan(samples[("ods_eval_loss", (("run", "t"),))])  # no eval yet: NaN, not 0
        with pytest.raises(urllib.error.HTTPError):
            _get(exp.url.replace("/metrics", "/other"))
        with pytest.raises(OSError):
            PrometheusExporter(exp.port, host="127.0.0.1")


@pytest.mark.network
def test_scrape_the_endpoint_of_running_peers(tmp_path):
    """Two real peers on 127.0.0.1 train; their endpoints are scraped while they run."""
    from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes

    boot, addrs = start_bootstrap(tmp_path, "promtest")
    procs, ports = [boot], [_free_port(), _free_port()]
    try:
        for r, port in enumerate(ports):
            cmd = [sys.executable, "-m", "opendiloco_stream", "peer", "--initial-peers", *addrs, "--run-id", "promtest",
                   "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--no-progress",
                   "--mode", "blocking", "--fragments", "2", "--inner-steps", "6", "--steps", "400",
                   "--shard", f"{r}/2", "--no-join", "--metrics-port", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=open(tmp_path / f"p{r}.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ}))
        url = f"http://127.0.0.1:{ports[0]}/metrics"
        deadline, samples = time.monotonic() + 180, {}
        while time.monotonic() < deadline:
            for p in procs[1:]:
                assert p.poll() is None, (tmp_path / "p0.log").read_text()[-2000:]
            try:
                samples = {k[0] if k[0] != "ods_rounds_total" else f"rounds_{dict(k[1])['result']}": v
                           for k, v in parse_text(_get(url)).items()}
            except (urllib.error.URLError, ConnectionError):
                samples = {}  # not up yet (the peer builds its model, then joins the DHT)
            if samples.get("rounds_ok", 0) >= 2 and samples.get("ods_group_size") == 2:
                break
            time.sleep(1.0)
        assert samples.get("rounds_ok", 0) >= 2, samples
        assert samples["ods_group_size"] == 2
        # the second round is at step 6; a scrape may land between its sync record and its step record.
        # tokens: 2 x 32 a trained step; a step skipped to catch up with the other peer (under load) has none
        assert samples["ods_step"] >= 5 and samples["ods_tokens_total"] % (2 * 32) == 0
        assert 0 < samples["ods_tokens_total"] <= samples["ods_step"] * 2 * 32
        assert samples["ods_bytes_sent_total"] > 0 and samples["ods_bytes_received_total"] > 0
        assert 0 < samples["ods_compute_utilization"] <= 1 and samples["ods_tokens_per_second"] > 0
        assert math.isfinite(samples["ods_loss"]) and samples["ods_sync_wait_seconds_total"] >= 0
        other = parse_text(_get(f"http://127.0.0.1:{ports[1]}/metrics"))
        peers = {dict(k[1]).get("peer") for k in other} | {dict(k[1]).get("peer") for k in parse_text(_get(url))}
        assert len(peers) == 2  # each endpoint is labelled with its own peer id
    finally:
        stop_processes(procs, grace=10)


def test_loggers_are_optional_and_map_records_to_scalars(monkeypatch):
    from opendiloco_stream.config import ConfigError, load_config

    assert scalars(RECORDS[0]) == [("train/loss", 5.5, 1), ("train/lr", 0.0, 1)]
    assert ("sync/group_size", 3, 0) in scalars(RECORDS[2]) and ("sync/ok", 0.0, 0) in scalars(RECORDS[3])
    assert build_loggers(load_config(None, {})) == []

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("tensorboard", "wandb") else real(n, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        build_loggers(load_config(None, {"train": {"tensorboard_dir": "tb"}}))
    with pytest.raises(ConfigError, match="pip install wandb"):
        build_loggers(load_config(None, {"train": {"wandb_project": "p"}}))

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir, self.scalars, self.closed = log_dir, [], False

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def close(self):
            self.closed = True

    made = []
    tb = TensorBoardLogger("runs/tb", writer_factory=lambda log_dir: made.append(FakeWriter(log_dir)) or made[-1])
    for rec in RECORDS:
        tb.observe({**rec, "rank": 1})
    tb.close()
    assert made[0].log_dir == "runs/tb/worker-1" and ("eval/loss", 4.75, 2) in made[0].scalars and made[0].closed

    class FakeWandb:
        logged = []

        @classmethod
        def init(cls, project, config):
            assert project == "p"
            return cls()

        def log(self, values, step):
            self.logged.append((values, step))

        def finish(self):
            pass

    wb = WandbLogger("p", {}, wandb_module=FakeWandb)
    for rec in RECORDS:
        wb.observe(rec)
    wb.observe({**RECORDS[0], "rank": 1})  # other ranks are not logged
    assert len(FakeWandb.logged) == 5 and FakeWandb.logged[0] == ({"train/loss": 5.5, "train/lr": 0.0}, 1)
