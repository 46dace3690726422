"""Data: tokenizers, the built-in offline corpus, ``datasets`` sources, and per-rank batches.

Sources (``build_datasets(dataset=...)``):

* ``"builtin"``: the running Python's standard-library ``*.py`` files (real text, no download;
  ~12 MB on CPython 3.11). Split into train / validation by file, on a hash of the file's path
  relative to the stdlib root, so the split does not depend on the seed or on the machine.
* a local file or directory of ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files, read with
  ``datasets``' ``text`` / ``json`` / ``parquet`` builders (field ``text_field``; ``.txt`` files
  yield one document per blank-line separated paragraph);
* anything else is a hub dataset name, streamed with ``datasets.load_dataset(name, config,
  streaming=True)`` and tokenized on the fly as training reads it (``train/streaming_data.py``;
  ``streaming=True`` does the same for local files). With ``streaming=False`` a hub dataset is read
  into memory instead, at most ``max_tokens`` training tokens (default 50 M).

For non-builtin sources, documents go to validation on a hash of their text. Documents are
tokenized, each followed by EOS, concatenated, and cut into non-overlapping windows of
``seq_len + 1`` tokens (input ``x[:, :-1]``, target ``x[:, 1:]``). Validation keeps at most
``max_val_windows`` windows, evenly spaced, to keep evaluation cheap. Token ids are stored as
uint16 (int32 for vocabularies over 65536) and widened to int64 per batch.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from opendiloco_stream.config import RunConfig
from opendiloco_stream.train.streaming_data import build_streaming
from opendiloco_stream.train.text_dataset import DataError, first_line, open_dataset

#: Byte-level vocabulary: ids 0..255 are the byte values, then BOS (256), EOS (257), PAD (258).
BYTE_VOCAB_SIZE = 259
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

#: Default cap on training tokens read from a streamed hub dataset.
HUB_MAX_TOKENS = 50_000_000


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus BOS/EOS/PAD specials; needs no files."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers`` tokenizer behind the same small interface as :class:`ByteTokenizer`."""

    def __init__(self, tokenizer, name: str):
        self.hf = tokenizer
        self.name = name
        # len() counts added special tokens, which ``tokenizer.vocab_size`` leaves out.
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        if eos is None:
            eos = tokenizer.sep_token_id
        if eos is None:
            raise DataError(f"tokenizer '{name}' has no EOS (or SEP) token to separate documents; add one")
        self.eos_id = int(eos)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.hf(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids))


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(path: Optional[str]) -> Tokenizer:
    """``None`` -> :class:`ByteTokenizer`; else a HF tokenizer from a local directory (or hub name)."""
    if path is None or path in ("", "byte"):
        return ByteTokenizer()

    local = Path(path).expanduser().is_dir()
    try:
        tok = AutoTokenizer.from_pretrained(str(Path(path).expanduser()) if local else path, local_files_only=local)
    except Exception as e:  # transformers raises OSError, ValueError, HTTP errors...
        raise DataError(f"cannot load tokenizer '{path}': {first_line(e)}") from None
    return HFTokenizer(tok, path)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


# Third-party packages are not the stdlib; the test suites hold deliberately malformed files and
# large binary-ish fixtures that would dominate a small corpus.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def builtin_corpus_files() -> list[Path]:
    """The running Python's standard-library ``*.py`` files, sorted by path relative to the stdlib."""
    root = _stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    if not found:
        raise DataError(f"built-in corpus: no *.py files under the stdlib path {root}; pass --dataset PATH")
    return found


