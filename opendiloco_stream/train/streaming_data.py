"""Streamed training data: a ``datasets`` IterableDataset read and tokenized on the fly.

``--dataset allenai/c4 --dataset-config en`` (any hub name) opens the dataset with
``datasets.load_dataset(name, config, split="train", streaming=True)``: nothing is downloaded up
front, each peer reads its own shard as it trains. Local ``.jsonl`` / ``.parquet`` / ``.txt`` files
go through the same path with ``data.streaming = true`` (``load_dataset("json", data_files=...,
streaming=True)`` is the same IterableDataset class), which is how it is tested offline.

How a peer's batches are made:

* **Shard.** ``datasets.distributed.split_dataset_by_node(ds, rank, world)``: whole files per peer
  when the number of files divides by the world size, else every ``world``-th document.
* **Validation.** Documents whose text hashes below ``val_fraction`` are held out (the same rule as
  the in-memory path); the validation set is the first ``max_val_windows`` windows of held-out
  documents of the *unsharded* stream (reading at most ``max_val_docs`` documents), so every peer
  evaluates on the same text. Training skips those documents.
* **Tokens.** Each training document is tokenized with the model's tokenizer, followed by EOS,
  appended to a buffer, and cut into windows of ``seq_len + 1`` tokens; ``batch_size`` windows make
  a batch. When the shard ends, the next epoch starts (``set_epoch``).
* **Position.** ``StreamBatches.position()`` is a small dict: the IterableDataset's own
  ``state_dict()`` (which file, which row), the tokens read but not yet emitted, the epoch and the
  number of batches served. It goes into checkpoints; ``batches(position=...)`` resumes there, and
  the batches that follow are exactly those an uninterrupted run gets (tested).

No shuffle buffer is used: ``datasets`` cannot restore one, which would break exact resume. Hub
pretraining corpora are stored shuffled; for local files, shuffle them once when writing them.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from opendiloco_stream.train.text_dataset import DataError, open_dataset

#: Documents tokenized per call (fast tokenizers are much quicker in batches).
CHUNK_DOCS = 32
#: Documents read at most to collect the validation windows.
MAX_VAL_DOCS = 20_000
POSITION_FORMAT = 1


def _hash_unit(text: str) -> float:
    data = text.encode("utf-8", errors="surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2.0**64


class StreamingSource:
    """Training batches of a streamed dataset, per rank, with a resumable position (module doc)."""

    streaming = True

    def __init__(self, open_stream: Callable[[], Any], name: str, tokenizer, seq_len: int, text_field: str = "text",
                 val_fraction: float = 0.05):
        self.open_stream = open_stream  # () -> a fresh datasets.IterableDataset
        self.name = name
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.text_field = text_field
        self.val_fraction = val_fraction

    def tokens_per_batch(self, batch_size: int) -> int:
        return batch_size * self.seq_len

    def _text(self, row: dict) -> Optional[str]:
        if self.text_field not in row:
            raise DataError(f"dataset '{self.name}' has no field '{self.text_field}' (fields: {', '.join(row)}); "
                            "set data.text_field")
        value = row[self.text_field]
        return str(value) if value else None

    def is_validation(self, text: str) -> bool:
        return _hash_unit(text) < self.val_fraction

    def validation(self, max_windows: int = 64, max_docs: int = MAX_VAL_DOCS) -> torch.Tensor:
        """``[N, seq_len + 1]`` int64 windows of held-out documents from the start of the stream."""
        span, buf, windows, docs = self.seq_len + 1, [], [], 0
        for row in self.open_stream():
            docs += 1
            text = self._text(row)
            if text is not None and self.is_validation(text):
                buf.extend(self.tokenizer.encode(text))
                buf.append(self.tokenizer.eos_id)
                while len(buf) >= span and len(windows) < max_windows:
                    windows.append(buf[:span])
                    buf = buf[span:]
            if len(windows) >= max_windows or docs >= max_docs:
                break
        if not windows:
            raise DataError(f"dataset '{self.name}': no validation window of {span} tokens among the first {docs} "
                            f"documents (data.val_fraction = {self.val_fraction}); raise val_fraction or use more data")
        return torch.tensor(windows, dtype=torch.int64)

    def batches(self, rank: int, world_size: int, batch_size: int, start_step: int = 0,
                position: Optional[dict] = None) -> "StreamBatches":
        """Endless ``[batch_size, seq_len + 1]`` int64 batches of this rank's shard.

        ``position`` (from ``StreamBatches.position()``, e.g. out of a checkpoint) resumes exactly;
        without it, ``start_step`` batches are read and dropped (exact too, but it reads the data).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or start_step < 0:
            raise DataError(f"batch_size must be >= 1 and start_step >= 0, got {batch_size} and {start_step}")
        it = StreamBatches(self, rank, world_size, batch_size, position)
        if position is None:
            for _ in range(start_step):
                next(it)
        return it


