"""One end of a hole punch between two peers behind NAT (tests/test_punch.py), no hivemind:

    python -m tests.support.punch_pair ROLE DIR ECHO_IP ECHO_PORT [--tamper]
    python -m tests.support.punch_pair echo DIR     # an echo server; writes its port to DIR/echo.port

``a`` (the sender) and ``b`` (the reducer) each learn their mapped ports from the echo server,
swap them through files in ``DIR`` (standing in for the round's metadata), punch at the same time
(``Puncher.dial``: a from its send port, b from its recv port) and, where that worked, ``a`` sends
one sealed contribution over the connection and ``b`` opens it. ``--tamper``: a flips one byte of
the sealed message before it goes out (a fake for an attacker on the path, which this topology
has no place for). Each writes ``DIR/<role>.result`` (JSON).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

from hivemind.proto import averaging_pb2

from opendiloco_stream.transport.hivemind.direct import read_message, write_end, write_message
from opendiloco_stream.transport.hivemind.protocol import CONTRIB, Message, frame_parts
from opendiloco_stream.net.reachability import EchoServer
from opendiloco_stream.transport.hivemind.punch import Puncher
from opendiloco_stream.transport.hivemind.seal import DirectSecurity, SealError

GROUP, PREFIX, SALT = bytes(range(32)), "punch_f0", b"p" * 16
PAYLOAD = bytes((i * 7) % 251 for i in range(200_000))


def _channel(end: str):
    return DirectSecurity().channel(GROUP, PREFIX, 0, 1, SALT, end)


async def _sealed_bytes(tamper: bool) -> bytes:
    """One sealed contribution as it goes on the wire (a byte flipped mid-ciphertext if asked)."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    msg = Message(averaging_pb2.PART_FOR_AVERAGING, b"gid", frame_parts(CONTRIB, 0, (PAYLOAD,)))
    await write_message(a, msg, _channel("sender"))
    a.close()
    raw = bytearray()
    while chunk := await asyncio.get_event_loop().sock_recv(b, 1 << 20):
        raw += chunk
    b.close()
    if tamper:
        raw[len(raw) // 2] ^= 1
    return bytes(raw)


async def _peer(role: str, workdir: Path, echo: tuple[str, int], tamper: bool) -> dict:
    puncher = Puncher.start([echo])
    if puncher is None:
        return {"punched": False, "error": "no echo"}
    (workdir / f"{role}.json").write_text(json.dumps(puncher.meta()))
    other = workdir / f"{'b' if role == 'a' else 'a'}.json"
    deadline = time.monotonic() + 30
    while not other.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    theirs = json.loads(other.read_text())
    out = {"kind": puncher.kind, "meta": puncher.meta()}
    local, remote = (puncher.send_port, theirs["recv"]) if role == "a" else (puncher.recv_port, theirs["send"])
    try:
        sock = await puncher.dial(local, remote, 8.0)
    except (OSError, asyncio.TimeoutError) as e:
        return {**out, "punched": False, "error": repr(e)}
    out.update(punched=True, local=list(sock.getsockname()), peer=list(sock.getpeername()))
    loop = asyncio.get_event_loop()
    try:
        if role == "a":
            try:
                await loop.sock_sendall(sock, await _sealed_bytes(tamper))
                await write_end(sock)
                await asyncio.wait_for(loop.sock_recv(sock, 1), 10)  # b closes once it has read
            except ConnectionError:
                pass  # b closed (punched sockets close with a reset) after a message that did not open
        else:
            try:
                msg = await asyncio.wait_for(read_message(sock, 1 << 20, _channel("reducer")), 10)
                out["opened"] = bytes(msg.buffer).endswith(PAYLOAD)
                out["end"] = await asyncio.wait_for(read_message(sock, 1 << 20, _channel("reducer")), 10) is None
            except SealError as e:
                out["seal_error"] = repr(e)
    finally:
        sock.close()
        puncher.close()
    return out


def main(argv: list[str]) -> int:
    role, workdir = argv[0], Path(argv[1])
    if role == "echo":
        server = EchoServer()
        (workdir / "echo.port.tmp").write_text(str(server.port))
        os.replace(workdir / "echo.port.tmp", workdir / "echo.port")
        time.sleep(float(argv[2]) if len(argv) > 2 else 120)
        return 0
    result = asyncio.run(_peer(role, workdir, (argv[2], int(argv[3])), "--tamper" in argv))
    (workdir / f"{role}.result").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
