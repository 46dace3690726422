"""``opendiloco-stream bootstrap``: run a DHT-only node that peers join with ``--initial-peers``.

Prints one ``--initial-peers MADDR`` line per address on stdout, the one to use first (status and
hints go to stderr), optionally writes the addresses to ``--addr-file`` (atomically, one per
line) for scripts, then serves until Ctrl+C / SIGTERM and shuts down cleanly (exit 0).

For peers on other machines: ``--port 31337`` (open it in the firewall), ``--public-ip IP`` behind
NAT, and ``--identity-path bootstrap.key`` so the address stays the same across restarts. The node
also answers ``doctor``'s dial-back requests and validates the run's metrics records; with the run's
``--run-key-file`` (and its ``--run-id``) it also refuses records not signed with the key.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import tempfile
from pathlib import Path

from opendiloco_stream.net.flags import add_network_flags, net_config_from_args, verbose
from opendiloco_stream.net.lifecycle import GracefulShutdown, daemons, kill_stray_daemons

logger = logging.getLogger(__name__)
HEARTBEAT_PERIOD = 30.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bootstrap", help="run a DHT-only node; print the address peers pass as --initial-peers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_flags(p)
    p.add_argument("--addr-file", metavar="F", help="write this node's multiaddrs to F, one per line (atomically)")
    p.add_argument("--no-dialback", action="store_true", help="do not answer doctor's dial-back requests")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=False,
                   help="serve as a circuit relay for peers behind NAT that run with --relay (every byte of "
                   "their rounds crosses this node); --no-relay: do not (default)")
    p.add_argument("--echo-port", type=int, default=0, metavar="PORT",
                   help="with --relay: the TCP port of the echo server peers behind NAT learn their public "
                   "address from, for hole punching (default: a random free port; open it in a firewall)")
    p.set_defaults(func=run)


def write_addr_file(path: str, maddrs: list[str]) -> None:
    """Write ``maddrs`` one per line so that a reader never sees a partial file."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{m}\n" for m in maddrs))
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def _heartbeat(dht) -> None:
    """Look up a random key: the lookup pings neighbours and evicts dead ones from the routing
    table, so joining peers are not sent to peers that left long ago (as hivemind's run_dht does)."""
    try:
        dht.get(f"heartbeat_{secrets.token_hex(8)}", latest=True, return_future=True).result(HEARTBEAT_PERIOD)
    except Exception as e:  # a slow lookup is not a reason to stop serving
        logger.debug("heartbeat lookup: %r", e)


class _Echo:
    """A relay's echo server for hole punching (``transport/hivemind/punch.py``), announced on the DHT."""

    def __init__(self, dht, run_id: str, ips: list[str], port: int = 0):
        from opendiloco_stream.net.reachability import EchoServer  # lazy: loads hivemind; --help stays light
        self.dht, self.run_id, self.ips = dht, run_id, ips
        self.server = EchoServer("0.0.0.0", port)
        self.publish()

    def publish(self) -> None:
        from opendiloco_stream.transport.hivemind.punch import publish_echo  # lazy: loads torch; --help stays light
        publish_echo(self.dht, self.run_id, self.ips, self.server.port, ttl_s=4 * HEARTBEAT_PERIOD)

    def close(self) -> None:
        self.server.close()


def _start_echo(dht, run_id: str, maddrs: list[str], port: int = 0) -> "_Echo | None":
    """Peers behind NAT learn their public address and port from this node (hole punching)."""
    from opendiloco_stream.net.dht import ip4_of  # lazy: loads hivemind; --help stays light
    ips = [ip for ip in dict.fromkeys(ip4_of(m) for m in maddrs) if ip and ip != "0.0.0.0"]
    try:
        return _Echo(dht, run_id, ips, port) if ips else None
    except OSError as e:
        logger.warning("no echo server for hole punching: %s", e)
        return None


def _start_relay(net):
    """The DHT node as a circuit relay whose relayed connections carry a round (``net.relay_check``:
    p2pd may serve go-libp2p's default 128 KiB per connection instead; then it is restarted)."""
    from opendiloco_stream.net.relay_check import RelayVerdict, start_relay  # lazy: loads hivemind; --help stays light
    dht, probe = start_relay(net, use_relay=True, force_reachability="public")
    if probe.verdict is RelayVerdict.LIMITED:
        logger.warning("this relay still resets relayed connections after %d bytes (go-libp2p's default limit of "
                       "128 KiB) after restarts: rounds relayed through it fail; restart this bootstrap",
                       probe.moved_bytes)
    elif probe.verdict is RelayVerdict.UNKNOWN:
        logger.warning("could not test this relay (%s): if relayed rounds fail with resets, restart this bootstrap",
                       probe.detail)
    else:
        print(f"relay self-test: {probe.moved_bytes} bytes through one relayed connection in {probe.seconds:.1f} s",
              file=sys.stderr)
    return dht


def _is_local_only(maddrs: list[str]) -> bool:
    return all(m.startswith(("/ip4/127.", "/ip6/::1/")) for m in maddrs)


def run(args: argparse.Namespace) -> int:
    from opendiloco_stream.net.dht import (  # lazy: loads hivemind; --help stays light
        quiet_hivemind, start_dht, stop_dht, visible_maddrs)
    from opendiloco_stream.net.metrics import install_validators  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.net.reachability import DialbackService  # lazy: loads hivemind; --help stays light

    net = net_config_from_args(args)
    existing = daemons()
    quiet_hivemind(verbose(args))
    with GracefulShutdown() as stop:
        if args.relay:  # p2pd serves relay reservations only once it believes it is public; on a bare subnet nothing tells it
            dht = _start_relay(net)
        else:
            dht = start_dht(net)
        service = None
        try:
            # this node stores the run's metrics records: without the validators it would accept forged ones
            install_validators(dht, net.run_id)
            if not args.no_dialback:
                service = DialbackService(dht).start()
            maddrs = visible_maddrs(dht)
            echo = _start_echo(dht, net.run_id, maddrs, args.echo_port) if args.relay else None
            if args.addr_file:
                write_addr_file(args.addr_file, maddrs)
            print(f"bootstrap node {dht.peer_id} is up (run '{net.run_id}'); peers join with:", file=sys.stderr)
            for m in maddrs:
                print(f"--initial-peers {m}", flush=True)
            if _is_local_only(maddrs):
                print("note: reachable from this machine only; for other machines add --port 31337 (open it) "
                      "and, behind NAT, --public-ip <your public IP>", file=sys.stderr)
            if not net.identity_path:
                print("note: the /p2p/ id changes at every start; --identity-path bootstrap.key keeps it",
                      file=sys.stderr)
            print("serving; Ctrl+C (or SIGTERM) stops it", file=sys.stderr, flush=True)
            while not stop.wait(HEARTBEAT_PERIOD):
                _heartbeat(dht)
                if echo is not None:
                    echo.publish()
        finally:
            if echo is not None:
                echo.close()
            if not verbose(args):  # p2pd complains about the sockets we close on the way out
                quiet_hivemind(level=60)
            if service is not None:
                service.shutdown()
            stop_dht(dht)
            kill_stray_daemons(existing)  # a dial-back probe cut short by the shutdown
    print("bootstrap node stopped", file=sys.stderr)
    return 0