class StreamBatches(Iterator[torch.Tensor]):
    """The iterator ``StreamingSource.batches`` returns; ``position()`` is where it stands."""

    def __init__(self, source: StreamingSource, rank: int, world_size: int, batch_size: int,
                 position: Optional[dict] = None):
        self.source, self.batch_size = source, batch_size
        self.rank, self.world_size = rank, world_size
        self.epoch, self.served, self.buffer = 0, 0, np.zeros(0, dtype=np.int64)
        self._docs_in_epoch = 0
        if position is not None:
            if position.get("format") != POSITION_FORMAT or position.get("shard") != [rank, world_size] \
                    or position.get("batch_size") != batch_size:
                raise DataError(f"the recorded data position (shard {position.get('shard')}, batch size "
                                f"{position.get('batch_size')}) does not match this run (shard {[rank, world_size]}, "
                                f"batch size {batch_size}); resume with the same shard and batch size")
            self.epoch, self.served = int(position["epoch"]), int(position["batches"])
            self.buffer = np.asarray(position["buffer"], dtype=np.int64)
            self._docs_in_epoch = int(position.get("docs_in_epoch", 0))
        self.ds = self._open_shard()
        self._state = copy.deepcopy(self.ds.state_dict())  # state after the last document read
        if position is not None:
            # (state_dict() reports a fresh state until the restored iterator reads something)
            self.ds.load_state_dict(copy.deepcopy(position["dataset"]))
            self._state = copy.deepcopy(position["dataset"])
        self._rows = iter(self.ds)

    def position(self) -> dict:
        """Where the stream stands after the last batch served (JSON-able except the buffer)."""
        return {"format": POSITION_FORMAT, "kind": "stream", "shard": [self.rank, self.world_size],
                "batch_size": self.batch_size, "epoch": self.epoch, "batches": self.served,
                "docs_in_epoch": self._docs_in_epoch,
                "dataset": copy.deepcopy(self._state), "buffer": self.buffer.copy()}

    def _open_shard(self):
        from datasets.distributed import split_dataset_by_node  # lazy: as in text_dataset.open_dataset

        ds = split_dataset_by_node(self.source.open_stream(), rank=self.rank, world_size=self.world_size)
        ds.set_epoch(self.epoch)
        return ds

    def _read_chunk(self) -> list[str]:
        """Up to CHUNK_DOCS training texts; starts the next epoch at the end of the shard."""
        src, texts = self.source, []
        while len(texts) < CHUNK_DOCS:
            try:
                row = next(self._rows)
            except StopIteration:
                if self._docs_in_epoch == 0 and not texts:
                    raise DataError(f"dataset '{src.name}': shard {self.rank}/{self.world_size} has no training "
                                    "document; use fewer peers or more data") from None
                self.epoch += 1
                self._docs_in_epoch = 0
                self.ds = self._open_shard()
                self._rows = iter(self.ds)
                if texts:
                    break
                continue
            text = src._text(row)
            if text is not None and not src.is_validation(text):
                texts.append(text)
                self._docs_in_epoch += 1
        self._state = copy.deepcopy(self.ds.state_dict())
        return texts

    def __next__(self) -> torch.Tensor:
        span = self.source.seq_len + 1
        need = self.batch_size * span
        tok = self.source.tokenizer
        while len(self.buffer) < need:
            texts = self._read_chunk()
            parts = [self.buffer]
            for ids in tok.encode_batch(texts):
                parts.append(np.asarray(ids, dtype=np.int64))
                parts.append(np.array([tok.eos_id], dtype=np.int64))
            self.buffer = np.concatenate(parts)
        batch, self.buffer = self.buffer[:need], self.buffer[need:]
        self.served += 1
        return torch.from_numpy(batch.reshape(self.batch_size, span).copy())


def open_stream_fn(dataset: str, dataset_config: Optional[str]) -> Callable[[], Any]:
    """A function returning a fresh IterableDataset of ``dataset`` (hub name or local files)."""
    def open_stream():
        return open_dataset(dataset, dataset_config)

    return open_stream


def build_streaming(dataset: str, tokenizer, seq_len: int, val_fraction: float = 0.05,
                    dataset_config: Optional[str] = None, text_field: str = "text",
                    max_val_windows: int = 64) -> tuple[StreamingSource, torch.Tensor]:
    """``(StreamingSource, validation windows)`` of a hub dataset name or local files, streamed."""
    label = str(Path(dataset).expanduser()) if Path(dataset).expanduser().exists() else dataset
    source = StreamingSource(open_stream_fn(dataset, dataset_config), label, tokenizer, seq_len,
                             text_field=text_field, val_fraction=val_fraction)
    return source, source.validation(max_windows=max_val_windows)
