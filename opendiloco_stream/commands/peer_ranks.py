"""``peer --nproc-per-node K``: one peer on K local ranks (``train/ranks.py`` holds the training side).

:func:`launch` starts K processes of the same ``peer`` command line with the torch.distributed
environment (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK`` = ``LOCAL_RANK``,
``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = K), each in its own session and made to get SIGTERM if the
launcher dies, and watches them:

* Ctrl+C / SIGTERM goes to rank 0 as SIGTERM: it stops every rank after the same inner step and
  the peer leaves the run cleanly (exit 0); a second signal kills every rank's process tree.
* A rank that exits with an error or a signal stops the peer: the others are sent SIGTERM (rank 0
  leaves the run; its collectives fail at once on the broken connection), their process trees are
  killed after a grace period, and the launcher exits nonzero (rank 0's own code if it has one,
  else 1, or 128 + the signal that killed the failed rank).

``torchrun --nproc-per-node K -m opendiloco_stream peer ...`` also works (the ranks find the same
variables); the launcher here adds the graceful stop and the clean teardown. :func:`follow` is
what ranks > 0 run.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, NoReturn, Optional, Union

from opendiloco_stream.commands._common import prepare_data
from opendiloco_stream.commands.local_hivemind import stop_processes
from opendiloco_stream.config import check_data_parallel
from opendiloco_stream.config_cli import UsageError
from opendiloco_stream.net.lifecycle import GracefulShutdown, exit_without_teardown

GRACE_S = 15.0  # a failed rank's peers: how long the others get to leave before their trees are killed


def ranks_for(args: argparse.Namespace, cfg: Any) -> Union[None, int, Any]:
    """This process's ``Ranks`` (a rank of a multi-rank peer), None (a one-process peer), or the
    exit code of :func:`launch` (``nproc_per_node`` > 1 and not started as a rank: it was the launcher)."""
    from opendiloco_stream.train.ranks import (  # lazy: loads torch; --help stays light
        Ranks, collective_timeout, rank_env)

    env, k = rank_env(), cfg.train.nproc_per_node
    if env is None and k == 1:
        return None
    check_data_parallel(cfg.diloco.mode, ranked=True)
    if env is None:
        return launch(args, k)
    if k not in (1, env.world):
        raise UsageError(f"--nproc-per-node {k}, but this process is rank {env.rank} of WORLD_SIZE={env.world} "
                         "(started by torchrun?): give one or the other")

    # a rank killed by a fatal signal (a C++ abort in a collective, a segfault) prints every
    # thread's Python stack to the peer's stderr before it dies: the launcher's "rank N ended with
    # signal ..." then comes with where it happened
    faulthandler.enable(file=sys.stderr, all_threads=True)
    return Ranks(env, cfg.train.device, collective_timeout(cfg))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher(launcher: int):
    """A ``preexec_fn``: the child gets SIGTERM when the launcher dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def set_pdeathsig() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)
    return set_pdeathsig


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def launch(args: argparse.Namespace, k: int) -> int:
    """Run ``peer`` on K ranks (this very command line once per rank); the peer's exit code."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(k),
           "LOCAL_WORLD_SIZE": str(k)}
    cmd = [sys.executable, "-m", "opendiloco_stream", *args.argv]
    procs: list[subprocess.Popen] = []
    failed: Optional[int] = None
    with GracefulShutdown() as stop:
        try:
            for r in range(k):
                procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                              start_new_session=True, preexec_fn=_die_with_launcher(os.getpid())))
            forwarded = False
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                if stop.requested and not forwarded:  # rank 0 stops every rank after the same step
                    procs[0].send_signal(signal.SIGTERM)
                    forwarded = True
                time.sleep(0.2) if stop.requested else stop.wait(0.2)
            ended = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if ended:  # a rank killed by a signal is the cause; the others' errors are its consequences
                ended.sort(key=lambda rc: rc[1] >= 0)
                failed = ended[0][0]
                print("opendiloco-stream peer: " + ", ".join(f"rank {r} ended with {_describe(c)}" for r, c in ended)
                      + ": stopping the peer's other ranks", file=sys.stderr, flush=True)
        finally:
            stop_processes(procs, grace=GRACE_S)
    if failed is None:
        return 0
    lead, code = procs[0].returncode, procs[failed].returncode
    if lead is not None and lead > 0:
        return lead
    return 128 - code if code < 0 else max(1, code)


def end_rank(code: int) -> NoReturn:
    """A rank's process ends here, once its process group is destroyed, without the interpreter's
    teardown. FSDP2's device mesh and DDP keep the gloo group's C++ object alive past
    ``destroy_process_group``; freed during finalization, its worker threads can abort the process
    (CI saw a rank end with SIGABRT after its run had finished). Everything the rank wrote is
    flushed first; the DHT, averagers and files were closed by the rank itself."""
    exit_without_teardown(code)


def lost_rank(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank of the peer is gone."""
    import torch.distributed as dist  # lazy: loads torch; --help stays light

    text = str(e)
    return isinstance(e, dist.DistError) or "Connection closed by peer" in text or "Connection reset by peer" in text


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def follow(cfg: Any, ranks: Any) -> int:
    """A rank > 0: rank 0's data shard, then the inner loop with DDP (no transport, no metrics)."""
    from opendiloco_stream.train.loop import train_worker  # lazy: loads torch; --help stays light
    from opendiloco_stream.train.ranks import data_shard  # lazy: loads torch; --help stays light

    try:
        train_source, val, vocab_size = prepare_data(cfg)
        rank, world = data_shard(ranks.share(), ranks.rank, ranks.world)  # rank 0 knows its shard once it has a peer id
        train_worker(rank, world, cfg, None, train_source, val, vocab_size, lambda rec: None, ranks=ranks)
    except RuntimeError as e:
        if not lost_rank(e):
            raise
        print(f"opendiloco-stream peer (rank {ranks.rank}): rank 0 is gone ({first_line(e)})", file=sys.stderr)
        return 1
    finally:
        ranks.close()
    return 0
