"""A Prometheus endpoint on each peer (``--metrics-port``), served by ``prometheus_client``.

``peer --metrics-port 9100`` serves ``http://<host>:9100/metrics`` from ``prometheus_client``'s
HTTP server thread, in the text exposition format (or OpenMetrics, as the scraper asks). The
exporter is fed the same records the peer writes to ``--metrics-file`` (``observe(record)``), so
the two never disagree. The metric objects are the library's: counters only go up (the library
refuses a negative increment), HELP and TYPE come with them. Every series carries ``run`` and
``peer`` labels; per-round series also carry ``fragment``:

========================================================  =======  ===============================================
metric                                                    type     meaning
========================================================  =======  ===============================================
``ods_step``                                              gauge    inner steps done (the swarm's step after a join)
``ods_loss``                                              gauge    last training loss
``ods_eval_loss``                                         gauge    last evaluation loss (NaN before the first)
``ods_tokens_total``                                      counter  tokens trained on by this peer
``ods_tokens_per_second``                                 gauge    tokens / wall time since the peer started
``ods_compute_utilization``                               gauge    compute time / wall time (0..1)
``ods_bytes_sent_total{fragment}``                        counter  bytes this peer sent in all-reduces
``ods_bytes_received_total{fragment}``                    counter  bytes it received
``ods_rounds_total{fragment,result=ok|failed}``           counter  fragment rounds that completed / failed
``ods_group_size{fragment}``                              gauge    peers in the fragment's last completed round
``ods_sync_wait_seconds_total{fragment}``                 counter  time the training loop waited for rounds
``ods_last_sync_wait_seconds{fragment}``                  gauge    the wait of the fragment's last round
``ods_round_land_steps{fragment}``                        gauge    inner steps between the last round's launch
                                                                   and the landing of its average (when the sync
                                                                   records carry ``land_steps``)
``ods_exchanges_total{fragment,path}``                    counter  exchanges with groupmates by path: ``direct``,
                                                                   ``punched`` (through NAT), ``relayed``, ``p2p``
``ods_repairs_total{fragment,outcome}``                   counter  repairs of a theta_bar that differed from the
                                                                   group's: ``repaired``, ``failed``, ``stale``
                                                                   (``algorithm/repair.py``)
``ods_groupmate_rtt_seconds{fragment,groupmate}``         gauge    round-trip time to a groupmate, as the last
                                                                   round with it measured it (the direct path's
                                                                   TCP connection; sync records' ``rtt_ms``)
``ods_info{mode,codec,...}``                              info     1, with the run's settings as labels
========================================================  =======  ===============================================

A scrape config: ``- job_name: diloco`` / ``static_configs: [{targets: ["gpu-box-1:9100"]}]``;
``benchmarks/prometheus_scrape.py`` runs a real Prometheus server against a 2-peer swarm.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

PEER_LABELS = ("run", "peer")


class PeerMetrics:
    """The peer's metrics in a ``prometheus_client`` registry of their own, updated from its metrics
    records (``observe``; thread-safe: the library's metric objects are)."""

    def __init__(self, labels: Optional[dict[str, Any]] = None, info: Optional[dict[str, Any]] = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {k: str(v) for k, v in {"run": "", "peer": "", **(labels or {})}.items()}
        names, frag = list(self.labels), list(self.labels) + ["fragment"]
        r = self.registry

        def gauge(name: str, doc: str, by: list[str] = names) -> Gauge:
            return Gauge(name, doc, by, registry=r)

        def counter(name: str, doc: str, by: list[str] = names) -> Counter:
            return Counter(name, doc, by, registry=r)

        self.step = gauge("ods_step", "Inner steps done by this peer (the swarm's step after a join).")
        self.loss = gauge("ods_loss", "Last training loss.")
        self.eval_loss = gauge("ods_eval_loss", "Last evaluation loss (NaN before the first).")
        self.tokens = counter("ods_tokens", "Tokens trained on by this peer.")
        self.tokens_per_second = gauge("ods_tokens_per_second", "Tokens per second of wall time since training started.")
        self.utilization = gauge("ods_compute_utilization", "Compute time over wall time (0..1).")
        self.bytes_sent = counter("ods_bytes_sent", "Bytes sent in all-reduces.", frag)
        self.bytes_received = counter("ods_bytes_received", "Bytes received in all-reduces.", frag)
        self.rounds = counter("ods_rounds", "Fragment rounds by result (ok, failed).", frag + ["result"])
        self.group_size = gauge("ods_group_size", "Peers in the fragment's last completed round.", frag)
        self.wait = counter("ods_sync_wait_seconds", "Seconds the training loop waited for rounds.", frag)
        self.last_wait = gauge("ods_last_sync_wait_seconds", "Wait of the fragment's last round in seconds.", frag)
        self.land_steps = gauge("ods_round_land_steps", "Inner steps between the fragment's last round's launch "
                                "and the landing of its average.", frag)
        self.exchanges = counter("ods_exchanges", "Exchanges with groupmates by path (direct, punched through "
                                 "NAT, relayed, p2p).", frag + ["path"])
        self.repairs = counter("ods_repairs", "Repairs of a theta_bar that differed from the group's, by outcome "
                               "(repaired, failed, stale).", frag + ["outcome"])
        self.rtt = gauge("ods_groupmate_rtt_seconds", "Round-trip time to a groupmate, as the fragment's last round "
                         "with it measured it.", frag + ["groupmate"])
        self.info = Info("ods", "The run's settings.", names, registry=r)
        self._info = {k: str(v) for k, v in (info or {}).items()}
        self._lock = threading.Lock()  # the wall-time bookkeeping below
        self._compute_s, self._tokens, self._t0 = 0.0, 0, None
        self.relabel()

    def relabel(self, **labels: Any) -> None:
        """Set ``run`` / ``peer`` (the peer id is known once the DHT is up): before the first
        ``observe`` only, as it starts every series again."""
        self.labels.update({k: str(v) for k, v in labels.items()})
        for metric in (self.step, self.loss, self.eval_loss, self.tokens, self.tokens_per_second,
                       self.utilization, self.info):
            metric.clear()
        self._values = {m: m.labels(**self.labels) for m in (self.step, self.loss, self.eval_loss, self.tokens,
                                                              self.tokens_per_second, self.utilization)}
        self._values[self.loss].set(math.nan)
        self._values[self.eval_loss].set(math.nan)
        if self._info:
            self.info.labels(**self.labels).info(self._info)

    def _of(self, metric, rec: dict[str, Any], **extra: str):
        return metric.labels(**self.labels, fragment=str(rec.get("fragment", "")), **extra)

    def observe(self, rec: dict[str, Any]) -> None:
        """Fold one JSON-lines record (``step``, ``sync``, ``eval``, ``joined``, ``summary``) in."""
        event, v = rec.get("event"), self._values
        if event == "step":
            self._step(rec)
        elif event == "sync":
            wait = float(rec.get("wait_s", 0.0))
            self._of(self.wait, rec).inc(wait)
            self._of(self.last_wait, rec).set(wait)
            ok = bool(rec.get("ok"))
            self._of(self.rounds, rec, result="ok" if ok else "failed").inc()
            if ok:
                self._of(self.bytes_sent, rec).inc(int(rec.get("bytes_sent", 0)))
                self._of(self.bytes_received, rec).inc(int(rec.get("bytes_received", 0)))
                self._of(self.group_size, rec).set(int(rec.get("group_size", 0)))
            for path, n in (rec.get("exchanges") or {}).items():
                self._of(self.exchanges, rec, path=str(path)).inc(int(n))
            if rec.get("land_steps") is not None:
                self._of(self.land_steps, rec).set(float(rec["land_steps"]))
            for mate, rtt_ms in (rec.get("rtt_ms") or {}).items():
                if rtt_ms is not None:
                    self._of(self.rtt, rec, groupmate=str(mate)).set(float(rtt_ms) / 1e3)
        elif event == "repair":
            self._of(self.repairs, rec, outcome=str(rec.get("outcome", ""))).inc()
        elif event == "eval":
            v[self.eval_loss].set(float(rec.get("eval_loss", math.nan)))
        elif event == "joined":
            v[self.step].set(int(rec.get("step", 0)))
        elif event == "summary":  # the run's own end-of-run accounting wins
            if "compute_utilization" in rec:
                v[self.utilization].set(float(rec["compute_utilization"]))
            if "tokens_per_s" in rec:
                v[self.tokens_per_second].set(float(rec["tokens_per_s"]))

    def _step(self, rec: dict[str, Any]) -> None:
        v, tokens = self._values, int(rec.get("tokens", 0))
        v[self.step].set(int(rec.get("step", 0)))
        v[self.loss].set(float(rec.get("loss", math.nan)))
        v[self.tokens].inc(tokens)
        with self._lock:
            now = time.perf_counter()
            if self._t0 is None:  # the first step's compute time is the first wall time
                self._t0 = now - float(rec.get("compute_s", 0.0)) - float(rec.get("sync_s", 0.0))
            self._tokens += tokens
            self._compute_s += float(rec.get("compute_s", 0.0))
            wall = max(1e-9, now - self._t0)
            v[self.tokens_per_second].set(self._tokens / wall)
            v[self.utilization].set(min(1.0, self._compute_s / wall))

    def exposition(self) -> str:
        """The registry in the Prometheus text format (what a scrape of ``/metrics`` returns)."""
        return generate_latest(self.registry).decode()


class PrometheusExporter:
    """``PeerMetrics`` served on ``host:port`` by ``prometheus_client``'s HTTP server (a daemon
    thread); ``observe(record)`` feeds it.

    ``port=0`` binds a free port (read it back from ``.port``). A port in use raises ``OSError``
    at construction, before training starts.
    """

    def __init__(self, port: int, host: str = "0.0.0.0", labels: Optional[dict[str, Any]] = None,
                 info: Optional[dict[str, Any]] = None):
        self.metrics = PeerMetrics(labels, info)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.metrics.registry)
        self.host, self.port = host, self._server.server_address[1]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def observe(self, rec: dict[str, Any]) -> None:
        self.metrics.observe(rec)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2.0)

    def __enter__(self) -> "PrometheusExporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a scrape, read with ``prometheus_client``'s parser: {(name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
