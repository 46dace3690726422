"""The direct TCP data path of the hivemind transport (``transport/hivemind/direct.py``).

In-process: messages encode exactly as hivemind's protobufs (so bytes are counted the same on both
paths), hellos authenticate a sender of a group. Networked (3 peers on 127.0.0.1): the streams of
a round go direct on loopback; a reducer whose advertised port is unreachable is reached through
the p2p daemon instead, in the same round; results are bit-identical on every peer either way.
Peers record which path each exchange took in files under ``ODS_TEST_PATH_LOG`` (``PathLoggingRunner``).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from hivemind.proto import averaging_pb2

from benchmarks.harness.loopback import LoopbackSwarm
from opendiloco_stream.transport.hivemind import HivemindTransport
from opendiloco_stream.transport.hivemind.direct import (
    DirectStream, FailedAddresses, RunningGroups, group_tag, hello_is_valid, make_hello, parse_address, read_hello,
)
from opendiloco_stream.transport.hivemind.protocol import (
    CONTRIB, DONE, Message, ProtocolError, frame_parts, pack_frame, parse_message, unpack_frame,
)
from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner
from opendiloco_stream.transport.hivemind.seal import DirectSecurity

MODULE = __name__


# ---------------------------------------------------------------------------------------- in-process
@pytest.mark.parametrize("message", [
    Message(averaging_pb2.PART_FOR_AVERAGING, b"g" * 20, frame_parts(CONTRIB, 3, b"x" * 300)),
    Message(averaging_pb2.AVERAGED_PART, b"", pack_frame(DONE, 2, b"", bytes([0, 0, 2]), 1.5)),
    Message(averaging_pb2.AVERAGED_PART, b"", b""),  # an empty part is still a part
    Message(averaging_pb2.INTERNAL_ERROR, has_part=False),
])
def test_messages_encode_as_hivemind_protobufs_and_parse_back(message):
    pb = message.to_pb()
    wire = message.pb_prefix() + bytes(message.buffer)
    assert wire == pb.SerializeToString() and message.ByteSize() == pb.ByteSize() == len(wire)
    back = parse_message(bytearray(wire))
    assert (back.code, back.group_id, bytes(back.buffer), back.has_part) == (
        message.code, message.group_id, bytes(message.buffer), message.has_part)
    assert back.ByteSize() == pb.ByteSize()


def test_parsed_frames_are_views_and_truncated_messages_are_refused():
    wire = Message(averaging_pb2.PART_FOR_AVERAGING, b"gid", frame_parts(CONTRIB, 1, b"payload")).to_pb().SerializeToString()
    frame = unpack_frame(parse_message(bytearray(wire)).buffer)
    assert isinstance(frame.payload, memoryview) and frame.payload == b"payload"
    with pytest.raises(ProtocolError):
        parse_message(wire[:-3])


def test_a_failed_direct_address_is_retried_after_a_doubling_back_off():
    now = [100.0]
    failed = FailedAddresses(first_s=30, max_s=100, clock=lambda: now[0])
    a, b = ("10.0.0.1", 5000), ("10.0.0.2", 5000)
    assert not failed.blocked(a) and len(failed) == 0
    assert failed.failed(a) == 30 and failed.blocked(a) and not failed.blocked(b)
    now[0] += 29.9
    assert failed.blocked(a)
    now[0] += 0.2  # back-off over: the next round tries direct again
    assert not failed.blocked(a)
    assert [failed.failed(a), failed.failed(a), failed.failed(a)] == [60, 100, 100]  # doubles, capped
    failed.succeeded(a)  # a success forgets it: the next failure starts over
    assert not failed.blocked(a) and len(failed) == 0 and failed.failed(a) == 30
    with pytest.raises(ValueError):
        FailedAddresses(first_s=0)


def test_hello_authenticates_one_sender_of_one_group():
    group, other, salt = os.urandom(32), os.urandom(32), os.urandom(16)
    security = DirectSecurity()
    hello = read_hello(make_hello(security, group, "run_f0", 2, 1, salt))
    assert (hello.tag, hello.sender, hello.salt, hello.plaintext) == (group_tag(group), 2, salt, False)
    assert hello.tag != group_tag(other)
    assert hello_is_valid(security, group, "run_f0", 1, hello)
    for g, prefix, reducer, h in ((other, "run_f0", 1, hello), (group, "run_f1", 1, hello), (group, "run_f0", 0, hello),
                                  (group, "run_f0", 1, hello._replace(sender=0)),
                                  (group, "run_f0", 1, hello._replace(salt=bytes(16))),
                                  (group, "run_f0", 1, hello._replace(flags=1))):
        assert not hello_is_valid(security, g, prefix, reducer, h)
    with pytest.raises(ProtocolError):
        read_hello(b"GET / HTTP/1.1\r\n" + bytes(71))


def test_advertised_addresses_are_validated():
    assert parse_address([["127.0.0.1", 4000]]) == ("127.0.0.1", 4000)
    assert parse_address([["not an ip", 1], ["10.0.0.2", 70000], ["10.0.0.3", 5]]) == ("10.0.0.3", 5)
    for bad in (None, "127.0.0.1:4000", [["::1", 4000]], [[1, 2, 3]], [["127.0.0.1", "4000"]]):
        assert parse_address(bad) is None


# ---------------------------------------------------------------------------------------- fakes
class PathLoggingRunner(HvAllReduceRunner):
    """The real runner; logs which path each of its exchanges took."""

    async def _open_stream(self, q):
        stream = await super()._open_stream(q)
        path = (f"direct {'reused' if stream.reused else 'new'}" if isinstance(stream, DirectStream) else "p2p")
        with open(Path(os.environ["ODS_TEST_PATH_LOG"]) / f"{self.me}-{q}-{self.key[1]}", "w") as f:
            f.write(path)
        return stream


class PathLoggingTransport(HivemindTransport):
    runner_cls = PathLoggingRunner


class UnreachableTransport(PathLoggingTransport):
    """Advertises a direct port nobody listens on (as a peer behind NAT would): groupmates must
    reach it through the p2p daemon."""

    def prepare(self, numels):
        super().prepare(numels)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        for fragment in numels:
            self._lanes[fragment].endpoint.listener.addresses = [["127.0.0.1", closed]]  # what rounds advertise


def _paths(log_dir: Path, rnd: int) -> dict[tuple[int, int], str]:
    """(sender, reducer) -> path, in group order (peer order may differ from it)."""
    out = {}
    for f in log_dir.iterdir():
        sender, reducer, r = map(int, f.name.split("-"))
        if r == rnd:
            out[(sender, reducer)] = f.read_text()
    return out


# ---------------------------------------------------------------------------------------- networked
@pytest.mark.network
def test_rounds_go_direct_on_loopback_and_fall_back_to_p2p_for_an_unreachable_port(tmp_path, monkeypatch):
    monkeypatch.setenv("ODS_TEST_PATH_LOG", str(tmp_path))  # spawned peers inherit it
    numel = 200_003
    swarm = LoopbackSwarm(3, run_id="hvdirect", transport_kwargs=dict(
        codec="fp32", chunk_bytes=1 << 16, target_group_size=3, matchmaking_time=3.0, request_timeout=1.0,
        next_chunk_timeout=15.0, allreduce_timeout=40.0), transport_cls=f"{MODULE}:PathLoggingTransport",
        peer_overrides={2: dict(transport_cls=f"{MODULE}:UnreachableTransport")})
    try:
        swarm.start()
        swarm.call_all("prepare", {0: numel}, timeout=120)
        args = [dict(seed=10 + i, numel=numel, weight=1.0 + i, return_tensors=False) for i in range(3)]
        for rnd in (0, 1):
            results = swarm.call_all("all_reduce", (0, rnd), per_peer=args, timeout=90)
            assert [(r["ok"], r["group_size"]) for r in results] == [(True, 3)] * 3, results
            assert len({r["sha256"] for r in results}) == 1  # bit-identical whatever the path
            for r in results:  # the phases partition the round (a reducer runs all of them)
                assert list(r["phases"]) == ["prepare", "matchmaking", "contributions", "verdicts", "reduce",
                                             "results", "drain", "finish"], r["phases"]
                assert 0.5 * r["elapsed_s"] <= sum(r["phases"].values()) <= r["elapsed_s"] + 0.01, r
            paths = _paths(tmp_path, rnd)
            assert len(paths) == 6, paths  # every member sends to both others
            peer_ids = [p.peer_id for p in swarm.peers]
            order = results[0]["peers"]  # the group order the runner indexes by
            unreachable = order.index(peer_ids[2])
            for (sender, reducer), path in paths.items():
                assert path.split()[0] == ("p2p" if reducer == unreachable else "direct"), (sender, reducer, paths)
                if reducer != unreachable:  # the second round reuses the first one's connection (kept open)
                    assert path.split()[1] == ("new" if rnd == 0 else "reused"), (sender, reducer, paths)
    finally:
        swarm.close()


def count_bytes(peer, numel: int, rounds: int) -> list[tuple[int, int]]:
    """Inside a peer: bytes sent and received in ``rounds`` rounds, after one warm-up round.

    The warm-up's outcome is not what this test checks: the first round of a fresh pair has
    (rarely, not reproduced on demand) timed out in full runs; its error message now says where
    the round stood. The measured rounds must all succeed."""
    warm = peer.all_reduce((0, 0), seed=1000, numel=numel, return_tensors=False)
    if not warm["ok"]:
        print(f"warm-up round failed: {warm['reason']}: {warm['message']}", file=sys.stderr, flush=True)
    out = []
    for rnd in range(1, rounds + 1):
        r = peer.all_reduce((0, rnd), seed=rnd, numel=numel, return_tensors=False)
        assert r["ok"], r
        out.append((r["bytes_sent"], r["bytes_received"]))
    return out


@pytest.mark.network
def test_bytes_are_counted_the_same_on_both_paths():
    """The direct path writes the protobuf encoding of each message: a round's byte counts do not
    depend on the path (2 peers, fp4; encoded sizes depend on sizes only, parts are equal)."""
    numel = 100_096  # 1564 blocks of 64: two parts of 782
    counts = {}
    for direct in (True, False):
        swarm = LoopbackSwarm(2, run_id=f"hvbytes{int(direct)}", transport_kwargs=dict(
            codec="fp4-e3m0", chunk_bytes=1 << 12, target_group_size=2, matchmaking_time=3.0, request_timeout=1.0,
            direct=direct))
        try:
            swarm.start()
            swarm.call_all("prepare", {0: numel}, timeout=120)
            counts[direct] = swarm.call_all("call", function=f"{MODULE}:count_bytes", numel=numel, rounds=2, timeout=120)
        finally:
            swarm.close()
    assert counts[True] == counts[False], counts
    assert len({c for peer in counts[True] for c in peer}) == 1  # symmetric, round after round


def test_a_stream_waiting_for_its_group_wakes_when_the_group_registers_and_gives_up_at_its_deadline():
    """``RunningGroups.find``: a groupmate's stream that arrives before our round is registered
    waits for the registration (woken by ``notify``, long before its deadline), and a group that
    never registers gives None at the deadline."""
    import asyncio

    async def scenario():
        loop = asyncio.get_event_loop()
        board = RunningGroups({})
        waiting = asyncio.ensure_future(board.find(lambda g: g == b"ours", loop.time() + 3600.0))
        await asyncio.sleep(0.05)
        board.groups[b"other"] = None
        board.notify()  # not ours: the waiter looks again and waits on
        await asyncio.sleep(0.05)
        still_waiting = not waiting.done()
        board.groups[b"ours"] = loop.create_future()
        board.notify()
        for _ in range(5):  # a few turns of the loop: an hour before its deadline, only notify can wake it
            await asyncio.sleep(0)
        woken = waiting.done()
        found = waiting.result() if woken else waiting.cancel()
        missing = await board.find(lambda g: g == b"never", loop.time() + 0.1)
        return still_waiting, woken, found, missing

    still_waiting, woken, found, missing = asyncio.run(scenario())
    assert still_waiting and woken and found == b"ours"
    assert missing is None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.network
def test_fixed_data_ports_and_a_peer_without_the_direct_path(tmp_path, monkeypatch, free_port_range):
    """``net.data_port``: fragment p listens on data_port + p. ``--no-direct``: a peer that
    advertises no address and opens none; its groupmates reach it, and it them, over the daemon."""
    monkeypatch.setenv("ODS_TEST_PATH_LOG", str(tmp_path))
    numel, base = 50_000, free_port_range(20)
    swarm = LoopbackSwarm(3, run_id="hvports", transport_kwargs=dict(
        codec="fp32", target_group_size=3, matchmaking_time=3.0, request_timeout=1.0, next_chunk_timeout=15.0,
        allreduce_timeout=40.0), transport_cls=f"{MODULE}:PathLoggingTransport",
        peer_overrides={0: dict(direct_port=base), 1: dict(direct_port=base + 10), 2: dict(direct=False)})
    try:
        swarm.start()
        swarm.call_all("prepare", {0: numel, 1: numel}, timeout=120)
        assert all(_listening(p) for p in (base, base + 1, base + 10, base + 11))
        assert not _listening(base + 2) and not _listening(base + 12)  # one port per fragment, no more
        args = [dict(seed=i, numel=numel, return_tensors=False) for i in range(3)]
        results = swarm.call_all("all_reduce", (1, 0), per_peer=args, timeout=90)
        assert [(r["ok"], r["group_size"]) for r in results] == [(True, 3)] * 3, results
        assert len({r["sha256"] for r in results}) == 1
        order = results[0]["peers"]
        plain = order.index(swarm.peers[2].peer_id)
        paths = _paths(tmp_path, 0)
        assert len(paths) == 6, paths
        for (sender, reducer), path in paths.items():
            assert path == ("p2p" if plain in (sender, reducer) else "direct new"), (sender, reducer, paths)
    finally:
        swarm.close()


@pytest.mark.network
def test_a_taken_data_port_is_an_error_with_the_fix_and_a_free_one_is_used(free_port_range):
    from opendiloco_stream.config import NetConfig
    from opendiloco_stream.net.dht import NetError, start_dht, stop_dht
    from opendiloco_stream.transport.hivemind.direct import DirectListener

    dht = start_dht(NetConfig())  # a local node: listens on 127.0.0.1
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            taken = s.getsockname()[1]
            with pytest.raises(NetError, match=f"cannot listen on data port {taken}/tcp .*--data-port"):
                DirectListener.for_dht(dht, taken)
        free = free_port_range(1)
        listener = DirectListener.for_dht(dht, free)
        try:
            assert listener.port == free and listener.addresses == [["127.0.0.1", free]]
        finally:
            listener.close()
    finally:
        stop_dht(dht)
