"""Probes of an emulated link between two nodes of a :class:`benchmarks.harness.netns.Topology`.

Small Python programs run inside the nodes' namespaces (no ping or iperf is installed here):

- :func:`measure_rtt`: ICMP echo round trips (a ping, sent from a raw socket): the emulated
  link's round trip, timed by the kernel at the far end.
- :func:`measure_udp`: datagrams paced at a fixed rate one way; how many arrive (the loss rate,
  and the emulator's ceiling: the highest rate at which none is lost).
- :func:`measure_tcp`: one TCP bulk stream with fixed socket buffers (so the window, not
  autotuning, decides what is in flight); goodput from the receiver's first byte to its last.

Each returns a plain dict of what it measured; the caller checks or tabulates it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

from benchmarks.harness.netns import Topology

_PING = r"""
import json, os, socket, struct, sys, time
host, count, interval, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(wait)
s.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS: the reply's arrival as the kernel saw it
ident = os.getpid() & 0xFFFF

def checksum(b):
    total = sum(struct.unpack(f"!{len(b) // 2}H", b))
    total = (total >> 16) + (total & 0xFFFF); total += total >> 16
    return ~total & 0xFFFF

rtts = []
for seq in range(count):
    body = struct.pack("!HH", ident, seq) + b"\0" * 56
    packet = struct.pack("!BBH", 8, 0, checksum(struct.pack("!BBH", 8, 0, 0) + body)) + body
    sent = time.time(); s.sendto(packet, (host, 0))
    while True:
        try:
            data, anc, _, _ = s.recvmsg(2048, 64)
        except socket.timeout:
            break
        icmp = data[(data[0] & 0x0F) * 4:]
        if icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (ident, seq):
            stamp = next((a + b * 1e-9 for lvl, kind, d in anc if kind == 35 for a, b in [struct.unpack("qq", d[:16])]),
                         time.time())
            rtts.append((stamp - sent) * 1e3); break
    time.sleep(interval)
print(json.dumps(rtts))
"""

_UDP_SINK = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: the probe must not be what drops
s.bind((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
s.settimeout(float(sys.argv[2])); n = nbytes = 0; first = last = None
try:
    while True:  # timed from the second datagram: the first one is the source's ARP warm-up
        data = s.recv(65536); last = time.perf_counter(); n += 1
        if n == 2: first = last
        if n >= 2: nbytes += len(data)
        s.settimeout(1.0)
except socket.timeout:
    pass
print(json.dumps({"received": n, "bytes": nbytes, "seconds": (last - first) if n > 2 else 0.0}))
"""

_UDP_SOURCE = r"""
import json, socket, sys, time
host, port, mbit, seconds, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((host, port))
s.setsockopt(socket.SOL_SOCKET, 32, 64 << 20)  # SO_SNDBUFFORCE
payload, gap = b"\x5a" * size, size * 8 / (mbit * 1e6)
s.send(payload); time.sleep(float(sys.argv[6]))  # one datagram resolves ARP: the kernel drops what waits on it
t0, sent = time.perf_counter(), 0
while True:
    now = time.perf_counter()
    if now - t0 >= seconds:
        break
    due = int((now - t0) / gap) + 1  # paced by the clock: catch up in bursts after a stall
    while sent < due:
        s.send(payload); sent += 1
    time.sleep(min(gap * 8, 0.002))
print(json.dumps({"sent": sent + 1, "seconds": time.perf_counter() - t0}))
"""

_TCP_SINK = r"""
import json, socket, sys, time
buf = int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if buf: s.setsockopt(socket.SOL_SOCKET, 33, buf)  # SO_RCVBUFFORCE, inherited by the accepted socket
s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(float(sys.argv[2])); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[2])); got, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b: break
    first = first or time.perf_counter(); got += len(b)
dt = time.perf_counter() - first
print(json.dumps({"bytes": got, "seconds": dt, "mbit_s": got * 8 / dt / 1e6,
                  "rcvbuf": c.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)}))
"""

_TCP_SOURCE = r"""
import socket, sys
buf = int(sys.argv[4])
c = socket.socket()
if buf: c.setsockopt(socket.SOL_SOCKET, 32, buf)  # SO_SNDBUFFORCE
c.settimeout(float(sys.argv[5])); c.connect((sys.argv[1], int(sys.argv[2])))
n, chunk = int(sys.argv[3]), b"\x5a" * (1 << 20)
while n > 0:
    c.sendall(chunk[:min(n, len(chunk))]); n -= min(n, len(chunk))
c.close()
"""


