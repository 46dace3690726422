"""Preflight checks for joining a swarm, each with the fix to apply (``opendiloco-stream doctor``).

In order, each check printed as it completes:

1. ``p2pd``      the libp2p daemon shipped with hivemind exists and starts.
2. ``listen``    a daemon listens where the peer would (``--port`` / ``--host-maddrs``) and
                 announces what it would (``--public-ip`` / ``--announce-maddrs``).
3. ``bootstrap`` a client DHT node dials the initial peers, pings each, and a DHT lookup of the
                 run's metrics key is answered.
4. ``dial-back`` the bootstrap node is asked to open a *new* connection to each announced address
                 of check 2 (see :mod:`opendiloco_stream.net.reachability`). If it offers no such
                 service, this machine dials them instead, and the result says that only this was
                 checked.
5. ``nat``       the bootstrap says which address this machine's connections come from; when
                 it is none of this machine's own, the peer is behind NAT, and the check says
                 whether that is a problem (nobody can dial it and it is not a client) and what
                 to do: client mode, a forwarded port with ``--public-ip``, or ``--relay`` (the
                 p2p daemon then reserves a slot on each initial peer at start).
6. ``relay``     with ``--relay``, one line per relay among the initial peers (every one): two
                 throwaway p2p daemons here send 512 KiB through one connection relayed by it
                 (:mod:`opendiloco_stream.net.relay_check`); ``FAIL`` when it resets the
                 connection at go-libp2p's default 128 KiB (restart that ``bootstrap --relay``),
                 ``warn`` when no relayed connection opens.
7. ``punch``     which NAT this machine is behind, from the run's echo servers (every ``bootstrap
                 --relay`` runs one): no NAT, a home router (one public port for every
                 destination: groupmates behind NAT open direct connections to it by hole
                 punching) or a symmetric NAT (a new port per destination: no punch can work,
                 exchanges with groupmates behind NAT cross the relay); skipped without echoes
                 (a warning with ``--relay``), ``--no-direct`` or ``--no-punch``.
8. ``data port`` the direct data path of rounds (``--data-port D``): this machine can listen on
                 TCP D, and the bootstrap opens a TCP connection to D at each address that passed
                 check 4 (skipped for random data ports, ``--no-direct``, client mode and ``--relay``).
9. ``link``      the round-trip time to each initial peer (TCP handshakes), and whether this
                 machine's TCP settings suit a link of that RTT at ``--link-mbit``: buffers that
                 grow to the bandwidth-delay product, and connections that keep their window
                 between rounds (``net.ipv4.tcp_slow_start_after_idle``); warn with the fix.
                 Whether a round of the run's H, P and codec fits that link: ``peer --dry-run``.
10. ``share``    the address others should pass as ``--initial-peers``.
11. ``kernels`` the native codec kernels build and load (``compression/native.py``); without
                 them the codecs run in torch, several times slower on the CPU (warn).

Status: ``ok``, ``FAIL`` (the peer will not work as configured), ``warn`` (it may), ``skip``.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import ipaddress
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from opendiloco_stream.compression import native
from opendiloco_stream.config import PREMATCH_AUTO_MIN_RTT_MS, PREMATCH_AUTO_RTTS, NetConfig
from opendiloco_stream.net.auth import run_validators
from opendiloco_stream.net.dht import (check_run_id, ensure_identity, explain_start_error, ip4_of, listen_maddrs,
                                       rank_maddrs, relay_nodes)
from opendiloco_stream.net.distance import probe_peers
from opendiloco_stream.net.keys import run_key
from opendiloco_stream.net.metrics import metrics_validators
from opendiloco_stream.net.reachability import (NatKind, echo_key, parse_echoes, probe_dial, probe_nat, probe_tcp,
                                                 request_dialback, request_observed, request_tcp_dialback,
                                                 reserve_ports, short_error)
from opendiloco_stream.net.relay_check import (DEFAULT_RELAY_DATA_LIMIT, PROBE_BYTES, RelayProbe, RelayVerdict,
                                                probe_relay)
from opendiloco_stream.net.tcp import bdp_bytes, kernel_buffer_limits, restarts_after_idle

logger = logging.getLogger(__name__)


@dataclass
class Check:
    """The outcome of one preflight check."""

    name: str
    status: str  # "ok" | "FAIL" | "warn" | "skip"
    detail: str
    fix: str = ""

    def lines(self) -> str:
        text = f"[{self.status}] {self.name}: {self.detail}"
        return text + (f"\n       fix: {self.fix}" if self.fix else "")


def _host_port(maddr: str) -> tuple[str, str]:
    parts = maddr.strip("/").split("/")
    return (parts[1] if len(parts) > 1 else "?"), (parts[3] if len(parts) > 3 else "?")


def _ip_is(maddr: Any, attribute: str) -> bool:
    maddr = Multiaddr(str(maddr))
    for proto in ("ip4", "ip6"):
        if proto in maddr:
            return getattr(ipaddress.ip_address(maddr[proto]), attribute)
    return False


async def _hang_up(reader: Any, writer: Any) -> None:
    writer.close()


def _reach_fix(net: NetConfig) -> str:
    if net.port is None and not net.host_maddrs:
        return ("listen on a fixed port and open it: --port 31337 (allow TCP and UDP 31337 in the firewall, "
                "forward them on the router); behind NAT also add --public-ip <your public IP>; a peer that "
                "cannot be reached can still train as a client (net.client_mode = true)")
    return ("open/forward the listening port (TCP and UDP) to this machine and make sure the announced IP is "
            "this machine's public one (--public-ip / --announce-maddrs); or train as a client "
            "(net.client_mode = true)")


def _route_source(initial_peers: list[str]) -> list[str]:
    """This machine's address on its route to the first IPv4 initial peer, as ``/ip4/A`` (none if
    unknown). A UDP socket's connect picks the route and sends nothing."""
    ip = next((ip4_of(m) for m in initial_peers if ip4_of(m)), "")
    if not ip:
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError:
            return []
        return [f"/ip4/{s.getsockname()[0]}"]


