"""Direct TCP streams between the members of a group: a round's bulk bytes off the p2p daemon.

The p2p daemon (libp2p: encryption, multiplexing, a unix socket to each Python process and a
protobuf copy at each end) moved a 10M-element fp32 round at ~1/20 of what loopback carries and
cost more CPU than the reduction itself (docs/benchmarks.md, "Data plane"). So each reducing peer
also listens on a TCP port of its own, advertised in the metadata gathered at matchmaking
(``direct: [[ip, port], ...]``), and a sender streams its contributions there; the results come
back on the same connection. Discovery, matchmaking and peer authentication stay on hivemind.

- *Who may connect.* The group id is drawn by the leader and reaches members only over hivemind's
  authenticated streams. A connection opens with a hello: a tag of the group (a hash of its id),
  the sender's index, whether it seals, a random salt and an HMAC of all that under the group
  secret (the group id, and the run key when there is one: ``seal.py``). The reducer serves it only
  if the MAC checks for that sender of that group (and the runner refuses a second stream of the
  same sender). A sealing peer and a ``--direct-plaintext`` one refuse each other.
- *Messages.* Sealed (the default, ``seal.py``): a little-endian uint32 length, then the AES-256-GCM
  ciphertext of the ``AveragingData`` encoding of the message (``protocol.Message``: the frames,
  codes and byte counts of the p2p path) and its tag; a message that does not open fails the
  exchange (``SealError``). Plaintext: the length, then the encoding itself. Before a connection
  has keys (no such group, a bad hello), a reducer can only answer with a *notice*: an error code,
  unsealed, flagged in the length's top bit; it can fail an exchange, never carry data.
- *Closing, and keeping open.* The sender ends its messages with an *end* word (a length of
  ``END``, unsealed); the reducer reads it, writes its results and DONE. The connection then stays
  open for the next round between the two (a new hello, new keys): a connection kept open costs
  no handshake (one round trip) per round, and keeps the window it grew where the kernel lets it
  (``net.ipv4.tcp_slow_start_after_idle = 0``, or a congestion control that never restarts it:
  each connection switches itself to BBR where the kernel restarts others and lets any process
  choose BBR, ``net.tcp.keep_window``). The sender keeps it in its ``ConnectionPool``
  only after a clean exchange (DONE read), and checks it is still open before reusing it; a
  reducer waits ``IDLE_S`` for the next hello, then closes. Each side knows how many messages to
  expect, so a connection cut short reads as a broken exchange, never as a shorter one.
- *Fallback.* A sender that cannot open the connection within ``request_timeout`` (a peer behind
  NAT, a firewall) uses the p2p daemon for that exchange, and for later rounds to that address
  until a back-off ends (``FailedAddresses``: 30 s, doubling to 10 min); then it tries direct
  again. A connect that timed out once on a busy machine so does not keep a pair of peers on the
  slower daemon path for the rest of the run, and an address that never answers costs one
  ``request_timeout`` per back-off, not per round.
- *Behind NAT.* A reducer with no address of its own (``--relay``) is reached over a connection
  both sides open at once (hole punching, ``punch.py``): the same hello, sealing and pool, only
  the connect differs (``DirectStream.open(connect=...)``, ``serve_accepted``).
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
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, Optional, Sequence

from hivemind.proto import averaging_pb2

from opendiloco_stream.net.dht import NetError, ip4_of
from opendiloco_stream.net.tcp import TcpInfo, keep_window, tcp_info
from opendiloco_stream.transport.hivemind.protocol import DONE, Message, ProtocolError, frame_kind, parse_message
from opendiloco_stream.transport.hivemind.seal import TAG_BYTES, Channel, DirectSecurity

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sBBH16s16s32s")  # magic, version, flags, sender index, group tag, salt, MAC
_HELLO_HEAD = struct.Struct("<4sB")  # magic, version: read first, so another version is named as such
HELLO_MAGIC, HELLO_VERSION = b"ODDT", 3  # 3: kept-open connections, END; 2: sealed messages (seal.py)
FLAG_PLAINTEXT = 1
_LENGTH = struct.Struct("<I")
NOTICE = 1 << 31  # in a length: an unsealed error notice follows (see the module docstring)
END = 0xFFFFFFFF  # a length word alone: the sender's last message of this round (the connection stays open)
IDLE_S = 300.0  # a reducer closes a kept-open connection with no new hello for this long
POOL_IDLE_S = 120.0  # a sender reuses a connection idle for less than this (well below IDLE_S)
OFF_LOOP_BYTES = 256 << 10  # messages from this size on are sealed and opened on a thread
# A message's head (length, protobuf prefix, frame head: tens of bytes) goes out with this much of
# the bytes that follow, in one send. Sent alone after an idle gap it is a lone small segment whose
# ACK the kernel takes for a delayed one ("maybe delayed"): BBR then ignores that RTT sample, its
# restart-after-idle guard ends with that ACK, and the next ACK, with BBR's 10-second min-RTT filter
# expired (a fragment's rounds are further apart), puts the connection in PROBE_RTT (4 segments in
# flight for 200 ms and a round trip) in the middle of the round's bulk: +0.54 s per exchange at
# 300 ms in the emulator (docs/benchmarks-wan.md, "A round at its transfer + 4 RTT by default").
JOIN_BYTES = 64 << 10


# ---------------------------------------------------------------------------------------- hello
class HelloVersionError(ProtocolError):
    """A hello of another version of the direct path: peers of different releases in one run."""


class Hello(NamedTuple):
    """What a connection's first bytes say: group tag, sender index, flags, salt, MAC (see ``make_hello``)."""

    tag: bytes
    sender: int
    flags: int
    salt: bytes
    mac: bytes

    @property
    def plaintext(self) -> bool:
        return bool(self.flags & FLAG_PLAINTEXT)


