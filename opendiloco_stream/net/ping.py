"""Round-trip times to the swarm's peers before any round: DHT pings (``hivemind``'s ``call_ping``).

A peer measures the RTT to its groupmates in its rounds (TCP_INFO of the direct path's
connections, ``transport/hivemind/link.py``), but what it decides before its first round (how far
ahead groups form: ``prematch_steps = "auto"``) needs one earlier. The DHT already holds a
connection to every peer of its routing table (the initial peers and every DHT server of the run
it met), so :func:`ping_swarm` pings each of them a few times from the DHT's process and keeps the
fastest answer: the first ping of a peer may pay for its connection's set-up, the later ones are
one request and one reply on a connection already open, about one round trip.

Client-mode peers serve no DHT requests and are not in routing tables: they are measured only in
rounds. Pings go through the DHT's p2p daemon, which may relay them (a NAT'ed peer): a relayed
path is slower than the direct one a round uses, so the figure errs long (groups form earlier).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from typing import Any, Optional

from hivemind.dht import DHT

PINGS = 3  # per peer: the first may set up the connection; the fastest answer is the RTT
MAX_PEERS = 16  # a large swarm: the peers most recently in the routing table, not every one


def ping_swarm(dht: DHT, timeout: float = 5.0, pings: int = PINGS, max_peers: int = MAX_PEERS,
               lock: Optional[threading.Lock] = None) -> dict[str, float]:
    """``{peer id: RTT (s)}`` of the DHT's routing-table peers that answered, the fastest of
    ``pings`` DHT pings each, within ``timeout`` seconds in all; ``{}`` when none answered (or the
    DHT did not). Blocks the caller until then; ``lock``: held while the request goes down the
    DHT's control pipe (one sender at a time), not while the pings run."""
    future = None
    try:
        with lock if lock is not None else contextlib.nullcontext():
            future = dht.run_coroutine(functools.partial(_ping_all, pings=pings, max_peers=max_peers,
                                                         timeout=timeout), return_future=True)
        return dict(future.result(timeout=timeout + 1.0))
    except Exception:  # a busy, stopped or dying DHT: nothing measured this time
        if future is not None:
            future.cancel()
        return {}


async def _ping_all(_dht: Any, node: Any, *, pings: int, max_peers: int, timeout: float) -> dict[str, float]:
    """In the DHT's process: ping the routing table's peers concurrently, ``pings`` times each in turn."""
    peers = [p for p in list(node.protocol.routing_table.peer_id_to_uid) if p != node.peer_id][:max_peers]
    deadline = time.monotonic() + timeout
    rtts = await asyncio.gather(*(_fastest(node, p, pings, deadline) for p in peers))
    return {str(p): rtt for p, rtt in zip(peers, rtts) if rtt is not None}


async def _fastest(node: Any, peer: Any, pings: int, deadline: float) -> Optional[float]:
    best: Optional[float] = None
    for _ in range(pings):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        t0 = time.monotonic()
        try:
            answer = await asyncio.wait_for(node.protocol.call_ping(peer), left)
        except (asyncio.TimeoutError, Exception):  # no answer in time: what was measured stands
            break
        if answer is None:
            break
        rtt = time.monotonic() - t0
        best = rtt if best is None else min(best, rtt)
    return best