def _nat_fix(net: NetConfig, public: str) -> str:
    port = net.port or 31337
    return (f"train as a client (--client-mode / net.client_mode = true: it connects out, others reduce "
            f"its parts); or forward TCP and UDP {port} on the router to this machine and run with --port "
            f"{port} --public-ip {public}; where no peer of the run can open a port: --relay here, with "
            f"a `bootstrap --relay` on a public machine as --initial-peers (one is enough; exchanges that "
            f"cannot punch a direct connection then cross it; docs/networking.md, \"Behind NAT\")")


def _relay_check(relay: str, probe: RelayProbe) -> Check:
    """The ``relay`` line of one relay: its probe's verdict and what to do."""
    if probe.verdict is RelayVerdict.CARRIES:
        return Check("relay", "ok", f"{relay} carried {probe.moved_bytes} bytes through one relayed connection "
                     f"({probe.seconds:.1f} s)")
    if probe.verdict is RelayVerdict.LIMITED:
        return Check("relay", "FAIL", f"{relay} reset a relayed connection after {probe.moved_bytes} of "
                     f"{PROBE_BYTES} bytes (go-libp2p's default limit, {DEFAULT_RELAY_DATA_LIMIT} bytes per "
                     f"connection): every exchange of a round relayed through it fails",
                     "restart that bootstrap with --relay (`bootstrap --relay` tests its relay at start and "
                     "restarts its p2p daemon until it carries); a bootstrap without --relay is no relay: "
                     "drop it from the --initial-peers of --relay peers")
    return Check("relay", "warn", f"{relay}: no relayed connection could be opened through it "
                 f"({probe.detail or 'no detail'}); whether it carries a round is unknown",
                 "check that it runs as `bootstrap --relay` (a bootstrap without --relay serves no reservation "
                 "that carries a round) and that this machine reaches its port")


def _probe_nat(echoes: list[tuple[str, int]]):
    """``probe_nat`` from two fresh ports (blocking), freed afterwards."""
    holders = reserve_ports(2)
    try:
        return probe_nat(*(h.getsockname()[1] for h in holders), echoes)
    finally:
        for holder in holders:
            holder.close()


