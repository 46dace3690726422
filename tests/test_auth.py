"""Run authorization and join checks: key loading, signed DHT records, admission proofs, fingerprints.

In-process pieces first; then real DHT nodes on 127.0.0.1 (the join checks), real averagers (an
outsider cannot get into a group or download state) and real ``peer`` processes (refusals end with
exit code 2 and one line; the key holders' run is unaffected).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

from benchmarks.harness.loopback import LoopbackSwarm, make_tensor
from opendiloco_stream.config import ConfigError, NetConfig, RunConfig, load_config
from opendiloco_stream.net.auth import Admission, RunAuth, RunKeyValidator, load_run_key, open_keys
from opendiloco_stream.train.join import JoinRefused, RunGate, common_start, first_difference, fingerprint_fields
from opendiloco_stream.net.metrics import MetricsPublisher, install_validators, read_swarm_metrics

KEY = "correct horse battery staple 42"
OTHER = "another key of enough length!!"
MODULE = __name__


# ---------------------------------------------------------------------------------------- the key
def test_run_key_from_file_env_and_toml(tmp_path):
    f = tmp_path / "run.key"
    f.write_text(KEY + "\n")
    assert load_run_key(load_config(None, {"net": {"run_key_file": str(f)}}, environ={}).net) == KEY.encode()
    assert load_run_key(load_config(None, environ={"ODS_NET__RUN_KEY": KEY}).net) == KEY.encode()
    toml = tmp_path / "peer.toml"
    toml.write_text(f'[net]\nrun_key_file = "{f}"\n')
    assert load_run_key(load_config(str(toml), environ={}).net) == KEY.encode()
    toml.write_text(f'[net]\nrun_key = "{KEY}"\n')
    cfg = load_config(str(toml), environ={})
    assert load_run_key(cfg.net) == KEY.encode()
    assert KEY not in str(cfg.model_dump(mode="json")) and KEY not in repr(cfg)  # never logged or printed
    assert load_run_key(NetConfig()) is None


def test_bad_run_keys_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_key(NetConfig(run_key_file=str(tmp_path / "missing.key")))
    (tmp_path / "short.key").write_text("abc\n")
    with pytest.raises(ConfigError, match="needs at least 16"):
        load_run_key(NetConfig(run_key_file=str(tmp_path / "short.key")))
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, {"net": {"run_key_file": "f"}}, environ={"ODS_NET__RUN_KEY": KEY})
    assert load_run_key(load_config(None, environ={"ODS_NET__RUN_KEY": "1234567890123456789"}).net) == \
        b"1234567890123456789"  # an all-digit key parses as a TOML integer: still a key


def test_dry_run_checks_the_key_file(tmp_path):
    from opendiloco_stream.commands.dry_run import check_run_key

    f = tmp_path / "run.key"
    f.write_text(KEY)
    assert f"key id {RunAuth(KEY.encode()).key_id}" in check_run_key(RunConfig(net={"run_key_file": str(f)}))
    f.write_text("")
    with pytest.raises(ConfigError, match="holds 0 bytes"):
        check_run_key(RunConfig(net={"run_key_file": str(f)}))


# ---------------------------------------------------------------------------------------- DHT records
def test_signed_records_validate_only_under_the_same_key():
    mine, theirs = RunKeyValidator(RunAuth(KEY.encode()), "r"), RunKeyValidator(RunAuth(OTHER.encode()), "r")
    record = DHTRecord(b"k" * 20, b"subkey", b"value", 123.5)
    signed = DHTRecord(record.key, record.subkey, mine.sign_value(record), record.expiration_time)
    assert mine.validate(signed) and mine.strip_value(signed) == b"value"
    assert not theirs.validate(signed)  # another key
    assert not mine.validate(record)  # unsigned
    for tampered in (DHTRecord(signed.key, b"other", signed.value, 123.5),
                     DHTRecord(signed.key, signed.subkey, b"V" + signed.value[1:], 123.5),
                     DHTRecord(signed.key, signed.subkey, signed.value, 999.0)):
        assert not mine.validate(tampered)
    header = DHTRecord(next(iter(open_keys("r"))), b"s", b"plain", 1.0)
    assert mine.sign_value(header) == b"plain" and theirs.validate(header)  # the public key-id header


# ---------------------------------------------------------------------------------------- groups, state
def test_admission_needs_the_key_bound_to_the_peer_and_the_same_fingerprint():
    a, b = PeerID(b"\x12\x20" + bytes(32)).to_bytes(), PeerID(b"\x12\x20" + bytes([1] * 32)).to_bytes()
    holder = Admission(RunAuth(KEY.encode()), fingerprint="fp1")
    meta = {"v": 1, "w": 10.0, "spec": ["fp32", 0, ""], "numel": 5, "key": [0, 3]}
    sealed = holder.seal(meta, a)
    assert holder.check_member(sealed, a) is None
    assert "proof" in holder.check_member(sealed, b)  # replayed under another peer id
    assert "proof" in holder.check_member({**sealed, "w": 1e9}, a)  # changed weight
    assert "proof" in holder.check_member(meta, a)  # no proof at all
    assert "proof" in holder.check_member(Admission(RunAuth(OTHER.encode()), "fp1").seal(meta, a), a)
    assert "fingerprint" in holder.check_member(Admission(RunAuth(KEY.encode()), "fp2").seal(meta, a), a)
    assert Admission(None, "fp1").check_member(Admission(None, "fp1").seal(meta, a), a) is None  # no key: fp only
    proof = holder.state_proof("request", a, b)
    assert holder.check_state_proof(proof, "request", a, b) is None
    assert holder.check_state_proof(proof, "reply", a, b) is not None  # a request is not a reply
    assert holder.check_state_proof(proof, "request", b, a) is not None
    assert holder.check_state_proof({}, "request", a, b) is not None


def test_first_difference_names_the_field_and_both_values():
    run = {"protocol": "p", "mode": "eager", "codec": "int8", "codec_params": "64/fp16", "inner_steps": "10",
           "fragments": "2", "fragment_pattern": "strided", "model": "m"}
    assert first_difference(dict(run), run) is None
    assert first_difference({**run, "codec": "fp4-e3m0", "inner_steps": "20"}, run) == \
        "codec differs: this peer fp4-e3m0, the run int8"
    assert first_difference({**run, "inner_steps": "20"}, run) == "H (inner steps) differs: this peer 20, the run 10"


def test_fingerprint_covers_model_shapes_and_the_codec():
    cfg = RunConfig(diloco={"codec": "fp32"})
    small, large = torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)
    assert fingerprint_fields(cfg, small) == fingerprint_fields(cfg, torch.nn.Linear(4, 4))
    assert first_difference(fingerprint_fields(cfg, large), fingerprint_fields(cfg, small)).startswith("model")
    int8 = RunConfig(diloco={"codec": "int8"})
    assert first_difference(fingerprint_fields(int8, small), fingerprint_fields(cfg, small)).startswith(
        "codec differs: this peer int8, the run fp32")


# ---------------------------------------------------------------------------------------- real DHT nodes
def _dht(tmp_path, initial: list[str], **net):
    from opendiloco_stream.net.dht import start_dht

    return start_dht(NetConfig(run_id="keyed", initial_peers=initial, **net))


def _fields(**changes) -> dict[str, str]:
    cfg = RunConfig(diloco={"codec": "fp4-e3m0", "inner_steps": 10, **changes})
    return fingerprint_fields(cfg, torch.nn.Linear(4, 4))


@pytest.mark.network
@pytest.mark.timeout(90)
def test_join_checks_refuse_another_key_no_key_and_another_fingerprint(tmp_path):
    from opendiloco_stream.net.dht import stop_dht, visible_maddrs

    key_file = tmp_path / "run.key"
    key_file.write_text(KEY)
    nodes, gates = [], []
    try:
        holder = _dht(tmp_path, [], run_key_file=str(key_file))
        nodes.append(holder)
        addrs = visible_maddrs(holder)
        gate = RunGate(holder, "keyed", RunAuth(KEY.encode()), timeout=10)
        gates.append(gate)
        gate.check_key()  # the first peer: nothing to compare with
        gate.check_fingerprint(_fields())
        others = {"wrong": _dht(tmp_path, addrs, run_key=OTHER), "none": _dht(tmp_path, addrs),
                  "same": _dht(tmp_path, addrs, run_key=KEY)}
        nodes += others.values()
        with pytest.raises(JoinRefused, match=r"^refused: run key mismatch: run 'keyed' uses key \w{8}, this peer"):
            RunGate(others["wrong"], "keyed", RunAuth(OTHER.encode()), timeout=10).check_key()
        with pytest.raises(JoinRefused, match="^refused: run 'keyed' requires a run key and this peer has none"):
            RunGate(others["none"], "keyed", None, timeout=10).check_key()
        same = RunGate(others["same"], "keyed", RunAuth(KEY.encode()), timeout=10)
        gates.append(same)
        same.check_key()
        with pytest.raises(JoinRefused, match="^refused: codec differs: this peer int8, the run fp4-e3m0$"):
            same.check_fingerprint(_fields(codec="int8"))
        with pytest.raises(JoinRefused, match=r"^refused: H \(inner steps\) differs: this peer 20, the run 10$"):
            same.check_fingerprint(_fields(inner_steps=20))
        # an outsider's records never reach the holders: not the forged fingerprint, not its key id
        forger = RunGate(others["wrong"], "keyed", None, timeout=10)
        forger._store("fingerprint", {"fields": _fields(codec="int8"), "since": 0.0})
        same.check_fingerprint(_fields())  # still compared with the holder's record: accepted
        seen = [v["fields"]["codec"] for v, _ in same._others("fingerprint")]
        assert seen == ["fp4-e3m0"], seen
        # the metrics' own validators (RSA signature, schema) work under the run key's
        # (a store's result is the first replica's answer: the outsiders' nodes may refuse it)
        publisher = MetricsPublisher(holder, "keyed", name="holder")
        publisher.publish({"step": 3})
        publisher.close(timeout=10)
        install_validators(others["same"], "keyed")
        assert [r["step"] for r in read_swarm_metrics(others["same"], "keyed")] == [3]
    finally:
        for g in gates:
            g.close()
        for node in nodes:
            stop_dht(node)


def test_peers_that_waited_for_each_other_agree_on_their_first_step():
    """``common_start``: margin after the count-th earliest ready record, whatever the order each
    peer reads them in; a swarm whose count peers were ready long ago gives a time in the past."""
    assert common_start([10.0, 12.5], 2, 2.0) == common_start([12.5, 10.0], 2, 2.0) == 14.5
    assert common_start([10.0, 11.0, 100.0], 2, 2.0) == 13.0  # a third peer joins a running pair: no hold
    with pytest.raises(ValueError):
        common_start([10.0], 2)


@pytest.mark.network
@pytest.mark.timeout(90)
def test_wait_for_peers_counts_the_key_holders_ready_and_gives_up_at_its_timeout(tmp_path):
    """``--wait-for-peers``: a peer waits until N peers of the run said they are ready, reports its
    progress while it waits, starts at the same instant as the peers it waited for, and trains with
    fewer after its timeout; an outsider's forged ``ready``
    record (another key) is not counted."""
    import threading

    from opendiloco_stream.net.dht import stop_dht, visible_maddrs

    nodes, gates = [], []
    try:
        first = _dht(tmp_path, [], run_key=KEY)
        nodes.append(first)
        addrs = visible_maddrs(first)
        outsider, second = _dht(tmp_path, addrs, run_key=OTHER), _dht(tmp_path, addrs, run_key=KEY)
        nodes += [outsider, second]
        RunGate(outsider, "keyed", None, timeout=10)._store("ready", {"since": 0.0})  # a forgery: never counted
        waiter = RunGate(first, "keyed", RunAuth(KEY.encode()), timeout=10)
        gates.append(waiter)
        result, seen = [], []
        thread = threading.Thread(target=lambda: result.append(waiter.wait_for_peers(
            2, timeout=60, progress=lambda ready, waited: seen.append(ready), poll_s=0.2, progress_every_s=0.5)))
        thread.start()
        time.sleep(3.0)
        assert thread.is_alive() and not result and seen and set(seen) == {1}, (result, seen)
        late = RunGate(second, "keyed", RunAuth(KEY.encode()), timeout=10)
        gates.append(late)
        assert late.wait_for_peers(2, timeout=30) == 2  # the first peer is ready already: no wait
        thread.join(30)
        assert result == [2], result
        # both start at the same instant, from the same two records: 2 s after the later one
        assert waiter.start_at is not None and waiter.start_at == late.start_at, (waiter.start_at, late.start_at)
        alone = RunGate(second, "keyed-alone", RunAuth(KEY.encode()), timeout=10)
        gates.append(alone)
        start = time.monotonic()
        assert alone.wait_for_peers(3, timeout=1.0, poll_s=0.2) == 1  # nobody else in that run: gives up
        assert time.monotonic() - start >= 1.0
        stopped = RunGate(second, "keyed-stop", RunAuth(KEY.encode()), timeout=10)
        gates.append(stopped)
        assert stopped.wait_for_peers(3, timeout=60, should_stop=lambda: True) == 1  # a signal ends the wait
    finally:
        for g in gates:
            g.close()
        for node in nodes:
            stop_dht(node)


# ---------------------------------------------------------------------------------------- real averagers
class _Forger(RunKeyValidator):
    """An outsider's node that reads the holders' records (strips their MACs unchecked) and signs its
    own with a key of its choosing: it finds the holders' groups and donors and knocks on their doors."""

    def validate(self, record: DHTRecord) -> bool:
        return True


