"""``opendiloco-stream simulate``: bandwidth each sync method needs for a compute utilization.

The model is ``opendiloco_stream.commands.simulator`` (assumptions in docs/simulator.md). Two uses:

* Without ``--at-mbit``: for each model (the paper's 1B / 10B / 100B, or ``--params``), method and
  target utilization, the smallest link bandwidth (Gbit/s) that reaches the target.
* With ``--at-mbit 5,20,100``: the predicted utilization of each method at those link rates, e.g.
  for this machine's measured step time:
  ``simulate --params 4.2e6 --layers 4 --step-time 0.05 --inner-steps 20 --fragment-layers 2
  --at-mbit 5,20,100``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Optional

from opendiloco_stream.commands import simulator as sim
from opendiloco_stream.config_cli import UsageError, deprecated_alias

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``simulate`` and its flags."""
    p = sub.add_parser(
        "simulate",
        help="bandwidth needed per sync method for a compute utilization (Streaming DiLoCo's method)",
        description="Simulate compute utilization versus link bandwidth for data-parallel, DiLoCo, "
                    "Streaming DiLoCo (+ overlap, + FP4) and eager updates. Without --params: "
                    "the paper's 1B / 10B / 100B models. Assumptions: docs/simulator.md.",
    )
    # Numbers are parsed in run() so that a bad value is one line, not argparse's usage dump.
    model = p.add_argument_group("model (default: the paper's 1B/24/0.1s, 10B/48/0.8s, 100B/108/4.9s)")
    model.add_argument("--params", metavar="N", help="parameters, e.g. 1e9, 10B, 4.2M")
    model.add_argument("--layers", metavar="L",
                       help="transformer blocks (default: the paper preset matching --params)")
    model.add_argument("--step-time", metavar="S",
                       help="seconds of pure compute per inner step (e.g. measured on this machine);"
                            " default: 6*params*tokens/(MFU*peak)")
    model.add_argument("--tokens-per-step", metavar="T",
                       help="tokens per inner step per worker (default: what the paper's step "
                            "times imply at 60%% MFU and 989 TFLOP/s, interpolated in params)")
    model.add_argument("--mfu", metavar="F", help=f"model FLOPs utilization (default {sim.DEFAULT_MFU})")
    model.add_argument("--peak-tflops", metavar="X",
                       help=f"a worker's peak TFLOP/s (default {sim.DEFAULT_PEAK_TFLOPS:g})")
    algo = p.add_argument_group("method")
    algo.add_argument("--methods", metavar="LIST",
                      help=f"comma-separated subset of: {', '.join(sim.METHODS)} (default: all)")
    algo.add_argument("--inner-steps", metavar="H", default="100", help="H (default 100)")
    algo.add_argument("--fragments", metavar="P",
                      help="fragments per model, as the training commands' flag (at most one per block; "
                      "default: from --fragment-layers)")
    algo.add_argument("--fragment-layers", metavar="K",
                      help="blocks per fragment, P = ceil(layers / K) (default 3; --fragments wins)")
    algo.add_argument("--fragment-pattern", dest="pattern", choices=sim.PATTERNS, default="strided",
                      help="which blocks form a fragment (default strided), as the training commands' flag")
    deprecated_alias(algo, "--pattern", "--fragment-pattern")
    algo.add_argument("--overlap-steps", metavar="TAU", default="1",
                      help="tau: inner steps a streaming-overlap sync may take (default 1)")
    link = p.add_argument_group("link")
    link.add_argument("--bits", metavar="B", default="16",
                      help="bits per value sent at full precision: DP gradients, outer gradients "
                           "(default 16)")
    link.add_argument("--quant-bits", metavar="B", default="4",
                      help="bits per value of the *-fp4 methods (default 4)")
    link.add_argument("--allreduce-factor", metavar="F", default="2",
                      help="link bytes per payload byte: 2 = ring all-reduce among many peers, "
                           "2(M-1)/M for M peers, 1 = the paper's Table 4 (default 2)")
    link.add_argument("--latency-ms", metavar="MS", default="0",
                      help="delay before each all-reduce result arrives; does not occupy "
                           "the link (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--targets", metavar="LIST", default="50,80,90,95,99",
                     help="target utilizations in percent (default 50,80,90,95,99)")
    out.add_argument("--at-mbit", metavar="LIST",
                     help="instead: predicted utilization at these link rates (Mbit/s), e.g. 5,20,100")
    out.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the simulation the flags describe; print a table or JSON."""
    setup = _setup(args)
    models = _models(args)
    methods = _methods(args.methods)
    too_deep = [m for m in models if setup.fragments is None and setup.fragment_layers > m.layers]
    if too_deep:
        raise UsageError(f"--fragment-layers {setup.fragment_layers} exceeds the {too_deep[0].layers}"
                         f" layers of the {too_deep[0].name or _size(too_deep[0].params)} model")
    if args.at_mbit is not None:
        rates = [_positive(v, "--at-mbit") for v in _split(args.at_mbit, "--at-mbit")]
        records = sim.at_rates(models, setup, rates, methods)
        if args.json:
            print(json.dumps([_clean(r) for r in records], indent=1))
        else:
            print(_rates_table(models, setup, methods, rates, records))
        return 0
    targets = []
    for text in _split(args.targets, "--targets"):
        value = _number(text, "--targets")
        if not 0 < value < 100:
            raise UsageError(f"--targets are percentages strictly between 0 and 100, got {text!r}")
        targets.append(value / 100)
    records = sim.sweep(models, setup, methods, targets)
    if args.json:
        print(json.dumps([_clean(r) for r in records], indent=1))
    else:
        print(_targets_table(models, setup, methods, targets, records))
    return 0


def _setup(args: argparse.Namespace) -> sim.Setup:
    tau = _count(args.overlap_steps, "--overlap-steps", minimum=0)
    return sim.Setup(
        inner_steps=_count(args.inner_steps, "--inner-steps"),
        fragment_layers=_count(args.fragment_layers or "3", "--fragment-layers"),
        fragments=_count(args.fragments, "--fragments") if args.fragments is not None else None,
        overlap_steps=tau,
        bits=_positive(args.bits, "--bits"),
        quant_bits=_positive(args.quant_bits, "--quant-bits"),
        allreduce_factor=_positive(args.allreduce_factor, "--allreduce-factor"),
        latency_s=_non_negative(args.latency_ms, "--latency-ms") / 1e3,
        pattern=args.pattern,
    )


def _models(args: argparse.Namespace) -> list[sim.Model]:
    if args.step_time is not None and any(
            v is not None for v in (args.tokens_per_step, args.mfu, args.peak_tflops)):
        raise UsageError("--step-time replaces --tokens-per-step/--mfu/--peak-tflops; give one or the other")
    mfu = sim.DEFAULT_MFU if args.mfu is None else _positive(args.mfu, "--mfu")
    if mfu > 1:
        raise UsageError(f"--mfu is a fraction in (0, 1], got {args.mfu!r}")
    peak = sim.DEFAULT_PEAK_TFLOPS if args.peak_tflops is None else _positive(args.peak_tflops, "--peak-tflops")
    tokens = None if args.tokens_per_step is None else _positive(args.tokens_per_step, "--tokens-per-step")

    def step_time(params: float) -> float:
        t = sim.paper_tokens_per_step(params) if tokens is None else tokens
        return sim.step_time_from_flops(params, t, mfu, peak)

    if args.params is None:
        if args.layers is not None or args.step_time is not None:
            raise UsageError("--layers/--step-time describe one model: add --params N "
                             "(without it the paper's three models are simulated)")
        return [replace(m, step_time_s=step_time(m.params)) for m in sim.PAPER_MODELS]
    params = _positive(args.params, "--params")
    preset = sim.paper_model(params)
    if args.layers is not None:
        layers = _count(args.layers, "--layers")
    elif preset is not None:
        layers = preset.layers
    else:
        raise UsageError(f"--layers is required for --params {args.params} "
                         "(presets without it: 1e9, 1e10, 1e11)")
    seconds = _positive(args.step_time, "--step-time") if args.step_time is not None else step_time(params)
    return [sim.Model(params, layers, seconds, preset.name if preset and args.layers is None else "")]


def _methods(text: Optional[str]) -> list[str]:
    if text is None:
        return list(sim.METHODS)
    names = _split(text, "--methods")
    unknown = [n for n in names if n not in sim.METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r} in --methods; choose from {', '.join(sim.METHODS)}")
    return names


def _split(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"{flag} needs a comma-separated list, got {text!r}")
    return items


def _number(text: str, flag: str) -> float:
    s = text.strip()
    scale = _SUFFIXES.get(s[-1:].lower(), 1.0) if s and not s[-1:].isdigit() else 1.0
    try:
        value = float(s[:-1] if scale != 1.0 else s) * scale
    except ValueError:
        raise UsageError(f"{flag} expects a number (e.g. 1e9, 10B, 4.2M), got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{flag} expects a finite number, got {text!r}")
    return value


def _positive(text: str, flag: str) -> float:
    value = _number(text, flag)
    if value <= 0:
        raise UsageError(f"{flag} must be > 0, got {text!r}")
    return value


def _non_negative(text: str, flag: str) -> float:
    value = _number(text, flag)
    if value < 0:
        raise UsageError(f"{flag} must be >= 0, got {text!r}")
    return value


def _count(text: str, flag: str, minimum: int = 1) -> int:
    value = _number(text, flag)
    if value != int(value) or value < minimum:
        raise UsageError(f"{flag} must be an integer >= {minimum}, got {text!r}")
    return int(value)


def _clean(record: dict) -> dict:
    """JSON-friendly record: whole-number params as integers."""
    out = dict(record)
    if float(out["params"]).is_integer():
        out["params"] = int(out["params"])
    return out


def _size(params: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g}{unit}"
    return f"{params:g}"


def _describe(setup: sim.Setup) -> str:
    split = f"P={setup.fragments}" if setup.fragments is not None else f"{setup.fragment_layers} layers/fragment"
    return (f"H={setup.inner_steps}, {split} ({setup.pattern}), "
            f"tau={setup.overlap_steps}, {setup.bits:g}-bit payloads, fp4 = {setup.quant_bits:g} bits, "
            f"all-reduce moves {setup.allreduce_factor:g} x payload, latency "
            f"{setup.latency_s * 1e3:g} ms")


def _heading(model: sim.Model, setup: sim.Setup) -> str:
    frags = sim.fragments_of(model, setup)
    return (f"{model.name or _size(model.params)} params, {model.layers} layers, "
            f"step {model.step_time_s:.3g} s, P={frags} fragments")


def _gbit(value: Optional[float]) -> str:
    if value is None:
        return "unreachable"
    if value <= sim.MIN_GBIT_S:
        return f"<={sim.MIN_GBIT_S:g}"
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if value >= limit:
            return f"{value:.{digits}f}"
    return f"{value:.3f}"


def _targets_table(models: list[sim.Model], setup: sim.Setup, methods: list[str],
                   targets: list[float], records: list[dict]) -> str:
    lines = ["Link bandwidth (Gbit/s) each method needs to reach a compute utilization",
             f"({_describe(setup)})"]
    width = max(len(m) for m in methods)
    cells = {(r["params"], r["method"], r["target_utilization"]): r["required_gbit_s"] for r in records}
    for model in models:
        lines += ["", _heading(model, setup),
                  f"{'method':<{width}}" + "".join(f"{t * 100:>12g}%" for t in targets)]
        for method in methods:
            row = "".join(f"{_gbit(cells[(model.params, method, t)]):>13}" for t in targets)
            lines.append(f"{method:<{width}}{row}")
    return "\n".join(lines)


def _rates_table(models: list[sim.Model], setup: sim.Setup, methods: list[str],
                 rates: list[float], records: list[dict]) -> str:
    lines = ["Predicted compute utilization at each link rate", f"({_describe(setup)})"]
    width = max(len(m) for m in methods)
    cells = {(r["params"], r["method"], r["link_mbit"]): r["utilization"] for r in records}
    for model in models:
        lines += ["", _heading(model, setup),
                  f"{'method':<{width}}" + "".join(f"{f'{r:g} Mbit/s':>14}" for r in rates)]
        for method in methods:
            row = "".join(f"{cells[(model.params, method, r)] * 100:>13.1f}%" for r in rates)
            lines.append(f"{method:<{width}}{row}")
    return "\n".join(lines)
