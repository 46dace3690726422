"""Learning quality at equal tokens: synchronization modes and wire codecs, side by side.

Every run trains the tiny Llama on the built-in corpus with M workers as threads over the
in-process ``LocalSwarm`` (cheap and deterministic: the same seed gives the same numbers), through
the package's own ``train_worker`` loop, so what is measured is exactly what ``opendiloco-stream
local`` runs. All runs see the same tokens: same steps x batch x workers, same data order per seed.

Three groups of runs (defaults otherwise: outer SGD lr 0.7, Nesterov momentum 0.9, AdamW 4e-4):

* modes (fp32 on the wire, ``mode_seeds``): ``data-parallel`` (gradients averaged every inner
  step: the upper bound), ``diloco`` (blocking, P = 1), ``streaming`` (blocking, P fragments),
  ``streaming-tau1`` (overlap mode, tau = 1, alpha = 0.5), ``eager`` and ``naive-delayed``
  (one-outer-step overlap).
* codecs under ``eager`` (the package default, ``codec_seeds``): fp32 (the ``eager`` run), fp16,
  int8, fp4-e3m0, fp4-e2m1, each lossy one with and without error feedback (EF on fp32 is a no-op);
  and the two 4-bit codecs under blocking ``streaming``, where the outer step is not delayed.
* outer-optimizer checks (``codec_seeds``): ``streaming``, ``eager`` and ``naive-delayed`` again
  with outer lr 0.4 (the Streaming DiLoCo paper's value) and with outer momentum 0, to see what
  the gap between them comes from. Diagnostics, not tuning: the other groups use the defaults.

Usage (from the repository root)::

    python -m benchmarks.quality --preset full       # the numbers in docs/benchmarks-quality.md
    python -m benchmarks.quality                     # --preset quick: 1 seed, 100 steps
    python -m benchmarks.quality --smoke --out /tmp/q.json --img-dir /tmp   # seconds (tests)
    python -m benchmarks.quality --only eager,naive-delayed --seeds 0,1,2
    python -m benchmarks.quality --preset full --resume   # run only what --out does not hold yet
    python -m benchmarks.quality --preset delays --img-dir docs/img   # modes at link delays D (issue 28)

Prints markdown tables, writes JSON (``--out``, default ``benchmarks/results/quality-<preset>.json``,
rewritten after every run so an interrupted run keeps what it finished) and PNG plots
(``--img-dir``, default ``docs/img``; the smoke preset defaults to the directory of ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.harness.quality_report import OUTER_CHECKS, OUTER_MODES, report
from benchmarks.harness.results import IMG_DIR, RESULTS_DIR, command_line, environment, read_result, write_payload

from opendiloco_stream.algorithm.fragments import fragment_offsets, syncs_at
from opendiloco_stream.config import RunConfig, load_config


@dataclass(frozen=True)
class Preset:
    """Run sizes; ``mode_seeds`` for the mode comparison, ``codec_seeds`` for the codec grid."""

    workers: int
    steps: int
    seq_len: int
    batch_size: int
    inner_steps: int
    fragments: int
    eval_every: int
    warmup_steps: int
    max_val_batches: int
    mode_seeds: tuple[int, ...]
    codec_seeds: tuple[int, ...]
    model: str = "tiny"
    #: which variant groups run: "mode", "codec", "outer"; "eager" is the mode comparison plus the
    #: eager rule's checks (the 'paper' reading, fp4-e3m0) in one table; "scale" a short list for
    #: a larger model; "delay" the modes at link delays (``link_delays``)
    groups: tuple[str, ...] = ("mode", "codec", "outer")
    #: "delay" group: the inner steps after its launch at which a round lands (LocalSwarm's link model)
    link_delays: tuple[int, ...] = ()


PRESETS: dict[str, Preset] = {
    "smoke": Preset(workers=2, steps=8, seq_len=32, batch_size=2, inner_steps=4, fragments=2, eval_every=4,
                    warmup_steps=2, max_val_batches=1, mode_seeds=(0,), codec_seeds=(0,)),
    "quick": Preset(workers=4, steps=100, seq_len=64, batch_size=8, inner_steps=25, fragments=2, eval_every=25,
                    warmup_steps=20, max_val_batches=8, mode_seeds=(0,), codec_seeds=(0,)),
    "full": Preset(workers=4, steps=200, seq_len=64, batch_size=8, inner_steps=25, fragments=2, eval_every=25,
                   warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0,)),
    # the eager issue's bar: exactly `local`'s defaults (seq 128, batch 8) at 400 steps, 4 workers, 2 seeds
    "eager": Preset(workers=4, steps=400, seq_len=128, batch_size=8, inner_steps=25, fragments=2, eval_every=50,
                    warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0, 1), groups=("eager",)),
    # the same comparison one model size up (~4.9 M parameters), shorter so it fits a CPU
    "eager-small": Preset(workers=4, steps=200, seq_len=64, batch_size=8, inner_steps=25, fragments=2,
                          eval_every=50, warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0, 1),
                          model="small", groups=("scale",)),
    # sparse codecs (issue 12): fp32, fp4-e3m0 and topk-int2 at 1/2/5 %, blocking and eager, the
    # `local` defaults at 400 steps (the bar), 2 seeds. 24 runs of ~5-7 min on 2 cores:
    # pass --img-dir so that the plots do not replace the other presets' in docs/img.
    "sparse": Preset(workers=4, steps=400, seq_len=128, batch_size=8, inner_steps=25, fragments=2, eval_every=50,
                     warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0, 1), groups=("sparse",)),
    # eager at real link delays: each round lands D inner steps after its launch, D/H ~ 0, 1/4, 1/2, 1
    # (D = 26 > H: at the fragment's next sync); blocking, overlap with tau = D (tau < H/P), eager's
    # rules, eager fp4; `local`'s defaults at 400 steps, 2 seeds. Pass --img-dir / --out per preset.
    "delays": Preset(workers=4, steps=400, seq_len=128, batch_size=8, inner_steps=25, fragments=2, eval_every=50,
                     warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0, 1), groups=("delay",),
                     link_delays=(1, 6, 12, 26)),
    "delays-small": Preset(workers=4, steps=200, seq_len=64, batch_size=8, inner_steps=25, fragments=2,
                           eval_every=50, warmup_steps=20, max_val_batches=8, mode_seeds=(0, 1), codec_seeds=(0, 1),
                           model="small", groups=("delay",), link_delays=(1, 6, 12, 26)),
}
SPARSE_DENSITIES = (0.01, 0.02, 0.05)


@dataclass(frozen=True)
class Variant:
    """One configuration to train: ``diloco`` holds DiLoCoConfig overrides on top of the preset."""

    name: str
    group: str  # "mode", "codec" or "outer"
    label: str
    diloco: dict[str, Any] = field(default_factory=dict)
    reference: str = "streaming"  # the variant that "delta" columns subtract
    link_delay: int = 1  # inner steps from a round's launch to its landing (1: an instant link)


LOSSY_CODECS = ("fp16", "int8", "fp4-e3m0", "fp4-e2m1")


def variants(preset: Preset) -> list[Variant]:
    """The mode comparison, the codec grid (fp32 rows: the ``eager`` and ``streaming`` mode runs),
    the outer-optimizer checks."""
    P = preset.fragments
    paper = Variant("eager-paper", "mode", f"eager, 'paper' rule (P={P})", {"mode": "eager", "eager_rule": "paper"})
    next_sync = Variant("eager-next-sync", "mode", f"eager, corrected at the next sync (P={P})",
                        {"mode": "eager", "eager_rule": "corrected", "eager_correction": "next-sync"})
    if "sparse" in preset.groups:
        return sparse_variants(P)
    if "delay" in preset.groups:
        return delay_variants(preset)
    if "scale" in preset.groups:
        return [Variant("streaming", "mode", f"streaming (blocking, P={P})", {"mode": "blocking"}),
                Variant("eager", "mode", f"eager (P={P})", {"mode": "eager"}), next_sync, paper,
                Variant("naive-delayed", "mode", f"naive-delayed (P={P})", {"mode": "naive-delayed"})]
    out = [
        Variant("data-parallel", "mode", "data-parallel (every step)", {"mode": "data-parallel", "num_fragments": 1}),
        Variant("diloco", "mode", "DiLoCo (blocking, P=1)", {"mode": "blocking", "num_fragments": 1}),
        Variant("streaming", "mode", f"streaming (blocking, P={P})", {"mode": "blocking"}),
        Variant("streaming-tau1", "mode", f"streaming tau=1 (P={P})", {"mode": "overlap", "overlap_steps": 1}),
        Variant("eager", "mode", f"eager (P={P})", {"mode": "eager"}),
        Variant("naive-delayed", "mode", f"naive-delayed (P={P})", {"mode": "naive-delayed"}),
    ]
    if "eager" in preset.groups:
        return out + [next_sync, paper,
                      Variant("eager-fp4-e3m0", "mode", f"eager fp4-e3m0 (P={P})", {"mode": "eager", "codec": "fp4-e3m0"})]
    if "codec" not in preset.groups:
        return out
    for codec in LOSSY_CODECS:
        for ef in (False, True):
            out.append(Variant(f"eager-{codec}" + ("-ef" if ef else ""), "codec", f"eager {codec}" + (" + EF" if ef else ""),
                               {"mode": "eager", "codec": codec, "error_feedback": ef}, reference="eager"))
    for codec in ("fp4-e3m0", "fp4-e2m1"):  # the same 4-bit codecs where the outer step is not delayed
        out.append(Variant(f"streaming-{codec}", "codec", f"streaming {codec}", {"mode": "blocking", "codec": codec}))
    for check, (overrides, words) in OUTER_CHECKS.items():
        for mode in OUTER_MODES:
            out.append(Variant(f"{mode}-{check}", "outer", f"{mode} (P={P}), {words}",
                               {"mode": "blocking" if mode == "streaming" else mode, **overrides},
                               reference=f"streaming-{check}"))
    return out


def sparse_variants(P: int) -> list[Variant]:
    """fp32 rows (the references), fp4-e3m0, topk-int2 at each density with error feedback (its
    default), under blocking streaming and eager."""
    out = []
    for mode, ref in (("blocking", "streaming"), ("eager", "eager")):
        words = f"streaming (blocking, P={P})" if mode == "blocking" else f"eager (P={P})"
        out.append(Variant(ref, "mode", words, {"mode": mode}))
        out.append(Variant(f"{ref}-fp4-e3m0", "codec", f"{words} fp4-e3m0", {"mode": mode, "codec": "fp4-e3m0"},
                           reference=ref))
        for density in SPARSE_DENSITIES:
            out.append(Variant(f"{ref}-topk-int2-{100 * density:g}pct-ef", "codec",
                               f"{words} topk-int2 {100 * density:g}% + EF",
                               {"mode": mode, "codec": "topk-int2", "density": density, "error_feedback": None},
                               reference=ref))
        # error feedback as a residual buffer added to the next outer gradient (SparseLoCo's form)
        out.append(Variant(f"{ref}-topk-int2-2pct-ef-buffer", "codec", f"{words} topk-int2 2% + EF (buffer)",
                           {"mode": mode, "codec": "topk-int2", "density": 0.02, "error_feedback": None,
                            "error_feedback_mode": "buffer"}, reference=ref))
    return out


#: the "delay" group's rows: name -> (words, DiLoCoConfig overrides); overlap only where tau < H/P
DELAY_RULES: dict[str, tuple[str, dict[str, Any]]] = {
    "overlap": ("overlap, tau = D", {"mode": "overlap"}),
    "eager-merge": ("eager 'merge'", {"mode": "eager", "eager_rule": "merge"}),
    "eager-overlap": ("eager 'overlap'", {"mode": "eager", "eager_rule": "overlap"}),
    "eager-corrected": ("eager 'corrected'", {"mode": "eager", "eager_rule": "corrected"}),
    "eager-merge-fp4": ("eager 'merge' fp4-e3m0", {"mode": "eager", "eager_rule": "merge", "codec": "fp4-e3m0"}),
}


def delay_variants(preset: Preset) -> list[Variant]:
    """Blocking streaming (no delay matters: it waits), then every rule of DELAY_RULES at each delay."""
    P, H = preset.fragments, preset.inner_steps
    out = [Variant("streaming", "delay", f"streaming (blocking, P={P})", {"mode": "blocking"})]
    for D in preset.link_delays:
        for name, (words, diloco) in DELAY_RULES.items():
            if name == "overlap":
                if D * P >= H:
                    continue
                diloco = {**diloco, "overlap_steps": D}
            out.append(Variant(f"{name}-D{D}", "delay", f"{words}, D={D}", diloco, link_delay=D))
    return out


def make_config(preset: Preset, variant: Variant, seed: int) -> RunConfig:
    """The run's RunConfig; the environment (``ODS_*``) is ignored so results are reproducible."""
    diloco = {"inner_steps": preset.inner_steps, "num_fragments": preset.fragments, "codec": "fp32",
              "error_feedback": False, **variant.diloco}
    return load_config(overrides={
        "diloco": diloco,
        "model": {"name": preset.model, "seq_len": preset.seq_len},
        "data": {"dataset": "builtin", "max_val_batches": preset.max_val_batches},
        "train": {"steps": preset.steps, "batch_size": preset.batch_size, "eval_every": preset.eval_every,
                  "warmup_steps": preset.warmup_steps, "seed": seed, "device": "cpu"},
    }, environ={})


