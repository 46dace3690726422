"""Peers behind NAT on one machine (tests/test_nat.py, benchmarks/nat_relay.py): the namespaces of :class:`benchmarks.harness.netns.Topology`
plus router namespaces that masquerade (nftables) for one private peer each.

    with NatTopology(public=2, natted=1) as topo:   # boot, p0, p1 public; n0 behind router r0
        subprocess.Popen(topo.exec_argv("n0", [...]))

Layout: the public segment is the bridge of ``Topology`` (``10.77.0.0/24``: the bootstrap, the
public peers ``p<i>`` and each router's ``wan0``). Router ``r<i>`` has a second interface
``lan0`` (``192.168.<10+i>.1/24``) wired to the private peer ``n<i>`` (``wan0``,
``192.168.<10+i>.2/24``, default route via its router). The router forwards, masquerades what
leaves ``wan0`` and drops every connection that starts on the public side (``inbound="drop"``, a
home router's default; ``"reject"`` answers with a reset instead). Public nodes have no route to
the private subnets: an address a private peer announces is unreachable from outside, as on the
Internet. ``symmetric=True`` masquerades with a random port per connection (an endpoint-dependent
mapping: a "symmetric" NAT, through which hole punching cannot work); a list of router indices
makes only those routers symmetric.

With ``regions`` (see ``Topology``), each router's ``wan0`` is on the delayed segment: the
forwarder holds what crosses between regions, and a private peer is in its router's region.

Every name carries ``odsw<pid>`` like ``Topology``'s, so teardown, ``cleanup_leftovers`` and the
process kill on teardown apply unchanged. Needs root, ``ip``, and ``nft`` (Debian's nftables).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Optional

from benchmarks.harness import netns
from benchmarks.harness.netns import Topology
from benchmarks.harness.wan_emulator import Regions

RULES = """
table ip ods_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade{random}
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        iifname "lan0" oifname "wan0" accept
        ct state established,related accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state new {verdict}
    }}
}}
"""


#: an on-path tamperer in a router: one byte of every large TCP segment forwarded to ``dest``
#: overwritten (the kernel keeps the TCP checksum right, so the receiver's TCP accepts the segment)
TAMPER_RULE = ('insert rule ip ods_nat forward ip daddr {dest} ip protocol tcp ip length > 1000 counter '
               '@ih,{bit},8 set 0x5a comment "ods-tamper"')

#: accepts one connection and prints the source port it came from
_SEEN_PORT = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(20)
print(s.getsockname()[1], flush=True)
c, (_, port) = s.accept()
print(port, flush=True)
"""

#: connects from one fixed local port to each (host, port) in turn, SO_REUSEADDR so it may reuse it
_FROM_PORT = r"""
import socket, sys, time
sport = int(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.bind(("0.0.0.0", sport)); c.settimeout(20); c.connect((host, int(port))); time.sleep(0.2); c.close()
"""


def unavailable_reason() -> Optional[str]:
    """None if the NAT topology can be built here, else one line saying what is missing."""
    reason = netns.unavailable_reason()
    if reason is None and shutil.which("nft") is None:
        reason = "`nft` is not installed (Debian: apt-get install nftables; scripts/test.sh does it as root)"
    return reason


def exit_if_unavailable(benchmark: str) -> None:
    """For a benchmark's ``main``: say why the topology cannot be built here and exit with 2."""
    reason = unavailable_reason()
    if reason:
        print(f"{benchmark}: {reason}", file=sys.stderr)
        raise SystemExit(2)


def listen_flags(topo: "NatTopology", node: str) -> list[str]:
    """A public peer listens on its bridge address; a private one on every interface (the default
    for remote initial peers), so what it announces is its private address, as behind a real NAT."""
    return [] if node in topo.private else ["--host-maddrs", f"/ip4/{topo.ip(node)}/tcp/0"]


