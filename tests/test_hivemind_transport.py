"""The hivemind transport: protocol pieces in-process, then real peers on 127.0.0.1.

Networked tests start peers with ``LoopbackSwarm`` (one spawned process per peer, each in its own
session with its own DHT bootstrapped from peer 0); the swarm is closed, and every peer's process
group SIGKILLed, in a ``finally`` block. Faults are injected by ``FaultyRunner`` below, a test
double of the all-reduce runner that misbehaves on a fixed schedule of (fragment, round) keys;
peers import it from this module by name.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from opendiloco_stream.compression import get_codec
from opendiloco_stream.testing import faults
from benchmarks.harness.loopback import LoopbackSwarm, make_tensor, peer_signal
from opendiloco_stream.transport.hivemind import HivemindTransport
from opendiloco_stream.transport.hivemind.protocol import (
    DONE, RESULT, ProtocolError, pack_frame, unpack_frame,
)
from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner, _message
from opendiloco_stream.transport.hivemind.state import StateError, flatten_state, unflatten_state
from opendiloco_stream.transport.hivemind.timeouts import BACKSTOP_S, GRACE_S, derive_timeouts
from opendiloco_stream.transport.layout import GroupLayout, chunk_numel_for, codec_alignment
from opendiloco_stream.transport.reduce import (
    ABSTAINED, MISSING, OK, PROTOCOL_VERSION, REJECTED, GroupMismatch, check_chunk, combine_verdicts, judge_members,
    norm_verdict, weighted_mean,
)

MODULE = __name__  # peers import the fakes below as f"{MODULE}:..."


# ---------------------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 262_151])
@pytest.mark.parametrize("reducers", [[True], [True, True, True], [True, False, True, True]])
def test_layout_covers_every_element_once_on_block_boundaries(numel, reducers):
    codec = get_codec("fp4-e3m0", block_size=64)
    align = codec_alignment(codec)
    layout = GroupLayout.build(numel, reducers, align, chunk_numel_for(codec, 4096, align))
    covered = [c for chunks in layout.chunks for c in chunks]
    assert sorted(covered) == covered  # parts in group order, chunks in order
    assert sum(hi - lo for lo, hi in covered) == numel
    assert all(lo % align == 0 for lo, _ in covered)
    for i, is_reducer in enumerate(reducers):
        if not is_reducer:
            assert layout.chunks[i] == () and layout.parts[i][0] == layout.parts[i][1]
    sizes = [hi - lo for (lo, hi), r in zip(layout.parts, reducers) if r]
    assert max(sizes) - min(sizes) <= align  # equal shares up to one block


def test_chunked_encoding_equals_whole_tensor_encoding():
    # What makes SyncResult.sent == codec.roundtrip(tensor): chunks never split a block.
    codec = get_codec("fp4-e3m0", block_size=32)
    x = make_tensor(3, 10_007)
    layout = GroupLayout.build(x.numel(), [True, True, True], codec_alignment(codec), 1000)
    pieces = [codec.decode(codec.encode(x[lo:hi])) for chunks in layout.chunks for lo, hi in chunks]
    assert torch.equal(torch.cat(pieces), codec.roundtrip(x))


def test_frames_roundtrip_and_reject_garbage():
    data = pack_frame(RESULT, 7, b"payload", bytes([OK, REJECTED]), 3.5)
    frame = unpack_frame(data)
    assert (frame.kind, frame.chunk, frame.status, frame.total_weight, frame.payload) == (
        RESULT, 7, bytes([OK, REJECTED]), 3.5, b"payload")
    for bad in (b"", data[:5], b"XXXX" + data[4:], data[:4] + bytes([99]) + data[5:]):
        with pytest.raises(ProtocolError):
            unpack_frame(bad)
    with pytest.raises(ProtocolError):
        unpack_frame(pack_frame(DONE, 0, b"", bytes([OK] * 3))[:-1])  # cut inside the status vector


def test_check_chunk_rejects_wrong_size_format_and_nonfinite():
    codec = get_codec("int8", block_size=64)
    x = make_tensor(0, 256)
    values, why = check_chunk(codec, codec.encode(x), 256)
    assert why == "" and torch.equal(values, codec.roundtrip(x))
    assert check_chunk(codec, codec.encode(x), 255)[0] is None  # size
    assert check_chunk(codec, codec.encode(x)[:-1], 256)[0] is None  # truncated
    assert check_chunk(codec, get_codec("fp4-e3m0").encode(x), 256)[0] is None  # another format
    poisoned = bytearray(codec.encode(x))
    poisoned[24:26] = b"\x00\x7e"  # first block scale := fp16 NaN
    assert check_chunk(codec, bytes(poisoned), 256)[0] is None


def test_verdicts_combine_to_the_most_severe_status():
    assert combine_verdicts([bytes([OK, OK, MISSING]), bytes([OK, REJECTED, OK])]) == bytes([OK, REJECTED, MISSING])
    assert combine_verdicts([bytes([ABSTAINED, OK])]) == bytes([ABSTAINED, OK])


def test_norm_bound_needs_three_contributions_and_spares_honest_ones():
    assert norm_verdict([OK, OK], [1.0, 1e12], 10.0) == [OK, OK]  # two: cannot tell who is wrong
    assert norm_verdict([OK, OK, OK], [1.0, 4.0, 1e6], 10.0) == [OK, OK, REJECTED]
    assert norm_verdict([OK, OK, OK, REJECTED], [1.0, 1.5, 2.0, 1e9], 10.0) == [OK, OK, OK, REJECTED]
    assert norm_verdict([OK, OK, OK], [1.0, 4.0, 1e6], None) == [OK, OK, OK]


def test_weighted_mean_is_deterministic_fp32():
    xs = [make_tensor(i, 1000) for i in range(3)]
    expected = (xs[0] * 1 + xs[1] * 2 + xs[2] * 3) / 6
    out = weighted_mean([x.clone() for x in xs], [1.0, 2.0, 3.0])
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(out, weighted_mean([x.clone() for x in xs], [1.0, 2.0, 3.0]))


@pytest.mark.parametrize("codec_name", ["fp4-e3m0", "int8", "topk-int2", "fp32"])
def test_a_part_too_big_to_keep_decoded_keeps_the_bytes_and_reduces_to_the_same_bits(codec_name):
    """Above ``decoded_limit`` a lossy codec's contributions wait as their bytes (decoded again when
    reduced), not as fp32 values; the results are the same bits. fp32 always keeps its values: they
    are views of the received bytes."""
    from opendiloco_stream.transport.reduce import PartReducer

    codec = get_codec(codec_name)
    align = codec_alignment(codec)
    chunks = GroupLayout.build(20_000, [True], align, align * max(1, 4096 // align)).chunks[0]  # several chunks
    contributions = [[codec.encode(make_tensor(10 * s + j, hi - lo)) for j, (lo, hi) in enumerate(chunks)]
                     for s in range(3)]
    outcomes = []
    for limit in (1 << 30, 0):  # kept decoded / kept encoded
        part = PartReducer(codec, chunks, [OK] * 3, None, decoded_limit=limit)
        for s in range(3):
            for j in range(len(chunks)):
                assert part.take(s, j, contributions[s][j]) == ""
        decoded = [v for row in part.values for v in row if v is not None]
        final = part.verdict()
        reduced = [part.reduce_chunk(j, final, [1.0, 2.0, 0.5]) for j in range(len(chunks))]
        outcomes.append((len(decoded), bytes(final), [bytes(p) for p, _ in reduced], [r for _, r in reduced]))
    (kept_decoded, final_a, bytes_a, results_a), (kept_encoded, final_b, bytes_b, results_b) = outcomes
    assert len(chunks) > 1 and kept_decoded == 3 * len(chunks)
    assert kept_encoded == (3 * len(chunks) if codec_name == "fp32" else 0)
    assert final_a == final_b and bytes_a == bytes_b
    assert all(torch.equal(a, b) for a, b in zip(results_a, results_b))


def test_group_metadata_gives_weights_and_refuses_mismatched_peers():
    def member(w, **kw):
        return dict(dict(v=PROTOCOL_VERSION, w=w, spec=["fp4-e3m0", 64, "fp16"], numel=100, key=[0, 3]), **kw)

    weights, status = judge_members([member(2.0), member(0), member(float("nan")), member(5)], 0,
                                    [False, False, False, True])
    assert weights == [2.0, 0.0, 0.0, 5.0] and status == [OK, ABSTAINED, REJECTED, ABSTAINED]
    for other in (member(1.0, key=[0, 4]), member(1.0, numel=99), member(1.0, spec=["fp16", 0, ""]), member(1.0, v=0)):
        with pytest.raises(GroupMismatch):
            judge_members([member(1.0), other], 0, [False, False])


# ---------------------------------------------------------------------------------------- timeouts
def test_timeouts_follow_the_hierarchy_and_scale_with_the_payload():
    small = derive_timeouts(encoded_bytes=10_000, numel=10_000, chunk_bytes=1 << 20, link_mbit=100,
                            request_timeout=3, matchmaking_time=5)
    big = derive_timeouts(encoded_bytes=400_000_000, numel=100_000_000, chunk_bytes=1 << 20, link_mbit=100,
                          request_timeout=3, matchmaking_time=5)
    for t in (small, big):
        assert t.request < t.matchmaking < t.allreduce and t.next_chunk < t.allreduce
    assert big.allreduce > 3 * 2 * 400_000_000 * 8 / 100e6  # safety x transfer time
    assert small.allreduce < big.allreduce


def test_chunks_follow_the_link_rate_and_keep_the_silence_bound_of_slow_links():
    from opendiloco_stream.config import RunConfig
    from opendiloco_stream.transport.factory import chunk_bytes
    from opendiloco_stream.transport.layout import MAX_CHUNK_BYTES, chunk_bytes_for_link

    sizes = [chunk_bytes_for_link(r) for r in (1, 5, 100, 200, 1000, 1700, 10_000, 100_000)]
    assert sizes[:4] == [1 << 20] * 4  # slow links keep 1 MiB chunks
    assert sizes[4] == 5_000_000 and sizes[-2:] == [MAX_CHUNK_BYTES] * 2
    assert sizes == sorted(sizes)
    for rate in (200, 1000, 10_000):  # a derived chunk never widens the silence bound past 40 ms of link time
        t = derive_timeouts(encoded_bytes=10_000_000, numel=10_000_000, chunk_bytes=chunk_bytes_for_link(rate),
                            link_mbit=rate, request_timeout=3, matchmaking_time=5)
        assert t.next_chunk <= derive_timeouts(encoded_bytes=10_000_000, numel=10_000_000, chunk_bytes=1 << 20,
                                               link_mbit=200, request_timeout=3, matchmaking_time=5).next_chunk + 1e-9
    with pytest.raises(ValueError, match="link_mbit"):
        chunk_bytes_for_link(0)
    cfg = RunConfig()
    assert cfg.net.chunk_bytes is None and chunk_bytes(cfg) == chunk_bytes_for_link(cfg.net.link_mbit)
    fast = RunConfig(net={"link_mbit": 1000})
    assert chunk_bytes(fast) == 5_000_000
    given = RunConfig(net={"link_mbit": 1000, "chunk_bytes": 65536})
    assert chunk_bytes(given) == 65536


def test_a_group_with_mixed_chunk_sizes_cuts_the_smallest():
    from opendiloco_stream.transport.layout import DEFAULT_CHUNK_BYTES, group_chunk_bytes
    from opendiloco_stream.transport.reduce import member_metadata

    codec = get_codec("fp4-e3m0")
    users = [member_metadata(codec, 100_000, (0, 1), 1.0, c) for c in (1 << 16, 4096, 8 << 20)]
    assert group_chunk_bytes(users) == 4096
    assert group_chunk_bytes([users[0], users[2]]) == 1 << 16
    unusable = [dict(users[2], chunk=True), dict(users[2], chunk=1 << 40), dict(users[2], chunk=100),
                {k: v for k, v in users[2].items() if k != "chunk"}]
    for bad in unusable:  # unusable or missing: the size peers cut before sizes were announced
        assert group_chunk_bytes([users[2], bad]) == DEFAULT_CHUNK_BYTES


def test_timeouts_fit_the_window_or_say_why_not():
    t = derive_timeouts(encoded_bytes=400_000_000, numel=100_000_000, chunk_bytes=1 << 20, link_mbit=100,
                        request_timeout=1, matchmaking_time=2, window_s=60)
    assert t.round_bound <= 60 + 1e-9 and t.allreduce == pytest.approx(60 - 2 - 1 - BACKSTOP_S - GRACE_S)
    with pytest.raises(ValueError, match="window_s"):
        derive_timeouts(encoded_bytes=1, numel=1, chunk_bytes=1, link_mbit=100, request_timeout=1,
                        matchmaking_time=2, window_s=6)
    with pytest.raises(ValueError, match="does not fit the window"):
        derive_timeouts(encoded_bytes=1, numel=1, chunk_bytes=1, link_mbit=100, request_timeout=1,
                        matchmaking_time=2, allreduce_timeout=100, window_s=30)
    with pytest.raises(ValueError, match="request_timeout"):
        derive_timeouts(encoded_bytes=1, numel=1, chunk_bytes=1, link_mbit=100, request_timeout=5, matchmaking_time=5)


def test_transport_rejects_bad_arguments_in_one_line():
    for kwargs, match in ((dict(run_id="a.b"), "run_id"), (dict(run_id="r", codec="fp5"), "unknown codec"),
                          (dict(run_id="r", target_group_size=1), "target_group_size"),
                          (dict(run_id="r", request_timeout=9.0), "request_timeout"),
                          (dict(run_id="r", chunk_bytes=100), "chunk_bytes")):
        with pytest.raises(ValueError, match=match):
            HivemindTransport(None, **kwargs)


# ---------------------------------------------------------------------------------------- state
def test_state_flattens_and_restores_nested_structures():
    state = {"step": 3, "outer": [torch.arange(5.0), torch.zeros(2, 3, dtype=torch.bfloat16)],
             "opt": {0: {"momentum_buffer": torch.ones(4)}}, "meta": ("eager", 0.5, None, b"x")}
    manifest, tensors = flatten_state(state)
    restored = unflatten_state(manifest, [t.clone() for t in tensors])
    assert restored["step"] == 3 and restored["meta"] == ("eager", 0.5, None, b"x")
    assert torch.equal(restored["outer"][1], state["outer"][1]) and restored["outer"][1].dtype == torch.bfloat16
    assert torch.equal(restored["opt"][0]["momentum_buffer"], torch.ones(4))
    with pytest.raises(StateError):
        unflatten_state(manifest, tensors[:-1])  # a truncated download
    with pytest.raises(StateError):
        unflatten_state(manifest, [tensors[0], tensors[1].float(), tensors[2]])
    with pytest.raises(TypeError, match="cannot share"):
        flatten_state({"bad": object()})


def test_a_round_ends_only_once_its_thread_jobs_are_done_and_later_jobs_never_run():
    """Cancelling the task that awaits an executor job does not stop its thread, and such a job may
    write the round's tensors (what was sent, the average). RoundJobs.finish
    (run()'s end) waits for it; a job queued before the end and started after it does nothing."""
    import concurrent.futures

    from opendiloco_stream.transport.hivemind.jobs import RoundClosed, RoundJobs

    async def scenario():
        loop = asyncio.get_event_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))  # one thread: the second job queues
        jobs, started, release, ran = RoundJobs(), threading.Event(), threading.Event(), []

        def writes_a_buffer(name):
            if name == "first":
                started.set()
                release.wait(30)
            ran.append(name)

        first = asyncio.ensure_future(jobs.run(writes_a_buffer, "first"))
        queued = asyncio.ensure_future(jobs.run(writes_a_buffer, "queued"))
        while not started.is_set():
            await asyncio.sleep(0.001)
        first.cancel()  # as run()'s finally cancels its tasks: the thread goes on
        ending = asyncio.ensure_future(jobs.finish("round (0, 0)"))
        await asyncio.sleep(0.05)
        still_waiting = (not ending.done(), jobs.running)
        release.set()
        finished = await ending
        with pytest.raises(RoundClosed):
            await queued  # queued before the end, started after it
        with pytest.raises(RoundClosed):
            await jobs.run(writes_a_buffer, "late")  # asked for after the end
        return still_waiting, finished, ran

    still_waiting, finished, ran = asyncio.run(scenario())
    assert still_waiting == (True, 1)  # the round had not ended while the first job ran
    assert finished and ran == ["first"]


