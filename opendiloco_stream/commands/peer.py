"""``opendiloco-stream peer``: join a run's DHT and train, syncing fragments over hivemind.

    opendiloco-stream peer --initial-peers /ip4/.../tcp/.../p2p/Qm... --run-id my-run \\
        --config peers/eager-fp4.toml [--port 31337 --public-ip 203.0.113.7]

A peer that finds others already training downloads their state (outer parameters, outer
optimizer, schedule position, eager state) and joins at the swarm's step. Ctrl+C / SIGTERM stop it
at the next inner step; a second signal stops it at once. Metrics go to ``--metrics-file`` and, for
``monitor``, to the DHT.

With a run key (``--run-key-file F`` or ``ODS_NET__RUN_KEY``), only peers holding the same key join
its groups, write its DHT records and download its state (docs/security.md). Before its first round
a peer checks that the run uses its key and its fingerprint (mode, codec, H, P, model shapes), and
is refused in one line (exit code 2) naming what differs.

``--nproc-per-node K`` trains the peer on K local ranks (DDP; on CUDA one GPU each): the command
starts them itself (``commands/peer_ranks.py``); rank 0 joins the DHT and runs the transport and the
outer steps, every rank reads its share of the peer's data shard (docs/multi-gpu.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import torch

from opendiloco_stream.commands._common import (  # noqa: F401 (parse_shard: re-exported)
    SHARDS_AUTO, add_training_flags, config_from_args, parse_shard, require_device,
)
from opendiloco_stream.net.flags import add_network_flags, net_overrides

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peer", help="join a run and train", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_flags(p, config=False, every_field=True)  # --initial-peers ... --link-mbit, --metrics-port
    p.add_argument("--no-join", action="store_true", help="do not download state from running peers")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration (with where each value came from), check it, start nothing")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-level", default="WARNING", help="python logging level (default WARNING)")
    add_training_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from opendiloco_stream.cli import UsageError
    from opendiloco_stream.net.auth import RunAuth
    from opendiloco_stream.net.flags import quiet_hivemind
    from opendiloco_stream.net.lifecycle import die_with_parent

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_hivemind(args.verbose)
    die_with_parent()  # a SIGKILLed peer must not orphan its DHT / averager processes and p2pd
    if args.dry_run:
        from opendiloco_stream.commands.dry_run import dry_run

        cfg, sources = config_from_args(args, updates=net_overrides(args), return_sources=True)
        return dry_run(cfg, sources, command="peer", config_path=args.config, workers=None)
    cfg = config_from_args(args, updates=net_overrides(args))
    if not cfg.net.initial_peers:
        raise UsageError("no --initial-peers: start `opendiloco-stream bootstrap` and pass the line it prints")
    auth = RunAuth.from_config(cfg.net)  # a missing or short key file fails here, before anything starts
    require_device(cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    from opendiloco_stream.commands import peer_ranks

    ranks = peer_ranks.ranks_for(args, cfg)  # None: one process; K > 1 and no rank yet: launched them
    if isinstance(ranks, int):
        return ranks
    if ranks is not None and not ranks.leader:
        peer_ranks.end_rank(peer_ranks.follow(cfg, ranks))
    try:
        code = _lead(args, cfg, auth, ranks)
    except RuntimeError as e:
        if ranks is None or not peer_ranks.lost_rank(e):
            raise
        print(f"opendiloco-stream peer: another rank of this peer stopped ({peer_ranks.first_line(e)}); "
              "leaving the run", file=sys.stderr)
        code = 1
    finally:
        if ranks is not None:
            ranks.close()
    if ranks is not None:
        peer_ranks.end_rank(code)
    return code


def _lead(args: argparse.Namespace, cfg, auth, ranks) -> int:
    """The peer itself (rank 0 of a multi-rank peer): DHT, transport, metrics, training."""
    from tqdm import tqdm

    from opendiloco_stream.commands._common import prepare_data, print_summary
    from opendiloco_stream.net.auth import Admission
    from opendiloco_stream.net.dht import start_dht, stop_dht, visible_maddrs
    from opendiloco_stream.net.join import RunGate, fingerprint_digest, fingerprint_fields
    from opendiloco_stream.net.lifecycle import GracefulShutdown
    from opendiloco_stream.net.metrics import MetricsPublisher, live_values
    from opendiloco_stream.net.prometheus import PrometheusExporter
    from opendiloco_stream.train.loggers import Fanout, build_loggers
    from opendiloco_stream.train.ranks import data_shard
    from opendiloco_stream.stats import SyncStats
    from opendiloco_stream.train.loop import MetricsWriter, summarize, train_worker
    from opendiloco_stream.transport.factory import codec_from_config, hivemind_transport
    from opendiloco_stream.cli import UsageError

    train_source, val, vocab_size = prepare_data(cfg)
    sinks = build_loggers(cfg)
    exporter = None
    if cfg.net.metrics_port is not None:
        try:
            exporter = PrometheusExporter(cfg.net.metrics_port, labels={"run": cfg.net.run_id},
                                          info={"mode": cfg.diloco.mode, "codec": cfg.diloco.codec,
                                                "fragments": cfg.diloco.num_fragments,
                                                "inner_steps": cfg.diloco.inner_steps, "model": cfg.model.name})
        except OSError as e:
            raise UsageError(f"--metrics-port {cfg.net.metrics_port}: cannot listen ({e.strerror}); "
                             "pick another port or 0 for any free one") from None
        sinks.append(exporter)

    with GracefulShutdown() as stop:
        dht = start_dht(cfg.net)
        transport = gate = None
        try:
            gate = RunGate(dht, cfg.net.run_id, auth)
            gate.check_key()  # a peer with another key (or none) stops here, having stored nothing
            peer_id = str(dht.peer_id)
            rank, world = parse_shard(cfg.data.shard, peer_id)
            data_rank, data_world = rank, world
            if ranks is not None:  # the peer's shard, split between its ranks
                ranks.share((rank, world))
                data_rank, data_world = data_shard((rank, world), 0, ranks.world)
            if exporter is not None:
                exporter.metrics.relabel(peer=peer_id)
                print(f"prometheus metrics on {exporter.url}", file=sys.stderr, flush=True)
            on_ranks = f", {ranks.world} ranks" if ranks is not None else ""
            print(f"peer {peer_id} joined run '{cfg.net.run_id}' (shard {rank}/{world}{on_ranks}); "
                  f"listening on {' '.join(visible_maddrs(dht)) or '(client mode)'}", file=sys.stderr, flush=True)
            admission = Admission(auth)
            transport = hivemind_transport(cfg, dht, admission)

            def before_join(model: torch.nn.Module) -> None:
                fields = fingerprint_fields(cfg, model)
                gate.check_fingerprint(fields)
                admission.fingerprint = fingerprint_digest(fields)  # groupmates compare it every round
            publisher = MetricsPublisher(dht, cfg.net.run_id, expiration=cfg.net.metrics_expiration,
                                         name=peer_id[-8:])
            writer = MetricsWriter(cfg.train.metrics_file)
            writer.write({"event": "config", "peer_id": peer_id, "shard": [rank, world], "transport": "hivemind",
                          "ranks": ranks.world if ranks is not None else 1, **cfg.model_dump(mode="json")})
            live: dict[str, Any] = {"step": 0, "loss": float("nan"), "tokens": 0, "t0": time.perf_counter(),
                                    "compute_s": 0.0, "stats": SyncStats(), "last_pub": 0.0}

            def snapshot() -> dict[str, Any]:
                elapsed = max(1e-9, time.perf_counter() - live["t0"])
                return live_values(live["stats"], step=live["step"], loss=live["loss"],
                                   tokens_per_s=live["tokens"] / elapsed, mode=cfg.diloco.mode,
                                   compute_utilization=min(1.0, live["compute_s"] / elapsed))

            fanout = Fanout(writer.write, sinks)

            def emit(rec: dict[str, Any]) -> None:
                fanout(rec)
                if rec.get("event") == "step":
                    live["tokens"] += rec["tokens"]
                    live["compute_s"] += rec["compute_s"]
                elif rec.get("event") == "joined":
                    live["step"] = rec["step"]
                elif rec.get("event") == "state_download" and not args.no_progress:  # a big state takes a while
                    mib = 1 << 20
                    print(f"state download from {rec['donor'][-8:]}: {rec['bytes'] / mib:.0f}/"
                          f"{rec['total_bytes'] / mib:.0f} MiB, {rec['mib_per_s']:.1f} MiB/s"
                          + (f" ({rec['reused_bytes'] / mib:.0f} MiB reused from a donor that failed)"
                             if rec["reused_bytes"] else "") + (" - done" if rec["done"] else ""),
                          file=sys.stderr, flush=True)

            bar = tqdm(total=cfg.train.steps, desc=f"peer {peer_id[-6:]}", unit="step", disable=args.no_progress,
                       file=sys.stderr, dynamic_ncols=True)

            def on_step(_rank: int, loss: float, stats: SyncStats) -> None:
                live["step"] += 1
                live["loss"] = loss
                live["stats"] = stats  # the trainer's own counters: what the summary will say
                bar.update(1)
                now = time.perf_counter()
                if now - live["last_pub"] >= 2.0:
                    live["last_pub"] = now
                    publisher.publish(snapshot())
                    bar.set_postfix(loss=f"{loss:.3f}")

            start = time.perf_counter()
            report = train_worker(data_rank, data_world, cfg, transport, train_source, val, vocab_size, emit,
                                  on_step=on_step, should_stop=lambda: stop.requested,
                                  join_running=not args.no_join, before_join=before_join, ranks=ranks)
            bar.close()
            wall = time.perf_counter() - start
            summary = summarize(cfg, [report], wall, codec_from_config(cfg).encoded_size)
            live["stats"] = report.stats
            summary.update(peer_id=peer_id, stopped_early=stop.requested)
            publisher.publish({**snapshot(), "compute_utilization": summary["compute_utilization"],
                               "tokens_per_s": summary["tokens_per_s"]})
            publisher.close(timeout=5.0)  # the final record reaches the DHT before it stops
            fanout(summary)
            writer.close()
            print_summary(summary)
        finally:
            for sink in sinks:
                sink.close()
            if transport is not None:
                transport.close()
            if gate is not None:
                gate.close()
            stop_dht(dht)
    return 0  # a signal-requested stop at a safe point is a clean exit
