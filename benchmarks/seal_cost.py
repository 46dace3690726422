"""What sealing the direct data path costs: round time, sealed (the default) vs ``--direct-plaintext``.

    python -m benchmarks.seal_cost                     # loopback and a 100 Mbit/s shaped link
    python -m benchmarks.seal_cost --links loopback --codecs fp32 --numels 10000000 --rounds 3

For each link, codec and mode, a fresh swarm of ``--peers`` real peers (``LoopbackSwarm``; every
round goes over the direct TCP path) runs one warm-up round and ``--rounds`` measured rounds of
each size, every peer starting at a common moment (``harness.loopback.reduce_staged``); a round's
time runs from that moment to the last peer's result. Averages are checked bit-identical across
peers every round. The two modes of a codec run one after the other (``--passes 2``: sealed,
plaintext, then plaintext, sealed), so the ratio sealed/plaintext of a row compares rounds taken
minutes apart on the same machine.

``shaped``: every peer in its own network namespace behind ``--link-mbit`` each way (``tc tbf``;
root, ``benchmarks/harness/netns.py``), where the link, not the CPU, should set the pace. On
``loopback`` the CPU does: all peers share this machine's cores, so the ratio there is the
upper bound of what sealing adds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness.loopback import LOOPBACK_MBIT, START_AHEAD_S, LoopbackSwarm
from benchmarks.harness.results import RESULTS_DIR, markdown_table, relative, write_result

MODES = ("sealed", "plaintext")


def time_rounds(swarm: LoopbackSwarm, fragment: int, numel: int, rounds: int, label: str) -> list[float]:
    """Round times of ``rounds`` measured rounds of one fragment (after one warm-up round)."""
    times = []
    for rnd in range(rounds + 1):
        swarm.call_all("call", function="benchmarks.harness.loopback:stage_tensor", numel=numel, timeout=300,
                       per_peer=[dict(seed=1000 * rnd + i) for i in range(swarm.n)])
        start_at = time.time() + START_AHEAD_S
        results = swarm.call_all("call", function="benchmarks.harness.loopback:reduce_staged", key=(fragment, rnd),
                                 start_at=start_at, weight=1.0, timeout=600)
        failed = [f"peer {i}: {r['reason']}: {r['message']}" for i, r in enumerate(results) if not r["ok"]]
        if failed:
            raise RuntimeError(f"{label} round {rnd}: " + "; ".join(failed))
        if len(set(swarm.call_all("digest", timeout=120))) != 1:
            raise RuntimeError(f"{label} round {rnd}: averages differ between peers")
        if rnd > 0:  # round 0 warms up: first-touch allocations, connections
            times.append(max(r["finished_at"] for r in results) - start_at)
    return times


def measure(mode: str, codec: str, numels: list[int], rounds: int, peers: int, topo=None) -> dict[int, list[float]]:
    """``{numel: round times}`` of one swarm in ``mode``."""
    kwargs = dict(codec=codec, target_group_size=peers, matchmaking_time=3.0, request_timeout=1.0,
                  link_mbit=LOOPBACK_MBIT if topo is None else topo.rate_mbit, direct_plaintext=mode == "plaintext")
    overrides = None
    if topo is not None:
        overrides = {i: dict(netns=topo.ns(f"p{i}"), host=topo.ip(f"p{i}")) for i in range(peers)}
    with LoopbackSwarm(peers, run_id=f"seal_{mode}_{codec.replace('-', '_')}", transport_kwargs=kwargs,
                       peer_overrides=overrides) as swarm:
        swarm.call_all("prepare", dict(enumerate(numels)), timeout=300)
        return {numel: time_rounds(swarm, f, numel, rounds, f"{mode} {codec} {numel:,}")
                for f, numel in enumerate(numels)}


def measure_link(link: str, args: argparse.Namespace, topo=None) -> list[dict]:
    rows = []
    for codec in args.codecs:
        times: dict[str, dict[int, list[float]]] = {m: {n: [] for n in args.numels} for m in MODES}
        for p in range(args.passes):
            for mode in (MODES if p % 2 == 0 else MODES[::-1]):
                for numel, t in measure(mode, codec, args.numels, args.rounds, args.peers, topo).items():
                    times[mode][numel] += t
                    print(f"{link} {codec} {numel:,} {mode}: " + ", ".join(f"{x:.3f}" for x in t), flush=True)
        for numel in args.numels:
            sealed, plain = (statistics.median(times[m][numel]) for m in MODES)
            rows.append(dict(link=link, link_mbit=None if topo is None else topo.rate_mbit, codec=codec, numel=numel,
                             peers=args.peers, sealed_s_median=sealed, plaintext_s_median=plain,
                             ratio=sealed / plain, sealed_s=times["sealed"][numel],
                             plaintext_s=times["plaintext"][numel]))
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["link", "codec", "elements", "sealed s (median)", "plaintext s (median)", "sealed / plaintext",
         "sealed rounds", "plaintext rounds"],
        [[r["link"] if r["link_mbit"] is None else f"{r['link_mbit']:g} Mbit/s", r["codec"], f"{r['numel']:,}",
          f"{r['sealed_s_median']:.3f}", f"{r['plaintext_s_median']:.3f}", f"{r['ratio']:.2f}x",
          " ".join(f"{x:.2f}" for x in r["sealed_s"]), " ".join(f"{x:.2f}" for x in r["plaintext_s"])]
         for r in rows], align="llrrrrll")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", nargs="+", choices=["loopback", "shaped"], default=["loopback", "shaped"])
    p.add_argument("--link-mbit", type=float, default=100.0, help="the shaped link's rate, each way")
    p.add_argument("--codecs", nargs="+", default=["fp32", "fp4-e3m0"])
    p.add_argument("--numels", nargs="+", type=int, default=[10_000_000, 50_000_000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=1, help="2: each mode twice, in the order A B B A")
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "seal-cost.json")
    args = p.parse_args(argv)
    rows = []
    if "loopback" in args.links:
        rows += measure_link("loopback", args)
    if "shaped" in args.links:
        from benchmarks.harness import netns

        reason = netns.unavailable_reason()
        if reason:
            print(f"shaped link skipped: {reason}", file=sys.stderr)
        else:
            with netns.Topology(peers=args.peers) as topo:
                topo.shape(args.link_mbit)
                rows += measure_link("shaped", args, topo)
    print(table(rows))
    write_result(args.out, settings=dict(vars(args), out=relative(args.out)), rows=rows, benchmark="seal_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
