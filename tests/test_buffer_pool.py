"""The service's pool of round buffers (transport/hivemind/buffers.py): memory comes back only
once no tensor or view of it is left, and a tensor a rule still holds is never handed out again."""

from __future__ import annotations

import gc

import torch

from opendiloco_stream.transport.hivemind.buffers import BufferPool


def test_a_block_comes_back_only_when_the_last_view_of_it_is_gone():
    pool = BufferPool()
    a = pool.take(1000)
    a.fill_(1.0)
    part = a[10:20]  # a rule keeps a slice (f.split) of the average
    del a
    gc.collect()
    assert pool.free_blocks(1000) == 0
    b = pool.take(1000)  # so this is new memory, and the slice keeps its values
    b.fill_(2.0)
    assert torch.equal(part, torch.ones(10)) and pool.allocated == 2
    ptr = part.data_ptr() - 10 * 4
    del part
    gc.collect()
    assert pool.free_blocks(1000) == 1
    assert pool.take(1000).data_ptr() == ptr and pool.allocated == 2  # the same memory, no new block


def test_blocks_are_kept_by_size_and_only_up_to_keep():
    pool = BufferPool(keep=2)
    held = [pool.take(64) for _ in range(3)] + [pool.take(128)]
    assert all(t.dtype == torch.float32 and t.numel() in (64, 128) for t in held)
    del held
    gc.collect()
    assert pool.free_blocks(64) == 2 and pool.free_blocks(128) == 1
    pool.clear()
    assert pool.free_blocks(64) == 0
