"""Command-line flags generated from the configuration tree (``config.py``), and its reference doc.

Every field of ``RunConfig`` is a flag: ``diloco.inner_steps`` is ``--inner-steps``, with the
field's description as help, its default shown, its ``Literal`` values as choices, ``bool`` as
``--x / --no-x``, lists as ``nargs="+"``. A field's ``json_schema_extra=cli(...)`` renames the flag,
adds aliases (``--tau`` for ``overlap_steps``) or hides it. Flags default to ``None`` so that only
the ones given override the TOML file and the environment. Adding a knob is adding a field.

    add_config_flags(parser, sections=TRAINING_SECTIONS)     # every field of those sections
    cfg = config_from_args(args)                              # defaults < TOML < env < flags
    cfg, sources = config_from_args(args, return_sources=True)  # sources.of("diloco.mode") -> "flag"
"""

from __future__ import annotations

import argparse
import tomllib
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

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
