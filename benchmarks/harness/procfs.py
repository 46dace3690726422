"""Memory and CPU as Linux reports them (``/proc``): the memory and scaling benchmarks' measures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: resident now, ``VmHWM``: the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _stat(pid: int) -> tuple[int, int, float]:
    """(parent pid, session id, CPU seconds) of a process from ``/proc/PID/stat``: its own user and
    system time (all its threads) plus that of its children it has waited for."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    ppid, session = int(fields[1]), int(fields[3])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, session, (utime + stime + cutime + cstime) / _TICKS


def tree_cpu_seconds(roots: Iterable[int]) -> dict[int, dict[int, float]]:
    """CPU seconds of each process of each root's tree, by root then pid (one scan of ``/proc``).

    A tree is the root, its descendants (by parent pid) and, when the root leads a session, every
    member of it (a daemon that re-parented to init stays counted). A peer's tree holds whatever it
    runs: threads of its own process, forked averagers, the DHT process, p2pd; so its sum stays
    comparable when the transport moves work between them. A process that exited and was not
    waited for by a process of the tree loses its time here."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = _stat(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # it exited meanwhile
    trees = {}
    for root in roots:
        if root not in stats:
            raise ProcessLookupError(f"no process {root}")
        members = {root} | {pid for pid, (_, session, _) in stats.items() if session == root}
        while below := {pid for pid, (ppid, _, _) in stats.items() if ppid in members} - members:
            members |= below
        trees[root] = {pid: stats[pid][2] for pid in members}
    return trees
