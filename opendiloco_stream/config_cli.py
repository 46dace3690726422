"""Command-line flags generated from the configuration tree (``config.py``), and its reference doc.

Every field of ``RunConfig`` is a flag: ``diloco.inner_steps`` is ``--inner-steps``, with the
field's description as help, its default shown, its ``Literal`` values as choices, ``bool`` as
``--x / --no-x``, lists as ``nargs="+"``. A field's ``json_schema_extra=cli(...)`` renames the flag,
adds aliases (``--tau`` for ``overlap_steps``) or hides it. Flags default to ``None`` so that only
the ones given override the TOML file and the environment. Adding a knob is adding a field.

    add_config_flags(parser, sections=TRAINING_SECTIONS)     # every field of those sections
    cfg = config_from_args(args)                              # defaults < TOML < env < flags
    cfg, sources = config_from_args(args, return_sources=True)  # sources.of("diloco.mode") -> "flag"

Also the parser every command is built with (:class:`Parser`: errors of one line), the old flag
spellings kept one release (:func:`deprecated_alias`) and :class:`UsageError` (a user mistake:
one line, exit code 2). They live here, below ``net`` and ``commands``, because both use them.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tomllib
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, NoReturn, Optional, Sequence

from pydantic.fields import FieldInfo

from opendiloco_stream.config import ENV_PREFIX, RunConfig, deep_update, load_config

TRAINING_SECTIONS = ("diloco", "model", "data", "train")
SECTION_TITLES = {"diloco": "algorithm", "model": "model", "data": "data", "train": "training",
                  "net": "network and transport"}


def _toml_value(raw: str) -> Any:
    """A flag value of a type argparse has no converter for: parsed as a TOML value, like env vars."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


@dataclass(frozen=True)
class FlagSpec:
    """One config field as a flag."""

    section: str
    name: str
    flags: tuple[str, ...]
    info: FieldInfo

    @property
    def dest(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.section.upper()}__{self.name.upper()}"

    @property
    def default(self) -> Any:
        return self.info.get_default(call_default_factory=True)

    def argparse_kwargs(self) -> dict[str, Any]:
        """``add_argument`` keyword arguments from the field's type, description and default."""
        annotation, kwargs = self.info.annotation, {}
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
            annotation = next(a for a in args if a is not type(None))  # Optional[X] -> X
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            kwargs.update(choices=args, type=type(args[0]))
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
        elif origin is list and args and args[0] in (int, float, str):
            kwargs.update(nargs="+", type=args[0])
        elif origin is tuple and args and Ellipsis not in args and len(set(args)) == 1 and args[0] in (int, float, str):
            kwargs.update(nargs=len(args), type=args[0])
        else:
            kwargs["type"] = _toml_value
        meta = _cli_meta(self.info)
        if "action" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = meta.get("metavar") or self.name.upper()
        help_text = self.info.description or ""
        default = self.default
        if default is not None and default != []:
            help_text += f" (default: {default})" if help_text else f"default: {default}"
        kwargs["help"] = help_text.replace("%", "%%")  # argparse %-formats help strings
        return kwargs


def _cli_meta(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("cli") or {}


def flag_specs(sections: Optional[Iterable[str]] = None, names: Optional[Iterable[str]] = None) -> list[FlagSpec]:
    """The flags of ``sections`` (all by default), optionally only the fields ``names``, tree order."""
    wanted = set(names) if names is not None else None
    out, seen = [], {}
    for section, section_field in RunConfig.model_fields.items():
        if sections is not None and section not in sections:
            continue
        for name, info in section_field.annotation.model_fields.items():
            meta = _cli_meta(info)
            if meta.get("hidden") or (wanted is not None and name not in wanted):
                continue
            flags = tuple(meta.get("flags") or [f"--{name.replace('_', '-')}"])
            for flag in flags:  # one namespace for every section: names must not collide
                if flag in seen:
                    raise ValueError(f"flag {flag} would mean both {seen[flag]} and {section}.{name}: "
                                     "rename one with json_schema_extra=cli(...)")
                seen[flag] = f"{section}.{name}"
            out.append(FlagSpec(section, name, flags, info))
    return out


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str] = TRAINING_SECTIONS,
                     names: Optional[Iterable[str]] = None, exclude: Iterable[str] = ()) -> list[FlagSpec]:
    """Add one flag per field of ``sections`` (grouped by section); returns the flags added.

    ``names`` keeps only those fields, ``exclude`` drops ``"section.field"`` ones. A flag the parser
    already has (a command's own option of the same name) is left to the command.
    """
    added, groups, exclude = [], {}, set(exclude)
    for spec in flag_specs(sections, names):
        if spec.dest in exclude or any(flag in parser._option_string_actions for flag in spec.flags):
            continue
        group = groups.get(spec.section)
        if group is None:
            group = groups[spec.section] = parser.add_argument_group(
                f"{SECTION_TITLES.get(spec.section, spec.section)} ([{spec.section}] in TOML)")
        group.add_argument(*spec.flags, dest=spec.dest, default=None, **spec.argparse_kwargs())
        added.append(spec)
    return added


