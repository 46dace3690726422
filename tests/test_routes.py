"""The DHT route keeper (net/routes.py), with real hivemind nodes on 127.0.0.1.

hivemind drops a peer from the routing table after one unanswered request. A real partition
(tests/test_faults.py, network namespaces) makes both sides do that; here the drop is done by hand
inside the DHT process, which is exactly the state such a request leaves behind.
"""

from __future__ import annotations

import functools
import time

import pytest

from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.dht import start_dht, stop_dht, visible_maddrs
from opendiloco_stream.net.routes import keep_routes, repair_once


async def _drop(_dht, node, peer_id: str) -> bool:
    """Remove ``peer_id`` from this node's routing table (what an unanswered request does)."""
    from hivemind.p2p import PeerID

    table = node.protocol.routing_table
    uid = table.get(peer_id=PeerID.from_base58(peer_id))
    if uid is None:
        return False
    del table[uid]
    return True


async def _knows(_dht, node, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer_id) in node.protocol.routing_table


async def _remembers(_dht, node, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    from opendiloco_stream.net.routes import remembered

    return PeerID.from_base58(peer_id) in remembered(node)


async def _one_pass(_dht, node, lost: str, stale: str) -> tuple[list[str], list[str]]:
    """Drop ``lost``, then run one repair on a memory that holds it (seen now) and ``stale`` (seen an
    hour ago); no await in between, so the keeper's own pass cannot re-add it first."""
    from hivemind.p2p import PeerID

    assert await _drop(_dht, node, lost)
    seen = {PeerID.from_base58(lost): time.monotonic(), PeerID.from_base58(stale): time.monotonic() - 3600}
    back = await repair_once(node, seen, forget_after_s=600)
    return [str(p) for p in back], [str(p) for p in seen]


def _wait_for(dht, fn, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dht.run_coroutine(fn):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_dropped_peer_is_pinged_back_into_the_routing_table():
    nodes = []
    try:
        nodes.append(start_dht(NetConfig()))  # start_dht starts the keeper (5 s period)
        nodes.append(start_dht(NetConfig(initial_peers=visible_maddrs(nodes[0]))))
        a, b = nodes
        assert keep_routes(a) is False  # already running: idempotent
        b_id, a_id = str(b.peer_id), str(a.peer_id)
        assert _wait_for(a, functools.partial(_knows, peer_id=b_id), 20)
        assert _wait_for(a, functools.partial(_remembers, peer_id=b_id), 20)  # the keeper looks every second
        # both sides drop each other, as after a partition: nobody would ever talk again
        assert a.run_coroutine(functools.partial(_drop, peer_id=b_id))
        b.run_coroutine(functools.partial(_drop, peer_id=a_id))
        assert not a.run_coroutine(functools.partial(_knows, peer_id=b_id))
        assert _wait_for(a, functools.partial(_knows, peer_id=b_id), 20)  # the keeper pinged b back
        assert _wait_for(b, functools.partial(_knows, peer_id=a_id), 20)

        # one pass by hand: a lost live peer answers; a peer unseen for an hour is forgotten, unpinged
        stale = "QmXcY4ZNkgxUS8Ca41UAYUdtqNjvHj6Lk2SHv9iBR5Yqgh"
        back, remembered = a.run_coroutine(functools.partial(_one_pass, lost=b_id, stale=stale))
        assert back == [b_id] and stale not in remembered
    finally:
        for node in nodes:
            stop_dht(node)