def train_run(cfg: RunConfig, workers: int, data_cache: dict, link_delay: int = 1) -> dict[str, Any]:
    """Train ``workers`` threads over a LocalSwarm whose rounds land ``link_delay`` inner steps
    after their launch; return the summary record and the curves."""
    from opendiloco_stream.commands.local import prepare_data
    from opendiloco_stream.train.loop import summarize, train_worker
    from opendiloco_stream.transport.factory import codec_from_config, local_swarm
    from opendiloco_stream.transport.local import LinkModel

    key = (cfg.model.seq_len, cfg.train.seed)
    if key not in data_cache:
        data_cache[key] = prepare_data(cfg)
    train_source, val, vocab_size = data_cache[key]
    swarm = local_swarm(cfg, workers, LinkModel(delay_steps=link_delay))
    records: list[dict[str, Any]] = []  # list.append is atomic under the GIL: safe from worker threads
    start = time.perf_counter()
    reports = swarm.run(lambda rank: train_worker(rank, workers, cfg, swarm.transport(rank), train_source, val,
                                                  vocab_size, records.append))
    wall = time.perf_counter() - start
    codec = codec_from_config(cfg)
    summary = summarize(cfg, reports, wall, codec.encoded_size)
    summary["bits_per_value"] = codec.bits_per_value(max(1, reports[0].outer_gradient_numel))
    summary["bytes_sent_launched"] = bytes_launched(cfg, records)
    return {"summary": summary, "eval_curve": _mean_by_step(records, "eval", "eval_loss"),
            "train_curve": _mean_by_step(records, "step", "loss")}


