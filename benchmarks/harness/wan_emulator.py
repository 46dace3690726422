"""A user-space WAN emulator: delay, jitter and loss between network namespaces, per pair of regions.

This kernel has no ``netem`` qdisc (only ``tbf``), so latency cannot be added with ``tc``. Instead
:class:`benchmarks.harness.netns.Topology` leaves the node-side veth ends (``v<node>``) unbridged
in its ``br`` namespace and runs this module there as a process (the *forwarder*): it reads every
Ethernet frame arriving on those ends with ``AF_PACKET`` raw sockets, decides the output port by
MAC learning (broadcast, multicast and not-yet-learned addresses go to every other port), and
sends the frame out once the pair's one-way delay has passed (a heap of due times, one thread,
``select``). A rate limit stays a ``tbf`` qdisc on the veths (``Topology.shape``); a frame the
forwarder writes passes the destination veth's ``tbf``, as a frame leaving a bottleneck router.

Why it is exact enough:
- Each frame's due time counts from the kernel's receive timestamp (``SO_TIMESTAMPNS``), not from
  when the forwarder read it, so a forwarder descheduled for a few ms still releases on time.
- Segmentation offloads: veths hand raw sockets 64 KB GSO super-frames whose checksums are left
  to the hardware. The sockets use ``PACKET_VNET_HDR`` (the virtio header travels with each frame,
  so the kernel finishes a partial checksum on the far side) and the topology sets
  ``gso_max_segs 1`` on every veth, so TCP sends MTU-sized segments and a loss rate applies per
  real packet. ``gso_frames`` in the stats counts any super-frame that got through anyway.
- Jitter never reorders a pair's frames (a frame is due no earlier than the one before it on the
  same pair), because TCP takes reordering as loss, which real paths rarely cause.

Outages: a link between two regions can go down, dropping every frame crossing it (in both
directions) as a cut cable or a dead router would, either on a schedule (``Outage(start_s,
end_s)``, seconds after the forwarder's ``ready``) or on demand (SIGUSR1: every link between
regions down, SIGUSR2: up again; ``Topology.outage``). Frames already in flight are delivered
(they left before the cut); frames within a region are never dropped. ``outage_drops`` counts them.

Run standalone (stdlib only, so it starts in ~50 ms): ``python wan_emulator.py CONFIG_JSON``;
it prints ``ready`` once every socket is bound and rewrites the stats file (``stats``) every
half second and on SIGTERM. :class:`Regions` is the spec the topology turns into that config.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_STATISTICS = 6
PACKET_IGNORE_OUTGOING = 23
SO_TIMESTAMPNS = 35
SO_RCVBUFFORCE, SO_SNDBUFFORCE = 33, 32
VNET_HDR_LEN = 10  # struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
ETH = VNET_HDR_LEN  # offset of the Ethernet header in a frame read with PACKET_VNET_HDR
#: each port's receive buffer: a few ms of descheduling at hundreds of Mbit/s, but not so much
#: that an overloaded forwarder queues (and delays) frames for long instead of dropping them, as
#: a router's bounded buffer does
RCVBUF = 4 << 20
SNDBUF = 16 << 20
STATS_EVERY_S = 0.5
#: frames due within this much are sent now: select()'s wake-up comes ~50 us late (timer slack)
EARLY_S = 0.00005


# ---------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class Link:
    """The path between two regions: round-trip time, jitter (each way, +-) and loss (each way)."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self):
        if self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"rtt_ms and jitter_ms must be >= 0, got {self.rtt_ms}, {self.jitter_ms}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss is a fraction in [0, 1), got {self.loss}")

    @property
    def one_way_ms(self) -> float:
        return self.rtt_ms / 2


