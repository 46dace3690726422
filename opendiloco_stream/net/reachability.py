"""Can other peers open a connection to this one? A dial-back service and a dial probe.

A peer that others cannot dial can still connect out, join the DHT and even look healthy, but the
averaging services of other peers fail to reach it and every round it takes part in times out. The only way
to know is to be dialed from the outside:

* :class:`DialbackService` runs next to a DHT node (``opendiloco-stream bootstrap`` starts one). A
  peer sends it a list of its multiaddrs; for each, the service starts a fresh p2p daemon that
  does not listen, has no relays and no prior connection, and tries to connect to exactly that
  address. The answer says, per address, whether a direct connection from the service's machine
  succeeded.
* :func:`probe_dial` is that dial, usable on its own (``doctor`` falls back to it, from this
  machine, when the bootstrap offers no dial-back service, and says so).
* The same service opens plain TCP connections to a peer's *data ports* (the direct data path of
  rounds, ``net.data_port``) when asked with ``"tcp": [[ip, port], ...]`` (:func:`request_tcp_dialback`,
  :func:`probe_tcp`). Only IPs of the caller's own announced multiaddrs are dialed, so the service
  cannot be used to scan other hosts.
* Asked with ``{"observe": true}`` (:func:`request_observed`), the service dials nothing and answers
  with the address it sees the caller's connection come from. Behind NAT that is the router's
  public address, not one of the caller's own: how ``doctor`` tells a peer it is behind NAT.
* *Which NAT* (:class:`EchoServer`, :func:`probe_nat`): an echo server (``bootstrap --relay`` runs
  one, announced on the DHT under the run's ``echo`` key) answers each TCP connection with the
  address and port it came from. Connecting from one local port to two echo servers tells the
  NAT's kind (:class:`NatKind`): whether hole punching (``transport/hivemind/punch.py``) can open
  a direct connection through it, and what ``doctor`` reports.

Abuse bound: one request at a time per caller, at most ``max_addrs`` addresses (and TCP targets),
all of one peer id, and at most two dials in flight per service.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import ipaddress
import json
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from opendiloco_stream.net.dht import ip4_of, parse_maddr
from opendiloco_stream.net.keys import run_key

logger = logging.getLogger(__name__)

DIALBACK_HANDLER = "ods_dialback_v1"

_PROBE_ARGS = dict(dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False, no_listen=True)


def short_error(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    # p2pd errors look like "Daemon failed to start: 2026/01/01 12:00:00 failed to connect to bootstrap peers"
    if "failed to connect to bootstrap peers" in msg:
        return "connection failed"
    if "failed to start in" in msg:
        return "no answer (timed out)"
    return msg.splitlines()[0][:200]


async def probe_dial(maddr: str, timeout: float = 10.0) -> Optional[str]:
    """Open a direct connection to ``maddr`` (with its ``/p2p/`` id) from a fresh p2p daemon.

    Returns None on success, else a short reason. The daemon's own bootstrap step is the dial: it
    connects to the given peer, verifying its peer id, before it reports ready.
    """
    try:
        p2p = await P2P.create(initial_peers=[maddr], startup_timeout=timeout, **_PROBE_ARGS)
    except Exception as e:
        return short_error(e)
    await p2p.shutdown()
    return None


async def probe_tcp(ip: str, port: int, timeout: float = 10.0) -> Optional[str]:
    """Open (and close) a plain TCP connection to ``ip:port``; None on success, else a short reason."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except asyncio.TimeoutError:
        return f"no answer in {timeout:g} s (a firewall dropping the port?)"
    except OSError as e:  # asyncio words it "Connect call failed (...)": name the errno instead
        return os.strerror(e.errno) if e.errno else (str(e) or type(e).__name__)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


