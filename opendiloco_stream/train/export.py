"""The trained model out: theta_bar as a ``transformers`` model directory.

theta_bar is the model every peer of a run agrees on: the fp32 outer parameters of every fragment
(``StreamingDiLoCo`` keeps them whole on a peer's rank 0, sharded peers included), or, in mode
``data-parallel``, the model itself. :func:`export_checkpoint` reads it from a checkpoint
(``worker-<rank>.pt``, any mode, a late joiner's too); :func:`save_model_at_end` from the live
wrapper at the end of training (``train.save_model``). Both write, through ``save_pretrained``:
``config.json`` and ``generation_config.json``, ``model.safetensors`` (sharded above
``max_shard_size``), the tokenizer, and a ``README.md`` with the run's settings and eval loss. The
weights are saved in fp32, bit for bit theta_bar.

The byte-level tokenizer of the project (UTF-8 bytes as ids 0..255, then BOS, EOS, PAD) has no files
of its own: :func:`byte_tokenizer` builds the same ids as a ``tokenizers`` byte-level model wrapped
in a ``PreTrainedTokenizerFast``, so ``AutoTokenizer`` loads it with the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from opendiloco_stream.algorithm.fragments import partition
from opendiloco_stream.config import ConfigError, RunConfig
from opendiloco_stream.train.checkpoint import checkpoint_path
from opendiloco_stream.train.data import (BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, HFTokenizer, load_run_data,
                                          load_tokenizer)
from opendiloco_stream.train.loss import evaluate
from opendiloco_stream.train.models import build_model, transformer_blocks

#: ``save_pretrained`` splits ``model.safetensors`` into files of at most this size (with an index).
DEFAULT_MAX_SHARD_SIZE = "2GB"
#: the byte tokenizer's special tokens, in id order after the 256 bytes (``train/data.py``)
BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


class ExportError(ConfigError):
    """A checkpoint or output directory that cannot be exported: one line, exit code 2."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: what the ``tokenizers`` ByteLevel steps map bytes to."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """The project's byte tokenizer as a ``PreTrainedTokenizerFast``: byte b is id b, BOS/EOS/PAD are
    256/257/258; the special tokens' text in a document stays bytes (``split_special_tokens``), as
    with :class:`~opendiloco_stream.train.data.ByteTokenizer`."""
    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    bos, eos, pad = BYTE_SPECIALS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   split_special_tokens=True, model_max_length=int(1e30))
    ids = [fast.convert_tokens_to_ids(t) for t in BYTE_SPECIALS]
    if ids != [BOS_ID, EOS_ID, PAD_ID] or len(fast) != BYTE_VOCAB_SIZE:  # the ids the model was trained on
        raise RuntimeError(f"byte tokenizer ids {ids} / {len(fast)} differ from the project's")
    return fast


def hf_tokenizer(cfg: RunConfig):
    """The run's tokenizer as a ``transformers`` tokenizer (the byte tokenizer built, else loaded)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    return tok.hf if isinstance(tok, HFTokenizer) else byte_tokenizer()


def theta_bar(model: torch.nn.Module, cfg: RunConfig, diloco_state: dict[str, Any],
              model_state: Optional[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Parameter name -> theta_bar tensor, from a StreamingDiLoCo ``state_dict()`` (its fragments'
    outer parameters, named by partitioning ``model`` as the run did) or, in mode data-parallel,
    from the model's own state."""
    if "fragments" not in diloco_state:  # data-parallel: every peer holds the averaged model itself
        if model_state is None:
            raise ExportError("the checkpoint holds neither outer parameters nor a model to export")
        return dict(model_state)
    frags = partition(model, transformer_blocks(model), cfg.diloco.num_fragments, cfg.diloco.fragment_pattern)
    if len(frags) != len(diloco_state["fragments"]):
        raise ExportError(f"the checkpoint has {len(diloco_state['fragments'])} fragments, the run's config "
                          f"{len(frags)}: export with the config of the run that wrote it")
    out: dict[str, torch.Tensor] = {}
    for frag, state in zip(frags, diloco_state["fragments"]):
        for name, param, value in zip(frag.names, frag.params, state["outer_params"], strict=True):
            if value.shape != param.shape:
                raise ExportError(f"{name}: the checkpoint's tensor is {tuple(value.shape)}, the run's model "
                                  f"{tuple(param.shape)}: export with the config of the run that wrote it")
            out[name] = value
    return out