def _hash_unit(key: Union[str, bytes]) -> float:
    """Deterministic (process- and machine-independent) hash of ``key`` into [0, 1)."""
    data = key.encode("utf-8", errors="surrogatepass") if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2.0**64


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def _pack(docs: list[np.ndarray], eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Concatenate documents, each followed by EOS, into one compact array (no Python per-token loop)."""
    out = np.empty(sum(len(d) + 1 for d in docs), dtype=dtype)
    pos = 0
    for d in docs:
        out[pos : pos + len(d)] = d
        out[pos + len(d)] = eos_id
        pos += len(d) + 1
    return out


class TrainSource:
    """Training windows of ``seq_len + 1`` tokens, served as disjoint per-rank shards.

    Rank ``r`` of ``W`` owns windows ``i`` with ``i % W == r``. Its stream is the concatenation of
    epochs, each a permutation of the shard drawn from ``(seed, rank, W, epoch)``; batch ``k`` is
    items ``k*B .. k*B+B-1`` of that stream (batches run across epoch boundaries). Hence
    ``batches(start_step=k)`` equals ``batches()`` after ``k`` batches, and costs one permutation.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, tokenizer: Optional[Tokenizer] = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.tokenizer = tokenizer
        self.num_windows = len(tokens) // (seq_len + 1)

    def tokens_per_batch(self, batch_size: int) -> int:
        """Predicted (target) tokens in one batch: ``batch_size * seq_len``."""
        return batch_size * self.seq_len

    def _epoch_order(self, shard: np.ndarray, epoch: int, rank: int, world_size: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, rank, world_size, epoch])
        return shard[rng.permutation(len(shard))]

    def batches(self, rank: int, world_size: int, batch_size: int, start_step: int = 0) -> Iterator[torch.Tensor]:
        """Endless deterministic int64 batches ``[batch_size, seq_len + 1]`` of this rank's shard."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size < 1 or start_step < 0:
            raise DataError(f"batch_size must be >= 1 and start_step >= 0, got {batch_size} and {start_step}")
        shard = np.arange(rank, self.num_windows, world_size)
        if len(shard) == 0:
            raise DataError(
                f"the training data has {self.num_windows} windows of {self.seq_len + 1} tokens: "
                f"too few for {world_size} ranks; use more data or a shorter seq_len"
            )
        return self._iterate(shard, rank, world_size, batch_size, start_step)

    def _iterate(self, shard, rank, world_size, batch_size, start_step) -> Iterator[torch.Tensor]:
        span = self.seq_len + 1
        epoch, offset = divmod(start_step * batch_size, len(shard))
        order = self._epoch_order(shard, epoch, rank, world_size)
        cols = np.arange(span)
        while True:
            rows = np.empty(batch_size, dtype=np.int64)
            filled = 0
            while filled < batch_size:
                if offset == len(order):
                    epoch, offset = epoch + 1, 0
                    order = self._epoch_order(shard, epoch, rank, world_size)
                take = min(batch_size - filled, len(order) - offset)
                rows[filled : filled + take] = order[offset : offset + take]
                filled, offset = filled + take, offset + take
            yield torch.from_numpy(self.tokens[rows[:, None] * span + cols].astype(np.int64))


def _windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def build_datasets(
    dataset: str = "builtin",
    tokenizer: Optional[Tokenizer] = None,
    seq_len: int = 128,
    val_fraction: float = 0.05,
    dataset_config: Optional[str] = None,
    text_field: str = "text",
    seed: int = 0,
    max_val_windows: int = 64,
    max_tokens: Optional[int] = None,
    streaming: Optional[bool] = None,
) -> tuple[TrainSource, torch.Tensor]:
    """Return ``(train source, validation int64 tensor [N_val, seq_len + 1])``; see the module doc.

    ``seed`` only shuffles the training order; the split is a pure function of the data.
    ``max_tokens`` caps the training tokens read (default: all for local data, ``HUB_MAX_TOKENS``
    for hub streams).
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if streaming is None:  # hub names stream by default; local files are small enough to load
        streaming = dataset != "builtin" and not Path(dataset).expanduser().exists()
    if streaming:
        if dataset == "builtin":
            raise DataError("the built-in corpus is not streamed: set data.streaming = false or pass --dataset NAME")
        return build_streaming(dataset, tokenizer, seq_len, val_fraction=val_fraction, dataset_config=dataset_config,
                               text_field=text_field, max_val_windows=max_val_windows)
    dtype = _token_dtype(tokenizer.vocab_size)
    if dataset == "builtin":
        train_docs, val_docs = _builtin_docs(tokenizer, val_fraction)
    else:
        train_docs, val_docs = _dataset_docs(dataset, dataset_config, text_field, tokenizer, val_fraction, max_tokens)
    train = _pack(train_docs, tokenizer.eos_id, dtype)
    val = _pack(val_docs, tokenizer.eos_id, dtype)
    span = seq_len + 1
    if len(val) < span:
        # Too little held-out text (tiny local files): move the tail of the training stream instead.
        n_move = max(1, math.ceil(val_fraction * (len(train) // span)))
        val, train = train[len(train) - n_move * span :], train[: len(train) - n_move * span]
    if len(train) < span:
        raise DataError(
            f"dataset '{dataset}' is too small: {len(train) + len(val)} tokens, "
            f"need at least {2 * span} for seq_len {seq_len}"
        )
    val_windows = _windows(val, seq_len)
    if len(val_windows) > max_val_windows:
        keep = np.linspace(0, len(val_windows) - 1, max_val_windows).round().astype(np.int64)
        val_windows = val_windows[keep]
    return TrainSource(train, seq_len, seed, tokenizer), torch.from_numpy(val_windows.astype(np.int64))


def load_run_data(cfg: RunConfig) -> tuple[TrainSource, torch.Tensor, int]:
    """(train source, validation tensor, vocab size) of a run's ``data`` section (DataError if unusable)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    train_source, val = build_datasets(
        cfg.data.dataset, tokenizer=tokenizer, seq_len=cfg.model.seq_len, val_fraction=cfg.data.val_fraction,
        dataset_config=cfg.data.dataset_config, text_field=cfg.data.text_field, seed=cfg.train.seed,
        streaming=cfg.data.streaming)
    return train_source, val, tokenizer.vocab_size


def _builtin_split(val_fraction: float) -> tuple[list[Path], list[Path]]:
    root = _stdlib_root()
    files = builtin_corpus_files()
    keys = [_hash_unit(p.relative_to(root).as_posix()) for p in files]
    is_val = [k < val_fraction for k in keys]
    if not any(is_val):  # a tiny fraction still holds out one file: the lowest hash
        is_val[int(np.argmin(keys))] = True
    return [f for f, v in zip(files, is_val) if not v], [f for f, v in zip(files, is_val) if v]


def _builtin_docs(tokenizer: Tokenizer, val_fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, validation) documents of the built-in corpus; empty files are skipped."""

    def read(files: list[Path]) -> list[np.ndarray]:
        if isinstance(tokenizer, ByteTokenizer):  # raw bytes are the tokens: no decode / encode
            docs = [np.frombuffer(f.read_bytes(), dtype=np.uint8) for f in files]
        else:
            docs = tokenizer.encode_batch([f.read_text("utf-8", errors="replace") for f in files])
        return [d for d in docs if len(d)]

    train, val = _builtin_split(val_fraction)
    return read(train), read(val)


def _dataset_docs(
    dataset: str,
    dataset_config: Optional[str],
    text_field: str,
    tokenizer: Tokenizer,
    val_fraction: float,
    max_tokens: Optional[int],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    if max_tokens is None and not Path(dataset).expanduser().exists():
        max_tokens = HUB_MAX_TOKENS
    stream = open_dataset(dataset, dataset_config)
    train, val, n_train, chunk = [], [], 0, []

    def flush() -> None:
        nonlocal n_train
        for text, ids in zip(chunk, tokenizer.encode_batch(chunk)):
            if _hash_unit(text) < val_fraction:
                val.append(ids)
            else:
                train.append(ids)
                n_train += len(ids) + 1
        chunk.clear()

    try:
        with tqdm(desc=f"reading {dataset}", unit=" docs", disable=None) as bar:
            for row in stream:
                if text_field not in row:
                    raise DataError(f"dataset '{dataset}' has no field '{text_field}' (fields: {', '.join(row)})")
                if row[text_field]:
                    chunk.append(str(row[text_field]))
                if len(chunk) >= 1000:
                    bar.update(len(chunk))
                    flush()
                    if max_tokens is not None and n_train >= max_tokens:
                        break
            bar.update(len(chunk))
            flush()
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot read dataset '{dataset}': {first_line(e)}") from None
    if not train and not val:
        raise DataError(f"dataset '{dataset}' has no non-empty '{text_field}' documents")
    return train, val
