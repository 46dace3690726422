"""What a peer measures of its links and what it derives from them: the kernel's TCP_INFO on a real
loopback connection, the per-groupmate estimates, the socket buffers for a bandwidth-delay product,
the RTT terms of the timeouts, and the direct path's connections kept open between exchanges."""

from __future__ import annotations

import asyncio
import socket

import pytest

from opendiloco_stream.transport.hivemind.direct import END, ConnectionPool, is_open, read_message, write_end
from opendiloco_stream.transport.hivemind.link import (
    LinkBook, LinkEstimate, bdp_bytes, buffer_bytes, parse_tcp_info, size_buffers, tcp_info,
)
from opendiloco_stream.transport.hivemind.timeouts import (
    CHUNK_RTTS, EXCHANGE_RTTS, MATCH_RTTS, REQUEST_RTTS, SAFETY, derive_timeouts, link_timeouts,
)


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def test_tcp_info_of_a_loopback_connection_reads_the_kernels_rtt_and_bytes():
    listener, client, server = _pair()
    try:
        payload = b"x" * 200_000
        client.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(server.recv(1 << 16))
        info = tcp_info(client)
        assert info is not None
        assert 0 < info.rtt_s < 2.0 and 0 < info.min_rtt_s <= info.rtt_s + 1e-6  # loopback: well under a second
        assert info.bytes_acked >= len(payload) and info.cwnd >= 1 and info.total_retrans == 0
    finally:
        for s in (client, server, listener):
            s.close()
    assert tcp_info(client) is None  # closed: nothing to read
    assert parse_tcp_info(b"\0" * 100) is None  # an old kernel's shorter struct


def test_link_book_keeps_an_average_per_groupmate_and_answers_with_the_worst_link():
    book = LinkBook(rtt_floor_s=0.01)
    assert book.worst() == (0.01, None)
    book.record("a", rtt_s=0.1)
    book.record("a", rtt_s=0.2)  # one slower round moves the estimate, not all the way
    assert 0.1 < book.get("a").rtt_s < 0.2 and book.get("a").samples == 2
    book.record("b", rtt_s=0.05, rate_mbit=40.0)
    book.record("b", rate_mbit=20.0)  # no RTT this round: the RTT stays
    assert book.get("b").rtt_s == pytest.approx(0.05) and 20.0 < book.get("b").rate_mbit < 40.0
    rtt, rate = book.worst()
    assert rtt == book.get("a").rtt_s and rate == book.get("b").rate_mbit
    assert book.worst(["b"])[0] == pytest.approx(0.05)
    assert LinkEstimate(0.1).updated(None, None) == LinkEstimate(0.1, None, 2)
    with pytest.raises(ValueError, match="rtt_s"):
        book.record("c", rtt_s=-1.0)


def test_socket_buffers_are_set_only_where_the_bdp_exceeds_what_autotuning_reaches():
    assert bdp_bytes(100, 0.3) == 3_750_000  # the example: 100 Mbit/s x 300 ms
    assert buffer_bytes(100, 0.3, autotune_max=32 << 20, core_max=4 << 20) is None  # autotuning gets there
    assert buffer_bytes(500, 0.3, autotune_max=4 << 20, core_max=64 << 20) == 2 * 18_750_000  # 2 BDP
    assert buffer_bytes(10_000, 0.3, autotune_max=4 << 20, core_max=64 << 20) == 64 << 20  # capped
    assert buffer_bytes(10_000, 0.3, autotune_max=4 << 20, core_max=4 << 20) is None  # a cap below: no gain
    with socket.socket() as s:
        limits = {"snd_autotune_max": 1 << 20, "rcv_autotune_max": 1 << 20, "snd_core_max": 1 << 30,
                  "rcv_core_max": 1 << 30}
        done = size_buffers(s, 1000, 0.1, limits)
        assert done == {"snd": 25_000_000, "rcv": 25_000_000}
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > 0


def test_timeouts_grow_with_the_round_trip_time_and_keep_the_hierarchy():
    args = dict(encoded_bytes=50_000_000, numel=600_000, chunk_bytes=1 << 20, link_mbit=100, request_timeout=3,
                matchmaking_time=5)
    near, far = derive_timeouts(**args), derive_timeouts(**args, rtt_s=0.5)
    assert far.allreduce - near.allreduce == pytest.approx(SAFETY * EXCHANGE_RTTS * 0.5)
    assert far.next_chunk - near.next_chunk == pytest.approx(SAFETY * CHUNK_RTTS * 0.5)
    assert (far.request, far.matchmaking) == (3, 5)  # 6 RTT = 3 s, 3 + 4 RTT = 5 s: the given ones hold
    very = derive_timeouts(**args, rtt_s=1.0)  # the given ones are raised, never lowered
    assert very.request == REQUEST_RTTS * 1.0 and very.matchmaking == very.request + MATCH_RTTS * 1.0
    for t in (near, far, very):
        assert t.request < t.matchmaking < t.allreduce and t.next_chunk < t.allreduce
    with pytest.raises(ValueError, match="rtt_s"):
        derive_timeouts(**args, rtt_s=-0.1)


