"""The package's shape: short, shallow functions (not a cap on modules: a module is split where
the design says) in the package and the benchmarks, imports that point down the layers with no
circles and a reason on every function-level import, test support
outside the installed package, tests that import support and never each other or a benchmark,
docstrings and docs/architecture.md's "where to change what" table that point at files that exist,
a Python floor that matches."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


# ---- the import graph: arrows point down the layers, no circles, lazy imports say why ----------------

# Lowest first; a module may import its own layer and the layers below. The package root (``""``) is the
# public facade (``from opendiloco_stream import wrap``), so it sits on top with the command line.
# ``testing`` holds the fault hooks that transport and train code call, so it is a leaf at the bottom.
LAYERS = [
    {"compression", "stats", "testing"},
    {"config", "config_cli"},
    {"net"},
    {"transport"},
    {"algorithm"},
    {"train"},
    {"commands"},
    {"cli", "__main__", ""},
]
_LAZY_COMMENT = re.compile(r"#\s*lazy:\s*\S")

def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    inside = module.split(".", 1)[1] if "." in module else ""
    top = inside.split(".", 1)[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in tests/test_layout.py")


def _lazy_comment_lines(source: str) -> set[int]:
    return {i for i, line in enumerate(source.splitlines(), 1) if _LAZY_COMMENT.search(line)}


def _edges(name: str, source: str, is_package: bool, known: set[str]):
    """Every import of a package module in ``source``: (importer, target, lines, function or None,
    statement). ``lines`` is the statement's (first, last) line; ``function`` is the enclosing function's qualified name for a function-level import;
    imports under ``if TYPE_CHECKING:`` count as arrows too (a type is a dependency)."""
    package = name.split(".") if is_package else name.split(".")[:-1]

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        return ".".join(parts) or None

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [t for a in node.names if (t := resolve(a.name))]
        base = package[: len(package) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        return [t for a in node.names if (t := resolve(f"{module}.{a.name}"))]

    def visit(node: ast.AST, function: str | None, scope: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in dict.fromkeys(targets(child)):
                    if target != name:
                        yield name, target, (child.lineno, child.end_lineno), function, ast.unparse(child)
                if function is not None:
                    yield name, None, (child.lineno, child.end_lineno), function, ast.unparse(child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualified = f"{scope}.{child.name}" if scope else child.name
                inner = qualified if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                yield from visit(child, inner, qualified)
            else:
                yield from visit(child, function, scope)

    yield from visit(ast.parse(source), None, "")


def _graph(sources: dict[str, tuple[str, bool]]):
    """``sources``: module name -> (source, is package). Returns the arrows (importer -> target, first
    line) and the function-level imports without a ``# lazy:`` reason."""
    known = set(sources)
    arrows: dict[tuple[str, str], int] = {}
    unannotated = []
    for name, (source, is_package) in sources.items():
        lazy_lines = _lazy_comment_lines(source)
        for importer, target, (first, last), function, statement in _edges(name, source, is_package, known):
            if target is not None:
                arrows.setdefault((importer, target), first)
            elif not lazy_lines.intersection(range(first, last + 1)):
                unannotated.append(f"{importer}::{function}: {statement}")
    return arrows, sorted(set(unannotated))


def _upward(arrows: dict[tuple[str, str], int]) -> list[str]:
    return sorted(f"{a} -> {b}" for (a, b) in arrows if _layer(b) > _layer(a))


def _cycles(arrows: dict[tuple[str, str], int]) -> list[str]:
    """The strongly connected components of more than one module, each as its sorted members."""
    graph: dict[str, set[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str):  # Tarjan; the graph is a few hundred modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {_module_name(p, ROOT): (p.read_text(), p.name == "__init__.py") for p in MODULES}


def _offenders() -> dict[str, list[str]]:
    arrows, unannotated = _graph(_package_sources())
    return {"upward arrows": _upward(arrows), "circles": _cycles(arrows),
            "function-level imports without '# lazy: <reason>'": unannotated}


def test_imports_point_down_the_layers_without_circles_and_lazy_imports_say_why():
    """Layers (lowest first): compression, stats < config, config_cli < net < transport < algorithm <
    train < commands < cli. A function-level import needs ``# lazy: <reason>`` on its line: an
    optional dependency, or in cli/commands keeping ``--help`` fast."""
    offenders = _offenders()
    message = "\n".join(f"{kind} ({len(found)}):\n  " + "\n  ".join(found) for kind, found in offenders.items() if found)
    if any(offenders.values()):
        pytest.fail("\n" + message, pytrace=False)


def test_every_commands_help_loads_neither_torch_nor_hivemind():
    """What makes the commands' ``# lazy:`` imports worth their comment: the parser of every command
    (what ``--help`` and a one-line usage error need) is built without torch or hivemind."""
    code = ("import sys; from opendiloco_stream.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'hivemind', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_import_graph_sees_upward_arrows_circles_and_unexplained_lazy_imports():
    sources = {
        "opendiloco_stream": ("", True),
        "opendiloco_stream.net": ("", True),
        "opendiloco_stream.net.a": ("from opendiloco_stream.transport import b\n", False),
        "opendiloco_stream.transport": ("", True),
        "opendiloco_stream.transport.b": (
            "from . import c\n"
            "def f():\n    from opendiloco_stream.net import a\n    import torch  # lazy: optional\n"
            "    import json\n", False),
        "opendiloco_stream.transport.c": ("from .b import f\n", False),
    }
    arrows, unannotated = _graph(sources)
    assert _upward(arrows) == ["opendiloco_stream.net.a -> opendiloco_stream.transport.b"]
    assert _cycles(arrows) == [
        "opendiloco_stream.net.a <-> opendiloco_stream.transport.b <-> opendiloco_stream.transport.c"]
    assert unannotated == ["opendiloco_stream.transport.b::f: from opendiloco_stream.net import a",
                           "opendiloco_stream.transport.b::f: import json"]
