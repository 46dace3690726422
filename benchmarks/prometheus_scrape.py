"""A real Prometheus server scrapes a 2-peer swarm; its HTTP API returns the peers' series.

    .venv/bin/python -m benchmarks.prometheus_scrape [--steps 300] [--timeout 240]

Starts a bootstrap node and 2 real peers on 127.0.0.1 (tiny model, eager, fp4, ``--metrics-port``),
and a ``prometheus`` server (Debian package ``prometheus``; scripts/setup.sh installs it when it can)
with a scrape config naming both endpoints (1 s interval). Waits until the server's query API
(``/api/v1/query``) answers ``sum by (peer) (ods_rounds_total{result="ok"})`` with both peers and at
least 2 rounds each, checks ``ods_step`` and ``ods_info`` come back too and that the targets are up
(``/api/v1/targets``), then stops every process it started (by PID, whole sessions). Prints a JSON
verdict and writes it in the result envelope (``--out``); exit 0 when the check passes, 1 when it fails, 2 when ``prometheus`` is not installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.results import RESULTS_DIR, write_result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_flags(r: int, port: int, steps: int) -> list[str]:
    """Peer ``r`` of 2: tiny, eager fp4, its Prometheus endpoint on ``port``."""
    return ["--run-id", "promscrape", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--threads", "1",
            "--no-progress", "--mode", "eager", "--codec", "fp4-e3m0", "--fragments", "2", "--inner-steps", "6",
            "--steps", str(steps), "--shard", f"{r}/2", "--no-join", "--target-group-size", "2",
            "--metrics-port", str(port)]


def start_prometheus(binary: str, workdir: Path, targets: list[str], port: int) -> subprocess.Popen:
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "diloco", "static_configs": [{"targets": targets}]}]}
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    cmd = [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    return subprocess.Popen(cmd, stdout=open(workdir / "prometheus.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body}")
    return body["data"]


def query(port: int, expr: str) -> list[dict]:
    return api(port, "query", query=expr)["result"]


def wait_for_rounds(port: int, procs: list[subprocess.Popen], timeout: float) -> dict[str, float]:
    """{peer: ok rounds} once both peers have >= 2, as the server's query API returns them."""
    deadline, rounds = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a process exited early ({p.args[0]}: {p.returncode})")
        try:
            rows = query(port, 'sum by (peer) (ods_rounds_total{result="ok"})')
            rounds = {row["metric"].get("peer", ""): float(row["value"][1]) for row in rows}
        except OSError:
            rounds = {}  # the server is still starting
        if len(rounds) == 2 and min(rounds.values()) >= 2:
            return rounds
        time.sleep(1.0)
    raise RuntimeError(f"no 2 rounds per peer through the query API after {timeout:.0f} s: {rounds}")


def check(prom_port: int, procs: list[subprocess.Popen], timeout: float) -> dict:
    """What the server returns once both peers have 2 rounds: rounds, steps, info, targets, ok."""
    rounds = wait_for_rounds(prom_port, procs, timeout)
    steps = {row["metric"]["peer"]: float(row["value"][1]) for row in query(prom_port, "ods_step")}
    info = query(prom_port, "ods_info")
    targets = api(prom_port, "targets")["activeTargets"]
    ok = (len(steps) == 2 and min(steps.values()) > 0 and len(info) == 2 and info[0]["metric"].get("mode") == "eager"
          and sorted(t["health"] for t in targets) == ["up", "up"])
    return dict(rounds_ok=rounds, steps=steps, info=[row["metric"] for row in info],
                targets={t["scrapeUrl"]: t["health"] for t in targets}, ok=ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="inner steps per peer (they are stopped once checked)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the series")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "prometheus-scrape.json",
                    help="the verdict as JSON, one row per peer (default: %(default)s)")
    args = ap.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        print(json.dumps({"ok": False, "error": "prometheus is not installed (apt-get install prometheus)"}))
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="ods-prometheus-"))
    verdict: dict = {"ok": False, "workdir": str(workdir)}
    try:
        with PeerProcesses(workdir) as run:  # stops the peers and the server on the way out
            run.bootstrap("promscrape")
            ports = [free_port(), free_port()]
            for r, port in enumerate(ports):
                run.peer(f"peer-{r}", *peer_flags(r, port, args.steps))
            prom_port = free_port()
            run.procs.append(start_prometheus(binary, workdir, [f"127.0.0.1:{p}" for p in ports], prom_port))
            verdict.update(check(prom_port, run.procs, args.timeout))
    except (RuntimeError, OSError) as e:
        verdict["error"] = str(e)
    if verdict["ok"]:  # a failed run's logs and config stay for a look
        shutil.rmtree(workdir, ignore_errors=True)
        verdict.pop("workdir")
    print(json.dumps(verdict, indent=1))
    rows = [{"peer": peer, "step": step} for peer, step in sorted(verdict.get("steps", {}).items())]
    write_result(args.out, settings=vars(args), rows=rows, benchmark="prometheus_scrape", verdict=verdict)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