def _server(topo: Topology, node: str, script: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start ``script`` in ``node``; it prints its port first."""
    proc = subprocess.Popen(topo.exec_argv(node, [sys.executable, "-c", script, *args]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = proc.stdout.readline().strip()
    if not port.isdigit():
        proc.kill()
        raise RuntimeError(f"probe server in {node} failed: {proc.stderr.read()[-500:]}")
    return proc, port


def _client(topo: Topology, node: str, script: str, *args: str, timeout: float) -> str:
    r = subprocess.run(topo.exec_argv(node, [sys.executable, "-c", script, *args]), capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"probe client in {node} failed: {r.stderr[-500:]}")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    return out.strip().splitlines()[-1] if out.strip() else ""


def measure_rtt(topo: Topology, src: str, dst: str, count: int = 40, interval: float = 0.02,
                wait: Optional[float] = None) -> dict[str, Any]:
    """``count`` ICMP echoes from ``src`` to ``dst`` (a ping): median, spread and how many came back.

    The reply comes from ``dst``'s kernel and its arrival is the kernel's receive timestamp, so no
    process but the forwarder has to wake up in time: what is measured is the emulated link. The
    first echo also pays for ARP (one extra round trip on a fresh topology) and is left out.
    ``wait``: how long each echo waits for its reply (default: 2 s + 4 RTT)."""
    wait = 2.0 + topo.rtt_ms(src, dst) / 1e3 * 4 if wait is None else wait
    rtts = json.loads(_client(topo, src, _PING, topo.ip(dst), str(count + 1), str(interval), str(wait),
                              timeout=(count + 1) * (interval + wait) + 30))[1:]
    ordered = sorted(rtts) or [float("nan")]
    return {"count": count, "replies": len(rtts), "median_ms": statistics.median(ordered), "min_ms": ordered[0],
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "max_ms": ordered[-1]}


def measure_udp(topo: Topology, src: str, dst: str, mbit: float, seconds: float = 2.0,
                size: int = 1400) -> dict[str, Any]:
    """Datagrams of ``size`` bytes from ``src`` to ``dst`` paced at ``mbit`` for ``seconds``: how many arrived.

    One datagram goes first, and the rest wait a round trip for it: until ARP has resolved ``dst``,
    the kernel keeps only a few datagrams and drops the rest, which would count as the link's loss."""
    sink, port = _server(topo, dst, _UDP_SINK, topo.ip(dst), str(seconds + 10 + 3 * topo.rtt_ms(src, dst) / 1e3))
    try:
        warm = 2 * topo.rtt_ms(src, dst) / 1e3 + 0.2
        sent = json.loads(_client(topo, src, _UDP_SOURCE, topo.ip(dst), port, f"{mbit:g}", f"{seconds:g}", str(size),
                                  f"{warm:g}", timeout=seconds + warm + 30))
        got = json.loads(_finish(sink, seconds + 30))
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(5)
    offered = sent["sent"] * size * 8 / sent["seconds"] / 1e6
    return {**sent, **got, "offered_mbit_s": offered, "lost_fraction": 1 - got["received"] / max(1, sent["sent"]),
            "received_mbit_s": got["bytes"] * 8 / got["seconds"] / 1e6 if got["seconds"] else 0.0}


def measure_tcp(topo: Topology, src: str, dst: str, nbytes: int, buffer: int, timeout: float = 120.0) -> dict[str, Any]:
    """One TCP stream of ``nbytes`` from ``src`` to ``dst`` with ``buffer``-byte socket buffers each side
    (0: the kernel's autotuning); the receiver's goodput from its first byte to its last."""
    sink, port = _server(topo, dst, _TCP_SINK, topo.ip(dst), str(timeout), str(buffer))
    try:
        t0 = time.monotonic()
        _client(topo, src, _TCP_SOURCE, topo.ip(dst), port, str(nbytes), str(buffer), str(timeout), timeout=timeout)
        result = json.loads(_finish(sink, timeout))
        result["wall_s"] = time.monotonic() - t0
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(5)
    return result
