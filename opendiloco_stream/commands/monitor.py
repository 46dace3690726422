"""``opendiloco-stream monitor``: a live table of a run's peers, read from their metrics on the DHT.

Joins as a client-mode DHT node (it accepts no requests and stores nothing) and shows, per peer:
step, loss, tokens/s, MB sent, compute utilization, fragment rounds (failed), how many inner steps
rounds took to land on average (how stale eager updates are) and how long ago it
last published. Peers that stopped publishing disappear when their record expires
(``net.metrics_expiration``). ``--once`` prints one table and exits; ``--json`` prints the records.
``--html F`` also writes a self-contained page of loss and utilization curves over time (inline SVG,
works offline); ``--html F --from-metrics *.jsonl`` draws it from peers' metrics files instead.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any, Optional

from opendiloco_stream.commands.monitor_page import History, load_history, write_page
from opendiloco_stream.config_cli import UsageError
from opendiloco_stream.net.flags import add_network_flags, net_config_from_args, verbose
from opendiloco_stream.net.lifecycle import GracefulShutdown

COLUMNS = ("peer", "step", "loss", "tokens/s", "MB sent", "util", "rounds", "landed after", "last seen (s)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("monitor", help="live table of a run's peers from their metrics on the DHT",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_network_flags(p, listen=False, identity=False)
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="refresh period (default 2 s)")
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--json", action="store_true", help="print the records as JSON (one list per refresh)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="bound on each DHT lookup")
    p.add_argument("--html", metavar="F", help="also write a self-contained page of the swarm's loss and utilization "
                   "curves to F at every refresh (continues the curves of an existing F)")
    p.add_argument("--from-metrics", nargs="+", metavar="JSONL",
                   help="with --html: draw the page from peers' --metrics-file records instead of the DHT, and exit")
    p.set_defaults(func=run)


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: list[dict[str, Any]], now: float, run_id: str) -> str:
    """A plain-text table of ``records`` (as returned by ``read_swarm_metrics``)."""
    from opendiloco_stream.algorithm.sync_log import (  # lazy: algorithm/ loads torch; --help stays light
        ALONE_WARN_AFTER)

    if not records:
        return f"run '{run_id}': no peer has published metrics (yet)"
    rows = [COLUMNS]
    for r in records:
        rounds = f"{r['rounds']}" + (f" ({r['failed_rounds']} failed)" if r.get("failed_rounds") else "")
        util = r.get("compute_utilization")
        rows.append((
            r["name"], str(r["step"]), _fmt(r.get("loss"), ".4f"), _fmt(r.get("tokens_per_s"), ".0f"),
            _fmt(r["bytes_sent"] / 2**20, ".1f"), "-" if util is None else f"{util:.0%}", rounds,
            _fmt(r.get("land_steps"), ".1f") + ("" if r.get("land_steps") is None else " steps"),
            _fmt(max(0.0, now - r["time"]), ".0f"),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    header = f"run '{run_id}': {len(records)} peer(s)"
    warnings = [f"WARNING: {r['name']} has averaged with no other peer for its last {r['alone_rounds']} rounds: "
                f"it trains alone (is it reaching the others' rounds? `doctor` on it, and its metrics file's "
                f"\"warning\" records, say more)"
                for r in records if r.get("alone_rounds", 0) >= ALONE_WARN_AFTER]
    return "\n".join([header, *lines, *warnings])


def run(args: argparse.Namespace) -> int:
    from hivemind.utils import get_dht_time  # lazy: loads hivemind; --help stays light

    from opendiloco_stream.net.dht import (  # lazy: loads hivemind; --help stays light
        quiet_hivemind, start_dht, stop_dht)
    from opendiloco_stream.net.metrics import (  # lazy: loads hivemind; --help stays light
        install_validators, read_swarm_metrics)

    if args.interval <= 0 or args.timeout <= 0:
        raise UsageError("--interval and --timeout must be > 0 seconds")
    if args.from_metrics:
        return _page_from_metrics(args)
    net = net_config_from_args(args, client_mode=True)
    if not net.initial_peers:
        raise UsageError("monitor needs --initial-peers (the address a bootstrap node or any peer printed)")
    quiet_hivemind(verbose(args))
    live = sys.stdout.isatty() and not args.once and not args.json
    with GracefulShutdown() as stop:
        dht = start_dht(net)
        try:
            install_validators(dht, net.run_id)
            history = load_history(args.html, net.run_id) if args.html else None
            while not stop.requested:
                try:
                    records = read_swarm_metrics(dht, net.run_id, timeout=args.timeout)
                    if history is not None:
                        history.add_records(records)
                        write_page(args.html, history, refresh_s=None if args.once else max(2.0, args.interval))
                    if args.json:
                        out = json.dumps(records)
                    else:
                        out = format_table(records, get_dht_time(), net.run_id)
                except (TimeoutError, concurrent.futures.TimeoutError):
                    out = f"no answer from the DHT within {args.timeout:g} s; retrying"
                    if args.json or args.once:
                        raise UsageError(f"the DHT did not answer within {args.timeout:g} s") from None
                # clear the screen only when someone is looking at it
                print(("\x1b[H\x1b[2J" if live else "") + out, flush=True)
                if args.once or stop.wait(args.interval):
                    break
        finally:
            if not verbose(args):
                quiet_hivemind(level=60)
            stop_dht(dht)
    if args.html:
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _page_from_metrics(args: argparse.Namespace) -> int:
    """``monitor --html F --from-metrics a.jsonl b.jsonl``: the page of finished (or running) peers."""
    if not args.html:
        raise UsageError("--from-metrics draws a page: add --html F")
    history = History(net_config_from_args(args).run_id)
    for path in args.from_metrics:
        if not Path(path).is_file():
            raise UsageError(f"--from-metrics: {path} does not exist")
        history.add_metrics_file(path)
    if not any(history.series.values()):
        raise UsageError("--from-metrics: no step records in " + ", ".join(args.from_metrics))
    write_page(args.html, history)
    print(f"wrote {args.html} ({len(history.series)} curve(s))", file=sys.stderr)
    return 0
