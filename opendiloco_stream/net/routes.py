"""Keep a DHT node's routing table through network partitions.

hivemind's DHT drops a node from its routing table the first time a request to it goes
unanswered, and it adds a node back only when that node contacts it. After a partition (a link
down for a few seconds, a laptop on a train, a cloud network hiccup) both sides may have dropped
each other: once the link heals, nobody talks to anybody across the old cut, and the run stays
split in two for good (each side matchmakes alone; see tests/test_faults.py).

:func:`keep_routes` starts a small task in the DHT process that remembers every peer it has seen
in the routing table and, every ``period_s``, pings each remembered peer that is no longer in the
table. A ping that is answered puts the peer back (hivemind's ``call_ping`` updates the table on
both ends), so the next lookup reaches it again. A peer that has not answered for
``forget_after_s`` is forgotten (it died or left); until then it costs one ping per period.
Pings go through the p2p daemon, which still knows a recently connected peer's addresses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 5.0
DEFAULT_FORGET_AFTER_S = 600.0  # go-libp2p keeps a recently connected peer's addresses 10-15 minutes
MAX_PINGS = 16  # per period: a swarm that lost many peers at once re-finds them over a few periods


def keep_routes(dht: Any, *, period_s: float = DEFAULT_PERIOD_S,
                forget_after_s: float = DEFAULT_FORGET_AFTER_S, timeout: float = 10.0) -> bool:
    """Start the keeper in ``dht``'s process (a running ``hivemind.DHT``); idempotent.

    Returns True if this call started it, False if it was already running. Never raises for a
    DHT that does not answer within ``timeout`` (the run goes on without the keeper; logged)."""
    if not period_s > 0 or not forget_after_s > 0:
        raise ValueError(f"period_s and forget_after_s must be > 0, got {period_s}, {forget_after_s}")
    try:
        future = dht.run_coroutine(functools.partial(_start, period_s=period_s, forget_after_s=forget_after_s),
                                   return_future=True)
        return bool(future.result(timeout=timeout))
    except Exception as e:  # the keeper is a repair, not a requirement: a busy or dying DHT keeps its table
        logger.warning("could not start the DHT route keeper: %r (a healed partition may stay split)", e)
        return False


# in the DHT process: each node's keeper task and its memory (peer id -> when last seen or answered)
_KEEPERS: "weakref.WeakKeyDictionary[Any, tuple[asyncio.Task, dict]]" = weakref.WeakKeyDictionary()


async def _start(_dht: Any, node: Any, *, period_s: float, forget_after_s: float) -> bool:
    if node in _KEEPERS:
        return False
    seen: dict[Any, float] = {}
    _KEEPERS[node] = (asyncio.create_task(_keep(node, seen, period_s, forget_after_s)), seen)
    return True


def remembered(node: Any) -> dict[Any, float]:
    """In the DHT process: the peers ``node``'s keeper remembers (peer id -> monotonic time last seen)."""
    keeper = _KEEPERS.get(node)
    return {} if keeper is None else dict(keeper[1])


async def _keep(node: Any, seen: dict[Any, float], period_s: float, forget_after_s: float) -> None:
    """Look at the table every second (so a peer met just before a cut is remembered), repair every period."""
    tick = min(1.0, period_s)
    next_repair = time.monotonic() + period_s
    while node.is_alive:
        try:
            remember(node, seen)
            if time.monotonic() >= next_repair:
                next_repair = time.monotonic() + period_s
                await repair_once(node, seen, forget_after_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one missed repair; the next period tries again
            logger.debug("DHT route keeper: %r", e)
        await asyncio.sleep(tick)


def remember(node: Any, seen: dict[Any, float]) -> None:
    """Note every peer now in ``node``'s routing table as seen now."""
    now = time.monotonic()
    for peer_id in list(node.protocol.routing_table.peer_id_to_uid):
        seen[peer_id] = now


async def repair_once(node: Any, seen: dict[Any, float], forget_after_s: float) -> list[Any]:
    """One pass: remember the table's peers, ping the remembered ones it lost; return those that answered."""
    remember(node, seen)
    now, table = time.monotonic(), node.protocol.routing_table
    for peer_id in [p for p, t in seen.items() if now - t > forget_after_s]:
        logger.info("DHT: forgetting peer %s (no answer for %.0f s)", peer_id, now - seen.pop(peer_id))
    lost = sorted((p for p in seen if p not in table.peer_id_to_uid and p != node.peer_id),
                  key=lambda p: -seen[p])[:MAX_PINGS]  # most recently seen first
    if not lost:
        return []
    answers = await asyncio.gather(*(node.protocol.call_ping(p) for p in lost), return_exceptions=True)
    back = [p for p, a in zip(lost, answers) if a is not None and not isinstance(a, BaseException)]
    for peer_id in back:
        seen[peer_id] = time.monotonic()
        logger.info("DHT: peer %s answers again; back in the routing table", peer_id)
    return back
