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
5. ``share``     the address others should pass as ``--initial-peers``.

Status: ``ok``, ``FAIL`` (the peer will not work as configured), ``warn`` (it may), ``skip``.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import ipaddress
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.dht import NetError, explain_start_error, listen_maddrs, run_key
from opendiloco_stream.net.reachability import short_error, probe_dial, request_dialback


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
    host = parts[1] if len(parts) > 1 else "?"
    port = parts[3] if len(parts) > 3 else "?"
    return host, port


def _is_unspecified(maddr: Any) -> bool:
    for proto in ("ip4", "ip6"):
        if proto in maddr:
            return ipaddress.ip_address(maddr[proto]).is_unspecified
    return False


def _reach_fix(net: NetConfig) -> str:
    if net.port is None and not net.host_maddrs:
        return ("listen on a fixed port and open it: --port 31337 (allow TCP and UDP 31337 in the firewall, "
                "forward them on the router); behind NAT also add --public-ip <your public IP>; a peer that "
                "cannot be reached can still train as a client (net.client_mode = true)")
    return ("open/forward the listening port (TCP and UDP) to this machine and make sure the announced IP is "
            "this machine's public one (--public-ip / --announce-maddrs); or train as a client "
            "(net.client_mode = true)")


async def run_checks(net: NetConfig, *, timeout: float = 15.0,
                     report: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Run the checks in order, calling ``report`` on each as it completes; return them all.

    ``net`` must be valid (``listen_maddrs(net)`` raises NetError for bad addresses). Every
    daemon started here is shut down before returning.
    """
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    checks: list[Check] = []

    def add(check: Check) -> Check:
        checks.append(check)
        report(check)
        return check

    host, announce = listen_maddrs(net)
    ours: Optional[Any] = None
    node: Optional[Any] = None
    try:
        # 1. p2pd
        binary = importlib.resources.files("hivemind.hivemind_cli") / "p2pd"
        if not os.access(str(binary), os.X_OK):
            add(Check("p2pd", "FAIL", f"{binary} is missing or not executable",
                      "reinstall hivemind: pip install --force-reinstall --no-deps hivemind==1.1.12"))
            for name in ("listen", "bootstrap", "dial-back", "share"):
                add(Check(name, "skip", "needs p2pd"))
            return checks
        try:
            t0 = time.monotonic()
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=timeout)
            await p2p.shutdown()
            add(Check("p2pd", "ok", f"{binary} starts ({(time.monotonic() - t0) * 1e3:.0f} ms)"))
        except Exception as e:
            add(Check("p2pd", "FAIL", f"{binary} does not start: {short_error(e)}",
                      "reinstall hivemind (pip install --force-reinstall --no-deps hivemind==1.1.12); on an "
                      "unusual platform build p2pd with Go (HIVEMIND_BUILDGO=1)"))
            for name in ("listen", "bootstrap", "dial-back", "share"):
                add(Check(name, "skip", "needs p2pd"))
            return checks

        # 2. listen
        ours_maddrs: list[str] = []
        try:
            ours = await P2P.create(host_maddrs=host, announce_maddrs=announce or None,
                                    identity_path=net.identity_path, startup_timeout=timeout)
            ours_maddrs = [str(m) for m in await ours.get_visible_maddrs() if not _is_unspecified(m)]
            add(Check("listen", "ok", f"listening on {' '.join(host)}; announcing {' '.join(ours_maddrs)}"))
        except Exception as e:
            add(Check("listen", "FAIL", f"cannot listen on {' '.join(host)}",
                      explain_start_error(e, net, host)))

        # 3. bootstrap
        helper = None
        if not net.initial_peers:
            add(Check("bootstrap", "skip", "no --initial-peers given"))
        else:
            t0 = time.monotonic()
            try:
                probe_host, _ = listen_maddrs(NetConfig(initial_peers=net.initial_peers))
                node = await asyncio.wait_for(DHTNode.create(
                    initial_peers=net.initial_peers, client_mode=True, host_maddrs=probe_host,
                    startup_timeout=timeout), timeout)
                peer_ids = [PeerID.from_base58(Multiaddr(m)["p2p"]) for m in net.initial_peers]
                pings = await asyncio.gather(*(asyncio.wait_for(node.protocol.call_ping(p), timeout)
                                               for p in peer_ids), return_exceptions=True)
                alive = [p for p, r in zip(peer_ids, pings) if r is not None and not isinstance(r, BaseException)]
                await asyncio.wait_for(node.get(run_key(net.run_id, "metrics"), latest=True), timeout)
                helper = alive[0] if alive else None
                ms = (time.monotonic() - t0) * 1e3
                dead = [m for m, p in zip(net.initial_peers, peer_ids) if p not in alive]
                if not alive:
                    add(Check("bootstrap", "FAIL", "connected, but no initial peer answers DHT pings",
                              "the address belongs to a node that is not a DHT server (a client-mode peer?); "
                              "use the address printed by `opendiloco-stream bootstrap`"))
                elif dead:
                    add(Check("bootstrap", "warn", f"{len(alive)}/{len(peer_ids)} initial peers answer; "
                              f"not: {' '.join(dead)}", "drop or refresh the dead addresses"))
                else:
                    add(Check("bootstrap", "ok", f"{len(alive)}/{len(peer_ids)} initial peers answer; DHT "
                              f"lookup of run '{net.run_id}' done in {ms:.0f} ms"))
            except Exception as e:
                host_, port_ = _host_port(net.initial_peers[0])
                reason = short_error(e) if not isinstance(e, asyncio.TimeoutError) else f"no answer in {timeout:g} s"
                add(Check("bootstrap", "FAIL", f"cannot reach {' '.join(net.initial_peers)} ({reason})",
                          f"check that the bootstrap node runs and that this is the address it printed at its "
                          f"current start (its /p2p/ id changes unless it uses --identity-path); test the port "
                          f"from here with `nc -vz {host_} {port_}`"))

        # 4. dial-back
        reached: list[str] = []
        if not ours_maddrs:
            add(Check("dial-back", "skip", "nothing is listening (see listen)"))
        else:
            local_only = helper is None
            results: dict[str, Optional[str]] = {}
            where = ""
            if helper is not None:
                bound = timeout * math.ceil(len(ours_maddrs) / 2) + 5
                try:
                    results = await request_dialback(node.p2p, helper, ours_maddrs, bound)
                    where = f"the bootstrap ({helper})"
                except (LookupError, TimeoutError) as e:
                    local_only, where = True, str(e)
            if local_only:
                results = {m: await probe_dial(m, timeout) for m in ours_maddrs}
            reached = [m for m, err in results.items() if err is None]
            failed = "; ".join(f"{m}: {err}" for m, err in results.items() if err is not None)
            if not reached:
                add(Check("dial-back", "FAIL", f"no announced address could be dialed ({failed})", _reach_fix(net)))
            elif local_only:
                why = where or "no bootstrap to ask"
                add(Check("dial-back", "warn", f"dialed from THIS machine only ({why}): {' '.join(reached)} "
                          f"accepts connections; reachability from other machines is not verified",
                          "run the bootstrap with `opendiloco-stream bootstrap` (it answers dial-back "
                          "requests) or run doctor from another machine against your address"))
            else:
                extra = f" (not: {failed})" if failed else ""
                add(Check("dial-back", "ok", f"{where} opened a new connection to {' '.join(reached)}{extra}"))

        # 5. share
        if reached:
            pinned = (f"peer id pinned by {net.identity_path}" if net.identity_path else
                      "the /p2p/ id is this check's own: a node prints its address at start, or pin it with "
                      "--identity-path")
            add(Check("share", "ok", f"--initial-peers {reached[0]}  ({pinned})"))
        else:
            add(Check("share", "skip", "no address was verified"))
        return checks
    finally:
        if node is not None:
            await node.shutdown()
        if ours is not None:
            await ours.shutdown()


def check_config(net: NetConfig) -> None:
    """Validate ``net`` up front (bad addresses, run id) so the command can exit 2 before any check."""
    from opendiloco_stream.net.dht import check_run_id

    check_run_id(net.run_id)
    listen_maddrs(net)


__all__ = ["Check", "run_checks", "check_config", "NetError"]
