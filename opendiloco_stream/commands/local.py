"""``opendiloco-stream local``: N workers on this machine, the embedded default.

``--transport local`` (default) runs the N workers as threads over an in-process LocalSwarm
(deterministic, real wire encoding and byte counts); ``--transport hivemind`` starts a bootstrap
node and N real ``peer`` processes on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import torch

from opendiloco_stream.commands._common import add_training_flags, config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="train N workers on this machine (built-in corpus, tiny model by default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, metavar="N", help="number of workers (default 4)")
    p.add_argument("--transport", choices=("local", "hivemind"), default="local",
                   help="local: threads in this process; hivemind: N real peers on 127.0.0.1")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: cores / workers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_training_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from opendiloco_stream.cli import UsageError

    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    cfg = config_from_args(args)
    if args.transport == "hivemind":
        from opendiloco_stream.commands.local_hivemind import run_hivemind

        return run_hivemind(args, cfg)
    return run_threads(args, cfg)


def prepare_data(cfg):
    """(train source, validation tensor, vocab size) for a config; DataError -> UsageError."""
    from opendiloco_stream.cli import UsageError
    from opendiloco_stream.train import data as data_mod

    try:
        tokenizer = data_mod.load_tokenizer(cfg.data.tokenizer)
        train_source, val = data_mod.build_datasets(
            cfg.data.dataset, tokenizer=tokenizer, seq_len=cfg.model.seq_len, val_fraction=cfg.data.val_fraction,
            dataset_config=cfg.data.dataset_config, text_field=cfg.data.text_field, seed=cfg.train.seed,
            streaming=cfg.data.streaming)
    except data_mod.DataError as e:
        raise UsageError(str(e)) from None
    return train_source, val, tokenizer.vocab_size


def run_threads(args: argparse.Namespace, cfg) -> int:
    from tqdm import tqdm

    from opendiloco_stream.compression import get_codec
    from opendiloco_stream.train.loggers import Fanout, build_loggers
    from opendiloco_stream.train.loop import MetricsWriter, summarize, train_worker
    from opendiloco_stream.transport.local import LocalSwarm

    M = args.workers
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // M))
    train_source, val, vocab_size = prepare_data(cfg)
    d = cfg.diloco
    swarm = LocalSwarm(num_workers=M, codec=d.codec, block_size=d.codec_block_size, scale_dtype=d.codec_scale_dtype,
                       stochastic=d.stochastic_rounding, seed=cfg.train.seed, timeout=d.sync_timeout)
    writer = MetricsWriter(cfg.train.metrics_file)
    emit = Fanout(writer.write, build_loggers(cfg))  # + TensorBoard / W&B when configured
    writer.write({"event": "config", "workers": M, "transport": "local", **cfg.model_dump(mode="json")})
    bar = tqdm(total=M * cfg.train.steps, desc=f"{d.mode} x{M}", unit="step", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    lock, last_loss = threading.Lock(), {}

    def on_step(rank: int, loss: float) -> None:
        with lock:
            last_loss[rank] = loss
            bar.update(1)
            if bar.n % 10 == 0:
                bar.set_postfix(loss=f"{sum(last_loss.values()) / len(last_loss):.3f}")

    start = time.perf_counter()
    try:
        reports = swarm.run(lambda rank: train_worker(rank, M, cfg, swarm.transport(rank), train_source, val,
                                                      vocab_size, emit, on_step=on_step))
    finally:
        bar.close()
        emit.close()
    wall = time.perf_counter() - start
    codec = get_codec(d.codec, block_size=d.codec_block_size, scale_dtype=d.codec_scale_dtype)
    summary = summarize(cfg, reports, wall, codec.encoded_size)
    writer.write(summary)
    writer.close()
    print_summary(summary)
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def print_summary(s: dict[str, Any]) -> None:
    """A short human table of the summary record."""
    rows = [
        ("mode", f"{s['mode']} (P={s['fragments']}, H={s['inner_steps']}, tau={s['overlap_steps']}, codec {s['codec']})"),
        ("workers x steps", f"{s['workers']} x {s['steps']}  ({s['tokens']:,} tokens)"),
        ("eval loss", f"{s['eval_loss_initial']:.4f} -> {s['eval_loss']:.4f}"
                      + (f"  (before the in-flight rounds landed: {s['eval_loss_before_finish']:.4f})"
                         if s.get("eval_loss_before_finish") == s.get("eval_loss_before_finish") else "")),
        ("train loss (last 20 steps)", f"{s['train_loss']:.4f}"),
        ("bytes sent per worker", _fmt_bytes(s["bytes_sent_per_worker"])),
        ("peak bytes per sync", f"{_fmt_bytes(s['peak_bytes_per_sync'])}  (whole outer gradient: "
                                f"{_fmt_bytes(s['model_outer_gradient_bytes'])})"),
        ("syncs / failed / local-only", f"{s['syncs']} / {s['failed_syncs']} / {s['local_only_steps']}"),
        ("compute utilization", f"{100 * s['compute_utilization']:.1f}%"),
        ("wall time", f"{s['wall_time_s']:.1f} s  ({s['tokens_per_s']:,.0f} tokens/s)"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
