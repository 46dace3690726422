"""How a round's cost grows with the group: time, bytes and CPU per peer for 2 to 16 peers.

    python -m benchmarks.group_scaling                                  # 2, 4, 8, 16 peers, 10M elements
    python -m benchmarks.group_scaling --sizes 2,4 --numel 1000000 --rounds 5   # a quick look

For each group size M and codec: M ``HivemindTransport`` peers on 127.0.0.1, each in its own
process and session (``benchmarks/harness/loopback.py``: its own DHT, transport and p2p daemon),
one fragment of ``--numel`` elements, ``target_group_size`` = M (the group starts as soon as all
are there), one warm-up round, then ``--rounds`` rounds. Only the transport's public API is used:
the constructor, ``prepare``, ``all_reduce``, ``handle.wait`` and ``SyncResult``.

Per round, every peer calls ``all_reduce`` at one common moment (as ``transport_rounds``); the
round's time runs from that moment to the last peer's result. Per size the row records:

- ``round_s_median`` / ``round_s_max`` over the rounds that succeeded;
- ``phase_groups_s_median``: ``SyncResult.phases`` (``transport/hivemind/round_report.py``)
  grouped as ``loopback.PHASE_GROUPS`` (matchmaking; exchange: the bytes moving between peers; reduce:
  the peer's own part; host: the copies in and out of the transport), median over peers and
  rounds; ``phases_s_median`` keeps every phase as reported;
- ``bytes_sent_per_peer`` / ``bytes_received_per_peer``: ``SyncResult`` counts, mean over peers;
- ``cpu_s_per_peer_round``: CPU seconds (user + system) of each peer's whole process tree
  (``benchmarks/harness/procfs.py``: the peer, its threads, and every process it started: DHT,
  averagers, p2pd) from just before a round's command to its last result, so the figure stays
  comparable whether the averaging runs in forked processes or in a thread; ``idle_cpu_s_per_s``
  is the same tree's background rate with no round in flight (the figure holds that rate over the
  wait before the common start: ``cpu_interval_s_median - round_s_median`` seconds);
- ``ok_rounds`` / ``failures``: a round succeeds when every peer got a result from a group of M
  and all averages are bit-identical; failures are recorded with their reasons, not raised (the
  exit status is 1 when any round failed).

All M peers share this machine's cores: at M above the core count a peer's phases include waiting
for a core (``machine_busy``: the peers' CPU over the cores' time while a round ran). The
extrapolation (``opendiloco_stream.commands.simulator.fit_group_costs``) fits per-peer costs (a fixed
matchmaking cost and its growth per peer, a cost per byte sent, a cost per element of local work:
reduce + host; each peer's CPU per element and per groupmate) with each phase scaled by ``cores / M`` where M > cores, and predicts rounds of
``--extrapolate`` peers (default 64, 256), with the simulator's link figures for them
(``group_link``). Results: ``--out`` (JSON, with a markdown table) and ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.harness.loopback import GROUP_NAMES, START_AHEAD_S, LoopbackSwarm, PeerError, group_phases
from benchmarks.harness.procfs import tree_cpu_seconds
from benchmarks.harness.results import IMG_DIR, RESULTS_DIR, markdown_table, relative, write_result
from opendiloco_stream.commands import simulator as sim
from opendiloco_stream.compression import get_codec

IDLE_S = 2.0  # how long the background CPU of idle peers is sampled


def _cpu(swarm: LoopbackSwarm) -> list[float]:
    """Each peer's process-tree CPU seconds so far."""
    trees = tree_cpu_seconds([p.pid for p in swarm.peers])
    return [sum(trees[p.pid].values()) for p in swarm.peers]