def rounds_launched(cfg: RunConfig) -> dict[int, int]:
    """fragment -> rounds it puts on the wire in ``cfg.train.steps`` inner steps (data-parallel: every step)."""
    d, steps = cfg.diloco, cfg.train.steps
    if d.mode == "data-parallel":
        return {0: steps}
    offsets = fragment_offsets(d.inner_steps, d.num_fragments)
    return {p: sum(syncs_at(t, o, d.inner_steps) for t in range(1, steps + 1)) for p, o in enumerate(offsets)}


def bytes_launched(cfg: RunConfig, records: list[dict[str, Any]]) -> int:
    """Bytes all workers put on the wire, rounds still in flight at the end included.

    The summary's ``bytes_sent`` counts a round when its result is consumed, so under eager and
    overlap the last round of each fragment is missing from it; comparing modes needs what was sent.
    A fragment's round always has the same size, so its bytes are taken from any consumed round.
    """
    per_round: dict[tuple[int, int], int] = {}
    for r in records:
        if r.get("event") == "sync" and r.get("ok"):
            per_round[(r["rank"], r["fragment"])] = int(r["bytes_sent"])
    launched = rounds_launched(cfg)
    return sum(b * launched[fragment] for (_, fragment), b in per_round.items())


def _mean_by_step(records: list[dict[str, Any]], event: str, key: str) -> list[list[float]]:
    """[[step, mean over workers], ...] sorted by step."""
    by_step: dict[int, list[float]] = {}
    for r in records:
        if r.get("event") == event:
            by_step.setdefault(int(r["step"]), []).append(float(r[key]))
    return [[s, sum(v) / len(v)] for s, v in sorted(by_step.items())]


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="quick", help="run sizes (default quick)")
    p.add_argument("--smoke", action="store_true", help="same as --preset smoke: seconds, for tests")
    p.add_argument("--only", help="comma-separated variant names (default: all)")
    p.add_argument("--seeds", help="comma-separated seeds for the mode comparison (default: the preset's)")
    p.add_argument("--codec-seeds", help="comma-separated seeds for the codec grid (default: the preset's)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/quality-<preset>.json)")
    p.add_argument("--img-dir", type=Path, help="where the PNGs go (default docs/img)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--render-only", action="store_true",
                   help="no training: rebuild tables and plots from the existing --out JSON")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in --out (same preset) and run only the missing ones")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    return args


