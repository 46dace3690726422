"""Console script ``opendiloco-stream``: a thin dispatcher over ``opendiloco_stream.commands``.

Each command lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
User mistakes (bad flags, bad config, unreachable peers) print one line and exit with code 2: the
flag, the value and the fix, then ``usage: opendiloco-stream COMMAND --help`` (``config_cli.Parser``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

from opendiloco_stream.config import ConfigError
from opendiloco_stream.config_cli import Parser, UsageError

COMMANDS = ("local", "peer", "bootstrap", "doctor", "monitor", "simulate", "export", "sample")
PROG = "opendiloco-stream"


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="Streaming DiLoCo with overlapped, quantized, eager fragment synchronization.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"opendiloco_stream.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # a launcher re-runs this command line (peer_ranks.py)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ConfigError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