class DialbackService:
    """Serve dial-back requests on ``dht``'s p2p daemon, from a background thread with its own loop.

    ::

        service = DialbackService(dht).start()
        ...
        service.shutdown()
    """

    def __init__(self, dht: Any, *, timeout: float = 10.0, max_addrs: int = 8, max_concurrent: int = 2):
        self.dht, self.timeout, self.max_addrs, self.max_concurrent = dht, timeout, max_addrs, max_concurrent
        self.served = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="dialback-service", daemon=True)

    def start(self, timeout: float = 30.0) -> "DialbackService":
        """Start serving; raise if the handler could not be registered within ``timeout``."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"dial-back service did not start within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    def shutdown(self) -> None:
        """Stop serving (the DHT keeps running)."""
        if self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already ended
                pass
        # a dial in flight ends within its own timeout; the thread is a daemon, so never wait longer
        self._thread.join(self.timeout + 2.0)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        # the p2p client's reader tasks fail when p2pd dies first (Ctrl+C reaches it too): not our error
        self._loop.set_exception_handler(lambda loop, context: logger.debug("dial-back loop: %s", context))
        self._dials = asyncio.Semaphore(self.max_concurrent)
        self._busy_callers: set[str] = set()
        try:
            p2p = self._p2p = await self.dht.replicate_p2p()
            await p2p.add_protobuf_handler(DIALBACK_HANDLER, self._handle, BytesValue)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            try:  # bounded: when Ctrl+C already killed p2pd, the daemon never answers
                await asyncio.wait_for(p2p.remove_protobuf_handler(DIALBACK_HANDLER), 0.5)
            except Exception as e:
                logger.debug("remove dial-back handler: %r", e)

    async def _handle(self, request: Any, context: Any) -> Any:
        caller = context.remote_id.to_base58()
        if caller in self._busy_callers:
            return BytesValue(value=json.dumps({"error": "a dial-back for this peer is already running"}).encode())
        self._busy_callers.add(caller)
        try:
            reply = await self._observed(context.remote_id) if _is_observe(request.value) else \
                await self._dial_all(request.value)
        finally:
            self._busy_callers.discard(caller)
        self.served += 1
        return BytesValue(value=json.dumps(reply).encode())

    async def _observed(self, caller: Any) -> dict[str, Any]:
        """The remote addresses of this daemon's connections to ``caller`` (what it sees them come from)."""
        peers = await self._p2p.list_peers()
        return {"observed": sorted({str(a) for p in peers if p.peer_id == caller for a in p.addrs})}

    async def _dial_all(self, payload: bytes) -> dict[str, Any]:
        try:
            request = json.loads(payload)
            maddrs = [str(m) for m in request["maddrs"]][: self.max_addrs]
            ids = {Multiaddr(m)["p2p"] for m in maddrs}
        except Exception:
            return {"error": "bad request: expected {\"maddrs\": [multiaddrs with /p2p/<id>]}"}
        if len(ids) != 1:
            return {"error": "all addresses of one request must carry the same /p2p/ id"}
        if "tcp" in request:  # data ports: TCP only, to the caller's own announced IPs
            try:
                targets = [(str(ip), int(port)) for ip, port in request["tcp"]][: self.max_addrs]
            except Exception:
                return {"error": "bad request: expected \"tcp\": [[ip, port], ...]"}
            allowed = set(map(ip4_of, maddrs)) - {""}
            if any(ip not in allowed or not 1 <= port <= 65535 for ip, port in targets):
                return {"error": "TCP targets must be IPs of the announced multiaddrs, ports 1-65535"}

            async def connect(ip: str, port: int) -> Optional[str]:
                async with self._dials:
                    return await probe_tcp(ip, port, self.timeout)

            answers = await asyncio.gather(*(connect(ip, port) for ip, port in targets))
            return {"tcp": {f"{ip}:{port}": a for (ip, port), a in zip(targets, answers)}}

        async def dial(m: str) -> Optional[str]:
            async with self._dials:
                return await probe_dial(m, self.timeout)

        results = await asyncio.gather(*(dial(m) for m in maddrs))
        return {"results": dict(zip(maddrs, results))}


def _is_observe(payload: bytes) -> bool:
    try:
        request = json.loads(payload)
    except ValueError:
        return False
    return isinstance(request, dict) and request.get("observe") is True


