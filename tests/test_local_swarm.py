"""LocalSwarm: the in-process transport behaves like the wire (bytes, bit-identical results, bounds)."""

from __future__ import annotations

import pytest
import torch

from opendiloco_stream.compression import get_codec
from opendiloco_stream.transport.base import SyncFailed
from opendiloco_stream.transport.local import LocalSwarm
from opendiloco_stream.transport.layout import GroupLayout, codec_alignment


def reduce_all(swarm, tensors, weights, key=(0, 0)):
    out = [None] * swarm.num_workers

    def worker(rank):
        out[rank] = swarm.transport(rank).all_reduce(key, tensors[rank], weights[rank]).wait(10)

    swarm.run(worker)
    return out


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1"])
def test_every_worker_gets_bit_identical_averages(codec):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1001, generator=g) for _ in range(3)]
    res = reduce_all(LocalSwarm(3, codec=codec), tensors, [1.0, 1.0, 1.0])
    assert all(torch.equal(r.average, res[0].average) for r in res)
    true = sum(tensors) / 3
    rel = (res[0].average - true).norm() / true.norm()
    assert rel < {"fp32": 1e-6, "fp16": 1e-3, "int8": 1e-2, "fp8-e4m3": 5e-2}.get(codec, 0.3), rel
    c = get_codec(codec)
    layout = GroupLayout.for_codec(c, 1001, [True] * 3)  # part j is reduced (and encoded) separately
    bounds = [lo for lo, _ in layout.parts] + [1001]
    assert all(lo % codec_alignment(c) == 0 for lo in bounds[:-1])  # parts on whole codec blocks, as on the wire
    for r, t in zip(res, tensors):  # `sent` is what the wire carried: deQ(Q(part)) for every part
        expected = torch.cat([c.roundtrip(t[bounds[j]:bounds[j + 1]]) for j in range(3)])
        assert torch.equal(r.sent, expected)
        assert torch.equal(r.sent, c.roundtrip(t))  # block-aligned parts: the same as encoding it whole


def test_weights_are_tokens_and_shares_are_reported():
    tensors = [torch.full((8,), 1.0), torch.full((8,), 5.0)]
    res = reduce_all(LocalSwarm(2), tensors, [1.0, 3.0])
    assert torch.allclose(res[0].average, torch.full((8,), 4.0))  # (1*1 + 5*3) / 4
    assert res[0].weight_share == 0.25 and res[1].weight_share == 0.75
    assert res[0].group_size == 2 and res[0].included_self


def test_byte_counts_match_the_butterfly_wire_format():
    M, n = 4, 4096  # 64 blocks of 64: four equal parts (parts are cut on whole blocks)
    codec = get_codec("fp4-e3m0")
    res = reduce_all(LocalSwarm(M, codec="fp4-e3m0"), [torch.randn(n) for _ in range(M)], [1.0] * M)
    part = codec.encoded_size(n // M)
    # a worker sends its 3 foreign parts and its averaged part to 3 peers; receives the mirror image
    assert all(r.bytes_sent == 2 * (M - 1) * part and r.bytes_received == 2 * (M - 1) * part for r in res)


def test_byte_counts_follow_the_block_aligned_layout_when_parts_differ():
    M, n = 4, 4000  # 62.5 blocks: parts of 15, 16, 16 and 15.5 blocks
    codec = get_codec("fp4-e3m0")
    res = reduce_all(LocalSwarm(M, codec="fp4-e3m0"), [torch.randn(n) for _ in range(M)], [1.0] * M)
    sizes = [codec.encoded_size(hi - lo) for lo, hi in GroupLayout.for_codec(codec, n, [True] * M).parts]
    assert len(set(sizes)) > 1
    for r, mine in zip(res, sizes):
        foreign = sum(sizes) - mine
        assert r.bytes_sent == foreign + (M - 1) * mine and r.bytes_received == (M - 1) * mine + foreign


def test_nan_contribution_is_rejected_and_counted():
    tensors = [torch.ones(16), torch.ones(16) * 3, torch.full((16,), float("nan"))]
    res = reduce_all(LocalSwarm(3), tensors, [1.0, 1.0, 1.0])
    assert torch.equal(res[0].average, torch.full((16,), 2.0))
    assert res[0].group_size == 2 and res[0].rejected == 1 and not res[2].included_self


def test_a_missing_worker_costs_a_bounded_wait_not_a_hang():
    swarm = LocalSwarm(2, timeout=0.5)
    handle = swarm.transport(0).all_reduce((0, 0), torch.ones(4))
    # done() waits for the other workers (the swarm models an instant link) but only up to the bound;
    # the round is then settled as failed, and wait() raises at once
    assert handle.done()  # returns (pytest-timeout bounds the test), the round settled as failed
    with pytest.raises(SyncFailed) as e:
        handle.wait()
    assert e.value.reason == "timeout"


def test_done_means_every_worker_launched_the_round():
    """The instant-link model: done() returns once all workers have contributed, with the result."""
    swarm = LocalSwarm(2, timeout=10)
    out = {}

    def worker(rank):
        handle = swarm.transport(rank).all_reduce((0, 0), torch.full((4,), float(rank)))
        assert handle.done()
        out[rank] = handle.wait(timeout=0.0).average

    swarm.run(worker)
    assert torch.equal(out[0], torch.full((4,), 0.5)) and torch.equal(out[1], out[0])


def test_a_failing_worker_aborts_the_others_instead_of_hanging_them():
    swarm = LocalSwarm(2, timeout=60)

    def worker(rank):
        if rank == 1:
            raise RuntimeError("boom")
        swarm.transport(0).all_reduce((0, 0), torch.ones(4)).wait()

    with pytest.raises(RuntimeError, match="boom"):
        swarm.run(worker)


def test_the_norm_bound_and_zero_weights_are_judged_as_on_the_wire():
    """The shared core validates locally too: an outlier norm is rejected, weight 0 abstains."""
    tensors = [torch.ones(64), torch.ones(64) * 3, torch.ones(64) * 2, torch.ones(64) * 1e5]
    res = reduce_all(LocalSwarm(4), tensors, [1.0, 1.0, 0.0, 1.0])
    assert torch.equal(res[0].average, torch.full((64,), 2.0))  # (1 + 3) / 2: abstainer and outlier left out
    assert [r.included_self for r in res] == [True, True, False, False]
    assert all(r.group_size == 2 and r.rejected == 1 and r.peers == ["0", "1"] for r in res)
    assert res[0].weight_share == 0.5 and res[2].weight_share == 0.0
    relaxed = reduce_all(LocalSwarm(4, norm_bound=None), tensors, [1.0, 1.0, 0.0, 1.0])
    assert relaxed[0].group_size == 3 and relaxed[3].included_self  # the check can be turned off


def test_contributions_of_different_sizes_fail_the_round_for_everyone():
    swarm = LocalSwarm(2, timeout=5)
    errors = []

    def worker(rank):
        try:
            swarm.transport(rank).all_reduce((0, 0), torch.ones(8 + rank)).wait()
        except SyncFailed as e:
            errors.append(e.reason)

    swarm.run(worker)
    assert errors == ["rejected", "rejected"]
