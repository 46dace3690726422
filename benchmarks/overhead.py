"""What the DiLoCo wrapper and the wire codecs cost in compute, with no network in the way.

1. Training-loop throughput (tokens/s) of one worker, three ways, on the same model, data and
   seed:

   * ``plain``: the body of ``train_worker`` (opendiloco_stream/train/loop.py) mirrored here
     without ``StreamingDiLoCo`` (same forward, backward, clip, AdamW, scheduler, per-step record);
   * ``eager-fp4-e3m0`` and ``blocking-fp32``: ``train_worker`` itself, wrapped, over a
     ``LocalSwarm`` of one worker. With one worker the swarm still encodes the outer gradient,
     decodes it, encodes the "average" and decodes it again at every fragment sync, so this is
     the wrapper's real compute cost (outer-gradient math, outer optimizer, copies, codec).

   Variants run interleaved (plain, wrapped, wrapped, plain, ...) so that load from other
   processes hits all of them alike; the first ``warmup`` steps of each run are excluded; the
   table gives the median over repeats. The wrapped runs also report the time spent inside
   ``diloco.step()`` (the per-step ``sync_s`` records) as a share of the loop, a direct measure
   that does not depend on the noise between runs.

2. Codec throughput: encode, decode and encode+decode of a 16M-element fp32 tensor (64 MiB,
   outer-gradient-like values) for every codec, against ``torch.clone()`` and ``Tensor.copy_`` of
   the same tensor (a plain memory copy). Best of ``repeats`` timings, after one warm-up call.

Usage (from the repository root)::

    python benchmarks/overhead.py --preset full      # the numbers in docs/benchmarks-overhead.md
    python benchmarks/overhead.py --smoke --out /tmp/o.json --img-dir /tmp   # seconds (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

try:
    from benchmarks._common import (IMG_DIR, RESULTS_DIR, command_line, environment, markdown_table, plot_bars,
                                    relative, write_json)
except ImportError:  # run as a script: python benchmarks/overhead.py
    from _common import IMG_DIR, RESULTS_DIR, command_line, environment, markdown_table, plot_bars, relative, write_json

from opendiloco_stream.compression import CODEC_NAMES, get_codec
from opendiloco_stream.config import RunConfig, load_config


@dataclass(frozen=True)
class Preset:
    """Sizes of the loop runs and of the codec tensor."""

    steps: int
    warmup: int
    repeats: int
    seq_len: int
    batch_size: int
    inner_steps: int
    fragments: int
    codec_numel: int
    codec_repeats: int


PRESETS: dict[str, Preset] = {
    "smoke": Preset(steps=8, warmup=2, repeats=1, seq_len=32, batch_size=2, inner_steps=4, fragments=2,
                    codec_numel=1 << 16, codec_repeats=1),
    "quick": Preset(steps=60, warmup=10, repeats=2, seq_len=128, batch_size=8, inner_steps=25, fragments=2,
                    codec_numel=1 << 24, codec_repeats=2),
    "full": Preset(steps=150, warmup=10, repeats=3, seq_len=128, batch_size=8, inner_steps=25, fragments=2,
                   codec_numel=1 << 24, codec_repeats=5),
}

#: loop variants: name -> DiLoCoConfig overrides (None: no wrapper)
LOOP_VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "plain": None,
    "eager-fp4-e3m0": {"mode": "eager", "codec": "fp4-e3m0"},
    "blocking-fp32": {"mode": "blocking", "codec": "fp32"},
}


def make_config(preset: Preset, diloco: Optional[dict[str, Any]]) -> RunConfig:
    return load_config(overrides={
        "diloco": {"inner_steps": preset.inner_steps, "num_fragments": preset.fragments, **(diloco or {})},
        "model": {"name": "tiny", "seq_len": preset.seq_len},
        "data": {"dataset": "builtin", "max_val_batches": 1},
        "train": {"steps": preset.steps, "batch_size": preset.batch_size, "eval_every": 0, "seed": 0,
                  "device": "cpu"},
    }, environ={})


def plain_loop(cfg: RunConfig, train_source, val: torch.Tensor, vocab_size: int,
               emit: Callable[[dict[str, Any]], None], on_step: Callable[[int, float], None]) -> None:
    """``train_worker``'s body for rank 0 of 1 without the wrapper; keep in step with loop.py."""
    from opendiloco_stream.train.loop import evaluate, lr_factor
    from opendiloco_stream.train.models import build_model

    tc, device = cfg.train, cfg.train.device
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len, seed=tc.seed,
                        dtype=dtype).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc.warmup_steps, tc.steps))
    evaluate(model, val, tc.batch_size, cfg.data.max_val_batches, device)
    batches = train_source.batches(0, 1, tc.batch_size)
    for step in range(tc.steps):
        t0 = time.perf_counter()
        batch = next(batches).to(device)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if tc.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        tokens = batch[:, 1:].numel()
        t2 = time.perf_counter()  # where train_worker calls diloco.step()
        loss_value = loss.item()
        emit({"event": "step", "rank": 0, "step": step + 1, "loss": round(loss_value, 5),
              "lr": sched.get_last_lr()[0], "tokens": tokens, "compute_s": round(t1 - t0, 5),
              "sync_s": round(t2 - t1, 5)})
        on_step(0, loss_value)