def run_model(cfg: RunConfig, vocab_size: int, diloco_state: dict[str, Any],
              model_state: Optional[dict[str, torch.Tensor]]):
    """The run's model, built as training built it but in fp32, holding theta_bar (copied exactly),
    ready for ``generate``."""
    model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len, seed=cfg.train.seed,
                        dtype=torch.float32, init_from_config=cfg.model.init_from_config)
    if "fragments" not in diloco_state:  # data-parallel: the model itself
        if model_state is None:
            raise ExportError("the checkpoint holds neither outer parameters nor a model to export")
        model.load_state_dict(model_state)
    else:
        weights, params = theta_bar(model, cfg, diloco_state, model_state), dict(model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
    model.config.use_cache = True  # trained without a KV cache; generation wants one
    return model.eval()


def _set_special_ids(model, tokenizer) -> None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(model.config, key, value)
            setattr(model.generation_config, key, value)


def write_model_dir(out: str | Path, cfg: RunConfig, model, tokenizer, *, eval_loss: float, step: int,
                    source: str, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, license: str = "other") -> Path:
    """``save_pretrained`` the model and tokenizer into ``out`` and write its README."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: give a directory")
    _set_special_ids(model, tokenizer)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(model_card(cfg, eval_loss=eval_loss, step=step, source=source, path=out,
                                              license=license))
    for f in out.rglob("*"):  # safetensors writes through a private temp file (0600): a model is for sharing
        if f.is_file():
            f.chmod(0o644)
    return out


#: the model card's ``license`` until the user sets one (``export --license``): the Hub's "other"
DEFAULT_LICENSE = "other"


def model_card(cfg: RunConfig, *, eval_loss: float, step: int, source: str, path: str | Path = ".",
               license: str = DEFAULT_LICENSE) -> str:
    """The model's README, a Hugging Face Hub model card: front matter (library_name, tags, license,
    base settings), what the model is, how it was trained, its eval loss, how to load it from ``path``."""
    d, t = cfg.diloco, cfg.train
    loss = "not evaluated" if eval_loss is None or math.isnan(eval_loss) else f"{eval_loss:.4f}"
    settings = {"model": cfg.model.name, "seq_len": cfg.model.seq_len, "tokenizer": cfg.data.tokenizer or "byte",
                "dataset": cfg.data.dataset, "mode": d.mode, "codec": d.codec, "fragments": d.num_fragments,
                "inner_steps": d.inner_steps, "overlap_steps": d.overlap_steps, "outer_lr": d.outer_lr,
                "outer_momentum": d.outer_momentum, "inner_lr": t.lr, "batch_size": t.batch_size,
                "steps": t.steps, "seed": t.seed}
    rows = "\n".join(f"| {k} | {v} |" for k, v in settings.items())
    where = json.dumps(str(path))
    front = ("---\n"
             "library_name: transformers\n"
             f"license: {license}\n"
             "pipeline_tag: text-generation\n"
             "tags:\n- opendiloco-stream\n- diloco\n- streaming-diloco\n"
             f"- {'data-parallel' if d.mode == 'data-parallel' else d.mode}\n- {d.codec}\n"
             "---\n\n")
    return (front + f"# opendiloco-stream model: theta_bar of run '{cfg.net.run_id}' at inner step {step}\n\n"
            "The outer parameters every peer of an opendiloco-stream run agrees on (Streaming DiLoCo), "
            f"exported from {source}.\n\n"
            f"Eval loss (next-token cross-entropy on the run's validation data): {loss}\n\n"
            f"| setting | value |\n|---|---|\n{rows}\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained({where})\ntokenizer = AutoTokenizer.from_pretrained({where})\n"
            f"```\n\nOr: `opendiloco-stream sample --model {path} --prompt \"def main(\"`\n\n"
            f"Full config:\n\n```json\n{json.dumps(cfg.model_dump(mode='json'), indent=1)}\n```\n")


def eval_loss_of(model, cfg: RunConfig) -> float:
    """The model's loss on the run's validation data (as the training loop evaluates it)."""
    _, val, _ = load_run_data(cfg)
    return evaluate(model, val, cfg.train.batch_size, cfg.data.max_val_batches, "cpu")


def read_checkpoint(path: Path, config: Optional[RunConfig]) -> tuple[dict[str, Any], RunConfig]:
    """The checkpoint's state and the run's config (recorded in it, or ``config`` for older files)."""
    if not path.is_file():
        raise ExportError(f"no checkpoint {path}: give the --checkpoint-dir of a run (and its --rank)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if config is None:
        if state.get("config") is None:
            raise ExportError(f"{path} does not record its run's config (written before export existed): "
                              "pass --config with the run's settings")
        try:
            config = RunConfig.model_validate(state["config"])
        except ValueError as e:
            raise ExportError(f"{path}: its recorded config no longer validates ({str(e).splitlines()[0]}): "
                              "pass --config with the run's settings") from None
    return state, config


def find_checkpoint(checkpoint_dir: str | Path, rank: Optional[int] = None) -> Path:
    """``worker-<rank>.pt`` in ``checkpoint_dir``; without ``rank``: worker-0.pt, else the only one there
    (a peer's file is named after its data shard)."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ExportError(f"no checkpoint directory {directory}: give the --checkpoint-dir of a run")
    if rank is not None:
        return checkpoint_path(str(directory), rank)
    files = sorted(p for p in directory.glob("worker-*.pt") if p.stem.split("-", 1)[1].isdigit())
    if not files:
        raise ExportError(f"no worker-<rank>.pt checkpoint in {directory}: train with --checkpoint-dir {directory}")
    first = checkpoint_path(str(directory), 0)
    if first in files or len(files) == 1:
        return first if first in files else files[0]
    raise ExportError(f"{directory} holds {len(files)} checkpoints and no worker-0.pt: choose one with --rank "
                      f"({', '.join(p.stem.split('-', 1)[1] for p in files)})")


def checkpoint_model(path: Path, config: Optional[RunConfig] = None):
    """(model holding theta_bar, transformers tokenizer, run config, step) of the checkpoint ``path``."""
    state, cfg = read_checkpoint(path, config)
    tokenizer = hf_tokenizer(cfg)
    model = run_model(cfg, len(tokenizer), state["diloco"], state.get("model"))
    return model, tokenizer, cfg, int(state["step"])


def export_checkpoint(checkpoint_dir: str | Path, out: str | Path, *, rank: Optional[int] = None,
                      config: Optional[RunConfig] = None, evaluate_loss: bool = True,
                      max_shard_size: str = DEFAULT_MAX_SHARD_SIZE, license: str = "other") -> Path:
    """theta_bar of a checkpoint in ``checkpoint_dir`` (:func:`find_checkpoint`) as a transformers
    model directory ``out``."""
    path = find_checkpoint(checkpoint_dir, rank)
    model, tokenizer, cfg, step = checkpoint_model(path, config)
    loss = eval_loss_of(model, cfg) if evaluate_loss else float("nan")
    return write_model_dir(out, cfg, model, tokenizer, eval_loss=loss, step=step, source=f"checkpoint {path}",
                           max_shard_size=max_shard_size, license=license)


def save_model_at_end(cfg: RunConfig, diloco, model: torch.nn.Module, vocab_size: int, report) -> Path:
    """``train.save_model``: theta_bar of a finished run (after ``diloco.finish()``) as a transformers
    model directory. Reads the wrapper's ``state_dict()`` (a copy of the outer state) like a checkpoint
    does, so sharded peers export the same way; ``model`` is read only in mode data-parallel. The
    README's eval loss is the ``report``'s of theta_bar (of the model itself in data-parallel)."""
    eval_loss = report.eval_loss if math.isnan(report.eval_loss_global) else report.eval_loss_global
    state = diloco.state_dict()
    model_state = model.state_dict() if "fragments" not in state else None
    export = run_model(cfg, vocab_size, state, model_state)
    tokenizer = hf_tokenizer(cfg)
    return write_model_dir(cfg.train.save_model, cfg, export, tokenizer, eval_loss=eval_loss,
                           step=int(state["step"]), source="the end of training")
