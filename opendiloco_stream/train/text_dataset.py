"""Opening a text dataset with ``datasets``: a hub name or local files, as a streamed
IterableDataset, and :class:`DataError`, the one error a dataset or tokenizer gives.

Both the in-memory path (``data.py``) and the streamed one (``streaming_data.py``) open datasets
here; local ``.txt`` / ``.jsonl`` / ``.parquet`` files go through the same loader as hub names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from opendiloco_stream.config import ConfigError


class DataError(ConfigError):
    """A dataset or tokenizer that cannot be used: printed as one line, exit code 2."""


_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _local_files(path: Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and sorted data files for a local file or directory."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if p.suffix.lower() in _BUILDERS]
    builders = {_BUILDERS[p.suffix.lower()] for p in files}
    if not files:
        raise DataError(f"dataset '{path}': no {'/'.join(_BUILDERS)} files found")
    if len(builders) > 1:
        raise DataError(f"dataset '{path}' mixes file types ({', '.join(sorted(builders))}); use one kind")
    return builders.pop(), [str(p) for p in files]


def open_dataset(dataset: str, dataset_config: Optional[str]):
    import datasets  # lazy: pandas/pyarrow, ~1 s of every peer start-up; only a --dataset other than builtin needs it

    path = Path(dataset).expanduser()
    try:
        if path.exists():
            builder, files = _local_files(path)
            extra = {"sample_by": "paragraph"} if builder == "text" else {}
            return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **extra)
        return datasets.load_dataset(dataset, dataset_config, split="train", streaming=True)
    except DataError:
        raise
    except Exception as e:  # network, auth, missing config, bad files: all become one line
        raise DataError(f"cannot load dataset '{dataset}': {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
