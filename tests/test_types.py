"""The typed core: mypy holds ``algorithm/`` and ``transport/base.py`` to their annotations and to
the transport protocols (the files and options are pyproject.toml's ``[tool.mypy]``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error_in_the_algorithm_and_the_transport_protocols():
    # its cache outside the repository and kept between sessions: the first run reads torch's stubs
    # (about two minutes on a loaded 2-core machine), the next ones take a few seconds
    cache = Path(os.environ.get("ODS_MYPY_CACHE", Path(tempfile.gettempdir()) / "ods-mypy-cache"))
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache)], cwd=ROOT,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, f"mypy found errors:\n{run.stdout}{run.stderr}"