# ---------------------------------------------------------------------------------------- fakes
# (fragment, round) -> what peer 2 (FaultyTransport) does wrong. Honest peers never do any of it.
FAULTS = {
    (2, 0): "nan", (2, 1): "malformed", (2, 2): "huge",  # contributions the reducers must reject
    (3, 0): "truncate", (3, 1): "forge",  # a reducer that returns part of its results / a false verdict
    (5, 1): "stall", (5, 3): "stall",  # a sender that stops after its first chunk (round 3: then killed)
}


class FaultyRunner(HvAllReduceRunner):
    """Test double: the real runner, misbehaving on the rounds listed in FAULTS."""

    @property
    def fault(self):
        return FAULTS.get(tuple(self.key))

    def encode_contribution(self, chunk):
        payload = super().encode_contribution(chunk)
        if self.fault == "nan":
            poisoned = bytearray(payload)
            poisoned[24:26] = b"\x00\x7e"  # the first block scale := fp16 NaN (wire layout: compression/wire.py)
            return bytes(poisoned)
        if self.fault == "malformed":
            return payload[:-3]
        if self.fault == "huge":
            return self.codec.encode(chunk * 1e4)
        return payload

    async def _contributions_for(self, q):
        sent = 0
        async for msg in super()._contributions_for(q):
            yield msg
            sent += 1
            if self.fault == "stall" and sent == 1:
                peer_signal().set()
                await asyncio.Event().wait()  # stalls mid-stream until the test kills this peer

    async def serve(self, stream, remote):
        results = 0
        async for msg in super().serve(stream, remote):
            if self.fault in ("truncate", "forge") and msg.tensor_part.buffer:
                frame = unpack_frame(msg.tensor_part.buffer)
                if self.fault == "truncate" and frame.kind == RESULT:
                    results += 1
                    if results > 1:
                        return  # ends the stream cleanly after one chunk: a partial result
                if self.fault == "forge" and frame.kind in (RESULT, DONE):
                    status = bytes([REJECTED]) + frame.status[1:]  # claims peer 0 was rejected
                    msg = _message(pack_frame(frame.kind, frame.chunk, frame.payload, status, frame.total_weight),
                                   code=msg.code)
            yield msg


