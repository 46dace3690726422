"""Networking: DHT start and its errors, identity, signed metrics, lifecycle, and the bootstrap /
doctor / monitor commands, all with real hivemind nodes on 127.0.0.1.

Every process a test starts is killed by PID in a ``finally``; nodes are stopped with ``stop_dht``,
which verifies that their p2pd is gone.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.dht import (PRIVATE_STATIC_RELAYS, NetError, ensure_identity, listen_maddrs,
                                       relayed_peer_kwargs, start_dht, stop_dht, visible_maddrs)
from opendiloco_stream.net.keys import run_key
from opendiloco_stream.net.lifecycle import descendants, is_running, kill_process_tree, process_name
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[1]
FAKE_ID = "QmXcY4ZNkgxUS8Ca41UAYUdtqNjvHj6Lk2SHv9iBR5Yqgh"  # well-formed peer id nobody uses

# Runs one command through the real cli.main (its error handling, exit codes) with only that
# command registered, so it works while other command modules are still being written.
RUNNER = ("import sys, opendiloco_stream.cli as cli; cli.COMMANDS = (sys.argv[1],); "
          "sys.exit(cli.main(sys.argv[1:]))")


def _p2pd_under(pid: int) -> list[int]:
    return [p for p in descendants(pid) if process_name(p) == "p2pd"]


def _spawn(*argv: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", RUNNER, *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)


def _spawn_long(*argv: str, log: Path) -> subprocess.Popen:
    """A long-running command; stderr goes to ``log`` so that nobody has to drain a pipe."""
    with open(log, "w") as f:
        return _spawn(*argv, stderr=f)


def _run(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    proc = _spawn(*argv)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_process_tree(proc.pid, timeout=2)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _has_controlling_terminal() -> bool:
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
        return True
    except OSError:
        return False


def _readline(proc: subprocess.Popen, timeout: float) -> Optional[str]:
    """The next stdout line of ``proc``, or None if none came within ``timeout``.

    A reader thread per process feeds a queue: selecting on the pipe would miss lines already
    sitting in the text wrapper's buffer.
    """
    if not hasattr(proc, "lines"):
        proc.lines = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                proc.lines.put(line)
            proc.lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
    try:
        return proc.lines.get(timeout=timeout)
    except queue.Empty:
        return None


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """A real ``bootstrap`` command in a subprocess; yields (address, process)."""
    folder = tmp_path_factory.mktemp("boot")
    proc = _spawn_long("bootstrap", "--addr-file", str(folder / "addrs"), "--run-id", "net-test",
                       log=folder / "stderr")
    try:
        line = _readline(proc, 90)
        assert line and line.startswith("--initial-peers /ip4/127.0.0.1/"), (line, proc.poll())
        yield line.split()[1], proc
    finally:
        kill_process_tree(proc.pid, timeout=5)
        proc.wait(5)


# ---------------------------------------------------------------------------------- config checks


@pytest.mark.network  # start_dht: were a check missing, a node would start
def test_bad_multiaddrs_are_one_line_errors_naming_the_value_and_a_good_example():
    cases = {
        "1.2.3.4:5": dict(initial_peers=["1.2.3.4:5"]),
        "no /p2p/": dict(initial_peers=["/ip4/127.0.0.1/tcp/5"]),
        "/ip4/1.2.3/tcp/0": dict(host_maddrs=["/ip4/1.2.3/tcp/0"]),
        "--public-ip": dict(public_ip="203.0.113.7"),  # without a fixed port
        "not-an-ip": dict(public_ip="not-an-ip", port=31337),
        "a.b": dict(run_id="a.b"),
    }
    for needle, fields in cases.items():
        with pytest.raises(NetError) as e:
            start_dht(NetConfig(**fields))
        message = str(e.value)
        assert "\n" not in message
        assert needle in message, message
    with pytest.raises(NetError, match=r"expected e\.g\. /ip4/"):
        listen_maddrs(NetConfig(initial_peers=["1.2.3.4:5"]))


def test_listen_defaults_local_for_local_runs_and_shortcuts_for_wan():
    local = NetConfig(initial_peers=[f"/ip4/127.0.0.1/tcp/4/p2p/{FAKE_ID}"])
    assert listen_maddrs(local) == (["/ip4/127.0.0.1/tcp/0"], [])
    remote = NetConfig(initial_peers=[f"/ip4/203.0.113.7/tcp/4/p2p/{FAKE_ID}"])
    assert listen_maddrs(remote) == (["/ip4/0.0.0.0/tcp/0"], [])
    wan = NetConfig(port=31337, public_ip="198.51.100.4")
    assert listen_maddrs(wan) == (["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1"],
                                  ["/ip4/198.51.100.4/tcp/31337", "/ip4/198.51.100.4/udp/31337/quic-v1"])
    explicit = NetConfig(port=1, public_ip="198.51.100.4", host_maddrs=["/ip4/10.0.0.2/tcp/7"],
                         announce_maddrs=["/ip4/198.51.100.4/tcp/7"])
    assert listen_maddrs(explicit) == (["/ip4/10.0.0.2/tcp/7"], ["/ip4/198.51.100.4/tcp/7"])


def test_run_keys_are_namespaced_per_run_and_usable_as_averager_prefixes():
    assert run_key("a", "b_metrics") != run_key("a_b", "metrics")
    assert run_key("r1", "metrics") != run_key("r2", "metrics")
    assert "." not in run_key("run-1_x", "frag0")  # hivemind group keys are "<prefix>.0b<bits>"
    with pytest.raises(ValueError):
        run_key("r1", "a.b")


# ---------------------------------------------------------------------------------- DHT start


@pytest.mark.network
@pytest.mark.timeout(120)
def test_unreachable_bootstrap_is_a_one_line_error_and_leaves_no_process():
    before = set(_p2pd_under(os.getpid()))
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{FAKE_ID}"
    with pytest.raises(NetError) as e:
        start_dht(NetConfig(initial_peers=[dead]), start_timeout=60)
    assert "could not reach any initial peer" in str(e.value) and dead in str(e.value)
    assert "\n" not in str(e.value)
    assert set(_p2pd_under(os.getpid())) <= before


@pytest.mark.network
@pytest.mark.timeout(120)
def test_port_in_use_names_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(NetError, match=f"port {port} is already in use; pick another --port"):
            start_dht(NetConfig(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]), start_timeout=60)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_identity_path_keeps_the_peer_id_and_stop_leaves_no_p2pd(tmp_path):
    key = tmp_path / "keys" / "peer.key"  # the folder does not exist yet
    ids = []
    for _ in range(2):
        dht = start_dht(NetConfig(identity_path=str(key)))
        try:
            ids.append(str(dht.peer_id))
            assert visible_maddrs(dht)[0].endswith(f"/p2p/{ids[-1]}")
            p2pd = _p2pd_under(dht.pid)
            assert len(p2pd) == 1
        finally:
            stop_dht(dht)
        assert not any(is_running(p) for p in p2pd)
    assert ids[0] == ids[1] == ensure_identity(str(key))
    assert key.stat().st_mode & 0o777 == 0o400
    key.chmod(0o600)
    key.write_bytes(b"garbage")
    with pytest.raises(NetError, match="not a libp2p private key"):
        ensure_identity(str(key))


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_dht_process_killed_by_a_signal_never_leaves_its_p2pd_behind():
    from opendiloco_stream.net.lifecycle import GracefulShutdown, wait_gone
    from tests.support.hivemind_locks import unstick_hivemind_locks

    with GracefulShutdown():  # forked under it, the DHT process passes SIGTERM on to its p2pd
        dht = start_dht(NetConfig())
        p2pd = _p2pd_under(dht.pid)
        os.kill(dht.pid, signal.SIGTERM)
        assert wait_gone(p2pd + [dht.pid], 30) == []
        stop_dht(dht)

    # the killed DHT process may have held a hivemind lock: this test starts another in this
    # process (a fresh-clone suite hung here without it; tests/support/hivemind_locks.py)
    unstick_hivemind_locks()
    dht = start_dht(NetConfig())
    p2pd = _p2pd_under(dht.pid)
    os.kill(dht.pid, signal.SIGKILL)  # nothing runs in the DHT process: its p2pd is orphaned (re-parented)...
    assert wait_gone([dht.pid], 30) == []
    stop_dht(dht)  # ...and stop_dht still finds it, because start_dht remembered it
    assert not any(is_running(p) for p in p2pd)


def _hold_shared_bytes_lock():
    from hivemind.utils.mpfuture import SharedBytes

    SharedBytes._lock.acquire()
    time.sleep(120)


@pytest.mark.network
def test_the_suites_guard_frees_a_hivemind_lock_held_by_a_killed_process(caplog):
    """hivemind's MPFuture locks are shared by every process forked after import: a DHT process
    SIGKILLed while it holds one left every later DHT start in this process hanging (the suite's
    test_net timeouts). A real forked process takes the lock and is SIGKILLed; the guard the suite
    runs before every test (tests/support/hivemind_locks.py) resets the lock, and a DHT starts."""
    from tests.support.hivemind_locks import unstick_hivemind_locks

    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=_hold_shared_bytes_lock, daemon=True)
    child.start()
    time.sleep(1.0)  # it has the lock now
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    with caplog.at_level("WARNING", logger="tests.support.hivemind_locks"):
        assert unstick_hivemind_locks()
    assert not unstick_hivemind_locks()  # free now
    dht = start_dht(NetConfig(), start_timeout=30)
    try:
        assert "held by a process that died" in caplog.text
        assert dht.is_alive() and dht.get_visible_maddrs()
    finally:
        stop_dht(dht)


# ---------------------------------------------------------------------------------- metrics


def test_metrics_records_are_schema_exact_whatever_the_trainer_passes():
    import numpy as np
    import torch

    from opendiloco_stream.net.metrics import PeerMetrics, to_record

    record = to_record({"step": np.int64(5), "loss": torch.tensor(2.5), "tokens_per_s": float("inf"),
                        "compute_utilization": 1.2, "rounds": {"0": 3}, "mode": "eager", "peer": "ignored"},
                       name="a", peer_id="b", time=1.0)
    assert record == {"name": "a", "peer_id": "b", "step": 5, "loss": 2.5, "tokens_per_s": 0.0, "bytes_sent": 0,
                      "bytes_received": 0, "compute_utilization": 1.0, "rounds": 0, "failed_rounds": 0, "alone_rounds": 0,
                      "land_steps": None, "mode": "eager", "time": 1.0}
    assert [type(record[k]) for k in ("step", "loss")] == [int, float]  # strict: no numpy/torch scalars
    assert PeerMetrics(**record).dict() == record


@pytest.fixture(scope="module")
def swarm():
    """Three DHT nodes in this process: a writer, a reader and a forger."""
    nodes = []
    try:
        nodes.append(start_dht(NetConfig()))
        first = visible_maddrs(nodes[0])
        nodes += [start_dht(NetConfig(initial_peers=first)) for _ in range(2)]
        yield nodes
    finally:
        for node in nodes:
            stop_dht(node)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_metrics_from_one_node_are_read_by_another_and_forgeries_are_rejected(swarm):
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from opendiloco_stream.net.metrics import MetricsPublisher, install_validators, read_swarm_metrics, to_record

    writer, reader, forger = swarm
    install_validators(reader, "signed", RSAPrivateKey())
    with MetricsPublisher(writer, "signed", expiration=60, name="alice", private_key=RSAPrivateKey()) as pub:
        pub.publish({"step": 7, "loss": float("nan"), "tokens_per_s": 12.5, "bytes_sent": 3, "unknown": 1})
        assert pub.flush(30) and pub.published == 1 and pub.failures == 0
        [record] = read_swarm_metrics(reader, "signed")
        assert (record["name"], record["step"], record["bytes_sent"]) == ("alice", 7, 3)
        assert record["loss"] is None  # NaN would not survive the schema check; it is published as None
        assert record["peer_id"] == str(writer.peer_id)
        assert read_swarm_metrics(reader, "other-run") == []

        # a node that skips the validators writes under alice's subkey: the others refuse the unsigned record
        forged = to_record({"step": 999}, name="alice", peer_id="x", time=get_dht_time())
        key = run_key("signed", "metrics")
        forger.store(key, forged, expiration_time=get_dht_time() + 60, subkey=pub.public_key)
        assert [(r["name"], r["step"]) for r in read_swarm_metrics(reader, "signed")] == [("alice", 7)]
        # with its own key it cannot sign for alice's subkey, and a record of its own must match the schema
        own = install_validators(forger, "signed", RSAPrivateKey())
        assert not forger.store(key, forged, expiration_time=get_dht_time() + 60, subkey=pub.public_key)
        assert not forger.store(key, {**forged, "step": 1.0}, expiration_time=get_dht_time() + 60, subkey=own)
        assert forger.store(key, {**forged, "name": "mallory"}, expiration_time=get_dht_time() + 60, subkey=own)
        assert [(r["name"], r["step"]) for r in read_swarm_metrics(reader, "signed")] == [("alice", 7),
                                                                                          ("mallory", 999)]


@pytest.mark.network
@pytest.mark.timeout(120)
def test_expired_metrics_disappear_and_a_dead_dht_never_raises_into_training(swarm):
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from opendiloco_stream.net.metrics import MetricsPublisher, install_validators, read_swarm_metrics

    writer, reader, _ = swarm
    install_validators(reader, "expiry", RSAPrivateKey())
    pub = MetricsPublisher(writer, "expiry", expiration=3, name="bob", private_key=RSAPrivateKey())
    pub.publish({"step": 1})
    assert pub.flush(30) and pub.published == 1
    pub.close()  # no more refreshes: the record must expire on its own
    [record] = read_swarm_metrics(reader, "expiry")
    # waiting for a point in DHT time, not for an event: expiry is defined by the clock
    time.sleep(max(0.0, record["expiration"] - get_dht_time()) + 0.2)
    assert read_swarm_metrics(reader, "expiry") == []

    lonely = start_dht(NetConfig())
    pub = MetricsPublisher(lonely, "expiry", expiration=3, private_key=RSAPrivateKey())
    stop_dht(lonely)
    pub.publish({"step": 2})  # must neither raise nor block
    assert pub.flush(30) and pub.failures >= 1 and pub.published == 0
    pub.close()


# ---------------------------------------------------------------------------------- lifecycle

_GRACEFUL_CHILD = """
import subprocess, sys, time
from opendiloco_stream.net.lifecycle import GracefulShutdown, new_session
import os
created = new_session()
assert not created or os.getsid(0) == os.getpid()
print(int(created), flush=True)
with GracefulShutdown() as stop:
    sleeper = subprocess.Popen(["sleep", "60"])
    print(sleeper.pid, flush=True)
    stop.wait()
    print("stopping", flush=True)
    if sys.argv[1] == "hang":
        time.sleep(60)  # a cleanup that never ends: the second signal must cut it short
    sleeper.terminate()
    sleeper.wait()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["clean", "hang"])
