"""One result envelope for every benchmark, and the report helpers: markdown tables, PNG plots.

Every benchmark's JSON is written by :func:`write_result`, which wraps its rows in the same
envelope: ``benchmark``, ``command`` (``python -m benchmarks.NAME ...``, rerunnable from the
repository root), ``commit``, ``environment``, ``settings`` and ``rows``; a benchmark may add keys
of its own beside them (a table, events, a summary), never instead of them.

Plots use matplotlib's Agg backend (no display needed); matplotlib is imported lazily so that a
script's ``--help`` and its non-plot paths work without it (``pip install matplotlib``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
IMG_DIR = REPO_ROOT / "docs" / "img"


def module_name(argv0: Optional[str] = None) -> str:
    """``benchmarks.NAME`` for the running script (``sys.argv[0]`` under ``python -m``)."""
    main = Path(argv0 or sys.argv[0]).resolve()
    try:
        return ".".join(main.relative_to(REPO_ROOT).with_suffix("").parts)
    except ValueError:
        return main.stem


def command_line(argv: Optional[Sequence[str]] = None, module: Optional[str] = None) -> str:
    """The command that reproduces this run from the repository root, for the docs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module or module_name(), *(shlex.quote(a) for a in argv)])


def relative(path: str | Path) -> str:
    """``path`` relative to the repository root when it is inside it (for JSON and docs), else as is."""
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def environment() -> dict[str, Any]:
    """Where the numbers come from: machine, versions, commit (read-only git query)."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        env["git_commit"] = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def write_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON (parents created); NaN/Inf become null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, default=_plain) + "\n")
    return path


def _plain(x: Any) -> Any:
    # settings are often ``vars(args)``: paths as text, numbers (numpy, tensors) as floats
    return str(x) if isinstance(x, PurePath) else float(x)


ENVELOPE = ("benchmark", "command", "commit", "environment", "settings", "rows")


def write_result(path: str | Path, *, settings: Any, rows: Any, argv: Optional[Sequence[str]] = None,
                 benchmark: Optional[str] = None, environment_info: Optional[dict] = None,
                 command: Optional[str] = None, **extra: Any) -> Path:
    """Write one benchmark's result in the shared envelope (see the module docstring).

    ``benchmark``: the module's name under ``benchmarks`` (pass it: a benchmark run in-process by
    a test has pytest as ``sys.argv[0]``); ``argv``: the arguments of the run (default
    ``sys.argv[1:]``); ``environment_info``, ``command``: a resumed run's first ones (default: this
    run's); ``extra``: keys of the benchmark's own beside the envelope's."""
    module = module_name() if benchmark is None else f"benchmarks.{benchmark}"
    env = environment() if environment_info is None else environment_info
    payload = {"benchmark": module.rsplit(".", 1)[-1], "command": command or command_line(argv, module),
               "commit": env.get("git_commit"), "environment": env, "settings": settings, "rows": rows}
    clash = sorted(set(extra) & set(payload))
    if clash:
        raise ValueError(f"extra keys {clash} would replace the envelope's own")
    return write_json(path, {**payload, **extra})


def write_payload(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write again a result that already holds the envelope (read back or added to by a report)."""
    missing = [k for k in ENVELOPE if k not in payload]
    if missing:
        raise ValueError(f"{path}: the payload lacks the envelope's {missing}")
    rest = {k: v for k, v in payload.items() if k not in ENVELOPE}
    return write_result(path, settings=payload["settings"], rows=payload["rows"], benchmark=payload["benchmark"],
                        environment_info=payload["environment"], command=payload["command"], **rest)


def read_result(path: str | Path) -> dict[str, Any]:
    """A result file written by :func:`write_result` (an error naming the file when it is not one)."""
    payload = json.loads(Path(path).read_text())
    if not isinstance(payload, dict) or any(k not in payload for k in ENVELOPE):
        raise ValueError(f"{path} is not a benchmark result (it lacks the envelope: {', '.join(ENVELOPE)})")
    return payload


def _finite(x: Any) -> Any:
    # strict JSON has no NaN: readers in other languages choke on it
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: Optional[str] = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column (``l``/``r``), numbers right by default."""
    rows = [[_cell(v) for v in row] for row in rows]
    if align is None:
        align = "".join("r" if rows and all(_numeric(r[i]) for r in rows) else "l" for i in range(len(headers)))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _numeric(s: str) -> bool:
    try:
        float(s.replace(",", "").replace("%", "").replace("+", "").replace("x", ""))
        return True
    except ValueError:
        return s == "—"


def time_ops(ops: dict[str, Callable[[], Any]], repeats: int,
             sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each op in each of ``repeats`` rounds, after one warm-up call of each (allocator,
    lazy tables). Every round times each op once, in turn, so a burst of load from other processes
    cannot spoil all the samples of one op. ``sync`` runs before and after each call (a GPU:
    ``torch.cuda.synchronize``), so queued device work is counted in its op."""
    for fn in ops.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def mean_spread(xs: Sequence[float]) -> dict[str, float]:
    """Mean, sample std (0 for one value), min, max and count of the finite values."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
               xlabel: str, ylabel: str, bands: Optional[dict[str, tuple[Sequence[float], Sequence[float]]]] = None,
               ylim: Optional[tuple[float, float]] = None, note: Optional[str] = None) -> Path:
    """One line per label (``label -> (xs, ys)``), optional min/max band per label; saved as PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for label, (xs, ys) in series.items():
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
        if bands and label in bands:
            lo, hi = bands[label]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="0.4")
    return _save(fig, path)


def plot_bars(path: str | Path, labels: Sequence[str], values: Sequence[float], *, title: str, ylabel: str,
              log: bool = False, annotate: str = "{:.3g}", reference: Optional[tuple[str, float]] = None,
              note: Optional[str] = None) -> Path:
    """A bar chart, one bar per label; ``reference=(label, y)`` draws a horizontal line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels) + 2), 4.5), dpi=120)
    bars = ax.bar(range(len(labels)), values, color="#4c72b0")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    for bar, v in zip(bars, values):
        ax.annotate(annotate.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    if reference is not None:
        ax.axhline(reference[1], color="#c44e52", linestyle="--", linewidth=1, label=reference[0])
        ax.legend(fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="0.4")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))  # room for the bottom note
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
