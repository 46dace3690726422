"""An emulated wide-area network on one machine: network namespaces, veth pairs, a bridge, ``tc tbf``.

    topo = Topology(peers=2)          # namespaces odsw<pid>-br, -boot, -p0, -p1 (nothing created yet)
    with topo:                         # create(); teardown() on exit, also on Ctrl+C / SIGTERM
        topo.shape(5.0)               # every peer's link: 5 Mbit/s up and 5 Mbit/s down
        topo.counters("p0")           # {"tx_bytes": ..., "rx_bytes": ..., "tx_packets": ..., ...}
        subprocess.Popen(topo.exec_argv("p0", [sys.executable, ...]))

Layout: one namespace per node (``boot`` for the bootstrap, ``p0``, ``p1``, ... for peers) with
one interface ``wan0`` holding ``10.77.0.<n>/24``, and one ``br`` namespace with a Linux bridge
``br0`` into which every node's veth peer (``v<node>``) is plugged. There is no default route and
nothing is attached to the root namespace: traffic never leaves the namespaces made here.

Distance: ``Topology(peers=3, regions=Regions.preset("us/eu/asia"))`` places the nodes in regions
(``place={"p0": "us", ...}``; by default the bootstrap in the first region and the other nodes
round-robin over the regions) and, since a region pair then has delay, jitter or loss, replaces
the bridge by the user-space forwarder of ``benchmarks/harness/wan_emulator.py`` running in the
``br`` namespace: each frame between two nodes waits its regions' one-way delay (RTT / 2).

Shaping: ``tbf`` is an egress qdisc, so a peer's link gets two: one on its own ``wan0`` (upload)
and one on the bridge end ``v<node>`` (download). The bootstrap (a DHT node) is not shaped.
netem is not available on this kernel, so without ``regions`` links have no added latency (the
RTT is the sub-ms veth one plus whatever tbf queues, at most ``latency_ms``); with them the
forwarder adds it, and the download ``tbf`` on ``v<node>`` sits after its delay line.

Outages (with ``regions``): ``Topology(..., outages=[Outage(5, 9)])`` cuts every link between
regions from 5 to 9 s after the forwarder started; ``topo.outage(True)`` / ``topo.outage(False)``
cut and restore them on demand (the forwarder's SIGUSR1 / SIGUSR2), to hit a chosen round.

Every name carries ``odsw<pid>``, so ``cleanup_leftovers`` can find what an earlier (killed) run
left behind and only that; teardown first kills every process still inside our namespaces
(``ip netns pids``), then deletes the namespaces, which destroys their veths and the bridge.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from types import FrameType
from typing import Optional

from benchmarks.harness import wan_emulator
from benchmarks.harness.wan_emulator import Outage, Regions
from opendiloco_stream.net.lifecycle import is_running, terminate_pids

PREFIX = "odsw"
SUBNET = "10.77.0"
IFACE = "wan0"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-(\S+)$")


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be used here (not root, no ``ip netns``, no tbf); the message says why."""


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, check=True, timeout=20.0)


