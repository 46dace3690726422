"""torch's thread pool in a forked process: the race that failed fresh swarms' first rounds, and its remedy.

Real forks, real torch: a parent sets a thread count and runs a parallel op, then forks children in
which 16 threads run their first parallel op at once. Without ``renew_torch_thread_pool`` some
children hit torch's ``Invalid thread pool!`` (14-21 of 100 here, 16 torch threads); with it,
none may. The control run shows this test can fail: were torch to stop racing, it says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys, threading
import torch
from opendiloco_stream.transport.hivemind.forked import renew_torch_thread_pool

renew, forks = sys.argv[1] == "renew", int(sys.argv[2])
torch.set_num_threads(16)
torch.randn(1_000_000).sum()  # the parent has used its pool before forking, as a peer has
failed, messages = 0, set()
for _ in range(forks):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        if renew:
            renew_torch_thread_pool()
        barrier, errors = threading.Barrier(16), []

        def first_op():
            barrier.wait()
            try:
                (torch.randn(200_000) * 2).sum()
            except RuntimeError as e:
                errors.append(str(e))
        threads = [threading.Thread(target=first_op) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.write(write, json.dumps(errors[:1]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        errors = json.loads(f.read() or '["no report"]')
    os.waitpid(pid, 0)
    failed += bool(errors)
    messages.update(e.splitlines()[0][-40:] for e in errors)
print(json.dumps({"failed": failed, "messages": sorted(messages)}))
"""


def _children(mode: str, forks: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(forks)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_forked_children_race_for_the_thread_pool_unless_it_is_renewed_first():
    control = _children("none", 100)
    assert control["failed"] > 0, ("no child of 100 hit torch's thread-pool race: has torch stopped racing? "
                                   "then renew_torch_thread_pool may no longer be needed")
    assert all("Invalid thread pool" in m for m in control["messages"]), control["messages"]
    renewed = _children("renew", 100)
    assert renewed == {"failed": 0, "messages": []}
