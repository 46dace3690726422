"""What a link at a distance allows: whether a round of the chosen H, P and codec lands within its
window at a link of that rate and round trip (``--dry-run``, which measures the round trip to the
initial peers with ``net/distance.py``).

A round's wait, as docs/networking.md ("At distance") counts it::

    round_s = transfer_s + rtts * rtt_s
    transfer_s = 2 * (M-1)/M * fragment_bytes * 8 / link_bps       # the butterfly's bytes, M = 2
    rtts = MATCH_RTTS (0 with groups formed ahead: --prematch-steps auto at a distance, or K)
           + EXCHANGE_RTTS + SLOW_START_RTTS (0 with net.ipv4.tcp_slow_start_after_idle = 0, or BBR)

The window a mode gives a round: eager, the fragment's next sync (H inner steps); overlap, tau
inner steps; blocking, none (the whole round stalls training). The compute utilization comes from
the simulator (``simulator.utilization``: the same round as a latency on a link of that rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from opendiloco_stream.commands import simulator

MATCH_RTTS = 5.0  # plan (a DHT lookup), the announcements' read, the join of the leader
EXCHANGE_RTTS = 1.5  # contributions, the verdicts, the results: one way each
SLOW_START_RTTS = 6.0  # a connection idle between rounds starts each way from its initial window
GOOD_UTILIZATION = 0.9


@dataclass(frozen=True)
class RoundFit:
    """A round at a link, predicted: its wait, the window the mode gives it, and what to change."""

    round_s: float
    transfer_s: float
    rtts: float
    window_s: Optional[float]  # None: blocking (no window: the round stalls training)
    utilization: float
    fits: bool
    advice: list[str] = field(default_factory=list)

    def line(self) -> str:
        window = "no window (blocking: training waits)" if self.window_s is None else f"window {self.window_s:.2f} s"
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"a round ~{self.round_s:.2f} s ({self.transfer_s:.2f} s transfer + {self.rtts:g} RTT), {window}: "
                f"{verdict}; compute utilization ~{self.utilization:.0%}")


def round_fit(*, mode: str, inner_steps: int, fragments: int, overlap_steps: int, params: float, layers: int,
              codec_bits: float, step_time_s: float, link_mbit: float, rtt_s: float, prematch: bool,
              slow_start_after_idle: Optional[bool]) -> RoundFit:
    """Predict one fragment's round of a 2-peer group at ``link_mbit`` and ``rtt_s`` (see the module
    docstring); ``advice``: what would make it fit (or reach ``GOOD_UTILIZATION`` when blocking)."""
    if not (link_mbit > 0 and rtt_s >= 0 and step_time_s > 0):
        raise ValueError("link_mbit and step_time_s must be > 0 and rtt_s >= 0")
    fragment_bytes = params / max(1, fragments) * codec_bits / 8
    transfer_s = fragment_bytes * 8 / (link_mbit * 1e6)  # 2 (M-1)/M = 1 payload each way for M = 2
    slow = slow_start_after_idle is not False
    rtts = (0.0 if prematch else MATCH_RTTS) + EXCHANGE_RTTS + (SLOW_START_RTTS if slow else 0.0)
    round_s = transfer_s + rtts * rtt_s
    if mode == "eager":
        window, method = inner_steps * step_time_s, "eager-fp4"
    elif mode == "overlap":
        window, method = overlap_steps * step_time_s, "streaming-overlap"
    else:
        window, method = None, ("diloco" if fragments <= 1 else "streaming")
    model = simulator.Model(params=max(params, 1.0), layers=max(1, layers), step_time_s=step_time_s)
    setup = simulator.Setup(inner_steps=inner_steps, fragments=max(1, fragments),
                           overlap_steps=max(overlap_steps, 0), bits=codec_bits, quant_bits=codec_bits,
                           allreduce_factor=1.0, latency_s=rtts * rtt_s)
    util = simulator.utilization(model, setup, method, link_mbit / 1e3)
    fits = round_s <= window if window is not None else util >= GOOD_UTILIZATION
    advice = [] if fits else _advice(mode, round_s, step_time_s, inner_steps, prematch, slow, rtt_s)
    return RoundFit(round_s, transfer_s, rtts, window, util, fits, advice)


def _advice(mode: str, round_s: float, step_time_s: float, inner_steps: int, prematch: bool, slow: bool,
            rtt_s: float) -> list[str]:
    out = []
    if not prematch:
        out.append(f"--prematch-steps auto, the default, or 2 (forms each group ahead: saves "
                   f"~{MATCH_RTTS * rtt_s:.1f} s a round)")
    if slow:
        out.append(f"sysctl -w net.ipv4.tcp_slow_start_after_idle=0 (or bbr in tcp_allowed_congestion_control) on "
                   f"the peers (saves ~{SLOW_START_RTTS * rtt_s:.1f} s a round: kept-open connections keep their "
                   "window)")
    if mode == "eager":
        need = math.ceil(round_s / step_time_s)
        if need > inner_steps:
            out.append(f"--inner-steps {need} or more (H steps must outlast a round)")
    elif mode == "overlap":
        out.append(f"--tau {math.ceil(round_s / step_time_s)} or --mode eager (the round must land within tau steps)")
    else:
        out.append("--mode eager (the round runs behind H inner steps instead of stalling them)")
    return out