class FaultyTransport(HivemindTransport):
    runner_cls = FaultyRunner


def expected_state(numel: int) -> dict:
    g = torch.Generator().manual_seed(5)
    return {"step": 42, "outer": [torch.randn(numel, generator=g), torch.arange(10)],
            "opt": {0: {"momentum_buffer": torch.randn(numel // 2, generator=g)}}, "mode": ("eager", 0.5)}


def claim_download(claim_dir: str) -> bool:
    """Whether this donor is the first asked (it writes its pid to ``claim_dir/claim``)."""
    try:
        fd = os.open(os.path.join(claim_dir, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def donor_state(index: int, numel: int, claim_dir: str):
    """A state provider. Once ``claim_dir/armed`` exists, the first donor asked claims the download
    (writes its pid), signals the test and blocks until the test kills it: a donor that dies after
    accepting a download and before finishing it."""

    def provider():
        if os.path.exists(os.path.join(claim_dir, "armed")) and claim_download(claim_dir):
            peer_signal().set()
            threading.Event().wait(120)
        return dict(expected_state(numel), donor=index)

    return provider


def big_state(n_tensors: int, numel: int) -> dict:
    g = torch.Generator().manual_seed(9)
    return {"step": 7, "outer": [torch.randn(numel, generator=g) for _ in range(n_tensors)]}


def serve_big_state(peer, index: int, n_tensors: int, numel: int, claim_dir: str, die_after: int) -> None:
    """Inside a donor: serve ``big_state``; the first donor asked claims the download and dies
    (os._exit; its DHT and p2pd live on) when it is about to send tensor ``die_after``. A fault
    injection: a donor dying mid-stream at a known point cannot be produced otherwise."""
    def provider():
        if claim_download(claim_dir):
            faults.inject(die_after_tensors=die_after)  # test-only hook (opendiloco_stream/testing/faults.py)
        return dict(big_state(n_tensors, numel), donor=index)

    peer.transport.set_state_provider(provider)


def serve_after_one_failure(peer, numel: int, claim_dir: str) -> None:
    """Inside a donor: a state provider that fails on the first request (the donor then ends that
    stream empty) and serves ``expected_state`` afterwards."""
    def provider():
        if claim_download(claim_dir):
            raise RuntimeError("the first request fails (test)")
        return dict(expected_state(numel), donor=0)

    peer.transport.set_state_provider(provider)


def load_state_reporting(peer, load_timeout: float) -> dict:
    """Inside the joiner: load the state; what the download reported (progress, reuse)."""
    records = []
    state = peer.transport.load_state_from_peers(load_timeout, progress=records.append)
    return dict(state=state, progress=records, last_load=dict(peer.transport._sharing().last_load))


SERVICE_THREADS = ("ods-averaging", "ods-codec", "ods-dht", "hv-fragment-", "hv-presence")


def close_and_list_service_threads(peer) -> list[str]:
    """Inside a peer: close its transport; the averaging service's threads still alive afterwards."""
    assert any(t.name.startswith(SERVICE_THREADS) for t in threading.enumerate())  # they ran
    peer.transport.close()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if t.name.startswith(SERVICE_THREADS) and t.is_alive()]
        if not left:
            break
        time.sleep(0.1)
    return left


# ---------------------------------------------------------------------------------------- helpers
def block_absmax(v: torch.Tensor, block: int = 64) -> torch.Tensor:
    pad = (-v.numel()) % block
    blocks = torch.nn.functional.pad(v.abs(), (0, pad)).view(-1, block).amax(dim=1)
    return blocks.repeat_interleave(block)[: v.numel()]


def fp4_e3m0_bound(xs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Elementwise bound on |average - true weighted mean| for fp4-e3m0 (round to nearest, block 64).

    One quantization of v in a block of absmax s errs by at most max(|v|/3, s/128): the levels are
    0 and 2^k * s for k = -6..0 (s is stored rounded up to fp16: at most 2^-10 more). The average
    is quantized twice: each contribution, then the mean of the decoded contributions.
    """
    def q_err(v):
        return torch.maximum(v.abs() / 3, block_absmax(v) * (1 + 2**-10) / 128)

    total = sum(weights)
    true = sum(w * x for w, x in zip(weights, xs)) / total
    first = sum(w * q_err(x) for w, x in zip(weights, xs)) / total
    mean_bound = true.abs() + first
    return first + torch.maximum(mean_bound / 3, block_absmax(mean_bound) * (1 + 2**-10) / 128) + 1e-6


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


N = 131_079  # odd, not a multiple of the block: the last block is short
TIMEOUTS = dict(target_group_size=3, matchmaking_time=3.0, request_timeout=1.0)


@pytest.fixture(scope="module")
def swarm():
    """3 peers (peer 2 runs FaultyTransport: honest except on the rounds in FAULTS), fragments 0-3."""
    # generous chunk / all-reduce bounds: these tests are about results, not timing, and a loaded
    # 2-core CI box must not turn a slow chunk into a failed round (the stall test pins the bounds)
    s = LoopbackSwarm(3, run_id="hvtest", transport_kwargs=dict(codec="fp4-e3m0", chunk_bytes=1 << 12,
                                                                next_chunk_timeout=15.0, allreduce_timeout=40.0,
                                                                **TIMEOUTS),
                      peer_overrides={2: dict(transport_cls=f"{MODULE}:FaultyTransport")})
    try:
        s.start()
        s.call_all("prepare", {0: N, 1: N, 2: N, 3: N}, timeout=120)
        yield s
    finally:
        s.close()


# ---------------------------------------------------------------------------------------- networked
@pytest.mark.network
def test_three_peers_get_bit_identical_weighted_fp4_averages(swarm):
    codec = get_codec("fp4-e3m0")
    weights = [1.0, 2.0, 3.0]
    encoded = codec.encoded_size(N)
    for fragment in (0, 1):
        for rnd in (0, 1):
            args = [dict(seed=1000 * fragment + 10 * rnd + i, numel=N, offset=float(i), weight=weights[i]) for i in range(3)]
            results = swarm.call_all("all_reduce", (fragment, rnd), per_peer=args, timeout=90)
            assert [r["ok"] for r in results] == [True] * 3, results
            assert {r["sha256"] for r in results} == {results[0]["sha256"]}  # bit-identical everywhere
            xs = [make_tensor(a["seed"], N, a["offset"]) for a in args]
            for i, r in enumerate(results):
                assert (r["group_size"], r["rejected"], r["included_self"]) == (3, 0, True)
                assert r["weight_share"] == pytest.approx(weights[i] / 6)
                assert torch.equal(r["sent"], codec.roundtrip(xs[i]))  # sent = deQ(Q(own tensor))
                # ~4/3 of the encoded fragment each way: 2 of 3 contribution parts + 2 result parts
                assert 4 / 3 * encoded <= r["bytes_sent"] <= 4 / 3 * encoded * 1.05 + 2_000
                assert 4 / 3 * encoded <= r["bytes_received"] <= 4 / 3 * encoded * 1.05 + 2_000
            average = results[0]["average"]
            true = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
            assert bool(((average - true).abs() <= fp4_e3m0_bound(xs, weights)).all())
            # weights respected: the protocol's own output recomputed here, vs. the unweighted one
            sent = [codec.roundtrip(x) for x in xs]
            weighted = codec.roundtrip(sum(w * s for w, s in zip(weights, sent)) / sum(weights))
            unweighted = codec.roundtrip(sum(sent) / 3)
            assert relative(average, weighted) < 1e-3 < 0.05 < relative(average, unweighted)


@pytest.mark.network
def test_bad_contributions_are_rejected_counted_and_the_others_averaged(swarm):
    """Peer 2 is a fake sender (real peers never send these): NaN scales, truncated bytes, a norm
    10^4 times the others'. Reducers drop it, every peer counts it, the honest average stands."""
    weights = [1.0, 3.0, 2.0]
    for rnd, fault in enumerate(("nan", "malformed", "huge")):
        assert FAULTS[(2, rnd)] == fault
        args = [dict(seed=50 + 10 * rnd + i, numel=N, weight=weights[i]) for i in range(3)]
        results = swarm.call_all("all_reduce", (2, rnd), per_peer=args, timeout=90)
        assert [r["ok"] for r in results] == [True] * 3, results
        assert {r["sha256"] for r in results} == {results[0]["sha256"]}
        for i, r in enumerate(results):
            assert (r["group_size"], r["rejected"], r["included_self"]) == (2, 1, i != 2), fault
            assert r["weight_share"] == pytest.approx(weights[i] / 4 if i != 2 else 0.0)
        honest = [make_tensor(a["seed"], N) for a in args[:2]]
        bound = fp4_e3m0_bound(honest, weights[:2])
        true = (honest[0] * weights[0] + honest[1] * weights[1]) / 4
        assert bool(((results[0]["average"] - true).abs() <= bound).all()), fault


@pytest.mark.network
def test_partial_or_inconsistent_results_fail_the_round_then_rounds_recover(swarm):
    """Peer 2 is a fake reducer: round 0 it sends 1 of its ~6 result chunks and ends the stream
    cleanly (hivemind's stock runner would report this as a success with "received N% results"),
    round 1 it claims a different verdict than the other reducers. Round 2 is honest."""
    args = [dict(seed=70 + i, numel=N) for i in range(3)]
    for rnd in (0, 1):
        results = swarm.call_all("all_reduce", (3, rnd), per_peer=args, timeout=90)
        for r in results[:2]:
            assert (r["ok"], r["reason"]) == (False, "partial"), (FAULTS[(3, rnd)], r)
    results = swarm.call_all("all_reduce", (3, 2), per_peer=args, timeout=90)
    assert [(r["ok"], r["group_size"]) for r in results] == [(True, 3)] * 3
    assert {r["sha256"] for r in results} == {results[0]["sha256"]}


@pytest.mark.network
def test_stalled_or_killed_peer_costs_one_bounded_round_then_the_others_go_on():
    """Peer 2 (fake) stops sending after its first chunk: in round 1 it just stalls (the others drop
    it after next_chunk_timeout), in round 3 the test SIGKILLs its whole process group there. Peer 1
    is in client mode (sends, reduces nothing). Explicit timeouts: next chunk 2 s, all-reduce 6 s."""
    swarm = LoopbackSwarm(3, run_id="hvkill", transport_kwargs=dict(
        codec="fp32", chunk_bytes=1 << 16, next_chunk_timeout=2.0, allreduce_timeout=6.0, **TIMEOUTS),
        peer_overrides={1: dict(client_mode=True), 2: dict(transport_cls=f"{MODULE}:FaultyTransport")})
    numel = 500_000
    try:
        swarm.start()
        swarm.call_all("prepare", {5: numel}, timeout=120)
        args = [dict(seed=90 + i, numel=numel, return_tensors=False) for i in range(3)]
        for rnd in (0, 1, 2):
            results = swarm.call_all("all_reduce", (5, rnd), per_peer=args, timeout=90)
            if FAULTS.get((5, rnd)) == "stall":
                assert swarm.signal.is_set()
                swarm.signal.clear()
                for r in results:  # everyone fails the round (peer 2 is a reducer: its part is lost)
                    assert not r["ok"] and r["reason"] in ("partial", "timeout"), r
            else:
                assert [(r["ok"], r["group_size"]) for r in results] == [(True, 3)] * 3, results
                assert len({r["sha256"] for r in results}) == 1
        for peer, kwargs in zip(swarm.peers, args):  # round 3: peer 2 stalls after its first chunk...
            peer.send("all_reduce", (5, 3), **kwargs)
        assert swarm.signal.wait(60), "peer 2 never reached the all-reduce"
        killed_at = time.time()  # wall clock: the peers report when they saw the round fail
        swarm.peers[2].kill()  # ...and dies there, with its DHT and p2p daemon
        survivors = [p.recv(90) for p in swarm.peers[:2]]
        recovery_s = max(r["finished_at"] for r in survivors) - killed_at
        # peer 0 loses the round: it is the reducer peer 2 was sending to (peer 1 reduces nothing).
        # Peer 1 loses it too, or, when it reached round 3 after peers 0 and 2 had closed their
        # group (seen once in a full-suite run), was left out of it and fails for "matchmaking"
        assert not survivors[0]["ok"] and survivors[0]["reason"] in ("partial", "timeout"), survivors
        assert not survivors[1]["ok"] and survivors[1]["reason"] in ("partial", "timeout", "matchmaking"), survivors
        results = swarm.call_all("all_reduce", (5, 4), per_peer=args[:2], peers=swarm.peers[:2], timeout=90)
        assert [(r["ok"], r["group_size"], r["weight_share"]) for r in results] == [(True, 2, 0.5)] * 2, results
        assert results[0]["sha256"] == results[1]["sha256"]
        print(f"\nkilled peer: survivors failed the round {recovery_s:.2f}s after the kill; "
              f"next round (2 peers) took {max(r['elapsed_s'] for r in results):.2f}s")
        left = swarm.peers[0].call("call", f"{MODULE}:close_and_list_service_threads", timeout=60)
        assert left == [], left  # close() leaves no thread of the averaging service behind
    finally:
        swarm.close()


@pytest.mark.network
def test_a_download_cut_mid_way_resumes_from_another_donor_with_what_it_has(tmp_path):
    """12 tensors of 1 MB; the first donor asked dies before sending tensor 8 (each of its lanes
    stops there and the process exits 2 s after the first did: ``faults.stop_lane``): the joiner
    keeps the whole tensors that reached it (up to 8: parts still in flight at the exit may be
    lost with the stream), asks the other donor with their digests, gets a marker for each of those and the
    rest as bytes, and ends with exactly the state (the second donor's), progress reported."""
    swarm = LoopbackSwarm(3, run_id="hvresume", transport_kwargs=dict(codec="fp32", state_timeout=10.0, **TIMEOUTS))
    n_tensors, numel = 12, 250_000
    try:
        swarm.start()
        for i in (0, 1):
            swarm.peers[i].call("call", f"{MODULE}:serve_big_state", index=i, n_tensors=n_tensors, numel=numel,
                                claim_dir=str(tmp_path), die_after=8, timeout=30)
        out = swarm.peers[2].call("call", f"{MODULE}:load_state_reporting", load_timeout=60.0, timeout=90)
        victim = int((tmp_path / "claim").read_text())
        survivor = next(p.index for p in swarm.peers[:2] if p.pid != victim)
        state, last = out["state"], out["last_load"]
        assert state is not None, last
        assert state["donor"] == survivor and state["step"] == 7
        expected = big_state(n_tensors, numel)["outer"]
        assert all(torch.equal(a, b) for a, b in zip(state["outer"], expected))
        assert len(last["donors"]) == 2, last  # the one that died, then the survivor
        assert last["lanes"] == 8, last  # the survivor served its parts on 8 streams (state.py, "Lanes")
        reused = last["reused_tensors"]
        assert 1 <= reused <= 8 and last["reused_bytes"] == reused * numel * 4, last
        # over the wire: the tensors the second donor sent (all but those reused), and what the first
        # sent before it died: at most its die_after = 8 tensors, whole or cut short. It serves on 8
        # streams at once, so several tensors can be in flight when it dies, not one (a fresh-clone
        # suite saw 2 tensors' worth received and not kept: 14 MB with 2 reused)
        assert 12 * numel * 4 <= last["received_bytes"] <= (8 + 12 - reused) * numel * 4, last
        final = out["progress"][-1]
        assert final["done"] and final["bytes"] == final["total_bytes"] == 12 * numel * 4, out["progress"]
        assert final["reused_bytes"] == reused * numel * 4
    finally:
        swarm.close()


@pytest.mark.network
def test_late_joiner_downloads_state_and_survives_a_donor_dying(tmp_path):
    swarm = LoopbackSwarm(3, run_id="hvstate", transport_kwargs=dict(codec="fp32", state_timeout=10.0, **TIMEOUTS))
    numel = 500_000
    try:
        swarm.start()
        joiner = swarm.peers[2]
        assert joiner.call("load_state", 5.0, timeout=30)["state"] is None  # nobody serves yet
        for i in (0, 1):
            swarm.peers[i].call("set_state_provider", f"{MODULE}:donor_state", index=i, numel=numel,
                                claim_dir=str(tmp_path), timeout=30)
        expected = expected_state(numel)

        def check(state):
            assert state is not None and state["step"] == 42 and state["mode"] == ("eager", 0.5)
            assert all(torch.equal(a, b) for a, b in zip(state["outer"], expected["outer"]))
            assert torch.equal(state["opt"][0]["momentum_buffer"], expected["opt"][0]["momentum_buffer"])

        check(joiner.call("load_state", 30.0, timeout=60)["state"])
        (tmp_path / "armed").touch()  # now the first donor asked dies mid-download
        joiner.send("load_state", 40.0)
        assert swarm.signal.wait(60), "no donor was asked"
        pid = int((tmp_path / "claim").read_text())
        victim = next(p for p in swarm.peers if p.pid == pid)
        victim.kill()
        state = joiner.recv(60)["state"]
        check(state)
        assert state["donor"] == 1 - victim.index  # from the survivor
    finally:
        swarm.close()


@pytest.mark.network
def test_a_joiner_whose_only_donor_failed_asks_it_again(tmp_path):
    """Every donor failed (here the only one, once): the joiner asks again a few seconds later
    (``state.LOAD_PASSES``) instead of starting from its own initial model. A run at 150 ms beside
    two CPU burners saw the only donor's address barred by libp2p's dial backoff for a moment, and
    the joiner trained alone (as it did in CI and in a fresh-clone suite, whose logs could not say
    why)."""
    swarm = LoopbackSwarm(2, run_id="hvretry", transport_kwargs=dict(codec="fp32", state_timeout=10.0, **TIMEOUTS))
    try:
        swarm.start()
        swarm.peers[0].call("call", f"{MODULE}:serve_after_one_failure", numel=1000, claim_dir=str(tmp_path),
                            timeout=30)
        out = swarm.peers[1].call("call", f"{MODULE}:load_state_reporting", load_timeout=60.0, timeout=90)
        state, last = out["state"], out["last_load"]
        assert state is not None and state["step"] == 42 and state["donor"] == 0, last
        assert torch.equal(state["outer"][0], expected_state(1000)["outer"][0])
        assert len(last["donors"]) == 2 and len(set(last["donors"])) == 1, last  # the same donor, twice
        assert len(last["failures"]) == 1 and "manifest" in last["failures"][0], last
    finally:
        swarm.close()


def test_round_phases_split_a_round_between_the_host_and_the_runner_marks():
    from opendiloco_stream.transport.hivemind.round_report import round_phases

    marks = {"group": 10.5, "contributions": 10.75, "verdicts": 10.875, "reduced": 11.0, "results": 11.5, "end": 11.625}
    phases = round_phases(10.0, 10.25, marks, 12.0)
    assert phases == {"prepare": 0.25, "matchmaking": 0.25, "contributions": 0.25, "verdicts": 0.125, "reduce": 0.125,
                      "results": 0.5, "drain": 0.125, "finish": 0.375}
    assert sum(phases.values()) == 2.0
    # a peer with no part to reduce has no reducer marks; no marks at all: only what the host saw
    assert round_phases(10.0, 10.25, {"group": 10.5, "results": 11.5, "end": 11.5}, 11.75) == {
        "prepare": 0.25, "matchmaking": 0.25, "results": 1.0, "drain": 0.0, "finish": 0.25}
    assert round_phases(10.0, 10.25, {}, 11.0) == {"prepare": 0.25}


@pytest.mark.network
@pytest.mark.timeout(180)
def test_an_abandoned_round_fails_at_once_and_the_next_round_averages_correctly():
    """``SyncHandle.abandon`` on a round still in matchmaking (its groupmate never comes: the swarm
    moved on) fails it with reason "matchmaking" instead of waiting out the window, and cancels its
    group formation: the next round of the same fragment, with both peers, gives both the exact
    weighted mean."""
    swarm = LoopbackSwarm(2, run_id="hvabandon", transport_kwargs=dict(codec="fp32", target_group_size=2,
                                                                       matchmaking_time=5.0, request_timeout=1.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: N}, timeout=120)
        alone = swarm.peers[0].call("all_reduce", key=(0, 0), seed=1, numel=N, abandon_after_s=0.5, timeout=60)
        assert alone["abandoned"] is True and not alone["ok"]
        assert alone["reason"] == "matchmaking" and "abandoned before its group formed" in alone["message"]
        both = swarm.call_all("all_reduce", key=(0, 1), numel=N, timeout=60,
                              per_peer=[dict(seed=10, weight=1.0), dict(seed=11, weight=3.0)])
        assert all(r["ok"] and r["group_size"] == 2 for r in both), both
        expected = (make_tensor(10, N) * 1.0 + make_tensor(11, N) * 3.0) / 4.0
        for r in both:
            assert torch.allclose(r["average"], expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(both[0]["average"], both[1]["average"])
        # the same round with its group being formed ahead (peer 0 alone): abandoning it ends that
        # matchmaking too. It once went on "matching now" for a whole window (5 s here): a phantom
        # member of a round this peer had given up (a joiner's first rounds, in a 150 ms run beside
        # two CPU burners)
        assert swarm.peers[0].call("prematch", (0, 2), timeout=60) is None
        alone = swarm.peers[0].call("all_reduce", key=(0, 2), seed=2, numel=N, abandon_after_s=0.5, timeout=60)
        assert alone["abandoned"] is True and alone["reason"] == "matchmaking", alone
        deadline = time.monotonic() + 2.5  # well inside the 5 s window a phantom would match for
        while (left := swarm.peers[0].call("call", "benchmarks.harness.loopback:matching_rounds", fragment=0, timeout=30)):
            assert time.monotonic() < deadline, f"round {left} still matching after it was abandoned"
            time.sleep(0.1)
    finally:
        swarm.close()


@pytest.mark.network
def test_a_group_formed_ahead_averages_like_one_formed_at_the_round():
    """``Transport.prematch``: the group forms before the round and the round goes straight to the
    exchange. The average is the exact weighted mean, with the weights given when
    the group formed; a peer that matches at the round joins a group formed ahead by the others;
    a group formed ahead for a round that is not launched is dropped and the next round matches,
    and so is a group formed ahead that found nobody in its window."""
    swarm = LoopbackSwarm(3, run_id="hvahead", transport_kwargs=dict(codec="fp32", target_group_size=3,
                                                                     matchmaking_time=5.0, request_timeout=1.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: N}, timeout=120)

        def expected(seeds, weights):
            return sum(make_tensor(s, N) * w for s, w in zip(seeds, weights)) / sum(weights)

        # formed ahead, then launched with other weights: the group's (predicted) weights count
        stages = swarm.call_all("prematch", (0, 0), timeout=60,
                                per_peer=[dict(weight=w, wait_formed_s=20.0) for w in (1.0, 1.0, 2.0)])
        assert stages == ["FORMED"] * 3, stages
        out = swarm.call_all("all_reduce", (0, 0), numel=N, timeout=60,
                             per_peer=[dict(seed=20 + i, weight=5.0) for i in range(3)])
        assert all(r["ok"] and r["group_size"] == 3 for r in out), out
        assert [r["weight_share"] for r in out] == pytest.approx([0.25, 0.25, 0.5])
        for r in out:
            assert torch.allclose(r["average"], expected([20, 21, 22], [1.0, 1.0, 2.0]), rtol=1e-6, atol=1e-7)
            assert torch.equal(r["average"], out[0]["average"])
        # two peers form it ahead, the third matches at the round: one group of three
        swarm.call_all("prematch", (0, 1), timeout=60, peers=swarm.peers[:2],
                   per_peer=[dict(weight=1.0), dict(weight=3.0)])
        out = swarm.call_all("all_reduce", (0, 1), numel=N, timeout=60,
                             per_peer=[dict(seed=30 + i, weight=w) for i, w in enumerate((1.0, 3.0, 4.0))])
        assert all(r["ok"] and r["group_size"] == 3 for r in out), out
        for r in out:
            assert torch.allclose(r["average"], expected([30, 31, 32], [1.0, 3.0, 4.0]), rtol=1e-6, atol=1e-7)
        # formed ahead for round 2, but round 3 is launched: dropped, and round 3 matches at once
        stages = swarm.call_all("prematch", (0, 2), timeout=60, per_peer=[dict(wait_formed_s=20.0)] * 3)
        assert stages == ["FORMED"] * 3, stages
        out = swarm.call_all("all_reduce", (0, 3), numel=N, timeout=60,
                             per_peer=[dict(seed=40 + i, weight=1.0) for i in range(3)])
        assert all(r["ok"] and r["group_size"] == 3 for r in out), out
        for r in out:
            assert torch.allclose(r["average"], expected([40, 41, 42], [1.0] * 3), rtol=1e-6, atol=1e-7)
        # peer 0 alone forms ahead for round 4 and finds nobody within its window: at the launch
        # that step is dropped and the round matches with the others as usual
        alone = swarm.peers[0].call("prematch", (0, 4), wait_formed_s=0.0, timeout=60)
        deadline = time.monotonic() + 30
        while swarm.peers[0].call("early_stage", 0) not in ("FAILED", None):
            assert time.monotonic() < deadline, "the lone step formed ahead never gave up (it waits for its trigger)"
            time.sleep(0.5)
        out = swarm.call_all("all_reduce", (0, 4), numel=N, timeout=60,
                             per_peer=[dict(seed=50 + i, weight=1.0) for i in range(3)])
        assert alone is None and all(r["ok"] and r["group_size"] == 3 for r in out), out
        for r in out:
            assert torch.allclose(r["average"], expected([50, 51, 52], [1.0] * 3), rtol=1e-6, atol=1e-7)
    finally:
        swarm.close()


def test_transport_settings_come_from_netconfig_not_repeated_defaults():
    import inspect

    from opendiloco_stream.config import load_config
    from opendiloco_stream.transport.hivemind.settings import HivemindSettings

    assert list(inspect.signature(HivemindTransport.__init__).parameters) == ["self", "dht", "settings", "admission",
                                                                            "overrides"]
    cfg = load_config(overrides={"net": {"run_id": "r1", "matchmaking_time": 7.0, "data_port": 4000,
                                         "norm_bound": None}, "diloco": {"codec": "int8"}}, environ={})
    s = HivemindSettings.from_config(cfg)
    assert (s.run_id, s.matchmaking_time, s.direct_port, s.norm_bound, s.codec.name) == ("r1", 7.0, 4000, None, "int8")
    defaults = HivemindSettings.defaults()
    net = load_config(environ={}).net
    assert (defaults.matchmaking_time, defaults.request_timeout, defaults.link_mbit, defaults.norm_bound) == (
        net.matchmaking_time, net.request_timeout, net.link_mbit, net.norm_bound)
    assert HivemindSettings.defaults(codec="topk-int2").codec.block_size == load_config(environ={}).diloco.sparse_chunk


@pytest.mark.network
@pytest.mark.timeout(180)
def test_a_group_of_clients_only_fails_naming_the_cause_and_a_listener_makes_it_form():
    """Two peers that both accept no connections (client mode) reach the same round: none can lead
    or reduce, so the round fails after its window with reason "clients" and a message that says
    what to do, not the generic "matchmaking". With one of the two listening, the next round
    forms and averages exactly (the client reduces no part)."""
    kwargs = dict(codec="fp32", target_group_size=2, matchmaking_time=3.0, request_timeout=1.0)
    clients = LoopbackSwarm(2, run_id="hvclients", transport_kwargs=dict(client_mode=True, **kwargs))
    try:
        clients.start()
        clients.call_all("prepare", {0: N}, timeout=120)
        failed = clients.call_all("all_reduce", key=(0, 0), numel=N, timeout=60, per_peer=[dict(seed=1), dict(seed=2)])
        for r in failed:
            assert not r["ok"] and r["reason"] == "clients", r
            assert "all clients" in r["message"] and "--relay" in r["message"], r["message"]
    finally:
        clients.close()
    mixed = LoopbackSwarm(2, run_id="hvmixed", transport_kwargs=kwargs, peer_overrides={1: dict(client_mode=True)})
    try:
        mixed.start()
        mixed.call_all("prepare", {0: N}, timeout=120)
        both = mixed.call_all("all_reduce", key=(0, 0), numel=N, timeout=60, per_peer=[dict(seed=1), dict(seed=2)])
        assert all(r["ok"] and r["group_size"] == 2 for r in both), both
        assert torch.allclose(both[0]["average"], (make_tensor(1, N) + make_tensor(2, N)) / 2, rtol=1e-6, atol=1e-7)
        assert torch.equal(both[0]["average"], both[1]["average"])
    finally:
        mixed.close()