def _round(swarm: LoopbackSwarm, size: int, numel: int, key: tuple, seed: int, timeout: float) -> dict:
    """One round of every peer from a common start; what it cost and whether it succeeded."""
    swarm.call_all("call", function="benchmarks.harness.loopback:stage_tensor", numel=numel, timeout=timeout,
                   per_peer=[dict(seed=seed + i) for i in range(size)])
    cpu0, t0 = _cpu(swarm), time.monotonic()
    start_at = time.time() + max(START_AHEAD_S, 0.05 * size)  # every command arrives before it
    results = swarm.call_all("call", function="benchmarks.harness.loopback:reduce_staged", key=key,
                             start_at=start_at, per_peer=[dict(weight=1.0 + i) for i in range(size)], timeout=timeout)
    cpu1, wall = _cpu(swarm), time.monotonic() - t0
    failures = [f"peer {i}: {r['reason']}: {r['message'][:200]}" for i, r in enumerate(results) if not r["ok"]]
    failures += [f"peer {i}: group of {r['group_size']}" for i, r in enumerate(results)
                 if r["ok"] and r["group_size"] != size]
    if not failures and len(set(swarm.call_all("digest", timeout=timeout))) != 1:
        failures.append("averages differ between peers")
    ok = [r for r in results if r["ok"]]
    return dict(ok=not failures, failures=failures, round_s=max(r["finished_at"] for r in results) - start_at,
                started_late_s=max(r.get("started_late_s", 0.0) for r in results),
                cpu_s=[b - a for a, b in zip(cpu0, cpu1)], wall_s=wall,
                bytes_sent=[r["bytes_sent"] for r in ok], bytes_received=[r["bytes_received"] for r in ok],
                phases=[r["phases"] for r in ok])


def measure(size: int, codec: str, numel: int, rounds: int, matchmaking_time: float, cores: int,
            timeout: float) -> dict:
    """One row: ``size`` peers, ``codec``, a warm-up round and ``rounds`` measured ones."""
    kwargs = dict(codec=codec, target_group_size=size, matchmaking_time=matchmaking_time)
    row = dict(peers=size, codec=codec, numel=numel, rounds=rounds, payload_bytes=get_codec(codec).encoded_size(numel),
               ok_rounds=0, failures=[])
    done: list[dict] = []
    t0 = time.monotonic()
    try:
        with LoopbackSwarm(size, run_id=f"scale{size}_{codec.replace('-', '_')}_{os.getpid()}",
                           transport_kwargs=kwargs, start_timeout=60.0 + 10.0 * size) as swarm:
            swarm.call_all("prepare", {0: numel}, timeout=timeout)
            row["start_s"] = time.monotonic() - t0
            before = _cpu(swarm)
            time.sleep(IDLE_S)  # a benchmark: the peers' background work with no round in flight
            row["idle_cpu_s_per_s"] = statistics.median((b - a) / IDLE_S for a, b in zip(before, _cpu(swarm)))
            for rnd in range(rounds + 1):
                got = _round(swarm, size, numel, (0, rnd), seed=1000 * rnd, timeout=timeout)
                if rnd == 0:
                    row["warmup_ok"] = got["ok"]
                    row["failures"] += [f"warm-up: {f}" for f in got["failures"]]
                    continue
                row["failures"] += [f"round {rnd}: {f}" for f in got["failures"]]
                done.append(got)
                print(f"  {size:3d} peers {codec:9s} round {rnd}: {got['round_s']:.3f} s"
                      f"{'' if got['ok'] else ' FAILED: ' + '; '.join(got['failures'])}", flush=True)
    except (TimeoutError, PeerError) as e:  # a peer that hangs or raises ends this row, recorded as such
        row["failures"].append(f"after {len(done)} rounds: {type(e).__name__}: {str(e)[:300]}")
    row.update(_summary([r for r in done if r["ok"]], cores, row.get("idle_cpu_s_per_s", 0.0)))
    row["ok_rounds"] = sum(r["ok"] for r in done)
    return row


def _summary(ok: list[dict], cores: int, idle_rate: float) -> dict:
    """Medians of the rounds that succeeded (empty when none did). ``machine_busy``: the peers'
    CPU over the cores' time during the round, the idle background of the wait before the common
    start taken out."""
    if not ok:
        return {}
    per_peer = [p for r in ok for p in r["phases"]]
    grouped = [group_phases(p) for p in per_peer]
    cpu = [c for r in ok for c in r["cpu_s"]]
    times = [r["round_s"] for r in ok]
    return dict(
        round_s_median=statistics.median(times), round_s_max=max(times), round_s_min=min(times),
        phase_groups_s_median={g: statistics.median(p[g] for p in grouped) for g in GROUP_NAMES},
        phases_s_median={k: statistics.median(p.get(k, 0.0) for p in per_peer) for k in per_peer[0]},
        bytes_sent_per_peer=statistics.median(statistics.mean(r["bytes_sent"]) for r in ok),
        bytes_received_per_peer=statistics.median(statistics.mean(r["bytes_received"]) for r in ok),
        bytes_sent_max_peer=max(max(r["bytes_sent"]) for r in ok),
        cpu_s_per_peer_round=statistics.median(cpu), cpu_s_per_peer_round_max=max(cpu),
        cpu_s_all_peers_round=statistics.median(sum(r["cpu_s"]) for r in ok),
        cpu_interval_s_median=statistics.median(r["wall_s"] for r in ok),
        machine_busy=statistics.median(
            (sum(r["cpu_s"]) - idle_rate * len(r["cpu_s"]) * max(0.0, r["wall_s"] - r["round_s"])) / (cores * r["round_s"])
            for r in ok),
        started_late_s_max=max(r["started_late_s"] for r in ok),
    )


