"""Model helpers the tests share: the export check the hivemind tests run on a peer's checkpoint,
a tiny Hugging Face tokenizer. Here, not in a test module: tests import support, never each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from opendiloco_stream.algorithm.fragments import partition
from opendiloco_stream.config import RunConfig
from opendiloco_stream.train.models import transformer_blocks

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m opendiloco_stream ARGS`` from the repository root, output captured as text."""
    return subprocess.run([sys.executable, "-m", "opendiloco_stream", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def theta_bar_by_name(ckpt: dict, model) -> dict[str, torch.Tensor]:
    """The checkpoint's outer parameters named as the run's fragments name them."""
    cfg = RunConfig.model_validate(ckpt["config"])
    frags = partition(model, transformer_blocks(model), cfg.diloco.num_fragments, cfg.diloco.fragment_pattern)
    return {n: t for f, st in zip(frags, ckpt["diloco"]["fragments"]) for n, t in zip(f.names, st["outer_params"])}


def assert_export_is_theta_bar(checkpoint_dir: Path, out: Path, rank: Optional[int] = None) -> None:
    """``export`` of ``checkpoint_dir`` loads in transformers with the checkpoint's theta_bar, bit for
    bit, and generates (the hivemind tests call this on a late joiner's and a sharded peer's files)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    flags = [] if rank is None else ["--rank", str(rank)]
    proc = cli("export", "--checkpoint-dir", str(checkpoint_dir), "--out", str(out), "--no-eval", *flags)
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    name = "worker-0.pt" if rank is None and (checkpoint_dir / "worker-0.pt").is_file() else f"worker-{rank}.pt"
    expected = theta_bar_by_name(torch.load(checkpoint_dir / name, weights_only=False), model)
    params = dict(model.named_parameters())
    assert set(expected) == set(params) and all(torch.equal(params[n], v) for n, v in expected.items())
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("x = ", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id).shape[1] > ids.shape[1]


def save_tiny_hf_tokenizer(path) -> None:
    """A 300-token byte-level BPE tokenizer trained on two lines, saved as a transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "def main(): return 42"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
