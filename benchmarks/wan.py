"""WAN benchmark: real ``peer`` processes in network namespaces behind ``tc tbf`` links.

    sudo .venv/bin/python -m benchmarks.wan --quick --out benchmarks/results/wan-quick.json
    sudo .venv/bin/python -m benchmarks.wan --rates 5,20,100 --out benchmarks/results/wan-full.json
    sudo .venv/bin/python -m benchmarks.wan --time-to-loss --out benchmarks/results/wan-time-to-loss.json
    sudo .venv/bin/python -m benchmarks.wan --cleanup          # remove leftovers of killed runs

For each link rate R and each mode (data-parallel, DiLoCo blocking P=1, streaming blocking,
streaming tau=1, streaming eager) x codec, it starts a bootstrap node and M peers, each in its own
namespace with an R Mbit/s link each way (``benchmarks/harness/netns.py``), trains the tiny model for the
same number of inner steps (data-parallel: fewer, see ``--dp-budget``) and records, per run:
compute utilization, tokens/s, bytes per peer from our accounting and from the interface
counters, peak bytes per sync, time blocked on the network, and the final eval loss.

Nothing is scraped from logs: the bootstrap writes its address to a file, peers write JSON-lines
metrics. Every run is bounded (``--run-timeout``, derived from the expected traffic by default);
a run that times out or fails is recorded with its status. Processes start and stop through the
harness (``benchmarks/harness/peers.py``); namespaces and every process in them are removed at
the end, on Ctrl+C and on SIGTERM. Without root / ``ip netns`` it says why and exits 0 without
numbers. The report (table, ratios, simulator comparison, plots) is ``benchmarks/harness/wan_report.py``.

Distance (``--rtt-ms 0,80,150,300`` and/or ``--regions us/eu/asia``, with ``--loss``, ``--jitter``):
the namespaces sit in regions of the user-space WAN emulator (``benchmarks/harness/wan_emulator.py``):
2 peers (``--peers``) RTT apart for each ``--rtt-ms``, and with ``--regions`` one peer per region
at the preset's RTTs. Each place gets its own topology; the report adds per run the rounds every
peer averaged with the whole group, failed rounds and why, matchmaking and round time with its
split, and the time to blocking's final loss at the same place and rate (``benchmarks/harness/wan_rtt.py``).

    sudo .venv/bin/python -m benchmarks.wan --distance --rtt-ms 0,80,150,300 --regions us/eu/asia \
        --rates 5,20 --out benchmarks/results/wan-rtt.json --report docs/benchmarks-wan-rtt.md --plots docs/img/wan-rtt

``--time-to-loss``: the peers evaluate every 10 steps, and the report gives per link the training
time each mode needs to reach blocking streaming fp32's final eval loss (every run has the same
steps and learning-rate schedule; a run that ends above the target says "not reached") and a plot
of eval loss against time (``benchmarks/harness/wan_time_to_loss.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import netns, wan_report, wan_rtt
from benchmarks.harness import wan_time_to_loss as ttl
from benchmarks.harness import wan_records as wr
from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.results import command_line, environment, write_result
from benchmarks.harness.wan_emulator import PRESETS, Regions
from benchmarks.harness.wan_report import CODEC_BITS, wire_bits
from opendiloco_stream.train.loop import read_metrics

SPARSE = ("topk-int2", "topk-int4")  # at their defaults (2 %, 1024-value chunks)
MODES = {  # benchmark label -> (trainer mode, fragments: "P" = --fragments, tau)
    "data-parallel": ("data-parallel", 1, 0),
    "diloco": ("blocking", 1, 0),
    "streaming": ("blocking", "P", 0),
    "streaming-tau1": ("overlap", "P", 1),
    "streaming-eager": ("eager", "P", 0),
}
TINY_PARAMS = 870_272  # measured: `peer --model tiny` summary "params" (byte vocabulary)
GRACE_S = 20.0
#: sequential round trips a round took at distance (measured: ~5 to form the group, ~10 to exchange):
#: the time bounds add them, so that a run at 300 ms RTT is not cut short
ROUND_TRIPS = 15


@dataclass
class RunSpec:
    """One benchmark run: a mode, codec and link rate, trained for ``steps`` inner steps by ``peers`` peers."""

    label: str
    mode: str
    codec: str
    fragments: int
    overlap_steps: int
    inner_steps: int
    steps: int
    link_mbit: float
    peers: int
    eval_every: int = 0  # --time-to-loss: evaluations along the way (the eval-loss-against-time curve)
    place: str = ""  # where the peers are: "" (one bridge, no delay), "rtt150" (2 regions), "us/eu/asia"

    @property
    def name(self) -> str:
        where = f"-{self.place.replace('/', '-')}" if self.place else ""
        return f"{self.label}-{self.codec}-P{self.fragments}-{self.link_mbit:g}mbit{where}"


def place_regions(place: str, loss: float = 0.0, jitter_ms: float = 0.0) -> Regions:
    """The regions of a place name: ``"rtt<ms>"`` two regions that far apart, else a preset."""
    if place.startswith("rtt"):
        return Regions.pair(float(place[3:]), jitter_ms, loss)
    return Regions.preset(place, jitter_ms, loss)


def place_rtt_ms(place: str) -> float:
    """The largest RTT between two peers of a place (what bounds a round's waiting)."""
    if not place:
        return 0.0
    regions = place_regions(place)
    return max([link.rtt_ms for link in regions.links.values()] + [0.0])


# ---------------------------------------------------------------------------------------- plan


def payload_per_sync(spec: RunSpec, params: int = TINY_PARAMS) -> float:
    """Bytes one peer sends per sync round, as hivemind's butterfly all-reduce moves them."""
    frac = 1.0 if spec.mode == "data-parallel" else 1.0 / spec.fragments
    return params * frac * wire_bits(spec.codec) / 8 * 2 * (spec.peers - 1) / spec.peers


def expected_network_s(spec: RunSpec) -> float:
    """Seconds the link needs for all of a run's syncs (one direction; both directions run in parallel)."""
    syncs = spec.steps if spec.mode == "data-parallel" else spec.steps * spec.fragments / spec.inner_steps
    return syncs * (payload_per_sync(spec) * 8 / (spec.link_mbit * 1e6) + ROUND_TRIPS * place_rtt_ms(spec.place) / 1e3)


def dp_steps(args: argparse.Namespace, rate: float, peers: int, codec: str, place: str = "") -> int:
    """Data-parallel syncs every step: bound its steps so that it needs about ``--dp-budget`` s of link."""
    probe = RunSpec("data-parallel", "data-parallel", codec, 1, 0, args.inner_steps, 1, rate, peers, place=place)
    per_step = expected_network_s(probe) + args.step_time_guess
    return int(max(args.dp_min_steps, min(args.steps * args.longer, args.dp_budget // per_step)))


def plan(args: argparse.Namespace) -> list[RunSpec]:
    """Every run of the benchmark, in execution order (rate by rate)."""
    specs = []
    for place in args.places:
        peers = len(place_regions(place).names) if place and not place.startswith("rtt") else args.peers
        for rate in args.rates:
            for label in args.modes:
                mode, frags, tau = MODES[label]
                fragments = args.fragments if frags == "P" else frags
                codecs = args.codecs_for.get(label, args.codecs)
                for codec in codecs:
                    steps = dp_steps(args, rate, peers, codec, place) if label == "data-parallel" else args.steps
                    if label != "data-parallel" and (label, codec) != ttl.REFERENCE:
                        steps = int(steps * args.longer)  # room to reach the reference's final loss
                    specs.append(RunSpec(label, mode, codec, fragments, tau, args.inner_steps, steps, rate, peers,
                                         args.eval_every, place))
    if args.baseline:  # no sync at all (H > steps): the traffic that is not ours (DHT, metrics)
        steps = min(args.steps, 20)  # a rate per second is all it measures
        place = args.places[0]
        peers = len(place_regions(place).names) if place and not place.startswith("rtt") else args.peers
        specs.insert(0, RunSpec("idle", "blocking", "fp32", 1, 0, steps + 1, steps, args.rates[0], peers, place=place))
    return specs


# ---------------------------------------------------------------------------------------- one run


def peer_flags(topo: netns.Topology, spec: RunSpec, rank: int, run_id: str, workdir: Path,
               matchmaking_s: float, wait: bool = True, prematch_steps: "int | str" = "auto") -> list[str]:
    """The ``peer`` flags of peer ``rank`` of ``spec`` (``PeerProcesses.peer`` adds the initial
    peers and the metrics file ``workdir/peer-RANK.jsonl``). ``wait``: the peers, started together,
    wait for each other before their first step (``--wait-for-peers``). ``prematch_steps``: groups
    formed that many inner steps ahead of their rounds (``--prematch-steps``)."""
    flags = ["--run-id", run_id, "--host-maddrs", f"/ip4/{topo.ip(f'p{rank}')}/tcp/0", "--shard", f"{rank}/{spec.peers}",
             "--no-join", "--no-progress", "--mode", spec.mode, "--fragments", str(spec.fragments),
             "--inner-steps", str(spec.inner_steps), "--codec", spec.codec, "--steps", str(spec.steps),
             "--model", "tiny", "--target-group-size", str(spec.peers), "--link-mbit", f"{spec.link_mbit:g}",
             "--threads", "1", "--wait-for-peers", str(spec.peers if wait else 1),
             "--prematch-steps", str(prematch_steps if spec.mode != "data-parallel" else 0),
             # the final checkpoint waits for the rounds still in flight (eager, tau) and stores their byte
             # counts: how our accounting covers every round that went on the wire (see tail_rounds)
             "--checkpoint-dir", str(workdir / f"ckpt-{rank}"), "--matchmaking-time", f"{matchmaking_s:g}"]
    if spec.mode == "overlap":
        flags += ["--overlap-steps", str(spec.overlap_steps)]
    if spec.eval_every:
        flags += ["--eval-every", str(spec.eval_every)]
    return flags


@dataclass
class Watch:
    """What watching a run's peers until they exit (or its deadline) saw: its status, the widest
    gap in steps between peers, and the interface counters over time (for windowed analysis)."""

    status: str = "ok"
    error: Optional[str] = None
    max_lag: int = 0
    series: list[dict[str, Any]] = field(default_factory=list)


def watch(run: PeerProcesses, peers: list[subprocess.Popen], topo: netns.Topology, nodes: list[str],
          t0: float, timeout: float, bar: Any) -> Watch:
    """Poll the peers' metrics and the interface counters every 0.5 s until every peer exited
    or ``timeout`` s after ``t0`` passed; a peer that exited non-zero fails the run."""
    seen = Watch()
    while any(p.poll() is None for p in peers):
        if time.monotonic() > t0 + timeout:
            seen.status, seen.error = "timeout", f"not finished after {timeout:.0f} s"
            break
        done = [sum(1 for rec in run.records(f"peer-{r}") if rec.get("event") == "step") for r in range(len(peers))]
        bar.update(sum(done) - bar.n)
        if min(done) > 0:
            seen.max_lag = max(seen.max_lag, max(done) - min(done))
        seen.series.append({"t": round(time.monotonic() - t0, 3), "steps": done, **{n: topo.counters(n) for n in nodes}})
        time.sleep(0.5)
    failed = [r for r, p in enumerate(peers) if p.poll() not in (None, 0)]
    if seen.status == "ok" and failed:
        seen.status = "failed"
        seen.error = f"peer {failed[0]} exited {peers[failed[0]].returncode}: " + \
            (run.workdir / f"peer-{failed[0]}.log").read_text()[-600:].strip().replace("\n", " | ")
    return seen


def run_one(topo: netns.Topology, spec: RunSpec, workdir: Path, timeout: float, progress: bool,
            other_bps: float = 0.0, matchmaking_s: float = 10.0, pin: Optional[list[int]] = None,
            wait: bool = True, prematch_steps: "int | str" = "auto") -> dict[str, Any]:
    """Run ``spec`` on ``topo`` (already shaped); return its record (status ok / timeout / failed).

    Processes start and stop through :class:`benchmarks.harness.peers.PeerProcesses`: SIGTERM
    (peers stop at a safe point), ``GRACE_S``, then whatever is left in the namespaces is killed.
    ``pin``: CPUs to pin the peers to, round-robin (peer r and every process it starts on one CPU).
    """
    from tqdm import tqdm

    run_id = f"wan{os.getpid()}_{int(time.time() * 1000) % 10**9}"
    nodes = ["boot", *(f"p{r}" for r in range(spec.peers))]  # the bootstrap's counters show how much is DHT
    load_before = os.getloadavg()[0]
    bar = tqdm(total=spec.steps * spec.peers, desc=spec.name, unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, leave=False)
    try:
        with PeerProcesses(workdir, grace=GRACE_S, topology=topo) as run:
            run.bootstrap(run_id, node="boot")
            before, t0 = {n: topo.counters(n) for n in nodes}, time.monotonic()
            # taskset: the peer's DHT and p2pd inherit its CPU
            peers = [run.peer(f"peer-{r}", *peer_flags(topo, spec, r, run_id, workdir, matchmaking_s, wait,
                                                            prematch_steps), node=f"p{r}",
                              prefix=["taskset", "-c", str(pin[r % len(pin)])] if pin else ())
                     for r in range(spec.peers)]
            seen = watch(run, peers, topo, nodes, t0, timeout, bar)
    except RuntimeError as e:  # the bootstrap did not come up
        seen = Watch(status="failed", error=str(e))
        before, t0 = {n: topo.counters(n) for n in nodes}, time.monotonic()
    finally:
        bar.close()
    after = {n: topo.counters(n) for n in nodes}
    iface = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in nodes}
    (workdir / "counters.json").write_text(json.dumps({"before": before, "after": after, "series": seen.series}))
    metrics = [read_metrics(workdir / f"peer-{r}.jsonl") for r in range(spec.peers)]
    rec = make_record(spec, metrics, iface, seen.status, seen.error, time.monotonic() - t0, workdir, other_bps)
    # a loaded machine slows compute unevenly: the peers drift apart (eager never re-aligns them)
    started = [next((x["t"] for x in seen.series if x["steps"][r] > 0), None) for r in range(spec.peers)]
    rec["start_skew_s"] = max(started) - min(started) if None not in started else None  # 0.5 s resolution
    rec.update(max_step_lag=seen.max_lag, loadavg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
               boot_iface=iface["boot"], matchmaking_s=matchmaking_s, pinned_cpus=pin, wait_for_peers=wait,
               prematch_steps=prematch_steps,
               # what each peer's --prematch-steps came to at the end ("auto" follows the measured RTT)
               prematch_chosen=[next((m.get("prematch") for m in reversed(ms) if m.get("event") == "summary"), None)
                                for ms in metrics])
    return rec


def make_record(spec: RunSpec, metrics: list[list[dict]], iface: dict[str, dict[str, int]], status: str,
                error: Optional[str], elapsed: float, workdir: Path, other_bps: float = 0.0) -> dict[str, Any]:
    """The JSON record of one run from each peer's metrics and interface counter deltas."""
    rec: dict[str, Any] = {"mode": spec.label, "trainer_mode": spec.mode, "codec": spec.codec,
                           "fragments": spec.fragments, "link_mbit": spec.link_mbit, "peers": spec.peers,
                           "steps": spec.steps, "inner_steps": spec.inner_steps, "overlap_steps": spec.overlap_steps,
                           "status": status, "error": error, "elapsed_s": round(elapsed, 1), "workdir": str(workdir),
                           "place": spec.place, "rtt_ms": place_rtt_ms(spec.place)}
    per_peer = [wr.peer_figures(recs, spec.mode, iface.get(f"p{r}", {}), wr.tail_rounds(workdir / f"ckpt-{r}"),
                                other_bps, elapsed) for r, recs in enumerate(metrics)]
    for p, recs in zip(per_peer, metrics):
        p.update(wr.distance_figures(recs, spec.peers))
    rec.update(wr.aggregate(per_peer))
    rec.update(wr.aggregate_distance(per_peer))
    rec["eval_curve"] = ttl.curve(metrics)
    rec["per_peer"] = per_peer
    return rec


# ---------------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    """The bench's flags (``parse_args`` derives the settings that depend on several of them)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Needs root and `ip netns` (exits 0 with the reason otherwise).")
    p.add_argument("--quick", action="store_true", help="one link rate (5 Mbit/s), fp32 for every mode + eager fp4")
    p.add_argument("--time-to-loss", action="store_true",
                   help="wall time to reach streaming fp32's final eval loss: data-parallel, DiLoCo, streaming fp32, "
                        "eager fp4-e3m0 and topk-int2, evaluating every --eval-every steps, all with the same "
                        "steps and schedule (data-parallel: fewer if its link budget says so)")
    p.add_argument("--eval-every", type=int, help="peers evaluate every N steps (default 0, --time-to-loss 10)")
    p.add_argument("--longer", type=float, help="steps of the runs other than the reference (streaming fp32), as "
                   "a multiple of --steps, and data-parallel's link budget (default 1: every run the same schedule)")
    p.add_argument("--rates", help="link rates in Mbit/s, comma-separated (default 5,20,100)")
    p.add_argument("--modes", help=f"subset of {','.join(MODES)} (default: all)")
    p.add_argument("--codecs", help="codecs of the streaming modes (default fp32,fp16,int8,fp4-e3m0)")
    p.add_argument("--dp-codecs", default="fp32", help="codecs of data-parallel (default fp32)")
    p.add_argument("--peers", type=int, default=2, help="peers (default 2)")
    p.add_argument("--steps", type=int, help="inner steps per run (default 100, --quick 40)")
    p.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    p.add_argument("--fragments", type=int, default=2, help="P of the streaming modes (default 2; tiny has 4 blocks)")
    p.add_argument("--dp-budget", type=float, help="data-parallel runs get about this many seconds of link "
                   "time (default 60, --quick 30, --time-to-loss 150)")
    p.add_argument("--matchmaking-time", type=float, default=10.0,
                   help="peers' matchmaking_time (default 10 s, the trainer's is 5 s: peers start seconds apart "
                        "on a loaded machine and eager peers drift)")
    p.add_argument("--dp-min-steps", type=int, default=5)
    p.add_argument("--step-time-guess", type=float, default=0.35, help="s per inner step for the time bounds")
    p.add_argument("--run-timeout", type=float, help="seconds per run (default: derived from the expected traffic)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin peer r (and its helper processes) to CPU r mod #CPUs")
    p.add_argument("--prematch-steps", default="auto",
                   help="the peers' --prematch-steps: each round's group forms this many inner steps ahead, or "
                        "'auto' (default, the trainer's: sized from the measured RTT); data-parallel always 0")
    p.add_argument("--keep-window", action="store_true",
                   help="sysctl net.ipv4.tcp_slow_start_after_idle=0 in every namespace (what doctor advises): "
                        "kept-open connections keep their window between rounds")
    p.add_argument("--congestion-control", metavar="NAME",
                   help="sysctl net.ipv4.tcp_congestion_control=NAME in every namespace, one of "
                        "net.ipv4.tcp_allowed_congestion_control (a namespace may set no other): e.g. reno, whose "
                        "window restarts after idle as cubic's (most distributions' default) does; BBR's never "
                        "does, whatever --keep-window says")
    p.add_argument("--no-wait", dest="wait", action="store_false",
                   help="peers do not wait for each other before their first step (no --wait-for-peers: whichever "
                        "starts up first trains ahead, as every run before that flag did)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the no-sync run that measures traffic other than syncs")
    p.add_argument("--out", help="write the JSON list of runs here (updated after every run)")
    p.add_argument("--report", help="also write the markdown report here (table, ratio, simulator)")
    p.add_argument("--plots", help="write PNG plots with this path prefix, e.g. docs/img/wan")
    p.add_argument("--workdir", help="metrics and logs of each run (default: a temporary folder)")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces/processes left by earlier runs and exit")
    p.add_argument("--plan", action="store_true", help="print the runs (one JSON object each, with the peer "
                   "flags of peer 0) and exit: no root needed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--rtt-ms", help="RTTs between 2 regions, ms, comma-separated: one topology each (default: "
                   "none, one bridge)")
    p.add_argument("--regions", help="also one peer per region of this preset (us/eu/asia: RTTs us-eu 75, "
                   "us-asia 230, eu-asia 160 ms)")
    p.add_argument("--loss", type=float, default=0.0, help="loss on every link between regions, a fraction")
    p.add_argument("--jitter", type=float, default=0.0, help="jitter on every link between regions, +- ms each way")
    p.add_argument("--distance", action="store_true",
                   help="the RTT grid's modes: blocking (streaming fp32), overlap (tau=1, fp32), eager fp4-e3m0, "
                        "DiLoCo, data-parallel; evaluations every --eval-every steps (time to blocking's loss)")
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    if args.regions and args.regions not in PRESETS:
        p.error(f"--regions: unknown preset {args.regions!r}; use one of {', '.join(PRESETS)}")
    args.places = [f"rtt{float(x):g}" if float(x) > 0 else "" for x in args.rtt_ms.split(",")] if args.rtt_ms else []
    args.places += [args.regions] if args.regions else []
    args.places = args.places or [""]
    if args.distance:
        args.modes = args.modes or ",".join(MODES)
        args.codecs = args.codecs or "fp32,fp4-e3m0"
        args.eval_every = 10 if args.eval_every is None else args.eval_every
    if args.time_to_loss:
        args.modes = args.modes or "data-parallel,diloco,streaming,streaming-eager"
        args.codecs = args.codecs or "fp32,fp4-e3m0,topk-int2"
    args.eval_every = args.eval_every if args.eval_every is not None else (10 if args.time_to_loss else 0)
    args.longer = args.longer or 1.0
    args.rates = [float(x) for x in (args.rates or ("5" if args.quick else "5,20,100")).split(",")]
    args.modes = (args.modes or ",".join(MODES)).split(",")
    args.codecs = (args.codecs or ("fp32,fp4-e3m0" if args.quick else "fp32,fp16,int8,fp4-e3m0")).split(",")
    args.dp_codecs = args.dp_codecs.split(",")
    args.steps = args.steps or (40 if args.quick else 100)
    # --time-to-loss: data-parallel gets the time to show where its curve goes (100 steps from 20 Mbit/s)
    args.dp_budget = (args.dp_budget or (30.0 if args.quick else 150.0 if args.time_to_loss else 60.0)) * args.longer
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; use some of {', '.join(MODES)}")
    for c in args.codecs + args.dp_codecs:
        if c not in CODEC_BITS and c not in SPARSE:
            p.error(f"--codecs: unknown codec {c!r}; use some of {', '.join([*CODEC_BITS, *SPARSE])}")
    # DiLoCo is the fp32 reference; --quick: fp32 for every mode plus the headline, eager fp4
    args.codecs_for = {"data-parallel": args.dp_codecs, "diloco": ["fp32"]}
    if args.quick:
        args.codecs_for.update({"streaming": ["fp32"], "streaming-tau1": ["fp32"]})
    if args.time_to_loss:  # the reference, and eager at the two codecs a slow link would use
        args.codecs_for.update({"streaming": ["fp32"], "streaming-eager": [c for c in args.codecs if c != "fp32"]})
    if args.distance:  # the grid: blocking and overlap fp32 (the reference), eager fp4
        args.codecs_for.update({"streaming": ["fp32"], "streaming-tau1": ["fp32"],
                                "streaming-eager": [c for c in args.codecs if c != "fp32"] or ["fp4-e3m0"]})
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.plan:
        for spec in plan(args):
            flags = peer_flags(netns.Topology(peers=spec.peers), spec, 0, "RUN", Path("WORKDIR"), args.matchmaking_time)
            print(json.dumps({**vars(spec), "name": spec.name, "peer_flags": flags}))
        return 0
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"wan.py: WAN emulation unavailable here, nothing measured: {reason}", file=sys.stderr)
        return 0
    if args.cleanup:
        removed = netns.cleanup_leftovers(include_live=True)
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '(none)'}")
        return 0
    stale = netns.cleanup_leftovers()
    if stale:
        print(f"removed {len(stale)} namespaces left by earlier runs", file=sys.stderr)
    specs = plan(args)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="ods-wan-"))
    env = {**environment(), "command": command_line(argv, "benchmarks.wan")}
    print(f"{len(specs)} runs, {args.peers} peers, rates {args.rates} Mbit/s; metrics and logs in {root}",
          file=sys.stderr)
    records: list[dict[str, Any]] = []
    other_bps = 0.0
    # one CPU per peer, like one machine per peer: unpinned, a peer waiting in matchmaking (whose DHT
    # polling costs CPU) slows the others down, and under eager the gap between peers then feeds itself
    pin = sorted(os.sched_getaffinity(0)) if args.pin and shutil.which("taskset") else None
    for place in args.places:
        at = [s for s in specs if s.place == place]
        regions = place_regions(place, args.loss, args.jitter) if place else None
        with netns.Topology(peers=at[0].peers, regions=regions) as topo:
            tune_tcp(topo, args.keep_window, args.congestion_control)
            if place:
                print(f"{place}: {topo.regions.describe()}; peers in "
                      f"{', '.join(f'{n} {topo.region_of(n)}' for n in topo.peers())}", file=sys.stderr)
            for rate in args.rates:
                other_bps = run_rate(args, topo, [s for s in at if s.link_mbit == rate], rate, root, env, records,
                                     other_bps, pin, argv)
    if args.places != [""]:
        wan_rtt.finish(records, args.report, args.plots)
    else:
        wan_report.finish(records, args.report, args.plots)
    return 0