def test_graceful_shutdown_first_signal_is_a_flag_second_exits_now(mode):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _GRACEFUL_CHILD, mode], env=env, text=True,
                            stdout=subprocess.PIPE)
    try:
        created = int(_readline(proc, 30))
        assert created or _has_controlling_terminal()  # only an interactive job keeps its session
        sleeper = int(_readline(proc, 30))
        proc.send_signal(signal.SIGTERM)
        assert _readline(proc, 30).strip() == "stopping"
        if mode == "hang":
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 128 + signal.SIGINT
        else:
            assert proc.wait(30) == 0
        assert not is_running(sleeper)
    finally:
        kill_process_tree(proc.pid, timeout=2)


def test_kill_process_tree_reaches_grandchildren_that_ignore_sigterm():
    script = ("import subprocess, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], "
              "stdout=subprocess.PIPE, text=True); c.stdout.readline(); print(c.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], text=True, stdout=subprocess.PIPE)
    try:
        grandchild = int(_readline(proc, 30))
        killed = kill_process_tree(proc.pid, timeout=0.5)
        assert set(killed) == {proc.pid, grandchild}
        assert proc.wait(5) == -signal.SIGKILL and not is_running(grandchild)
    finally:
        kill_process_tree(proc.pid, timeout=1)


def test_kill_session_finds_the_orphans_of_a_leader_that_already_exited():
    """A session leader (a peer started with ``start_new_session``) that exits leaves its child (a
    DHT process) re-parented to init: ``session_members`` finds it by session id and
    ``kill_session`` stops it. (The session id was read from the wrong /proc field, so every
    LoopbackSwarm whose peer died first, e.g. the state donor that exits mid-download, left its
    DHT process and p2pd running after the suite.)"""
    from opendiloco_stream.net.lifecycle import kill_session, session_members

    script = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(c.pid, flush=True)")
    leader = subprocess.Popen([sys.executable, "-c", script], text=True, stdout=subprocess.PIPE, start_new_session=True)
    orphan = int(_readline(leader, 30))
    try:
        assert leader.wait(10) == 0  # the leader is gone, its child lives on in its session
        assert is_running(orphan) and session_members(leader.pid) == [orphan]
        assert kill_session(leader.pid, timeout=5, hard=True) == [orphan]
        assert not is_running(orphan)
    finally:
        if is_running(orphan):
            os.kill(orphan, signal.SIGKILL)


# ---------------------------------------------------------------------------------- commands


@pytest.mark.network
@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", ["process", "group"])  # group: Ctrl+C in a terminal, p2pd gets it too
def test_bootstrap_command_writes_addr_file_accepts_peers_and_stops_cleanly_on_sigint(tmp_path, target):
    addr_file = tmp_path / "bootstrap.addrs"
    proc = _spawn_long("bootstrap", "--addr-file", str(addr_file), "--identity-path", str(tmp_path / "b.key"),
                       log=tmp_path / "stderr")
    joined = None
    try:
        line = _readline(proc, 90)
        assert line and line.startswith("--initial-peers "), (line, proc.poll())
        addrs = addr_file.read_text().split()
        assert addrs[0] == line.split()[1] and addrs[0].endswith("/p2p/" + ensure_identity(str(tmp_path / "b.key")))

        joined = start_dht(NetConfig(initial_peers=addrs))
        assert joined.get(run_key("opendiloco", "nothing"), latest=True) is None  # the DHT answers
        p2pd = _p2pd_under(proc.pid)
        assert len(p2pd) == 1

        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)  # _spawn starts a new session: the group is the command's own
        else:
            proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "bootstrap node stopped" in (tmp_path / "stderr").read_text()
        assert not any(is_running(p) for p in p2pd)
    finally:
        if joined is not None:
            stop_dht(joined)
        kill_process_tree(proc.pid, timeout=2)