def time_loop(name: str, preset: Preset, data) -> dict[str, Any]:
    """One run of a loop variant: tokens/s after warm-up, and the time spent in ``diloco.step()``."""
    from opendiloco_stream.train.loop import train_worker
    from opendiloco_stream.transport.local import LocalSwarm

    cfg = make_config(preset, LOOP_VARIANTS[name])
    train_source, val, vocab_size = data
    stamps: list[float] = []
    records: list[dict[str, Any]] = []
    on_step = lambda rank, loss: stamps.append(time.perf_counter())  # noqa: E731
    if LOOP_VARIANTS[name] is None:
        plain_loop(cfg, train_source, val, vocab_size, records.append, on_step)
    else:
        d = cfg.diloco
        swarm = LocalSwarm(num_workers=1, codec=d.codec, block_size=d.codec_block_size,
                           scale_dtype=d.codec_scale_dtype, seed=0, timeout=d.sync_timeout)
        train_worker(0, 1, cfg, swarm.transport(0), train_source, val, vocab_size, records.append, on_step=on_step)
    steps = [r for r in records if r.get("event") == "step"][preset.warmup:]
    timed = len(stamps) - preset.warmup
    loop_s = stamps[-1] - stamps[preset.warmup - 1]
    tokens = sum(r["tokens"] for r in steps)
    return {"variant": name, "timed_steps": timed, "loop_s": loop_s, "tokens": tokens,
            "tokens_per_s": tokens / loop_s, "wrapper_s": sum(r["sync_s"] for r in steps),
            "wrapper_share": sum(r["sync_s"] for r in steps) / loop_s}