def unavailable_reason() -> Optional[str]:
    """None if namespaces, veth, bridge and tbf all work here; otherwise one line saying what is missing."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip() or r.stdout.strip()}"
        for cmd in (["link", "add", "pv0", "type", "veth", "peer", "name", "pv1"],
                    ["link", "add", "pbr", "type", "bridge"]):
            r = _ip("-n", probe, *cmd, check=False)
            if r.returncode != 0:
                return f"`ip {' '.join(cmd[:4])}` failed in a namespace: {r.stderr.strip()}"
        r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "pv0", "root", "tbf", "rate", "8mbit",
                            "burst", "32kb", "latency", "100ms"], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return f"`tc qdisc add ... tbf` failed (kernel module sch_tbf missing?): {r.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run iproute2: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


def our_namespaces(pid: Optional[int] = None) -> list[str]:
    """Namespaces named ``odsw<pid>-*`` (any pid when ``pid`` is None)."""
    r = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if (m := _NAME_RE.match(n)) and (pid is None or int(m.group(1)) == pid)]


def namespace_pids(ns: str) -> list[int]:
    """PIDs of the processes running inside namespace ``ns``."""
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def kill_namespace_processes(namespaces: list[str], timeout: float = 5.0) -> int:
    """SIGTERM every process inside ``namespaces``, SIGKILL what is left after ``timeout``; return how many."""
    pids = sorted({p for ns in namespaces for p in namespace_pids(ns)} - {os.getpid()})
    terminate_pids(pids, timeout)
    return len(pids)


_alive = is_running  # /proc state, zombies count as gone


def delete_namespaces(namespaces: list[str]) -> None:
    """Kill the processes inside, then delete each namespace (its veths and bridge go with it)."""
    kill_namespace_processes(namespaces)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)


def cleanup_leftovers(include_live: bool = False) -> list[str]:
    """Delete ``odsw<pid>-*`` namespaces whose creating process is gone (all of them with ``include_live``)."""
    def owner(name: str) -> int:
        return int(_NAME_RE.match(name).group(1))

    stale = [n for n in our_namespaces() if owner(n) != os.getpid() and (include_live or not _alive(owner(n)))]
    delete_namespaces(stale)
    return stale


class Topology:
    """A bootstrap namespace and ``peers`` peer namespaces on one bridge; see the module docstring.

    Node names are ``"boot"`` and ``"p0"`` .. ``"p{peers-1}"``; ``ip(node)`` is its address.
    Teardown runs on ``__exit__``, at interpreter exit, and on SIGINT / SIGTERM (which then
    raise ``KeyboardInterrupt`` / ``SystemExit`` so the caller's ``finally`` blocks run too).
    """

    def __init__(self, peers: int, prefix: Optional[str] = None, *, regions: Optional[Regions] = None,
                 place: Optional[dict[str, str]] = None, seed: int = 0, outages: tuple[Outage, ...] = ()):
        if not 1 <= peers <= 200:
            raise ValueError(f"peers must be in 1..200, got {peers}")
        self.prefix = prefix or f"{PREFIX}{os.getpid()}"
        if not _NAME_RE.match(f"{self.prefix}-x"):
            raise ValueError(f"prefix {self.prefix!r} must look like {PREFIX}<digits>")
        self.nodes = ["boot"] + [f"p{i}" for i in range(peers)]
        self.bridge = f"{self.prefix}-br"
        self.created: list[str] = []
        self.rate_mbit: Optional[float] = None
        self.regions = regions or Regions(("local",))
        self.place = dict(place or {})
        for node, region in self.place.items():
            if region not in self.regions.names:
                raise ValueError(f"{node} is placed in {region!r}, not one of the regions {self.regions.names}")
        self.seed = seed
        self.outages = tuple(outages)
        if self.outages and len(self.regions.names) < 2:
            raise ValueError("an outage cuts a link between regions: give at least two regions")
        self.forwarder: Optional[subprocess.Popen] = None
        self._macs: dict[str, str] = {}
        self.stats_path = f"/tmp/{self.prefix}-wan-stats.json"
        self._old_handlers: dict[int, object] = {}

    # ------------------------------------------------------------------ names and addresses
    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{2 + self.nodes.index(node)}"

    def peers(self) -> list[str]:
        return self.nodes[1:]

    def region_of(self, node: str) -> str:
        """``node``'s region: as placed, else the bootstrap in the first region and the other
        bridge-attached nodes round-robin over the regions in their order."""
        if node in self.place:
            return self.place[node]
        if node == "boot":
            return self.regions.names[0]
        return self.regions.names[(self.nodes.index(node) - 1) % len(self.regions.names)]

    @property
    def delayed(self) -> bool:
        """Whether the forwarder (delay, jitter, loss or outages) replaces the bridge."""
        return self.regions.delayed() or bool(self.outages)

    def rtt_ms(self, a: str, b: str) -> float:
        """The round-trip time the emulator adds between nodes ``a`` and ``b``."""
        return self.regions.link(self.region_of(a), self.region_of(b)).rtt_ms

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    # ------------------------------------------------------------------ lifecycle
    def create(self) -> "Topology":
        """Create the bridge namespace, one namespace + veth per node, addresses; no shaping yet."""
        self._install_handlers()
        try:
            self._add_ns(self.bridge)
            if not self.delayed:
                _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
                _ip("-n", self.bridge, "link", "set", "br0", "up")
            for node in self.nodes:
                self._add_node(node)
            if self.delayed:
                self._static_neighbours()
                self._start_forwarder()
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_node(self, node: str) -> None:
        """``node``'s namespace and veth: ``wan0`` inside, ``v<node>`` on the bridge (or left for the forwarder)."""
        ns = self._add_ns(self.ns(node))
        outer = f"v{node}"
        # created inside the bridge namespace, peer end moved at once: no name ever appears in the root namespace
        _ip("-n", self.bridge, "link", "add", outer, "type", "veth", "peer", "name", IFACE, "netns", ns)
        if self.delayed:
            # MTU-sized segments on both ends, so the forwarder's loss applies per real packet
            _ip("-n", self.bridge, "link", "set", outer, "gso_max_segs", "1")
            _ip("-n", ns, "link", "set", IFACE, "gso_max_segs", "1")
        else:
            _ip("-n", self.bridge, "link", "set", outer, "master", "br0")
        _ip("-n", self.bridge, "link", "set", outer, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", IFACE)
        _ip("-n", ns, "link", "set", IFACE, "up")

    def mac(self, node: str) -> str:
        """The hardware address of ``node``'s ``wan0``."""
        return json.loads(_ip("-n", self.ns(node), "-j", "link", "show", "dev", IFACE).stdout)[0]["address"]

    def _static_neighbours(self) -> None:
        """Every node knows every other node's MAC (permanent neighbour entries): on the Internet
        a peer never ARPs a host across an ocean, only its local gateway, so ARP must not pay the
        emulated delay or loss (a lost ARP reply would stall a connection for a second)."""
        macs = {node: self.mac(node) for node in self.nodes}
        for node in self.nodes:
            lines = "".join(f"neigh replace {self.ip(other)} lladdr {mac} dev {IFACE} nud permanent\n"
                            for other, mac in macs.items() if other != node)
            subprocess.run(["ip", "-n", self.ns(node), "-batch", "-"], input=lines, text=True, check=True,
                           capture_output=True, timeout=20)
        self._macs = macs

    def _start_forwarder(self, timeout: float = 20.0) -> None:
        """Run ``wan_emulator.py`` in the bridge namespace over every ``v<node>``; wait for its ``ready``."""
        ports = {f"v{node}": self.region_of(node) for node in self.nodes}
        config = self.regions.forwarder_config(ports, self.seed, self.stats_path, self.outages)
        config["macs"] = {f"v{node}": mac for node, mac in self._macs.items()}
        argv = ["ip", "netns", "exec", self.bridge, sys.executable, wan_emulator.__file__, json.dumps(config)]
        self.forwarder = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.forwarder.stdout], [], [], timeout)
        line = self.forwarder.stdout.readline().strip() if ready else ""
        if line != "ready":
            self.forwarder.kill()
            raise RuntimeError(f"the WAN forwarder did not start: {line} {self.forwarder.stderr.read()[-1000:]}")

    def outage(self, down: bool) -> None:
        """Cut (``True``) or restore (``False``) every link between regions now."""
        if self.forwarder is None or self.forwarder.poll() is not None:
            raise RuntimeError("no WAN forwarder runs: an outage needs regions (Topology(..., regions=...))")
        self.forwarder.send_signal(signal.SIGUSR1 if down else signal.SIGUSR2)

    def emulator_stats(self) -> dict:
        """The forwarder's counters (frames, drops by cause, lateness), at most half a second old."""
        if self.forwarder is None:
            return {}
        with open(self.stats_path) as f:
            return json.load(f)

    def _add_ns(self, name: str) -> str:
        _ip("netns", "add", name)
        self.created.append(name)
        return name

    def teardown(self) -> None:
        """Kill every process inside our namespaces and delete them. Safe to call twice."""
        names = [n for n in our_namespaces(int(_NAME_RE.match(f"{self.prefix}-x").group(1)))
                 if n.startswith(self.prefix + "-")]
        delete_namespaces(sorted(set(names) | set(self.created)))
        self.created = []
        if self.forwarder is not None:  # killed with the bridge namespace's processes; reap it
            if self.forwarder.poll() is None:
                self.forwarder.kill()
            self.forwarder.wait(10)
            self.forwarder.stdout.close()
            self.forwarder.stderr.close()
            self.forwarder = None
        if os.path.exists(self.stats_path):
            os.remove(self.stats_path)
        self._restore_handlers()

    def __enter__(self) -> "Topology":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _install_handlers(self) -> None:
        atexit.register(self.teardown)
        for sig, exc in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)):
            def handler(signum: int, frame: Optional[FrameType], _exc=exc) -> None:
                raise _exc(128 + signum) if _exc is SystemExit else _exc()
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: atexit and the caller's finally still clean up
                pass

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}
        atexit.unregister(self.teardown)

    # ------------------------------------------------------------------ shaping and counters
    def shape(self, rate_mbit: float, latency_ms: float = 100.0, nodes: Optional[list[str]] = None) -> None:
        """Limit every peer (or each of ``nodes``: a rate per link) to ``rate_mbit`` each way with
        tbf, replacing an earlier limit."""
        rate = f"{rate_mbit * 1000:.0f}kbit"
        # the bucket must hold a few MTU-sized packets; at high rates ~2 ms of traffic (timer granularity)
        burst = f"{max(32_000, int(rate_mbit * 1e6 / 8 * 0.002))}b"
        for node in nodes or self.peers():
            for ns, dev in ((self.ns(node), IFACE), (self.bridge, f"v{node}")):
                _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", f"{latency_ms:g}ms")
        self.rate_mbit = rate_mbit

    def unshape(self) -> None:
        for node in self.peers():
            for ns, dev in ((self.ns(node), IFACE), (self.bridge, f"v{node}")):
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=20)
        self.rate_mbit = None

    def qdisc(self, node: str) -> str:
        return _tc(self.ns(node), "qdisc", "show", "dev", IFACE).stdout.strip()

    def counters(self, node: str) -> dict[str, int]:
        """Byte and packet counters of ``node``'s ``wan0`` (Ethernet frames, as the kernel counts them)."""
        out = _ip("-n", self.ns(node), "-j", "-s", "link", "show", "dev", IFACE).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}


