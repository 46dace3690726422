"""One result envelope: every benchmark writes its JSON through ``benchmarks/harness/results.py``'s
``write_result`` (benchmark, command, commit, environment, settings, rows), the results kept in
``benchmarks/results/`` carry it, and a quick benchmark run as ``python -m benchmarks.NAME`` writes it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from benchmarks.harness.results import ENVELOPE, read_result, write_payload, write_result
from tests.support.peers import run_benchmark

ROOT = Path(__file__).resolve().parent.parent
#: modules of benchmarks/ that are no benchmark (reports and helpers live in benchmarks/harness/)
NOT_BENCHMARKS = {"__init__"}
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_BENCHMARKS)
WRITERS = {"write_result", "write_payload"}  # write_payload writes a read-back envelope through write_result


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_each_benchmark_writes_through_the_one_writer_and_runs_as_a_module(path):
    source = path.read_text()
    tree = ast.parse(source)
    calls = _calls(tree)
    assert calls & WRITERS, f"{path.name}: write the result with benchmarks.harness.results.write_result"
    assert not calls & {"write_json", "dump"}, f"{path.name}: JSON goes through write_result, not around it"
    assert "sys.path" not in source, f"{path.name}: run it as python -m benchmarks.{path.stem}, no sys.path edits"
    assert 'if __name__ == "__main__":' in source, f"{path.name}: python -m benchmarks.{path.stem} must run it"
    for node in ast.walk(tree):  # benchmarks share code through benchmarks.harness, not through each other
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("benchmarks"):
            parts = node.module.split(".")
            if len(parts) > 1 and parts[1] != "harness":
                assert parts[1] in NOT_BENCHMARKS, f"{path.name} imports the benchmark {node.module}"


def test_every_kept_result_carries_the_envelope():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert files
    for path in files:
        payload = read_result(path)
        assert isinstance(payload["rows"], list), path.name
        assert isinstance(payload["settings"], dict), path.name
        assert (ROOT / "benchmarks" / f"{payload['benchmark']}.py").is_file(), path.name


def test_write_result_keeps_the_envelope_first_and_refuses_to_replace_it(tmp_path):
    out = write_result(tmp_path / "r.json", settings={"n": 1, "out": tmp_path}, rows=[{"x": float("nan")}],
                       argv=["--n", "1"], benchmark="sparse_bytes", environment_info={"git_commit": "abc"},
                       table="| x |")
    payload = json.loads(out.read_text())
    assert list(payload)[:len(ENVELOPE)] == list(ENVELOPE) and payload["table"] == "| x |"
    assert payload["command"] == "python -m benchmarks.sparse_bytes --n 1" and payload["commit"] == "abc"
    assert payload["rows"] == [{"x": None}] and payload["settings"]["out"] == str(tmp_path)  # strict JSON
    write_payload(tmp_path / "again.json", payload)
    assert read_result(tmp_path / "again.json") == payload
    with pytest.raises(ValueError, match="would replace the envelope"):
        write_result(tmp_path / "bad.json", settings={}, rows=[], benchmark="x", environment_info={}, commit="x")
    (tmp_path / "old.json").write_text("[]")
    with pytest.raises(ValueError, match="not a benchmark result"):
        read_result(tmp_path / "old.json")


def test_a_quick_benchmark_run_as_a_module_writes_the_envelope(tmp_path):
    out = tmp_path / "sparse.json"
    proc = run_benchmark("sparse_bytes", "--workers", "2", "4", "--numel", "65536", "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = read_result(out)
    assert payload["benchmark"] == "sparse_bytes"
    assert payload["command"] == f"python -m benchmarks.sparse_bytes --workers 2 4 --numel 65536 --out {out}"
    assert payload["settings"]["workers"] == [2, 4] and payload["environment"]["python"]
    assert {(r["codec"], r["workers"]) for r in payload["rows"]} >= {("fp32", 2), ("topk-int2", 4)}
