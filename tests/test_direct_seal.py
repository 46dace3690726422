"""Sealing of the direct data path (``transport/hivemind/seal.py``, ``direct.py``).

In-process: messages round-trip; one under another key, with a flipped byte, replayed or out of
order does not open; every message of a key gets its own nonce; ``--direct-plaintext`` sends the
encoding itself. Networked (real peers on 127.0.0.1, a TCP proxy from ``tests/support/tamper.py``
in front of one peer's data port): averages are bit-identical and exact, sealed or not; the bytes
on the wire hold no plaintext of a tensor unless plaintext was asked for; a byte flipped in a
contribution or a reduced part fails that exchange and no peer applies anything but an exact mean
of honest inputs; the next round without the proxy is exact again.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import socket

import pytest
import torch
from hivemind.proto import averaging_pb2

from benchmarks.harness.loopback import LoopbackSwarm, make_tensor
from opendiloco_stream.net.auth import RunAuth
from opendiloco_stream.transport.hivemind import seal
from opendiloco_stream.transport.hivemind.direct import (
    HelloVersionError, make_hello, read_hello, read_message, write_message, write_notice,
)
from opendiloco_stream.transport.hivemind.protocol import CONTRIB, Message, frame_parts
from opendiloco_stream.transport.hivemind.seal import DirectSecurity, SealError, new_salt
from opendiloco_stream.transport.reduce import weighted_mean
from tests.support.tamper import TO_REDUCER, TO_SENDER, TamperProxy

GROUP, PREFIX = bytes(range(32)), "run_f0"


def _ends(security=None, group=GROUP, salt=b"s" * 16, sender=2, reducer=1, **kwargs):
    """(sender's channel, reducer's channel) of one connection."""
    security = security or DirectSecurity(**kwargs)
    return (security.channel(group, PREFIX, sender, reducer, salt, "sender"),
            security.channel(group, PREFIX, sender, reducer, salt, "reducer"))


def _seal(channel, data: bytes, aad: bytes = b"len") -> bytes:
    return b"".join(channel.sealer.seal([data[:7], data[7:]], aad))


# ---------------------------------------------------------------------------------------- in-process
def test_messages_round_trip_in_both_directions_and_grow_by_the_tag_only():
    sender, reducer = _ends()
    for i in range(3):
        up, down = os.urandom(1000 + i), os.urandom(10 + i)
        sealed = _seal(sender, up)
        assert len(sealed) == len(up) + seal.TAG_BYTES and up not in sealed
        assert reducer.opener.open(bytearray(sealed), b"len") == up
        assert sender.opener.open(_seal(reducer, down), b"len") == down


@pytest.mark.parametrize("other", [
    dict(group=bytes(32)), dict(salt=b"t" * 16), dict(sender=0), dict(reducer=0),
    dict(security=DirectSecurity(auth=RunAuth(b"a run key of 32 bytes, or nearly"))),
])
def test_a_message_under_other_keys_does_not_open(other):
    sender, _ = _ends()
    _, stranger = _ends(**other)
    with pytest.raises(SealError, match="does not open"):
        stranger.opener.open(_seal(sender, b"contribution bytes"), b"len")


def test_the_run_key_changes_the_keys_and_both_holders_agree():
    auth = RunAuth(b"a run key of 32 bytes, or nearly")
    sender, _ = _ends(DirectSecurity(auth=auth))
    _, reducer = _ends(DirectSecurity(auth=RunAuth(b"a run key of 32 bytes, or nearly")))
    assert reducer.opener.open(_seal(sender, b"x" * 100), b"len") == b"x" * 100


def test_a_flipped_byte_or_a_changed_length_does_not_open():
    sender, reducer = _ends()
    sealed = bytearray(_seal(sender, os.urandom(500)))
    for position in (0, 250, len(sealed) - 1):  # ciphertext, middle, tag
        tampered = bytearray(sealed)
        tampered[position] ^= 1
        with pytest.raises(SealError):
            reducer.opener.open(tampered, b"len")
    with pytest.raises(SealError):
        reducer.opener.open(sealed, b"LEN")  # the associated data: the message's length field
    assert len(reducer.opener.open(sealed, b"len")) == 500  # the failures did not move its counter


def test_a_replayed_or_reordered_message_does_not_open():
    sender, reducer = _ends()
    first, second = _seal(sender, b"first" * 50), _seal(sender, b"second" * 50)
    with pytest.raises(SealError):
        reducer.opener.open(second, b"len")  # out of order
    assert reducer.opener.open(first, b"len") == b"first" * 50
    with pytest.raises(SealError):
        reducer.opener.open(first, b"len")  # replayed
    assert reducer.opener.open(second, b"len") == b"second" * 50
    with pytest.raises(SealError):  # a message sent back to its own sender: the other direction's key
        sender.opener.open(_seal(sender, b"mirror"), b"len")


def test_every_message_of_a_key_has_its_own_nonce_and_the_counter_never_wraps(monkeypatch):
    used = []
    monkeypatch.setattr(seal, "nonce", lambda counter: used.append(counter) or bytes(4) + counter.to_bytes(8, "little"))
    sender, _ = _ends()
    sealed = [_seal(sender, b"same plaintext") for _ in range(100)]
    assert used == list(range(100)) and len(set(sealed)) == 100
    sender.sealer._counter = (1 << 64)  # the last nonce was used: sealing more must refuse, not wrap
    with pytest.raises(SealError, match="nonces are used up"):
        _seal(sender, b"one too many")


def _draw_salt(queue) -> None:
    queue.put(new_salt())


def test_forked_averagers_draw_different_salts():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=_draw_salt, args=(queue,)) for _ in range(2)]
    for child in children:
        child.start()
    salts = {queue.get(timeout=30) for _ in children} | {new_salt()}
    for child in children:
        child.join(30)
    assert len(salts) == 3 and all(len(s) == seal.SALT_BYTES for s in salts)


def test_plaintext_mode_has_no_channel_and_says_so_in_its_hello():
    plain = DirectSecurity(plaintext=True)
    assert plain.channel(GROUP, PREFIX, 0, 1, b"s" * 16, "sender") is None
    assert read_hello(make_hello(plain, GROUP, PREFIX, 0, 1, b"s" * 16)).plaintext
    assert not read_hello(make_hello(DirectSecurity(), GROUP, PREFIX, 0, 1, b"s" * 16)).plaintext
    v1 = bytearray(make_hello(plain, GROUP, PREFIX, 0, 1, b"s" * 16))
    v1[4] = 1
    with pytest.raises(HelloVersionError, match="v1 direct hello; this peer speaks v3"):
        read_hello(bytes(v1))


def _wire(sealed: bool, tamper_at: int = -1):
    """Write a contribution, a notice and a result over a socket pair; read them back."""
    async def scenario():
        a, b = socket.socketpair()
        for s in (a, b):
            s.setblocking(False)
        sender, reducer = _ends() if sealed else (None, None)
        payload = os.urandom(5000)
        msg = Message(averaging_pb2.PART_FOR_AVERAGING, b"gid", frame_parts(CONTRIB, 0, (payload[:100], payload[100:])))
        await write_message(a, msg, sender)
        await write_notice(a, averaging_pb2.BAD_GROUP_ID)
        raw = bytearray(await asyncio.get_event_loop().sock_recv(b, 1 << 20))
        if tamper_at >= 0:
            raw[tamper_at] ^= 1
        c, d = socket.socketpair()
        for s in (c, d):
            s.setblocking(False)
        await asyncio.get_event_loop().sock_sendall(c, raw)
        c.close()
        try:
            got = [await read_message(d, 1 << 20, reducer) for _ in range(3)]
        finally:
            for s in (a, b, d):
                s.close()
        return raw, payload, got

    return asyncio.run(scenario())


def test_sealed_messages_on_a_socket_hide_their_bytes_and_notices_only_carry_an_error():
    raw, payload, (msg, notice, end) = _wire(sealed=True)
    assert payload[:64] not in raw and payload[-64:] not in raw
    assert bytes(msg.buffer).endswith(payload) and msg.group_id == b"gid"
    assert (notice.code, notice.has_part, end) == (averaging_pb2.BAD_GROUP_ID, False, None)
    raw, payload, (msg, _, _) = _wire(sealed=False)
    assert payload in raw and bytes(msg.buffer).endswith(payload)
    with pytest.raises(SealError):
        _wire(sealed=True, tamper_at=2000)


# ---------------------------------------------------------------------------------------- networked
NUMEL = 60_000
SWARM_ARGS = dict(codec="fp32", chunk_bytes=1 << 16, matchmaking_time=3.0, request_timeout=1.0,
                  next_chunk_timeout=15.0, allreduce_timeout=40.0)


def _call(peer, name: str, **kwargs):
    return peer.call("call", function=f"tests.support.tamper:{name}", timeout=30, **kwargs)


def _round(swarm, rnd: int, seeds: list[int]) -> tuple[list[dict], list[torch.Tensor]]:
    args = [dict(seed=s, numel=NUMEL) for s in seeds]
    results = swarm.call_all("all_reduce", (0, rnd), per_peer=args, timeout=120)
    return results, [make_tensor(s, NUMEL) for s in seeds]


def _honest_means(swarm, results: list[dict], xs: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    """Every exact mean peer ``i``'s successful result may be: of ``group_size`` honest inputs,
    its own among them iff it says so, summed in group order as the reducers sum them."""
    r = results[i]
    ids = [p.peer_id for p in swarm.peers]
    order = [ids.index(p) for p in r["peers"]]  # group position -> peer index
    means = []
    for subset in itertools.combinations(order, r["group_size"]):
        if (i in subset) == r["included_self"]:
            means.append(weighted_mean([xs[j].clone() for j in subset], [1.0] * len(subset)))
    return means


def _assert_exact_or_failed(swarm, results, xs) -> list[bool]:
    """No peer applied anything but an exact mean of honest inputs; which peers succeeded."""
    for i, r in enumerate(results):
        if r["ok"]:
            assert any(torch.equal(r["average"], m) for m in _honest_means(swarm, results, xs, i)), (i, r["group_size"])
    return [r["ok"] for r in results]


def _assert_exact(swarm, results, xs) -> None:
    assert [(r["ok"], r["group_size"]) for r in results] == [(True, len(xs))] * len(xs), results
    assert len({r["sha256"] for r in results}) == 1
    _assert_exact_or_failed(swarm, results, xs)


def _found(tensor: torch.Tensor, data: bytearray, every: int = 97) -> int:
    """How many 8-element windows of ``tensor`` (one in ``every``) appear as bytes in ``data``."""
    raw = tensor.numpy().tobytes()
    return sum(raw[k * 32:(k + 1) * 32] in data for k in range(0, len(raw) // 32, every))


@pytest.mark.network
@pytest.mark.parametrize("plaintext", [False, True])
def test_two_peers_average_exactly_and_only_plaintext_shows_the_tensor_on_the_wire(plaintext):
    swarm = LoopbackSwarm(2, run_id=f"seal{int(plaintext)}", transport_kwargs=dict(
        SWARM_ARGS, target_group_size=2, direct_plaintext=plaintext))
    proxy = None
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        proxy = TamperProxy(("127.0.0.1", _call(swarm.peers[1], "data_port", fragment=0)))
        _call(swarm.peers[1], "advertise", fragment=0, port=proxy.port)
        for rnd in (0, 1):
            results, xs = _round(swarm, rnd, [10 * rnd, 10 * rnd + 1])
            _assert_exact(swarm, results, xs)
        # one connection: the second round reuses the first one's (kept open, direct.py)
        assert proxy.connections == 1 and len(proxy.captured[TO_REDUCER]) > 4 * NUMEL / 2
        wire = proxy.captured[TO_REDUCER] + proxy.captured[TO_SENDER]
        seen = _found(xs[0], wire) + _found(results[0]["average"], wire)
        assert (seen > 0) if plaintext else (seen == 0), seen
    finally:
        swarm.close()
        if proxy is not None:
            proxy.close()


@pytest.mark.network
def test_a_sealed_and_a_plaintext_peer_refuse_each_other():
    swarm = LoopbackSwarm(2, run_id="sealmix", transport_kwargs=dict(SWARM_ARGS, target_group_size=2),
                          peer_overrides={1: dict(direct_plaintext=True)})
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        results, _ = _round(swarm, 0, [1, 2])
        assert [(r["ok"], r["reason"]) for r in results] == [(False, "partial")] * 2, results
    finally:
        swarm.close()


@pytest.mark.network
def test_a_flipped_byte_in_a_contribution_or_a_reduced_part_never_reaches_an_average():
    """3 peers; peer 2's data port behind the proxy, which flips one byte of the first connection
    it carries: of a contribution (round 0), of a reduced part (round 2). Rounds 1 and 3 go
    without the proxy and are exact for everyone."""
    swarm = LoopbackSwarm(3, run_id="sealtamper", transport_kwargs=dict(SWARM_ARGS, target_group_size=3))
    proxies = []
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        real = _call(swarm.peers[2], "data_port", fragment=0)
        for rnd, direction in ((0, TO_REDUCER), (2, TO_SENDER)):
            proxies.append(proxy := TamperProxy(("127.0.0.1", real), flip=(direction, 400)))
            _call(swarm.peers[2], "advertise", fragment=0, port=proxy.port)
            results, xs = _round(swarm, rnd, [100 * rnd + i for i in range(3)])
            assert proxy.flipped == 1, direction
            ok = _assert_exact_or_failed(swarm, results, xs)
            # the tampered exchange failed: its sender's round, or a contribution left out
            assert not all(ok) or {r["group_size"] for r in results} != {3}, results
            _call(swarm.peers[2], "advertise", fragment=0, port=real)
            results, xs = _round(swarm, rnd + 1, [100 * rnd + 50 + i for i in range(3)])
            _assert_exact(swarm, results, xs)
    finally:
        swarm.close()
        for proxy in proxies:
            proxy.close()
