"""Soak: 3 loopback peers doing all-reduce rounds continuously; does resident memory grow?

    python -m benchmarks.soak              # 30 minutes
    python -m benchmarks.soak --quick      # 3 minutes
    python -m benchmarks.soak --minutes M [--numel N] [--sample-s S] [--out PATH]

Peers are ``LoopbackSwarm`` processes (benchmarks/harness/loopback.py: each its own session with its
DHT process and p2pd). Rounds: one fragment of ``--numel`` fp32 values (default 1M,
4 MB), fp32 codec, all 3 peers in every round, back to back. A sampler thread reads the resident
set size (VmRSS, /proc; psutil is not needed) of every process in every peer's session every
``--sample-s`` seconds, the parent included. Per process: first and last RSS, peak, and growth per
hour (least-squares slope over the samples after a warm-up of 10 % of the run, so start-up
allocations do not count as growth), and over the second half of the run alone (a short run's
whole-run slope is mostly allocator warm-up). Failed rounds are counted with their reasons. A table goes
to stdout, JSON to ``--out`` (default benchmarks/results/soak.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.harness.loopback import LoopbackSwarm
from benchmarks.harness.results import RESULTS_DIR, write_result



def _stat(pid: int):
    """(session id, name) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    name = data[data.index("(") + 1: data.rindex(")")]
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[3]), name  # fields: state ppid pgrp session ...


def rss_mb(pid: int):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return 0.0  # a zombie has no VmRSS line


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in argv if a)[:120]


def session_processes(sessions: dict[int, str]) -> dict[int, tuple[str, str]]:
    """pid -> (owner label, process name) for every process in the given sessions."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and st[0] in sessions:
                out[int(entry)] = (sessions[st[0]], st[1])
    return out


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) in MB per hour (0 with fewer than 3 samples)."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 3600


class Sampler(threading.Thread):
    def __init__(self, sessions: dict[int, str], period: float):
        super().__init__(daemon=True)
        self.sessions, self.period = sessions, period
        self.t0 = time.monotonic()
        self.series: dict[int, dict] = {}
        self.stop_event = threading.Event()

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        procs = session_processes(self.sessions)
        procs[os.getpid()] = ("parent", "python")
        for pid, (owner, name) in procs.items():
            mb = rss_mb(pid)
            if mb is None:
                continue
            s = self.series.setdefault(pid, dict(owner=owner, name=name, cmd=_cmd(pid), samples=[]))
            s["samples"].append((round(now, 2), round(mb, 2)))

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.period)


def run(minutes: float, numel: int, sample_s: float) -> dict:
    """Rounds among 3 loopback peers for ``minutes``, each process's RSS sampled: the report."""
    duration = minutes * 60
    swarm = LoopbackSwarm(3, run_id="soak", transport_kwargs=dict(
        codec="fp32", target_group_size=3, matchmaking_time=3.0, request_timeout=1.0))
    rounds, failures = 0, {}
    round_s: list[float] = []
    try:
        t_start = time.monotonic()
        swarm.start()
        swarm.call_all("prepare", {0: numel}, timeout=120)
        startup_s = time.monotonic() - t_start
        sampler = Sampler({p.pid: f"peer{p.index}" for p in swarm.peers}, sample_s)
        sampler.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < duration:
            args = [dict(seed=rounds * 3 + i, numel=numel, return_tensors=False) for i in range(3)]
            t = time.monotonic()
            results = swarm.call_all("all_reduce", (0, rounds), per_peer=args, timeout=180)
            round_s.append(time.monotonic() - t)
            rounds += 1
            ok = all(r["ok"] and r["group_size"] == 3 for r in results) and len({r["sha256"] for r in results}) == 1
            if not ok:
                reason = ",".join(sorted({str(r.get("reason", f"group {r.get('group_size')}")) for r in results}))
                failures[reason] = failures.get(reason, 0) + 1
        elapsed = time.monotonic() - t0
        sampler.stop_event.set()
        sampler.join(10)
        sampler.sample()
    finally:
        swarm.close()

    warmup = 0.1 * elapsed
    procs = []
    for pid, s in sorted(sampler.series.items(), key=lambda kv: (kv[1]["owner"], kv[0])):
        samples = s["samples"]
        steady = [x for x in samples if x[0] >= warmup] or samples
        late = [x for x in samples if x[0] >= elapsed / 2] or samples
        procs.append(dict(pid=pid, owner=s["owner"], name=s["name"], cmd=s["cmd"], n_samples=len(samples),
                          rss_first_mb=samples[0][1], rss_last_mb=samples[-1][1],
                          rss_peak_mb=max(v for _, v in samples),
                          growth_mb_per_hour=round(slope_per_hour(steady), 2),
                          growth_second_half_mb_per_hour=round(slope_per_hour(late), 2),
                          samples=samples))
    by_owner: dict[str, list] = {}
    for p in procs:  # per peer: the sum over its processes at each sample time
        by_owner.setdefault(p["owner"], []).append(p)
    totals = {}
    for owner, ps in by_owner.items():
        times = sorted({t for p in ps for t, _ in p["samples"]})
        summed = [(t, sum(v for p in ps for tt, v in p["samples"] if tt == t)) for t in times]
        steady = [x for x in summed if x[0] >= warmup] or summed
        late = [x for x in summed if x[0] >= elapsed / 2] or summed
        totals[owner] = dict(processes=len(ps), rss_first_mb=round(summed[0][1], 1), rss_last_mb=round(summed[-1][1], 1),
                             growth_mb_per_hour=round(slope_per_hour(steady), 2),
                             growth_second_half_mb_per_hour=round(slope_per_hour(late), 2))
    failed = sum(failures.values())
    report = dict(
        minutes=minutes, duration_s=round(elapsed, 1), startup_s=round(startup_s, 1),
        peers=3, numel=numel, codec="fp32", sample_s=sample_s, warmup_s=round(warmup, 1),
        rounds=rounds, failed_rounds=failed, failures=failures,
        round_s=dict(mean=round(sum(round_s) / max(1, len(round_s)), 3),
                     max=round(max(round_s, default=0.0), 3)),
        per_peer=totals, processes=procs,
        load_1m_at_end=os.getloadavg()[0],
    )
    return report