@pytest.fixture(scope="module")
def publishing_peer(bootstrap):
    """A DHT node in this process, joined to the bootstrap, publishing metrics for run "net-test"."""
    from opendiloco_stream.net.metrics import MetricsPublisher

    dht = start_dht(NetConfig(initial_peers=[bootstrap[0]]))
    try:
        with MetricsPublisher(dht, "net-test", expiration=120, name="carol") as pub:
            pub.publish({"step": 42, "loss": 3.25, "tokens_per_s": 1000.0, "bytes_sent": 5 * 2**20,
                         "compute_utilization": 0.9, "rounds": 4})
            assert pub.flush(30) and pub.published == 1
            yield pub
    finally:
        stop_dht(dht)


@pytest.mark.network
@pytest.mark.timeout(180)
def test_doctor_passes_against_a_live_bootstrap(bootstrap, publishing_peer):
    address, _ = bootstrap
    data_port = free_port()
    result = _run("doctor", "--initial-peers", address, "--run-id", "net-test", "--data-port", str(data_port))
    lines = [l for l in result.stdout.splitlines() if l.startswith("[")]
    # the punch check needs the run's echo servers, which a bootstrap starts only with --relay (this
    # one has none): it says so and skips (its ok/warn cases with a relay: tests/test_nat.py)
    punch = [l for l in lines if l.startswith("[skip] punch:")]
    assert punch == ["[skip] punch: run 'net-test' announces no echo server, so no peer can punch a direct connection"], \
        result.stdout
    lines.remove(punch[0])
    # the relays among the initial peers are checked with --relay only (tests/test_nat_relay_limit.py)
    lines.remove("[skip] relay: no --relay: the initial peers are not used as relays")
    assert [l.split("]")[0] + "]" for l in lines] == ["[ok]"] * 9, result.stdout + result.stderr
    assert "run 'net-test' has 1 peer(s) publishing metrics" in lines[2]  # decoded the signed records
    assert "the bootstrap" in lines[3] and "opened a new connection" in lines[3]  # a real dial-back
    assert lines[4] == "[ok] nat: not behind NAT: the bootstrap sees this machine as 127.0.0.1"
    assert f"[ok] data port: the bootstrap opened a TCP connection to 127.0.0.1:{data_port}" in lines[5]
    assert lines[6].startswith(f"[ok] link: RTT {address.split('/p2p/')[0]} ") and " ms;" in lines[6]  # loopback
    assert lines[7].startswith("[ok] share: --initial-peers /ip4/127.0.0.1/tcp/")
    assert lines[8].startswith("[ok] kernels: native codec kernels loaded")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    # without --data-port the check says what random ports mean; with its port taken it fails
    plain = _run("doctor", "--initial-peers", address, "--run-id", "net-test")
    assert "[skip] data port: random data ports" in plain.stdout and plain.returncode == 0, plain.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        busy = _run("doctor", "--initial-peers", address, "--run-id", "net-test", "--data-port", str(taken))
    assert busy.returncode == 1 and f"[FAIL] data port: cannot listen on TCP 127.0.0.1:{taken}" in busy.stdout, busy.stdout


