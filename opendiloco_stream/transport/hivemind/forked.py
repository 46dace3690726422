"""What a forked averager process (``averager.FragmentAverager``) has to set right before its threads start."""

from __future__ import annotations

import threading

import torch


def renew_torch_thread_pool() -> None:
    """Let torch replace its inherited thread pool once, from one thread, before any other uses it.

    After a fork, torch marks the thread pool inherited from the parent as corrupt (its threads do
    not exist in the child), and the next call that asks for the pool replaces it. That replacement
    is not guarded: while one thread builds the new pool, a second thread asking for it gets none,
    and its parallel op fails with ``pool INTERNAL ASSERT FAILED ... Invalid thread pool!``
    (``ATen/ParallelOpenMP.cpp``). Each thread asks once, on its first parallel op, when the
    process has set a thread count (``torch.set_num_threads``, which ``peer`` and ``local`` do).
    So the averager's executor threads, encoding the first round's chunks at the same time, raced:
    every fresh swarm's first round failed on a 16-core GPU machine, now and then one here.

    The replacement runs in a new thread: the main thread did its first parallel op before the
    fork and would not ask again, and a parallel op in the forked main thread hangs in its
    inherited OpenMP team. ``tests/test_forked.py`` reproduces the race and this remedy."""
    def renew() -> None:
        torch.set_num_threads(torch.get_num_threads())  # asks for the pool: replaces it if inherited

    thread = threading.Thread(target=renew, name="ods-renew-torch-pool")
    thread.start()
    thread.join()
