"""Time and bytes per all-reduce round of the hivemind transport, 3 real peers on 127.0.0.1.

    python -m benchmarks.transport_rounds --out runs/transport_rounds.json
    python -m benchmarks.transport_rounds --codecs fp32 fp4-e3m0 --numels 1000000 --rounds 5

For each codec: start 3 peers (``LoopbackSwarm``), declare one fragment per size, run one warm-up
round and ``--rounds`` measured rounds per size. Every peer calls ``all_reduce`` at the same
moment (``time.time()``, a common start ``START_AHEAD_S`` after the command is sent, as gloo's
barrier), and a round's time runs from that moment to the last peer's result
(``target_group_size`` = 3, so matchmaking does not wait); ``started_late_s_max`` is how late the
latest peer actually began. Bytes are
what each peer's transport counted on the wire (serialized messages), averaged over peers.
``phases_s_median`` splits a round into the phases of ``SyncResult.phases`` (prepare, matchmaking,
contributions, verdicts, reduce, results, drain, finish): the median over peers and rounds.

Then (unless ``--no-kill``) the killed-peer scenario: a round of the largest fragment is started
and one peer's whole process group is SIGKILLed mid-round (at 40% of a measured round time); we
report how long after the kill the survivors got their failure, and how long the next round (two
peers, after ``matchmaking_time`` since the target of 3 is no longer reachable) took.

With ``--gloo``, the same run also times ``torch.distributed.all_reduce`` (gloo backend) of the
same fp32 tensor between the same number of processes on 127.0.0.1 (one thread each, like the
peers), and writes it as ``gloo_round_s`` next to each row's ``round_s_median``: the reference for
"as fast as the link". It times gloo again after the rows (``gloo_round_s_after``): gloo's own
time moves between runs here. On loopback the gloo ranks stay up (``harness.gloo.GlooRanks``) and also
run ``GLOO_BETWEEN`` rounds right after each of our timed rounds: ``ours_over_gloo_between`` is
each of our rounds over the median of those, ``ours_over_gloo_between_median`` their median, a
ratio taken in the machine's state of that very round. ``--numels 10000000 50000000`` gives the
10M and 50M rows. With
``--gloo``, each row also gets ``codec_floor_s`` (``benchmarks/harness/codec_work.py``): the codec work of the same
round alone (encode, checks, mean, decode, the host's copy), spread over this machine's cores,
which no implementation of the round on these cores beats. With ``--prematch``, every size gets a
second row from rounds that alternate with the plain ones in the same swarm: each peer forms the
group ahead (``Transport.prematch`` when the command arrives, ``START_AHEAD_S`` before the start),
so matchmaking is off the round's critical path, as with the trainer's ``--prematch-steps``.

Loopback numbers measure CPU (encode, decode, reduce) and the p2p daemons, not a network. With
``--link-mbit R`` (root; ``benchmarks/harness/netns.py``) every peer, and every gloo rank, runs in its own
network namespace behind a link shaped to R Mbit/s each way by ``tc tbf``: a row then also
reports ``link_floor_s``, the time the link needs for the bytes the busiest peer sent or received
(the fastest any transport could move those bytes), and gloo runs over the same shaped links.
All peers share this machine's cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness.gloo import GlooRanks, time_gloo
from benchmarks.harness.loopback import LOOPBACK_MBIT, START_AHEAD_S, LoopbackSwarm
from benchmarks.harness.results import write_result
from opendiloco_stream.transport.layout import resolve_chunk_bytes

PEERS = 3
GLOO_BETWEEN = 3  # gloo rounds timed after each of our timed rounds (--gloo, on loopback)


def measure_codec(codec: str, numels: list[int], rounds: int, matchmaking_time: float,
                  gloo: Optional[dict[int, float]] = None, topo=None,
                  floors: Optional[dict[tuple, float]] = None, prematch: bool = False,
                  link_mbit: float = LOOPBACK_MBIT, chunk_bytes: Optional[int] = None,
                  between: Optional[GlooRanks] = None) -> list[dict]:
    """One row per size, or with ``prematch`` two, from alternating rounds: the group formed at
    the round's start (as without it), and formed ahead. ``between``: gloo ranks that time
    ``GLOO_BETWEEN`` rounds of the same size after each of our timed rounds."""
    rows = []
    kwargs = dict(codec=codec, target_group_size=PEERS, matchmaking_time=matchmaking_time, request_timeout=1.0,
                  link_mbit=link_mbit, chunk_bytes=chunk_bytes)
    overrides = None
    if topo is not None:  # each peer in its namespace, chunks and timeouts derived from the shaped rate
        kwargs["link_mbit"] = topo.rate_mbit
        overrides = {i: dict(netns=topo.ns(f"p{i}"), host=topo.ip(f"p{i}")) for i in range(PEERS)}
    with LoopbackSwarm(PEERS, run_id=f"bench_{codec.replace('-', '_')}", transport_kwargs=kwargs,
                       peer_overrides=overrides) as swarm:
        swarm.call_all("prepare", {f: n for f, n in enumerate(numels)}, timeout=300)
        for fragment, numel in enumerate(numels):
            modes = [False, True] if prematch else [False]
            seen = {m: dict(times=[], sent=[], received=[], phases=[], late=[], gloo=[]) for m in modes}
            for rnd in range(rounds + 1):
                for m, early in enumerate(modes):
                    key = (fragment, rnd * len(modes) + m)
                    # tensors first, on every peer, then the round: as gloo's barrier, so that no peer's
                    # round time includes waiting for another one still drawing its random tensor
                    swarm.call_all("call", function="benchmarks.harness.loopback:stage_tensor", numel=numel, timeout=300,
                                   per_peer=[dict(seed=1000 * rnd + i) for i in range(PEERS)])
                    start_at = time.time() + START_AHEAD_S  # every peer's command arrives before this moment
                    results = swarm.call_all("call", function="benchmarks.harness.loopback:reduce_staged", key=key,
                                             start_at=start_at, prematch=early,
                                             per_peer=[dict(weight=1.0 + i) for i in range(PEERS)], timeout=600)
                    failed = [r for r in results if not r["ok"]]
                    if failed:
                        raise RuntimeError(f"{codec} numel={numel} round {key[1]}: " + "; ".join(
                            f"peer {i}: {r['reason']}: {r['message']}" for i, r in enumerate(results) if not r["ok"]))
                    # digests once every peer is done, not while later peers still finish their round
                    if len(set(swarm.call_all("digest", timeout=120))) != 1:
                        raise RuntimeError(f"{codec} numel={numel} round {key[1]}: averages differ between peers")
                    if rnd == 0:
                        continue  # warm-up: first-touch allocations, connections
                    got = seen[early]
                    got["times"].append(max(r["finished_at"] for r in results) - start_at)
                    got["late"].append(max(r["started_late_s"] for r in results))
                    got["sent"].append(statistics.mean(r["bytes_sent"] for r in results))
                    got["received"].append(statistics.mean(r["bytes_received"] for r in results))
                    got["phases"] += [r["phases"] for r in results]
                    if between is not None:  # gloo now, in the machine's state of this very round
                        got["gloo"].append(between.times(numel, GLOO_BETWEEN))
            for early in modes:
                rows.append(_summary(codec, numel, rounds, early, **seen[early]))
                rows[-1].update(link_mbit_declared=kwargs["link_mbit"],
                                chunk_bytes=resolve_chunk_bytes(kwargs["chunk_bytes"], kwargs["link_mbit"]))
                _finish_row(rows[-1], gloo, floors, topo, swarm, results)
    return rows


def _summary(codec: str, numel: int, rounds: int, prematch: bool, times: list, sent: list, received: list,
             phases: list, late: list, gloo: list) -> dict:
    row = dict(codec=codec, numel=numel, peers=PEERS, rounds=rounds, prematch=prematch,
               round_s_median=statistics.median(times), round_s_min=min(times), round_s_max=max(times),
               bytes_sent_per_peer=statistics.mean(sent), bytes_received_per_peer=statistics.mean(received),
               wire_bits_per_element=8 * statistics.mean(sent) / numel,
               phases_s_median={k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]},
               started_late_s_max=max(late))
    if gloo:  # each of our rounds over the median of the gloo rounds right after it
        row.update(gloo_between_s_median=statistics.median(t for ts in gloo for t in ts),
                   ours_over_gloo_between=[ours / statistics.median(ts) for ours, ts in zip(times, gloo)])
        row["ours_over_gloo_between_median"] = statistics.median(row["ours_over_gloo_between"])
    return row


def _finish_row(row: dict, gloo: Optional[dict], floors: Optional[dict], topo, swarm, results: list) -> None:
    codec, numel = row["codec"], row["numel"]
    if gloo and numel in gloo:
        row["gloo_round_s"] = gloo[numel]
    if floors and (codec, numel) in floors:
        row["codec_floor_s"] = floors[(codec, numel)]
    if topo is not None:
        busiest = max(max(r["bytes_sent"], r["bytes_received"]) for r in results)  # last round
        row.update(link_mbit=topo.rate_mbit, link_floor_s=8 * busiest / (topo.rate_mbit * 1e6),
                   peer_maddrs=[m for p in swarm.peers for m in p.maddrs])  # where the peers listened
    print(_row(row), flush=True)
    print("    phases (median over peers and rounds): " + ", ".join(
        f"{k} {1000 * v:.0f} ms" for k, v in row["phases_s_median"].items()), flush=True)


def measure_kill(numel: int, codec: str, matchmaking_time: float) -> dict:
    kwargs = dict(codec=codec, target_group_size=PEERS, matchmaking_time=matchmaking_time, request_timeout=1.0)
    with LoopbackSwarm(PEERS, run_id="bench_kill", transport_kwargs=kwargs) as swarm:
        swarm.call_all("prepare", {0: numel}, timeout=300)
        args = [dict(seed=i, numel=numel, return_tensors=False) for i in range(PEERS)]
        durations = []
        for rnd in range(3):  # warm-up + a reference duration for the kill point
            results = swarm.call_all("all_reduce", (0, rnd), per_peer=args, timeout=600)
            assert all(r["ok"] for r in results), results
            durations.append(max(r["elapsed_s"] for r in results))
        round_s = statistics.median(durations[1:])
        for peer, kw in zip(swarm.peers, args):
            peer.send("all_reduce", (0, 3), **kw)
        time.sleep(0.4 * round_s)  # a benchmark: aim for the middle of the round
        killed_at = time.time()
        swarm.peers[-1].kill()
        survivors = [p.recv(600) for p in swarm.peers[:-1]]
        out = dict(numel=numel, codec=codec, round_s=round_s, kill_after_s=0.4 * round_s,
                   survivors=[dict(ok=r["ok"], reason=r.get("reason")) for r in survivors],
                   failure_after_kill_s=max(r["finished_at"] for r in survivors) - killed_at)
        t0 = time.monotonic()
        results = swarm.call_all("all_reduce", (0, 4), per_peer=args[:-1], peers=swarm.peers[:-1], timeout=600)
        out.update(next_round_ok=all(r["ok"] for r in results), next_round_group=results[0].get("group_size"),
                   next_round_s=time.monotonic() - t0, matchmaking_time=matchmaking_time)
        return out


def _row(r: dict) -> str:
    gloo = f" {r['gloo_round_s']:7.3f} | {r['round_s_median'] / r['gloo_round_s']:6.1f}x |" if "gloo_round_s" in r else ""
    if "codec_floor_s" in r:
        gloo += f" {r['codec_floor_s']:7.3f} |"
    if "link_floor_s" in r:
        gloo += f" {r['link_floor_s']:7.3f} | {r['link_floor_s'] / r['round_s_median']:5.0%} |"
    codec = r["codec"] + (" ahead" if r.get("prematch") else "")
    return (f"| {codec:>15} | {r['numel']:>10,} | {r['round_s_median']:8.3f} | {r['round_s_min']:6.3f}-{r['round_s_max']:6.3f} "
            f"| {r['bytes_sent_per_peer'] / 2**20:9.2f} | {r['bytes_received_per_peer'] / 2**20:9.2f} "
            f"| {r['wire_bits_per_element']:6.2f} |" + gloo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=["fp32", "fp16", "int8", "fp4-e3m0"])
    p.add_argument("--numels", nargs="+", type=int, default=[1_000_000, 10_000_000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--matchmaking-time", type=float, default=3.0)
    p.add_argument("--prematch", action="store_true",
                   help="also rows with the group formed ahead (Transport.prematch), from rounds alternating with "
                        "the plain ones in the same swarm")
    p.add_argument("--no-kill", action="store_true", help="skip the killed-peer scenario (always skipped with --link-mbit)")
    p.add_argument("--gloo", action="store_true",
                   help="also time a torch.distributed gloo fp32 all_reduce of each size (gloo_round_s per row)")
    p.add_argument("--link-mbit", type=float,
                   help="run every peer and gloo rank in its own network namespace behind a link shaped to this "
                        "many Mbit/s each way (tc tbf; needs root, see benchmarks/harness/netns.py)")
    p.add_argument("--loopback-mbit", type=float, default=LOOPBACK_MBIT,
                   help="the link rate the transport is told on 127.0.0.1 (chunk size and timeouts derive from it; "
                        "100: the 1 MiB chunks of earlier runs)")
    p.add_argument("--chunk-bytes", type=int, help="chunk size (default: derived from the link rate)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.link_mbit is None:
        return run(args, None)
    from benchmarks.harness import netns

    reason = netns.unavailable_reason()
    if reason:
        print(f"--link-mbit: {reason}", file=sys.stderr)
        return 2
    with netns.Topology(peers=PEERS) as topo:
        topo.shape(args.link_mbit)
        probe = netns.measure_throughput(topo, "p0", "p1", nbytes=max(2_000_000, int(args.link_mbit * 1e6 / 8)))
        print(f"links shaped to {args.link_mbit:g} Mbit/s each way; one TCP stream p0 -> p1: "
              f"{probe['mbit_s']:.1f} Mbit/s", flush=True)
        return run(args, topo, probe)


def run(args: argparse.Namespace, topo=None, probe: Optional[dict] = None) -> int:
    if not args.gloo or topo is not None:  # over shaped links gloo runs in the namespaces, before and after
        return _run(args, topo, probe, None)
    with GlooRanks(PEERS) as ranks:  # up from the start: timed before, between and after our rounds
        return _run(args, topo, probe, ranks)


def _run(args: argparse.Namespace, topo, probe: Optional[dict], ranks: Optional[GlooRanks]) -> int:
    gloo = {}
    if args.gloo:  # first, on a quiet machine (the peers' daemons are not up yet)
        for numel in args.numels:
            gloo[numel] = time_gloo(numel, args.rounds, PEERS, topo, ranks)
            print(f"gloo fp32 all_reduce, {PEERS} processes, {numel:,} elements: {gloo[numel]:.3f} s", flush=True)
    floors = {}
    if args.gloo:  # the codec work alone, spread over this machine's cores (codec_floor.py)
        from benchmarks.harness.codec_work import measure

        chunk = resolve_chunk_bytes(args.chunk_bytes, topo.rate_mbit if topo is not None else args.loopback_mbit)
        for codec in args.codecs:
            for numel in args.numels:
                floors[(codec, numel)] = measure(codec, numel, PEERS, repeats=3, chunk_bytes=chunk)["floor_s"]
                print(f"codec floor {codec}, {numel:,} elements: {floors[(codec, numel)]:.3f} s", flush=True)
    extra = (" gloo s  | ours/gloo | floor s |", "---------|-----------|---------|") if gloo else ("", "")
    if topo is not None:
        extra = (extra[0] + " link floor s | floor/ours |", extra[1] + "--------------|------------|")
    print("| codec (group)   | elements   | median s | min-max s     | sent MiB  | recv MiB  | bits/el |" + extra[0])
    print("|-----------------|------------|----------|---------------|-----------|-----------|---------|" + extra[1], flush=True)
    rows = []
    for codec in args.codecs:
        rows += measure_codec(codec, args.numels, args.rounds, args.matchmaking_time, gloo, topo, floors,
                              prematch=args.prematch, link_mbit=args.loopback_mbit, chunk_bytes=args.chunk_bytes,
                              between=ranks)
    if gloo:  # again, after our rounds: gloo's own time moves between runs on this machine
        after = {n: time_gloo(n, args.rounds, PEERS, topo, ranks) for n in gloo}
        for row in rows:
            row["gloo_round_s_after"] = after[row["numel"]]
            print(f"{row['codec']}{' ahead' if row['prematch'] else ''} {row['numel']:,}: "
                  f"{row['round_s_median'] / gloo[row['numel']]:.1f}x gloo before, "
                  f"{row['round_s_median'] / after[row['numel']]:.1f}x gloo after ({after[row['numel']]:.3f} s)"
                  + (f", {row['ours_over_gloo_between_median']:.1f}x gloo between rounds (median of "
                     f"{len(row['ours_over_gloo_between'])} ratios; gloo {row['gloo_between_s_median']:.3f} s)"
                     if "ours_over_gloo_between" in row else ""))
    report = dict(gloo_round_s={str(n): t for n, t in gloo.items()},
                  codec_floor_s={f"{c} {n}": t for (c, n), t in floors.items()}, start_ahead_s=START_AHEAD_S)
    if topo is not None:
        report.update(link_mbit=topo.rate_mbit, probe_mbit_s=probe["mbit_s"])
    if not args.no_kill and topo is None:
        kill = measure_kill(max(args.numels), "fp32", args.matchmaking_time)
        report["kill"] = kill
        print(f"\nkilled peer ({kill['numel']:,} fp32, round {kill['round_s']:.2f}s, kill at {kill['kill_after_s']:.2f}s): "
              f"survivors {[s['reason'] or 'ok' for s in kill['survivors']]} {kill['failure_after_kill_s']:.2f}s after "
              f"the kill; next round: group of {kill['next_round_group']} in {kill['next_round_s']:.2f}s "
              f"(includes matchmaking_time {kill['matchmaking_time']}s)")
    if args.out:
        write_result(args.out, settings=vars(args) | {"peers": PEERS}, rows=rows,
                     benchmark="transport_rounds", **report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
