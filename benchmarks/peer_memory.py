"""Host memory of real peers, process by process: the trainer, its DHT and p2pd (and, before the
averaging service, its forked averagers).

    python -m benchmarks.peer_memory                     # 35M preset, 2 peers, P = 4, eager fp4 (~2 min)
    python -m benchmarks.peer_memory --quick             # tiny preset: a smoke run (~40 s)

``benchmarks/memory.py`` measures what ``StreamingDiLoCo`` holds over a one-process ``LocalSwarm``. A
real peer (``peer``, or ``local --transport hivemind``) also runs a DHT process and a p2p daemon;
its averaging service is a thread of the trainer (up to the version before it, one forked
averager process per fragment). This script runs ``opendiloco-stream local --transport
hivemind`` and samples, every ``--every`` seconds, the proportional set size (PSS, from
``/proc/PID/smaps_rollup``) of every process in its tree. PSS splits a page shared by several
processes among them, so the sum over processes is the memory the run takes, counted once. The
row at the largest sum is reported, grouped by role, per peer:

- *trainer*: the peer's main process (model, AdamW, outer state; its share of shared pages).
- *averagers*: any other fork of the trainer besides its DHT: none today. Earlier versions ran one
  averager process per fragment here, holding the transport's shared buffers (``input``,
  ``output``: 2 x fragment fp32 each), their own heap and, being forks, any page of the trainer
  written since the fork (``benchmarks/results/peer-memory-35M.json`` is that version).
- *dht*, *p2pd*, *other* (torch's shared-memory manager).
- *of which shared memory*: the peer's shared memory (PSS), in all its processes (the old
  averagers' buffers were 2 x model fp32 over all fragments; the service shares none).

Prints a table and writes JSON (``--out``, default ``benchmarks/results/peer-memory[-quick].json``).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from opendiloco_stream.net.lifecycle import descendants

from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.results import RESULTS_DIR, markdown_table, write_result

MiB = 1 << 20
FIELDS = ("Pss", "Pss_Shmem", "Private_Dirty", "Rss")


def sample(pid: int) -> Optional[dict[str, Any]]:
    """One process's memory fields (bytes) and command line, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if k in FIELDS}
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()  # fields 3... of proc(5)
        ppid, started = int(stat[1]), int(stat[19])
    except (OSError, ValueError, IndexError):
        return None
    return {"pid": pid, "ppid": ppid, "started": started, "cmd": cmd, **{k: fields.get(k, 0) for k in FIELDS}}


def roles(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[dict]]]:
    """Group a snapshot's processes by peer (its trainer's pid) and role."""
    trainers = {r["pid"] for r in rows if " peer " in f" {r['cmd']} " and "opendiloco_stream" in r["cmd"]
                and not any(q["pid"] == r["ppid"] and " peer " in f" {q['cmd']} " for q in rows)}
    by_pid = {r["pid"]: r for r in rows}

    def trainer_of(r: dict) -> Optional[int]:
        while r is not None:
            if r["pid"] in trainers:
                return r["pid"]
            r = by_pid.get(r["ppid"])
        return None

    def forked(r: dict) -> bool:  # a fork of the trainer itself (not p2pd, not torch's manager)
        return r["ppid"] in trainers and "p2pd" not in r["cmd"] and "torch_shm_manager" not in r["cmd"]

    # the trainer forks its DHT first (``peer`` starts it before the transport); older versions then
    # forked one averager per fragment
    dht = {min((r for r in rows if forked(r) and r["ppid"] == t), key=lambda r: r["started"], default={}).get("pid")
           for t in trainers}
    out: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        owner = trainer_of(r)
        if owner is None:
            out["launcher"]["other"].append(r)
            continue
        if r["pid"] == owner:
            role = "trainer"
        elif "p2pd" in r["cmd"]:
            role = "p2pd"
        elif not forked(r):
            role = "other"
        else:
            role = "dht" if r["pid"] in dht else "averagers"
        out[str(owner)][role].append(r)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="ods-peer-memory-"))
    command = ["local", "--transport", "hivemind", "--workers", str(args.peers), "--model", args.model,
               "--fragments", str(args.fragments), "--inner-steps", str(args.inner_steps), "--steps", str(args.steps),
               "--mode", args.mode, "--codec", args.codec, "--batch-size", "2", "--threads", "1", "--no-progress",
               "--metrics-file", str(workdir / "m.jsonl")]
    best: tuple[int, list] = (0, [])
    deadline = time.monotonic() + args.timeout
    with PeerProcesses(workdir, grace=5.0) as launched:  # stops the run's whole session on the way out
        proc = launched.start("run", command)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run took over {args.timeout:.0f} s (log: {workdir / 'run.log'})")
            snapshot = [s for s in map(sample, [proc.pid, *descendants(proc.pid)]) if s]
            total = sum(s["Pss"] for s in snapshot)
            if total > best[0]:
                best = (total, snapshot)
            time.sleep(args.every)
    if proc.returncode != 0:
        raise RuntimeError(f"the run exited with {proc.returncode}: {(workdir / 'run.log').read_text()[-2000:]}")
    shutil.rmtree(workdir, ignore_errors=True)
    grouped = roles(best[1])
    peers = []
    for owner, parts in grouped.items():
        if owner == "launcher":
            continue
        peer = {role: {"processes": len(rs), **{k: sum(r[k] for r in rs) / MiB for k in FIELDS}}
                for role, rs in parts.items()}
        peer["shared_mib"] = sum(p["Pss_Shmem"] for p in peer.values())  # the transport's buffers, counted once
        peer["total_pss_mib"] = sum(p["Pss"] for p in peer.values() if isinstance(p, dict))
        peers.append(peer)
    return {"peak_total_pss_mib": best[0] / MiB, "peers": peers, "processes": best[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny preset, 12 steps (smoke run)")
    p.add_argument("--model", default="35M")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mode", default="eager")
    p.add_argument("--codec", default="fp4-e3m0")
    p.add_argument("--every", type=float, default=0.5, help="sampling period (s)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.model, args.steps = "tiny", 12
    result = run(args)
    roles_order = ("trainer", "averagers", "dht", "p2pd", "other")
    table = [[i, *(f"{peer[r]['Pss']:.0f} ({peer[r]['processes']})" if r in peer else "-" for r in roles_order),
              f"{peer['shared_mib']:.0f}", f"{peer['total_pss_mib']:.0f}"]
             for i, peer in enumerate(result["peers"])]
    print(f"{args.model}, {args.peers} peers, P = {args.fragments}, {args.mode} {args.codec}: PSS in MiB "
          f"(processes) at the run's peak, {result['peak_total_pss_mib']:.0f} MiB in all")
    print(markdown_table(["peer", *roles_order, "of which shared memory", "peer total"], table))
    out = args.out or RESULTS_DIR / f"peer-memory{'-quick' if args.quick else ''}.json"
    peers = result.pop("peers")  # one row per peer: its processes' PSS by role
    write_result(out, settings=vars(args) | {"out": out}, rows=peers, benchmark="peer_memory", **result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