def _seeds(text: Optional[str], default: tuple[int, ...]) -> tuple[int, ...]:
    if not text:
        return default
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"seeds must be comma-separated integers, got {text!r}") from None


def _take_previous(previous: dict[str, Any], payload: dict[str, Any], preset: Preset, command: str, *, check: bool,
                   resume: bool) -> Preset:
    """Carry an earlier result's runs, first command and environment into ``payload``; its preset.
    ``check``: refuse (ValueError) a result made with another preset or other seeds."""
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in previous["settings"]["preset"].items()}
    if check and saved != asdict(preset):
        raise ValueError(f"made with other settings ({previous['command']}); resume needs the same preset and "
                         "seeds")
    # keep the first command and add this one: the docs must show every command that ran
    commands = previous.get("commands", [previous["command"]])
    payload["settings"]["preset"] = previous["settings"]["preset"]
    payload.update(rows=previous["rows"], wall_time_s=previous.get("wall_time_s", 0.0),
                   environment=previous["environment"], commit=previous["commit"], command=previous["command"],
                   commands=commands + ([command] if resume and command not in commands else []))
    return Preset(**saved)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    try:
        preset = Preset(**{**asdict(preset), "mode_seeds": _seeds(args.seeds, preset.mode_seeds),
                           "codec_seeds": _seeds(args.codec_seeds, preset.codec_seeds)})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    variant_list = variants(preset)
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {v.name for v in variant_list}
        if unknown:
            print(f"error: unknown variant(s) {', '.join(sorted(unknown))}; choose from "
                  f"{', '.join(v.name for v in variant_list)}", file=sys.stderr)
            return 2
        variant_list = [v for v in variant_list if v.name in wanted]
    out = args.out or RESULTS_DIR / f"quality-{args.preset}.json"
    img_dir = args.img_dir or (out.parent if args.preset == "smoke" else IMG_DIR)
    command = command_line(argv, "benchmarks.quality")
    # workers are threads: split the cores between them as the ``local`` command does
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // preset.workers))

    env = environment()
    payload: dict[str, Any] = {"benchmark": "quality", "command": command, "commit": env.get("git_commit"),
                               "environment": env, "settings": {"preset_name": args.preset, "preset": asdict(preset),
                                                                "variants": [asdict(v) for v in variant_list]},
                               "rows": [], "wall_time_s": 0.0}
    if args.render_only or args.resume:
        if not out.is_file() and args.render_only:
            print(f"error: --render-only needs an existing result file; {out} is missing", file=sys.stderr)
            return 2
        if out.is_file():
            try:
                preset = _take_previous(read_result(out), payload, preset, command, check=not args.render_only,
                                        resume=args.resume)
            except ValueError as e:
                print(f"error: {out}: {e}", file=sys.stderr)
                return 2
        if args.render_only:
            return report(payload, preset, variant_list, out, img_dir, args.no_plots)

    # every seed-0 run first: an interrupted benchmark (JSON is rewritten after every run) then
    # still has the whole mode comparison and codec grid for one seed
    seeds = sorted(set(preset.mode_seeds) | set(preset.codec_seeds))
    done = {(r["variant"], r["seed"]) for r in payload["rows"]}
    jobs = [(v, s) for s in seeds for v in variant_list
            if s in (preset.mode_seeds if v.group == "mode" else preset.codec_seeds) and (v.name, s) not in done]
    data_cache: dict = {}
    started = time.perf_counter() - payload["wall_time_s"]
    for i, (v, seed) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        cfg = make_config(preset, v, seed)
        result = train_run(cfg, preset.workers, data_cache, v.link_delay)
        s = result["summary"]
        payload["rows"].append({"variant": v.name, "group": v.group, "seed": seed, "link_delay": v.link_delay,
                                "config": cfg.diloco.model_dump(mode="json"), **result})
        print(f"[{i}/{len(jobs)}] {v.name} seed {seed}: eval loss {s['eval_loss_initial']:.3f} -> "
              f"{s['eval_loss']:.4f}, outer parameters {s.get('eval_loss_global', float('nan')):.4f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        payload["wall_time_s"] = time.perf_counter() - started
        write_payload(out, payload)  # after every run: an interrupted benchmark keeps what it finished
    return report(payload, preset, variant_list, out, img_dir, args.no_plots)


if __name__ == "__main__":
    sys.exit(main())