# ---------------------------------------------------------------------- throughput probe

_RECEIVER = r"""
import json, socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 0)); s.listen(1)
s.settimeout(float(sys.argv[3]))
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[3])); got, t0 = 0, None
while got < n:
    b = c.recv(1 << 16)
    if not b: break
    t0 = t0 or time.perf_counter()
    got += len(b)
dt = time.perf_counter() - t0
print(json.dumps({"bytes": got, "seconds": dt, "mbit_s": got * 8 / dt / 1e6}), flush=True)
"""

_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
n, buf = int(sys.argv[3]), b"\x5a" * (1 << 16)
while n > 0:
    c.sendall(buf[:min(n, len(buf))]); n -= min(n, len(buf))
c.close()
"""


def measure_throughput(topo: Topology, src: str, dst: str, nbytes: int = 2_000_000,
                       timeout: float = 60.0) -> dict[str, float]:
    """One TCP transfer of ``nbytes`` from node ``src`` to node ``dst``; the receiver's goodput.

    Timed at the receiver from its first byte to its last, so connection set-up is excluded.
    """
    py = sys.executable
    recv = subprocess.Popen(topo.exec_argv(dst, [py, "-c", _RECEIVER, topo.ip(dst), str(nbytes), str(timeout)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = recv.stdout.readline().strip()  # the receiver prints its port once it listens
        if not port.isdigit():
            raise RuntimeError(f"throughput receiver failed: {recv.stderr.read()[-500:]}")
        send = subprocess.run(topo.exec_argv(src, [py, "-c", _SENDER, topo.ip(dst), port, str(nbytes), str(timeout)]),
                              capture_output=True, text=True, timeout=timeout)
        if send.returncode != 0:
            raise RuntimeError(f"throughput sender failed: {send.stderr[-500:]}")
        out, err = recv.communicate(timeout=timeout)
        if recv.returncode != 0:
            raise RuntimeError(f"throughput receiver failed: {err[-500:]}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