def extrapolate(rows: list[dict], sizes: list[int], cores: Optional[int]) -> dict:
    """Per codec: the fitted per-peer costs, the model at the measured sizes (against the
    measurement) and at ``sizes``, with the simulator's link figures (``simulate.group_link``)."""
    out = {}
    for codec in dict.fromkeys(r["codec"] for r in rows):
        measured = [r for r in rows if r["codec"] == codec and "round_s_median" in r]
        if not measured:
            continue
        samples = [dict(group_size=r["peers"], numel=r["numel"], payload_bytes=r["payload_bytes"],
                        bytes_sent=r["bytes_sent_per_peer"], matchmaking=r["phase_groups_s_median"]["matchmaking"],
                        exchange=r["phase_groups_s_median"]["exchange"],
                        reduce=r["phase_groups_s_median"]["reduce"] + r["phase_groups_s_median"]["host"],
                        cpu=r["cpu_s_per_peer_round"])
                   for r in measured]
        costs = sim.fit_group_costs(samples, cores=cores)
        numel, payload = measured[0]["numel"], measured[0]["payload_bytes"]
        predicted = []
        for m in sorted({r["peers"] for r in measured} | set(sizes)):
            got = sim.group_round(costs, m, payload, numel)
            setup, gbit_s = sim.group_link(costs, m, payload, numel)
            predicted.append(dict(peers=m, measured=any(r["peers"] == m for r in measured), **got,
                                  sim_allreduce_factor=setup.allreduce_factor, sim_latency_s=setup.latency_s,
                                  sim_gbit_s=gbit_s))
        out[codec] = dict(costs=vars(costs), numel=numel, payload_bytes=payload, predicted=predicted)
    return out


def tables(rows: list[dict], model: dict) -> str:
    """The measured table, then the model's (one peer per machine: at a measured size it is below
    the measurement by the wait for a core, when the size is above the core count)."""
    def ms(x: Optional[float]) -> str:
        return "—" if x is None else f"{1000 * x:.0f}"

    measured = markdown_table(
        ["peers", "codec", "ok", "round s median", "round s max", "matchmaking ms", "exchange ms", "reduce ms",
         "host ms", "sent MiB/peer", "recv MiB/peer", "CPU s/peer/round", "machine busy"],
        [[r["peers"], r["codec"], f"{r['ok_rounds']}/{r['rounds']}", r.get("round_s_median"), r.get("round_s_max"),
          *[ms(r.get("phase_groups_s_median", {}).get(g)) for g in ("matchmaking", "exchange", "reduce", "host")],
          r["bytes_sent_per_peer"] / 2**20 if "bytes_sent_per_peer" in r else None,
          r["bytes_received_per_peer"] / 2**20 if "bytes_received_per_peer" in r else None,
          r.get("cpu_s_per_peer_round"), f"{r['machine_busy']:.0%}" if "machine_busy" in r else None]
         for r in rows])
    predicted = markdown_table(
        ["peers", "codec", "model round s", "matchmaking ms", "exchange ms", "reduce + host ms", "sent MiB/peer",
         "CPU s/peer/round", "simulator factor", "simulator latency s"],
        [[p["peers"], codec + (" (a measured size)" if p["measured"] else ""), p["round"], ms(p["matchmaking"]),
          ms(p["exchange"]), ms(p["reduce"]), p["bytes_sent"] / 2**20, p["cpu"], p["sim_allreduce_factor"],
          p["sim_latency_s"]]
         for codec, fit in model.items() for p in fit["predicted"]])
    return measured + "\n\n" + predicted