def group_tag(group_id: bytes) -> bytes:
    """What a hello says about its group: a hash, so the id itself never travels in the clear."""
    return hashlib.sha256(b"ods-direct-tag\0" + group_id).digest()[:16]


def make_hello(security: DirectSecurity, group_id: bytes, prefix: str, sender: int, reducer: int,
               salt: bytes) -> bytes:
    flags = FLAG_PLAINTEXT if security.plaintext else 0
    return _HELLO.pack(HELLO_MAGIC, HELLO_VERSION, flags, sender, group_tag(group_id), salt,
                       security.hello_mac(group_id, prefix, sender, reducer, flags, salt))


def check_hello_head(data: bytes) -> None:
    """``ProtocolError`` unless ``data`` (the hello's first bytes) opens a hello of our version."""
    magic, version = _HELLO_HEAD.unpack(data[:_HELLO_HEAD.size])
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"not a direct hello (magic {magic!r})")
    if version != HELLO_VERSION:
        raise HelloVersionError(f"a v{version} direct hello; this peer speaks v{HELLO_VERSION}: run the same "
                                f"opendiloco-stream version on every peer")


def read_hello(data: bytes) -> Hello:
    """The fields of a hello; ``ProtocolError`` for anything else."""
    if len(data) != _HELLO.size:
        raise ProtocolError(f"direct hello of {len(data)} bytes")
    check_hello_head(data)
    _magic, _version, flags, sender, tag, salt, mac = _HELLO.unpack(data)
    return Hello(tag, sender, flags, salt, mac)


def hello_is_valid(security: DirectSecurity, group_id: bytes, prefix: str, reducer: int, hello: Hello) -> bool:
    expected = security.hello_mac(group_id, prefix, hello.sender, reducer, hello.flags, hello.salt)
    return hmac.compare_digest(hello.mac, expected)


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

    def blocked_now(self) -> list:
        """The addresses blocked at this moment, sorted."""
        now = self.clock()
        return sorted(a for a, (until, _) in self._entries.items() if now < until)

    def __len__(self) -> int:  # addresses remembered (blocked now or in a back-off that may double)
        return len(self._entries)


class DirectListener:
    """One fragment endpoint's listening socket (bound in a trainer thread, so the port is known
    before any round), served on the averaging service's loop (:func:`serve_connections`)."""

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


