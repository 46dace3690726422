"""Direct TCP streams between the members of a group: a round's bulk bytes off the p2p daemon.

The p2p daemon (libp2p: encryption, multiplexing, a unix socket to each Python process and a
protobuf copy at each end) moved a 10M-element fp32 round at ~1/20 of what loopback carries and
cost more CPU than the reduction itself (docs/benchmarks.md, "Data plane"). So each reducing peer
also listens on a plain TCP port, advertised in the metadata gathered at matchmaking
(``direct: [[ip, port], ...]``), and a sender streams its contributions there; the results come
back on the same connection. Discovery, matchmaking and peer authentication stay on hivemind.

- *Who may connect.* The group id is drawn by the leader and reaches members only over hivemind's
  authenticated streams. A connection opens with a hello: a tag of the group (a hash of its id),
  the sender's index and HMAC-SHA256(group id; prefix, sender, reducer). The reducer serves it only
  if the MAC checks for that sender of that group (and the runner refuses a second stream of the
  same sender). The bytes are NOT encrypted on this path (p2pd's are): run with ``direct=False``
  where contributions must not be readable on the network.
- *Messages.* A little-endian uint32 length, then the ``AveragingData`` encoding of the message
  (``protocol.Message``): the frames, codes and byte counts of the p2p path.
- *Closing.* The sender shuts down its writing side after its last message; the reducer reads that
  end, writes its results and DONE and closes. TCP delivers what was written before a close, so
  the linger of the p2p path is not needed.
- *Fallback.* A sender that cannot open the connection within ``request_timeout`` (a peer behind
  NAT, a firewall) uses the p2p daemon for that exchange, and for later rounds to that address
  until a back-off ends (``FailedAddresses``: 30 s, doubling to 10 min); then it tries direct
  again. A connect that timed out once on a busy machine so does not keep a pair of peers on the
  slower daemon path for the rest of the run, and an address that never answers costs one
  ``request_timeout`` per back-off, not per round.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import socket
import struct
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from hivemind.proto import averaging_pb2

from opendiloco_stream.net.dht import NetError, ip4_of
from opendiloco_stream.transport.hivemind.protocol import DONE, Message, ProtocolError, frame_kind, parse_message

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sBH16s32s")  # magic, version, sender index, group tag, MAC
HELLO_MAGIC, HELLO_VERSION = b"ODDT", 1
_LENGTH = struct.Struct("<I")


# ---------------------------------------------------------------------------------------- hello
def group_tag(group_id: bytes) -> bytes:
    """What a hello says about its group: a hash, so the id itself never travels in the clear."""
    return hashlib.sha256(b"ods-direct-tag\0" + group_id).digest()[:16]


def hello_mac(group_id: bytes, prefix: str, sender: int, reducer: int) -> bytes:
    msg = b"ods-direct-v1\0" + prefix.encode() + b"\0" + struct.pack("<HH", sender, reducer)
    return hmac.new(group_id, msg, hashlib.sha256).digest()


def make_hello(group_id: bytes, prefix: str, sender: int, reducer: int) -> bytes:
    return _HELLO.pack(HELLO_MAGIC, HELLO_VERSION, sender, group_tag(group_id), hello_mac(group_id, prefix, sender, reducer))


def read_hello(data: bytes) -> tuple[bytes, int, bytes]:
    """``(group tag, sender index, MAC)``; ``ProtocolError`` for anything else."""
    if len(data) != _HELLO.size:
        raise ProtocolError(f"direct hello of {len(data)} bytes")
    magic, version, sender, tag, mac = _HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != HELLO_VERSION:
        raise ProtocolError(f"not a v{HELLO_VERSION} direct hello (magic {magic!r}, version {version})")
    return tag, sender, mac


def hello_is_valid(group_id: bytes, prefix: str, sender: int, reducer: int, mac: bytes) -> bool:
    return hmac.compare_digest(mac, hello_mac(group_id, prefix, sender, reducer))


# ---------------------------------------------------------------------------------------- addresses
def parse_address(value: Any) -> Optional[tuple[str, int]]:
    """A groupmate's advertised ``direct`` metadata -> its first usable ``(ip, port)`` (or None)."""
    if not isinstance(value, (list, tuple)):
        return None
    for entry in value:
        try:
            ip, port = entry
            if isinstance(port, int) and 0 < port < 65536 and ipaddress.ip_address(ip).version == 4:
                return str(ip), port
        except (TypeError, ValueError):
            continue
    return None


