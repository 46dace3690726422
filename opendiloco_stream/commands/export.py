"""``opendiloco-stream export``: a run's model, theta_bar, as a ``transformers`` model directory.

Reads a checkpoint (``worker-<rank>.pt`` in ``--checkpoint-dir``: any mode, a sharded peer's rank-0
file, a late joiner's) and writes ``config.json``, ``model.safetensors`` (sharded above
``--max-shard-size``), the tokenizer and a README with the run's settings and eval loss::

    opendiloco-stream export --checkpoint-dir runs/local --out runs/local-model
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('runs/local-model')"

``peer`` and ``local`` write the same directory at the end of training with ``--save-model DIR``.
"""

from __future__ import annotations

import argparse

from opendiloco_stream.config import load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's model (theta_bar) as a transformers model directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="the run's train.checkpoint_dir")
    p.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    p.add_argument("--rank", type=int, default=None, metavar="N",
                   help="export worker-N.pt (default: worker-0.pt, or the only checkpoint in the directory)")
    p.add_argument("--config", metavar="TOML", default=None,
                   help="the run's config, for checkpoints that do not record it (written before export existed)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split model.safetensors into files of at most this size (default 2GB)")
    p.add_argument("--license", default="other", metavar="ID",
                   help="the model card's license: a Hub license id (apache-2.0, mit, ...) that fits your data "
                   "and model (default: other)")
    p.add_argument("--no-eval", action="store_true",
                   help="do not evaluate the model on the run's validation data for the README")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from opendiloco_stream.train.export import (  # lazy: loads torch; --help stays light
        DEFAULT_MAX_SHARD_SIZE, export_checkpoint)

    config = load_config(args.config) if args.config else None
    out = export_checkpoint(args.checkpoint_dir, args.out, rank=args.rank, config=config,
                            evaluate_loss=not args.no_eval, max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
                            license=args.license)
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained('{out}'))")
    return 0
