"""The WAN emulation layer of benchmarks/wan.py: namespaces, tbf shaping, counters, teardown, and
the user-space forwarder that adds delay and loss between regions (benchmarks/harness/wan_emulator.py).

Needs root and ``ip netns``; skipped with the reason otherwise. Bounded: one ~2 MB transfer at
8 Mbit/s (~2 s) plus namespace set-up, ~15 s of echoes and datagrams through the forwarder, and
one short run of transport_rounds.py over 50 Mbit/s links.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import netns
from benchmarks.harness import wan_probes
from benchmarks.harness.nat import NatTopology
from benchmarks.harness.wan_emulator import Link, Outage, Regions
from opendiloco_stream.net.lifecycle import is_running
from tests.support.peers import run_benchmark

REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.network,
              pytest.mark.skipif(REASON is not None, reason=f"WAN emulation unavailable: {REASON}")]

RATE_MBIT = 8.0
NBYTES = 2_000_000


@pytest.fixture
def topo():
    t = netns.Topology(peers=2, prefix=f"{netns.PREFIX}{os.getpid()}")
    t.create()
    try:
        yield t
    finally:
        t.teardown()


def test_two_peer_topology_is_isolated_and_connected(topo):
    names = set(netns.our_namespaces())
    assert {topo.ns("boot"), topo.ns("p0"), topo.ns("p1"), topo.bridge} <= names
    # no default route anywhere: traffic cannot leave the namespaces we made
    for node in topo.nodes:
        routes = subprocess.run(["ip", "-n", topo.ns(node), "route", "show"], capture_output=True, text=True).stdout
        assert "default" not in routes
        assert f"{netns.SUBNET}.0/24" in routes
    # the root namespace got no interface of ours
    root_links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert netns.IFACE not in root_links and "vp0" not in root_links


def test_tbf_limits_throughput_and_counters_see_the_bytes(topo):
    topo.shape(RATE_MBIT)
    assert "tbf" in topo.qdisc("p0") and "rate 8Mbit" in topo.qdisc("p0")
    before_src, before_dst = topo.counters("p0"), topo.counters("p1")
    result = netns.measure_throughput(topo, "p0", "p1", NBYTES, timeout=40.0)
    after_src, after_dst = topo.counters("p0"), topo.counters("p1")
    assert result["bytes"] == NBYTES
    assert abs(result["mbit_s"] - RATE_MBIT) / RATE_MBIT < 0.25, result
    sent = after_src["tx_bytes"] - before_src["tx_bytes"]
    received = after_dst["rx_bytes"] - before_dst["rx_bytes"]
    # payload plus TCP/IP/Ethernet headers: a little more than the payload, never less
    assert NBYTES <= sent < NBYTES * 1.10, sent
    assert NBYTES <= received < NBYTES * 1.10, received
    assert after_src["tx_packets"] > before_src["tx_packets"]


def test_unshaped_link_is_much_faster_than_the_limit(topo):
    # the limit comes from tbf, not from the machine: without it the same transfer is far faster
    result = netns.measure_throughput(topo, "p0", "p1", NBYTES, timeout=40.0)
    assert result["mbit_s"] > 4 * RATE_MBIT, result


def test_emulated_rtt_is_twice_the_one_way_delay_between_each_pair_of_regions():
    """Three regions (us/eu/asia RTTs 75, 230, 160 ms), one peer in each: the median UDP echo
    between two peers is their regions' RTT (2 x the one-way delay the forwarder holds each frame)
    within 2 ms. Medians: a loaded machine delays a few echoes by more (the benchmark shows how much)."""
    with netns.Topology(peers=3, regions=Regions.preset("us/eu/asia")) as topo:
        assert topo.delayed and [topo.region_of(p) for p in topo.peers()] == ["us", "eu", "asia"]
        for a, b, rtt in (("p0", "p1", 75.0), ("p0", "p2", 230.0), ("p1", "p2", 160.0)):
            assert topo.rtt_ms(a, b) == rtt
            echo = wan_probes.measure_rtt(topo, a, b, count=25)
            assert echo["replies"] == 25, echo
            assert abs(echo["median_ms"] - rtt) < 2.0, (a, b, echo)
        stats = topo.emulator_stats()
        assert stats["frames_out"] > 150 and stats["kernel_drops"] == 0 and stats["gso_frames"] == 0, stats


def test_loss_rate_applies_per_packet_on_the_lossy_link_only():
    """10% loss between two regions: about 10% of ~900 datagrams sent across are lost (binomial
    spread ~1%, the bounds ~5 of it); none is lost between two peers of one region."""
    regions = Regions(("a", "b"), {frozenset("ab"): Link(rtt_ms=20.0, loss=0.10)})
    with netns.Topology(peers=3, regions=regions, place={"p0": "a", "p1": "b", "p2": "a"}) as topo:
        across = wan_probes.measure_udp(topo, "p0", "p1", mbit=5.0, seconds=2.0)
        within = wan_probes.measure_udp(topo, "p0", "p2", mbit=5.0, seconds=1.0)
    assert across["sent"] > 800 and 0.05 < across["lost_fraction"] < 0.15, across
    assert within["lost_fraction"] == 0.0, within


def test_an_outage_cuts_every_frame_across_the_link_until_restored_and_none_within_a_region():
    """``topo.outage(True)``: nothing crosses between regions a and b (datagrams and echoes), while
    two peers of one region still talk; ``outage(False)``: the link is back at its RTT. A scheduled
    ``Outage`` cuts the same port pairs (its config)."""
    regions = Regions.pair(20.0)
    with netns.Topology(peers=3, regions=regions, place={"p0": "a", "p1": "b", "p2": "a"}) as topo:
        topo.outage(True)
        across = wan_probes.measure_rtt(topo, "p0", "p1", count=5, wait=0.3)
        within = wan_probes.measure_rtt(topo, "p0", "p2", count=5, wait=0.3)
        topo.outage(False)
        echo = wan_probes.measure_rtt(topo, "p0", "p1", count=5)
        time.sleep(0.6)  # the stats file is rewritten every half second
        stats = topo.emulator_stats()
    assert across["replies"] == 0 and within["replies"] == 5, (across, within)
    assert echo["replies"] == 5 and abs(echo["median_ms"] - 20.0) < 2.0, echo
    assert stats["outage_drops"] >= 6, stats  # the 6 echoes across (the first one too)
    config = regions.forwarder_config({"va": "a", "vb": "b", "vc": "a"}, 0, "/dev/null",
                                      (Outage(1.0, 2.0), Outage(3.0, 4.0, between=("a", "b"))))
    across_ab = [[False, True, False], [True, False, True], [False, True, False]]
    assert config["cut"] == across_ab and [o["cut"] for o in config["outages"]] == [across_ab, across_ab]
    assert [(o["start_s"], o["end_s"]) for o in config["outages"]] == [(1.0, 2.0), (3.0, 4.0)]


def test_nat_routers_sit_on_the_delayed_segment():
    """NatTopology on regions: the private peer is in its router's region, its traffic crosses the
    forwarder (RTT of the regions), and the router still keeps one public port per source port."""
    with NatTopology(public=1, natted=1, regions=Regions.pair(40.0), place={"n0": "b"}) as topo:
        assert (topo.region_of("p0"), topo.region_of("r0"), topo.region_of("n0")) == ("a", "b", "b")
        echo = wan_probes.measure_rtt(topo, "n0", "p0", count=10)
        assert abs(echo["median_ms"] - 40.0) < 2.0, echo
        assert topo.mapped_ports("n0", ["p0", "boot"]) == [40000, 40000]


def test_teardown_removes_namespaces_and_processes():
    t = netns.Topology(peers=2, prefix=f"{netns.PREFIX}{os.getpid()}")
    t.create()
    sleeper = subprocess.Popen(t.exec_argv("p0", [sys.executable, "-c", "import time; time.sleep(120)"]))
    try:
        # `ip netns exec` enters the namespace a moment after Popen returns: wait for it (bounded)
        deadline = time.monotonic() + 10
        while sleeper.pid not in netns.namespace_pids(t.ns("p0")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in netns.namespace_pids(t.ns("p0"))
        t.teardown()
        assert sleeper.wait(timeout=10) is not None  # killed by teardown, not by us
        assert [n for n in netns.our_namespaces() if n.startswith(t.prefix + "-")] == []
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert "vp0" not in links and "vboot" not in links
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(5)
        t.teardown()


def test_cleanup_leftovers_removes_a_dead_runs_namespaces():
    dead_pid = 2 ** 22 + 12345  # above pid_max's default: no live process has it
    stale = netns.Topology(peers=1, prefix=f"{netns.PREFIX}{dead_pid}")
    stale.create()
    stale._restore_handlers()  # pretend its creator died without cleaning up
    stale.created = []
    live = netns.Topology(peers=1)
    live.create()
    try:
        removed = netns.cleanup_leftovers()
        assert {stale.bridge, stale.ns("boot"), stale.ns("p0")} <= set(removed)
        remaining = netns.our_namespaces()
        assert live.ns("p0") not in removed and live.ns("p0") in remaining
    finally:
        live.teardown()
        netns.delete_namespaces([n for n in netns.our_namespaces(dead_pid)])


@pytest.mark.network
@pytest.mark.timeout(300)
def test_transport_rounds_over_shaped_links_times_gloo_on_the_same_links(tmp_path):
    """benchmarks/transport_rounds.py --link-mbit: 3 peers and 3 gloo ranks, each in a namespace
    behind a 50 Mbit/s link: the peers listen on the namespaces' addresses, gloo binds the
    namespaces' ``wan0`` (which the root namespace does not have), and the namespaces are gone after."""
    out, numel, rate = tmp_path / "rounds.json", 200_000, 50.0
    before = set(netns.our_namespaces())
    run = run_benchmark("transport_rounds", "--codecs", "fp32", "fp4-e3m0", "--numels", str(numel), "--rounds", "1",
                        "--gloo", "--link-mbit", str(rate), "--out", str(out), timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["link_mbit"] == rate and report["probe_mbit_s"] > 0
    fp32, fp4 = report["rows"]
    ring_bytes = 2 * (3 - 1) / 3 * 4 * numel  # what each gloo rank (and each of our fp32 peers) sends at least
    for row in (fp32, fp4):
        assert row["link_mbit"] == rate and row["gloo_round_s"] > 0
        ips = {m.split("/")[2] for m in row["peer_maddrs"] if m.startswith("/ip4/")}
        assert ips and all(ip.startswith(netns.SUBNET + ".") for ip in ips), row["peer_maddrs"]
        # the floor is the busiest peer's bytes over the rate (peers move about the same bytes here)
        assert abs(row["link_floor_s"] - 8 * row["bytes_sent_per_peer"] / (rate * 1e6)) < 0.1 * row["link_floor_s"]
    assert fp32["bytes_sent_per_peer"] >= ring_bytes and fp4["bytes_sent_per_peer"] < fp32["bytes_sent_per_peer"] / 4
    # the benchmark removed its namespaces: none is left by a process that has exited (those of live
    # processes belong to tests running beside this one, on the other test worker)
    left = [n for n in set(netns.our_namespaces()) - before if not is_running(int(n[len(netns.PREFIX):].split("-")[0]))]
    assert left == []


_KEEP_WINDOW_PROBE = """
import json, socket
from opendiloco_stream.net import tcp
s = socket.socket()
chosen = tcp.keep_window(s)
now = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()
print(json.dumps({"chosen": chosen, "now": now, "restarts": tcp.restarts_after_idle(),
                  "allowed": tcp.allowed_congestion_controls()}))
"""


@pytest.mark.parametrize("slow_start_after_idle", [1, 0])
def test_a_kept_open_connection_leaves_a_congestion_control_that_restarts_its_window_after_idle(slow_start_after_idle):
    """In a namespace whose connections use reno (its window restarts after each idle gap, as
    cubic's does) with ``tcp_slow_start_after_idle = 1``, a direct-path socket switches itself to
    BBR when any process may choose it (``net.tcp.keep_window``), and nothing else is asked of the
    user; with the sysctl at 0, or BBR not allowed, it keeps reno (and doctor/the notice say so)."""
    ns = f"odsw{os.getpid()}-cc{slow_start_after_idle}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_congestion_control=reno",
                        f"net.ipv4.tcp_slow_start_after_idle={slow_start_after_idle}"], check=True)
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _KEEP_WINDOW_PROBE],
                             capture_output=True, text=True, check=True, timeout=60)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    seen = json.loads(out.stdout)
    if slow_start_after_idle and "bbr" in seen["allowed"]:
        assert seen == {**seen, "chosen": "bbr", "now": "bbr", "restarts": False}
    else:
        assert seen["chosen"] is None and seen["now"] == "reno"
        assert seen["restarts"] is bool(slow_start_after_idle)