async def _ask(p2p: Any, helper: Any, body: dict, timeout: float) -> dict[str, Any]:
    """One request to ``helper``'s dial-back service; its answer, or LookupError / TimeoutError."""
    request = BytesValue(value=json.dumps(body).encode())
    try:
        reply = await asyncio.wait_for(
            p2p.call_protobuf_handler(helper, DIALBACK_HANDLER, request, BytesValue), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no dial-back answer within {timeout:g} s") from None
    except Exception as e:
        raise LookupError(f"{helper} offers no dial-back service ({short_error(e)})") from None
    answer = json.loads(reply.value)
    if "error" in answer:
        raise LookupError(f"dial-back refused: {answer['error']}")
    return answer


async def request_dialback(p2p: Any, helper: Any, maddrs: Sequence[str], timeout: float) -> dict[str, Optional[str]]:
    """Ask the peer ``helper`` (a PeerID ``p2p`` is connected to) to dial each of ``maddrs``.

    Returns ``{maddr: None (reached) or reason}``. Raises ``LookupError`` if the helper offers no
    dial-back service, ``TimeoutError`` if it does not answer within ``timeout``.
    """
    answer = await _ask(p2p, helper, {"maddrs": list(maddrs)}, timeout)
    return {m: answer["results"].get(m, "not dialed") for m in maddrs}


async def request_tcp_dialback(p2p: Any, helper: Any, maddrs: Sequence[str], targets: Sequence[tuple[str, int]],
                               timeout: float) -> dict[str, Optional[str]]:
    """Ask ``helper`` to open a TCP connection to each ``(ip, port)`` (IPs of ``maddrs``, this
    peer's announced addresses). Returns ``{"ip:port": None (reached) or reason}``; raises
    ``LookupError`` if the helper offers no such service (an older bootstrap), ``TimeoutError``."""
    answer = await _ask(p2p, helper, {"maddrs": list(maddrs), "tcp": [list(t) for t in targets]}, timeout)
    if "tcp" not in answer:
        raise LookupError(f"{helper} does not check data ports (an older bootstrap)")
    return {f"{ip}:{port}": answer["tcp"].get(f"{ip}:{port}", "not dialed") for ip, port in targets}


async def request_observed(p2p: Any, helper: Any, timeout: float) -> list[str]:
    """The multiaddrs ``helper`` sees this node's connections to it come from (the address after
    any NAT on the way). Raises ``LookupError`` if the helper does not offer this (an older
    bootstrap), ``TimeoutError``."""
    answer = await _ask(p2p, helper, {"observe": True}, timeout)
    if "observed" not in answer:
        raise LookupError(f"{helper} does not report observed addresses (an older bootstrap)")
    return [str(m) for m in answer["observed"]]


async def _dialback_of_self(_dht: Any, node: Any, helpers: Sequence[str], timeout: float) -> tuple[Optional[bool], str]:
    """In the DHT process: ask the first of ``helpers`` that answers to dial this node's announced
    addresses (loopback and wildcard ones left out). ``(True/False, detail)``; ``(None, why)`` when
    no helper could say."""
    maddrs = []
    for m in await node.p2p.get_visible_maddrs(latest=True):
        ip = ip4_of(m)
        if ip and not ipaddress.ip_address(ip).is_loopback and not ipaddress.ip_address(ip).is_unspecified:
            maddrs.append(str(m))
    if not maddrs:
        return False, "it announces no address others could dial"
    why = "no initial peer to ask"
    for helper in helpers:
        try:
            results = await request_dialback(node.p2p, PeerID.from_base58(helper), maddrs, timeout)
        except (LookupError, TimeoutError) as e:
            why = str(e)
            continue
        reached = [m for m, err in results.items() if err is None]
        if reached:
            return True, f"the bootstrap dialed {' '.join(reached)}"
        return False, "; ".join(f"{m}: {err}" for m, err in results.items())
    return None, why


def reachable(dht: Any, initial_peers: Sequence[str], timeout: float = 30.0) -> tuple[Optional[bool], str]:
    """Can others open a connection to ``dht``'s node? Asked of the initial peers' dial-back
    service (``opendiloco-stream bootstrap`` offers one), the way ``doctor`` asks. ``(True, ...)``,
    ``(False, what failed)``, or ``(None, why nobody could say)`` (no initial peer offers the
    service, or it did not answer within ``timeout``)."""
    helpers = list(dict.fromkeys(parse_maddr(m)["p2p"] for m in initial_peers))
    return dht.run_coroutine(functools.partial(_dialback_of_self, helpers=helpers, timeout=timeout))


# ---------------------------------------------------------------------------------------- which NAT
ECHO_MAGIC = b"ODEC"
_ECHO = struct.Struct(">4s4sH")  # magic, IPv4 address, port: what the echo saw of the connection
ECHO_TIMEOUT_S = 3.0


class NatKind(str, enum.Enum):
    """What the echoes saw of this machine's NAT (the value travels in round metadata)."""

    OPEN = "open"  # no NAT: the echo saw the local address and port
    CONE = "cone"  # endpoint-independent mapping (a home router): one public port for every destination
    SYMMETRIC = "symmetric"  # a new public port per destination: no punch can work through it
    UNKNOWN = "unknown"  # one echo only, and a changed port: it may be symmetric; no punch is counted on


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
    """The DHT key under which a run's echo servers are announced."""
    return run_key(run_id, "echo")


def parse_echoes(value: Any) -> list[tuple[str, int]]:
    """The echo servers in a DHT lookup's value of :func:`echo_key` (a dict of subkey -> entry)."""
    if not isinstance(value, dict):
        return []
    out = []
    for entry in value.values():
        try:
            ip, port = entry.value
            ipaddress.IPv4Address(ip)
            out.append((str(ip), int(port)))
        except (AttributeError, TypeError, ValueError):
            continue
    return sorted(set(out))


def reusable(sock: socket.socket) -> None:
    """Let ``sock`` share its local port: one port takes part in one connection per remote."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)


def reserve_ports(n: int, bind_host: str = "0.0.0.0") -> list[socket.socket]:
    """``n`` bound (not listening) placeholder sockets that keep their ports ours; close them to free them."""
    holders: list[socket.socket] = []
    try:
        for _ in range(n):
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holders.append(holder)
            reusable(holder)
            holder.bind((bind_host, 0))
    except OSError:
        for holder in holders:
            holder.close()
        raise
    return holders


def observe(local_port: int, echo: tuple[str, int], timeout: float = ECHO_TIMEOUT_S,
            bind_host: str = "0.0.0.0") -> tuple[str, int, str]:
    """The public ``(ip, port)`` a connection from ``local_port`` shows to ``echo`` (blocking), and
    the local address it left from."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        reusable(sock)
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


def nat_kind(send_port: int, recv_port: int, seen: Sequence[tuple], recv: tuple) -> NatKind:
    """The NAT's kind from the echoes: ``seen``, ``(ip, port, local ip)`` from ``send_port`` per
    echo; ``recv``, the same from ``recv_port`` to the first echo. ``open`` where the echo saw the
    local address and ports; ``symmetric`` where one port showed two mappings; ``unknown`` where
    one echo saw a changed port (a symmetric NAT's, maybe); else ``cone``."""
    ip, port, local_ip = seen[0]
    if ip == local_ip and port == send_port and recv[1] == recv_port:
        return NatKind.OPEN
    if len({(s[0], s[1]) for s in seen}) > 1:
        return NatKind.SYMMETRIC
    if len(seen) == 1 and (port != send_port or recv[1] != recv_port):
        return NatKind.UNKNOWN
    return NatKind.CONE


@dataclass(frozen=True)
class NatProbe:
    """What the echoes saw of two local ports (see :func:`probe_nat`)."""

    kind: NatKind
    send_seen: tuple[str, int]  # the public address of the first port, as the first echo saw it
    recv_seen: tuple[str, int]  # the same of the second port
    echoes: int  # how many echo servers answered the first port (2: the kind is certain)


def probe_nat(send_port: int, recv_port: int, echoes: Sequence[tuple[str, int]],
              bind_host: str = "0.0.0.0") -> NatProbe:
    """Ask up to two echo servers what ``send_port`` maps to, and the first what ``recv_port``
    does (blocking, a few round trips); ``ConnectionError`` where no echo answers."""
    seen, answered = [], []
    for echo in list(echoes)[:2]:
        try:
            seen.append(observe(send_port, echo, bind_host=bind_host))
            answered.append(echo)
        except OSError as e:
            logger.info("echo server %s:%d did not answer (%r)", *echo, e)
    if not seen:
        raise ConnectionError("no echo server answered")
    recv = observe(recv_port, answered[0], bind_host=bind_host)
    return NatProbe(nat_kind(send_port, recv_port, seen, recv), tuple(seen[0][:2]), tuple(recv[:2]), len(seen))
