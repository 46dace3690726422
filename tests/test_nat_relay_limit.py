"""A circuit relay must carry a relayed round, not go-libp2p's default 128 KiB per connection
(``net/relay_check.py``).

hivemind's p2pd serves circuit relay v2 twice on one protocol (the one configured from its flags,
4 GiB and 30 minutes per relayed connection, and one with go-libp2p's defaults, 128 KiB and
2 minutes) and whichever registers last serves; when it is the default one, every relayed
exchange of a round is reset. These tests run real p2p daemons on 127.0.0.1 (no NAT needed: a
relayed connection is one whatever the NAT): a daemon started with ``-relayService=0`` runs only
the default relay, and the probe reports it ``limited`` after about 128 KiB; a relay that
``start_relay`` started (the bootstrap's path) and a ``bootstrap --relay`` process carry 512 KiB
through one relayed connection, probed from outside, every time.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.harness.peers import PeerProcesses
from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.dht import stop_dht, visible_maddrs
from opendiloco_stream.net.relay_check import (
    DEFAULT_RELAY_DATA_LIMIT, PROBE_BYTES, Daemon, RelayVerdict, pin_port, local_relay_maddrs, probe_relay, start_relay,
)


ID = "12D3KooWEpDUHmB3dTNVLP4BePWbtTcrhXxkNQcLcSBuRimGaJMf"


def test_the_probe_dials_the_relay_where_it_listens_and_a_restart_keeps_its_port():
    """A relay announced at a public IP (which its own machine may not reach) is probed where it
    listens: 127.0.0.1 for a wildcard, else the listening IP; a random port is the one it got, and
    a restart listens on that port again (the address printed stays valid)."""
    visible = [f"/ip4/203.0.113.7/tcp/31337/p2p/{ID}"]
    assert local_relay_maddrs(visible, ["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1"]) == \
        [f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}"]
    assert local_relay_maddrs([f"/ip4/10.77.0.2/tcp/40011/p2p/{ID}"], ["/ip4/10.77.0.2/tcp/0"]) == \
        [f"/ip4/10.77.0.2/tcp/40011/p2p/{ID}"]
    assert pin_port(["/ip4/10.77.0.2/tcp/0"], [f"/ip4/10.77.0.2/tcp/40011/p2p/{ID}"]) == ["/ip4/10.77.0.2/tcp/40011"]
    assert pin_port(["/ip4/0.0.0.0/tcp/31337"], visible) == ["/ip4/0.0.0.0/tcp/31337"]


@pytest.mark.network
@pytest.mark.timeout(120)
def test_the_probe_finds_a_relay_at_go_libp2p_default_limits_resetting_after_128_KiB():
    """A p2pd started with ``-relayService=0`` runs only the relay with go-libp2p's default
    limits: what a relay serves when the configured one loses the race."""
    async def start() -> Daemon:
        return await Daemon.start({"relay": True, "relayService": False, "forceReachabilityPublic": True,
                                   "hostAddrs": "/ip4/127.0.0.1/tcp/0", "dhtServer": True})

    loop = asyncio.new_event_loop()
    relay = loop.run_until_complete(start())
    try:
        maddrs = [str(m) for m in loop.run_until_complete(relay.p2p.get_visible_maddrs())]
        # an inconclusive probe (its helper daemons could not reach the relay: seen once in a full
        # suite on a loaded machine, "failed to connect to bootstrap peers") is repeated, as in the
        # test below; the verdict, once there is one, must be "limited"
        for _ in range(3):
            probe = probe_relay(maddrs)
            if probe.verdict is not RelayVerdict.UNKNOWN:
                break
    finally:
        loop.run_until_complete(relay.stop())
        loop.close()
    assert probe.verdict is RelayVerdict.LIMITED, probe
    assert probe.moved_bytes <= DEFAULT_RELAY_DATA_LIMIT < PROBE_BYTES, probe


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relay_started_for_the_bootstrap_carries_a_relayed_round_every_time():
    """Three relays in a row (the race is lost at one start in several here): each, probed again
    after ``start_relay`` returned, carries 512 KiB through one relayed connection. The self-test
    itself may end inconclusive (in a full suite, once: every probe's helper daemon exited with
    "failed to connect to bootstrap peers"), never limited; the probe from outside, repeated while
    inconclusive, must find the relay carrying."""
    for _ in range(3):
        dht, probe = start_relay(NetConfig(run_id="relaycheck"), use_relay=True, force_reachability="public")
        try:
            assert probe.verdict in (RelayVerdict.CARRIES, RelayVerdict.UNKNOWN), probe
            for attempt in range(5):
                again = probe_relay(local_relay_maddrs(visible_maddrs(dht), ["/ip4/127.0.0.1/tcp/0"]))
                if again.verdict is not RelayVerdict.UNKNOWN:
                    break
                time.sleep(1.0 + attempt)
            assert again.verdict is RelayVerdict.CARRIES and again.moved_bytes == PROBE_BYTES, again
        finally:
            stop_dht(dht)


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bootstrap_relay_serves_relayed_connections_past_128_KiB(tmp_path):
    with PeerProcesses(tmp_path) as run:
        addr_file = tmp_path / "relay.addrs"
        proc = run.start("relay", ["bootstrap", "--run-id", "relaycheck", "--relay", "--addr-file", str(addr_file),
                                   "--log-level", "INFO"])
        deadline = time.monotonic() + 240
        while not (addr_file.exists() and addr_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "relay.log").read_text()[-2000:]
            time.sleep(0.2)
        probe = probe_relay(addr_file.read_text().split())
        log = (tmp_path / "relay.log").read_text()
    assert probe.verdict is RelayVerdict.CARRIES and probe.moved_bytes == PROBE_BYTES, (probe, log[-2000:])
    assert "relay self-test: 524288 bytes through one relayed connection" in log, log[-2000:]


def _start_bootstrap(run: PeerProcesses, name: str, *flags: str) -> list[str]:
    """A ``bootstrap`` process on 127.0.0.1 with ``flags``; its addresses once it printed them."""
    addr_file = run.workdir / f"{name}.addrs"
    proc = run.start(name, ["bootstrap", "--run-id", "relaydoc", "--addr-file", str(addr_file), *flags])
    deadline = time.monotonic() + 240
    while not (addr_file.exists() and addr_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, (run.workdir / f"{name}.log").read_text()[-2000:]
        time.sleep(0.2)
    return addr_file.read_text().split()


@pytest.mark.network
@pytest.mark.timeout(300)
def test_doctor_says_which_relay_among_the_initial_peers_carries_a_round_and_which_resets_at_128_KiB(tmp_path):
    """``doctor --relay`` probes every initial peer as a relay: a ``bootstrap --relay`` carries
    512 KiB (ok); a bootstrap without ``--relay`` serves only go-libp2p's default relay, which
    resets the connection before 128 KiB crossed (FAIL, with the fix: restart it with --relay)."""
    with PeerProcesses(tmp_path) as run:
        relay = _start_bootstrap(run, "relay", "--relay")
        plain = _start_bootstrap(run, "plain", "--initial-peers", *relay)
        proc = run.start("doctor", ["doctor", "--relay", "--run-id", "relaydoc", "--timeout", "10",
                                    "--initial-peers", *relay, *plain])
        code = proc.wait(180)
        out = (tmp_path / "doctor.log").read_text()
    lines = [line for line in out.splitlines() if "] relay:" in line]
    assert len(lines) == 2 and code == 1 and "1 check(s) failed: relay" in out, out
    assert f"[ok] relay: {relay[0]} carried {PROBE_BYTES} bytes through one relayed connection" in lines[0], out
    assert lines[1].startswith(f"[FAIL] relay: {plain[0]} reset a relayed connection after "), out
    moved = int(lines[1].split(" reset a relayed connection after ")[1].split()[0])
    assert moved <= DEFAULT_RELAY_DATA_LIMIT, out
    assert "fix: restart that bootstrap with --relay" in out, out