async def _tcp_dialback(_dht, node, helper: str, targets: list) -> object:
    """In the DHT process: ask the bootstrap to open TCP connections to ``targets``; the answer or the error."""
    from hivemind.p2p import PeerID

    from opendiloco_stream.net.reachability import request_tcp_dialback

    maddrs = [f"{m}/p2p/{node.peer_id}" if "/p2p/" not in str(m) else str(m) for m in await node.p2p.get_visible_maddrs()]
    try:
        return await request_tcp_dialback(node.p2p, PeerID.from_base58(helper), maddrs, [tuple(t) for t in targets], 30)
    except LookupError as e:
        return f"LookupError: {e}"


@pytest.mark.network
@pytest.mark.timeout(180)
def test_the_bootstrap_dials_data_ports_only_at_the_callers_own_addresses(bootstrap):
    import functools

    from hivemind.utils.multiaddr import Multiaddr

    address, _ = bootstrap
    helper = Multiaddr(address)["p2p"]
    dht = start_dht(NetConfig(initial_peers=[address]))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            open_port, closed_port = s.getsockname()[1], free_port()
            answer = dht.run_coroutine(functools.partial(
                _tcp_dialback, helper=helper, targets=[("127.0.0.1", open_port), ("127.0.0.1", closed_port)]))
        assert answer[f"127.0.0.1:{open_port}"] is None, answer
        assert "refused" in answer[f"127.0.0.1:{closed_port}"].lower(), answer
        # another host is not the caller's: no scanning through the bootstrap
        refused = dht.run_coroutine(functools.partial(_tcp_dialback, helper=helper, targets=[("192.0.2.1", 80)]))
        assert isinstance(refused, str) and "TCP targets must be IPs of the announced multiaddrs" in refused
    finally:
        stop_dht(dht)


