"""What a lone small segment after an idle gap costs a kept-open BBR connection at a distance.

    python -m benchmarks.harness.wan_bbr_idle [--rtt-ms 300] [--rate 5] [--modes bulk,runt,joined]

Two network namespaces of the WAN emulator (``wan_emulator.Regions.pair``), shaped to ``--rate``;
per mode, one TCP connection (BBR) kept open for ``--rounds`` exchanges ``--gap`` seconds apart
(more than BBR's 10-second min-RTT filter): the client sends a 72-byte hello and N bytes, the
server answers N bytes once it has them all, as a round of the direct path does. The server's
answer starts with:

- ``bulk``: N bytes in one send;
- ``runt``: 60 bytes in one send, then the rest (a message's head sent alone: the direct path
  before ``direct.JOIN_BYTES``);
- ``joined``: the 60 bytes and the rest in one send (``sendmsg``);
- ``ready``: the bulk in one send, and before it a 4-byte word of its own as soon as the hello
  arrived (a "ready" answer to the hello, tried and not kept).

Prints one JSON line per mode: the client's round times and, per round, the smallest congestion
window the server's socket showed while its answer drained (4: BBR's PROBE_RTT). The first round
is a new connection's slow start.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time

from benchmarks.harness import netns
from benchmarks.harness.wan_emulator import Regions

HELLO = 72
HEAD = 60
_CWND_AT, _BYTES_ACKED_AT = 80, 120  # struct tcp_info offsets (net/tcp.py)


def _recv_exactly(sock: socket.socket, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    got = 0
    while got < n:
        k = sock.recv_into(buf, min(len(buf), n - got))
        if k == 0:
            raise ConnectionError(f"closed after {got} of {n} bytes")
        got += k


def _bbr(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")


def server(port: int, mode: str, n: int, rounds: int) -> list[dict]:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(1)
    sock, _ = listener.accept()
    _bbr(sock)
    out = []
    for r in range(rounds):
        _recv_exactly(sock, HELLO)
        if mode == "ready":
            sock.sendall(b"RDY!")
        _recv_exactly(sock, n)
        t0 = time.monotonic()
        if mode == "runt":
            sock.sendall(b"h" * HEAD)
            sock.sendall(b"x" * (n - HEAD))
        elif mode == "joined":
            sock.sendmsg([b"h" * HEAD, b"x" * (n - HEAD)])
        else:
            sock.sendall(b"x" * n)
        smallest = 1 << 30
        while True:  # watch the window until the answer is acknowledged
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 168)
            smallest = min(smallest, struct.unpack_from("<I", raw, _CWND_AT)[0])
            answered = (r + 1) * (n + (4 if mode == "ready" else 0))
            if struct.unpack_from("<Q", raw, _BYTES_ACKED_AT)[0] >= answered:
                break
            time.sleep(0.005)
        out.append({"answer_acked_s": round(time.monotonic() - t0, 3), "smallest_cwnd": smallest})
    return out


def client(host: str, port: int, n: int, rounds: int, gap_s: float, mode: str) -> list[float]:
    sock = socket.create_connection((host, port))
    _bbr(sock)
    times = []
    for _ in range(rounds):
        t0 = time.monotonic()
        sock.sendall(b"h" * HELLO)
        sock.sendall(b"c" * n)
        _recv_exactly(sock, n + (4 if mode == "ready" else 0))
        times.append(round(time.monotonic() - t0, 3))
        time.sleep(gap_s)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", type=float, default=300.0)
    p.add_argument("--rate", type=float, default=5.0, help="Mbit/s each way")
    p.add_argument("--modes", default="bulk,runt,joined,ready")
    p.add_argument("--bytes", type=int, default=870_000, help="each way per round (a blocking fp32 round's half)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--gap", type=float, default=11.0, help="seconds idle between rounds")
    p.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "server":
        print(json.dumps(server(args.port, args.modes, args.bytes, args.rounds)), flush=True)
        return 0
    if args.role == "client":
        print(json.dumps(client(args.host, args.port, args.bytes, args.rounds, args.gap, args.modes)), flush=True)
        return 0
    me = [sys.executable, "-m", "benchmarks.harness.wan_bbr_idle", "--bytes", str(args.bytes),
          "--rounds", str(args.rounds), "--gap", str(args.gap)]
    with netns.Topology(2, regions=Regions.pair(args.rtt_ms), place={"boot": "a", "p0": "a", "p1": "b"}) as topo:
        topo.shape(args.rate)
        for i, mode in enumerate(args.modes.split(",")):
            port = 45000 + i
            srv = subprocess.Popen(topo.exec_argv("p1", [*me, "--role", "server", "--port", str(port), "--modes", mode]),
                                   stdout=subprocess.PIPE, text=True)
            time.sleep(1.0)
            cli = subprocess.Popen(topo.exec_argv("p0", [*me, "--role", "client", "--host", topo.ip("p1"),
                                                         "--port", str(port), "--modes", mode]),
                                   stdout=subprocess.PIPE, text=True)
            timeout = args.rounds * (args.gap + 30)
            rounds = json.loads(cli.communicate(timeout=timeout)[0])
            answers = json.loads(srv.communicate(timeout=60)[0])
            print(json.dumps({"mode": mode, "rtt_ms": args.rtt_ms, "rate_mbit": args.rate, "round_s": rounds,
                              "server": answers}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
