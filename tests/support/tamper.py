"""A TCP proxy for the direct data path: it records both directions of every connection it carries
and can flip one byte of the first connection, on the way to the reducer (a contribution) or on
the way back (a reduced part). Used by tests/test_direct_seal.py:

    proxy = TamperProxy(("127.0.0.1", real_port))     # in the test process
    swarm.peers[2].call("call", function="tests.support.tamper:advertise", fragment=0, port=proxy.port)
    ... a round: peer 2's groupmates reach its data port through the proxy ...
    swarm.peers[2].call("call", function="tests.support.tamper:advertise", fragment=0, port=real_port)

A peer advertises its data address in the metadata of every round it joins (``FragmentEndpoint.metadata``),
so pointing it at the proxy or back takes effect from the next round on. Half-closes are passed
on: the direct path's sender ends its messages with ``shutdown(SHUT_WR)`` and the reducer waits for it.
"""

from __future__ import annotations

import socket
import threading
from typing import Optional

TO_REDUCER, TO_SENDER = "to-reducer", "to-sender"


# Functions a loopback peer runs (``peer.call("call", function="tests.support.tamper:NAME", ...)``).
def data_port(peer, fragment: int) -> int:
    """Inside a peer: the port its endpoint of ``fragment`` really listens on."""
    return peer.transport._lanes[fragment].endpoint.listener.port


def advertise(peer, fragment: int, port: int) -> None:
    """Inside a peer: advertise ``127.0.0.1:port`` as its data address from the next round on."""
    peer.transport._lanes[fragment].endpoint.listener.addresses = [["127.0.0.1", port]]


class TamperProxy:
    """Forwards every connection to ``target``; ``flip``: ``(direction, offset)`` to flip the byte
    at ``offset`` of that direction of the first connection (``TO_REDUCER`` / ``TO_SENDER``), or None."""

    def __init__(self, target: tuple[str, int], flip: Optional[tuple[str, int]] = None):
        self.target, self.flip = target, flip
        self.captured = {TO_REDUCER: bytearray(), TO_SENDER: bytearray()}
        self.flipped = 0  # bytes flipped so far
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._start(self._accept)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                index = self.connections
                self.connections += 1
            flip = self.flip if index == 0 else None
            pumps = [2]  # pumps still running on this connection: the last one closes both sockets
            self._start(self._pump, client, server, TO_REDUCER, flip, pumps)
            self._start(self._pump, server, client, TO_SENDER, flip, pumps)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, flip, pumps: list) -> None:
        offset = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if flip is not None and flip[0] == direction and offset <= flip[1] < offset + len(data):
                    data[flip[1] - offset] ^= 0x01
                    with self._lock:
                        self.flipped += 1
                offset += len(data)
                with self._lock:
                    self.captured[direction] += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:  # a reset: wake the other direction's recv (close alone would not)
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._lock:
            pumps[0] -= 1
            last = pumps[0] == 0
        if last:
            src.close()
            dst.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
