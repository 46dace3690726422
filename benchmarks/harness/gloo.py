"""gloo's reference for the transport benchmarks: a ``torch.distributed`` gloo fp32 all_reduce of
the same tensor between the same number of processes on this machine, one torch thread each (as
the loopback peers).

- :class:`GlooRanks`: the ranks kept alive, timing rounds on command. ``transport_rounds.py`` times
  gloo before and after its rows, and between its rounds, with the swarm up and waiting: gloo's
  own time moved between 0.040 and 0.067 s inside single runs here, so a ratio to a reference
  timed minutes apart says as much about the machine's state as about the transport.
- :func:`measure_gloo_netns`: each rank in a peer's network namespace, behind the shaped link.

A time is the slowest rank's ``all_reduce`` of a round (after a barrier); round 0 is a warm-up.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness.loopback import make_tensor

GLOO_ROUNDS = 20  # a reference timed alone: at least this many rounds (a median over a few moved 1.5x)


def time_all_reduces(tensor, rounds: int) -> list[float]:
    """This rank's time of each of ``rounds`` all_reduces of a copy of ``tensor`` (each after a
    barrier), after one warm-up round; the process group is initialized."""
    import torch.distributed as dist

    times = []
    for rnd in range(rounds + 1):
        work = tensor.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(work)
        if rnd:  # round 0 is the warm-up
            times.append(time.perf_counter() - t0)
    return times


def _serve_rank(rank: int, world: int, port: int, conn) -> None:
    """A rank: ``(numel, rounds)`` -> its times of ``rounds`` timed all_reduces; None ends it."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors: dict[int, torch.Tensor] = {}
    try:
        while (command := conn.recv()) is not None:
            numel, rounds = command
            conn.send(time_all_reduces(tensors.setdefault(numel, make_tensor(rank, numel)), rounds))
    finally:
        dist.destroy_process_group()


class GlooRanks:
    """``peers`` gloo ranks on 127.0.0.1 (spawned processes), timing rounds on command; a context
    manager that always stops them."""

    def __init__(self, peers: int, timeout: float = 600.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.timeout, self.conns, self.procs = timeout, [], []
        for r in range(peers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_rank, args=(r, peers, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def times(self, numel: int, rounds: int) -> list[float]:
        """The slowest rank's time of each of ``rounds`` rounds (after one warm-up round)."""
        for conn in self.conns:
            conn.send((numel, rounds))
        per_rank = []
        for r, conn in enumerate(self.conns):
            if not conn.poll(self.timeout):
                raise TimeoutError(f"gloo rank {r} did not answer within {self.timeout:.0f} s")
            per_rank.append(conn.recv())
        return [max(times[i] for times in per_rank) for i in range(rounds)]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)

    def __enter__(self) -> "GlooRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_GLOO_RANK = r"""
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from benchmarks.harness.gloo import time_all_reduces
from benchmarks.harness.loopback import make_tensor
rank, world, addr, numel, rounds = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world)
times = time_all_reduces(make_tensor(rank, numel), rounds)
dist.destroy_process_group()
print(json.dumps(times), flush=True)
"""


def measure_gloo_netns(topo, numel: int, rounds: int, peers: int, timeout: float = 600) -> float:
    """Median over rounds of the slowest rank's ``all_reduce`` time, each rank in its peer namespace
    behind the shaped link (TCP on ``wan0``)."""
    addr = f"{topo.ip('p0')}:{random.randint(20000, 60000)}"  # fresh namespaces: nothing else listens
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "wan0"}
    root = str(Path(__file__).resolve().parents[2])
    procs = [subprocess.Popen(topo.exec_argv(f"p{r}", [sys.executable, "-c", _GLOO_RANK, root, str(r), str(peers), addr,
                                                        str(numel), str(rounds)]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(peers)]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (out, err) in zip(procs, outs):
        if proc.returncode != 0:
            raise RuntimeError(f"gloo rank failed in its namespace: {err[-800:]}")
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return statistics.median(max(times[i] for times in per_rank) for i in range(rounds))


def time_gloo(numel: int, rounds: int, peers: int, topo=None, ranks: Optional[GlooRanks] = None) -> float:
    """gloo's reference for a row, timed alone: the median of at least ``GLOO_ROUNDS`` rounds, over
    ``topo``'s links between ``peers`` ranks, else in ``ranks`` on loopback."""
    rounds = max(rounds, GLOO_ROUNDS)
    if topo is not None:
        return measure_gloo_netns(topo, numel, rounds, peers)
    if ranks is None:
        raise ValueError("time_gloo needs the namespaces (topo) or running gloo ranks")
    return statistics.median(ranks.times(numel, rounds))
