"""Hole punching for the direct data path: two peers behind NAT open a direct TCP connection.

A peer behind NAT accepts no connection, so a groupmate cannot dial its data port (``direct.py``);
before this module every byte between two such peers crossed a circuit relay. A TCP connection
can still be opened between them by *simultaneous open*: each side connects, at the same time,
from a port whose public mapping the other knows, to the other's mapped port. Each side's SYN
leaves through its own NAT first, which then lets the other's SYN (a reply, to its conntrack) in;
the kernels turn the crossing SYNs into one established connection (RFC 793's simultaneous open).

- *Observed addresses.* A peer does not know which public address and port its NAT maps a local
  port to. A public node echoes it (:class:`EchoServer`, run by ``bootstrap --relay`` and
  announced on the DHT under the run's ``echo`` key): connect from the local port, read back
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
import threading
import time
from typing import Any, Callable, Optional, Sequence

from opendiloco_stream.net.keys import run_key

logger = logging.getLogger(__name__)

ECHO_MAGIC = b"ODEC"
_ECHO = struct.Struct(">4s4sH")  # magic, IPv4 address, port: what the echo saw of the connection
ECHO_TIMEOUT_S = 3.0
OPEN, CONE, SYMMETRIC, UNKNOWN = "open", "cone", "symmetric", "unknown"
UNREACHED_S = 120.0  # a failed punch keeps the pair off the direct path (and out of reducer choice) this long
RETRY_S = (0.05, 0.2)  # after a reset (the other side's socket not there yet), retry after this much


# ---------------------------------------------------------------------------------------- the echo
class EchoServer:
    """Answers every TCP connection with the source address and port it came from, then closes
    (first, so the TIME_WAIT stays here and the client may reuse its port at once). A thread."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="ods-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, (ip, port) = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(ECHO_TIMEOUT_S)
                conn.sendall(_ECHO.pack(ECHO_MAGIC, socket.inet_aton(ip), port))
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(2.0)


def echo_key(run_id: str) -> str:
    return run_key(run_id, "echo")


def publish_echo(dht: Any, run_id: str, ips: Sequence[str], port: int, ttl_s: float = 120.0) -> None:
    """Announce an echo server on the DHT (the bootstrap calls this at start and every heartbeat)."""
    from hivemind.utils import get_dht_time
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
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for entry in found.value.values():
        try:
            ip, port = entry.value
            ipaddress.IPv4Address(ip)
            out.append((str(ip), int(port)))
        except (TypeError, ValueError):
            continue
    return sorted(set(out))


