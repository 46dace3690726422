"""The README and docs agree with the code: every flag they give to an ``opendiloco-stream`` command
exists in that command's ``--help``, every bare flag they name exists somewhere in the project's
command lines, and a precise figure next to a cited results file is in that file.

What is checked, to stay precise rather than guess:
* flags: inside fenced code blocks and inline code, the ``--flag`` tokens of an
  ``opendiloco-stream COMMAND ...`` command line (continuation lines joined; it ends at ``|``,
  ``&&``, ``;``, ``#`` or the line's end) must be flags of COMMAND's parser; an inline code span
  that is only a flag (`` `--flag` `` or `` `--flag VALUE` ``) must be a flag of some command, or of
  a benchmark or script of this repository.
* figures: in a sentence (of a paragraph or a list item) that cites exactly one
  ``benchmarks/results/*.json`` file, every number written with 3 or more decimals (``0.123``,
  ``2.4981``) must be a value of that file at that precision (or a fraction of it as a percentage).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from pathlib import Path

import pytest

from opendiloco_stream.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "peers" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:opendiloco-stream|python3? -m opendiloco_stream)\s+([a-z]+)\b(.*)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


PARSERS = _parsers()
COMMAND_FLAGS = {name: set(p._option_string_actions) for name, p in PARSERS.items()}
ALL_FLAGS = set().union(*COMMAND_FLAGS.values())


def _project_flags() -> set[str]:
    """Flags the repository's benchmarks and scripts define (``add_argument("--x"``)."""
    out = set()
    for path in [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").glob("*")]:
        if path.is_file():
            out |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text(errors="replace")))
            out |= set(re.findall(r"(--[a-z][a-z0-9-]*)\)", path.read_text(errors="replace")))  # case "--fast")
    return out


PROJECT_FLAGS = _project_flags()


def _code(text: str) -> tuple[list[str], list[str]]:
    """(lines of fenced code with continuations joined, inline code spans outside fences)."""
    fenced, inline, in_fence, pending = [], [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            fenced.append(pending + line)
            pending = ""
        else:
            inline += re.findall(r"`([^`\n]+)`", line)
    return fenced, inline


def _command_flags(code: str) -> list[tuple[str, str]]:
    """(command, flag) for every ``--flag`` of every opendiloco-stream command line in ``code``."""
    out = []
    for m in COMMAND.finditer(code):
        command, rest = m.group(1), re.split(r"\s(?:\||&&|;|#)\s?|\s#", m.group(2))[0]
        if command not in PARSERS:
            out.append((command, "<no such command>"))
            continue
        try:
            tokens = shlex.split(rest, posix=True)
        except ValueError:
            tokens = rest.split()
        out += [(command, t.split("=", 1)[0]) for t in tokens if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", t)]
    return out


def flag_problems(path: Path) -> list[str]:
    fenced, inline = _code(path.read_text())
    problems = []
    for code in fenced + inline:
        for command, flag in _command_flags(code):
            if flag == "<no such command>":
                problems.append(f"{path.name}: `opendiloco-stream {command}`: no such command")
            elif flag not in COMMAND_FLAGS[command]:
                problems.append(f"{path.name}: `{command} {flag}`: {command} --help has no {flag}")
    for span in inline:
        m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =]\S+)?", span.strip())
        if m and not COMMAND.search(span) and m.group(1) not in ALL_FLAGS | PROJECT_FLAGS:
            problems.append(f"{path.name}: `{span}`: no command, benchmark or script has {m.group(1)}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_the_docs_name_exists(path):
    assert flag_problems(path) == []


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) else []
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs (and table rows' blocks), fenced code left out."""
    out, block, in_fence = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if line.strip():
            block.append(line)
        elif block:
            out.append("\n".join(block))
            block = []
    if block:
        out.append("\n".join(block))
    return out


def _claims(text: str) -> list[str]:
    """The units a citation covers: sentences of a paragraph or of one list item (a list's next item,
    or the next sentence, may quote another run)."""
    out = []
    for para in _paragraphs(text):
        items = re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", para)
        for item in items:
            out += re.split(r"(?<=[.!?])\s+(?=[A-Z])", item)
    return out


RESULT = re.compile(r"benchmarks/results/([A-Za-z0-9_.-]+\.json)")
FIGURE = re.compile(r"(?<![\w.\-/])(\d+\.\d{3,})(?![\w.])")


def figure_problems(path: Path) -> list[str]:
    problems = []
    for para in _claims(path.read_text()):
        cited = set(RESULT.findall(para))
        if len(cited) != 1:
            continue
        (name,) = cited
        file = ROOT / "benchmarks" / "results" / name
        if not file.exists():
            problems.append(f"{path.name}: cites benchmarks/results/{name}, which does not exist")
            continue
        values = _numbers(json.loads(file.read_text()))
        text = RESULT.sub("", para)
        text = re.sub(r"`[^`]*`", "", text)  # commands and paths in code are not figures
        for figure in FIGURE.findall(text):
            decimals = len(figure.split(".")[1])
            target = float(figure)
            scales = (1.0, 100.0)  # a fraction in the file may be written as a percentage
            if not any(abs(round(v * s, decimals) - target) < 10 ** -decimals / 2 for v in values for s in scales):
                problems.append(f"{path.name}: {figure} is not in benchmarks/results/{name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_figures_next_to_a_cited_results_file_are_in_it(path):
    assert figure_problems(path) == []


def test_the_checks_catch_a_wrong_flag_and_a_wrong_figure(tmp_path):
    """The checks are not vacuous: a flag a command lacks, a bare unknown flag and a figure the cited
    file does not hold are reported; the right ones are not."""
    results = ROOT / "benchmarks" / "results"
    name = sorted(p.name for p in results.glob("*.json"))[0]
    value = next(v for v in _numbers(json.loads((results / name).read_text())) if v != int(v))
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\nopendiloco-stream peer --run-id x \\\n    --link-mbps 5 --codec fp4-e3m0\n"
                   "opendiloco-stream local --link-mbit 5 --link-step-s 0.1\n```\n\n"
                   "Use `--no-such-flag` or `--inner-steps 10`, and `opendiloco-stream bootstrap --relay`.\n\n"
                   f"It took {value:.3f} s and 123.456 s (benchmarks/results/{name}).\n")
    assert flag_problems(doc) == ["doc.md: `peer --link-mbps`: peer --help has no --link-mbps",
                                  "doc.md: `--no-such-flag`: no command, benchmark or script has --no-such-flag"]
    assert figure_problems(doc) == [f"doc.md: 123.456 is not in benchmarks/results/{name}"]
