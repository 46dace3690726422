"""Models (presets, local paths, blocks, sizes) and data (corpus split, shards, resume, sources)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers

from opendiloco_stream.train import data as data_mod
from opendiloco_stream.train.data import (
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TrainSource,
    build_datasets,
    builtin_corpus_files,
    load_tokenizer,
)
from opendiloco_stream.train.models import (
    PRESETS,
    build_model,
    count_parameters,
    model_flops_per_token,
    transformer_blocks,
)
from tests.support.models import save_tiny_hf_tokenizer

SEQ = 32


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def builtin():
    return build_datasets("builtin", seq_len=SEQ)


# ---------------------------------------------------------------- models


def test_same_seed_gives_bit_identical_weights_and_leaves_caller_rng_alone():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    a, b = build_model("tiny", BYTE_VOCAB_SIZE, SEQ, seed=7), build_model("tiny", BYTE_VOCAB_SIZE, SEQ, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert _same(_state(a), _state(b))
    assert not _same(_state(a), _state(build_model("tiny", BYTE_VOCAB_SIZE, SEQ, seed=8)))


def test_tiny_preset_is_small_untied_and_trains_on_cpu():
    model = build_model("tiny", BYTE_VOCAB_SIZE, SEQ, seed=0)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert 300_000 < count_parameters(model) < 3_000_000
    assert model.config.vocab_size == BYTE_VOCAB_SIZE and model.config.max_position_embeddings == SEQ
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    x = torch.randint(0, BYTE_VOCAB_SIZE, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    # An untrained model predicts close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(BYTE_VOCAB_SIZE)) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dtype_argument_casts_the_model():
    model = build_model("tiny", BYTE_VOCAB_SIZE, SEQ, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_paper_presets_have_the_table_shapes_and_grow():
    sizes = []
    for name in ("35M", "100M", "200M", "300M", "500M", "1B"):
        cfg = transformers.LlamaConfig(**PRESETS[name])
        assert cfg.hidden_size % cfg.num_attention_heads == 0
        sizes.append(model_flops_per_token(cfg, seq_len=2048))
    assert sizes == sorted(sizes)
    assert (PRESETS["1B"]["hidden_size"], PRESETS["1B"]["num_hidden_layers"]) == (2048, 24)


def test_transformer_blocks_finds_llama_layers():
    model = build_model("tiny", BYTE_VOCAB_SIZE, SEQ)
    blocks = transformer_blocks(model)
    assert len(blocks) == PRESETS["tiny"]["num_hidden_layers"]
    for i, block in enumerate(blocks):
        assert isinstance(block, torch.nn.Module) and block is model.model.layers[i]
        assert sum(p.numel() for p in block.parameters()) > 0


def test_transformer_blocks_gpt2_and_fallback_and_error():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=50))
    assert transformer_blocks(gpt2) == list(gpt2.transformer.h)

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.stack = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
            self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 2)])

    custom = Custom()
    assert transformer_blocks(custom) == list(custom.stack)
    with pytest.raises(ValueError, match="transformer blocks"):
        transformer_blocks(torch.nn.Linear(3, 3))


def test_count_parameters_counts_tied_weights_once():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    assert count_parameters(model) == sum(unique.values())
    assert count_parameters(model) < sum(p.numel() for p in model.state_dict().values())


def test_model_flops_per_token_formula_and_config_equals_model():
    model = build_model("tiny", BYTE_VOCAB_SIZE, SEQ)
    cfg = model.config
    n = count_parameters(model) - model.get_input_embeddings().weight.numel()
    expected = 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * SEQ
    assert model_flops_per_token(model) == expected
    assert model_flops_per_token(cfg) == expected
    assert model_flops_per_token(model, seq_len=2 * SEQ) > expected


def test_local_config_dir_and_json_file_build_seeded_models(tmp_path):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000
    )
    cfg.save_pretrained(tmp_path)
    a = build_model(str(tmp_path), vocab_size=300, seq_len=SEQ, seed=3)
    b = build_model(str(tmp_path / "config.json"), vocab_size=300, seq_len=SEQ, seed=3)
    assert a.config.num_hidden_layers == 3 and a.config.hidden_size == 64
    assert a.get_input_embeddings().weight.shape == (300, 64)  # vocab_size overrides the config's
    assert len(transformer_blocks(a)) == 3
    assert _same(_state(a), _state(b))


def test_local_model_dir_with_weights_loads_them(tmp_path):
    saved = build_model("tiny", BYTE_VOCAB_SIZE, SEQ, seed=11)
    saved.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), BYTE_VOCAB_SIZE, SEQ, seed=99)
    assert _same(_state(saved), _state(loaded))
    with pytest.raises(ValueError, match="embeds only"):
        build_model(str(tmp_path), BYTE_VOCAB_SIZE + 1, SEQ)


def test_unknown_model_lists_presets_and_mentions_paths():
    with pytest.raises(ValueError) as info:
        build_model("no-such-model", BYTE_VOCAB_SIZE, SEQ)
    message = str(info.value)
    assert all(name in message for name in PRESETS) and "local path" in message and "\n" not in message


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_specials():
    tok = load_tokenizer(None)
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert isinstance(tok, ByteTokenizer) and max(ids) < 256 and tok.decode(ids) == text
    assert tok.vocab_size == BYTE_VOCAB_SIZE and 256 <= tok.eos_id < BYTE_VOCAB_SIZE
    assert tok.decode(ids + [tok.eos_id]) == text  # specials decode to nothing


def test_local_hf_tokenizer_end_to_end(tmp_path):
    save_tiny_hf_tokenizer(tmp_path / "tok")
    docs = [{"text": f"the quick brown fox {i} jumps over the lazy dog"} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer) and tok.eos_id == tok.hf.convert_tokens_to_ids("</s>")
    assert tok.decode(tok.encode("the lazy dog")).strip() == "the lazy dog"
    train, val = build_datasets(str(tmp_path / "d.jsonl"), tokenizer=tok, seq_len=16)
    assert int(train.tokens.max()) < tok.vocab_size and int(val.max()) < tok.vocab_size
    assert (train.tokens == tok.eos_id).sum() > 0
    model = build_model("tiny", tok.vocab_size, 16)
    batch = next(train.batches(0, 1, 4))
    assert torch.isfinite(model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss)
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "d.jsonl"))


# ---------------------------------------------------------------- built-in corpus


def test_builtin_corpus_files_are_stdlib_sources_sorted():
    files = builtin_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    root = data_mod._stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)


def test_builtin_split_is_by_file_and_validation_is_the_held_out_files(builtin):
    train_files, val_files = data_mod._builtin_split(0.05)
    assert set(train_files).isdisjoint(val_files)
    assert sorted(train_files + val_files) == sorted(builtin_corpus_files())
    assert 0 < len(val_files) < len(train_files)
    # The training stream is exactly the training files, each followed by EOS.
    expected_len = sum(f.stat().st_size + 1 for f in train_files if f.stat().st_size)
    train, val = builtin
    assert len(train.tokens) == expected_len
    # The first validation window is the start of the held-out files' stream.
    held_out = b"".join(f.read_bytes() + b"\x00" for f in val_files if f.stat().st_size)
    first = val[0].tolist()
    eos = ByteTokenizer.eos_id
    assert bytes(0 if t == eos else t for t in first) == held_out[: SEQ + 1]
    assert val.dtype == torch.int64 and val.shape[1] == SEQ + 1 and 0 < len(val) <= 64


def test_builtin_is_deterministic_across_calls(builtin):
    train, val = builtin
    train2, val2 = build_datasets("builtin", seq_len=SEQ)
    assert np.array_equal(train.tokens, train2.tokens) and torch.equal(val, val2)
    a, b = train.batches(1, 3, 4), train2.batches(1, 3, 4)
    assert all(torch.equal(next(a), next(b)) for _ in range(5))


def test_builtin_ranks_read_disjoint_windows(builtin):
    train, _ = builtin
    world = 3
    seen = []
    for rank in range(world):
        it = train.batches(rank, world, 8)
        rows = torch.cat([next(it) for _ in range(20)])
        seen.append({bytes(r.to(torch.int16).numpy().tobytes()) for r in rows})
    assert all(seen[i].isdisjoint(seen[j]) for i in range(world) for j in range(i + 1, world))


# ---------------------------------------------------------------- TrainSource


def _indexed_source(num_windows: int, seq_len: int = 4, seed: int = 0) -> TrainSource:
    # Window i starts with token i * (seq_len + 1): a batch row names the window it came from.
    return TrainSource(np.arange(num_windows * (seq_len + 1), dtype=np.int32), seq_len, seed)


def _window_ids(batch: torch.Tensor, seq_len: int = 4) -> list[int]:
    return (batch[:, 0] // (seq_len + 1)).tolist()


def test_shards_are_disjoint_cover_everything_and_each_epoch_is_a_permutation():
    src, world, n = _indexed_source(23), 3, 23
    shards = []
    for rank in range(world):
        shard_size = len(range(rank, n, world))
        it = src.batches(rank, world, 1)
        epoch1 = [_window_ids(next(it))[0] for _ in range(shard_size)]
        epoch2 = [_window_ids(next(it))[0] for _ in range(shard_size)]
        assert sorted(epoch1) == sorted(epoch2) == list(range(rank, n, world))
        assert epoch1 != epoch2  # reshuffled each epoch
        shards.append(set(epoch1))
    assert set().union(*shards) == set(range(n)) and sum(map(len, shards)) == n


def test_batches_resume_exactly_from_start_step_across_epoch_boundaries():
    src = _indexed_source(37, seed=5)
    reference = src.batches(1, 2, 5)
    expected = [next(reference) for _ in range(25)]  # 18-window shard: crosses several epochs
    for k in (0, 1, 3, 4, 7, 20):
        resumed = src.batches(1, 2, 5, start_step=k)
        for want in expected[k : k + 5]:
            assert torch.equal(next(resumed), want)


def test_seed_changes_the_order_and_bad_arguments_are_data_errors():
    a, b = _indexed_source(40, seed=0), _indexed_source(40, seed=1)
    assert _window_ids(next(a.batches(0, 1, 40))) != _window_ids(next(b.batches(0, 1, 40)))
    assert a.tokens_per_batch(8) == 8 * 4
    with pytest.raises(DataError):
        a.batches(2, 2, 4)
    with pytest.raises(DataError, match="too few"):
        _indexed_source(2).batches(2, 3, 1)


# ---------------------------------------------------------------- datasets sources


def test_local_jsonl_through_datasets(tmp_path):
    docs = [f"document number {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(300)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    train, val = build_datasets(str(path), seq_len=SEQ, text_field="body")
    total = sum(len(d.encode()) + 1 for d in docs)
    assert len(train.tokens) + sum(len(d.encode()) + 1 for d in docs if data_mod._hash_unit(d) < 0.05) == total
    assert ByteTokenizer().decode(train.tokens[:40].tolist()).startswith("document number")
    assert 0 < len(val) <= 64
    with pytest.raises(DataError, match="no field 'text'"):
        build_datasets(str(path), seq_len=SEQ)


def test_local_txt_file_and_directory_through_datasets(tmp_path):
    paragraphs = [f"paragraph {i}\nwith two lines" for i in range(50)]
    (tmp_path / "one.txt").write_text("\n\n".join(paragraphs))
    train, val = build_datasets(str(tmp_path / "one.txt"), seq_len=8)
    eos = ByteTokenizer.eos_id
    n_docs = int((train.tokens == eos).sum()) + int((val == eos).sum())
    assert n_docs >= 40  # one document per paragraph (val may hold a moved tail)
    sub = tmp_path / "dir"
    sub.mkdir()
    (sub / "a.txt").write_text("alpha " * 200)
    (sub / "b.txt").write_text("beta " * 200)
    train, val = build_datasets(str(sub), seq_len=8)
    text = ByteTokenizer().decode(train.tokens.tolist()) + ByteTokenizer().decode(val.flatten().tolist())
    assert "alpha" in text and "beta" in text
    (sub / "c.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="mixes file types"):
        build_datasets(str(sub), seq_len=8)


def test_too_small_dataset_is_a_clear_error(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match="too small"):
        build_datasets(str(tmp_path / "t.jsonl"), seq_len=64)


def test_unreachable_hub_dataset_is_one_clean_data_error():
    # A subprocess: huggingface_hub and datasets read HF_HUB_OFFLINE when they are imported.
    code = textwrap.dedent(
        """
        from opendiloco_stream.train.data import DataError, build_datasets
        try:
            build_datasets("no-such-org/no-such-dataset", seq_len=16)
        except DataError as e:
            print("DATAERROR:" + str(e))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = next(l for l in out.stdout.splitlines() if l.startswith("DATAERROR:"))
    assert "no-such-org/no-such-dataset" in line
    assert "Traceback" not in out.stderr
