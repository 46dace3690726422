"""Network flags shared by the commands, mapped onto ``RunConfig.net`` like the training flags.

Every flag defaults to None, so a flag overrides the TOML file (``--config``) and the environment
(``ODS_NET__PORT=31337``) only when given.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Optional

from opendiloco_stream.config import NetConfig, load_config

# flag dest -> (section, field)
NET_FLAGS: dict[str, tuple[str, str]] = {
    "initial_peers": ("net", "initial_peers"),
    "run_id": ("net", "run_id"),
    "port": ("net", "port"),
    "public_ip": ("net", "public_ip"),
    "host_maddrs": ("net", "host_maddrs"),
    "announce_maddrs": ("net", "announce_maddrs"),
    "identity_path": ("net", "identity_path"),
}


def add_network_flags(p: argparse.ArgumentParser, *, listen: bool = True, identity: bool = True,
                      config: bool = True) -> None:
    """Add ``--initial-peers``, ``--run-id`` and (``listen``) the listen/announce/identity flags."""
    if config:
        p.add_argument("--config", metavar="TOML", help="a config file; its [net] table is used")
    g = p.add_argument_group("network")
    g.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                   help="multiaddrs of running peers, e.g. /ip4/203.0.113.7/tcp/31337/p2p/Qm...")
    g.add_argument("--initial-peers-file", metavar="F",
                   help="read more initial peers from F, one per line (e.g. a bootstrap's --addr-file)")
    g.add_argument("--run-id", metavar="NAME", help="the run (DHT namespace) to use (default: opendiloco)")
    if listen:
        g.add_argument("--port", type=int, help="listen on this TCP+UDP port on all interfaces (open it in the "
                       "firewall); default: a random port, on 127.0.0.1 only for a local run")
        g.add_argument("--public-ip", metavar="IP", help="announce this IP (with --port) when behind NAT")
        g.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="full listen multiaddrs (win over --port)")
        g.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                       help="full announced multiaddrs (win over --public-ip)")
    if identity:
        g.add_argument("--identity-path", metavar="F", help="private key file for a stable peer id (created if missing)")
    p.add_argument("-v", "--verbose", action="store_true", help="show hivemind's logs")


def net_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``{"net": {...}}`` overrides of the flags that were given."""
    net: dict[str, Any] = {}
    for dest, (_, key) in NET_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            net[key] = value
    path = getattr(args, "initial_peers_file", None)
    if path:
        net["initial_peers"] = list(net.get("initial_peers", [])) + read_peers_file(path)
    return {"net": net} if net else {}


def read_peers_file(path: str) -> list[str]:
    """Non-empty, non-comment lines of ``path``; a leading ``--initial-peers`` is tolerated."""
    from opendiloco_stream.net.dht import NetError

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise NetError(f"cannot read initial peers file {path}: {e.strerror}") from None
    peers = []
    for line in text.splitlines():
        line = line.strip().removeprefix("--initial-peers").strip()
        if line and not line.startswith("#"):
            peers.extend(line.split())
    if not peers:
        raise NetError(f"initial peers file {path} lists no address")
    return peers


def net_config_from_args(args: argparse.Namespace, **updates: Any) -> NetConfig:
    """``RunConfig.net`` from --config < environment < flags, then ``updates`` (e.g. client_mode=True)."""
    net = load_config(getattr(args, "config", None), net_overrides(args)).net
    return net.model_copy(update=updates) if updates else net


class _ShutdownNoise(logging.Filter):
    """Drops p2pd's complaint about its control socket closing, logged on every Ctrl+C."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


def quiet_hivemind(verbose: bool = False, level: Optional[int] = None) -> None:
    """hivemind logs INFO to stderr by default; commands show warnings only unless --verbose."""
    from hivemind.utils.logging import get_logger

    hivemind_logger = get_logger("hivemind")  # also installs hivemind's handler, which we filter
    hivemind_logger.setLevel(level if level is not None else logging.DEBUG if verbose else logging.WARNING)
    if not verbose:
        for handler in hivemind_logger.handlers:
            if not any(isinstance(f, _ShutdownNoise) for f in handler.filters):
                handler.addFilter(_ShutdownNoise())
