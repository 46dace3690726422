"""The tensors rounds decode into, recycled once the trainer has let go of them.

A round hands the trainer two fresh fp32 tensors (the average and, under a lossy codec, what this
peer sent), which the sync rules keep until a later round replaces them. Allocated anew every
round, each is a 40 MB ``mmap`` for a 10M-element fragment: its pages are faulted in while the round
decodes into it, and unmapped when the trainer drops it. On 3 loopback peers (2 cores) that churn
cost fp4 rounds of a 10M fragment about a fifth of their time (0.28-0.34 s against 0.24-0.25 s
with the memory reused; ``benchmarks/transport_rounds.py``).

``BufferPool`` keeps the memory instead: ``take(numel)`` gives a tensor over a block of the pool
(``torch.from_numpy`` of a numpy view of it). The tensor's storage holds that view; when the last
tensor or view of it is gone, the view is freed and ``weakref.finalize`` returns the block to the
pool. One pool serves every fragment of a peer, so it holds about what fresh tensors would at the
busiest moment (the rounds the rules keep, and the one decoding), and never more than ``keep``
free blocks per size.

On a GPU peer (``pinned=True``) the blocks are pinned (page-locked) host memory: the averages a
round decodes into are copied to the GPU by DMA on a side stream (``algorithm/staging.py``), with
no staging copy through pageable memory and without holding up the training thread.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from opendiloco_stream.compression import native


class BufferPool:
    """Recycled fp32 CPU tensors by size (thread-safe: blocks come back from the trainer's thread);
    ``pinned``: page-locked blocks (a GPU peer's)."""

    def __init__(self, keep: int = 8, pinned: bool = False):
        self.keep, self.pinned = int(keep), bool(pinned)
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # blocks made (counted under the lock; tests read it)

    def take(self, numel: int) -> torch.Tensor:
        """A tensor of ``numel`` fp32 elements (contents undefined), pages faulted in."""
        numel = int(numel)
        with self._lock:
            free = self._free.get(numel)
            block = free.pop() if free else None
        if block is None:
            # the block keeps its torch storage alive; pinned memory is resident already
            block = (torch.empty(numel, pin_memory=True) if self.pinned else native.touched_huge(numel)).numpy()
            with self._lock:
                self.allocated += 1
        view = block[:]  # a new array object over the block: only the tensor below holds it
        weakref.finalize(view, self._give_back, block)
        return torch.from_numpy(view)

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(block.size, [])
            if len(free) < self.keep:
                free.append(block)

    def free_blocks(self, numel: int) -> int:
        with self._lock:
            return len(self._free.get(int(numel), []))

    def clear(self) -> None:
        """Drop the free blocks (tensors still held stay valid: each keeps its own block)."""
        with self._lock:
            self._free.clear()
