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
from typing import Optional

from tqdm import tqdm

from opendiloco_stream.commands._common import (  # noqa: F401 (prepare_data, print_summary: re-exported)
    add_training_flags, config_from_args, prepare_data, print_device, print_summary, require_device,
    resolve_for_dry_run, resolve_fragments,
    worker_config,
)
from opendiloco_stream.commands.dry_run import dry_run
from opendiloco_stream.commands.local_hivemind import run_hivemind
from opendiloco_stream.config_cli import UsageError, deprecated_alias
from opendiloco_stream.net.flags import add_log_level
from opendiloco_stream.train.loggers import Fanout, build_loggers


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="train N workers on this machine (built-in corpus, tiny model by default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, metavar="N", help="number of workers (default 4)")
    p.add_argument("--transport", choices=("local", "hivemind"), default="local",
                   help="local: threads in this process; hivemind: N real peers on 127.0.0.1")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: cores / workers)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration (with where each value came from), check it, start nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    add_log_level(p, help="--transport hivemind: each peer's logging level, in its log (default WARNING)",
                  old_verbose=False)
    link = p.add_argument_group("simulated link (--transport local)", "when each round lands, in inner steps "
                                "after its launch: the same bits every run (default: at once, an instant link)")
    link.add_argument("--link-delay-steps", type=int, default=None, metavar="D",
                      help="every round lands D >= 1 inner steps after its launch (D > H: at the next sync)")
    link.add_argument("--link-mbit", dest="link_mbps", type=float, default=None, metavar="MBIT",
                      help="or from the round's bytes: its transfer time at this rate (Mbit/s), in steps of "
                      "--link-step-s")
    link.add_argument("--link-step-s", type=float, default=None, metavar="S",
                      help="with --link-mbit: the inner step time the transfer is counted in (seconds)")
    deprecated_alias(link, "--link-mbps", "--link-mbit")
    add_training_flags(p, exclude=("data.shard",))  # workers take shards r/N
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    link = link_model(args)
    if args.dry_run:
        cfg, sources = config_from_args(args, return_sources=True)
        return dry_run(*resolve_for_dry_run(cfg, sources), command="local", config_path=args.config, workers=args.workers)
    cfg = resolve_fragments(config_from_args(args))
    if cfg.train.nproc_per_node > 1 and args.transport != "hivemind":
        raise UsageError("--nproc-per-node needs --transport hivemind: the local transport runs the workers as "
                         "threads of one process (each hivemind peer starts its own ranks)")
    setting, cfg = cfg.train.device, require_device(cfg)  # 'auto' -> the first CUDA device, else the CPU
    if args.transport == "hivemind":
        if link is not None:
            raise UsageError("--link-delay-steps / --link-mbit simulate a link for --transport local; over "
                             "hivemind the link is real (shape it with tc, benchmarks/wan.py)")
        print_device(setting, cfg)
        return run_hivemind(args, cfg)
    return run_threads(args, cfg, link, setting)


def link_model(args: argparse.Namespace):
    """The simulated link of ``--link-*``, or None (an instant link)."""
    from opendiloco_stream.transport.local import LinkModel  # lazy: loads torch; --help stays light

    if args.link_delay_steps is None and args.link_mbps is None and args.link_step_s is None:
        return None
    try:
        return LinkModel(args.link_delay_steps, args.link_mbps, args.link_step_s)
    except ValueError as e:
        raise UsageError(f"{e} (--link-delay-steps, or --link-mbit with --link-step-s)") from None


def run_threads(args: argparse.Namespace, cfg, link=None, setting: Optional[str] = None) -> int:
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.train.loop import (  # lazy: loads torch; --help stays light
        MetricsWriter, summarize, train_worker)
    from opendiloco_stream.transport.factory import (  # lazy: transport/ loads torch; --help stays light
        codec_from_config, local_swarm)

    M = args.workers
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // M))
    train_source, val, vocab_size = prepare_data(cfg)
    print_device(cfg.train.device if setting is None else setting, cfg)  # once the data opened: a bad input is one line
    d = cfg.diloco
    swarm = local_swarm(cfg, M, link)
    writer = MetricsWriter(cfg.train.metrics_file)
    emit = Fanout(writer.write, build_loggers(cfg))  # + TensorBoard / W&B when configured
    writer.write({"event": "config", "workers": M, "transport": "local", **cfg.model_dump(mode="json")})
    bar = tqdm(total=M * cfg.train.steps, desc=f"{d.mode} x{M}", unit="step", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    lock, last_loss = threading.Lock(), {}

    def on_step(rank: int, loss: float, _stats) -> None:
        with lock:
            last_loss[rank] = loss
            bar.update(1)
            if bar.n % 10 == 0:
                bar.set_postfix(loss=f"{sum(last_loss.values()) / len(last_loss):.3f}")

    start = time.perf_counter()
    try:
        reports = swarm.run(lambda rank: train_worker(rank, M, worker_config(cfg, rank), swarm.transport(rank),
                                                      train_source, val, vocab_size, emit, on_step=on_step))
    finally:
        bar.close()
        emit.close()
    wall = time.perf_counter() - start
    summary = summarize(cfg, reports, wall, codec_from_config(cfg).encoded_size)
    writer.write(summary)
    writer.close()
    print_summary(summary)
    return 0