@pytest.mark.network
@pytest.mark.timeout(180)
def test_doctor_fails_with_the_fix_for_a_dead_bootstrap_and_an_unreachable_announce(bootstrap):
    address, _ = bootstrap
    dead_port = free_port()
    result = _run("doctor", "--initial-peers", f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{FAKE_ID}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[FAIL] bootstrap" in result.stdout and f"nc -vz 127.0.0.1 {dead_port}" in result.stdout

    # listening on one port but announcing another: what a peer behind NAT without forwarding looks like
    listen, announced = free_port(), free_port()
    result = _run("doctor", "--initial-peers", address, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{listen}",
                  "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{announced}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[ok] bootstrap" in result.stdout and "[FAIL] dial-back" in result.stdout
    assert "fix: open/forward the listening port" in result.stdout



@pytest.mark.network
@pytest.mark.timeout(180)
def test_monitor_once_json_lists_a_publishing_peer(bootstrap, publishing_peer):
    result = _run("monitor", "--initial-peers", bootstrap[0], "--run-id", "net-test", "--once", "--json")
    assert result.returncode == 0, result.stderr
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "carol"]
    assert (record["step"], record["loss"], record["rounds"]) == (42, 3.25, 4)
    assert record["peer_id"] == publishing_peer.peer_id


def test_monitor_table_shows_the_numbers_that_matter():
    from opendiloco_stream.commands.monitor import format_table

    record = {"name": "carol", "step": 42, "loss": 3.25, "tokens_per_s": 1000.4, "bytes_sent": 5 * 2**20,
              "compute_utilization": 0.9, "rounds": 4, "failed_rounds": 1, "land_steps": 6.5, "time": 100.0}
    lines = format_table([record, {**record, "name": "dave", "loss": None, "compute_utilization": None,
                                   "failed_rounds": 0, "land_steps": None}], now=103.0, run_id="r").splitlines()
    assert lines[0] == "run 'r': 2 peer(s)"
    assert lines[1].split()[:2] == ["peer", "step"]
    assert lines[2].split() == ["carol", "42", "3.2500", "1000", "5.0", "90%", "4", "(1", "failed)", "6.5", "steps", "3"]
    assert lines[3].split() == ["dave", "42", "-", "1000", "5.0", "-", "4", "-", "3"]
    assert "no peer has published" in format_table([], now=0.0, run_id="r")


def test_doctor_bad_input_exits_2_with_one_line(monkeypatch, capsys):
    import opendiloco_stream.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", ("doctor",))  # other command modules may not exist yet
    assert cli.main(["doctor", "--initial-peers", "203.0.113.7:31337"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opendiloco-stream doctor: error: initial peer '203.0.113.7:31337' is not a valid multiaddr")
    assert "\n" not in err


def test_a_relayed_peer_takes_each_initial_peer_once_as_a_static_relay():
    """p2pd's autorelay waits for 4 relay candidates (or 3 minutes) unless its relays are static:
    ``-trustedRelays`` with ``-relayDiscovery=0``, the latter through an entry of hivemind's
    ``P2P.FORCE_REACHABILITY_MAPPING``. Each relay node once, at a TCP address where it has one
    (p2pd would count every address as a relay and wait for that many); none is a usage error."""
    from hivemind.p2p import P2P

    ids = ["12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE", "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"]
    peers = [f"/ip4/203.0.113.7/udp/31337/quic-v1/p2p/{ids[0]}", f"/ip4/203.0.113.7/tcp/31337/p2p/{ids[0]}",
             f"/ip4/203.0.113.8/udp/31338/quic-v1/p2p/{ids[1]}"]
    kwargs = relayed_peer_kwargs(peers)
    assert kwargs == {"use_relay": True, "use_auto_relay": True, "force_reachability": PRIVATE_STATIC_RELAYS,
                      "trusted_relays": [peers[1], peers[2]]}
    assert P2P.FORCE_REACHABILITY_MAPPING[PRIVATE_STATIC_RELAYS] == {"forceReachabilityPrivate": 1,
                                                                     "relayDiscovery": 0}
    with pytest.raises(NetError, match="--relay needs its relays among the initial peers"):
        relayed_peer_kwargs([])

