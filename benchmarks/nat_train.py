"""Training through NAT, measured: who averaged with whom, from when, and which way the bytes went.

    python -m benchmarks.nat_train --natted 2 --relay --out benchmarks/results/nat-train-relay.json
    python -m benchmarks.nat_train --natted 2 --relay --symmetric            # both behind symmetric NATs
    python -m benchmarks.nat_train --natted 2 --relay --relays 4            # 4 relay bootstraps on one machine
    python -m benchmarks.nat_train --natted 2 --relay --rate 20             # the routers' uplinks at 20 Mbit/s
    python -m benchmarks.nat_train --public 2 --natted 1 --symmetric --client-mode --steps 40
    python -m benchmarks.nat_train --natted 2 --relay --relays 4 --symmetric-routers 1     # one of each NAT
    python -m benchmarks.nat_train --natted 2 --relay --relays 4 --rate 100 --relay-rate 20 [--no-punch]
    python -m benchmarks.nat_train --natted 2 --relay --relays 4 --symmetric --logs DIR \
        --relay-log-level DEBUG --p2pd-log 'info,relay=debug'    # each relayed connection's bytes in the relays' logs

Builds :class:`benchmarks.harness.nat.NatTopology` (the bootstrap and ``--public`` peers on a
public bridge, ``--natted`` peers each behind its own masquerading router; ``--symmetric``: a new
port per connection), starts a bootstrap in ``boot`` (``--relay``: a circuit relay, and the NATed
peers reserve a slot on it with ``peer --relay``; ``--relays K``: K relay bootstraps, all in
``boot``, or with ``--spread-relays`` the first K - 1 public nodes running one instead of a peer) and one ``peer`` per remaining node, all
started together, training the tiny model (blocking, H = 10, P = 2 unless told). While they run,
each sync record is stamped with the time it appeared, so the report says when the first round
averaged. Afterwards it counts the bytes on every public node's interface: a relayed round's bytes
cross the relay twice, a direct one (hole punched, or through a listening peer) not at all.

Per peer: rounds, averaged rounds, group sizes, failure reasons, the first averaged round's time,
payload bytes; for the run: whether every round all peers averaged had one digest, and each relay's
bytes against the peers' payload. Results are in docs/networking.md ("Behind NAT"). Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional

from benchmarks.harness.nat import NatTopology, exit_if_unavailable, listen_flags
from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.results import write_result
from opendiloco_stream.train.metrics_file import MetricsTail

RUN_ID = "nattrain"


def train_flags(args: argparse.Namespace) -> list[str]:
    return ["--run-id", RUN_ID, "--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--threads", "1",
            "--no-progress", "--mode", args.mode, "--codec", args.codec, "--fragments", str(args.fragments), "--inner-steps",
            str(args.inner_steps), "--steps", str(args.steps)] + (["--log-level", args.peer_log_level]
                                                                  if args.peer_log_level else [])


def node_flags(args: argparse.Namespace, topo: NatTopology, node: str) -> list[str]:
    """Where the peer listens (``listen_flags``), with ``--relay`` / ``--client-mode`` on NATed ones if asked."""
    extra = ["--relay"] * args.relay + ["--client-mode"] * args.client_mode + ["--no-punch"] * args.no_punch
    return listen_flags(topo, node) + (extra if node in topo.private else [])


def start_relays(run: PeerProcesses, topo: NatTopology, args: argparse.Namespace) -> list[str]:
    """The bootstrap in ``boot`` and ``--relays - 1`` more, in ``boot`` too (one public machine)
    or, with ``--spread-relays``, one in each of the first public nodes; returns the public nodes
    that host one. Every bootstrap's addresses become the peers' initial peers (``run.addrs``)."""
    flags = (["--relay"] if args.relay else []) + (["--log-level", args.relay_log_level] if args.relay_log_level else [])
    first = run.bootstrap(RUN_ID, *flags, node="boot")
    hosts = topo.public_peers()[:args.relays - 1] if args.spread_relays else ["boot"] * (args.relays - 1)
    for i, node in enumerate(hosts, start=1):
        run.bootstrap(RUN_ID, *flags, "--initial-peers", *first, node=node, name=f"relay{i}-{node}")
    return [h for h in hosts if h != "boot"]


def watch(run: PeerProcesses, nodes: list[str], procs: list, timeout: float, t0: float) -> dict[str, list[dict]]:
    """Each peer's records, each sync record stamped with ``t`` (seconds since ``t0`` when it
    appeared, polled every 0.5 s), until every peer exited or ``timeout``."""
    tails = {n: MetricsTail(run.workdir / f"{n}.jsonl") for n in nodes}
    records: dict[str, list[dict]] = {n: [] for n in nodes}
    deadline = t0 + timeout
    while True:
        done = all(p.poll() is not None for p in procs)
        now = round(time.monotonic() - t0, 1)
        for n, tail in tails.items():
            records[n] += [{**r, "t": now} if r.get("event") == "sync" else r for r in tail.read(final=done)]
        if done:
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers still running after {timeout:g} s")
        time.sleep(0.5)


def peer_row(node: str, records: list[dict]) -> dict[str, Any]:
    """One peer's line: its rounds, those averaged with others (the first one's time counts from
    the start of the first relay), failure reasons, payload bytes and its final eval loss."""
    syncs = [r for r in records if r["event"] == "sync"]
    ok = [r for r in syncs if r["ok"]]
    with_others = [r for r in ok if r["group_size"] > 1]
    summary = next((r for r in records if r["event"] == "summary"), {})
    exchanges = Counter()  # how this peer's exchanges went: direct, punched, relayed, p2p (sync records)
    for r in ok:
        exchanges.update(r.get("exchanges") or {})
    return {"node": node, "rounds": len(syncs), "averaged": len(with_others),
            "group_sizes": dict(sorted(Counter(r["group_size"] for r in ok).items())),
            "failed": dict(Counter(r.get("reason") for r in syncs if not r["ok"])),
            "failure_messages": [m for m, _ in Counter(r.get("message", "")[:300] for r in syncs
                                                        if not r["ok"]).most_common(3)],
            "first_averaged_s": with_others[0]["t"] if with_others else None,
            "first_averaged_round": [with_others[0]["fragment"], with_others[0]["round"]] if with_others else None,
            "averaged_after_first": f"{len(with_others)}/{len([r for r in syncs if with_others and r['t'] >= with_others[0]['t']])}",
            "wait_s_median": round(statistics.median(r["wait_s"] for r in with_others), 3) if with_others else None,
            "payload_sent_bytes": sum(r.get("bytes_sent", 0) for r in ok),
            "payload_received_bytes": sum(r.get("bytes_received", 0) for r in ok),
            "exchanges": dict(exchanges),
            "eval_loss": summary.get("eval_loss"), "wall_time_s": summary.get("wall_time_s")}


def agreement(records: dict[str, list[dict]]) -> dict[str, int]:
    """Rounds every peer averaged with all of them, and how many of those had one digest."""
    by_round = [{(r["fragment"], r["round"]): r for r in recs if r["event"] == "sync" and r["ok"]}
                for recs in records.values()]
    n = len(records)
    full = [k for k in set.intersection(*(set(b) for b in by_round)) if all(b[k]["group_size"] == n for b in by_round)]
    same = [k for k in full if len({b[k].get("digest") for b in by_round}) == 1]
    return {"rounds_with_all": len(full), "same_digest": len(same)}


@contextlib.contextmanager
def _workdir(keep: Optional[Path]) -> Iterator[str]:
    """Where the peers' logs and metrics go: ``keep`` (``--logs``, left there to read), else a
    temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="ods-nat-train-") as workdir:
            yield workdir
    else:
        keep.mkdir(parents=True, exist_ok=True)
        yield str(keep)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with _workdir(args.logs) as workdir, \
            NatTopology(public=args.public, natted=args.natted,
                        symmetric=args.symmetric_routers if args.symmetric_routers else args.symmetric) as topo:
        if args.rate:
            topo.shape(args.rate, latency_ms=100.0)  # every router's uplink (and public peer's), both ways
        if args.relay_rate:
            topo.shape(args.relay_rate, latency_ms=100.0, nodes=["boot"])  # the relays' machine
        with PeerProcesses(Path(workdir), grace=5.0, topology=topo) as launched:
            t0 = time.monotonic()
            hosts = start_relays(launched, topo, args)
            relays = ["boot", *hosts]
            nodes = [n for n in topo.public_peers() if n not in hosts] + topo.private
            before = {n: topo.counters(n) for n in relays + topo.routers}
            procs = [launched.peer(node, *train_flags(args), *node_flags(args, topo, node), "--shard",
                                   f"{i}/{len(nodes)}", node=node, env={"ODS_DILOCO__RECORD_DIGESTS": "true"})
                     for i, node in enumerate(nodes)]
            records = watch(launched, nodes, procs, args.timeout, t0)
            after = {n: topo.counters(n) for n in relays + topo.routers}
            errors = {n: (Path(workdir) / f"{n}.log").read_text()[-800:] for n, p in zip(nodes, procs) if p.returncode}
    rows = [peer_row(n, records[n]) for n in nodes]
    payload = sum(r["payload_sent_bytes"] for r in rows)
    exchanges = Counter()
    for r in rows:
        exchanges.update(r["exchanges"])
    links = {n: {k: after[n][k] - before[n][k] for k in ("rx_bytes", "tx_bytes")} for n in after}
    total = sum(exchanges.values())
    return {"rows": rows, "agreement": agreement(records), "links": links, "payload_sent_bytes": payload,
            "exchanges": dict(exchanges),
            "direct_share": round((exchanges["direct"] + exchanges["punched"]) / total, 3) if total else None,
            "relay_rx_over_payload": {n: round(links[n]["rx_bytes"] / payload, 3) if payload else None for n in relays},
            "errors": errors or None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--public", type=int, default=0, help="public peers (default 0)")
    ap.add_argument("--natted", type=int, default=2, help="peers behind NAT, each behind its own router (default 2)")
    ap.add_argument("--symmetric", action="store_true", help="the routers map every connection to a new port")
    ap.add_argument("--relay", action="store_true", help="bootstrap --relay, and peer --relay on the NATed peers")
    ap.add_argument("--relays", type=int, default=1, help="relay bootstraps, all in boot (one public machine)")
    ap.add_argument("--spread-relays", action="store_true", help="the extra relays in the first public nodes instead")
    ap.add_argument("--symmetric-routers", type=int, nargs="+", help="only these routers (0-based) are symmetric")
    ap.add_argument("--client-mode", action="store_true", help="the NATed peers run with --client-mode")
    ap.add_argument("--no-punch", action="store_true", help="the peers punch no hole: NATed pairs through the relay")
    ap.add_argument("--rate", type=float, help="shape every router's and public peer's link to this many Mbit/s")
    ap.add_argument("--relay-rate", type=float, help="shape the relays' machine (boot) to this many Mbit/s")
    ap.add_argument("--mode", default="blocking")
    ap.add_argument("--codec", default="fp32", help="the peers' codec (default fp32, as the documented runs: "
                    "a 4-bit payload is 1/8 of the bytes, so the relay's share of control traffic grows)")
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    ap.add_argument("--out", type=Path, help="write the report (JSON) here")
    ap.add_argument("--logs", type=Path, help="keep the peers' and relays' logs and metrics in this directory")
    ap.add_argument("--peer-log-level", choices=("DEBUG", "INFO", "WARNING"),
                    help="the peers' --log-level (DEBUG: their p2p daemons' lines too; with --logs to read them)")
    ap.add_argument("--p2pd-log", metavar="LEVELS",
                    help="the p2p daemons' log levels (GOLOG_LOG_LEVEL), e.g. 'info,relay=debug,p2p-circuit=debug'; "
                         "their lines show where the process logs at DEBUG")
    ap.add_argument("--relay-log-level", choices=("DEBUG", "INFO", "WARNING"),
                    help="the relays' (bootstraps') --log-level: DEBUG shows their p2p daemons' relay lines")
    args = ap.parse_args(argv)
    exit_if_unavailable("nat_train")
    if args.p2pd_log:
        os.environ["GOLOG_LOG_LEVEL"] = args.p2pd_log  # inherited by every peer's and relay's p2p daemon
    if args.spread_relays and args.public < args.relays - 1:
        ap.error(f"--spread-relays with --relays {args.relays} needs --public >= {args.relays - 1}")
    t0 = time.monotonic()
    report = run(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "logs")}
    print(json.dumps({"settings": settings, **report}, indent=2))
    if args.out:
        rows = report.pop("rows")
        write_result(args.out, settings=settings, rows=rows, benchmark="nat_train", **report,
                     wall_s=round(time.monotonic() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
