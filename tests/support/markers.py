"""Which tests start peer processes, found from their code, so a missing ``network`` marker fails
collection instead of slipping into the fast tier.

A test starts peers when its function, a fixture it requests, or a helper of its own module (or of
``tests/support``) refers to a *peer launcher*: an object registered with :func:`launches_peers`
(``tests/support/peers.py`` registers the product's and the benchmark harness's launchers, and a
test module decorates its own spawning helpers). References are read from the code objects
(global names, ``module.attr`` chains and imports inside functions), so a launcher reached through
any number of local helpers is found.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import types
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

F = TypeVar("F")
_LAUNCHERS: dict[int, tuple[Any, Optional[frozenset]]] = {}  # id -> (object kept alive, its `when`)


def launches_peers(obj: F, *, when: Optional[Iterable[str]] = None) -> F:
    """Register ``obj`` (a function or class) as starting peer processes; returns it unchanged.

    ``when``: only calls that name one of these strings start peers (``run_benchmark("soak")``
    does, ``run_benchmark("memory")`` does not); the strings are looked for among the constants of
    the code that refers to ``obj``."""
    _LAUNCHERS[id(obj)] = (obj, None if when is None else frozenset(when))
    return obj


def _launches(obj: Any, constants: set) -> bool:
    entry = _LAUNCHERS.get(id(obj))
    if entry is None or entry[0] is not obj:
        return False
    return entry[1] is None or bool(entry[1] & constants)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _local_imports(code: types.CodeType) -> Iterator[Any]:
    """Objects bound by ``from X import Y`` inside ``code`` (absolute imports only)."""
    module = None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = ins.argval
        elif ins.opname == "IMPORT_FROM" and module:
            try:
                yield getattr(importlib.import_module(module), ins.argval)
            except (ImportError, AttributeError):
                continue


def _referenced(func: Callable) -> Iterator[Any]:
    """Every object ``func``'s code names through its globals, ``module.attr`` chains and imports."""
    globs = getattr(func, "__globals__", {})
    for code in _code_objects(func.__code__):
        names = code.co_names
        for name in names:
            if name in globs:
                obj = globs[name]
                yield obj
                if isinstance(obj, types.ModuleType):
                    yield from (vars(obj)[attr] for attr in names if attr in vars(obj))
        yield from _local_imports(code)


def _own_helper(obj: Any) -> bool:
    """A plain function of a test module or of tests/support, whose body we also read."""
    module = getattr(obj, "__module__", "") or ""
    return isinstance(obj, types.FunctionType) and (module.startswith("test_") or module.startswith("tests."))


def starts_peers(func: Callable, _seen: set | None = None) -> bool:
    """True if ``func`` reaches a registered launcher directly or through its own helpers."""
    seen = _seen if _seen is not None else set()
    func = inspect.unwrap(func)
    if id(func) in seen:
        return False
    seen.add(id(func))
    constants = {c for code in _code_objects(func.__code__) for c in code.co_consts if isinstance(c, str)}
    for obj in _referenced(func):
        if _launches(obj, constants):
            return True
        if _own_helper(obj) and starts_peers(obj, seen):
            return True
    return False


def _fixture_functions(item: Any) -> Iterator[Callable]:
    """The functions of the fixtures ``item`` requests that its module or conftest defines."""
    sources = [vars(item.module)] + [vars(m) for m in _conftests(item)]
    for name in item.fixturenames:
        for namespace in sources:
            fixture = namespace.get(name)
            if fixture is not None and hasattr(fixture, "__wrapped__"):
                yield fixture.__wrapped__
                break


def _conftests(item: Any) -> list[types.ModuleType]:
    return [m for m in item.config.pluginmanager.get_plugins() if isinstance(m, types.ModuleType)
            and (getattr(m, "__file__", "") or "").endswith("conftest.py")]


def needs_network_marker(item: Any) -> bool:
    """True if the test item starts peer processes (its function or one of its fixtures does)."""
    func = getattr(item, "function", None)
    if func is None:
        return False
    seen: set = set()
    return starts_peers(func, seen) or any(starts_peers(f, seen) for f in _fixture_functions(item))


def unmarked_peer_tests(items: list) -> list[str]:
    """Node ids of the items that start peers but carry no ``network`` marker."""
    return [item.nodeid for item in items
            if item.get_closest_marker("network") is None and needs_network_marker(item)]