def loop_benchmark(preset: Preset, progress: Callable[[str], None]) -> dict[str, Any]:
    from opendiloco_stream.commands.local import prepare_data

    data = prepare_data(make_config(preset, None))
    runs = []
    for rep in range(preset.repeats):
        # alternate the order so that neither variant always runs first after a slow neighbour
        order = list(LOOP_VARIANTS) if rep % 2 == 0 else list(reversed(LOOP_VARIANTS))
        for name in order:
            r = time_loop(name, preset, data)
            r["repeat"] = rep
            runs.append(r)
            progress(f"loop {name} repeat {rep}: {r['tokens_per_s']:,.0f} tokens/s, "
                     f"wrapper {100 * r['wrapper_share']:.2f}% of the loop")
    summary = {}
    plain = [r["tokens_per_s"] for r in runs if r["variant"] == "plain"]
    for name in LOOP_VARIANTS:
        tps = [r["tokens_per_s"] for r in runs if r["variant"] == name]
        # paired: each wrapped run against the plain run of the same repeat
        paired = [100 * (1 - w["tokens_per_s"] / p["tokens_per_s"])
                  for w in runs if w["variant"] == name
                  for p in runs if p["variant"] == "plain" and p["repeat"] == w["repeat"]]
        summary[name] = {
            "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "overhead_pct_vs_median": 100 * (1 - statistics.median(tps) / statistics.median(plain)),
            "overhead_pct_paired_median": statistics.median(paired),
            "wrapper_share_pct_median": 100 * statistics.median(
                [r["wrapper_share"] for r in runs if r["variant"] == name]),
        }
    return {"runs": runs, "summary": summary}


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: allocator, lazy tables
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def codec_benchmark(preset: Preset, progress: Callable[[str], None]) -> dict[str, Any]:
    """GB/s (10^9 bytes of fp32 input per second) of each codec and of a plain memory copy."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(preset.codec_numel, generator=gen) * 1e-3  # outer gradients are small numbers
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    R = preset.codec_repeats
    copy_s = _best_time(lambda: dst.copy_(x), R)
    clone_s = _best_time(lambda: x.clone(), R)
    rows = {"copy_": {"seconds": copy_s, "gb_per_s": nbytes / copy_s / 1e9},
            "clone": {"seconds": clone_s, "gb_per_s": nbytes / clone_s / 1e9}}
    progress(f"memcpy: copy_ {nbytes / copy_s / 1e9:.2f} GB/s, clone {nbytes / clone_s / 1e9:.2f} GB/s")
    codecs = {}
    for name in CODEC_NAMES:
        codec = get_codec(name)
        payload = codec.encode(x)
        enc_s = _best_time(lambda: codec.encode(x), R)
        dec_s = _best_time(lambda: codec.decode(payload), R)
        err = float((codec.decode(payload) - x).norm() / x.norm())
        codecs[name] = {
            "encode_s": enc_s, "decode_s": dec_s, "encode_gb_per_s": nbytes / enc_s / 1e9,
            "decode_gb_per_s": nbytes / dec_s / 1e9, "roundtrip_gb_per_s": nbytes / (enc_s + dec_s) / 1e9,
            "roundtrip_vs_copy": copy_s / (enc_s + dec_s), "encoded_bytes": len(payload),
            "bits_per_value": 8 * len(payload) / x.numel(), "relative_error": err,
        }
        progress(f"codec {name}: encode {nbytes / enc_s / 1e9:.2f} GB/s, decode {nbytes / dec_s / 1e9:.2f} GB/s")
    return {"numel": x.numel(), "input_bytes": nbytes, "memcpy": rows, "codecs": codecs}


def loop_table(loop: dict[str, Any], preset: Preset) -> str:
    rows = []
    for name, s in loop["summary"].items():
        wrapped = name != "plain"
        rows.append([name, f"{s['tokens_per_s_median']:,.0f}",
                     f"{s['tokens_per_s_min']:,.0f}–{s['tokens_per_s_max']:,.0f}",
                     f"{s['overhead_pct_paired_median']:+.2f}%" if wrapped else "—",
                     f"{s['wrapper_share_pct_median']:.2f}%" if wrapped else "—"])
    return markdown_table(["loop (1 worker)", "tokens/s (median)", "range over repeats",
                           "tokens/s overhead vs plain (paired median)", "time in diloco.step()"], rows,
                          align="lrrrr")


def codec_table(res: dict[str, Any]) -> str:
    cp = res["memcpy"]
    rows = [["memcpy (`copy_`)", "32.00", "—", "—", "—", f"{cp['copy_']['gb_per_s']:.2f}", "1.00x", "0"],
            ["memcpy (`clone()`)", "32.00", "—", "—", "—", f"{cp['clone']['gb_per_s']:.2f}",
             f"{cp['copy_']['seconds'] / cp['clone']['seconds']:.2f}x", "0"]]
    for name, c in res["codecs"].items():
        rows.append([name, f"{c['bits_per_value']:.2f}", f"{c['encode_gb_per_s']:.2f}", f"{c['decode_gb_per_s']:.2f}",
                     f"{1e3 * (c['encode_s'] + c['decode_s']):.0f}", f"{c['roundtrip_gb_per_s']:.2f}",
                     f"{c['roundtrip_vs_copy']:.3f}x", f"{c['relative_error']:.2e}"])
    return markdown_table(["codec", "bits / value", "encode GB/s", "decode GB/s", "encode+decode ms",
                           "encode+decode GB/s", "vs copy_", "relative L2 error"], rows, align="lrrrrrrr")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="quick", help="run sizes (default quick)")
    p.add_argument("--smoke", action="store_true", help="same as --preset smoke: seconds, for tests")
    p.add_argument("--skip-loop", action="store_true", help="codec throughput only")
    p.add_argument("--skip-codecs", action="store_true", help="training-loop overhead only")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: stable on a shared machine, like for like)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/overhead-<preset>.json)")
    p.add_argument("--img-dir", type=Path, help="where the PNG goes (default docs/img)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    out = args.out or RESULTS_DIR / f"overhead-{args.preset}.json"
    img_dir = args.img_dir or (out.parent if args.preset == "smoke" else IMG_DIR)
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    # One thread by default: with several, a busy machine stalls every OpenMP barrier and the
    # timings measure the scheduler instead of the code.
    torch.set_num_threads(args.threads)
    command = command_line(argv)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    payload: dict[str, Any] = {"benchmark": "overhead", "command": command, "preset_name": args.preset,
                               "preset": asdict(preset), "environment": environment()}
    tables = {}
    if not args.skip_loop:
        payload["loop"] = loop_benchmark(preset, progress)
        tables["loop"] = loop_table(payload["loop"], preset)
    if not args.skip_codecs:
        payload["codecs"] = codec_benchmark(preset, progress)
        tables["codecs"] = codec_table(payload["codecs"])
        if not args.no_plots:
            c = payload["codecs"]
            names = list(c["codecs"])
            payload["plots"] = [relative(plot_bars(
                img_dir / "overhead-codec-throughput.png", names, [c["codecs"][n]["roundtrip_gb_per_s"] for n in names],
                log=True, annotate="{:.2f}", reference=("memcpy (copy_)", c["memcpy"]["copy_"]["gb_per_s"]),
                title=f"Codec encode+decode throughput, {c['numel'] / 2**20:.0f}M fp32 values, "
                      f"{torch.get_num_threads()} CPU threads",
                ylabel="GB/s of fp32 input (log)", note=command))]
    payload["tables_markdown"] = tables
    write_json(out, payload)
    print(f"\n{command}\n")
    if "loop" in tables:
        print(f"tiny model, seq {preset.seq_len}, batch {preset.batch_size}, H={preset.inner_steps}, "
              f"P={preset.fragments}, {preset.steps} steps ({preset.warmup} warm-up excluded) x {preset.repeats} "
              f"repeats, {torch.get_num_threads()} threads\n\n" + tables["loop"] + "\n")
    if "codecs" in tables:
        print(tables["codecs"] + "\n")
    print(f"results: {relative(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
