"""Streamed datasets (``datasets`` streaming=True), through the same IterableDataset path a hub name
takes, on local jsonl / parquet files: sharding, on-the-fly tokenization, exact resume from the
position recorded in checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch

from opendiloco_stream.config import load_config
from opendiloco_stream.train.data import ByteTokenizer, DataError, build_datasets, load_tokenizer
from opendiloco_stream.train.streaming_data import StreamingSource

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + f" doc{i}" for i in range(n)]


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))


@pytest.fixture()
def jsonl_dir(tmp_path):
    docs = _docs(300)
    d = tmp_path / "jsonl"
    d.mkdir()
    _write_jsonl(d / "part-0.jsonl", docs[:150])
    _write_jsonl(d / "part-1.jsonl", docs[150:])
    return d, docs


def _ids(batch: torch.Tensor) -> list[list[int]]:
    return batch.tolist()


def test_hub_names_stream_by_default_and_local_files_only_when_asked(jsonl_dir, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # this machine has no hub: fail at once
    d, _ = jsonl_dir
    in_memory, _ = build_datasets(str(d), seq_len=16)
    streamed, val = build_datasets(str(d), seq_len=16, streaming=True)
    assert not isinstance(in_memory, StreamingSource) and isinstance(streamed, StreamingSource)
    assert val.shape[1] == 17 and val.dtype == torch.int64
    with pytest.raises(DataError, match="cannot load dataset 'no-such-user/no-such-dataset'"):
        build_datasets("no-such-user/no-such-dataset", seq_len=16)  # a hub name: streamed, fails in one line


@pytest.mark.parametrize("n_docs,batch_size,stop_at", [(300, 4, 7), (24, 3, 30)])  # mid-epoch; a later epoch
def test_resume_from_recorded_position_gives_exactly_the_uninterrupted_batches(tmp_path, n_docs, batch_size, stop_at):
    docs = _docs(n_docs)
    _write_jsonl(tmp_path / "part-0.jsonl", docs[: n_docs // 2])
    _write_jsonl(tmp_path / "part-1.jsonl", docs[n_docs // 2:])
    source, _ = build_datasets(str(tmp_path), seq_len=24, streaming=True)
    for rank, world in ((0, 1), (1, 2)):
        reference = source.batches(rank, world, batch_size)
        straight = [_ids(next(reference)) for _ in range(stop_at + 12)]
        run = source.batches(rank, world, batch_size)
        for _ in range(stop_at):
            next(run)
        position = run.position()
        assert position["batches"] == stop_at and position["shard"] == [rank, world]
        assert (position["epoch"] >= 1) == (n_docs < 100)  # the small data set wrapped around
        resumed = source.batches(rank, world, batch_size, position=position)
        assert [_ids(next(resumed)) for _ in range(12)] == straight[stop_at:]
        # start_step (no position, e.g. a late joiner) re-reads the stream and lands at the same place
        skipped = source.batches(rank, world, batch_size, start_step=stop_at)
        assert _ids(next(skipped)) == straight[stop_at]


def test_shards_are_disjoint_and_validation_documents_never_train(tmp_path):
    docs = _docs(240, seed=1)
    _write_jsonl(tmp_path / "one.jsonl", docs)  # one file: documents are dealt out to the ranks
    tok = ByteTokenizer()
    source, val = build_datasets(str(tmp_path / "one.jsonl"), tokenizer=tok, seq_len=31, streaming=True,
                                 val_fraction=0.1)
    val_docs = {d for d in docs if source.is_validation(d)}
    assert 0 < len(val_docs) < len(docs)

    def seen(rank, world):
        it = source.batches(rank, world, 2)
        text = ""
        while it.epoch == 0:
            text += tok.decode(next(it).flatten().tolist())
        return {d for d in docs if f"{d}" in text}, text

    seen0, text0 = seen(0, 2)
    seen1, _ = seen(1, 2)
    train_docs = set(docs) - val_docs
    # every training document that fits wholly inside one batch window is seen by exactly one rank
    assert not (seen0 & seen1)
    assert len(seen0 | seen1) > 0.5 * len(train_docs)
    assert not ((seen0 | seen1) & val_docs)
    assert tok.decode(val.flatten().tolist()).split("doc")[0] in "".join(val_docs)


def test_parquet_with_the_models_hf_tokenizer(tmp_path):
    import pyarrow as pa  # a dependency of datasets
    import pyarrow.parquet as pq

    from tests.support.models import save_tiny_hf_tokenizer

    save_tiny_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    docs = _docs(200, seed=2)
    pq.write_table(pa.table({"content": docs}), tmp_path / "d.parquet", row_group_size=50)
    source, val = build_datasets(str(tmp_path / "d.parquet"), tokenizer=tok, seq_len=16, streaming=True,
                                 text_field="content")
    batches = source.batches(0, 1, 4)
    first = next(batches)
    assert first.shape == (4, 17) and int(first.max()) < tok.vocab_size and int(val.max()) < tok.vocab_size
    expected = [t for d in docs if not source.is_validation(d) for t in tok.encode(d) + [tok.eos_id]]
    assert first.flatten().tolist() == expected[:4 * 17]  # tokenized on the fly, in stream order
    with pytest.raises(DataError, match="no field 'text'"):
        build_datasets(str(tmp_path / "d.parquet"), tokenizer=tok, seq_len=16, streaming=True)


def test_position_of_another_shard_is_refused(jsonl_dir):
    d, _ = jsonl_dir
    source, _ = build_datasets(str(d), seq_len=16, streaming=True)
    it = source.batches(0, 2, 4)
    next(it)
    with pytest.raises(DataError, match="does not match this run"):
        source.batches(1, 2, 4, position=it.position())


def test_training_resumed_from_checkpoint_continues_the_stream_exactly(jsonl_dir, tmp_path, monkeypatch):
    """Two workers train on a streamed dataset; stopped at step 5 and resumed, the checkpoint's data
    position makes the rest of the run read the same batches, so the final models are bit-identical."""
    from opendiloco_stream.commands.local import prepare_data
    from opendiloco_stream.train.loop import train_worker
    from opendiloco_stream.transport.local import LocalSwarm

    torch.set_num_threads(1)
    d, _ = jsonl_dir

    def train(ckdir, steps, resume=False, stop_after=None):
        cfg = load_config(None, {
            "model": {"name": "tiny", "seq_len": 24},
            "data": {"dataset": str(d), "streaming": True, "max_val_batches": 1},
            "diloco": {"mode": "eager", "inner_steps": 4, "num_fragments": 2},
            "train": {"steps": steps, "batch_size": 2, "warmup_steps": 2, "checkpoint_dir": str(ckdir),
                      "resume": resume}})
        train_source, val, vocab = prepare_data(cfg)
        assert isinstance(train_source, StreamingSource)
        swarm = LocalSwarm(num_workers=2)
        out = {}

        def worker(rank):
            done = []

            def should_stop():
                done.append(1)
                return stop_after is not None and len(done) >= stop_after

            train_worker(rank, 2, cfg, swarm.transport(rank), train_source, val, vocab, lambda rec: None,
                         should_stop=should_stop)
            out[rank] = torch.load(ckdir / f"worker-{rank}.pt", weights_only=False)

        swarm.run(worker)
        return out

    straight = train(tmp_path / "a", 12)
    stopped = train(tmp_path / "b", 12, stop_after=5)
    assert stopped[1]["data"]["kind"] == "stream" and stopped[1]["data"]["batches"] == 5
    calls = []
    original = StreamingSource.batches

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StreamingSource, "batches", spy)
    resumed = train(tmp_path / "b", 12, resume=True)
    # both workers resumed from the recorded position, without re-reading the stream from its start
    assert len(calls) == 2 and all(c.get("position", {}).get("batches") == 5 for c in calls), calls
    for rank in (0, 1):
        assert resumed[rank]["data"]["batches"] == straight[rank]["data"]["batches"] == 12
        assert resumed[rank]["data"]["dataset"] == straight[rank]["data"]["dataset"]
        for key, value in straight[rank]["model"].items():
            assert torch.equal(value, resumed[rank]["model"][key]), key
