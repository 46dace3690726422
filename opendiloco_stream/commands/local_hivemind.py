"""``local --transport hivemind``: a bootstrap node and N real ``peer`` processes on 127.0.0.1.

No log scraping: the bootstrap writes its multiaddrs to a file, each peer writes JSON-lines
metrics, and the launcher reads both. Every child runs in its own session; Ctrl+C / SIGTERM here is
forwarded as SIGTERM (peers stop at a safe point), and whatever is still alive after a grace period
is killed by PID, process tree included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from opendiloco_stream.commands._common import print_summary, worker_config
from opendiloco_stream.config import RunConfig
from opendiloco_stream.net.lifecycle import GracefulShutdown, kill_process_tree
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.train.metrics_file import MetricsTail

GRACE_S = 30.0


def to_toml(cfg: RunConfig) -> str:
    """Serialize a RunConfig as TOML (None values omitted), so peers get exactly this config."""
    lines = []
    for section, model in cfg:
        lines.append(f"[{section}]")
        for key, value in model.model_dump(mode="json").items():
            if value is None:
                continue
            if hasattr(getattr(model, key), "get_secret_value"):  # a run key: dumped masked, the peers need it
                value = getattr(model, key).get_secret_value()
            lines.append(f"{key} = {json.dumps(value)}")  # JSON scalars/lists of these are valid TOML
        lines.append("")
    return "\n".join(lines)


def _python() -> str:
    return sys.executable


def start_bootstrap(workdir: Path, run_id: str, timeout: float = 60.0) -> tuple[subprocess.Popen, list[str]]:
    addr_file = workdir / "bootstrap.addrs"
    proc = subprocess.Popen([_python(), "-m", "opendiloco_stream", "bootstrap", "--run-id", run_id,
                             "--addr-file", str(addr_file)],
                            stdout=open(workdir / "bootstrap.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if addr_file.exists() and addr_file.read_text().strip():
            return proc, addr_file.read_text().split()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    log = (workdir / "bootstrap.log").read_text()[-2000:]
    stop_processes([proc])
    raise RuntimeError(f"the bootstrap node did not come up within {timeout:g} s:\n{log}")


def stop_processes(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    """SIGTERM every live process, wait up to ``grace``, then kill their whole trees."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        kill_process_tree(p.pid, timeout=5.0)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


def combine(summaries: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One summary over peers: their sync counters merged as ``summarize`` merges workers'
    (``SyncStats``), tokens summed, means of losses and utilization."""
    def mean(key: str) -> float:
        xs = [s[key] for s in summaries if s.get(key, math.nan) == s.get(key, math.nan)]  # NaN: not measured
        return float(sum(xs) / len(xs)) if xs else float("nan")

    first = summaries[0]
    out = {k: first[k] for k in ("mode", "codec", "fragments", "inner_steps", "overlap_steps", "model", "params",
                                 "model_outer_gradient_bytes")}
    tokens = sum(s["tokens"] for s in summaries)
    stats = SyncStats.total(SyncStats.from_record(s) for s in summaries)
    out.update(
        event="summary", transport="hivemind", workers=len(summaries), steps=max(s["steps"] for s in summaries),
        tokens=tokens, eval_loss_initial=mean("eval_loss_initial"), eval_loss=mean("eval_loss"),
        eval_loss_before_finish=mean("eval_loss_before_finish"), eval_loss_global=mean("eval_loss_global"),
        train_loss=mean("train_loss"), **stats.summary_fields(len(summaries)),
        compute_utilization=mean("compute_utilization"), wall_time_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0, peers=[s.get("peer_id") for s in summaries])
    return out


def run_hivemind(args: argparse.Namespace, cfg: RunConfig) -> int:
    M = args.workers
    run_id = cfg.net.run_id if cfg.net.run_id != "opendiloco" else f"local-{os.getpid()}"
    workdir = Path(tempfile.mkdtemp(prefix="ods-local-"))
    # train.save_model: peer 0 writes it (every peer holds the same theta_bar; one directory)
    (workdir / "run.toml").write_text(to_toml(worker_config(cfg, 1)))
    threads = args.threads or max(1, (os.cpu_count() or 1) // (M * cfg.train.nproc_per_node))  # per rank
    procs: list[subprocess.Popen] = []
    with GracefulShutdown() as stop:
        try:
            boot, addrs = start_bootstrap(workdir, run_id)
            procs.append(boot)
            peers = []
            for r in range(M):
                cmd = [_python(), "-m", "opendiloco_stream", "peer", "--config", str(workdir / "run.toml"),
                       "--run-id", run_id, "--initial-peers", *addrs, "--shard", f"{r}/{M}", "--no-join",
                       "--metrics-file", str(workdir / f"peer-{r}.jsonl"), "--no-progress",
                       "--threads", str(threads), "--target-group-size", str(M), "--wait-for-peers", str(M),
                       "--log-level", args.log_level]
                if r == 0 and cfg.train.save_model:
                    cmd += ["--save-model", str(Path(cfg.train.save_model).resolve())]
                if cfg.net.data_port:  # one range of data ports per peer: they share this machine
                    cmd += ["--data-port", str(cfg.net.data_port + r * cfg.diloco.num_fragments)]
                peers.append(subprocess.Popen(cmd, stdout=open(workdir / f"peer-{r}.log", "w"),
                                              stderr=subprocess.STDOUT, start_new_session=True))
            procs.extend(peers)
            ranks = f" x {cfg.train.nproc_per_node} ranks" if cfg.train.nproc_per_node > 1 else ""
            print(f"local run '{run_id}': bootstrap + {M} peers{ranks} on 127.0.0.1; logs and metrics in {workdir}",
                  file=sys.stderr)
            tails = [MetricsTail(workdir / f"peer-{r}.jsonl") for r in range(M)]
            summaries: list[Optional[dict]] = [None] * M
            bar = tqdm(total=M * cfg.train.steps, desc=f"{cfg.diloco.mode} x{M} (hivemind)", unit="step",
                       disable=args.no_progress, file=sys.stderr, dynamic_ncols=True)
            writer = open(cfg.train.metrics_file, "w") if cfg.train.metrics_file else None
            start = time.perf_counter()

            def drain(final: bool = False) -> None:
                for r, tail in enumerate(tails):
                    for rec in tail.read(final):
                        rec["rank"] = r
                        if writer:
                            writer.write(json.dumps(rec) + "\n")
                        if rec.get("event") == "step":
                            bar.update(1)
                        elif rec.get("event") == "summary":
                            summaries[r] = rec

            while not stop.requested and any(p.poll() is None for p in peers):
                drain()
                stop.wait(0.5)
            drain(final=True)  # what the peers wrote before exiting
            bar.close()
            wall = time.perf_counter() - start
            failed = [r for r, p in enumerate(peers) if p.returncode not in (0, None)]
            if stop.requested:
                print("interrupted: stopping the peers", file=sys.stderr)
                return 130
            if failed or any(s is None for s in summaries):
                for r in failed or [r for r, s in enumerate(summaries) if s is None]:
                    log = (workdir / f"peer-{r}.log").read_text()[-1500:]
                    print(f"peer {r} failed (exit {peers[r].returncode}); end of its log:\n{log}", file=sys.stderr)
                return 1
            summary = combine([s for s in summaries if s is not None], wall)
            if writer:
                writer.write(json.dumps(summary) + "\n")
                writer.close()
            print_summary(summary)
            return 0
        finally:
            stop_processes(procs)
