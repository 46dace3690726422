"""What the DiLoCo wrapper and the wire codecs cost in compute, with no network in the way.

1. Training-loop throughput (tokens/s) of one worker, on the same model, data and seed, three
   ways: ``plain`` (no wrapper), ``eager-fp4-e3m0`` and ``blocking-fp32`` (with ``StreamingDiLoCo``
   over a ``LocalSwarm`` of one worker). The loop is ``train_worker``'s body (loop.py) mirrored as
   a generator (``loop_steps``), so that the three loops can run *step-interleaved*: one inner step
   of each in turn, so load from other processes on a shared machine falls on all of them alike.
   ``mirror_check`` verifies that the mirrored wrapped loop reproduces ``train_worker``'s losses.
   With one worker the swarm still encodes the outer gradient, decodes it, encodes the "average"
   and decodes it again at every fragment sync, so this is the wrapper's real compute cost
   (outer-gradient math, outer optimizer, copies, codec). The first ``warmup`` steps are dropped;
   the table gives medians over repeats, the overhead paired per repeat, and the time spent
   inside ``diloco.step()`` as a share of the loop.

2. Codec throughput: encode, decode and encode+decode of a 16M-element fp32 tensor (64 MiB,
   outer-gradient-like values) for every codec, against ``torch.clone()`` and ``Tensor.copy_`` of
   the same tensor (a plain memory copy). Best of ``repeats`` timings after one warm-up call, the
   operations timed in turn within each repeat.

Everything runs on one torch thread by default (``--threads``).

Usage (from the repository root)::

    python -m benchmarks.overhead --preset full      # the numbers in docs/benchmarks-overhead.md
    python -m benchmarks.overhead --smoke --out /tmp/o.json --img-dir /tmp   # seconds (tests)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from benchmarks.harness.results import (IMG_DIR, RESULTS_DIR, command_line, markdown_table, plot_bars, relative,
                                       time_ops, write_result)

from opendiloco_stream.compression import CODEC_NAMES, get_codec, native
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
                   codec_numel=1 << 24, codec_repeats=9),
}

#: loop variants: name -> DiLoCoConfig overrides (None: no wrapper)
LOOP_VARIANTS: dict[str, Optional[dict[str, Any]]] = {
    "plain": None,
    "eager-fp4-e3m0": {"mode": "eager", "codec": "fp4-e3m0"},
    "blocking-fp32": {"mode": "blocking", "codec": "fp32"},
}


def make_config(preset: Preset, diloco: Optional[dict[str, Any]], steps: Optional[int] = None) -> RunConfig:
    return load_config(overrides={
        "diloco": {"inner_steps": preset.inner_steps, "num_fragments": preset.fragments, **(diloco or {})},
        "model": {"name": "tiny", "seq_len": preset.seq_len},
        "data": {"dataset": "builtin", "max_val_batches": 1},
        "train": {"steps": steps or preset.steps, "batch_size": preset.batch_size, "eval_every": 0, "seed": 0,
                  "device": "cpu"},
    }, environ={})


def loop_steps(cfg: RunConfig, data, wrapped: bool) -> Iterator[dict[str, float]]:
    """``train_worker``'s body (rank 0 of 1) as a generator, one inner step per ``next()``.

    ``wrapped``: with ``StreamingDiLoCo`` over a one-worker LocalSwarm, exactly as train_worker
    builds it; otherwise the same loop without it. The inner step is the trainer's own
    (``train.loop.inner_step``); ``mirror_check`` compares this loop's losses with train_worker's,
    so a change to how the trainer builds its parts shows here.
    """
    from opendiloco_stream.algorithm.diloco import wrap
    from opendiloco_stream.train.loop import inner_step, lr_factor
    from opendiloco_stream.train.loss import evaluate, use_bf16_autocast
    from opendiloco_stream.train.models import build_model, transformer_blocks
    from opendiloco_stream.transport.factory import local_swarm

    train_source, val, vocab_size = data
    tc, device, d = cfg.train, cfg.train.device, cfg.diloco
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len, seed=tc.seed,
                        dtype=dtype).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc.warmup_steps, tc.steps))
    diloco = None
    if wrapped:
        swarm = local_swarm(cfg, 1)
        diloco = wrap(model, opt, transport=swarm.transport(0), config=d, blocks=transformer_blocks(model))
    bf16 = use_bf16_autocast(tc.precision, device)
    evaluate(model, val, tc.batch_size, cfg.data.max_val_batches, device, bf16)
    batches = train_source.batches(0, 1, tc.batch_size)
    for step in range(tc.steps):
        t0 = time.perf_counter()
        batch = next(batches).to(device)
        loss = inner_step(model, opt, batch, bf16=bf16, clip_grad_norm=tc.clip_grad_norm, scheduler=sched)
        t1 = time.perf_counter()
        tokens = batch[:, 1:].numel()
        if diloco is not None:
            diloco.step(tokens=tokens)
        t2 = time.perf_counter()
        loss_value = loss.item()
        record = {"event": "step", "rank": 0, "step": step + 1, "loss": round(loss_value, 5),  # as train_worker
                  "lr": sched.get_last_lr()[0], "tokens": tokens, "compute_s": round(t1 - t0, 5),
                  "sync_s": round(t2 - t1, 5)}
        t3 = time.perf_counter()
        yield {**record, "loss": loss_value, "step_s": t3 - t0, "sync_s": t2 - t1}
    if diloco is not None:
        diloco.close()


def mirror_check(preset: Preset, data, steps: int) -> dict[str, Any]:
    """Losses of ``loop_steps(wrapped=True)`` against ``train_worker`` itself on the same config."""
    from opendiloco_stream.train.loop import train_worker
    from opendiloco_stream.transport.factory import local_swarm

    cfg = make_config(preset, LOOP_VARIANTS["eager-fp4-e3m0"], steps=steps)
    records: list[dict[str, Any]] = []
    swarm = local_swarm(cfg, 1)
    train_worker(0, 1, cfg, swarm.transport(0), *data, records.append)
    reference = [r["loss"] for r in records if r.get("event") == "step"]
    mirrored = [round(r["loss"], 5) for r in loop_steps(cfg, data, wrapped=True)]
    return {"steps": steps, "max_abs_loss_diff": max(abs(a - b) for a, b in zip(reference, mirrored)),
            "same_length": len(reference) == len(mirrored)}


def loop_benchmark(preset: Preset, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the variants' loops step-interleaved: one step of each in turn (rotating the order), so
    that load from other processes falls on all of them alike; warm-up steps are dropped."""
    from opendiloco_stream.commands.local import prepare_data

    data = prepare_data(make_config(preset, None))
    names = list(LOOP_VARIANTS)
    runs = []
    for rep in range(preset.repeats):
        loops = {n: loop_steps(make_config(preset, LOOP_VARIANTS[n]), data, wrapped=LOOP_VARIANTS[n] is not None)
                 for n in names}
        steps: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for i in range(preset.steps):
            for n in names[i % len(names):] + names[:i % len(names)]:
                steps[n].append(next(loops[n]))
        for n in names:
            for _ in loops[n]:  # run the generator to its end (closes the wrapper)
                pass
            timed = steps[n][preset.warmup:]
            loop_s = sum(r["step_s"] for r in timed)
            tokens = sum(r["tokens"] for r in timed)
            sync_s = sum(r["sync_s"] for r in timed)
            runs.append({"variant": n, "repeat": rep, "timed_steps": len(timed), "loop_s": loop_s, "tokens": tokens,
                         "tokens_per_s": tokens / loop_s, "wrapper_s": sync_s, "wrapper_share": sync_s / loop_s})
        progress(f"loop repeat {rep}: " + ", ".join(f"{r['variant']} {r['tokens_per_s']:,.0f} tokens/s"
                                                    for r in runs if r["repeat"] == rep))
    summary = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        tps = [r["tokens_per_s"] for r in mine]
        # paired: each wrapped run against the plain run it was interleaved with
        paired = [100 * (1 - r["tokens_per_s"] / p["tokens_per_s"])
                  for r in mine for p in runs if p["variant"] == "plain" and p["repeat"] == r["repeat"]]
        summary[name] = {
            "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "overhead_pct_paired_median": statistics.median(paired),
            "overhead_pct_paired_min": min(paired), "overhead_pct_paired_max": max(paired),
            "wrapper_share_pct_median": 100 * statistics.median([r["wrapper_share"] for r in mine]),
        }
    check = mirror_check(preset, data, steps=min(preset.steps, 2 * preset.inner_steps + 2))
    progress(f"mirror check: max |loss(loop_steps) - loss(train_worker)| = {check['max_abs_loss_diff']:.2e} "
             f"over {check['steps']} steps")
    return {"runs": runs, "summary": summary, "mirror_check": check}


