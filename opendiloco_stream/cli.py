"""Console script ``opendiloco-stream``: a thin dispatcher over ``opendiloco_stream.commands``.

Each command lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
User mistakes (bad flags, bad config, unreachable peers) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

COMMANDS = ("local", "peer", "bootstrap", "doctor", "monitor", "simulate", "export", "sample")


class UsageError(Exception):
    """A user mistake: one line on stderr, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opendiloco-stream",
        description="Streaming DiLoCo with overlapped, quantized, eager fragment synchronization.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"opendiloco_stream.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from opendiloco_stream.config import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a launcher re-runs this command line (peer_ranks.py)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ConfigError) as e:
        print(f"opendiloco-stream {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"opendiloco-stream {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