def overrides_from_args(args: argparse.Namespace, extra: Optional[dict[str, tuple[str, str]]] = None) -> dict[str, Any]:
    """The nested ``{"section": {"field": value}}`` of the config flags that were given.

    ``extra`` maps further ``dest -> (section, field)`` (a command's own flags that set config).
    """
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if value is not None and "." in dest:
            section, _, name = dest.partition(".")
            if section in RunConfig.model_fields:
                out.setdefault(section, {})[name] = value
    for dest, (section, name) in (extra or {}).items():
        value = getattr(args, dest, None)
        if value is not None:
            out.setdefault(section, {})[name] = value
    return out


def config_from_args(args: argparse.Namespace, extra: Optional[dict[str, tuple[str, str]]] = None, *,
                     updates: Optional[dict[str, Any]] = None, return_sources: bool = False):
    """``RunConfig`` from ``--config`` < environment < flags (< ``updates``, nested, from the command
    itself); with ``return_sources`` also where each value came from (see ``load_config``)."""
    overrides = deep_update(overrides_from_args(args, extra), updates or {})
    return load_config(getattr(args, "config", None), overrides, return_sources=return_sources)


def config_reference() -> str:
    """docs/configuration.md: every field with its TOML key, flag, environment variable and default."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `opendiloco_stream/config.py` by `python scripts/gen_config_docs.py`; do not edit",
        "(a test checks that it is up to date). Every field can be set in a TOML file (`--config`, one",
        "table per section), in the environment and on the command line; precedence, lowest to highest:",
        "defaults < TOML < environment < flags. Unknown keys are errors. The guide to the knobs that matter",
        "is the docstring of `config.py` and `docs/algorithm.md`.",
        "",
    ]
    for section, section_field in RunConfig.model_fields.items():
        model = section_field.annotation
        lines += [f"## `[{section}]` — {SECTION_TITLES.get(section, section)}", ""]
        if model.__doc__ and not model.__doc__.startswith(model.__name__ + "("):
            lines += [model.__doc__.strip().splitlines()[0], ""]
        lines += ["| key | flag | environment | default | description |", "|---|---|---|---|---|"]
        specs = {s.name: s for s in flag_specs([section])}
        for name, info in model.model_fields.items():
            spec = specs.get(name)
            kwargs = spec.argparse_kwargs() if spec else {}
            names = list(spec.flags) if spec else []
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                names += [f"--no-{f[2:]}" for f in spec.flags]
            flags = ", ".join(f"`{f}`" for f in names) or "(none)"
            choices = f"One of: {', '.join(f'`{c}`' for c in kwargs['choices'])}." if "choices" in kwargs else ""
            default = info.get_default(call_default_factory=True)
            env = f"{ENV_PREFIX}{section.upper()}__{name.upper()}"
            desc = info.description or ""
            if desc and choices:
                desc = desc.rstrip(".") + ". "
            desc = (desc + choices).replace("|", "\\|").strip()
            lines.append(f"| `{name}` | {flags} | `{env}` | `{default!r}` | {desc} |")
        lines.append("")
    return "\n".join(lines)


# ---- the parser of every command: one-line errors, deprecated spellings ----------------------------


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