def _reusable(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


def observe(local_port: int, echo: tuple[str, int], timeout: float = ECHO_TIMEOUT_S,
            bind_host: str = "0.0.0.0") -> tuple[str, int, str]:
    """The public ``(ip, port)`` a connection from ``local_port`` shows to ``echo`` (blocking), and
    the local address it left from."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        _reusable(sock)
        sock.bind((bind_host, local_port))
        sock.settimeout(timeout)
        sock.connect(echo)
        data = b""
        while len(data) < _ECHO.size:
            more = sock.recv(_ECHO.size - len(data))
            if not more:
                break
            data += more
        local_ip = sock.getsockname()[0]
        while sock.recv(64):  # wait for the echo's close: its TIME_WAIT, not ours, keeps the 4-tuple
            pass
    if len(data) != _ECHO.size or data[:4] != ECHO_MAGIC:
        raise ConnectionError(f"echo server {echo[0]}:{echo[1]} answered {len(data)} bytes, not an echo")
    _magic, ip, port = _ECHO.unpack(data)
    return socket.inet_ntoa(ip), port, local_ip


# ---------------------------------------------------------------------------------------- the puncher
class Puncher:
    """One fragment endpoint's two punching ports and what the echoes saw of them (see the module
    docstring). Build it with :meth:`start` in a trainer thread (blocking echoes); ``adopt`` (set
    by the endpoint) serves a punched connection on which a groupmate will say hello."""

    def __init__(self, send_port: int, recv_port: int, send_seen: tuple[str, int], recv_seen: tuple[str, int],
                 kind: str, holders: Sequence[socket.socket] = (), clock: Callable[[], float] = time.monotonic):
        self.send_port, self.recv_port = send_port, recv_port
        self.send_seen, self.recv_seen, self.kind = tuple(send_seen), tuple(recv_seen), kind
        self._holders = list(holders)  # placeholder sockets that keep both ports ours
        self.adopt: Optional[Callable[[socket.socket], "asyncio.Future"]] = None
        self.answered: dict[tuple, asyncio.Future] = {}  # sender's address -> serving task of its punched connection
        self._unreached: dict[str, float] = {}  # peer id -> until when a failed punch keeps it off
        self.clock = clock
        self.punched = self.failed = 0  # connections this endpoint opened by punching, and punches that failed

    @classmethod
    def start(cls, echoes: Sequence[tuple[str, int]], bind_host: str = "0.0.0.0") -> Optional["Puncher"]:
        """Bind two ports and ask up to two echo servers what they map to; None (no punching)
        where no echo answers."""
        holders = []
        try:
            for _ in range(2):
                holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _reusable(holder)
                holder.bind((bind_host, 0))
                holders.append(holder)
            send_port, recv_port = (h.getsockname()[1] for h in holders)
            seen = []  # (observed ip, observed port, local ip) from the send port, per echo
            for echo in list(echoes)[:2]:
                try:
                    seen.append(observe(send_port, echo, bind_host=bind_host))
                except OSError as e:
                    logger.info("echo server %s:%d did not answer (%r)", *echo, e)
            if not seen:
                raise ConnectionError("no echo server answered")
            recv = observe(recv_port, next(e for e in echoes), bind_host=bind_host)
        except OSError as e:
            for h in holders:
                h.close()
            logger.info("no hole punching (%s): groupmates behind NAT are reached through the relay", e)
            return None
        kind = nat_kind(send_port, recv_port, seen, recv)
        logger.info("hole punching: this peer's NAT is %s (data ports %d, %d seen as %s:%d, %s:%d)", kind,
                    send_port, recv_port, seen[0][0], seen[0][1], recv[0], recv[1])
        return cls(send_port, recv_port, seen[0][:2], recv[:2], kind, holders)

    def meta(self) -> dict:
        """What the round's metadata says of this peer's punching (``punch``)."""
        return {"send": list(self.send_seen), "recv": list(self.recv_seen), "nat": self.kind,
                "unreached": self.unreached()}

    def unreached(self) -> list[str]:
        now = self.clock()
        self._unreached = {p: t for p, t in self._unreached.items() if t > now}
        return sorted(self._unreached)

    def mark_unreached(self, peer: str) -> None:
        self.failed += 1
        self._unreached[peer] = self.clock() + UNREACHED_S

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
                _reusable(sock)
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


def nat_kind(send_port: int, recv_port: int, seen: Sequence[tuple], recv: tuple) -> str:
    """The NAT's kind from the echoes (see the module docstring): ``open`` where the echo saw the
    local address and port; ``symmetric`` where one port showed two mappings (or, with one echo
    server, a port the NAT did not keep); else ``cone``."""
    ip, port, local_ip = seen[0]
    if ip == local_ip and port == send_port and recv[1] == recv_port:
        return OPEN
    if len({(s[0], s[1]) for s in seen}) > 1:
        return SYMMETRIC
    if len(seen) == 1 and (port != send_port or recv[1] != recv_port):
        return UNKNOWN  # one echo: a changed port may be a symmetric NAT's; do not count on a punch
    return CONE


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
    kinds = {a.get("nat"), b.get("nat")}
    return kinds <= {OPEN, CONE} or (OPEN in kinds and len(kinds) == 2)


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