class FailedAddresses:
    """Reducer addresses a direct connection to failed, each blocked until its back-off ends.

    The first failure blocks an address for ``first_s``; each further failure without a success
    in between doubles that, up to ``max_s``. A success forgets the address."""

    def __init__(self, first_s: float = 30.0, max_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self._entries: dict[Any, tuple[float, float]] = {}  # address -> (blocked until, current back-off)

    def blocked(self, address: Any) -> bool:
        entry = self._entries.get(address)
        return entry is not None and self.clock() < entry[0]

    def failed(self, address: Any) -> float:
        """Record a failure; return how long the address is now blocked."""
        previous = self._entries.get(address)
        backoff = self.first_s if previous is None else min(2 * previous[1], self.max_s)
        self._entries[address] = (self.clock() + backoff, backoff)
        return backoff

    def succeeded(self, address: Any) -> None:
        self._entries.pop(address, None)

    def __len__(self) -> int:  # addresses remembered (blocked now or in a back-off that may double)
        return len(self._entries)


class DirectListener:
    """One averager's listening socket: bound in the host (so the port is known before the fork),
    served inside the averager process (:func:`serve_connections`)."""

    def __init__(self, bind_host: str, advertise: Sequence[str], port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind_host, port))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.addresses = [[ip, self.port] for ip in advertise]

    @classmethod
    def for_dht(cls, dht: Any, port: int = 0) -> Optional["DirectListener"]:
        """Listen where the DHT listens (127.0.0.1 stays local), advertise the IPv4 addresses it
        announces; None (p2p only) if it has none or the socket cannot be bound. ``port``: a
        fixed port (``net.data_port``); one that cannot be bound raises ``NetError`` with the fix."""
        hosts = [ip4_of(m) for m in (getattr(dht, "kwargs", {}).get("host_maddrs") or [])]
        bind = next((h for h in hosts if h), "0.0.0.0")
        visible = [ip for ip in dict.fromkeys(ip4_of(m) for m in dht.get_visible_maddrs()) if ip and ip != "0.0.0.0"]
        if ipaddress.ip_address(bind).is_loopback:
            visible = [ip for ip in visible if ipaddress.ip_address(ip).is_loopback] or [bind]
        if not visible:
            return None
        try:
            return cls(bind, visible, port)
        except OSError as e:
            if port:
                raise NetError(f"cannot listen on data port {port}/tcp ({e.strerror or e}): pick another "
                               f"net.data_port (--data-port), free it (ss -ltnp | grep :{port}), or use "
                               f"--no-direct") from None
            logger.warning("no direct data path (cannot listen on %s: %s); rounds use the p2p daemon", bind, e)
            return None

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------- messages
async def _recv_exactly(sock: socket.socket, n: int, eof_ok: bool = False) -> Optional[bytearray]:
    loop = asyncio.get_event_loop()
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            if got == 0 and eof_ok:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


async def read_message(sock: socket.socket, max_bytes: int) -> Optional[Message]:
    """The next message, or None at a clean end of stream."""
    head = await _recv_exactly(sock, _LENGTH.size, eof_ok=True)
    if head is None:
        return None
    (n,) = _LENGTH.unpack(head)
    if n > max_bytes:
        raise ProtocolError(f"direct message of {n} bytes (at most {max_bytes} expected)")
    return parse_message(await _recv_exactly(sock, n))


async def write_message(sock: socket.socket, msg: Any) -> None:
    loop = asyncio.get_event_loop()
    if isinstance(msg, Message):
        prefix = msg.pb_prefix()
        head, parts = _LENGTH.pack(len(prefix) + msg.nbytes) + prefix, list(msg.parts)
        while parts and len(parts[0]) <= 4096:  # small parts (a frame's head) go in one send with it
            head += bytes(parts.pop(0))
        await loop.sock_sendall(sock, head)
        for part in parts:  # a chunk's bytes, as they are
            await loop.sock_sendall(sock, part)
    else:  # a protobuf (test doubles may yield them)
        data = msg.SerializeToString()
        await loop.sock_sendall(sock, _LENGTH.pack(len(data)) + data)


def _configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle stall on a frame's tail


