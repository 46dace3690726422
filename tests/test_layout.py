"""The package's shape: short, shallow functions (not a cap on modules: a module is split where
the design says) in the package and the benchmarks, no import cycles between commands, test support
outside the installed package, tests that import support and never each other or a benchmark,
docstrings and docs/architecture.md's "where to change what" table that point at files that exist,
a Python floor that matches."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "opendiloco_stream"
MODULES = sorted(PACKAGE.rglob("*.py"))
BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))
TESTS = sorted((ROOT / "tests").rglob("*.py"))


MAX_FUNCTION_LINES = 80
MAX_NESTING = 5
_BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _functions():
    for path in MODULES + BENCHMARKS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}::{node.name}", node


def _nesting(node: ast.AST, depth: int = 0) -> int:
    """The deepest block nesting inside a function (an ``elif`` is its ``if``'s level, not one deeper;
    nested functions and classes are measured on their own)."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _SCOPES):
            continue
        elif_chain = (isinstance(node, ast.If) and isinstance(child, ast.If) and node.orelse == [child])
        deeper = isinstance(child, _BLOCKS) and not elif_chain
        deepest = max(deepest, _nesting(child, depth + deeper))
    return deepest


def test_no_function_is_over_80_lines():
    long = {name: n for name, f in _functions() if (n := f.end_lineno - f.lineno + 1) > MAX_FUNCTION_LINES}
    assert not long, f"split these into named steps: {long}"


def test_no_function_nests_blocks_more_than_5_deep():
    deep = {name: d for name, f in _functions() if (d := _nesting(f)) > MAX_NESTING}
    assert not deep, f"flatten these (early returns, a helper per branch): {deep}"


def test_the_measures_see_what_they_measure():
    code = "def f():\n" + "".join("    " * (i + 1) + "if x:\n" for i in range(6)) + "    " * 7 + "pass\n"
    (node,) = ast.parse(code).body
    assert _nesting(node) == 6 and node.end_lineno - node.lineno + 1 == 8
    chain = ast.parse("def g():\n    if a:\n        pass\n    elif b:\n        pass\n    elif c:\n        pass\n").body[0]
    assert _nesting(chain) == 1


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


def _imports(path: Path):
    """Every module ``path`` imports (lazy imports inside functions too), as written."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if node.module == "benchmarks":  # from benchmarks import gpu
                yield from (f"benchmarks.{a.name}" for a in node.names)


def test_tests_import_support_never_another_test_or_a_benchmark():
    test_modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    bad = {}
    for path in TESTS:
        for name in _imports(path):
            parts = name.split(".")
            another_test = parts[-1] in test_modules or (parts[0] == "tests" and parts[1:2] != ["support"])
            a_benchmark = parts[0] == "benchmarks" and len(parts) > 1 and parts[1] != "harness"
            if another_test or a_benchmark:
                bad.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert not bad, ("shared test code goes to tests/support/ or benchmarks/harness/; a benchmark runs as "
                     f"python -m benchmarks.NAME (tests/support/peers.py::run_benchmark): {bad}")


def test_conftest_leaves_sys_path_alone():
    for path in (ROOT / "tests").rglob("conftest.py"):
        assert "sys.path" not in path.read_text(), f"{path.relative_to(ROOT)}: import from the repository root instead"


def _change_table() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| to add")]


def test_the_where_to_change_what_table_names_files_and_names_that_exist():
    rows = _change_table()
    assert len(rows) >= 8, rows
    missing = []
    for row in rows:
        for ref in re.findall(r"`([^`]+)`", row):
            path, _, name = ref.partition("::")
            if not re.fullmatch(r"[\w./-]+\.(py|md|toml|sh)", path):
                continue  # a name, a flag or an expression, not a file
            where = [ROOT / path, PACKAGE / path]
            found = next((w for w in where if w.is_file()), None)
            if found is None:
                missing.append(ref)
            elif name and not re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]",
                                        found.read_text(), re.M):
                missing.append(ref)
    assert not missing, f"docs/architecture.md names what is not there: {missing}"


# names a hivemind object goes by in the package (a DHT, its p2p client, a node, a future...)
_HIVEMIND_OBJECTS = {"dht", "p2p", "node", "daemon", "averager", "future", "mpfuture", "servicer"}


def _hivemind_names(tree: ast.AST) -> set[str]:
    """The names a module binds to something imported from hivemind."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "hivemind")
    return names


def _private_uses(tree: ast.AST, hivemind: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases}
            found += [f"class {node.name}({b})" for b in bases & hivemind]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            owner = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
            if owner in hivemind or owner.lower().lstrip("_") in _HIVEMIND_OBJECTS:
                found.append(f"{owner}.{node.attr} (line {node.lineno})")
    return found


def test_the_package_neither_subclasses_hivemind_nor_reads_its_private_attributes():
    """The averaging service uses hivemind's public DHT and p2p APIs only (docs/architecture.md):
    no class derives from a hivemind class, and no ``._name`` is read off a name imported from
    hivemind or off an object named as hivemind's are (``dht``, ``p2p``, ``node``...)."""
    offenders = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        offenders += [f"{path.relative_to(ROOT)}: {use}" for use in _private_uses(tree, _hivemind_names(tree))]
    assert offenders == []


def test_the_private_use_check_sees_a_subclass_and_a_private_read():
    tree = ast.parse("from hivemind import DecentralizedAverager, DHT\nfrom hivemind.utils.mpfuture import MPFuture\n"
                     "class A(DecentralizedAverager):\n    pass\n"
                     "x = MPFuture._update_lock\ny = self.dht._node\nz = self._lock\n")
    assert _private_uses(tree, _hivemind_names(tree)) == [
        "class A(DecentralizedAverager)", "MPFuture._update_lock (line 5)", "dht._node (line 6)"]