async def read_message(sock: socket.socket, max_bytes: int, channel: Optional[Channel] = None) -> Optional[Message]:
    """The next message, or None at a clean end of stream; ``channel``: open it (sealed path)."""
    head = await _recv_exactly(sock, _LENGTH.size, eof_ok=True)
    if head is None:
        return None
    (n,) = _LENGTH.unpack(head)
    if n == END:
        return None
    if n & NOTICE:
        size = n & ~NOTICE
        if size > 64:
            raise ProtocolError(f"an unsealed notice of {size} bytes")
        return _notice(bytes(await _recv_exactly(sock, size)))
    if n > max_bytes + TAG_BYTES:
        raise ProtocolError(f"direct message of {n} bytes (at most {max_bytes} expected)")
    body = await _recv_exactly(sock, n)
    if channel is not None:
        body = await _off_loop(n, channel.opener.open, body, bytes(head))
    return parse_message(body)


async def _off_loop(nbytes: int, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``: sealing or opening a large message on an executor thread (AES-GCM releases
    the GIL), so the loop goes on reading and writing the round's other streams meanwhile; a
    small one here, where a thread hop would cost more than the work. One connection's messages
    are still sealed and opened one at a time, in order: each call is awaited before the next."""
    if nbytes < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_event_loop().run_in_executor(None, fn, *args)


def _notice(body: bytes) -> Message:
    msg = parse_message(body) if body else Message(0, has_part=False)
    if msg.has_part or msg.code in (averaging_pb2.PART_FOR_AVERAGING, averaging_pb2.AVERAGED_PART):
        raise ProtocolError("an unsealed notice that is not an error code")
    return msg


async def write_end(sock: socket.socket, lead: bytes = b"") -> None:
    """The end of this round's messages from the sender (the connection stays open); ``lead``:
    bytes that go out first, in the same send (a hello not sent yet)."""
    await asyncio.get_event_loop().sock_sendall(sock, lead + _LENGTH.pack(END))


async def write_notice(sock: socket.socket, code: int) -> None:
    """An error code, unsealed: what a reducer answers before the connection has keys."""
    body = Message(code, has_part=False).pb_prefix()
    await asyncio.get_event_loop().sock_sendall(sock, _LENGTH.pack(NOTICE | len(body)) + body)


async def write_message(sock: socket.socket, msg: Any, channel: Optional[Channel] = None, lead: bytes = b"") -> None:
    """Write one message; ``channel``: sealed (the frame's parts encrypted one by one, not joined);
    ``lead``: bytes that go out first, in the same send as the message's head (a sender's hello)."""
    loop = asyncio.get_event_loop()
    if isinstance(msg, Message):
        prefix, parts = msg.pb_prefix(), list(msg.parts)
    else:  # a protobuf (test doubles may yield them)
        prefix, parts = msg.SerializeToString(), []
    n = len(prefix) + sum(len(p) for p in parts)
    if channel is not None:
        head = _LENGTH.pack(n + TAG_BYTES)
        parts = await _off_loop(n, channel.sealer.seal, [prefix, *parts], head)
        prefix = b""
    else:
        head = _LENGTH.pack(n)
    head = lead + head + prefix
    while parts and len(parts[0]) <= 4096:  # small parts (a frame's head) go in one send with it
        head += bytes(parts.pop(0))
    if parts:  # and the first bytes of the next: never a lone small segment ahead of a message's bulk
        first = memoryview(parts[0]).cast("B")
        head += first[:JOIN_BYTES]
        parts[0] = first[JOIN_BYTES:]
    await loop.sock_sendall(sock, head)
    for part in parts:  # a chunk's bytes, as they are (or as sealed)
        await loop.sock_sendall(sock, part)


def _configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle stall on a frame's tail
    keep_window(sock)  # no slow start after each idle gap between rounds, where the kernel lets us


def is_open(sock: socket.socket) -> bool:
    """Whether a kept-open connection can carry another exchange: not closed by the other side,
    and nothing unread on it (an idle connection has nothing to read)."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # b"": closed by the reducer; data: out of step with the protocol


class ConnectionPool:
    """A sender's connections kept open to reducers' addresses between rounds (see the module
    docstring): ``take`` one still open (or None), ``give`` it back after a clean exchange."""

    def __init__(self, idle_s: float = POOL_IDLE_S, clock: Callable[[], float] = time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self._idle: dict[Any, list[tuple[socket.socket, float]]] = {}
        self.opened = self.reused = 0  # connections made, and exchanges that reused one

    def take(self, address: Any) -> Optional[socket.socket]:
        entries = self._idle.get(address, [])
        while entries:
            sock, since = entries.pop()
            if self.clock() - since < self.idle_s and is_open(sock):
                self.reused += 1
                return sock
            sock.close()
        return None

    def give(self, address: Any, sock: socket.socket) -> None:
        self._idle.setdefault(address, []).append((sock, self.clock()))

    def close(self) -> None:
        for entries in self._idle.values():
            for sock, _ in entries:
                sock.close()
        self._idle.clear()


# ---------------------------------------------------------------------------------------- sender side
class DirectStream:
    """The sender's end of one exchange: writes ``outgoing`` in the background, yields the replies
    (the same interface as a hivemind stream: async iteration and ``aclose``). A clean exchange
    (our END written, the reducer's DONE read) gives the connection back to ``pool``."""

    def __init__(self, sock: socket.socket, outgoing: AsyncIterator, max_bytes: int, channel: Optional[Channel] = None,
                 pool: Optional[ConnectionPool] = None, address: Any = None, reused: bool = False, hello: bytes = b""):
        self.sock, self.max_bytes, self.channel = sock, max_bytes, channel
        self.pool, self.address, self.reused = pool, address, reused
        self.connect_s: Optional[float] = None  # the TCP handshake's time (one round trip), if we made one
        self._done_read = self._end_written = False
        self._hello = hello  # written with our first message (see JOIN_BYTES)
        self._writer = asyncio.ensure_future(self._write(outgoing))

    @classmethod
    async def open(cls, address: tuple[str, int], hello: bytes, outgoing: Callable[[], AsyncIterator],
                   timeout: float, max_bytes: int, channel: Optional[Channel] = None,
                   pool: Optional[ConnectionPool] = None, buffers: Callable[[socket.socket], Any] = None,
                   connect: Optional[Callable[[], Awaitable[socket.socket]]] = None) -> "DirectStream":
        """Connect (or take a kept-open connection from ``pool``); ``OSError`` or
        ``asyncio.TimeoutError`` if that cannot be done within ``timeout`` (the caller falls back to
        the p2p daemon). The hello goes out with the first message, in the same send (``JOIN_BYTES``).
        ``channel``: the sender's end of the sealed connection the hello announces (None: plaintext). ``buffers(sock)``: sizes a new socket's buffers before it connects.
        ``connect()``: opens the connection instead of a plain connect to ``address`` (a punched
        one, ``punch.py``; ``address`` then only names it in ``pool``)."""
        loop = asyncio.get_event_loop()
        sock = pool.take(address) if pool is not None else None
        reused, connect_s = sock is not None, None
        try:
            if sock is None and connect is not None:
                t0 = loop.time()
                sock = await connect()
                _configure(sock)
                connect_s = loop.time() - t0
                if pool is not None:
                    pool.opened += 1
            elif sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _configure(sock)
                if buffers is not None:
                    buffers(sock)
                t0 = loop.time()
                await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
                connect_s = loop.time() - t0
                if pool is not None:
                    pool.opened += 1
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        stream = cls(sock, outgoing(), max_bytes, channel, pool, address, reused, hello)
        stream.connect_s = connect_s
        return stream

    async def _write(self, outgoing: AsyncIterator) -> None:
        try:
            async for msg in outgoing:
                await write_message(self.sock, msg, self.channel, lead=self._hello)
                self._hello = b""
            await write_end(self.sock, lead=self._hello)  # end of our messages: the reducer waits for it
            self._hello = b""
            self._end_written = True
        except (OSError, ProtocolError) as e:  # the reading side will see the broken connection
            logger.debug("direct stream: writing failed: %r", e)
        finally:
            await outgoing.aclose()

    def __aiter__(self) -> "DirectStream":
        return self

    async def __anext__(self) -> Message:
        msg = await read_message(self.sock, self.max_bytes, self.channel)
        if msg is None:
            raise StopAsyncIteration
        if msg.code == averaging_pb2.AVERAGED_PART and msg.parts and frame_kind(msg.parts[0]) == DONE:
            self._done_read = True
        return msg

    def tcp_info(self) -> Optional[TcpInfo]:
        """The kernel's measurements of this connection (``net/tcp.py``)."""
        return tcp_info(self.sock)

    async def aclose(self) -> None:
        clean = self._done_read and self._writer.done() and not self._writer.cancelled() and self._end_written
        self._writer.cancel()
        try:
            await self._writer
        except BaseException:
            pass
        if clean and self.pool is not None:
            self.pool.give(self.address, self.sock)
        else:
            self.sock.close()


# ---------------------------------------------------------------------------------------- reducer side
class _Incoming:
    """A sender's messages on an accepted connection, as the async iterator ``runner.serve`` reads."""

    def __init__(self, sock: socket.socket, max_bytes: int, channel: Optional[Channel]):
        self.sock, self.max_bytes, self.channel = sock, max_bytes, channel

    def __aiter__(self) -> "_Incoming":
        return self

    async def __anext__(self) -> Message:
        msg = await read_message(self.sock, self.max_bytes, self.channel)
        if msg is None:
            raise StopAsyncIteration
        return msg


class RunningGroups:
    """An endpoint's running groups (group id -> future of its runner) and a
    wake-up for the streams that wait for one. A groupmate's stream often arrives before our own
    round is registered (its BEGIN_ALLREDUCE came first, or this process is short of CPU): it waits
    for the registration itself, not on a poll (which added up to 20 ms to each early stream)."""

    def __init__(self, groups: dict):
        self.groups = groups
        self._changed: Optional[asyncio.Event] = None  # created by the first waiter, in the service's loop

    def notify(self) -> None:
        """A group was registered (the endpoint calls this, in the service's loop)."""
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


async def serve_connections(listener: DirectListener, groups: RunningGroups, prefix: str, wait_s: float,
                             security: Optional[DirectSecurity] = None) -> None:
    """Accept direct connections forever (the endpoint's task; cancel it to stop).

    A sender may connect before our own round is registered in ``groups``, so a hello waits for
    its group up to ``wait_s`` (the longest silence tolerated before a first contribution).
    ``security``: how connections are protected (default: sealed, no run key)."""
    loop = asyncio.get_event_loop()
    security = security or DirectSecurity()
    tasks: set = set()
    try:
        while True:
            sock, _ = await loop.sock_accept(listener.sock)
            _configure(sock)
            task = asyncio.ensure_future(_serve_connection(sock, groups, prefix, wait_s, security))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        for task in tasks:
            task.cancel()


async def serve_accepted(sock: socket.socket, groups: RunningGroups, prefix: str, wait_s: float,
                         security: DirectSecurity) -> None:
    """Serve a connection opened otherwise than by our listener (a punched one, ``punch.py``)
    exactly as an accepted one: its exchanges, one per hello, until it closes."""
    _configure(sock)
    await _serve_connection(sock, groups, prefix, wait_s, security)


async def _read_hello(sock: socket.socket, wait_s: float, idle_s: Optional[float] = None) -> Optional[Hello]:
    """The next hello; ``idle_s``: a kept-open connection's wait for its first byte (None at a clean
    close, or after ``idle_s`` without one)."""
    if idle_s is not None:
        try:
            first = await asyncio.wait_for(_recv_exactly(sock, 1, eof_ok=True), idle_s)
        except asyncio.TimeoutError:
            return None
        if first is None:
            return None
        rest = await asyncio.wait_for(_recv_exactly(sock, _HELLO_HEAD.size - 1), wait_s)
        head = bytes(first) + bytes(rest)
    else:
        head = bytes(await asyncio.wait_for(_recv_exactly(sock, _HELLO_HEAD.size), wait_s))
    check_hello_head(head)  # another version is named before we wait for bytes it may never send
    return read_hello(head + bytes(await asyncio.wait_for(_recv_exactly(sock, _HELLO.size - len(head)), wait_s)))


async def _runner_for(sock: socket.socket, groups: RunningGroups, hello: Hello, deadline: float) -> tuple:
    """``(group id, runner)`` of the group the hello names, or None after answering why not."""
    loop = asyncio.get_event_loop()
    group_id = await groups.find(lambda g: group_tag(g) == hello.tag, deadline)
    future = None if group_id is None else groups.groups.get(group_id)
    if future is None:
        await write_notice(sock, averaging_pb2.BAD_GROUP_ID)
        return None
    try:
        runner = await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
    except Exception:  # no runner (mismatching peers, shutting down): the sender fails too
        await write_notice(sock, averaging_pb2.INTERNAL_ERROR)
        return None
    return group_id, runner


async def _serve_connection(sock: socket.socket, groups: RunningGroups, prefix: str, wait_s: float,
                            security: DirectSecurity) -> None:
    """One sender's connection: an exchange per hello, as long as each ends cleanly."""
    try:
        idle_s = None  # the first hello follows the connect at once
        while await _serve_exchange(sock, groups, prefix, wait_s, security, idle_s):
            idle_s = IDLE_S
    finally:
        sock.close()


async def _serve_exchange(sock: socket.socket, groups: RunningGroups, prefix: str, wait_s: float,
                          security: DirectSecurity, idle_s: Optional[float]) -> bool:
    """Serve one hello's exchange; True if it ended cleanly (the connection may carry another)."""
    loop = asyncio.get_event_loop()
    try:
        hello = await _read_hello(sock, wait_s, idle_s)
        if hello is None:
            return False
        deadline = loop.time() + wait_s
        found = await _runner_for(sock, groups, hello, deadline)
        if found is None:
            return False
        group_id, runner = found
        if not (0 <= hello.sender < len(runner.peer_ids)) or not hello_is_valid(security, group_id, prefix,
                                                                                 runner.me, hello):
            logger.info("%s: refusing a direct connection with a bad hello (sender %d)", prefix, hello.sender)
            await write_notice(sock, averaging_pb2.PROTOCOL_VIOLATION)
            return False
        if hello.plaintext != security.plaintext:
            logger.warning("%s: refusing a direct connection from %s: it %s and this peer %s; set "
                           "--direct-plaintext on every peer or on none", prefix, runner.peer_ids[hello.sender],
                           *(("sends in plaintext", "seals") if hello.plaintext else ("seals", "sends in plaintext")))
            await write_notice(sock, averaging_pb2.PROTOCOL_VIOLATION)
            return False
        channel = security.channel(group_id, prefix, hello.sender, runner.me, hello.salt, "reducer")
        return await _serve_sender(sock, runner, hello.sender, channel)
    except HelloVersionError as e:
        logger.warning("%s: refusing a direct connection: %s", prefix, e)
    except (OSError, ProtocolError, asyncio.TimeoutError) as e:
        logger.info("%s: direct connection failed: %r", prefix, e)
    return False


async def _serve_sender(sock: socket.socket, runner: Any, sender: int, channel: Optional[Channel]) -> bool:
    """Hand the sender's messages to the runner, write its replies back; True if DONE went out
    (the sender's END was read before: the connection is between two exchanges)."""
    replies = runner.serve(_Incoming(sock, runner.max_message_bytes, channel), runner.peer_ids[sender])
    try:
        async for msg in replies:
            await write_message(sock, msg, channel)
            head = msg.parts[0] if isinstance(msg, Message) and msg.parts else msg.tensor_part.buffer
            if msg.code != averaging_pb2.AVERAGED_PART:
                return False
            if frame_kind(head) == DONE:
                return True  # our last message
        return False
    finally:
        await replies.aclose()