def tune_tcp(topo: netns.Topology, keep_window: bool, congestion_control: Optional[str]) -> None:
    """The TCP settings a run asks for, in every namespace (``--keep-window``, ``--congestion-control``)."""
    settings = ([f"net.ipv4.tcp_congestion_control={congestion_control}"] if congestion_control else []) + \
        (["net.ipv4.tcp_slow_start_after_idle=0"] if keep_window else [])
    for node in topo.nodes if settings else ():
        subprocess.run(topo.exec_argv(node, ["sysctl", "-qw", *settings]), check=True)


def netns_congestion_control(topo: netns.Topology) -> Optional[str]:
    """The congestion control the peers' connections use (peer 0's namespace; recorded with each run)."""
    out = subprocess.run(topo.exec_argv("p0", ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]),
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def run_rate(args: argparse.Namespace, topo: netns.Topology, specs: list[RunSpec], rate: float, root: Path,
             env: dict, records: list[dict[str, Any]], other_bps: float, pin: Optional[list[int]],
             argv: Optional[list[str]]) -> float:
    """Shape ``topo`` to ``rate``, run ``specs`` on it, append their records (and write ``--out``
    after each); return the traffic rate that is not ours (measured by the idle run, if any)."""
    topo.shape(rate)
    probe = netns.measure_throughput(topo, "p0", "p1" if len(topo.peers()) > 1 else "boot", 1_000_000)
    print(f"link {rate:g} Mbit/s: measured {probe['mbit_s']:.2f} Mbit/s (1 MB over TCP, p0 -> p1)", file=sys.stderr)
    for spec in specs:
        timeout = args.run_timeout or 120 + 3 * (expected_network_s(spec) + spec.steps * args.step_time_guess)
        rec = run_one(topo, spec, root / spec.name, timeout, not args.no_progress, other_bps,
                      args.matchmaking_time, pin, args.wait, args.prematch_steps)
        if spec.label == "idle" and rec["status"] == "ok":
            # TCP payload a peer sends when it never syncs (DHT upkeep, metrics), per second of run
            other_bps = wr.mean([p["iface"]["tcp_payload_bytes"] for p in rec["per_peer"]]) / rec["elapsed_s"]
            rec["other_traffic_bytes_per_s"] = other_bps
        rec.update(link_measured_mbit=round(probe["mbit_s"], 3), environment=env, keep_window=args.keep_window,
                   congestion_control=args.congestion_control or netns_congestion_control(topo),
                   regions=topo.regions.describe() if topo.delayed else None, loss=args.loss, jitter_ms=args.jitter)
        records.append(rec)
        print(wan_report.one_line(rec), file=sys.stderr, flush=True)
        if args.out:
            # after every run: an interrupted benchmark keeps its runs
            write_result(args.out, settings=vars(args), rows=records, argv=argv, benchmark="wan",
                         environment_info=env, command=env["command"])
    return other_bps


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: namespaces and processes removed", file=sys.stderr)
        sys.exit(130)
    except SystemExit as e:
        if e.code == 128 + 15:  # SIGTERM, raised by netns.Topology's handler after the teardown
            print("terminated: namespaces and processes removed", file=sys.stderr)
        raise
