"""Flags shared by the training commands (``local``, ``peer``) and their mapping onto RunConfig.

Every flag defaults to ``None`` so that only flags given on the command line override the TOML file
(``--config``) and the environment (``ODS_SECTION__FIELD``).
"""

from __future__ import annotations

import argparse
from typing import Any

from opendiloco_stream.config import CODECS, MODES, RunConfig, load_config

# flag dest -> (section, field)
TRAINING_FLAGS: dict[str, tuple[str, str]] = {
    "mode": ("diloco", "mode"),
    "fragments": ("diloco", "num_fragments"),
    "fragment_pattern": ("diloco", "fragment_pattern"),
    "inner_steps": ("diloco", "inner_steps"),
    "overlap_steps": ("diloco", "overlap_steps"),
    "alpha": ("diloco", "alpha"),
    "outer_lr": ("diloco", "outer_lr"),
    "outer_momentum": ("diloco", "outer_momentum"),
    "codec": ("diloco", "codec"),
    "block_size": ("diloco", "codec_block_size"),
    "scale_dtype": ("diloco", "codec_scale_dtype"),
    "stochastic_rounding": ("diloco", "stochastic_rounding"),
    "error_feedback": ("diloco", "error_feedback"),
    "weighting": ("diloco", "weighting"),
    "sync_timeout": ("diloco", "sync_timeout"),
    "model": ("model", "name"),
    "seq_len": ("model", "seq_len"),
    "dataset": ("data", "dataset"),
    "dataset_config": ("data", "dataset_config"),
    "text_field": ("data", "text_field"),
    "tokenizer": ("data", "tokenizer"),
    "steps": ("train", "steps"),
    "batch_size": ("train", "batch_size"),
    "lr": ("train", "lr"),
    "warmup_steps": ("train", "warmup_steps"),
    "eval_every": ("train", "eval_every"),
    "seed": ("train", "seed"),
    "device": ("train", "device"),
    "metrics_file": ("train", "metrics_file"),
    "checkpoint_dir": ("train", "checkpoint_dir"),
    "checkpoint_every": ("train", "checkpoint_every"),
    "resume": ("train", "resume"),
}


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Add the algorithm / model / data / training flags (all optional overrides)."""
    p.add_argument("--config", metavar="TOML", help="a peer config file (see peers/*.toml)")
    g = p.add_argument_group("algorithm")
    g.add_argument("--mode", choices=MODES, help="eager (default), overlap, blocking, naive-delayed, data-parallel")
    g.add_argument("--fragments", "--num-fragments", dest="fragments", type=int, metavar="P", help="fragments (1 = DiLoCo)")
    g.add_argument("--fragment-pattern", choices=("strided", "sequential"))
    g.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per outer round")
    g.add_argument("--overlap-steps", "--tau", dest="overlap_steps", type=int, metavar="TAU",
                   help="inner steps of overlap (mode overlap)")
    g.add_argument("--alpha", type=float, help="overlap merge weight of the local parameters")
    g.add_argument("--outer-lr", type=float)
    g.add_argument("--outer-momentum", type=float)
    g.add_argument("--codec", choices=CODECS, help="wire format of outer gradients")
    g.add_argument("--block-size", type=int, help="codec block size (low-bit codecs)")
    g.add_argument("--scale-dtype", choices=("fp16", "fp32"))
    g.add_argument("--stochastic-rounding", action="store_true", default=None)
    g.add_argument("--error-feedback", action="store_true", default=None)
    g.add_argument("--weighting", choices=("tokens", "equal"))
    g.add_argument("--sync-timeout", type=float, metavar="S")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="preset (tiny, 35M, 100M, ...) or a local HF model/config path")
    g.add_argument("--seq-len", type=int)
    g.add_argument("--dataset", help="'builtin', a local file/dir (.txt/.jsonl/.parquet) or a hub dataset name")
    g.add_argument("--dataset-config")
    g.add_argument("--text-field")
    g.add_argument("--tokenizer", help="a local HF tokenizer directory (default: bytes)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, metavar="S", help="inner steps per worker")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float, help="inner AdamW learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--eval-every", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--metrics-file", metavar="F", help="JSON-lines metrics output")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save atomic checkpoints here")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="every N inner steps (0: at the end only)")
    g.add_argument("--resume", action="store_true", default=None, help="continue from --checkpoint-dir")


def overrides_from_args(args: argparse.Namespace, extra: dict[str, tuple[str, str]] | None = None) -> dict[str, Any]:
    """The nested override dict of the flags that were given."""
    out: dict[str, Any] = {}
    for dest, (section, key) in {**TRAINING_FLAGS, **(extra or {})}.items():
        value = getattr(args, dest, None)
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out


def config_from_args(args: argparse.Namespace, extra: dict[str, tuple[str, str]] | None = None) -> RunConfig:
    return load_config(getattr(args, "config", None), overrides_from_args(args, extra))