def print_table(r: dict) -> None:
    print(f"soak: {r['duration_s']:.0f}s, {r['rounds']} rounds ({r['failed_rounds']} failed {r['failures']}), "
          f"round mean {r['round_s']['mean']:.2f}s max {r['round_s']['max']:.2f}s, {r['numel']} fp32 values")
    print(f"{'owner':<8} {'pid':>7} {'process':<16} {'first MB':>9} {'last MB':>9} {'peak MB':>9} {'MB/hour':>9} "
          f"{'2nd half':>9}")
    for p in r["processes"]:
        print(f"{p['owner']:<8} {p['pid']:>7} {p['name'][:16]:<16} {p['rss_first_mb']:>9.1f} {p['rss_last_mb']:>9.1f} "
              f"{p['rss_peak_mb']:>9.1f} {p['growth_mb_per_hour']:>9.1f} {p['growth_second_half_mb_per_hour']:>9.1f}")
    for owner, t in r["per_peer"].items():
        print(f"{owner:<8} total of {t['processes']} processes: {t['rss_first_mb']:.0f} -> {t['rss_last_mb']:.0f} MB, "
              f"{t['growth_mb_per_hour']:+.1f} MB/hour after warm-up, {t['growth_second_half_mb_per_hour']:+.1f} "
              "over the second half")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="3 minutes")
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json")
    a = ap.parse_args(argv)
    report = run(3.0 if a.quick else a.minutes, a.numel, a.sample_s)
    print_table(report)
    processes = report.pop("processes")
    write_result(a.out, settings=vars(a), rows=processes, argv=argv, benchmark="soak", **report)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