def plot(path: Path, rows: list[dict], model: dict, note: str) -> Path:
    """Three panels against group size: round time (measured median and max, the model's line),
    each peer's CPU seconds and MiB sent per round (measured, model); then the measured phase split
    per size and codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.5), dpi=110)
    panels = [("round time, s", "round_s_median", "round", "One round against group size"),
              ("CPU s per peer per round", "cpu_s_per_peer_round", "cpu", "Each peer's CPU (process tree)"),
              ("MiB sent per peer per round", "bytes_sent_per_peer", "bytes_sent", "Each peer's bytes sent")]
    for ax, (ylabel, measured_key, model_key, title) in zip(axes, panels):
        unit = 2**20 if model_key == "bytes_sent" else 1
        for codec, fit in model.items():
            got = [r for r in rows if r["codec"] == codec and "round_s_median" in r]
            xs = [r["peers"] for r in got]
            (line,) = ax.plot(xs, [r[measured_key] / unit for r in got], "o-", label=f"{codec} measured")
            if model_key == "round":
                ax.plot(xs, [r["round_s_max"] for r in got], "v", color=line.get_color(), alpha=0.6,
                        label=f"{codec} max")
            costs, last = sim.GroupCosts(**fit["costs"]), max(p["peers"] for p in fit["predicted"])
            curve = sorted({p["peers"] for p in fit["predicted"]} | {2**k for k in range(1, last.bit_length())})
            ax.plot(curve, [sim.group_round(costs, m, fit["payload_bytes"], fit["numel"])[model_key] / unit
                            for m in curve], "--", color=line.get_color(), label=f"{codec} model, a peer per machine")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("peers in the group")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    right = axes[3]
    done = [r for r in rows if "phase_groups_s_median" in r]
    bottom = [0.0] * len(done)
    for group in GROUP_NAMES:
        values = [r["phase_groups_s_median"][group] for r in done]
        if any(values):
            right.bar(range(len(done)), values, bottom=bottom, label=group)
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(done)))
    right.set_xticklabels([f"{r['peers']}\n{r['codec']}" for r in done], fontsize=7)
    right.set_ylabel("seconds (median per peer)")
    right.set_title("Where a peer's round goes (measured)", fontsize=10)
    right.legend(fontsize=7)
    right.grid(True, axis="y", alpha=0.3)
    fig.text(0.01, 0.01, note, fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 2 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected comma-separated group sizes >= 2, e.g. 2,4,8,16; got {text!r}")
    return sizes


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=_sizes, default=[2, 4, 8, 16], help="group sizes, comma-separated (default 2,4,8,16)")
    p.add_argument("--codecs", nargs="+", default=["fp32", "fp4-e3m0"])
    p.add_argument("--numel", type=int, default=10_000_000, help="elements of the fragment (default 10M)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per size and codec, after a warm-up")
    p.add_argument("--matchmaking-time", type=float, default=5.0,
                   help="how long a round waits for its group of M before starting with fewer (s)")
    p.add_argument("--extrapolate", type=_sizes, default=[64, 256], help="group sizes to predict (default 64,256)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="cores the peers share, for the extrapolation's contention scaling (0: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on any one command to the peers (s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "group_scaling.json")
    p.add_argument("--plot", type=Path, default=IMG_DIR / "group_scaling.png")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.numel < 1 or args.rounds < 1:
        p.error("--numel and --rounds must be >= 1")
    load = os.getloadavg()[0]
    rows = []
    for size in args.sizes:
        for codec in args.codecs:
            print(f"{size} peers, {codec}, {args.numel:,} elements", flush=True)
            rows.append(measure(size, codec, args.numel, args.rounds, args.matchmaking_time, args.cores or 1,
                                args.timeout))
            if rows[-1]["failures"]:
                print("  failures: " + "; ".join(rows[-1]["failures"]), flush=True)
    model = extrapolate(rows, args.extrapolate, args.cores or None)
    table = tables(rows, model)
    print(table)
    note = (f"{args.numel:,} elements, {args.rounds} rounds per point, all peers on one machine of "
            f"{os.cpu_count()} cores (load {load:.1f} at start); model: simulate.fit_group_costs")
    extra = dict(table=table, extrapolation=model, loadavg_1m_start=load, loadavg_1m_end=os.getloadavg()[0])
    if not args.no_plot and model:
        extra["plot"] = relative(plot(args.plot, rows, model, note))
        print(f"wrote {extra['plot']}")
    write_result(args.out, settings=vars(args), rows=rows, argv=argv, benchmark="group_scaling", **extra)
    print(f"wrote {relative(args.out)}")
    failed = [f"{r['peers']} peers {r['codec']}" for r in rows if r["ok_rounds"] < r["rounds"]]
    if failed:
        print("rounds failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