def keyed_transport(dht, *, secret: str, forger: bool = False, **kwargs):
    """A loopback peer's transport (see hv_loopback) whose DHT node and averagers hold ``secret``."""
    from opendiloco_stream.transport.hivemind import HivemindTransport

    auth = RunAuth(secret.encode())
    dht.add_validators([(_Forger if forger else RunKeyValidator)(auth, kwargs["run_id"])])
    return HivemindTransport(dht, admission=Admission(auth, fingerprint="fp"), **kwargs)


def small_state():
    return lambda: {"step": 7, "outer": torch.arange(6, dtype=torch.float32)}


@pytest.mark.network
@pytest.mark.timeout(150)
def test_an_outsider_gets_into_no_group_and_downloads_no_state():
    numel = 4096
    swarm = LoopbackSwarm(3, run_id="hvkeyed", transport_cls=f"{MODULE}:keyed_transport", transport_kwargs=dict(
        codec="fp32", secret=KEY, target_group_size=3, matchmaking_time=3.0, request_timeout=1.0, state_timeout=5.0),
        peer_overrides={2: dict(secret=OTHER, forger=True)})
    try:
        swarm.start()
        holders, outsider = swarm.peers[:2], swarm.peers[2]
        swarm.call_all("prepare", {0: numel}, timeout=120)
        results = swarm.call_all("all_reduce", (0, 0), numel=numel, per_peer=[dict(seed=s) for s in range(3)],
                                 timeout=90)
        expected = (make_tensor(0, numel) + make_tensor(1, numel)) / 2
        for r in results[:2]:
            assert r["ok"] and r["group_size"] == 2, r  # the two holders, without the outsider
            assert torch.equal(r["average"], expected)
        assert not results[2]["ok"], results[2]
        holders[0].call("set_state_provider", f"{MODULE}:small_state")
        assert outsider.call("load_state", 5.0, timeout=30)["state"] is None  # the donor serves no outsider
        state = holders[1].call("load_state", 10.0, timeout=30)["state"]
        assert state["step"] == 7 and torch.equal(state["outer"], torch.arange(6, dtype=torch.float32))
    finally:
        swarm.close()