class _Doctor:
    """The state the checks share: the listening daemon ("ours") and the client DHT node."""

    def __init__(self, net: NetConfig, timeout: float):
        self.net, self.timeout = net, timeout
        self.host, self.announce = listen_maddrs(net)
        self.ours: Optional[Any] = None  # a p2p daemon listening and announcing like the peer would
        self.ours_maddrs: list[str] = []
        self.node: Optional[Any] = None  # a client DHT node connected to the initial peers
        self.helper: Optional[Any] = None  # the initial peer asked for the dial-back
        self.reached: list[str] = []

    async def p2pd(self) -> Check:
        binary = importlib.resources.files("hivemind.hivemind_cli") / "p2pd"
        reinstall = "reinstall hivemind: pip install --force-reinstall --no-deps hivemind==1.1.12"
        if not os.access(str(binary), os.X_OK):
            return Check("p2pd", "FAIL", f"{binary} is missing or not executable", reinstall)
        t0 = time.monotonic()
        try:
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=self.timeout)
        except Exception as e:
            return Check("p2pd", "FAIL", f"{binary} does not start: {short_error(e)}",
                         f"{reinstall}; on an unusual platform build p2pd with Go (HIVEMIND_BUILDGO=1)")
        await p2p.shutdown()
        return Check("p2pd", "ok", f"{binary} starts ({(time.monotonic() - t0) * 1e3:.0f} ms)")

    async def listen(self) -> Check:
        identity = self.net.identity_path
        if identity:
            ensure_identity(identity)  # the same key the node will use: the shared address stays valid
        try:
            self.ours = await P2P.create(host_maddrs=self.host, announce_maddrs=self.announce or None,
                                         identity_path=identity, startup_timeout=self.timeout)
        except Exception as e:
            return Check("listen", "FAIL", f"cannot listen on {' '.join(self.host)}",
                         explain_start_error(e, self.net, self.host))
        self.ours_maddrs = rank_maddrs(await self.ours.get_visible_maddrs())
        return Check("listen", "ok", f"listening on {' '.join(self.host)}; announcing {' '.join(self.ours_maddrs)}")

    async def bootstrap(self) -> Check:
        peers = self.net.initial_peers
        if not peers:
            return Check("bootstrap", "skip", "no --initial-peers given")
        t0 = time.monotonic()
        try:
            probe_host, _ = listen_maddrs(NetConfig(initial_peers=peers))
            # the outer bound is wider than the daemon's own, which fails with a clearer message
            # the run's validators (metrics, run key): without them its signed records cannot even be decoded
            self.node = await asyncio.wait_for(DHTNode.create(
                initial_peers=peers, client_mode=True, host_maddrs=probe_host, startup_timeout=self.timeout,
                record_validator=CompositeValidator(metrics_validators(self.net.run_id) + run_validators(self.net))),
                2 * self.timeout)
            ids = [PeerID.from_base58(Multiaddr(m)["p2p"]) for m in peers]
            pings = await asyncio.gather(*(asyncio.wait_for(self.node.protocol.call_ping(p), self.timeout)
                                           for p in ids), return_exceptions=True)
            alive = [p for p, r in zip(ids, pings) if r is not None and not isinstance(r, BaseException)]
            found = await asyncio.wait_for(self.node.get(run_key(self.net.run_id, "metrics"), latest=True),
                                           self.timeout)
        except Exception as e:
            host, port = _host_port(peers[0])
            reason = f"no answer in {self.timeout:g} s" if isinstance(e, asyncio.TimeoutError) else short_error(e)
            return Check("bootstrap", "FAIL", f"cannot reach {' '.join(peers)} ({reason})",
                         f"check that the bootstrap node runs and that this is the address it printed at its "
                         f"current start (its /p2p/ id changes unless it uses --identity-path); test the port "
                         f"from here with `nc -vz {host} {port}`")
        if not alive:
            return Check("bootstrap", "FAIL", "connected, but no initial peer answers DHT pings",
                         "the address belongs to a node that is not a DHT server (a client-mode peer?); use "
                         "the address printed by `opendiloco-stream bootstrap`")
        self.helper = alive[0]
        dead = [m for m, p in zip(peers, ids) if p not in alive]
        if dead:
            return Check("bootstrap", "warn", f"{len(alive)}/{len(ids)} initial peers answer; not: {' '.join(dead)}",
                         "drop or refresh the dead addresses")
        publishing = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        return Check("bootstrap", "ok", f"{len(alive)}/{len(ids)} initial peers answer; run '{self.net.run_id}' "
                     f"has {publishing} peer(s) publishing metrics (lookup done {(time.monotonic() - t0) * 1e3:.0f} "
                     f"ms after start)")

    async def _dial(self, ask: Callable[[float], Any], here: dict[str, Callable[[], Any]]
                    ) -> tuple[dict[str, Optional[str]], Optional[str]]:
        """``{target: None (reached) or reason}`` from the bootstrap (``ask(bound)``, the bootstrap
        dials two at a time), else dialed from this machine (``here``); the second item says why
        it was dialed from here (None: the bootstrap did it)."""
        why_local = "no bootstrap to ask"
        if self.helper is not None:
            try:
                return await ask(self.timeout * math.ceil(len(here) / 2) + 5), None
            except (LookupError, TimeoutError) as e:
                why_local = str(e)
        return {target: await dial() for target, dial in here.items()}, why_local

    async def dial_back(self) -> Check:
        if not self.ours_maddrs:
            return Check("dial-back", "skip", "nothing is listening (see listen)")
        candidates = self.ours_maddrs
        if self.net.initial_peers and not all(_ip_is(m, "is_loopback") for m in self.net.initial_peers):
            # a remote helper dialing 127.0.0.1 reaches itself, not us
            candidates = [m for m in candidates if not _ip_is(m, "is_loopback")] or candidates
        results, why_local = await self._dial(
            lambda bound: request_dialback(self.node.p2p, self.helper, candidates, bound),
            {m: lambda m=m: probe_dial(m, self.timeout) for m in candidates})
        local_only = why_local is not None
        self.reached = [m for m, err in results.items() if err is None]
        failed = "; ".join(f"{m}: {err}" for m, err in results.items() if err is not None)
        if not self.reached and self.net.relay:
            return Check("dial-back", "warn", f"no announced address could be dialed ({failed}); --relay: others "
                         "reach this peer through a relay once its p2p daemon reserved a slot there (see nat)")
        if not self.reached and self.net.client_mode:
            return Check("dial-back", "warn", f"no announced address could be dialed ({failed}); client mode: "
                         "fine, this peer only connects out")
        if not self.reached:
            return Check("dial-back", "FAIL", f"no announced address could be dialed ({failed})", _reach_fix(self.net))
        if local_only:
            return Check("dial-back", "warn", f"dialed from THIS machine only ({why_local}): "
                         f"{' '.join(self.reached)} accepts connections; reachability from other machines is "
                         f"not verified", "run the bootstrap with `opendiloco-stream bootstrap` (it answers "
                         "dial-back requests) or run doctor from another machine against your address")
        extra = f" (not: {failed})" if failed else ""
        return Check("dial-back", "ok", f"the bootstrap ({self.helper}) opened a new connection to "
                     f"{' '.join(self.reached)}{extra}")

    async def nat(self) -> Check:
        """Behind NAT or not, from the address the bootstrap sees (see the module docstring)."""
        if self.helper is None:
            return Check("nat", "skip", "no bootstrap to ask")
        try:
            observed = await request_observed(self.node.p2p, self.helper, self.timeout)
        except (LookupError, TimeoutError) as e:
            return Check("nat", "skip", f"the bootstrap does not say where it sees this machine from ({e})")
        seen = sorted({ip4_of(m) for m in observed} - {""})
        ours = [m for m in self.ours_maddrs if "/p2p-circuit" not in str(m)]  # a relay's address is not ours
        own = sorted({ip for ip in map(ip4_of, [*ours, *self.host, *_route_source(self.net.initial_peers)])
                      if ip and not ipaddress.ip_address(ip).is_loopback} - {"0.0.0.0"})
        if not seen:
            return Check("nat", "skip", "the bootstrap sees no IPv4 connection from this machine")
        if set(seen) & set(own) or not own:
            return Check("nat", "ok", f"not behind NAT: the bootstrap sees this machine as {' '.join(seen)}")
        detail = (f"behind NAT: this machine announces {' '.join(own)} but the bootstrap sees it as "
                  f"{' '.join(seen)} (a router translates its address)")
        if self.reached:
            return Check("nat", "ok", f"{detail}; reachable anyway at {' '.join(self.reached)} (a forwarded port)")
        if self.net.client_mode:
            return Check("nat", "ok", f"{detail}; client mode: it connects out only, which works behind NAT")
        if self.net.relay:
            return self._relayed(detail)
        return Check("nat", "FAIL", f"{detail}; nobody can open a connection to it", _nat_fix(self.net, seen[0]))

    def _relayed(self, detail: str) -> Check:
        """Behind NAT with ``--relay``: fine, its p2p daemon reserves a slot on each initial peer
        at start (whether each relay carries a round: the ``relay`` check)."""
        n = len(relay_nodes(self.net.initial_peers))
        return Check("nat", "ok", f"{detail}; --relay: reached through the {n} relay(s) among the initial peers "
                     f"(a slot on each, reserved at start)")

    async def relays(self) -> list[Check]:
        """With ``--relay``, one check per relay among the initial peers: whether it carries a
        relayed connection past go-libp2p's default 128 KiB (``net.relay_check.probe_relay``)."""
        if not self.net.relay:
            return [Check("relay", "skip", "no --relay: the initial peers are not used as relays")]
        if self.helper is None:
            return [Check("relay", "skip", "no initial peer answered (see bootstrap)")]
        nodes = relay_nodes(self.net.initial_peers)
        loop = asyncio.get_running_loop()
        probes = await asyncio.gather(*(loop.run_in_executor(None, self._probe_relay, maddrs)
                                        for maddrs in nodes.values()))
        return [_relay_check(maddrs[0], probe) for maddrs, probe in zip(nodes.values(), probes)]

    def _probe_relay(self, maddrs: list[str]) -> RelayProbe:
        """:func:`probe_relay` (blocking), once more if its helper daemons reached no relayed stream."""
        probe = probe_relay(maddrs, timeout=2 * self.timeout)
        if probe.verdict is RelayVerdict.UNKNOWN:
            time.sleep(1.0)
            probe = probe_relay(maddrs, timeout=2 * self.timeout)
        return probe

    async def punch(self) -> Check:
        """Which NAT, from the run's echo servers: whether groupmates can punch to this peer."""
        net, name = self.net, "punch"
        if not net.direct:
            return Check(name, "skip", "--no-direct: no direct data path, nothing to punch")
        if not net.punch:
            return Check(name, "skip", "--no-punch: groupmates behind NAT are reached through the relay")
        if self.node is None:
            return Check(name, "skip", "no bootstrap to ask for the run's echo servers")
        try:
            found = await asyncio.wait_for(self.node.get(echo_key(net.run_id), latest=True), self.timeout)
        except Exception as e:
            return Check(name, "skip", f"the run's echo servers could not be looked up ({short_error(e)})")
        echoes = parse_echoes(None if found is None else found.value)
        if not echoes:
            detail = f"run '{net.run_id}' announces no echo server, so no peer can punch a direct connection"
            if net.relay:
                return Check(name, "warn", f"{detail}: every exchange with a groupmate behind NAT crosses the relay",
                             "run the relays as `bootstrap --relay` (each serves an echo) and let their echo port "
                             "through a firewall in front of them (`bootstrap --relay --echo-port PORT`)")
            return Check(name, "skip", detail)
        try:
            probe = await asyncio.get_running_loop().run_in_executor(None, _probe_nat, echoes)
        except OSError as e:
            return Check(name, "warn", f"no echo server of the run answered ({short_error(e)}): no punching; "
                         f"groupmates behind NAT go through the relay",
                         "let the relays' echo port through the firewalls on the way (`bootstrap --relay --echo-port`)")
        seen = f"{probe.send_seen[0]}:{probe.send_seen[1]}"
        if probe.kind is NatKind.OPEN:
            return Check(name, "ok", f"no NAT on the way to the echo servers ({seen}): groupmates behind NAT open "
                         f"direct connections to this peer by punching")
        if probe.kind is NatKind.CONE:
            return Check(name, "ok", f"NAT: cone (a home router: one public port, {seen}, for {probe.echoes} echo "
                         f"servers): punching works with groupmates behind a cone NAT or none; one behind a "
                         f"symmetric NAT is reached through the relay")
        if probe.kind is NatKind.SYMMETRIC:
            return Check(name, "warn", f"NAT: symmetric (a new public port per destination, {seen} for the first "
                         f"echo): no punch can work; exchanges with groupmates behind NAT cross the relay",
                         "forward a port to this machine (--port P --public-ip IP --data-port D), or use a router "
                         "with endpoint-independent mapping (most home routers; not carrier-grade NAT)")
        return Check(name, "warn", f"NAT: unknown (one echo server answered and saw the port changed, {seen}): "
                     f"maybe symmetric; groupmates do not count on a punch to this peer",
                     "run a second `bootstrap --relay` (each serves an echo) so two echoes tell the NAT's kind")

    async def data_port(self) -> Check:
        net, name = self.net, "data port"
        if net.client_mode:
            return Check(name, "skip", "client mode: this peer reduces no part and listens on no data port")
        if net.relay:
            return Check(name, "skip", "--relay: every byte goes through the p2p daemon (encrypted), relayed")
        if not net.direct:
            return Check(name, "skip", "--no-direct: every byte goes through the p2p daemon (encrypted)")
        if not net.data_port:
            return Check(name, "skip", "random data ports (no --data-port): where a firewall drops them, rounds "
                         "use the p2p daemon instead (slower)", "to open them in a firewall, fix them: --data-port D "
                         "(fragment p listens on TCP D + p)")
        port = net.data_port
        bind = next((ip for ip in map(ip4_of, self.host) if ip), "0.0.0.0")
        try:
            server = await asyncio.start_server(_hang_up, bind, port)
        except OSError as e:
            return Check(name, "FAIL", f"cannot listen on TCP {bind}:{port} ({e.strerror or e})",
                         f"pick another --data-port or stop the process holding it (ss -ltnp | grep :{port})")
        try:
            if not self.reached:
                return Check(name, "skip", f"listening on TCP {port}; not dialed, since no p2p address was "
                             f"reachable (see dial-back)")
            targets = sorted({(ip, port) for ip in map(ip4_of, self.reached) if ip})
            results, why_local = await self._dial(
                lambda bound: request_tcp_dialback(self.node.p2p, self.helper, self.reached, targets, bound),
                {f"{ip}:{p}": lambda ip=ip, p=p: probe_tcp(ip, p, self.timeout) for ip, p in targets})
            local_only = why_local is not None
        finally:
            server.close()
            await server.wait_closed()
        reached = [t for t, err in results.items() if err is None]
        failed = "; ".join(f"{t}: {err}" for t, err in results.items() if err is not None)
        more = "and the next ports, one per fragment"
        if not reached:
            return Check(name, "FAIL", f"no TCP connection to the data port ({failed})",
                         f"open/forward TCP {port} ({more}) to this machine, or use --no-direct (slower, encrypted)")
        if local_only:
            return Check(name, "warn", f"dialed from THIS machine only ({why_local}): {' '.join(reached)} accepts "
                         f"connections; reachability from other machines is not verified")
        extra = f" (not: {failed})" if failed else ""
        return Check(name, "ok", f"the bootstrap opened a TCP connection to {' '.join(reached)}{extra}; "
                     f"open the next ports too, one per fragment")

    async def link(self) -> Check:
        peers = self.net.initial_peers
        if not peers:
            return Check("link", "skip", "no --initial-peers given")
        rtts = await asyncio.get_running_loop().run_in_executor(
            None, lambda: probe_peers(peers, samples=5, timeout=min(5.0, self.timeout)))
        known = [r for r in rtts.values() if r is not None]
        if not known:
            return Check("link", "warn", "no initial peer answered a TCP handshake: RTT unknown")
        rtt, rate = max(known), self.net.link_mbit
        parts = ["RTT " + ", ".join(f"{m.split('/p2p/')[0]} {'-' if r is None else f'{r * 1e3:.0f} ms'}"
                                    for m, r in rtts.items())]
        bdp, limits = bdp_bytes(rate, rtt), kernel_buffer_limits()
        grow = min(limits["rcv_autotune_max"], limits["snd_autotune_max"]) or None
        parts.append(f"in flight at {rate:g} Mbit/s: {bdp / 1e6:.2f} MB; buffers grow to "
                     + (f"{grow / 1e6:.1f} MB" if grow else "(unknown)"))
        fixes = []
        if grow is not None and bdp > grow:
            fixes.append(f"raise the TCP buffer maxima to at least {2 * bdp:.0f} bytes (sysctl -w net.ipv4.tcp_rmem="
                         f"'4096 131072 {2 * bdp:.0f}' net.ipv4.tcp_wmem='4096 16384 {2 * bdp:.0f}')")
        slow = restarts_after_idle()
        if slow and rtt >= 0.02:
            parts.append("tcp_slow_start_after_idle=1")
            fixes.append(f"sysctl -w net.ipv4.tcp_slow_start_after_idle=0, or allow bbr in "
                         f"net.ipv4.tcp_allowed_congestion_control (each "
                         f"round's kept-open connection then keeps its window instead of ~6 round trips of slow "
                         f"start: ~{6 * rtt:.1f} s a round here)")
        if rtt * 1e3 >= PREMATCH_AUTO_MIN_RTT_MS:
            parts.append(f"at this RTT peers form each round's group ahead (--prematch-steps auto, the default from "
                         f"{PREMATCH_AUTO_MIN_RTT_MS:g} ms: ~{PREMATCH_AUTO_RTTS} round trips of matchmaking, "
                         f"~{PREMATCH_AUTO_RTTS * rtt:.1f} s, leave the round); peer --dry-run says whether a round "
                         f"of your H, P and codec fits this link")
        detail = "; ".join(parts)
        return Check("link", "warn" if fixes else "ok", detail, "; ".join(fixes)) if fixes else Check("link", "ok", detail)

    def share(self) -> Check:
        if not self.reached:
            return Check("share", "skip", "no address was verified")
        pinned = (f"peer id pinned by {self.net.identity_path}" if self.net.identity_path else
                  "the /p2p/ id is this check's own: a node prints its address at start, or pin it with "
                  "--identity-path")
        return Check("share", "ok", f"--initial-peers {self.reached[0]}  ({pinned})")

    @staticmethod
    def kernels() -> Check:
        if native.available():
            return Check("kernels", "ok", f"native codec kernels loaded (built in {native.cache_dir()})")
        return Check("kernels", "warn", f"codecs run in torch, slower on the CPU: {native.why_not()}",
                     "install a C compiler (Debian/Ubuntu: apt install build-essential) or point $CC at one")

    async def close(self) -> None:
        if self.node is not None:
            await self.node.shutdown()
        if self.ours is not None:
            await self.ours.shutdown()


