"""Hole punching for the direct data path: two peers behind NAT open a direct TCP connection.

A peer behind NAT accepts no connection, so a groupmate cannot dial its data port (``direct.py``);
before this module every byte between two such peers crossed a circuit relay. A TCP connection
can still be opened between them by *simultaneous open*: each side connects, at the same time,
from a port whose public mapping the other knows, to the other's mapped port. Each side's SYN
leaves through its own NAT first, which then lets the other's SYN (a reply, to its conntrack) in;
the kernels turn the crossing SYNs into one established connection (RFC 793's simultaneous open).

- *Observed addresses.* A peer does not know which public address and port its NAT maps a local
  port to. A public node echoes it (``net.reachability.EchoServer``, run by ``bootstrap --relay``
  and announced on the DHT under the run's ``echo`` key): connect from the local port, read back
  the source address the echo saw. Two echoes from one local port to two echo servers tell the
  NAT's kind: the same mapping (``cone``: endpoint-independent, a home router) or not
  (``symmetric``: a new port per destination; no punch can work through it), or no NAT at all
  (``open``: the echo saw the local address itself).
- *Two ports per fragment.* A pair of groupmates exchanges in both directions (each sends its
  contribution to the other's part), and a kept-open connection per direction needs its own
  4-tuple: each peer sends from its ``send`` port and serves punched connections on its ``recv``
  port. Both are bound with ``SO_REUSEADDR`` and ``SO_REUSEPORT`` (a placeholder socket holds
  each), so one local port takes part in one connection per groupmate.
- *Who punches, when.* Every member reads the same announcements (``punch`` in the round's
  metadata: the two observed addresses and the NAT kind) and decides alike, at the round's start:
  a sender punches to a reducer it has no direct address for (and no punched connection kept
  open from an earlier round) while that reducer punches back; then the sealed direct path runs
  over the connection as over any other (``direct.DirectStream`` on the sender's side,
  ``direct.serve_accepted`` on the reducer's). Where the punch fails within ``request_timeout``
  (a symmetric NAT, a filtered port) the exchange goes through the p2p daemon, relayed, as before.
- *Reducers by reachability* (:func:`direct_reducers`): a part is reduced only by a member every
  other member reaches directly (an open address, or a punch that can work between the two
  kinds and has not failed lately); where no member qualifies, every non-client member reduces,
  reached through the relay where it must be.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import random
import socket
import struct
import time
from typing import Any, Callable, Optional, Sequence

from hivemind.utils import get_dht_time

from opendiloco_stream.net.reachability import NatKind, echo_key, parse_echoes, probe_nat, reserve_ports, reusable
from opendiloco_stream.transport.hivemind.direct import FailedAddresses

logger = logging.getLogger(__name__)

OPEN, CONE, SYMMETRIC, UNKNOWN = NatKind.OPEN, NatKind.CONE, NatKind.SYMMETRIC, NatKind.UNKNOWN
#: A failed punch keeps the pair off the direct path (and out of reducer choice) for a back-off:
#: UNREACHED_FIRST_S after a first failure, doubling with each further one up to UNREACHED_MAX_S,
#: forgotten once an exchange completes over a punched connection. The usual failure is the punch
#: right after a punched connection broke: the routers keep the closed connection's conntrack entry
#: 10 s (Linux's ``nf_conntrack_tcp_timeout_close``) and reset a SYN that meets it; 15 s later a punch
#: works. A pair that cannot punch at all (a filtered port) backs off to minutes.
UNREACHED_FIRST_S, UNREACHED_MAX_S = 15.0, 600.0
RETRY_S = (0.05, 0.2)  # after a reset (the other side's socket not there yet), retry after this much


# ---------------------------------------------------------------------------------------- the echo
def publish_echo(dht: Any, run_id: str, ips: Sequence[str], port: int, ttl_s: float = 120.0) -> None:
    """Announce an echo server (``net.reachability.EchoServer``) on the DHT (the bootstrap calls
    this at start and every heartbeat)."""
    for ip in ips:
        dht.store(echo_key(run_id), subkey=f"{ip}:{port}", value=[ip, port], expiration_time=get_dht_time() + ttl_s,
                  return_future=True)


def find_echoes(dht: Any, run_id: str, timeout: float = 10.0) -> list[tuple[str, int]]:
    """The echo servers announced for ``run_id`` (an empty list where none is)."""
    try:
        found = dht.get(echo_key(run_id), latest=True, return_future=True).result(timeout)
    except Exception as e:
        logger.debug("echo lookup: %r", e)
        return []
    return parse_echoes(None if found is None else found.value)


# ---------------------------------------------------------------------------------------- the puncher
class Puncher:
    """One fragment endpoint's two punching ports and what the echoes saw of them (see the module
    docstring). Build it with :meth:`start` in a trainer thread (blocking echoes); ``adopt`` (set
    by the endpoint) serves a punched connection on which a groupmate will say hello."""

    def __init__(self, send_port: int, recv_port: int, send_seen: tuple[str, int], recv_seen: tuple[str, int],
                 kind: NatKind, holders: Sequence[socket.socket] = (), clock: Callable[[], float] = time.monotonic):
        self.send_port, self.recv_port = send_port, recv_port
        self.send_seen, self.recv_seen, self.kind = tuple(send_seen), tuple(recv_seen), kind
        self._holders = list(holders)  # placeholder sockets that keep both ports ours
        self.adopt: Optional[Callable[[socket.socket], "asyncio.Future"]] = None
        self.answered: dict[tuple, asyncio.Future] = {}  # sender's address -> serving task of its punched connection
        self._unreached = FailedAddresses(UNREACHED_FIRST_S, UNREACHED_MAX_S, clock)  # peer id -> its back-off
        self.punched = self.failed = 0  # connections this endpoint opened by punching, and punches that failed

    @classmethod
    def start(cls, echoes: Sequence[tuple[str, int]], bind_host: str = "0.0.0.0") -> Optional["Puncher"]:
        """Bind two ports and ask up to two echo servers what they map to
        (``net.reachability.probe_nat``); None (no punching) where no echo answers."""
        try:
            holders = reserve_ports(2, bind_host)
        except OSError as e:
            logger.info("no hole punching (%s): groupmates behind NAT are reached through the relay", e)
            return None
        send_port, recv_port = (h.getsockname()[1] for h in holders)
        try:
            probe = probe_nat(send_port, recv_port, echoes, bind_host)
        except OSError as e:
            for h in holders:
                h.close()
            logger.info("no hole punching (%s): groupmates behind NAT are reached through the relay", e)
            return None
        logger.info("hole punching: this peer's NAT is %s (data ports %d, %d seen as %s:%d, %s:%d)", probe.kind.value,
                    send_port, recv_port, *probe.send_seen, *probe.recv_seen)
        return cls(send_port, recv_port, probe.send_seen, probe.recv_seen, probe.kind, holders)

    def meta(self) -> dict:
        """What the round's metadata says of this peer's punching (``punch``)."""
        return {"send": list(self.send_seen), "recv": list(self.recv_seen), "nat": NatKind(self.kind).value,
                "unreached": self.unreached()}

    def unreached(self) -> list[str]:
        """The groupmates a failed punch keeps off the direct path now (announced with the round)."""
        return self._unreached.blocked_now()

    def mark_unreached(self, peer: str) -> float:
        """A punch with ``peer`` failed: returns how long it is now kept off (its back-off)."""
        self.failed += 1
        return self._unreached.failed(peer)

    def mark_reached(self, peer: str) -> None:
        """A punched connection with ``peer`` worked: its next failure starts the back-off afresh."""
        self._unreached.succeeded(peer)

    def serving(self, remote: tuple) -> bool:
        """Whether a connection punched from ``remote`` (a sender's send address) is still served."""
        task = self.answered.get(tuple(remote))
        return task is not None and not task.done()

    async def dial(self, local_port: int, remote: Sequence, timeout: float) -> socket.socket:
        """Connect from ``local_port`` to ``remote`` while the other side does the same towards us:
        retried after a reset (its socket not there yet) until ``timeout``; a SYN dropped by a NAT
        is retransmitted by the kernel. ``asyncio.TimeoutError`` or ``OSError`` when it fails."""
        loop = asyncio.get_event_loop()
        deadline = loop.time() + timeout
        address = (str(remote[0]), int(remote[1]))
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                reusable(sock)
                # closed with a reset, not a FIN: no TIME_WAIT keeps this 4-tuple (the next punch's) for a minute
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.bind(("0.0.0.0", local_port))
                sock.setblocking(False)
                await asyncio.wait_for(loop.sock_connect(sock, address), max(0.0, deadline - loop.time()))
                return sock
            except OSError as e:
                sock.close()
                if e.errno not in (errno.ECONNREFUSED, errno.ECONNRESET) or loop.time() + RETRY_S[1] > deadline:
                    raise
                await asyncio.sleep(random.uniform(*RETRY_S))
            except BaseException:
                sock.close()
                raise

    async def answer(self, remote: Sequence, timeout: float) -> bool:
        """The reducer's side: punch from the recv port to a sender's send address and serve the
        connection (``adopt``); False where it failed (the sender falls back on its own)."""
        try:
            sock = await self.dial(self.recv_port, remote, timeout)
        except (OSError, asyncio.TimeoutError) as e:
            logger.debug("punch from %s:%d failed: %r", remote[0], remote[1], e)
            return False
        self.answered[tuple(remote)] = self.adopt(sock)
        return True

    def close(self) -> None:
        for task in self.answered.values():
            task.cancel()
        for holder in self._holders:
            holder.close()


# ---------------------------------------------------------------------------------------- reachability
def punch_info(meta: Any) -> Optional[dict]:
    """A member's ``punch`` announcement, if it is well formed."""
    info = meta.get("punch") if isinstance(meta, dict) else None
    if not isinstance(info, dict):
        return None
    try:
        for k in ("send", "recv"):
            ip, port = info[k]
            ipaddress.IPv4Address(ip)
            if not 0 < int(port) < 65536:
                return None
    except (KeyError, TypeError, ValueError):
        return None
    return info


def can_punch(a: Optional[dict], b: Optional[dict]) -> bool:
    """Whether a punch between two announcements can work: both announce one, neither is behind
    a symmetric NAT (or an unknown one) unless the other has no NAT at all."""
    if a is None or b is None:
        return False
    kinds = {a.get("nat"), b.get("nat")}  # strings, as announced (an enum member hashes by its name)
    return kinds <= {OPEN.value, CONE.value} or (OPEN.value in kinds and len(kinds) == 2)


def reaches(users: Sequence[Any], peer_names: Sequence[str], direct: Sequence[Any], a: int, b: int) -> bool:
    """Whether member ``a`` reaches member ``b`` without a relay: ``b`` listens on an address of
    its own, or is not relayed (``--no-direct``: its p2p daemon is dialed directly), or a punch
    can work between them and neither reported it failing lately."""
    if direct[b] is not None or not (isinstance(users[b], dict) and users[b].get("relayed")):
        return True
    pa, pb = punch_info(users[a]), punch_info(users[b])
    if not can_punch(pa, pb):
        return False
    return peer_names[b] not in (pa.get("unreached") or []) and peer_names[a] not in (pb.get("unreached") or [])


def direct_reducers(users: Sequence[Any], peer_names: Sequence[str], direct: Sequence[Any],
                    is_reducer: Sequence[bool]) -> list[bool]:
    """Which members reduce a part this round: those every other member reaches directly
    (:func:`reaches`), where there is one; else ``is_reducer`` unchanged (parts through relays).
    Every member computes it from the same gathered metadata, so all agree."""
    n = len(users)
    direct_ok = [is_reducer[b] and all(reaches(users, peer_names, direct, a, b) for a in range(n) if a != b)
                 for b in range(n)]
    return direct_ok if any(direct_ok) else list(is_reducer)