# ---------------------------------------------------------------------------------------- real peers
def _refusal(log) -> str:
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return text.strip().splitlines()[-1]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_outsiders_and_another_codec_are_refused_with_exit_2_and_the_holders_train_on(tmp_path):
    from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes
    from opendiloco_stream.train.loop import read_metrics
    from tests.support.peers import start_peer, wait_for

    key = tmp_path / "run.key"
    key.write_text(KEY + "\n")
    boot, addrs = start_bootstrap(tmp_path, "authrun")  # without the key: an untrusted store, as any node
    procs = [boot]

    def syncs(name: str) -> list[dict]:
        return [r for r in read_metrics(tmp_path / f"{name}.jsonl") if r["event"] == "sync"]

    try:
        common = ["--run-id", "authrun", "--mode", "eager", "--inner-steps", "10", "--steps", "100000",
                  "--target-group-size", "2", "--no-join"]
        holders = [start_peer(tmp_path, "h0", addrs, *common, "--codec", "fp4-e3m0", "--run-key-file", str(key),
                              "--shard", "0/2"),
                   start_peer(tmp_path, "h1", addrs, *common, "--codec", "fp4-e3m0", "--shard", "1/2",
                              env={"ODS_NET__RUN_KEY": KEY})]  # the same key, from the environment
        procs += holders
        wait_for(lambda: all(any(r["ok"] for r in syncs(h)) for h in ("h0", "h1")), 240, "the holders' rounds", holders)
        outsiders = {"wrong": start_peer(tmp_path, "wrong", addrs, *common, "--codec", "fp4-e3m0",
                                         env={"ODS_NET__RUN_KEY": OTHER}),
                     "none": start_peer(tmp_path, "none", addrs, *common, "--codec", "fp4-e3m0"),
                     "codec": start_peer(tmp_path, "codec", addrs, *common, "--codec", "int8", "--run-key-file",
                                         str(key))}
        procs += outsiders.values()
        for p in outsiders.values():
            p.wait(timeout=180)
        lines = {name: _refusal(tmp_path / f"{name}.log") for name in outsiders}
        assert {name: p.returncode for name, p in outsiders.items()} == dict.fromkeys(outsiders, 2), lines
        assert lines["wrong"].startswith("opendiloco-stream peer: error: refused: run key mismatch: run 'authrun'")
        assert lines["none"].startswith("opendiloco-stream peer: error: refused: run 'authrun' requires a run key")
        assert lines["codec"] == ("opendiloco-stream peer: error: refused: codec differs: this peer int8, "
                                  "the run fp4-e3m0")
        before = len(syncs("h0"))
        wait_for(lambda: len(syncs("h0")) >= before + 2, 120, "the holders' next rounds", holders)
        for p in holders:
            p.terminate()  # SIGTERM: they stop at the next inner step
            p.wait(timeout=60)
            assert p.returncode == 0, (tmp_path / "h0.log").read_text()[-3000:]
        for name in ("h0", "h1"):
            done = [r for r in syncs(name) if r["ok"]]
            assert done and all(r["group_size"] == 2 for r in done), done  # never anyone but the two holders
    finally:
        stop_processes(procs, grace=10)