async def run_checks(net: NetConfig, *, timeout: float = 15.0,
                     report: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Run the checks in order, calling ``report`` on each as it completes; return them all.

    ``net`` must be valid (:func:`check_config`). Every daemon started here is shut down before
    returning. Without a working p2pd the other checks are skipped.
    """
    # hivemind's callbacks can fail after a check already gave up on them: not worth a traceback
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: logger.debug("%s", context))
    doctor = _Doctor(net, timeout)
    checks: list[Check] = []

    def add(check: Check) -> Check:
        checks.append(check)
        report(check)
        return check

    try:
        if add(await doctor.p2pd()).status == "FAIL":
            for name in ("listen", "bootstrap", "dial-back", "nat", "relay", "punch", "data port", "link", "share"):
                add(Check(name, "skip", "needs p2pd"))
            add(doctor.kernels())
            return checks
        add(await doctor.listen())
        add(await doctor.bootstrap())
        add(await doctor.dial_back())
        add(await doctor.nat())
        for check in await doctor.relays():
            add(check)
        add(await doctor.punch())
        add(await doctor.data_port())
        add(await doctor.link())
        add(doctor.share())
        add(doctor.kernels())
        return checks
    finally:
        await doctor.close()


def check_config(net: NetConfig) -> None:
    """Validate ``net`` up front (bad addresses, run id) so the command can exit 2 before any check."""
    check_run_id(net.run_id)
    listen_maddrs(net)
