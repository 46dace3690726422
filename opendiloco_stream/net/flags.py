"""Network flags of the commands, generated from ``RunConfig.net`` like every config flag.

Every flag defaults to None, so a flag overrides the TOML file (``--config``) and the environment
(``ODS_NET__PORT=31337``) only when given. ``bootstrap``, ``doctor`` and ``monitor`` get a subset
(:data:`BASIC`, :data:`LISTEN`, :data:`IDENTITY`); ``peer`` gets every ``net`` field.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from opendiloco_stream.config import NetConfig
from opendiloco_stream.config_cli import add_config_flags, config_from_args, deprecated_alias, overrides_from_args
from opendiloco_stream.net.keys import NetError

BASIC = ("initial_peers", "run_id", "run_key_file")
LISTEN = ("port", "public_ip", "host_maddrs", "announce_maddrs")
IDENTITY = ("identity_path",)
DATA = ("data_port", "direct", "punch", "client_mode", "relay")  # doctor: the data path it checks, and whether it needs dialing


def add_network_flags(p: argparse.ArgumentParser, *, listen: bool = True, identity: bool = True,
                      config: bool = True, every_field: bool = False, data: bool = False) -> None:
    """Add ``--initial-peers``, ``--run-id`` and (``listen``) the listen/announce/identity flags;
    ``data``: the data path's (``--data-port``, ``--no-direct``);
    ``every_field``: a flag for every ``net`` field (timeouts, client mode, ... : ``peer``)."""
    if config:
        p.add_argument("--config", metavar="TOML", help="a config file; its [net] table is used")
    names = None if every_field else (BASIC + (LISTEN if listen else ()) + (IDENTITY if identity else ())
                                      + (DATA if data else ()))
    add_config_flags(p, ("net",), names)
    p.add_argument("--initial-peers-file", metavar="F",
                   help="read more initial peers from F, one per line (e.g. a bootstrap's --addr-file)")
    add_log_level(p)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level(p: argparse.ArgumentParser, help: str = "logging level of this command and of hivemind; "
                  "DEBUG shows hivemind's logs (default WARNING)", *, old_verbose: bool = True) -> None:
    """``--log-level`` (one spelling on every command); ``old_verbose``: the commands that had
    ``-v`` / ``--verbose`` keep them one release as deprecated spellings of ``--log-level DEBUG``."""
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="WARNING", metavar="LEVEL",
                   help=help.replace("%", "%%") + f" ({', '.join(LOG_LEVELS)})")
    if old_verbose:
        deprecated_alias(p, "-v", "--log-level", help="deprecated: use --log-level DEBUG", const_value="DEBUG")
        deprecated_alias(p, "--verbose", "--log-level", help="deprecated: use --log-level DEBUG",
                         const_value="DEBUG")


def verbose(args: argparse.Namespace) -> bool:
    """Whether hivemind's own logs are shown (``--log-level DEBUG``)."""
    return getattr(args, "log_level", "WARNING") == "DEBUG"


def net_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``{"net": {...}}`` overrides of the flags that were given (``--initial-peers-file`` included)."""
    net: dict[str, Any] = dict(overrides_from_args(args).get("net", {}))
    path = getattr(args, "initial_peers_file", None)
    if path:
        net["initial_peers"] = list(net.get("initial_peers", [])) + read_peers_file(path)
    return {"net": net} if net else {}


def read_peers_file(path: str) -> list[str]:
    """Non-empty, non-comment lines of ``path``; a leading ``--initial-peers`` is tolerated."""
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
    net = config_from_args(args, updates=net_overrides(args)).net
    return net.model_copy(update=updates) if updates else net