@dataclass(frozen=True)
class Outage:
    """Every link between regions (or only the link between the regions ``between``) drops every
    frame from ``start_s`` to ``end_s`` seconds after the forwarder started."""

    start_s: float
    end_s: float
    between: Optional[tuple[str, str]] = None

    def __post_init__(self):
        if not 0 <= self.start_s < self.end_s:
            raise ValueError(f"an outage needs 0 <= start_s < end_s, got {self.start_s}, {self.end_s}")
        if self.between is not None and (len(self.between) != 2 or self.between[0] == self.between[1]):
            raise ValueError(f"an outage is between two regions, got {self.between}")


#: RTTs between cloud regions (approximate public measurements): us-east, eu-west, ap-southeast
PRESETS: dict[str, dict[tuple[str, str], float]] = {
    "us/eu/asia": {("us", "eu"): 75.0, ("us", "asia"): 230.0, ("eu", "asia"): 160.0},
}


@dataclass
class Regions:
    """N regions and the :class:`Link` between each pair; nodes in one region see ``local``.

    ``Regions.pair(150)`` is two regions ``a`` and ``b`` 150 ms apart; ``Regions.preset("us/eu/asia")``
    the three cloud regions of :data:`PRESETS`. Pairs not given get ``Link()`` (no delay).
    """

    names: tuple[str, ...]
    links: dict[frozenset, Link] = field(default_factory=dict)
    local: Link = Link()

    def __post_init__(self):
        self.names = tuple(self.names)
        if len(set(self.names)) != len(self.names) or not self.names:
            raise ValueError(f"region names must be distinct and at least one, got {self.names}")
        for pair in self.links:
            if not set(pair) <= set(self.names) or len(pair) != 2:
                raise ValueError(f"link {sorted(pair)} names a region not in {self.names}")

    @classmethod
    def pair(cls, rtt_ms: float, jitter_ms: float = 0.0, loss: float = 0.0) -> "Regions":
        return cls(("a", "b"), {frozenset(("a", "b")): Link(rtt_ms, jitter_ms, loss)})

    @classmethod
    def preset(cls, name: str, jitter_ms: float = 0.0, loss: float = 0.0) -> "Regions":
        if name not in PRESETS:
            raise ValueError(f"unknown region preset {name!r}; choose one of {sorted(PRESETS)}")
        rtts = PRESETS[name]
        names = tuple(dict.fromkeys(r for pair in rtts for r in pair))
        return cls(names, {frozenset(p): Link(rtt, jitter_ms, loss) for p, rtt in rtts.items()})

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return self.local
        return self.links.get(frozenset((a, b)), Link())

    def with_link(self, a: str, b: str, link: Link) -> "Regions":
        """A copy with the ``a``-``b`` link replaced (e.g. 1% loss on one link only)."""
        return Regions(self.names, {**self.links, frozenset((a, b)): link}, self.local)

    def delayed(self) -> bool:
        """Whether any link adds delay, jitter or loss (else a plain bridge does the job)."""
        return any(link != Link() for link in [self.local, *self.links.values()])

    def describe(self) -> str:
        parts = [f"{'-'.join(sorted(p))} {l.rtt_ms:g} ms" + (f" +-{l.jitter_ms:g}" if l.jitter_ms else "")
                 + (f" {l.loss:.1%} loss" if l.loss else "") for p, l in self.links.items()]
        return ", ".join(parts) or "no delay"

    def forwarder_config(self, ports: dict[str, str], seed: int, stats: str,
                         outages: tuple[Outage, ...] = ()) -> dict:
        """The forwarder's config: ``ports`` maps each veth end to its node's region; ``outages``
        become, per window, the matrix of port pairs it cuts (``True``: a pair across the link)."""
        names = list(ports)
        rows = [[self.link(ports[a], ports[b]) for b in names] for a in names]
        for o in outages:
            if o.between is not None and not set(o.between) <= set(self.names):
                raise ValueError(f"outage between {o.between}: not regions of {self.names}")

        def cut(o: Optional[Outage]) -> list[list[bool]]:
            return [[ports[a] != ports[b] and (o is None or o.between is None or {ports[a], ports[b]} == set(o.between))
                     for b in names] for a in names]

        return {"ports": names, "seed": seed, "stats": stats,
                "delay_ms": [[l.one_way_ms for l in r] for r in rows],
                "jitter_ms": [[l.jitter_ms for l in r] for r in rows],
                "loss": [[l.loss for l in r] for r in rows],
                "cut": cut(None),  # what SIGUSR1 takes down
                "outages": [{"start_s": o.start_s, "end_s": o.end_s, "cut": cut(o)} for o in outages]}