# ---------------------------------------------------------------------------------------- sender side
class DirectStream:
    """The sender's end of one exchange: writes ``outgoing`` in the background, yields the replies
    (the same interface as a hivemind stream: async iteration and ``aclose``)."""

    def __init__(self, sock: socket.socket, outgoing: AsyncIterator, max_bytes: int):
        self.sock, self.max_bytes = sock, max_bytes
        self._writer = asyncio.ensure_future(self._write(outgoing))

    @classmethod
    async def open(cls, address: tuple[str, int], hello: bytes, outgoing: Callable[[], AsyncIterator],
                   timeout: float, max_bytes: int) -> "DirectStream":
        """Connect and say hello; ``OSError`` or ``asyncio.TimeoutError`` if that cannot be done
        within ``timeout`` (the caller falls back to the p2p daemon)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            _configure(sock)
            loop = asyncio.get_event_loop()
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
            await asyncio.wait_for(loop.sock_sendall(sock, hello), timeout)
        except BaseException:
            sock.close()
            raise
        return cls(sock, outgoing(), max_bytes)

    async def _write(self, outgoing: AsyncIterator) -> None:
        try:
            async for msg in outgoing:
                await write_message(self.sock, msg)
        except (OSError, ProtocolError) as e:  # the reading side will see the broken connection
            logger.debug("direct stream: writing failed: %r", e)
        finally:
            try:
                self.sock.shutdown(socket.SHUT_WR)  # end of our messages: the reducer waits for it
            except OSError:
                pass
            await outgoing.aclose()

    def __aiter__(self) -> "DirectStream":
        return self

    async def __anext__(self) -> Message:
        msg = await read_message(self.sock, self.max_bytes)
        if msg is None:
            raise StopAsyncIteration
        return msg

    async def aclose(self) -> None:
        self._writer.cancel()
        try:
            await self._writer
        except BaseException:
            pass
        self.sock.close()


# ---------------------------------------------------------------------------------------- reducer side
class _Incoming:
    """A sender's messages on an accepted connection, as the async iterator ``runner.serve`` reads."""

    def __init__(self, sock: socket.socket, max_bytes: int):
        self.sock, self.max_bytes = sock, max_bytes

    def __aiter__(self) -> "_Incoming":
        return self

    async def __anext__(self) -> Message:
        msg = await read_message(self.sock, self.max_bytes)
        if msg is None:
            raise StopAsyncIteration
        return msg


class RunningGroups:
    """The averager's running groups (``_running_groups``: group id -> future of its runner) and a
    wake-up for the streams that wait for one. A groupmate's stream often arrives before our own
    round is registered (its BEGIN_ALLREDUCE came first, or this process is short of CPU): it waits
    for the registration itself, not on a poll (which added up to 20 ms to each early stream)."""

    def __init__(self, groups: dict):
        self.groups = groups
        self._changed: Optional[asyncio.Event] = None  # created by the first waiter, in the averager's loop

    def notify(self) -> None:
        """A group was registered (the averager calls this, in its loop)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def find(self, match: Callable[[Any], bool], deadline: float) -> Optional[Any]:
        """The id of the first running group that ``match``es, waiting until the loop's ``deadline``;
        None if none registered by then."""
        loop = asyncio.get_event_loop()
        while True:
            group_id = next((g for g in list(self.groups) if match(g)), None)
            remaining = deadline - loop.time()
            if group_id is not None or remaining <= 0:
                return group_id
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass


async def serve_connections(listener: DirectListener, groups: RunningGroups, prefix: str, wait_s: float) -> None:
    """Accept direct connections forever (the averager's task; cancel it to stop).

    A sender may connect before our own round is registered in ``groups``, so a hello waits for
    its group up to ``wait_s`` (the longest silence tolerated before a first contribution)."""
    loop = asyncio.get_event_loop()
    tasks: set = set()
    try:
        while True:
            sock, _ = await loop.sock_accept(listener.sock)
            _configure(sock)
            task = asyncio.ensure_future(_serve_connection(sock, groups, prefix, wait_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()


async def _serve_connection(sock: socket.socket, groups: RunningGroups, prefix: str, wait_s: float) -> None:
    loop = asyncio.get_event_loop()
    deadline = loop.time() + wait_s
    try:
        tag, sender, mac = read_hello(bytes(await asyncio.wait_for(_recv_exactly(sock, _HELLO.size), wait_s)))
        group_id = await groups.find(lambda g: group_tag(g) == tag, deadline)
        future = None if group_id is None else groups.groups.get(group_id)
        if future is None:
            await write_message(sock, Message(averaging_pb2.BAD_GROUP_ID, has_part=False))
            return
        try:
            runner = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except Exception:  # no runner (mismatching peers, shutting down): the sender fails too
            await write_message(sock, Message(averaging_pb2.INTERNAL_ERROR, has_part=False))
            return
        if not (0 <= sender < len(runner.peer_ids)) or not hello_is_valid(group_id, prefix, sender, runner.me, mac):
            logger.info("%s: refusing a direct connection with a bad hello (sender %d)", prefix, sender)
            await write_message(sock, Message(averaging_pb2.PROTOCOL_VIOLATION, has_part=False))
            return
        replies = runner.serve(_Incoming(sock, runner.max_message_bytes), runner.peer_ids[sender])
        try:
            async for msg in replies:
                await write_message(sock, msg)
                head = msg.parts[0] if isinstance(msg, Message) and msg.parts else msg.tensor_part.buffer
                if msg.code != averaging_pb2.AVERAGED_PART or frame_kind(head) == DONE:
                    break  # our last message: no linger on TCP (see the module docstring)
        finally:
            await replies.aclose()
    except (OSError, ProtocolError, asyncio.TimeoutError) as e:
        logger.info("%s: direct connection failed: %r", prefix, e)
    finally:
        sock.close()
