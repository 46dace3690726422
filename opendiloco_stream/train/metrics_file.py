"""JSON-lines metrics files (``--metrics-file``): one writer, one reader.

Every training command writes one JSON object per line (``MetricsWriter``). Readers go through
:class:`MetricsTail`, which reads a file another process may still be writing: complete lines
only, a cut or garbled line skipped rather than fatal; :func:`read_metrics` reads a whole file.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Optional


class MetricsWriter:
    """Thread-safe JSON-lines writer (``--metrics-file``); a no-op without a path."""

    def __init__(self, path: Optional[str]):
        self._lock = threading.Lock()
        self._fh = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        line = json.dumps(record, default=float)
        with self._lock:
            self._fh.write(line + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class MetricsTail:
    """Incremental reader of a JSON-lines file: each ``read()`` returns the records added since."""

    def __init__(self, path: "str | Path"):
        self.path, self.offset, self._rest = Path(path), 0, ""

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        """New complete records; with ``final`` also a last line without its newline. Lines that
        are not JSON (a writer killed mid-line) are skipped."""
        if self.path.exists():
            with open(self.path) as fh:
                fh.seek(self.offset)
                data = fh.read()
                self.offset = fh.tell()
            self._rest += data
        *lines, self._rest = self._rest.split("\n")
        if final:
            lines, self._rest = lines + [self._rest], ""
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def read_metrics(path: "str | Path") -> list[dict[str, Any]]:
    """The records of a JSON-lines metrics file; a missing file is empty and a cut last line
    (a peer still writing, or killed mid-line) is skipped."""
    return MetricsTail(path).read(final=True)