class NatTopology(Topology):
    """``public`` peers and ``natted`` private peers (each behind its own masquerading router)
    around one bootstrap; see the module docstring. Nodes: ``boot``, ``p<i>``, ``r<i>``, ``n<i>``."""

    def __init__(self, public: int, natted: int, *, inbound: str = "drop", symmetric: bool = False,
                 prefix: Optional[str] = None, regions: Optional[Regions] = None,
                 place: Optional[dict[str, str]] = None):
        if not 1 <= natted <= 8:
            raise ValueError(f"natted must be in 1..8, got {natted}")
        if inbound not in ("drop", "reject"):
            raise ValueError(f"inbound must be 'drop' or 'reject', got {inbound!r}")
        super().__init__(peers=max(public, 1), prefix=prefix, regions=regions, place=place)
        if public == 0:
            self.nodes.remove("p0")
        self.routers = [f"r{i}" for i in range(natted)]
        self.private = [f"n{i}" for i in range(natted)]
        self.nodes += self.routers  # on the public bridge, like any public node
        self.inbound, self.symmetric = inbound, symmetric

    def ip(self, node: str) -> str:
        """A node's address: public nodes and routers on the bridge, private peers on their LAN."""
        if node in self.private:
            return f"192.168.{10 + self.private.index(node)}.2"
        return super().ip(node)

    def region_of(self, node: str) -> str:
        """A private peer sits in its router's region (placing ``n<i>`` places ``r<i>``); its LAN adds no delay."""
        if node in self.private:
            router = self.routers[self.private.index(node)]
            return self.place.get(node) or super().region_of(router)
        if node in self.routers and node not in self.place:
            private = self.private[self.routers.index(node)]
            if private in self.place:
                return self.place[private]
        return super().region_of(node)

    def public_ip(self, node: str) -> str:
        """The address the public side sees for ``node``: its router's for a private peer."""
        return super().ip(self.routers[self.private.index(node)]) if node in self.private else self.ip(node)

    def public_peers(self) -> list[str]:
        return [n for n in self.nodes if n.startswith("p")]

    def create(self) -> "NatTopology":
        """The public bridge and its nodes (``Topology.create``), then each router's LAN and rules."""
        super().create()
        try:
            for i, (router, private) in enumerate(zip(self.routers, self.private)):
                self._add_lan(i, router, private)
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_lan(self, i: int, router: str, private: str) -> None:
        r, n = self.ns(router), self._add_ns(self.ns(private))
        lan = f"192.168.{10 + i}"
        netns._ip("-n", r, "link", "add", "lan0", "type", "veth", "peer", "name", netns.IFACE, "netns", n)
        netns._ip("-n", r, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        netns._ip("-n", r, "link", "set", "lan0", "up")
        netns._ip("-n", n, "link", "set", "lo", "up")
        netns._ip("-n", n, "addr", "add", f"{lan}.2/24", "dev", netns.IFACE)
        netns._ip("-n", n, "link", "set", netns.IFACE, "up")
        netns._ip("-n", n, "route", "add", "default", "via", f"{lan}.1")
        subprocess.run(["ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True,
                       capture_output=True, timeout=20)
        symmetric = i in self.symmetric if isinstance(self.symmetric, (list, tuple, set)) else self.symmetric
        rules = RULES.format(random=" random" if symmetric else "",
                             verdict=self.inbound)
        subprocess.run(["ip", "netns", "exec", r, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=20)

    def _nft(self, router: str, *args: str) -> str:
        return subprocess.run(["ip", "netns", "exec", self.ns(router), "nft", *args], check=True, capture_output=True,
                              text=True, timeout=20).stdout

    def tamper(self, router: str, dest: str, offset: int = 100) -> None:
        """Make ``router`` an attacker on the path: from now on it overwrites byte ``offset`` of
        the payload of every TCP segment over 1000 bytes that it forwards to ``dest`` (small
        segments, handshakes and hellos, pass intact). :meth:`untamper` stops it."""
        self._nft(router, TAMPER_RULE.format(dest=dest, bit=8 * offset))

    def untamper(self, router: str) -> int:
        """Remove ``router``'s tamper rule; returns how many segments it altered."""
        listing = self._nft(router, "-a", "list", "chain", "ip", "ods_nat", "forward")
        line = next(line for line in listing.splitlines() if '"ods-tamper"' in line)
        self._nft(router, "delete", "rule", "ip", "ods_nat", "forward", "handle", line.rsplit("handle", 1)[1].strip())
        return int(line.split("counter packets", 1)[1].split()[0])

    def mapped_ports(self, node: str, targets: list[str], sport: int = 40000) -> list[int]:
        """The source port each public node of ``targets`` sees when ``node`` connects to it from
        its own port ``sport``: the same port for all under an endpoint-independent mapping (this
        topology's default masquerade keeps ``sport`` itself when free), a different one for each
        under a symmetric NAT. How the test and the benchmark show which kind a router is."""
        py = sys.executable
        servers = [subprocess.Popen(self.exec_argv(t, [py, "-c", _SEEN_PORT, self.ip(t)]), stdout=subprocess.PIPE,
                                    text=True) for t in targets]
        try:
            ports = [srv.stdout.readline().strip() for srv in servers]
            subprocess.run(self.exec_argv(node, [py, "-c", _FROM_PORT, str(sport),
                                                 *(f"{self.ip(t)}:{p}" for t, p in zip(targets, ports))]),
                           check=True, capture_output=True, timeout=60)
            return [int(srv.stdout.readline().strip()) for srv in servers]
        finally:
            for srv in servers:
                if srv.poll() is None:
                    srv.kill()
                srv.wait(5)
