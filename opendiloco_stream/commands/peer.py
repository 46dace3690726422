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
import ipaddress
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from tqdm import tqdm

from opendiloco_stream.commands import peer_ranks
from opendiloco_stream.commands._common import (  # noqa: F401 (parse_shard: re-exported)
    SHARDS_AUTO, add_training_flags, config_from_args, parse_shard, prepare_data, print_device, print_summary,
    require_device, resolve_for_dry_run, resolve_fragments,
)
from opendiloco_stream.commands.dry_run import dry_run
from opendiloco_stream.config import PREMATCH_AUTO_MIN_RTT_MS, PREMATCH_AUTO_RTTS
from opendiloco_stream.config_cli import UsageError
from opendiloco_stream.net.flags import add_network_flags, net_overrides, verbose
from opendiloco_stream.net.lifecycle import GracefulShutdown, die_with_parent
from opendiloco_stream.net.prometheus import PrometheusExporter
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.testing import faults
from opendiloco_stream.train.loggers import Fanout, build_loggers

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peer", help="join a run and train", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_flags(p, config=False, every_field=True)  # --initial-peers ... --link-mbit, --metrics-port
    p.add_argument("--no-join", action="store_true", help="do not download state from running peers")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved configuration (with where each value came from), check it, start nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    add_training_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.net.auth import RunAuth  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.net.dht import quiet_hivemind  # lazy: loads hivemind; --help stays light

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_hivemind(verbose(args))
    die_with_parent()  # a SIGKILLed peer must not orphan its DHT / averager processes and p2pd
    if args.dry_run:
        cfg, sources = config_from_args(args, updates=net_overrides(args), return_sources=True)
        return dry_run(*resolve_for_dry_run(cfg, sources), command="peer", config_path=args.config, workers=None)
    cfg = resolve_fragments(config_from_args(args, updates=net_overrides(args)))
    if not cfg.net.initial_peers:
        raise UsageError("no --initial-peers: start `opendiloco-stream bootstrap` and pass the line it prints")
    from opendiloco_stream.net.dht import EXAMPLE_PEER, parse_maddr  # lazy: loads hivemind; --help stays light

    for maddr in cfg.net.initial_peers:  # a malformed address fails here, before the start-up lines
        parse_maddr(maddr, what="initial peer", example=EXAMPLE_PEER, need_peer_id=True)
    auth = RunAuth.from_config(cfg.net)  # a missing or short key file fails here, before anything starts
    setting, cfg = cfg.train.device, require_device(cfg)  # 'auto' -> the first CUDA device, else the CPU
    if args.threads:
        torch.set_num_threads(args.threads)

    ranks = peer_ranks.ranks_for(args, cfg)  # None: one process; K > 1 and no rank yet: launched them
    if isinstance(ranks, int):
        return ranks
    if ranks is not None and not ranks.leader:
        peer_ranks.end_rank(peer_ranks.follow(cfg, ranks))
    try:
        code = _lead(args, cfg, auth, ranks, setting)
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


class LiveMetrics:
    """A peer's running figures while it trains, and where they go: every record to the metrics
    file and loggers, a snapshot to the DHT for ``monitor`` every ``publish_every_s``, progress to
    the terminal. ``emit`` and ``on_step`` are what ``train_worker`` calls."""

    def __init__(self, mode: str, publisher: Any, fanout: Callable[[dict], None], bar: Any, *,
                 quiet: bool, publish_every_s: float = 2.0):
        self.mode, self.publisher, self.fanout, self.bar = mode, publisher, fanout, bar
        self.quiet, self.publish_every_s = quiet, publish_every_s
        self.step, self.loss, self.tokens, self.compute_s = 0, float("nan"), 0, 0.0
        self.stats = SyncStats()
        self.t0, self.last_pub = time.perf_counter(), 0.0

    def snapshot(self) -> dict[str, Any]:
        from opendiloco_stream.net.metrics import live_values  # lazy: loads hivemind; --help stays light

        elapsed = max(1e-9, time.perf_counter() - self.t0)
        return live_values(self.stats, step=self.step, loss=self.loss, tokens_per_s=self.tokens / elapsed,
                           mode=self.mode, compute_utilization=min(1.0, self.compute_s / elapsed))

    def emit(self, rec: dict[str, Any]) -> None:
        self.fanout(rec)
        event = rec.get("event")
        if event == "step":
            self.tokens += rec["tokens"]
            self.compute_s += rec["compute_s"]
        elif event == "joined":
            self.step = rec["step"]
        elif event == "prematch":  # --prematch-steps auto started (or stopped) forming groups ahead
            print(f"peer: groups formed ahead: {rec['why']}", file=sys.stderr, flush=True)
        elif event == "state_download" and not self.quiet:  # a big state takes a while
            mib = 1 << 20
            print(f"state download from {rec['donor'][-8:]}: {rec['bytes'] / mib:.0f}/"
                  f"{rec['total_bytes'] / mib:.0f} MiB, {rec['mib_per_s']:.1f} MiB/s"
                  + (f" ({rec['reused_bytes'] / mib:.0f} MiB reused from a donor that failed)"
                     if rec["reused_bytes"] else "") + (" - done" if rec["done"] else ""),
                  file=sys.stderr, flush=True)

    def on_step(self, _rank: int, loss: float, stats: Any) -> None:
        self.step += 1
        self.loss = loss
        self.stats = stats  # the trainer's own counters: what the summary will say
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last_pub >= self.publish_every_s:
            self.last_pub = now
            self.publisher.publish(self.snapshot())
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def final(self, summary: dict[str, Any], stats: Any) -> None:
        """Publish the run's last figures (waiting until they reach the DHT), then log the summary."""
        self.bar.close()
        self.stats = stats
        self.publisher.publish({**self.snapshot(), "compute_utilization": summary["compute_utilization"],
                                "tokens_per_s": summary["tokens_per_s"]})
        self.publisher.close(timeout=5.0)  # the final record reaches the DHT before it stops
        self.fanout(summary)


