"""Starting a hivemind DHT node from a :class:`~opendiloco_stream.config.NetConfig`, with clear errors.

Where a node listens and what it announces (the knobs that matter on a wide-area network):

* nothing given: listen on ``127.0.0.1`` (a random port) when every initial peer is on this machine
  (or there is none), otherwise on all interfaces (``0.0.0.0``). Enough for a local run; a
  bootstrap node started this way is reachable from this machine only.
* ``port=P``: listen on ``/ip4/0.0.0.0/tcp/P`` and ``/ip4/0.0.0.0/udp/P/quic-v1``. Open this port in
  the firewall / forward it on the router.
* ``public_ip=IP`` (needs a fixed port): announce ``/ip4/IP/tcp/P`` and ``/ip4/IP/udp/P/quic-v1``.
  Needed behind NAT (cloud VMs, home routers), where the node cannot see its public address.
* ``host_maddrs`` / ``announce_maddrs``: full control; they win over ``port`` / ``public_ip``.
* ``identity_path``: a private key file giving a stable peer id (created on first use). A bootstrap
  node needs one, or the address others were given changes at every restart.

``opendiloco-stream doctor`` checks all of this from the outside (see docs/networking.md).
Every DHT key of a run goes through ``net.keys.run_key``, so runs sharing a DHT never see each other.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.auth import run_validators
from opendiloco_stream.net.keys import NetError, check_run_id
from opendiloco_stream.net.lifecycle import descendants, is_running, kill_process_tree, process_name, terminate_pids
from opendiloco_stream.net.routes import keep_routes

logger = logging.getLogger(__name__)

EXAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/QmXcY4ZNkgxUS8Ca41UAYUdtqNjvHj6Lk2SHv9iBR5Yqgh"
EXAMPLE_LISTEN = "/ip4/0.0.0.0/tcp/31337"


# ---------------------------------------------------------------------------------------- addresses


def parse_maddr(value: str, *, what: str = "multiaddr", example: str = EXAMPLE_LISTEN, need_peer_id: bool = False):
    """Parse one multiaddr; a bad one raises NetError naming it and showing a good one."""
    try:
        maddr = Multiaddr(value.strip())
    except Exception as e:  # the multiaddr package raises several unrelated types
        reason = str(e).split(": ", 1)[-1] if ": " in str(e) else str(e)
        raise NetError(f"{what} {value!r} is not a valid multiaddr ({reason}); expected e.g. {example}") from None
    if need_peer_id and "p2p" not in maddr:
        raise NetError(f"{what} {value!r} has no /p2p/<peer id> part; copy the full line the bootstrap "
                       f"node printed, e.g. {example}")
    return maddr


def _tcp_or_udp_port(maddr) -> Optional[int]:
    for proto in ("tcp", "udp"):
        if proto in maddr:
            return int(maddr[proto])
    return None


def ip4_of(maddr: Any) -> str:
    """The IPv4 address of a multiaddr (``/ip4/A.B.C.D/...``), "" if it has none."""
    parts = str(maddr).split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "ip4" else ""


def _is_loopback(maddr) -> bool:
    for proto in ("ip4", "ip6"):
        if proto in maddr:
            return ipaddress.ip_address(maddr[proto]).is_loopback
    return False


#: the ``force_reachability`` of a ``--relay`` peer's p2p daemon: private, and its relays static
#: (registered in hivemind's ``P2P.FORCE_REACHABILITY_MAPPING`` by :func:`relayed_peer_kwargs`)
PRIVATE_STATIC_RELAYS = "private, static relays"


def relay_nodes(initial_peers: Iterable[str]) -> dict[str, list[str]]:
    """The initial peers of a ``--relay`` peer, which are its relays, by node: ``{peer id:
    multiaddrs}``, TCP addresses first, else in the order given."""
    nodes: dict[str, list[str]] = {}
    for m in sorted(map(str, initial_peers), key=lambda m: "/tcp/" not in m):  # a stable sort
        nodes.setdefault(m.rstrip("/").rsplit("/p2p/", 1)[-1], []).append(m)
    return nodes


def relayed_peer_kwargs(initial_peers: Sequence[str]) -> dict[str, Any]:
    """``hivemind.DHT`` keyword arguments of a ``--relay`` peer: a private node whose p2p daemon
    reserves a slot at once on each initial peer, taken as its relays.

    p2pd's autorelay, fed relay candidates from its DHT, reserves only once it knows 4 of them, or
    after a boot delay of 3 minutes (go-libp2p v0.32 autorelay ``minCandidates`` and ``bootDelay``).
    Given ``-trustedRelays`` and ``-relayDiscovery=0`` it uses those relays statically instead
    (``EnableAutoRelayWithStaticRelays``: as many candidates as relays, no wait). hivemind 1.1.12's
    ``P2P.create`` passes ``trusted_relays`` as ``-trustedRelays`` but has no argument for
    ``-relayDiscovery``; it turns ``force_reachability`` into daemon flags through the class
    attribute ``P2P.FORCE_REACHABILITY_MAPPING`` (hivemind/p2p/p2p_daemon.py, 1.1.12), where one
    more entry, :data:`PRIVATE_STATIC_RELAYS`, adds ``-relayDiscovery=0`` to
    ``-forceReachabilityPrivate=1``. hivemind's DHT process is forked (``DHT`` is a
    ``ForkProcess``), so it sees the entry. Each relay is passed once, at its first TCP address
    (else its first): p2pd counts every address as a relay, and autorelay would wait for as many
    distinct ones. docs/networking.md, "Two peers both behind NAT".
    """
    if not initial_peers:
        raise NetError("--relay needs its relays among the initial peers: pass the address each "
                       "`bootstrap --relay` printed as --initial-peers")
    P2P.FORCE_REACHABILITY_MAPPING[PRIVATE_STATIC_RELAYS] = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
    return {"use_relay": True, "use_auto_relay": True, "force_reachability": PRIVATE_STATIC_RELAYS,
            "trusted_relays": [maddrs[0] for maddrs in relay_nodes(initial_peers).values()]}


def listen_maddrs(net: NetConfig) -> tuple[list[str], list[str]]:
    """``(host_maddrs, announce_maddrs)`` for ``net``, shortcuts resolved and every address validated."""
    initial = [parse_maddr(p, what="initial peer", example=EXAMPLE_PEER, need_peer_id=True) for p in net.initial_peers]

    if net.host_maddrs:
        host = [str(parse_maddr(m, what="host multiaddr")) for m in net.host_maddrs]
    elif net.port is not None:
        host = [f"/ip4/0.0.0.0/tcp/{net.port}", f"/ip4/0.0.0.0/udp/{net.port}/quic-v1"]
    elif net.public_ip is None and all(_is_loopback(m) for m in initial):
        host = ["/ip4/127.0.0.1/tcp/0"]  # a local run: never expose a port it does not need
    else:
        host = ["/ip4/0.0.0.0/tcp/0"]

    if net.announce_maddrs:
        announce = [str(parse_maddr(m, what="announce multiaddr", example="/ip4/203.0.113.7/tcp/31337"))
                    for m in net.announce_maddrs]
    elif net.relay:  # "reach me through this relay": the initial peers' circuit addresses
        announce = [f"{m}/p2p-circuit" for m in net.initial_peers if not _is_loopback(parse_maddr(m))]
    elif net.public_ip is not None:
        try:
            ip = ipaddress.ip_address(net.public_ip.strip())
        except ValueError:
            raise NetError(f"--public-ip {net.public_ip!r} is not an IP address (e.g. --public-ip 203.0.113.7)") from None
        port = net.port or next((p for p in map(_tcp_or_udp_port, map(parse_maddr, host)) if p), None)
        if not port:
            raise NetError("--public-ip needs a fixed port to announce: add --port 31337 (and open/forward that port)")
        family = "ip4" if ip.version == 4 else "ip6"
        announce = [f"/{family}/{ip}/tcp/{port}", f"/{family}/{ip}/udp/{port}/quic-v1"]
    else:
        announce = []
    for m in announce:
        if _tcp_or_udp_port(parse_maddr(m)) == 0:
            raise NetError(f"announce multiaddr {m!r} has port 0: announce the fixed port you listen on (e.g. --port 31337)")
    return host, announce


def rank_maddrs(maddrs: Iterable[Any]) -> list[str]:
    """``maddrs`` best first for others to dial: public, then private, then loopback; TCP before
    QUIC; wildcard addresses (0.0.0.0, ::) dropped."""

    def rank(m: Any) -> tuple[int, int]:
        scope = 1  # dns names and anything without an IP: as good as a private address
        for proto in ("ip4", "ip6"):
            if proto in m:
                ip = ipaddress.ip_address(m[proto])
                scope = 3 if ip.is_unspecified else 2 if ip.is_loopback else 0 if ip.is_global else 1
        return scope, 0 if "tcp" in m else 1

    ranked = sorted((Multiaddr(str(m)) for m in maddrs), key=rank)
    return [str(m) for m in ranked if rank(m)[0] < 3]


def visible_maddrs(dht: Any, latest: bool = True) -> list[str]:
    """The multiaddrs other peers should pass as ``--initial-peers``, best first (:func:`rank_maddrs`),
    each with its ``/p2p/<peer id>`` suffix."""
    return rank_maddrs(dht.get_visible_maddrs(latest=latest))


# ---------------------------------------------------------------------------------------- identity


def ensure_identity(path: str) -> str:
    """Return the peer id stored in the key file ``path``, creating the file (and its folder) if missing."""
    p = Path(path).expanduser()
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        # written to a temporary file and renamed: two peers starting at once never read half a key
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(key.SerializeToString())
        os.chmod(tmp, 0o400)
        try:
            os.link(tmp, p)  # fails if another process created it meanwhile: theirs wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        return PeerID.from_identity(p.read_bytes()).to_base58()
    except Exception:
        raise NetError(f"identity file {p} is not a libp2p private key: delete it to create a new one") from None


# ---------------------------------------------------------------------------------------- start/stop


def explain_start_error(e: BaseException, net: NetConfig, host: Sequence[str]) -> str:
    msg = str(e)
    peers = " ".join(net.initial_peers)
    if "failed to connect to bootstrap peers" in msg or "none of the initial_peers responded" in msg:
        return (f"could not reach any initial peer ({peers}): check that the bootstrap node runs, that the "
                f"address is the one it printed at this start (the /p2p/ id changes unless it uses "
                f"--identity-path) and that its port is open; `opendiloco-stream doctor --initial-peers ...` "
                f"checks each step")
    if "address already in use" in msg:
        ports = sorted({str(_tcp_or_udp_port(parse_maddr(m))) for m in host} - {"0", "None"})
        port = "/".join(ports) or "the port"
        return (f"cannot listen on {' '.join(host)}: port {port} is already in use; pick another --port "
                f"or stop the process using it (`ss -ltnup | grep :{ports[0] if ports else 'PORT'}` shows it)")
    if "cannot assign requested address" in msg:
        return (f"cannot listen on {' '.join(host)}: that IP is not on this machine; listen on "
                f"{EXAMPLE_LISTEN} and put the public address in --public-ip / --announce-maddrs instead")
    if "already taken by another peer" in msg:
        return (f"another running peer already uses the identity in {net.identity_path}: stop it or pass a "
                f"different --identity-path")
    if "Daemon failed to start in" in msg:
        return (f"the p2p daemon did not start within {net.daemon_startup_timeout:g} s: raise "
                f"net.daemon_startup_timeout (ODS_NET__DAEMON_STARTUP_TIMEOUT) on a slow machine")
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return f"could not start the DHT node: {first}"


# the processes a started DHT had (its pid's children: p2pd), remembered by start_dht for stop_dht
_CHILDREN: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()


def start_dht(net: NetConfig, *, start_timeout: Optional[float] = None,
              record_validators: Iterable[Any] = (), **dht_kwargs: Any):
    """Start a ``hivemind.DHT`` for ``net`` and wait until it serves; raise NetError with the fix.

    ``start_timeout`` bounds the whole start (daemon, identity check, bootstrap); by default twice
    ``net.daemon_startup_timeout`` plus 10 s. ``dht_kwargs`` go to ``hivemind.DHT`` unchanged.
    On failure nothing is left running: the DHT process and its p2pd are killed.
    """
    check_run_id(net.run_id)
    record_validators = [*record_validators, *run_validators(net)]  # a run key signs and checks every record
    host, announce = listen_maddrs(net)
    identity = None
    if net.identity_path:
        identity = str(Path(net.identity_path).expanduser())
        ensure_identity(identity)
    timeout = start_timeout if start_timeout is not None else 2 * net.daemon_startup_timeout + 10
    if net.relay:  # a reservation on each initial peer, a static relay of p2pd's autorelay (docs/networking.md)
        dht_kwargs = {**relayed_peer_kwargs(net.initial_peers), **dht_kwargs}
    dht = hivemind.DHT(
        initial_peers=list(net.initial_peers) or None, start=False, host_maddrs=host,
        announce_maddrs=announce or None, identity_path=identity, client_mode=net.client_mode,
        startup_timeout=net.daemon_startup_timeout, record_validators=list(record_validators), **dht_kwargs,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
    except BaseException as e:
        if dht.pid is not None:
            kill_process_tree(dht.pid, timeout=2.0)
            dht.join(1.0)
        if isinstance(e, TimeoutError) or type(e).__name__ == "TimeoutError":
            raise NetError(f"the DHT node did not start within {timeout:g} s (initial peers: "
                           f"{' '.join(net.initial_peers) or 'none'}); check them with `opendiloco-stream doctor`") from None
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise NetError(explain_start_error(e, net, host)) from None
    # remembered now: if the DHT process dies, its p2pd is re-parented and no longer found through it
    _CHILDREN[dht] = {p: process_name(p) for p in descendants(dht.pid)}
    keep_routes(dht)  # re-find the peers a partition made it drop (net/routes.py)
    logger.info("DHT node %s listening on %s", dht.peer_id, " ".join(host))
    return dht


def stop_dht(dht: Any, timeout: float = 5.0) -> None:
    """Shut ``dht`` down and make sure its process and p2pd are gone (SIGKILL after ``timeout``).

    When p2pd is already dead (Ctrl+C in a terminal reaches it too: it shares the terminal's
    process group), hivemind's graceful shutdown would wait for it in vain; the DHT process is then
    terminated directly. Either way nothing of the node is left running, including a p2pd whose
    DHT process died earlier (start_dht remembered it).
    """
    pid = dht.pid
    known = dict(_CHILDREN.get(dht, {}))
    if pid is not None and is_running(pid):
        known.update({p: process_name(p) for p in descendants(pid)})
    # a remembered pid only counts while it still runs the same program (pids get reused)
    children = [p for p, name in known.items() if is_running(p) and process_name(p) == name]
    if any(known[p] == "p2pd" for p in children):
        try:
            dht.shutdown()
        except Exception as e:  # a broken pipe to a dead DHT process: the kill below finishes the job
            logger.debug("DHT shutdown: %r", e)
    killed = terminate_pids(children + ([pid] if pid is not None else []), timeout)
    if pid is not None:
        dht.join(1.0)
        if pid in killed:  # hivemind's futures are guarded by cross-process locks it may have held
            logger.warning("the DHT process %s had to be killed; if a later DHT start in this process hangs, "
                           "restart the process", pid)


# -------------------------------------------------------------------------------------------- logs


class _ShutdownNoise(logging.Filter):
    """Drops p2pd's complaint about its control socket closing, logged on every Ctrl+C."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


def quiet_hivemind(verbose: bool = False, level: Optional[int] = None) -> None:
    """hivemind logs INFO to stderr by default; commands show warnings only unless --verbose."""
    hivemind_logger = get_logger("hivemind")  # also installs hivemind's handler, which we filter
    hivemind_logger.setLevel(level if level is not None else logging.DEBUG if verbose else logging.WARNING)
    if not verbose:
        for handler in hivemind_logger.handlers:
            if not any(isinstance(f, _ShutdownNoise) for f in handler.filters):
                handler.addFilter(_ShutdownNoise())
