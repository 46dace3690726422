"""A reducer averages a chunk as soon as every sender still OK has sent it (``PartReducer.reduce_ahead``),
before the verdicts; the verdict then keeps that result only if it accepts exactly those senders.
The end-to-end bit-identity of the hivemind runner, which reduces ahead, against the in-process
round, which does not, is in test_reduction_parity.py and test_hivemind_transport.py."""

from __future__ import annotations

import pytest
import torch

from opendiloco_stream.compression import get_codec
from opendiloco_stream.transport.reduce import OK, REJECTED, PartReducer, encode_chunk, weighted_mean

CHUNKS = [(0, 512), (512, 1024)]
WEIGHTS = [1.0, 2.0, 3.0]


def _contributions(codec, n=3, numel=1024, scale=(1.0, 1.0, 1.0, 1.0)):
    g = torch.Generator().manual_seed(7)
    return [encode_chunk(codec, torch.randn(numel, generator=g) * scale[s]) for s in range(n)]


def _reducer(codec, contributions, norm_bound=None, chunks=(0, 1)):
    reducer = PartReducer(codec, CHUNKS, [OK] * len(contributions), norm_bound)
    for j in chunks:
        lo, hi = CHUNKS[j]
        for s, (_, values) in enumerate(contributions):
            payload, _ = encode_chunk(codec, values[lo:hi])  # deterministic codecs: the same bytes again
            assert reducer.take(s, j, payload) == ""
    return reducer


SPARSE = dict(block_size=64, density=0.1)


@pytest.mark.parametrize("codec_name", ["fp32", "fp4-e3m0", "int8", "topk-int2"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_chunk_reduced_ahead_is_the_verdicts_result_bit_for_bit(codec_name, in_place):
    codec = get_codec(codec_name, **(SPARSE if codec_name.startswith("topk") else {}))
    contributions = _contributions(codec)
    plain, ahead = _reducer(codec, contributions), _reducer(codec, contributions)
    result = torch.full((1024,), float("nan"))  # the runner's output buffer
    outs = [result[lo:hi] if in_place else None for lo, hi in CHUNKS]
    for j in range(len(CHUNKS)):
        run = ahead.reduce_ahead(j, WEIGHTS, parts=True, out=outs[j])
        assert run is not None
        assert ahead.reduce_ahead(j, WEIGHTS, parts=True, out=outs[j]) is None  # taken once
        run()
    final = plain.verdict()
    assert final == ahead.verdict() == bytes([OK] * 3)
    for j, (lo, hi) in enumerate(CHUNKS):
        expect = plain.reduce_chunk(j, final, WEIGHTS, parts=True)
        kept = ahead.ahead[j][1]
        got = ahead.reduce_chunk(j, final, WEIGHTS, parts=True, out=outs[j])
        assert got[1] is kept[1]  # the result reduced ahead, not a second reduction
        assert torch.equal(got[1], expect[1])
        assert b"".join(bytes(p) for p in _parts(got[0])) == b"".join(bytes(p) for p in _parts(expect[0]))
        mean = weighted_mean([v[lo:hi] for _, v in contributions], WEIGHTS)
        fmt = codec.result_codec(3)
        assert torch.equal(got[1], mean if fmt is None or fmt.name == "fp32" else fmt.roundtrip(mean))
        if in_place:
            assert got[1].data_ptr() == result[lo:hi].data_ptr()
    if in_place:
        assert torch.equal(result, torch.cat(_plain_results(codec, contributions)))
    assert ahead.ahead == {}
    assert all(v is None for row in ahead.values for v in row)  # the contributions are released


def _plain_results(codec, contributions):
    plain = _reducer(codec, contributions)
    final = plain.verdict()
    return [plain.reduce_chunk(j, final, WEIGHTS)[1] for j in range(len(CHUNKS))]


def _parts(payload):
    return payload if isinstance(payload, tuple) else (payload,)


def test_nothing_is_reduced_ahead_while_a_sender_still_owes_the_chunk():
    codec = get_codec("fp32")
    contributions = _contributions(codec)
    reducer = PartReducer(codec, CHUNKS, [OK] * 3, None)
    for s in range(2):
        payload, _ = encode_chunk(codec, contributions[s][1][:512])
        reducer.take(s, 0, payload)
        assert reducer.reduce_ahead(0, WEIGHTS) is None
    reducer.drop(2, REJECTED)  # the last sender is out: the chunk is complete without it
    run = reducer.reduce_ahead(0, WEIGHTS)
    assert run is not None
    run()
    assert reducer.ahead[0][0] == (0, 1)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_sender_rejected_by_the_norm_check_makes_the_verdict_reduce_again_without_it(in_place):
    codec = get_codec("fp32")
    contributions = _contributions(codec, n=4, scale=(1.0, 1.0, 1.0, 100.0))  # sender 3: 100x the others
    weights = WEIGHTS + [4.0]
    reducer = PartReducer(codec, CHUNKS, [OK] * 4, norm_bound=10.0)
    result = torch.empty(1024)
    outs = [result[lo:hi] if in_place else None for lo, hi in CHUNKS]
    spoilt = []
    for j, (lo, hi) in enumerate(CHUNKS):
        for s, (_, values) in enumerate(contributions):
            payload, _ = encode_chunk(codec, values[lo:hi])
            reducer.take(s, j, payload)
        run = reducer.reduce_ahead(j, weights, out=outs[j])
        run()
        assert reducer.ahead[j][0] == (0, 1, 2, 3)  # ahead, nobody is rejected yet
        spoilt.append(reducer.ahead[j][1][1].clone())
    final = reducer.verdict()
    assert final == bytes([OK, OK, OK, REJECTED])
    for j, (lo, hi) in enumerate(CHUNKS):
        _, got = reducer.reduce_chunk(j, final, weights, out=outs[j])
        assert torch.equal(got, weighted_mean([v[lo:hi] for _, v in contributions[:3]], WEIGHTS))
        assert not torch.equal(got, spoilt[j])
        if in_place:  # the result replaced the one reduced ahead in the buffer
            assert torch.equal(result[lo:hi], got)


@pytest.mark.parametrize("native_kernel", [True, False])
def test_the_weighted_mean_written_in_place_is_the_same_bits(monkeypatch, native_kernel):
    from opendiloco_stream.compression import native
    if not native_kernel:
        monkeypatch.setattr(native, "usable", lambda *tensors: False)  # the torch path
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(10_001, generator=g) * 10 ** k for k in range(3)]
    expect = weighted_mean(values, [0.3, 1.7, 2.9])
    buffer = torch.full((20_000,), float("nan"))
    got = weighted_mean(values, [0.3, 1.7, 2.9], out=buffer[5_000:15_001])
    assert got.data_ptr() == buffer[5_000:].data_ptr()
    assert torch.equal(got, expect)
    assert buffer[:5_000].isnan().all() and buffer[15_001:].isnan().all()  # nothing written outside