def _exporter(cfg) -> Any:
    """The Prometheus endpoint, if ``net.metrics_port`` asks for one (a taken port: a one-line error)."""
    if cfg.net.metrics_port is None:
        return None
    try:
        return PrometheusExporter(cfg.net.metrics_port, labels={"run": cfg.net.run_id},
                                  info={"mode": cfg.diloco.mode, "codec": cfg.diloco.codec,
                                        "fragments": cfg.diloco.num_fragments,
                                        "inner_steps": cfg.diloco.inner_steps, "model": cfg.model.name})
    except OSError as e:
        raise UsageError(f"--metrics-port {cfg.net.metrics_port}: cannot listen ({e.strerror}); "
                         "pick another port or 0 for any free one") from None


def _lead(args: argparse.Namespace, cfg, auth, ranks, setting: str = "auto") -> int:
    """The peer itself (rank 0 of a multi-rank peer): DHT, transport, metrics, training."""
    from opendiloco_stream.net.auth import Admission  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.net.dht import start_dht, stop_dht  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.train.join import RunGate  # lazy: loads torch; --help stays light
    from opendiloco_stream.transport.factory import (  # lazy: transport/ loads torch; --help stays light
        hivemind_transport)

    train_source, val, vocab_size = prepare_data(cfg)
    loggers = build_loggers(cfg)  # a logger that is not installed fails here, before the DHT starts
    sinks = list(loggers)
    exporter = _exporter(cfg)
    if exporter is not None:
        sinks.append(exporter)
    with GracefulShutdown() as stop:
        dht = start_dht(cfg.net)
        transport = gate = None
        try:
            cfg, dht = _client_if_unreachable(cfg, dht)
            gate = RunGate(dht, cfg.net.run_id, auth)
            gate.check_key()  # a peer with another key (or none) stops here, having stored nothing
            shards = _announce(cfg, dht, ranks, exporter)
            for logger_ in loggers:  # W&B: one run per peer, named after it; TensorBoard: DIR/<peer id>
                logger_.set_peer(str(dht.peer_id))
            print_device(setting, cfg)  # train.device as given (setting) and as resolved
            admission = Admission(auth)
            transport = hivemind_transport(cfg, dht, admission)
            _train(args, cfg, ranks, dht, gate, admission, transport, sinks, stop, shards,
                   (train_source, val, vocab_size))
        finally:
            for sink in sinks:
                sink.close()
            if transport is not None:
                transport.close()
            if gate is not None:
                gate.close()
            stop_dht(dht)
    return 0  # a signal-requested stop at a safe point is a clean exit


def _client_if_unreachable(cfg, dht) -> tuple[Any, Any]:
    """A peer nobody can dial (behind NAT, a firewall) would stall every group that gave it a part
    to reduce: when the bootstrap cannot dial it back, it restarts its DHT node as a client and
    trains as one (it sends and receives; the peers that accept connections reduce its parts)."""
    from opendiloco_stream.net.dht import ip4_of, start_dht, stop_dht  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.net.reachability import reachable  # lazy: loads hivemind; --help stays light

    net = cfg.net
    remote = [m for m in net.initial_peers if not (ip4_of(m) and ipaddress.ip_address(ip4_of(m)).is_loopback)]
    # a local run: everyone can dial everyone; a relayed peer is dialed through the relay, not directly
    if net.client_mode or net.relay or not net.auto_client or not remote:
        return cfg, dht
    ok, detail = reachable(dht, net.initial_peers)
    if ok is not False:
        logger.info("reachability: %s", detail if ok else f"not checked ({detail})")
        return cfg, dht
    print(f"peer: nobody can open a connection to this peer ({detail}): it trains as a client and reduces no "
          f"part; to reduce, open/forward a port (--port P --public-ip IP; `opendiloco-stream doctor` checks); "
          f"--client-mode skips this check; if no peer of the run can accept connections, see --relay", file=sys.stderr, flush=True)
    cfg = cfg.model_copy(update={"net": net.model_copy(update={"client_mode": True})})
    stop_dht(dht)
    return cfg, start_dht(cfg.net)


