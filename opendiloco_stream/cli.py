"""Console script ``opendiloco-stream``: a thin dispatcher over ``opendiloco_stream.commands``.

Each command lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
User mistakes (bad flags, bad config, unreachable peers) print one line and exit with code 2: the
flag, the value and the fix, then ``usage: opendiloco-stream COMMAND --help`` (:class:`Parser`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from typing import NoReturn, Optional, Sequence

COMMANDS = ("local", "peer", "bootstrap", "doctor", "monitor", "simulate", "export", "sample")
PROG = "opendiloco-stream"


class UsageError(Exception):
    """A user mistake: one line on stderr, exit code 2."""


_TYPE_WORDS = {"int": "an integer, e.g. 10", "float": "a number, e.g. 0.5", "_toml_value": "a TOML value"}


class Parser(argparse.ArgumentParser):
    """argparse with errors of one line: what is wrong, with which value, and the fix.

    argparse's own error prints the whole usage block first (50-80 lines for ``peer``); here the
    message is rewritten to name the flag, the value and what to give instead, and the usage
    collapses to ``usage: opendiloco-stream COMMAND --help``. Subparsers inherit the class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self.explain(message)}\nusage: {self.prog} --help\n")

    def explain(self, message: str) -> str:
        """argparse's message, with the fix spelled out."""
        m = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if m:
            flag, value, choices = m.groups()
            choices = choices.replace("'", "")
            options = [c.strip() for c in choices.split(",")]
            close = [c for c in options if value and c.startswith(value)][:1] or difflib.get_close_matches(
                value, options, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return f"{flag} {value!r} is not one of: {choices}{hint}"
        m = re.match(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: '(.*)'$", message)
        if m:
            flag, kind, value = m.groups()
            return f"{flag} {value!r}: expects {_TYPE_WORDS.get(kind, kind)}"
        m = re.match(r"argument (\S+?)(?:/\S+)?: expected (.*)$", message)
        if m:
            flag, what = m.groups()
            return f"{flag} needs a value: it expected {what}"
        m = re.match(r"the following arguments are required: (.*)$", message)
        if m:
            return f"missing {m.group(1)}: give {'it' if ',' not in m.group(1) else 'them'} (see {self.prog} --help)"
        m = re.match(r"argument (\S+?)(?:/\S+)?: ignored explicit argument '(.*)'$", message)
        if m:
            return f"{m.group(1)} takes no value (got {m.group(2)!r}): drop '={m.group(2)}'"
        return message

    def unknown(self, extras: list[str]) -> NoReturn:
        """One line for flags this command does not have, with the closest one it has."""
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        first = extras[0]
        name = first.split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6) if name.startswith("-") else []
        hint = f"did you mean {close[0]}?" if close else f"see {self.prog} --help for its flags"
        what = "unknown flag" if name.startswith("-") else "unexpected argument"
        more = f" (and {len(extras) - 1} more)" if len(extras) > 1 else ""
        self.error(f"{what} {first!r}{more}: {hint}")

    def parse_args(self, args=None, namespace=None):
        """Unknown flags are reported by the subcommand that got them, with its closest flag."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
            command = getattr(parsed, subs[0].dest, None) if subs else None
            (subs[0].choices[command] if command else self).unknown(extras)
        return parsed


class DeprecatedAlias(argparse.Action):
    """An old flag spelling kept for one release: sets the new flag's value and prints a notice.

    ``const`` is the new spelling; ``default`` is suppressed so the new flag's default stands.
    """

    def __init__(self, option_strings, dest, new: str, nargs=None, **kwargs):
        self.new = new
        kwargs.setdefault("help", f"deprecated: use {new}")
        kwargs["default"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: note: {option_string} is deprecated and will be removed in the next release: "
              f"use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def deprecated_alias(parser, old: str, new: str, *, const_value=None, **kwargs) -> None:
    """Register ``old`` as a deprecated spelling of the flag ``new`` (same dest, type and choices).

    ``const_value``: ``old`` takes no value and stands for ``new const_value`` (``-v`` for
    ``--log-level DEBUG``); a flag ``new`` that takes no value is mirrored the same way.
    """
    # argparse keeps no public map from a flag to its Action: ``_option_string_actions`` (CPython
    # 3.11's argparse, as ``unknown`` above reads it too) is the one private name this module uses
    action = parser._option_string_actions[new]
    shown = new if const_value is None else f"{new} {const_value}"
    if const_value is not None or action.nargs == 0:
        value = const_value if const_value is not None else (action.const if action.const is not None else True)
        parser.add_argument(old, dest=action.dest, action=_ConstAlias, new=shown, const=value, nargs=0, **kwargs)
        return
    parser.add_argument(old, dest=action.dest, action=DeprecatedAlias, new=new, type=action.type,
                        choices=action.choices, metavar=action.metavar, nargs=action.nargs, **kwargs)


class _ConstAlias(DeprecatedAlias):
    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: note: {option_string} is deprecated and will be removed in the next release: "
              f"use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, self.const)


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
    from opendiloco_stream.config import ConfigError

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
