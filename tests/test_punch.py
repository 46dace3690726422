"""Hole punching for the direct data path (``transport/hivemind/punch.py``).

In-process: the echo server reports a connection's source port; the NAT kind follows from the
echoes; the reachability rule places reducers where every member reaches them directly, and
leaves the choice alone where none qualifies. In the NAT topology (root, ``nft``; two peers each
behind its own router, the echo server public): behind home-router NATs a simultaneous open
gives one connection between the two mapped addresses, and a sealed message crosses it intact
while a flipped byte does not open; behind symmetric NATs the punch fails within its bound.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from opendiloco_stream.net.reachability import EchoServer, nat_kind, observe
from opendiloco_stream.transport.hivemind.punch import (
    CONE, OPEN, SYMMETRIC, UNKNOWN, UNREACHED_FIRST_S, UNREACHED_MAX_S, Puncher, can_punch, direct_reducers,
    punch_info,
)
from tests.support.nat import NatTopology, unavailable_reason


# ---------------------------------------------------------------------------------------- in-process
def test_the_echo_server_reports_the_source_port_of_the_connection():
    server = EchoServer("127.0.0.1")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for _ in range(2):  # the same local port twice: the echo closes first, the port is free again
            ip, seen, local = observe(port, ("127.0.0.1", server.port))
            assert (ip, seen, local) == ("127.0.0.1", port, "127.0.0.1")
    finally:
        server.close()


def test_a_puncher_without_nat_is_open_and_announces_both_ports():
    server = EchoServer("127.0.0.1")
    try:
        puncher = Puncher.start([("127.0.0.1", server.port)], bind_host="127.0.0.1")
        assert puncher is not None and puncher.kind == OPEN
        meta = puncher.meta()
        assert meta["send"] == ["127.0.0.1", puncher.send_port] and meta["recv"] == ["127.0.0.1", puncher.recv_port]
        assert punch_info({"punch": meta}) == meta and meta["unreached"] == []
        puncher.mark_unreached("peerX")
        assert puncher.meta()["unreached"] == ["peerX"]
        puncher.close()
    finally:
        server.close()
    assert Puncher.start([("127.0.0.1", 1)], bind_host="127.0.0.1") is None  # no echo: no punching


def test_a_failed_punch_backs_off_from_seconds_doubling_and_a_punched_exchange_resets_it():
    """After a punched connection breaks, the next punch between the same ports fails while the
    routers still hold the old connection (~10 s): the pair is kept off the direct path for 15 s,
    not minutes; only repeated failures back off further (to 10 minutes), and a punched
    connection that works starts the back-off afresh."""
    now = [1000.0]
    puncher = Puncher(1, 2, ("9.9.9.9", 1), ("9.9.9.9", 2), CONE, clock=lambda: now[0])
    assert puncher.mark_unreached("peerX") == UNREACHED_FIRST_S == 15.0
    assert puncher.meta()["unreached"] == ["peerX"]
    now[0] += 14.9
    assert puncher.unreached() == ["peerX"]
    now[0] += 0.2
    assert puncher.unreached() == []  # punched again after 15 s
    backoffs = [puncher.mark_unreached("peerX") for _ in range(8)]  # failing again and again
    assert backoffs == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0, 600.0] and UNREACHED_MAX_S == 600.0
    assert puncher.unreached() == ["peerX"] and puncher.failed == 9
    puncher.mark_reached("peerX")  # an exchange went through a punched connection
    assert puncher.unreached() == []
    assert puncher.mark_unreached("peerX") == 15.0
    assert puncher.mark_unreached("peerY") == 15.0 and puncher.unreached() == ["peerX", "peerY"]


@pytest.mark.parametrize("seen,recv,kind", [
    ([("1.2.3.4", 5000, "1.2.3.4")], ("1.2.3.4", 5001), OPEN),
    ([("9.9.9.9", 5000, "192.168.1.2"), ("9.9.9.9", 5000, "192.168.1.2")], ("9.9.9.9", 5001), CONE),
    ([("9.9.9.9", 6000, "192.168.1.2"), ("9.9.9.9", 6000, "192.168.1.2")], ("9.9.9.9", 7000), CONE),
    ([("9.9.9.9", 6000, "192.168.1.2"), ("9.9.9.9", 6001, "192.168.1.2")], ("9.9.9.9", 7000), SYMMETRIC),
    ([("9.9.9.9", 5000, "192.168.1.2")], ("9.9.9.9", 5001), CONE),
    ([("9.9.9.9", 6000, "192.168.1.2")], ("9.9.9.9", 5001), UNKNOWN),
])
def test_the_nat_kind_follows_from_the_echoes(seen, recv, kind):
    assert nat_kind(5000, 5001, seen, recv) == kind


def _member(nat=None, direct=None, client=False, unreached=(), relayed=None):
    meta = {"client": client, "relayed": direct is None if relayed is None else relayed}
    if nat is not None:
        meta["punch"] = {"send": ["9.9.9.9", 1000], "recv": ["9.9.9.9", 1001], "nat": nat, "unreached": list(unreached)}
    return meta, direct


def _reducers(*members):
    users, direct = zip(*members)
    names = [f"p{i}" for i in range(len(users))]
    return direct_reducers(list(users), names, list(direct), [not u["client"] for u in users])


def test_reducers_are_the_members_everyone_reaches_directly():
    public = _member(OPEN, direct=("10.0.0.1", 9000))
    assert _reducers(public, _member(CONE), _member(CONE)) == [True, True, True]
    # a symmetric NAT reaches the cones by no punch: only the listening peer reduces
    assert _reducers(public, _member(CONE), _member(SYMMETRIC)) == [True, False, False]
    # two cones whose punch failed (one reported the other unreached): neither reduces this round
    assert _reducers(public, _member(CONE, unreached=["p2"]), _member(CONE)) == [True, False, False]
    # a client never reduces, even where it could be reached
    assert _reducers(public, _member(CONE, client=True)) == [True, False]


def test_without_a_member_everyone_reaches_every_non_client_reduces_through_the_relay():
    assert _reducers(_member(SYMMETRIC), _member(SYMMETRIC)) == [True, True]
    assert _reducers(_member(CONE), _member(SYMMETRIC)) == [True, True]
    assert _reducers(_member(None), _member(None), _member(None, client=True)) == [True, True, False]
    assert not can_punch(None, {"nat": CONE}) and can_punch({"nat": OPEN}, {"nat": UNKNOWN})


def test_a_peer_without_a_data_port_that_is_not_relayed_still_reduces():
    """``--no-direct``: no address, no punch, but its p2p daemon is dialed directly, not relayed."""
    public = _member(OPEN, direct=("10.0.0.1", 9000))
    assert _reducers(public, _member(None, relayed=False)) == [True, True]
    # ... while a relayed cone, which it has no puncher to reach, reduces nothing that round
    assert _reducers(public, _member(None, relayed=False), _member(CONE)) == [True, True, False]


# ---------------------------------------------------------------------------------------- behind NAT
REASON = unavailable_reason()
behind_nat = pytest.mark.skipif(REASON is not None, reason=f"NAT topology unavailable: {REASON}")


def _punch_pair(tmp_path, symmetric: bool, tamper: bool = False) -> dict:
    """Both ends of a punch (tests/support/punch_pair.py) between n0 and n1, the echo in boot."""
    py = [sys.executable, "-m", "tests.support.punch_pair"]
    with NatTopology(public=0, natted=2, symmetric=symmetric) as topo:
        echo = subprocess.Popen(topo.exec_argv("boot", [*py, "echo", str(tmp_path), "60"]))
        try:
            deadline = time.monotonic() + 30
            while not (tmp_path / "echo.port").exists():
                assert echo.poll() is None and time.monotonic() < deadline, "the echo server did not start"
                time.sleep(0.05)
            port = (tmp_path / "echo.port").read_text()
            ends = [subprocess.Popen(topo.exec_argv(n, [*py, role, str(tmp_path), topo.ip("boot"), port]
                                                    + ["--tamper"] * tamper))
                    for n, role in (("n0", "a"), ("n1", "b"))]
            for p in ends:
                assert p.wait(60) == 0
        finally:
            echo.kill()
            echo.wait(5)
        routers = {n: topo.public_ip(n) for n in ("n0", "n1")}
    return {"routers": routers, **{r: json.loads((tmp_path / f"{r}.result").read_text()) for r in "ab"}}


@pytest.mark.network
@behind_nat
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tamper", [False, True], ids=["sealed", "tampered"])
def test_two_peers_behind_home_router_nats_punch_one_connection_and_seal_over_it(tmp_path, tamper):
    out = _punch_pair(tmp_path, symmetric=False, tamper=tamper)
    a, b = out["a"], out["b"]
    assert a["kind"] == b["kind"] == CONE, out
    assert a["punched"] and b["punched"], out
    # one connection: each end sees the other's router and mapped port, as announced
    assert a["peer"] == b["meta"]["recv"] and b["peer"] == a["meta"]["send"], out
    assert a["peer"][0] == out["routers"]["n1"] and b["peer"][0] == out["routers"]["n0"]
    if tamper:
        assert "seal_error" in b and "opened" not in b, out
    else:
        assert b["opened"] is True and b["end"] is True and "seal_error" not in b, out


@pytest.mark.network
@behind_nat
@pytest.mark.timeout(180)
def test_behind_symmetric_nats_the_punch_fails_within_its_bound(tmp_path):
    out = _punch_pair(tmp_path, symmetric=True)
    assert not out["a"]["punched"] and not out["b"]["punched"], out
    assert out["a"]["kind"] in (SYMMETRIC, UNKNOWN) and out["b"]["kind"] in (SYMMETRIC, UNKNOWN), out


def test_exchanges_by_path_are_counted_in_the_summary_and_in_prometheus():
    from opendiloco_stream.net.prometheus import PeerMetrics
    from opendiloco_stream.stats import SyncStats

    stats = SyncStats()
    stats.count_exchanges({"punched": 2, "direct": 1})
    stats.count_exchanges({"relayed": 1})
    assert (stats.direct_exchanges, stats.punched_exchanges, stats.relayed_exchanges, stats.p2p_exchanges) == (1, 2, 1, 0)
    assert stats.merge(stats).summary_fields(2)["punched_exchanges"] == 4
    metrics = PeerMetrics({"run": "r", "peer": "p"})
    for exchanges in ({"punched": 2, "direct": 1}, {"punched": 1}):
        metrics.observe({"event": "sync", "fragment": 0, "round": 1, "ok": True, "wait_s": 0.1, "bytes_sent": 1,
                         "bytes_received": 1, "group_size": 3, "exchanges": exchanges})
    text = metrics.exposition()
    assert 'ods_exchanges_total{fragment="0",path="punched",peer="p",run="r"} 3.0' in text, text
    assert 'ods_exchanges_total{fragment="0",path="direct",peer="p",run="r"} 1.0' in text, text