def _announce(cfg, dht, ranks, exporter) -> tuple[tuple[int, int], tuple[int, int]]:
    """Say who the peer is and where it listens; its data shard and the part of it this rank reads."""
    from opendiloco_stream.net.dht import visible_maddrs  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.train.ranks import data_shard  # lazy: loads torch; --help stays light

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
    return (rank, world), (data_rank, data_world)


def _wait_for_peers(cfg, gate, stop) -> None:
    """``--wait-for-peers N``: say this peer is ready and wait for N ready peers, with progress."""
    faults.delay_start()  # tests only (ODS_TEST_FAULTS=start_delay_s=S): a peer that comes S seconds later
    want, timeout = cfg.net.wait_for_peers, cfg.net.wait_for_peers_timeout

    def progress(ready: int, waited: float) -> None:
        print(f"peer: waiting for peers: {ready}/{want} ready after {waited:.0f} s (--wait-for-peers {want}, "
              f"at most {timeout:.0f} s)", file=sys.stderr, flush=True)

    ready = gate.wait_for_peers(want, timeout, should_stop=lambda: stop.requested, progress=progress)
    if want > 1 and ready >= want:
        print(f"peer: {ready}/{want} peers ready: training", file=sys.stderr, flush=True)
    elif want > 1 and not stop.requested:
        print(f"peer: only {ready}/{want} peers ready after {timeout:.0f} s (--wait-for-peers-timeout): training "
              f"with those, later peers join the running swarm", file=sys.stderr, flush=True)


def _prematch_line(steps: "int | str") -> str:
    """What ``--prematch-steps`` will do, said at start (``"auto"`` decides from the first inner step
    on, from the swarm's RTTs pinged at start, and says what it chose then)."""
    if steps == "auto":
        return (f"auto (from the worst RTT to the swarm's peers: DHT pings from the start, then the rounds' own "
                f"measures; from {PREMATCH_AUTO_MIN_RTT_MS:g} ms on, enough inner steps ahead to cover "
                f"~{PREMATCH_AUTO_RTTS} round trips of matchmaking)")
    return f"{steps} inner steps ahead (--prematch-steps {steps})" if steps else "off (--prematch-steps 0)"


def _train(args: argparse.Namespace, cfg, ranks, dht, gate, admission, transport, sinks: list, stop,
           shards: tuple, data: tuple) -> None:
    """Train the peer with its live metrics, then write and print its summary."""
    from opendiloco_stream.net.metrics import MetricsPublisher  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.train.join import (  # lazy: loads torch; --help stays light
        fingerprint_digest, fingerprint_fields)
    from opendiloco_stream.train.loop import (  # lazy: loads torch; --help stays light
        MetricsWriter, summarize, train_worker)
    from opendiloco_stream.transport.factory import (  # lazy: transport/ loads torch; --help stays light
        codec_from_config)

    train_source, val, vocab_size = data
    (rank, world), (data_rank, data_world) = shards
    peer_id = str(dht.peer_id)

    def before_join(model: torch.nn.Module) -> None:
        fields = fingerprint_fields(cfg, model)
        gate.check_fingerprint(fields)
        admission.fingerprint = fingerprint_digest(fields)  # groupmates compare it every round
        _wait_for_peers(cfg, gate, stop)

    writer = MetricsWriter(cfg.train.metrics_file)
    writer.write({"event": "config", "peer_id": peer_id, "shard": [rank, world], "transport": "hivemind",
                  "ranks": ranks.world if ranks is not None else 1, **cfg.model_dump(mode="json")})
    if cfg.diloco.mode != "data-parallel":
        print(f"peer: groups formed ahead: {_prematch_line(cfg.diloco.prematch_steps)}", file=sys.stderr, flush=True)
    bar = tqdm(total=cfg.train.steps, desc=f"peer {peer_id[-6:]}", unit="step", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    live = LiveMetrics(cfg.diloco.mode, MetricsPublisher(dht, cfg.net.run_id, expiration=cfg.net.metrics_expiration,
                                                         name=peer_id[-8:]),
                       Fanout(writer.write, sinks), bar, quiet=args.no_progress)
    start = time.perf_counter()
    report = train_worker(data_rank, data_world, cfg, transport, train_source, val, vocab_size, live.emit,
                          on_step=live.on_step, should_stop=lambda: stop.requested,
                          join_running=not args.no_join, before_join=before_join, ranks=ranks)
    summary = summarize(cfg, [report], time.perf_counter() - start, codec_from_config(cfg).encoded_size)
    summary.update(peer_id=peer_id, stopped_early=stop.requested)
    live.final(summary, report.stats)
    writer.close()
    print_summary(summary)