NATIVE_CODECS = ("int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1", "topk-int2", "topk-int4")  # where native.py applies


def _in_torch(fn: Callable[[Any], Any], arg: Any) -> Any:
    with native.disabled():
        return fn(arg)


def codec_benchmark(preset: Preset, progress: Callable[[str], None]) -> dict[str, Any]:
    """GB/s (10^9 bytes of fp32 input per second) of each codec and of a plain memory copy."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(preset.codec_numel, generator=gen) * 1e-3  # outer gradients are small numbers
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    ops: dict[str, Callable[[], Any]] = {"copy_": lambda: dst.copy_(x), "clone": lambda: x.clone()}
    payloads = {}
    for name in CODEC_NAMES:
        codec = get_codec(name)
        payloads[name] = payload = codec.encode(x)
        ops[f"{name}/encode"] = lambda codec=codec: codec.encode(x)
        ops[f"{name}/decode"] = lambda codec=codec, payload=payload: codec.decode(payload)
        if native.available() and name in NATIVE_CODECS:  # the same ops in torch, timed in turn
            ops[f"{name}/encode-torch"] = lambda codec=codec: _in_torch(codec.encode, x)
            ops[f"{name}/decode-torch"] = lambda codec=codec, payload=payload: _in_torch(codec.decode, payload)
    best = {name: min(ts) for name, ts in time_ops(ops, preset.codec_repeats).items()}
    copy_s, clone_s = best["copy_"], best["clone"]
    rows = {"copy_": {"seconds": copy_s, "gb_per_s": nbytes / copy_s / 1e9},
            "clone": {"seconds": clone_s, "gb_per_s": nbytes / clone_s / 1e9}}
    progress(f"memcpy: copy_ {nbytes / copy_s / 1e9:.2f} GB/s, clone {nbytes / clone_s / 1e9:.2f} GB/s")
    codecs = {}
    for name in CODEC_NAMES:
        codec, payload = get_codec(name), payloads[name]
        enc_s, dec_s = best[f"{name}/encode"], best[f"{name}/decode"]
        err = float((codec.decode(payload) - x).norm() / x.norm())
        codecs[name] = {
            "encode_s": enc_s, "decode_s": dec_s, "encode_gb_per_s": nbytes / enc_s / 1e9,
            "decode_gb_per_s": nbytes / dec_s / 1e9, "roundtrip_gb_per_s": nbytes / (enc_s + dec_s) / 1e9,
            "roundtrip_vs_copy": copy_s / (enc_s + dec_s), "encoded_bytes": len(payload),
            "bits_per_value": 8 * len(payload) / x.numel(), "relative_error": err,
        }
        if f"{name}/encode-torch" in best:
            codecs[name]["torch_encode_s"] = best[f"{name}/encode-torch"]
            codecs[name]["torch_decode_s"] = best[f"{name}/decode-torch"]
            codecs[name]["native_speedup"] = ((best[f"{name}/encode-torch"] + best[f"{name}/decode-torch"])
                                              / (enc_s + dec_s))
        progress(f"codec {name}: encode {nbytes / enc_s / 1e9:.2f} GB/s, decode {nbytes / dec_s / 1e9:.2f} GB/s")
    return {"numel": x.numel(), "input_bytes": nbytes, "repeats": preset.codec_repeats, "memcpy": rows,
            "codecs": codecs}


def loop_table(loop: dict[str, Any]) -> str:
    rows = []
    for name, s in loop["summary"].items():
        wrapped = name != "plain"
        rows.append([name, f"{s['tokens_per_s_median']:,.0f}",
                     f"{s['tokens_per_s_min']:,.0f}–{s['tokens_per_s_max']:,.0f}",
                     f"{s['overhead_pct_paired_median']:+.2f}% ({s['overhead_pct_paired_min']:+.2f}…"
                     f"{s['overhead_pct_paired_max']:+.2f})" if wrapped else "—",
                     f"{s['wrapper_share_pct_median']:.2f}%" if wrapped else "—"])
    return markdown_table(["loop (1 worker)", "tokens/s (median)", "range over repeats",
                           "tokens/s overhead vs plain: median (range)", "time in diloco.step()"], rows,
                          align="lrrrr")


def codec_table(res: dict[str, Any]) -> str:
    cp = res["memcpy"]
    rows = [["memcpy (`copy_`)", "32.00", "—", "—", "—", f"{cp['copy_']['gb_per_s']:.2f}", "1.00x", "—", "0"],
            ["memcpy (`clone()`)", "32.00", "—", "—", "—", f"{cp['clone']['gb_per_s']:.2f}",
             f"{cp['copy_']['seconds'] / cp['clone']['seconds']:.2f}x", "—", "0"]]
    for name, c in res["codecs"].items():
        torch_ms = (f"{1e3 * (c['torch_encode_s'] + c['torch_decode_s']):.0f} ({c['native_speedup']:.1f}x)"
                    if "native_speedup" in c else "—")
        rows.append([name, f"{c['bits_per_value']:.2f}", f"{c['encode_gb_per_s']:.2f}", f"{c['decode_gb_per_s']:.2f}",
                     f"{1e3 * (c['encode_s'] + c['decode_s']):.0f}", f"{c['roundtrip_gb_per_s']:.2f}",
                     f"{c['roundtrip_vs_copy']:.3f}x", torch_ms, f"{c['relative_error']:.2e}"])
    return markdown_table(["codec", "bits / value", "encode GB/s", "decode GB/s", "encode+decode ms",
                           "encode+decode GB/s", "vs copy_", "torch-only ms (kernels' speed-up)",
                           "relative L2 error"], rows, align="lrrrrrrrr")


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
    command = command_line(argv, "benchmarks.overhead")
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    settings = {"preset_name": args.preset, "preset": asdict(preset), "threads": args.threads}
    payload: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []  # the loops' runs: one per variant and repeat
    tables = {}
    if not args.skip_loop:
        loop = loop_benchmark(preset, progress)
        tables["loop"] = loop_table(loop)
        rows = loop.pop("runs")
        payload["loop"] = loop
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
                      f"{torch.get_num_threads()} CPU thread" + ("s" if torch.get_num_threads() > 1 else ""),
                ylabel="GB/s of fp32 input (log)", note=command))]
    payload["tables_markdown"] = tables
    write_result(out, settings=settings, rows=rows, argv=argv, benchmark="overhead", command=command, **payload)
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
