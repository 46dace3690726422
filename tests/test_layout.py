"""The package's shape: small modules, no import cycles between commands, test support outside
the installed package, docstrings that point at files that exist, a Python floor that matches."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "opendiloco_stream"
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by concern: {long}"


def test_no_import_cycles_between_command_modules():
    modules = {p.stem: p for p in (PACKAGE / "commands").glob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[:2] == ["opendiloco_stream", "commands"] and len(parts) > 2 and parts[2] in modules:
                    graph[name].add(parts[2])

    def reaches(start: str, target: str, seen: set) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    cycles = [name for name in graph if reaches(name, name, {name})]
    assert not cycles, f"import cycle through {cycles}: {graph}"


def test_loopback_harness_is_test_support_not_part_of_the_package():
    assert not list(PACKAGE.rglob("*loopback*"))
    assert (ROOT / "benchmarks" / "harness" / "loopback.py").exists()


def test_docstrings_point_at_files_that_exist():
    pattern = re.compile(r"\b((?:docs|scripts|tests|benchmarks|peers)/[\w./-]+\.(?:md|py|toml))")
    missing = {}
    for path in MODULES:
        for ref in pattern.findall(path.read_text()):
            if not (ROOT / ref).exists():
                missing.setdefault(str(path.relative_to(ROOT)), []).append(ref)
    assert not missing, missing


def test_requires_python_matches_what_the_code_imports():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in re.match(r">=\s*(\d+)\.(\d+)", spec).groups())
    uses_tomllib = any("import tomllib" in p.read_text() for p in MODULES)
    assert not uses_tomllib or floor >= (3, 11), f"tomllib needs Python 3.11, pyproject says {spec}"
    assert sys.version_info[:2] >= floor
