"""Extra resident memory of StreamingDiLoCo over the plain training loop, on CPU.

    python -m benchmarks.memory                     # 35M and 100M presets, 3 modes x 3 codecs (~15 min)
    python -m benchmarks.memory --quick             # tiny model, 2 modes, fp32: a smoke run (~1 min)

Every configuration runs in a fresh subprocess (this script with ``--child``): build the model
and AdamW, take ``--warmup`` plain steps (the optimizer state exists), reset the peak-RSS mark
(``/proc/self/clear_refs``), then take ``--steps`` more steps, either plain (the baseline) or
wrapped by ``StreamingDiLoCo`` on a 1-worker ``LocalSwarm`` (H = ``--inner-steps``, P =
``--fragments``: every fragment syncs at least twice). The child runs with glibc's mmap threshold
fixed at 128 KiB, so freed tensors leave the resident set and RSS follows live memory.

Reported per configuration:

- ``extra_peak``: peak RSS (VmHWM) minus the plain loop's peak RSS, over the measured steps.
- ``extra_end``: RSS after the last step minus the plain loop's.
- ``sync_extra``: the most RSS one ``diloco.step()`` added above what was resident when it began
  (its transient buffers; they may fit under the plain loop's own peak, which is the backward pass).
- ``held``: bytes of the distinct tensor storages the wrapper holds after the last step (outer
  parameters, momentum, eager's ``start``, rounds in flight, last results, error feedback):
  torch accounting, no allocator involved.
- ``target``: outer parameters + momentum (2 x model fp32) + one fragment's send/receive buffers
  (its outer gradient, what was sent and the average, in fp32, plus the encoded bytes out and
  in, for the largest fragment). Eager 'corrected' also keeps ``start``, the point the local
  parameters restarted from (1 x model fp32, docs/algorithm.md): its target includes it.

Prints a markdown table and writes JSON (``--out``, default ``benchmarks/results/memory[-quick].json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.procfs import reset_peak, status_kib
from benchmarks.harness.results import REPO_ROOT, RESULTS_DIR, markdown_table, write_result

MiB = 1 << 20
MODES = ("blocking", "overlap", "eager")
CODECS = ("fp32", "fp4-e3m0", "topk-int2")


# ---------------------------------------------------------------------------------------- child
def held_bytes(diloco: Any) -> int:
    """Bytes of the distinct storages of the tensors the wrapper holds between steps."""
    import torch

    seen: dict[int, int] = {}

    def visit(x: Any, depth: int = 0) -> None:
        if depth > 6 or x is None:
            return
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth + 1)
        elif hasattr(x, "__dict__") and type(x).__module__.startswith(("opendiloco_stream", "torch.optim")):
            for v in vars(x).values():
                visit(v, depth + 1)

    params = {p.untyped_storage().data_ptr() for p in diloco.model.parameters()}
    for s in diloco.syncs:  # a fragment's state, its round in flight and its rule's own state
        f = s.f
        visit([f.outer, f.unsent, f.opt.opt.state, s.pending,
               [v for k, v in vars(s.rule).items() if k not in ("f", "config")]])
    visit(diloco.error_feedback)
    return sum(n for ptr, n in seen.items() if ptr not in params)


def run_child(spec: dict) -> dict:
    import torch

    from opendiloco_stream.algorithm import wrap
    from opendiloco_stream.compression import get_codec
    from opendiloco_stream.config import DiLoCoConfig
    from opendiloco_stream.train.loop import inner_step
    from opendiloco_stream.train.models import build_model
    from opendiloco_stream.transport.local import LocalSwarm

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    vocab, seq, batch = spec["vocab"], spec["seq_len"], spec["batch_size"]
    model = build_model(spec["model"], vocab, seq, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def train_step() -> None:  # the trainer's inner step (fp32, no clipping)
        inner_step(model, opt, torch.randint(vocab, (batch, seq + 1), generator=gen))

    for _ in range(spec["warmup"]):
        train_step()
    gc.collect()
    rss_start = status_kib("VmRSS")
    peak_reset = reset_peak()
    diloco = None
    if spec["mode"] != "plain":
        cfg = DiLoCoConfig(mode=spec["mode"], inner_steps=spec["inner_steps"], num_fragments=spec["fragments"],
                           codec=spec["codec"], overlap_steps=1 if spec["mode"] == "overlap" else 0)
        diloco = wrap(model, opt, transport=LocalSwarm(1, codec=spec["codec"]).transport(0), config=cfg)
    t0 = time.perf_counter()
    peak = sync_extra = 0  # KiB: overall peak; the most one diloco.step() added above its start
    for _ in range(spec["steps"]):
        train_step()
        if diloco is not None:
            peak = max(peak, status_kib("VmHWM"))
            before = status_kib("VmRSS")
            reset_peak()
            diloco.step(tokens=batch * seq)
            sync_extra = max(sync_extra, status_kib("VmHWM") - before)
    gc.collect()
    peak = max(peak, status_kib("VmHWM"))
    out = dict(spec, rss_start_mib=rss_start / 1024, rss_end_mib=status_kib("VmRSS") / 1024,
               peak_mib=peak / 1024, sync_extra_mib=sync_extra / 1024, peak_reset=peak_reset,
               seconds=time.perf_counter() - t0, params=sum(p.numel() for p in model.parameters()))
    if diloco is not None:
        numels = [f.numel for f in diloco.fragments]
        codec = get_codec(spec["codec"])
        frag = max(numels)
        out.update(fragment_numels=numels, held_mib=held_bytes(diloco) / MiB,
                   syncs=diloco.log.stats.syncs if hasattr(diloco.log.stats, "syncs") else None,
                   target_mib=(2 * 4 * sum(numels) + 3 * 4 * frag + 2 * codec.encoded_size(frag)
                               + (4 * sum(numels) if cfg.mode == "eager" and cfg.eager_rule == "corrected" else 0)) / MiB)
        diloco.close()
    return out


# ---------------------------------------------------------------------------------------- parent
def run_config(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS=str(spec["threads"]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--child", json.dumps(spec)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['model']} {spec['mode']} {spec['codec']}: child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["35M", "100M"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--codecs", nargs="+", default=list(CODECS))
    p.add_argument("--inner-steps", type=int, default=4, help="H")
    p.add_argument("--fragments", type=int, default=2, help="P")
    p.add_argument("--steps", type=int, default=10, help="measured steps (>= 2H + 1: every fragment syncs twice)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="per configuration (s)")
    p.add_argument("--quick", action="store_true", help="tiny model, blocking and eager, fp32, few steps")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return 0
    if args.quick:
        args.models, args.modes, args.codecs = ["tiny"], ["blocking", "eager"], ["fp32"]
        args.steps, args.seq_len, args.vocab = 2 * args.inner_steps + 1, 32, 1000
    out = args.out or RESULTS_DIR / ("memory-quick.json" if args.quick else "memory.json")
    base = dict(inner_steps=args.inner_steps, fragments=args.fragments, steps=args.steps, warmup=args.warmup,
                seq_len=args.seq_len, batch_size=args.batch_size, vocab=args.vocab, threads=args.threads)
    rows = []
    headers = ["model", "params", "mode", "codec", "extra peak MiB", "extra end MiB", "held MiB", "sync extra MiB",
               "target MiB", "peak / target"]
    print("| " + " | ".join(headers) + " |", flush=True)
    for model in args.models:
        plain = run_config(dict(base, model=model, mode="plain", codec="-"), args.timeout)
        rows.append(plain)
        print(f"| {model} | {plain['params'] / 1e6:.1f}M | plain | - | (peak {plain['peak_mib']:.0f}) | "
              f"(end {plain['rss_end_mib']:.0f}) | | | | |", flush=True)
        for mode in args.modes:
            for codec in args.codecs:
                r = run_config(dict(base, model=model, mode=mode, codec=codec), args.timeout)
                r.update(extra_peak_mib=r["peak_mib"] - plain["peak_mib"], extra_end_mib=r["rss_end_mib"] - plain["rss_end_mib"])
                rows.append(r)
                print(f"| {model} | {r['params'] / 1e6:.1f}M | {mode} | {codec} | {r['extra_peak_mib']:.0f} | "
                      f"{r['extra_end_mib']:.0f} | {r['held_mib']:.0f} | {r['sync_extra_mib']:.0f} | {r['target_mib']:.0f} | "
                      f"{r['extra_peak_mib'] / r['target_mib']:.2f} |", flush=True)
    table = markdown_table(headers, [
        [r["model"], f"{r['params'] / 1e6:.1f}M", r["mode"], r["codec"], round(r["extra_peak_mib"]),
         round(r["extra_end_mib"]), round(r["held_mib"]), round(r["sync_extra_mib"]), round(r["target_mib"]),
         round(r["extra_peak_mib"] / r["target_mib"], 2)]
        for r in rows if r["mode"] != "plain"])
    write_result(out, settings=base, rows=rows, argv=argv, benchmark="memory", table=table)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