def test_link_timeouts_take_a_slower_measured_rate_but_never_a_faster_one():
    base = dict(encoded_bytes=50_000_000, numel=100_000_000, chunk_bytes=1 << 20, request_timeout=3,
                matchmaking_time=5)
    configured = link_timeouts(base, link_mbit=100, rtt_s=0.1, measured_mbit=None)
    slower = link_timeouts(base, link_mbit=100, rtt_s=0.1, measured_mbit=20)
    faster = link_timeouts(base, link_mbit=100, rtt_s=0.1, measured_mbit=1000)
    assert slower.allreduce > configured.allreduce == faster.allreduce
    assert configured == derive_timeouts(link_mbit=100, rtt_s=0.1, **base)


def test_a_kept_open_connection_is_reused_only_while_open_and_idle_for_less_than_the_limit():
    now = [0.0]
    pool = ConnectionPool(idle_s=10.0, clock=lambda: now[0])
    listener, client, server = _pair()
    try:
        client.setblocking(False)
        assert is_open(client)
        pool.give("addr", client)
        assert pool.take("addr") is client and pool.reused == 1  # open, idle 0 s
        assert pool.take("addr") is None  # taken: none left
        pool.give("addr", client)
        now[0] = 11.0
        assert pool.take("addr") is None  # idle too long: closed instead
        assert client.fileno() == -1
        listener2, client2, server2 = _pair()
        client2.setblocking(False)
        server2.close()  # the reducer closed it meanwhile
        pool.give("addr", client2)
        assert pool.take("addr") is None
        listener2.close()
    finally:
        for s in (client, server, listener):
            s.close()


def test_the_end_word_ends_a_rounds_messages_without_closing_the_connection():
    async def main():
        listener, client, server = _pair()
        for s in (client, server):
            s.setblocking(False)
        try:
            await write_end(client)
            assert await read_message(server, 1024) is None  # the round's messages end here
            await asyncio.get_event_loop().sock_sendall(client, b"more")  # the connection still carries bytes
            assert await asyncio.get_event_loop().sock_recv(server, 4) == b"more"
        finally:
            for s in (client, server, listener):
                s.close()
    assert END == 0xFFFFFFFF
    asyncio.run(main())


def test_the_rtt_a_round_measured_reaches_the_sync_record_the_summary_and_prometheus():
    import torch

    from opendiloco_stream.algorithm.sync_log import SyncLog
    from opendiloco_stream.net.prometheus import PeerMetrics
    from opendiloco_stream.stats import SyncStats
    from opendiloco_stream.transport.base import SyncResult

    records = []
    log = SyncLog(records.append)
    result = SyncResult(average=torch.zeros(3), group_size=2, weight_share=0.5, sent=torch.zeros(3),
                        links={"QmA": {"rtt_ms": 301.5, "rate_mbit": None, "reused": True}, "QmB": {"rtt_ms": None}})
    log.record(0, 3, 30, result, None, 0.1, None)
    rec = next(r for r in records if r.get("event") == "sync")
    assert rec["rtt_ms"] == {"QmA": 301.5}  # a groupmate with nothing measured is left out
    assert log.stats.peak_rtt_ms == 301.5 and SyncStats.total([log.stats, SyncStats()]).peak_rtt_ms == 301.5
    metrics = PeerMetrics({"run": "r", "peer": "me"})
    metrics.observe(rec)
    text = metrics.exposition()
    assert 'ods_groupmate_rtt_seconds{fragment="0",groupmate="QmA",peer="me",run="r"} 0.3015' in text


def test_a_round_that_outlasts_its_window_at_distance_says_what_to_change():
    from opendiloco_stream.commands.link_fit import EXCHANGE_RTTS, MATCH_RTTS, SLOW_START_RTTS, round_fit

    args = dict(inner_steps=10, fragments=2, overlap_steps=1, params=3e6, layers=4, codec_bits=4.5, step_time_s=0.2,
                link_mbit=100)
    near = round_fit(mode="eager", rtt_s=0.0, prematch=False, slow_start_after_idle=True, **args)
    assert near.fits and near.window_s == pytest.approx(2.0) and near.advice == []
    far = round_fit(mode="eager", rtt_s=0.3, prematch=False, slow_start_after_idle=True, **args)
    assert far.rtts == MATCH_RTTS + EXCHANGE_RTTS + SLOW_START_RTTS and not far.fits
    assert far.round_s == pytest.approx(far.transfer_s + far.rtts * 0.3)
    assert any("--prematch-steps" in a for a in far.advice) and any("slow_start_after_idle" in a for a in far.advice)
    assert any(a.startswith("--inner-steps 20") for a in far.advice)  # 3.9 s / 0.2 s per step
    tuned = round_fit(mode="eager", rtt_s=0.3, prematch=True, slow_start_after_idle=False, **args)
    assert tuned.rtts == EXCHANGE_RTTS and tuned.fits  # transfer + 1.5 RTT < 2 s
    blocking = round_fit(mode="blocking", rtt_s=0.3, prematch=False, slow_start_after_idle=True, **args)
    assert blocking.window_s is None and not blocking.fits and blocking.utilization < near.utilization
    assert any("--mode eager" in a for a in blocking.advice)


def test_the_rtt_probe_times_tcp_handshakes_to_an_initial_peers_address():
    from opendiloco_stream.net.distance import _tcp_port, probe_peers

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    try:
        maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWQK8tJXrS3xx5ErssHn9JCwSLVTEXtJEmihpDjSFaJE14"
        assert _tcp_port(maddr) == port
        rtts = probe_peers([maddr], samples=3, timeout=2.0)
        assert 0 < rtts[maddr] < 2.0
    finally:
        listener.close()
    assert probe_peers([maddr], samples=1, timeout=1.0)[maddr] is None  # nobody listens now
