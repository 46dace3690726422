"""A Prometheus text endpoint on each peer (``--metrics-port``): the numbers users already scrape.

``peer --metrics-port 9100`` serves ``http://<host>:9100/metrics`` in the Prometheus text exposition
format (version 0.0.4) from a daemon thread (stdlib ``http.server``; no extra dependency). The
exporter is fed the same records the peer writes to ``--metrics-file`` (``observe(record)``), so
the two never disagree. Every series carries ``run`` and ``peer`` labels:

=====================================  =======  =====================================================
metric                                 type     meaning
=====================================  =======  =====================================================
``ods_step``                           gauge    inner steps done (the swarm's step after a join)
``ods_loss``                           gauge    last training loss
``ods_eval_loss``                      gauge    last evaluation loss
``ods_tokens_total``                   counter  tokens trained on by this peer
``ods_tokens_per_second``              gauge    tokens / wall time since the peer started training
``ods_compute_utilization``            gauge    compute time / wall time (0..1)
``ods_bytes_sent_total``               counter  bytes this peer sent in all-reduces
``ods_bytes_received_total``           counter  bytes it received
``ods_rounds_total{result=ok|failed}`` counter  fragment rounds that completed / failed
``ods_group_size``                     gauge    peers in this peer's last completed round
``ods_sync_wait_seconds_total``        counter  time the training loop waited for rounds
``ods_last_sync_wait_seconds``         gauge    the wait of the last round
``ods_info{mode,codec,...}``           gauge    1, with the run's settings as labels
=====================================  =======  =====================================================

A scrape config: ``- job_name: diloco`` / ``static_configs: [{targets: ["gpu-box-1:9100"]}]``.
"""

from __future__ import annotations

import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: name -> (type, help)
METRICS: dict[str, tuple[str, str]] = {
    "ods_step": ("gauge", "Inner steps done by this peer (the swarm's step after a join)."),
    "ods_loss": ("gauge", "Last training loss."),
    "ods_eval_loss": ("gauge", "Last evaluation loss."),
    "ods_tokens_total": ("counter", "Tokens trained on by this peer."),
    "ods_tokens_per_second": ("gauge", "Tokens per second of wall time since training started."),
    "ods_compute_utilization": ("gauge", "Compute time over wall time (0..1)."),
    "ods_bytes_sent_total": ("counter", "Bytes sent in all-reduces."),
    "ods_bytes_received_total": ("counter", "Bytes received in all-reduces."),
    "ods_rounds_total": ("counter", "Fragment rounds by result (ok, failed)."),
    "ods_group_size": ("gauge", "Peers in the last completed round."),
    "ods_sync_wait_seconds_total": ("counter", "Seconds the training loop waited for rounds."),
    "ods_last_sync_wait_seconds": ("gauge", "Wait of the last round in seconds."),
    "ods_info": ("gauge", "The run's settings as labels (value 1)."),
}


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


class PeerCounters:
    """The peer's numbers, updated from its metrics records (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {
            "ods_step": 0, "ods_loss": float("nan"), "ods_eval_loss": float("nan"), "ods_tokens_total": 0,
            "ods_tokens_per_second": 0.0, "ods_compute_utilization": 0.0, "ods_bytes_sent_total": 0,
            "ods_bytes_received_total": 0, "ods_group_size": 0, "ods_sync_wait_seconds_total": 0.0,
            "ods_last_sync_wait_seconds": 0.0}
        self.rounds = {"ok": 0, "failed": 0}
        self._compute_s = 0.0
        self._t0: Optional[float] = None

    def observe(self, rec: dict[str, Any]) -> None:
        """Fold one JSON-lines record (``step``, ``sync``, ``eval``, ``joined``, ``summary``) in."""
        event, v = rec.get("event"), self.values
        with self._lock:
            now = time.perf_counter()
            if event == "step":
                if self._t0 is None:  # the first step's compute time is the first wall time
                    self._t0 = now - float(rec.get("compute_s", 0.0)) - float(rec.get("sync_s", 0.0))
                v["ods_step"] = int(rec.get("step", v["ods_step"]))
                v["ods_loss"] = float(rec.get("loss", float("nan")))
                v["ods_tokens_total"] += int(rec.get("tokens", 0))
                self._compute_s += float(rec.get("compute_s", 0.0))
                wall = max(1e-9, now - self._t0)
                v["ods_tokens_per_second"] = v["ods_tokens_total"] / wall
                v["ods_compute_utilization"] = min(1.0, self._compute_s / wall)
            elif event == "sync":
                wait = float(rec.get("wait_s", 0.0))
                v["ods_sync_wait_seconds_total"] += wait
                v["ods_last_sync_wait_seconds"] = wait
                if rec.get("ok"):
                    self.rounds["ok"] += 1
                    v["ods_bytes_sent_total"] += int(rec.get("bytes_sent", 0))
                    v["ods_bytes_received_total"] += int(rec.get("bytes_received", 0))
                    v["ods_group_size"] = int(rec.get("group_size", 0))
                else:
                    self.rounds["failed"] += 1
            elif event == "eval":
                v["ods_eval_loss"] = float(rec.get("eval_loss", float("nan")))
            elif event == "joined":
                v["ods_step"] = int(rec.get("step", v["ods_step"]))
            elif event == "summary":  # the run's own end-of-run accounting wins
                v["ods_compute_utilization"] = float(rec.get("compute_utilization", v["ods_compute_utilization"]))
                v["ods_tokens_per_second"] = float(rec.get("tokens_per_s", v["ods_tokens_per_second"]))

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        with self._lock:
            return dict(self.values), dict(self.rounds)


def render(counters: PeerCounters, labels: dict[str, Any], info: Optional[dict[str, Any]] = None) -> str:
    """The Prometheus text exposition of ``counters``."""
    values, rounds = counters.snapshot()
    out = []
    for name, (kind, help_text) in METRICS.items():
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        if name == "ods_rounds_total":
            for result in ("ok", "failed"):
                out.append(f"{name}{_labels({**labels, 'result': result})} {rounds[result]}")
        elif name == "ods_info":
            out.append(f"{name}{_labels({**labels, **(info or {})})} 1")
        else:
            out.append(f"{name}{_labels(labels)} {_number(values[name])}")
    return "\n".join(out) + "\n"


class PrometheusExporter:
    """Serves ``/metrics`` on ``host:port`` from a daemon thread; ``observe(record)`` feeds it.

    ``port=0`` binds a free port (read it back from ``.port``). A port in use raises ``OSError``
    at construction, before training starts.
    """

    def __init__(self, port: int, host: str = "0.0.0.0", labels: Optional[dict[str, Any]] = None,
                 info: Optional[dict[str, Any]] = None):
        self.counters = PeerCounters()
        self.labels = dict(labels or {})
        self.info = dict(info or {})
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = render(exporter.counters, exporter.labels, exporter.info).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # scrapes every few seconds: keep stderr quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="prometheus-exporter", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def observe(self, rec: dict[str, Any]) -> None:
        self.counters.observe(rec)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2.0)

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A small parser of the exposition format (samples only): {(name, sorted labels): value}.

    Enough to read our own endpoint back in tests and scripts; not a full Prometheus parser.
    """
    import re

    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = sample.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        labels = tuple(sorted(label.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out