# ---------------------------------------------------------------------- the forwarder


@dataclass
class Stats:
    """What the forwarder did: frames in and out, drops by cause, how late frames left."""

    frames_in: int = 0      # late_*: when each frame left minus its due time (negative: early)
    frames_out: int = 0
    bytes_out: int = 0
    lost: int = 0          # dropped on purpose (the link's loss rate)
    outage_drops: int = 0  # dropped because their link was down (an outage)
    send_errors: int = 0   # the output veth refused the frame (its tbf queue was full)
    kernel_drops: int = 0  # the raw socket's receive buffer overflowed: frames the emulator lost
    gso_frames: int = 0
    late_sum_s: float = 0.0
    late_max_s: float = 0.0
    realtime: bool = False  # whether the forwarder got SCHED_FIFO

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["late_mean_ms"] = 1e3 * self.late_sum_s / max(1, self.frames_out)
        d["late_max_ms"] = 1e3 * self.late_max_s
        return d


def _open_port(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    try:
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # our own sends are not input
    except OSError:
        pass  # kernels before 4.20: _drain skips PACKET_OUTGOING instead
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SNDBUF)
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


class Forwarder:
    """The frame loop; see the module docstring. ``config`` is :meth:`Regions.forwarder_config`'s."""

    def __init__(self, config: dict):
        self.ports: list[str] = config["ports"]
        self.delay = [[ms / 1e3 for ms in row] for row in config["delay_ms"]]
        self.jitter = [[ms / 1e3 for ms in row] for row in config["jitter_ms"]]
        self.loss = config["loss"]
        self.rng = random.Random(config.get("seed", 0))
        self.stats_path: Optional[str] = config.get("stats")
        self.socks = [_open_port(name) for name in self.ports]
        self.by_fd = {s.fileno(): i for i, s in enumerate(self.socks)}
        # known addresses (the topology's): no frame is flooded; others are learned as they appear
        self.mac_port: dict[bytes, int] = {bytes.fromhex(mac.replace(":", "")): self.ports.index(port)
                                           for port, mac in config.get("macs", {}).items()}
        self.last_due = [[0.0] * len(self.ports) for _ in self.ports]
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = itertools.count()
        self.stats = Stats()
        self.running = True
        self.started = time.time()
        self.cut_all: list[list[bool]] = config.get("cut") or [[False] * len(self.ports) for _ in self.ports]
        self.outages: list[dict] = list(config.get("outages", []))
        self.down_on_demand = False  # SIGUSR1 / SIGUSR2

    def run(self) -> None:
        # select(), not epoll: its timeout has microsecond steps where epoll's has milliseconds, and
        # a topology has a few ports at most
        fds = list(self.by_fd)
        next_stats = time.time()
        while self.running:
            now = time.time()
            if now >= next_stats:
                self.write_stats()
                next_stats = now + STATS_EVERY_S
            wait = min(next_stats, self.heap[0][0] - EARLY_S if self.heap else next_stats) - now
            readable, _, _ = select.select(fds, [], [], max(0.0, wait))
            for fd in readable:
                self._drain(self.by_fd[fd])
            self._release(time.time() + EARLY_S)
        self.write_stats()

    def _drain(self, port: int, budget: int = 64) -> None:
        """Read up to ``budget`` frames waiting on ``port`` and schedule each for its destinations
        (a small budget: frames already due leave between two batches, not after a long read)."""
        sock = self.socks[port]
        for _ in range(budget):
            try:
                frame, anc, _flags, addr = sock.recvmsg(70_000, 64)
            except BlockingIOError:
                return
            if addr[2] == socket.PACKET_OUTGOING:
                continue
            stamp = time.time()
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", data[:16])
                    stamp = sec + nsec * 1e-9
            self.stats.frames_in += 1
            if frame[1]:  # virtio gso_type: a super-frame got through despite gso_max_segs 1
                self.stats.gso_frames += 1
            self._schedule(port, frame, stamp)

    def _down(self, src: int, dst: int, stamp: float) -> bool:
        """Whether the link from port ``src`` to ``dst`` is down at ``stamp`` (an outage)."""
        if self.down_on_demand and self.cut_all[src][dst]:
            return True
        t = stamp - self.started
        return any(o["start_s"] <= t < o["end_s"] and o["cut"][src][dst] for o in self.outages)

    def _schedule(self, src: int, frame: bytes, stamp: float) -> None:
        dst_mac, src_mac = frame[ETH:ETH + 6], frame[ETH + 6:ETH + 12]
        self.mac_port[src_mac] = src
        out = self.mac_port.get(dst_mac)
        targets = range(len(self.ports)) if out is None or dst_mac[0] & 1 else (out,)
        for dst in targets:
            if dst == src:
                continue
            if (self.down_on_demand or self.outages) and self._down(src, dst, stamp):
                self.stats.outage_drops += 1
                continue
            if self.loss[src][dst] and self.rng.random() < self.loss[src][dst]:
                self.stats.lost += 1
                continue
            due = stamp + self.delay[src][dst]
            if self.jitter[src][dst]:
                due += self.rng.uniform(-self.jitter[src][dst], self.jitter[src][dst])
            due = max(due, self.last_due[src][dst])  # jitter never reorders a pair's frames
            self.last_due[src][dst] = due
            heapq.heappush(self.heap, (due, next(self.seq), dst, frame))

    def _release(self, now: float) -> None:
        heap, stats = self.heap, self.stats
        while heap and heap[0][0] <= now:
            due, _, dst, frame = heapq.heappop(heap)
            try:
                self.socks[dst].send(frame)
            except OSError:  # ENOBUFS / EAGAIN: the output's tbf queue is full, as a router's would be
                stats.send_errors += 1
                continue
            late = time.time() - due
            stats.frames_out += 1
            stats.bytes_out += len(frame) - VNET_HDR_LEN
            stats.late_sum_s += late
            stats.late_max_s = max(stats.late_max_s, late)

    def write_stats(self) -> None:
        for s in self.socks:  # struct tpacket_stats {packets, drops}; reading resets them
            _, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
            self.stats.kernel_drops += drops
        if self.stats_path:
            tmp = self.stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**self.stats.as_dict(), "queued": len(self.heap), "time": time.time()}, f)
            os.replace(tmp, self.stats_path)

    def stop(self, *_args) -> None:
        self.running = False

    def link_down(self, *_args) -> None:
        self.down_on_demand = True

    def link_up(self, *_args) -> None:
        self.down_on_demand = False


def _realtime() -> bool:
    """Ask for SCHED_FIFO: netem's delay runs in the kernel's softirq, ours in a process that must
    wake up on time on a busy machine. It sleeps between frames, and the kernel caps real-time
    tasks at 95% of a CPU, so an overloaded forwarder cannot starve the machine."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (OSError, AttributeError):  # not permitted here (no CAP_SYS_NICE, no RT budget): best effort
        return False


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    fwd = Forwarder(config)
    fwd.stats.realtime = _realtime()
    signal.signal(signal.SIGTERM, fwd.stop)
    signal.signal(signal.SIGINT, fwd.stop)
    signal.signal(signal.SIGUSR1, fwd.link_down)
    signal.signal(signal.SIGUSR2, fwd.link_up)
    fwd.write_stats()  # the stats file exists once the topology sees "ready"
    fwd.started = time.time()  # outages count from here
    print("ready", flush=True)
    fwd.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
