"""The averager's executor work once more after torch's 'Invalid thread pool!'.

A fake failure: the error came from torch's thread pool in a forked averager process on a 16-core
GPU machine (torch 2.11), in every fresh swarm's first round, and cannot be produced here (2 cores,
torch 2.13). The functions below raise that error's message the way torch did."""

from __future__ import annotations

import pytest

from opendiloco_stream.transport.hivemind.forked import once_more_on_bad_pool

TORCH_MESSAGE = ('pool INTERNAL ASSERT FAILED at "/pytorch/aten/src/ATen/ParallelOpenMP.cpp":64, '
                 'please report a bug to PyTorch. Invalid thread pool!')


def _failing(times: int, message: str = TORCH_MESSAGE):
    calls = []

    def fn(a, b):
        calls.append((a, b))
        if len(calls) <= times:
            raise RuntimeError(message)
        return a + b
    return fn, calls


def test_a_first_bad_pool_error_is_run_once_more_with_the_same_arguments():
    fn, calls = _failing(1)
    assert once_more_on_bad_pool(fn, 2, 3) == 5
    assert calls == [(2, 3), (2, 3)]


def test_a_second_bad_pool_error_and_any_other_error_are_raised():
    fn, calls = _failing(2)
    with pytest.raises(RuntimeError, match="Invalid thread pool"):
        once_more_on_bad_pool(fn, 1, 1)
    assert len(calls) == 2
    fn, calls = _failing(1, "some other failure")
    with pytest.raises(RuntimeError, match="some other failure"):
        once_more_on_bad_pool(fn, 1, 1)
    assert len(calls) == 1  # not retried
