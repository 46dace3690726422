"""``opendiloco-stream doctor``: preflight a peer's networking before a run, with the fix for each failure.

Checks, in order: p2pd starts; a node listens where the peer would (--port / --host-maddrs); the
initial peers answer and the DHT serves the run; the bootstrap can open a new connection back to
the addresses this peer announces (--public-ip / --announce-maddrs); with --relay, that each
initial peer is a relay whose relayed connections carry a round (past 128 KiB); with --data-port,
that it can also open a TCP connection to the data port; the address to share.
Exit code 0 when nothing failed, 1 when a check failed, 2 for bad input.

Run it with the same network flags the peer will use, e.g.
``opendiloco-stream doctor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm... --port 31337 --public-ip 198.51.100.4``.
"""

from __future__ import annotations

import argparse
import asyncio

from opendiloco_stream.config_cli import UsageError
from opendiloco_stream.net.flags import add_network_flags, net_config_from_args, verbose
from opendiloco_stream.net.lifecycle import daemons, kill_stray_daemons


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="preflight: p2pd, listen port, bootstrap, dial-back, relays, data port, address to share",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_flags(p, data=True)
    p.add_argument("--timeout", type=float, default=15.0, metavar="S", help="bound on each check (default 15 s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from opendiloco_stream.net.dht import quiet_hivemind  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.net.doctor import check_config, run_checks  # lazy: loads torch; --help stays light

    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0 seconds")
    net = net_config_from_args(args)
    existing = daemons()
    check_config(net)  # bad addresses: exit 2 before any check runs
    quiet_hivemind(verbose(args), level=None if verbose(args) else 60)  # the checks report failures themselves
    try:
        checks = asyncio.run(run_checks(net, timeout=args.timeout, report=lambda c: print(c.lines(), flush=True)))
    finally:
        kill_stray_daemons(existing)  # Ctrl+C mid-check can leave a daemon that was still starting
    failed = [c.name for c in checks if c.status == "FAIL"]
    print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed")
    return 1 if failed else 0
