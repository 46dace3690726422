"""Compute-utilization simulator in the method of Streaming DiLoCo (arXiv 2501.18512, Table 4).

Python and numpy, no torch: a discrete-event model of one worker's accelerators and its
wide-area link, answering "how much bandwidth does each synchronization method need to keep the
accelerators busy X% of the time?". The assumptions are written out in docs/simulator.md; in short:

* An inner step takes ``step_time_s``: a forward pass (1/3) then a backward pass (2/3), both split
  evenly over the ``layers`` transformer blocks; the parameters are spread evenly over the blocks.
* Every synchronization is an all-reduce, sent block by block as soon as that block's backward is
  done (so it overlaps the rest of the backward pass), in backward order (deepest block first), over
  ONE link shared by everything in flight (first in, first out). Moving ``B`` bytes costs
  ``allreduce_factor * 8 * B / W`` seconds (2.0: ring all-reduce among many peers), plus an optional
  latency that delays the result without occupying the link.
* A block's averaged values are needed by the forward pass of that block at the step where the
  method applies them; the accelerators idle until then. Compute utilization is compute time over
  wall time in the steady state, solved exactly in max-plus algebra (see ``utilization``).

Methods (the names of the CLI and its JSON); a sync launched at step t is needed by step ...

* ``data-parallel``: every step, all blocks (gradients), ``bits``; ... t + 1.
* ``diloco``: every H steps, all blocks, ``bits``; ... t + 1 (blocking).
* ``streaming``: every H steps per fragment, one fragment, ``bits``; ... t + 1 (blocking).
* ``streaming-overlap``: as streaming; ... t + tau + 1.
* ``streaming-overlap-fp4``: as streaming-overlap with ``quant_bits``.
* ``eager-fp4``: as streaming with ``quant_bits``; ... t + H + 1, the fragment's next sync.

Fragments are staggered as in the trainer: fragment p syncs at steps t with
``(t - o_p) mod H == 0``, ``o_p = floor((p+1)*H/P) mod H``.

What a round costs a group of M peers of our transport (``GroupCosts``, ``group_round``,
``group_link``, ``fit_group_costs``) extrapolates rounds measured with 2-16 peers
(``benchmarks/group_scaling.py``) to larger groups, and gives the link figures above for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import numpy as np

METHODS: tuple[str, ...] = (
    "data-parallel",
    "diloco",
    "streaming",
    "streaming-overlap",
    "streaming-overlap-fp4",
    "eager-fp4",
)
PATTERNS: tuple[str, ...] = ("strided", "sequential")
DEFAULT_TARGETS: tuple[float, ...] = (0.50, 0.80, 0.90, 0.95, 0.99)

# Step-time model: 6 * params * tokens FLOPs per inner step (Kaplan et al. 2020) at an MFU.
DEFAULT_MFU = 0.6
# A worker's aggregate peak; only the ratio tokens-per-step / peak matters. 989 TFLOP/s is one
# H100 SXM (dense bf16), so the default tokens per step read as "per H100-equivalent".
DEFAULT_PEAK_TFLOPS = 989.0

# Bandwidth search range and precision, in Gbit/s (1 Gbit = 1e9 bits).
MIN_GBIT_S = 1e-4
MAX_GBIT_S = 1e6
_REL_TOL = 1e-3

# A time is a float when simulating, or a max-plus linear form of the round's initial state
# (a numpy vector) when solving for the steady state; see ``_Round.run``.
Time = Union[float, np.ndarray]
Pending = dict[int, dict[int, Time]]


@dataclass(frozen=True)
class Model:
    """A model as the simulator sees it: size, depth, and pure-compute time of one inner step."""

    params: float
    layers: int
    step_time_s: float
    name: str = ""

    def __post_init__(self) -> None:
        if not (self.params > 0 and math.isfinite(self.params)):
            raise ValueError(f"params must be a positive number, got {self.params}")
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"step time must be a positive number of seconds, got {self.step_time_s}")


# The paper's three simulated models (Table 4): params, blocks, step time at 60% MFU.
PAPER_MODELS: tuple[Model, ...] = (
    Model(1e9, 24, 0.1, "1B"),
    Model(1e10, 48, 0.8, "10B"),
    Model(1e11, 108, 4.9, "100B"),
)


@dataclass(frozen=True)
class Setup:
    """The knobs shared by every method (defaults: the paper's Table 4 setting).

    inner_steps: H, inner steps per outer round. fragment_layers: blocks per fragment (P =
    ceil(layers / fragment_layers)); fragments: P itself for every model (wins over fragment_layers,
    at most one fragment per block), as the training commands' ``--fragments``. overlap_steps: tau, inner steps a streaming-overlap sync may
    take before the result is needed. bits / quant_bits: bits per value on the wire at full
    precision (DP gradients, outer gradients) and for the *-fp4 methods. allreduce_factor: bytes on
    the link per byte of payload (2.0 = ring all-reduce among many peers, 2(M-1)/M for M peers).
    latency_s: added to each block's result, not to link occupancy. backward_fraction: share of a
    step spent in the backward pass. pattern: which blocks form a fragment.
    """

    inner_steps: int = 100
    fragment_layers: int = 3
    fragments: Optional[int] = None
    overlap_steps: int = 1
    bits: float = 16.0
    quant_bits: float = 4.0
    allreduce_factor: float = 2.0
    latency_s: float = 0.0
    backward_fraction: float = 2.0 / 3.0
    pattern: str = "strided"

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"inner steps (H) must be >= 1, got {self.inner_steps}")
        if self.fragment_layers < 1:
            raise ValueError(f"fragment layers must be >= 1, got {self.fragment_layers}")
        if self.fragments is not None and self.fragments < 1:
            raise ValueError(f"fragments (P) must be >= 1, got {self.fragments}")
        if self.overlap_steps < 0:
            raise ValueError(f"overlap steps (tau) must be >= 0, got {self.overlap_steps}")
        for name in ("bits", "quant_bits", "allreduce_factor"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency_s}")
        if not 0 < self.backward_fraction < 1:
            raise ValueError(f"backward fraction must be in (0, 1), got {self.backward_fraction}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {self.pattern!r}")


def fragments_of(model: "Model", setup: Setup) -> int:
    """P for this model: ``setup.fragments`` (at most one per block), else from ``fragment_layers``."""
    if setup.fragments is not None:
        return max(1, min(setup.fragments, model.layers))
    return num_fragments(model.layers, setup.fragment_layers)


def num_fragments(layers: int, fragment_layers: int) -> int:
    """P: how many fragments ``layers`` blocks make with ``fragment_layers`` blocks each (ceil)."""
    return max(1, math.ceil(layers / max(1, min(fragment_layers, layers))))


def fragment_blocks(layers: int, num_frags: int, pattern: str = "strided") -> list[tuple[int, ...]]:
    """Blocks of each fragment, by the trainer's rule (strided: i mod P; sequential: i*P // L)."""
    if pattern == "strided":
        return [tuple(range(p, layers, num_frags)) for p in range(num_frags)]
    if pattern == "sequential":
        return [tuple(i for i in range(layers) if i * num_frags // layers == p) for p in range(num_frags)]
    raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")


def fragment_offsets(inner_steps: int, num_frags: int) -> list[int]:
    """``o_p = floor((p+1)*H/P) mod H``: the trainer's staggered schedule (docs/algorithm.md)."""
    return [((p + 1) * inner_steps // num_frags) % inner_steps for p in range(num_frags)]


@dataclass(frozen=True)
class _Plan:
    """What one method sends and when: the method names reduced to four numbers and a partition."""

    inner_steps: int  # H (1 for data-parallel: every step is a sync)
    fragments: tuple[tuple[int, ...], ...]
    delay_steps: int  # the result of a sync launched at step s is needed by step s + delay + 1
    bits: float


def _plan(method: str, model: Model, setup: Setup) -> _Plan:
    everything = (tuple(range(model.layers)),)
    frags = fragment_blocks(model.layers, fragments_of(model, setup), setup.pattern)
    H, tau = setup.inner_steps, setup.overlap_steps
    plans = {
        "data-parallel": (1, everything, 0, setup.bits),
        "diloco": (H, everything, 0, setup.bits),
        "streaming": (H, frags, 0, setup.bits),
        "streaming-overlap": (H, frags, tau, setup.bits),
        "streaming-overlap-fp4": (H, frags, tau, setup.quant_bits),
        # Eager: round k's average is first used at the fragment's next sync, H steps later.
        "eager-fp4": (H, frags, H, setup.quant_bits),
    }
    if method not in plans:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    h, fragments, delay, bits = plans[method]
    return _Plan(h, tuple(fragments), delay, bits)


@dataclass(frozen=True)
class _Round:
    """One outer round of a method on a model, ready to run: per-block costs and launch steps."""

    inner_steps: int
    layers: int
    fwd_block: float  # seconds of forward per block
    bwd_block: float  # seconds of backward per block
    comm_block: float  # seconds of link time per block's payload
    latency: float
    delay_steps: int
    launches: dict[int, list[int]]  # step in round (1..H) -> blocks, deepest first

    def run(self, clock: Time, link: Time, pending: Pending,
            maximum: Callable[[Time, Time], Time]) -> tuple[Time, Time, Pending]:
        """Advance one round: returns the clock and link at its end and the results still due.

        Only ``+ constant`` and ``maximum`` touch times, so the same code runs on floats and on
        max-plus linear forms (numpy vectors) from which the steady state is solved exactly.
        ``pending`` maps a step (1 = the round's first) to ``{block: when its result arrives}``.
        """
        L = self.layers
        for step in range(1, self.inner_steps + 1):
            waits = pending.pop(step, None)
            if waits:
                # Forward block by block: a block waits for its averaged values, later ones too.
                done = 0
                for block in sorted(waits):
                    clock = maximum(clock + (block - done) * self.fwd_block, waits[block])
                    done = block
                clock = clock + (L - done) * self.fwd_block
            else:
                clock = clock + L * self.fwd_block
            blocks = self.launches.get(step)
            if blocks:
                due = pending.setdefault(step + self.delay_steps + 1, {})
                for block in blocks:
                    # The block's payload joins the link queue when its backward is done.
                    link = maximum(clock + (L - block) * self.bwd_block, link) + self.comm_block
                    arrival = link + self.latency
                    due[block] = maximum(due[block], arrival) if block in due else arrival
            clock = clock + L * self.bwd_block
        return clock, link, {step - self.inner_steps: w for step, w in pending.items()}


def _round(model: Model, setup: Setup, method: str, gbit_s: float) -> _Round:
    if not gbit_s > 0:
        raise ValueError(f"bandwidth must be > 0 Gbit/s, got {gbit_s}")
    plan = _plan(method, model, setup)
    H, L = plan.inner_steps, model.layers
    launches: dict[int, list[int]] = {}
    for frag, offset in zip(plan.fragments, fragment_offsets(H, len(plan.fragments))):
        launches.setdefault(offset or H, []).extend(frag)
    for blocks in launches.values():
        blocks.sort(reverse=True)  # backward order
    block_bits = model.params / L * plan.bits * setup.allreduce_factor
    return _Round(
        inner_steps=H, layers=L,
        fwd_block=model.step_time_s * (1.0 - setup.backward_fraction) / L,
        bwd_block=model.step_time_s * setup.backward_fraction / L,
        comm_block=0.0 if math.isinf(gbit_s) else block_bits / (gbit_s * 1e9),
        latency=setup.latency_s, delay_steps=plan.delay_steps, launches=launches,
    )


def _max_cycle_mean(A: np.ndarray) -> float:
    """Largest mean weight of a cycle of the max-plus matrix ``A`` (Karp's algorithm, with every
    node a start): the growth per iteration of ``x <- A (x) x`` in the long run."""
    n = A.shape[0]
    walks = np.full((n + 1, n), -np.inf)  # walks[k, v]: heaviest k-edge walk ending at v
    walks[0] = 0.0
    for k in range(1, n + 1):
        walks[k] = np.max(A + walks[k - 1][None, :], axis=1)
    final = walks[n]
    ends = np.isfinite(final)
    with np.errstate(invalid="ignore"):
        means = (final[None, ends] - walks[:n, ends]) / (n - np.arange(n))[:, None]
    means[~np.isfinite(walks[:n, ends])] = np.inf  # no k-edge walk: no constraint from k
    return float(np.max(np.min(means, axis=0)))


def utilization(model: Model, setup: Setup, method: str, gbit_s: float) -> float:
    """Steady-state compute utilization (compute time / wall time) at link bandwidth ``gbit_s``.

    Solved exactly: one round maps (clock, link, results due) linearly in max-plus algebra, and
    the long-run time per round is that map's largest cycle mean, so no warm-up guess is needed
    (an eager backlog may take hundreds of rounds to build up near the threshold).
    ``gbit_s`` may be ``math.inf`` (communication then costs only the latency).
    """
    rnd = _round(model, setup, method, gbit_s)
    # Which results cross round boundaries: run a few rounds from idle to reach the fixed key set.
    clock, link, pending = 0.0, 0.0, {}
    for _ in range(rnd.delay_steps // rnd.inner_steps + 2):
        clock, link, pending = rnd.run(clock, link, pending, max)
    keys = [(step, block) for step in sorted(pending) for block in sorted(pending[step])]
    n = 2 + len(keys)
    unit = np.full((n, n), -np.inf)
    np.fill_diagonal(unit, 0.0)
    start: Pending = {}
    for i, (step, block) in enumerate(keys, start=2):
        start.setdefault(step, {})[block] = unit[i]
    clock_f, link_f, pending_f = rnd.run(unit[0], unit[1], start, np.maximum)
    A = np.full((n, n), -np.inf)
    A[0], A[1] = clock_f, link_f
    for i, (step, block) in enumerate(keys, start=2):
        A[i] = pending_f[step][block]
    per_round = _max_cycle_mean(A)
    return min(1.0, rnd.inner_steps * model.step_time_s / per_round)


def simulated_utilization(model: Model, setup: Setup, method: str, gbit_s: float,
                          warmup_rounds: int, rounds: int) -> float:
    """Utilization measured event by event from an idle start: over ``rounds`` outer rounds after
    ``warmup_rounds``. Converges to ``utilization`` as the warm-up grows (a cross-check)."""
    rnd = _round(model, setup, method, gbit_s)
    clock, link, pending = 0.0, 0.0, {}
    begin = 0.0
    for r in range(warmup_rounds + rounds):
        if r == warmup_rounds:
            begin = clock
        clock, link, pending = rnd.run(clock, link, pending, max)
    return min(1.0, rounds * rnd.inner_steps * model.step_time_s / (clock - begin))


def required_bandwidth(model: Model, setup: Setup, method: str, target: float,
                       lo: float = MIN_GBIT_S, hi: float = MAX_GBIT_S) -> Optional[float]:
    """Smallest bandwidth (Gbit/s) reaching ``target`` utilization (0..1), or None if even ``hi``
    does not. Bisection on log(bandwidth), to 0.1%: utilization never decreases with bandwidth.
    Returns ``lo`` when ``lo`` already suffices."""
    if not 0 < target < 1:
        raise ValueError(f"target utilization must be in (0, 1), got {target}")
    if utilization(model, setup, method, hi) < target:
        return None
    if utilization(model, setup, method, lo) >= target:
        return lo
    log_lo, log_hi = math.log(lo), math.log(hi)
    while log_hi - log_lo > _REL_TOL:
        mid = 0.5 * (log_lo + log_hi)
        if utilization(model, setup, method, math.exp(mid)) >= target:
            log_hi = mid
        else:
            log_lo = mid
    return math.exp(log_hi)


def step_time_from_flops(params: float, tokens_per_step: float, mfu: float = DEFAULT_MFU,
                         peak_tflops: float = DEFAULT_PEAK_TFLOPS) -> float:
    """Pure-compute seconds of one inner step: ``6 * params * tokens / (mfu * peak)``."""
    for name, value in (("params", params), ("tokens per step", tokens_per_step),
                        ("peak TFLOP/s", peak_tflops)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")
    return 6.0 * params * tokens_per_step / (mfu * peak_tflops * 1e12)


def paper_tokens_per_step(params: float) -> float:
    """Tokens per inner step that make ``step_time_from_flops`` (60% MFU, 989 TFLOP/s) give the
    paper's step times (0.1 / 0.8 / 4.9 s at 1B / 10B / 100B).

    The three anchors imply different token counts (about 9.9k / 7.9k / 4.8k), so this interpolates
    log(tokens) linearly in log(params) between them and extends the nearest segment outside.
    """
    if not (params > 0 and math.isfinite(params)):
        raise ValueError(f"params must be a positive number, got {params}")
    points = [(math.log(m.params),
               math.log(m.step_time_s * DEFAULT_MFU * DEFAULT_PEAK_TFLOPS * 1e12 / (6.0 * m.params)))
              for m in PAPER_MODELS]
    x = math.log(params)
    (x0, y0), (x1, y1) = points[0], points[1]
    if x > points[1][0]:
        (x0, y0), (x1, y1) = points[1], points[2]
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def paper_model(params: float) -> Optional[Model]:
    """The paper's preset whose size is within 1% of ``params``, if any."""
    for m in PAPER_MODELS:
        if abs(params - m.params) <= 0.01 * m.params:
            return m
    return None


def sweep(models: Sequence[Model], setup: Setup, methods: Sequence[str] = METHODS,
          targets: Sequence[float] = DEFAULT_TARGETS) -> list[dict]:
    """Required bandwidth for every (model, method, target): the records of ``simulate --json``."""
    return [
        {"params": m.params, "layers": m.layers, "step_time_s": m.step_time_s, "method": method,
         "target_utilization": target,
         "required_gbit_s": required_bandwidth(m, setup, method, target)}
        for m in models for method in methods for target in targets
    ]


def at_rates(models: Sequence[Model], setup: Setup, link_mbit: Sequence[float],
             methods: Sequence[str] = METHODS) -> list[dict]:
    """Predicted utilization of every method at each given link rate (Mbit/s)."""
    return [
        {"params": m.params, "layers": m.layers, "step_time_s": m.step_time_s, "method": method,
         "link_mbit": rate, "utilization": utilization(m, setup, method, rate / 1e3)}
        for m in models for method in methods for rate in link_mbit
    ]


# ---------------------------------------------------------------- cost of a round by group size
#
# ``utilization`` sees a sync as ``allreduce_factor * 8 * B / W`` seconds of link plus a latency.
# What follows says what those two numbers are for a group of M peers of our transport, from costs
# measured per peer (``benchmarks/group_scaling.py``), so rounds of 64 or 256 peers can be
# predicted from groups of 2 to 16 (docs/benchmarks.md, "How a round's cost grows with the group").


@dataclass(frozen=True)
class GroupCosts:
    """One peer's costs in an all-reduce round of a group of M peers (butterfly: each peer reduces
    1/M of the fragment), fitted from measured rounds by :func:`fit_group_costs`.

    matchmaking_s: the fixed cost of forming a round's group; matchmaking_s_per_peer: what each
    peer beyond two adds to it (a leader admits M - 1 followers, a peer reads M announcements).
    exchange_s_per_byte: seconds of the exchange phases (contributions, verdicts, results, drain)
    per byte a peer sends: on a real link at least ``8 / link_bps``; on loopback the CPU's cost of
    coding, sealing and moving a byte.
    overhead_bytes_per_peer: bytes a peer sends to each groupmate beyond the payload (headers,
    verdicts, chunk framing).
    reduce_s_per_element: seconds to reduce one element of one contribution (check, weighted sum,
    encode of the mean); a peer reduces M contributions of N / M elements, so N of them per round.
    cpu_s_per_element, cpu_s_per_groupmate: a peer's CPU seconds in a round (all its threads and
    processes), ``cpu_s_per_element * N + cpu_s_per_groupmate * (M - 1)``: the coding of its N
    elements, and what each groupmate adds (connections, messages, matchmaking). Not part of the
    round's time: the CPU a peer must have to spare per round.
    """

    matchmaking_s: float
    matchmaking_s_per_peer: float
    exchange_s_per_byte: float
    overhead_bytes_per_peer: float
    reduce_s_per_element: float
    cpu_s_per_element: float = 0.0
    cpu_s_per_groupmate: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def butterfly_bytes(group_size: int, payload_bytes: float, overhead_bytes_per_peer: float = 0.0) -> float:
    """Bytes one peer sends in a round of ``group_size`` peers: its contribution's (M-1)/M to the
    other reducers, then its part's average (1/M of the payload) to each of the M-1 others, i.e.
    ``2 (M-1)/M`` payloads, plus ``overhead_bytes_per_peer`` per groupmate. It receives as much."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    m = group_size
    return 2.0 * (m - 1) / m * payload_bytes + (m - 1) * overhead_bytes_per_peer


def group_round(costs: GroupCosts, group_size: int, payload_bytes: float, numel: int) -> dict[str, float]:
    """Predicted phases of one peer's round (seconds) and its bytes sent, for a fragment of
    ``numel`` elements encoded as ``payload_bytes``: ``matchmaking``, ``exchange``, ``reduce``,
    their sum ``round``, ``bytes_sent``, and the peer's CPU seconds ``cpu``."""
    sent = butterfly_bytes(group_size, payload_bytes, costs.overhead_bytes_per_peer)
    phases = dict(matchmaking=costs.matchmaking_s + costs.matchmaking_s_per_peer * max(0, group_size - 2),
                  exchange=costs.exchange_s_per_byte * sent,
                  reduce=costs.reduce_s_per_element * numel)
    cpu = costs.cpu_s_per_element * numel + costs.cpu_s_per_groupmate * (group_size - 1)
    return dict(phases, round=sum(phases.values()), bytes_sent=sent, cpu=cpu)


def group_link(costs: GroupCosts, group_size: int, payload_bytes: float, numel: int,
               setup: Setup = Setup()) -> tuple[Setup, float]:
    """The simulator's link for a group: ``(setup, gbit_s)`` such that a fragment of ``numel``
    elements costs, in :func:`utilization`'s model, exactly :func:`group_round`'s round time.

    The payload's bits per value become ``bits`` and ``quant_bits``, the butterfly's bytes over the
    payload ``allreduce_factor``, the exchange cost per byte the bandwidth, and matchmaking plus
    reduce the latency (they delay the result without occupying the link)."""
    predicted = group_round(costs, group_size, payload_bytes, numel)
    bits = 8.0 * payload_bytes / numel
    setup = replace(setup, bits=bits, quant_bits=bits, allreduce_factor=predicted["bytes_sent"] / payload_bytes,
                    latency_s=predicted["matchmaking"] + predicted["reduce"])
    gbit_s = math.inf if costs.exchange_s_per_byte == 0 else 8.0 / costs.exchange_s_per_byte / 1e9
    return setup, gbit_s


def fit_group_costs(samples: Sequence[dict], cores: Optional[int] = None) -> GroupCosts:
    """:class:`GroupCosts` from measured rounds, each sample a dict of ``group_size``, ``numel``,
    ``payload_bytes``, ``bytes_sent``, the phases in seconds ``matchmaking``, ``exchange``,
    ``reduce`` and optionally the peer's CPU seconds ``cpu`` (medians over a size's rounds).

    ``cores``: the machine's cores when all the peers ran on one machine. M peers busy at once
    then get ``cores / M`` of a core each, so a phase measured at M > cores is taken as
    ``cores / M`` of its time to give one peer's cost on a machine of its own (an assumption that
    holds for phases bound by CPU; a phase waiting on others is overstated less). ``None``: as
    measured. CPU seconds are not scaled: waiting for a core costs none.

    Fits: matchmaking by least squares on ``a + b (M - 2)`` and the CPU on ``a + b (M - 1)``
    (:func:`_line`); the overhead bytes per groupmate as the mean excess over
    :func:`butterfly_bytes` (clipped at 0); the exchange cost as the phase's total time over the
    total bytes sent; the reduce cost as the mean of the phase over ``numel``."""
    if not samples:
        raise ValueError("fit_group_costs needs at least one measured size")

    def scale(s: dict) -> float:
        return 1.0 if cores is None else min(1.0, cores / s["group_size"])

    match_fixed, match_slope = _line([s["group_size"] - 2 for s in samples],
                                     [scale(s) * s["matchmaking"] for s in samples])
    with_cpu = [s for s in samples if s.get("cpu") is not None]
    cpu_fixed, cpu_slope = _line([s["group_size"] - 1 for s in with_cpu], [s["cpu"] for s in with_cpu])
    overhead = [(s["bytes_sent"] - butterfly_bytes(s["group_size"], s["payload_bytes"])) / (s["group_size"] - 1)
                for s in samples if s["group_size"] > 1]
    sent = sum(s["bytes_sent"] for s in samples)
    return GroupCosts(
        matchmaking_s=match_fixed, matchmaking_s_per_peer=match_slope,
        exchange_s_per_byte=sum(scale(s) * s["exchange"] for s in samples) / sent if sent > 0 else 0.0,
        overhead_bytes_per_peer=max(0.0, float(np.mean(overhead))) if overhead else 0.0,
        reduce_s_per_element=float(np.mean([scale(s) * s["reduce"] / s["numel"] for s in samples])),
        cpu_s_per_element=cpu_fixed / float(np.mean([s["numel"] for s in with_cpu])) if with_cpu else 0.0,
        cpu_s_per_groupmate=cpu_slope,
    )


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x`` by least squares, with ``b`` clipped at 0 (then ``a`` is the
    mean of ``y - b x``) and ``a`` at 0; one distinct ``x`` gives ``b = 0``, no points ``(0, 0)``."""
    if not len(xs):
        return 0.0, 0.0
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    slope = max(0.0, float(np.polyfit(x, y, 1)[0])) if np.ptp(x) > 0 else 0.0
    return max(0.0, float(np.mean(y - slope * x))), slope
