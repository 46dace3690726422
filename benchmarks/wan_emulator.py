"""The WAN emulator measured: timing error, loss, jitter and ceiling of ``benchmarks/harness/wan_emulator.py``.

    sudo .venv/bin/python -m benchmarks.wan_emulator --out benchmarks/results/wan-emulator.json \\
        --report docs/benchmarks-wan-emulator.md

Two peer namespaces (``p0``, ``p1``) in two regions of a :class:`benchmarks.harness.netns.Topology`:

- **timing**: ICMP echoes (a ping from a raw socket: no ping is installed here) at each ``--rtts``;
  the median round trip against the emulated RTT (2 x one-way delay). The 0 row is the plain bridge.
- **loss / jitter**: UDP datagrams one way through a link with ``--loss``, how many arrive; echoes
  through a link with ``--jitter`` ms, their spread.
- **ceiling** at ``--ceiling-rtt`` (default 300 ms, 150 ms one-way): UDP paced at each of
  ``--udp-rates`` for 2 s; the ceiling is the highest rate at which every datagram arrived and
  the forwarder dropped no frame. Then one TCP bulk stream with ``--tcp-buffer`` byte socket
  buffers (fixed, so the window and not autotuning decides what is in flight), unshaped and
  behind a ``--tcp-shaped`` Mbit/s tbf.

All of it runs beside whatever else loads the machine: the ceiling is the forwarder's (one Python
thread) on this machine at that moment, with the probes on the same CPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.harness import netns
from benchmarks.harness import wan_probes as wp
from benchmarks.harness.results import markdown_table, write_result
from benchmarks.harness.wan_emulator import Regions


def _stats_delta(topo: netns.Topology, measure: Callable[[], dict]) -> dict[str, Any]:
    """``measure()`` and what the forwarder counted meanwhile (frames, drops, lateness)."""
    before = topo.emulator_stats()
    result = measure()
    time.sleep(0.6)  # the forwarder rewrites its stats every 0.5 s
    after = topo.emulator_stats()
    if not before:
        return result
    keys = ("frames_out", "kernel_drops", "send_errors", "lost", "gso_frames", "late_sum_s")
    delta = {k: after[k] - before[k] for k in keys}
    delta["late_mean_ms"] = 1e3 * delta.pop("late_sum_s") / max(1, delta["frames_out"])
    return {**result, "forwarder": delta, "late_max_ms_so_far": after["late_max_ms"]}


def timing(rtts: list[float], count: int) -> list[dict[str, Any]]:
    rows = []
    for rtt in rtts:
        with netns.Topology(peers=2, regions=Regions.pair(rtt)) as topo:
            r = wp.measure_rtt(topo, "p0", "p1", count)
        rows.append({"rtt_ms": rtt, "emulated": topo.delayed, **r, "error_ms": r["median_ms"] - rtt})
        print(f"timing: RTT {rtt:g} ms -> median {r['median_ms']:.2f} ms (p90 {r['p90_ms']:.2f}, "
              f"max {r['max_ms']:.2f})", file=sys.stderr)
    return rows


def loss_and_jitter(loss: float, jitter: float, rtt: float, count: int) -> dict[str, Any]:
    with netns.Topology(peers=2, regions=Regions.pair(rtt, loss=loss)) as topo:
        lossy = _stats_delta(topo, lambda: wp.measure_udp(topo, "p0", "p1", 20.0, 3.0))
    with netns.Topology(peers=2, regions=Regions.pair(rtt, jitter_ms=jitter)) as topo:
        jittered = wp.measure_rtt(topo, "p0", "p1", count)
    print(f"loss {loss:.1%}: {lossy['lost_fraction']:.2%} of {lossy['sent']} datagrams lost; jitter +-{jitter:g} ms: "
          f"RTT median {jittered['median_ms']:.2f}, min {jittered['min_ms']:.2f}, max {jittered['max_ms']:.2f}",
          file=sys.stderr)
    return {"loss": {"set": loss, "rtt_ms": rtt, **lossy}, "jitter": {"set_ms": jitter, "rtt_ms": rtt, **jittered}}


def ceiling(rtt: float, rates: list[float], tcp_bytes: int, tcp_buffer: int, shaped: float) -> dict[str, Any]:
    out: dict[str, Any] = {"rtt_ms": rtt, "udp": [], "tcp": []}
    with netns.Topology(peers=2, regions=Regions.pair(rtt)) as topo:
        for rate in rates:
            r = _stats_delta(topo, lambda: wp.measure_udp(topo, "p0", "p1", rate, 2.0))
            r["clean"] = r["received"] == r["sent"] and r["forwarder"]["kernel_drops"] == 0
            out["udp"].append({"rate_mbit": rate, **r})
            print(f"ceiling: UDP {rate:g} Mbit/s at RTT {rtt:g}: {r['lost_fraction']:.2%} lost, forwarder late "
                  f"{r['forwarder']['late_mean_ms']:.2f} ms on average", file=sys.stderr)
        # what the sender reached, not what it was asked: on a busy machine the probe itself falls short
        clean = [row["offered_mbit_s"] for row in out["udp"] if row["clean"]]
        out["udp_ceiling_mbit"] = round(max(clean), 1) if clean else 0.0
        out["udp_ceiling_is_the_senders"] = all(row["clean"] for row in out["udp"])
        for limit in (None, shaped):
            if limit:
                topo.shape(limit, nodes=["p0", "p1"])
            r = _stats_delta(topo, lambda: wp.measure_tcp(topo, "p0", "p1", tcp_bytes, tcp_buffer))
            out["tcp"].append({"tbf_mbit": limit, "buffer": tcp_buffer, **r})
            print(f"ceiling: TCP at RTT {rtt:g}, tbf {limit or 'none'}: {r['mbit_s']:.1f} Mbit/s "
                  f"(forwarder dropped {r['forwarder']['kernel_drops']} frames)", file=sys.stderr)
    return out


def report(result: dict[str, Any]) -> str:
    """The markdown tables of one run."""
    t = markdown_table(["emulated RTT (ms)", "median (ms)", "error (ms)", "p90 (ms)", "max (ms)", "replies"],
                       [[r["rtt_ms"], f"{r['median_ms']:.2f}", f"{r['error_ms']:+.2f}", f"{r['p90_ms']:.2f}",
                         f"{r['max_ms']:.2f}", f"{r['replies']}/{r['count']}"] for r in result["timing"]])
    c = result["ceiling"]
    u = markdown_table(["UDP offered (Mbit/s)", "received (Mbit/s)", "lost", "frames dropped by the forwarder",
                        "mean lateness (ms)"],
                       [[f"{r['offered_mbit_s']:.0f}", f"{r['received_mbit_s']:.0f}", f"{r['lost_fraction']:.2%}",
                         r["forwarder"]["kernel_drops"], f"{r['forwarder']['late_mean_ms']:.2f}"] for r in c["udp"]])
    tcp = markdown_table(["TCP, socket buffers", "tbf (Mbit/s)", "goodput (Mbit/s)", "frames dropped by the forwarder"],
                         [[f"{r['buffer'] >> 20} MiB", r["tbf_mbit"] or "none", f"{r['mbit_s']:.1f}",
                           r["forwarder"]["kernel_drops"]] for r in c["tcp"]])
    lj = result["loss_and_jitter"]
    return "\n\n".join([
        "Round trips (ICMP echo from a raw socket, kernel receive timestamps; median of the echoes):", t,
        f"Ceiling at RTT {c['rtt_ms']:g} ms ({c['rtt_ms'] / 2:g} ms one-way): "
        f"**{'at least ' if c['udp_ceiling_is_the_senders'] else ''}{c['udp_ceiling_mbit']:g} Mbit/s** without a "
        f"lost frame (UDP, 1400-byte datagrams, 2 s each"
        + ("; no rate lost a frame: the Python sender could not offer more" if c["udp_ceiling_is_the_senders"]
           else "") + ").", u, tcp,
        f"Loss set to {lj['loss']['set']:.1%}: {lj['loss']['lost_fraction']:.2%} of {lj['loss']['sent']} datagrams "
        f"lost. Jitter set to +-{lj['jitter']['set_ms']:g} ms each way at RTT {lj['jitter']['rtt_ms']:g}: echoes "
        f"{lj['jitter']['min_ms']:.1f}-{lj['jitter']['max_ms']:.1f} ms, median {lj['jitter']['median_ms']:.1f}."])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", default="0,80,150,300,600", help="emulated RTTs of the timing rows, ms")
    p.add_argument("--count", type=int, default=40, help="echoes per timing row")
    p.add_argument("--ceiling-rtt", type=float, default=300.0, help="RTT of the ceiling runs, ms")
    p.add_argument("--udp-rates", default="50,100,200,300,400,600", help="UDP rates of the ceiling sweep, Mbit/s")
    p.add_argument("--tcp-bytes", type=int, default=100_000_000)
    p.add_argument("--tcp-buffer", type=int, default=32 << 20, help="TCP socket buffers, bytes (each side)")
    p.add_argument("--tcp-shaped", type=float, default=100.0, help="tbf rate of the shaped TCP run, Mbit/s")
    p.add_argument("--loss", type=float, default=0.05)
    p.add_argument("--jitter", type=float, default=10.0, help="+- ms each way")
    p.add_argument("--out", help="JSON result")
    p.add_argument("--report", help="markdown tables")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"wan_emulator.py: namespaces unavailable here, nothing measured: {reason}", file=sys.stderr)
        return 0
    netns.cleanup_leftovers()
    result = {"timing": timing([float(x) for x in args.rtts.split(",")], args.count),
              "loss_and_jitter": loss_and_jitter(args.loss, args.jitter, 100.0, args.count),
              "ceiling": ceiling(args.ceiling_rtt, [float(x) for x in args.udp_rates.split(",")], args.tcp_bytes,
                                 args.tcp_buffer, args.tcp_shaped)}
    text = report(result)
    print(text)
    if args.out:
        write_result(args.out, settings=vars(args), rows=result["timing"], benchmark="wan_emulator",
                     ceiling=result["ceiling"], loss_and_jitter=result["loss_and_jitter"])
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
