"""One reduction core: LocalSwarm predicts the hivemind transport's averages bit for bit.

The same inputs (tensors, weights, codec, chunk size, group order) go through ``LocalSwarm`` in
this process and through 3 real hivemind peers on 127.0.0.1 (``benchmarks/harness/loopback.py``); the
averages must be equal bit for bit, and so must what each member sent and the verdict (group
size, rejected contributions, weight shares). The peers run torch with one thread, this process
with several: the core's arithmetic must not depend on that.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.harness.loopback import LoopbackSwarm, make_tensor
from opendiloco_stream.transport.local import LocalSwarm

N = 100_003  # parts of ~33k elements (above torch's parallel grain), not a multiple of any block
CHUNK_BYTES = 1 << 16  # fp32: several chunks per part; fp4: one chunk per part
TIMEOUTS = dict(target_group_size=3, matchmaking_time=3.0, request_timeout=1.0, next_chunk_timeout=15.0,
                allreduce_timeout=40.0)


@pytest.fixture(scope="module", params=["fp4-e3m0", "fp32", "topk-int2"])
def peers(request):
    codec = request.param
    swarm = LoopbackSwarm(3, run_id=f"parity_{codec.replace('-', '_')}",
                          transport_kwargs=dict(codec=codec, chunk_bytes=CHUNK_BYTES, **TIMEOUTS))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: N}, timeout=120)
        yield codec, swarm
    finally:
        swarm.close()


def local_round(codec: str, tensors: list[torch.Tensor], weights: list[float], key: tuple[int, int]) -> list:
    swarm = LocalSwarm(len(tensors), codec=codec, chunk_bytes=CHUNK_BYTES, timeout=30)

    def worker(rank):
        return swarm.transport(rank).all_reduce(key, tensors[rank], weights[rank]).wait()

    return swarm.run(worker)


@pytest.mark.network
@pytest.mark.timeout(300)
@pytest.mark.parametrize("round_index, weights, offsets", [
    (0, [1.0, 2.0, 3.0], [0.0, 1.0, -0.5]),
    (1, [3.0, 0.5, 1.25], [0.25, 0.0, 2.0]),
    (2, [1.0, 1.0, 1.0], [0.0, 1e4, 0.5]),  # peer 1's norm is ~10^4 x the others': rejected by both
])
def test_local_swarm_and_hivemind_peers_give_bit_identical_averages(peers, round_index, weights, offsets):
    codec, swarm = peers
    args = [dict(seed=100 * round_index + i, numel=N, offset=offsets[i], weight=weights[i]) for i in range(3)]
    wire = swarm.call_all("all_reduce", (0, round_index), per_peer=args, timeout=120)
    assert all(r["ok"] for r in wire), wire
    index_of = {p.peer_id: i for i, p in enumerate(swarm.peers)}
    accepted = [index_of[pid] for pid in wire[0]["peers"]]  # group order, as the leader set it
    order = accepted + [i for i in range(3) if i not in accepted]  # a rejected member's place does not matter

    tensors = [make_tensor(args[i]["seed"], N, args[i]["offset"]) for i in order]
    local = local_round(codec, tensors, [weights[i] for i in order], (0, round_index))

    expect_rejected = 1 if round_index == 2 else 0
    for member, i in enumerate(order):
        w, loc = wire[i], local[member]
        assert torch.equal(loc.average, w["average"]), (codec, round_index, (loc.average - w["average"]).abs().max())
        assert torch.equal(loc.sent, w["sent"])
        assert (loc.group_size, loc.rejected, loc.included_self) == (w["group_size"], w["rejected"], w["included_self"])
        assert loc.weight_share == pytest.approx(w["weight_share"], rel=1e-12)
        assert loc.rejected == expect_rejected and loc.group_size == 3 - expect_rejected


@pytest.mark.parametrize("codec", ["fp32", "fp4-e3m0", "int8", "topk-int2"])
def test_the_codec_floor_does_each_peers_work_and_gets_the_round_average(codec):
    """benchmarks/harness/codec_work.py times one peer's codec work of a round, mirroring the runner. Each
    peer's average, from its own part reduced and the others' parts decoded, must be the in-process
    round's bit for bit (``measure`` raises otherwise), and the floor is the peers' work over the cores."""
    from benchmarks.harness import codec_work

    row = codec_work.measure(codec, N, peers=3, repeats=1, chunk_bytes=CHUNK_BYTES, keep_freed_memory=False)
    assert len(row["peer_work_s"]) == 3 and all(t > 0 for t in row["peer_work_s"])
    assert row["cores"] == min(3, os.cpu_count() or 1)
    assert row["floor_s"] == pytest.approx(sum(row["peer_work_s"]) / row["cores"])


def test_the_codec_floor_notices_a_wrong_average(monkeypatch):
    """The check behind the floor can fail: a decoder that zeroes the other parts gives another average."""
    from benchmarks.harness import codec_work

    real = codec_work.decode_result

    def zero_the_parts_of_others(codec, payload, final, weights, numel, out=None):
        result = real(codec, payload, final, weights, numel, out=out)
        return result if out is None else out.zero_()

    monkeypatch.setattr(codec_work, "decode_result", zero_the_parts_of_others)
    with pytest.raises(AssertionError, match="differs from the in-process round"):
        codec_work.measure("fp32", N, peers=3, repeats=1, chunk_bytes=CHUNK_BYTES, keep_freed_memory=False)


@pytest.mark.network
@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["fp32", "fp4-e3m0"])
def test_peers_cutting_different_chunk_sizes_average_together(codec):
    """Chunk sizes derive from each peer's own link rate, so a group mixes them: every member cuts
    the smallest size announced at matchmaking. The round succeeds, and each member's average is
    the in-process round's bit for bit (which cuts one size of its own)."""
    sizes = [1 << 12, 1 << 14, 1 << 16]
    overrides = {i: dict(chunk_bytes=c) for i, c in enumerate(sizes)}
    with LoopbackSwarm(3, run_id=f"mixed_chunks_{codec.replace('-', '_')}", peer_overrides=overrides,
                       transport_kwargs=dict(codec=codec, **TIMEOUTS)) as swarm:
        swarm.call_all("prepare", {0: N}, timeout=120)
        weights = [1.0, 2.0, 0.5]
        args = [dict(seed=700 + i, numel=N, weight=weights[i]) for i in range(3)]
        wire = swarm.call_all("all_reduce", (0, 0), per_peer=args, timeout=120)
        assert all(r["ok"] for r in wire), wire
        index_of = {p.peer_id: i for i, p in enumerate(swarm.peers)}
        order = [index_of[pid] for pid in wire[0]["peers"]]
    assert sorted(order) == [0, 1, 2]
    tensors = [make_tensor(700 + i, N) for i in order]
    local = local_round(codec, tensors, [weights[i] for i in order], (0, 0))
    for member, i in enumerate(order):
        assert wire[i]["group_size"] == 3
        assert torch.equal(local[member].average, wire[i]["average"]), (codec, i)
