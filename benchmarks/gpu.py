"""One worker on a CUDA device: the trainer's inner loop with StreamingDiLoCo, per model preset.

    python -m benchmarks.gpu                                # tiny and 100M, 300 timed steps each
    python -m benchmarks.gpu --presets 100M --steps 500 --outer-device cpu --out /tmp/gpu.json

For each preset: the model on ``cuda:0`` (fp32 parameters), AdamW, the forward under bf16 autocast
(``train.precision`` 'auto' on CUDA, as the trainer runs it) and ``StreamingDiLoCo`` (eager, fp4-e3m0,
P=4, H=100 by default) over a ``LocalSwarm`` of one worker: each round is the fragment's copy to the
host, the codec's encode and decode and the one-member reduction, in-process (no network). Tokens
are random ids (throughput does not depend on the text). Every step is timed with
``torch.cuda.synchronize()`` around the inner step (forward, backward, clip, AdamW) and around
``diloco.step()``; the first ``--warmup`` steps are not timed.

Reported per preset: tokens/s over the timed steps, peak GPU memory
(``torch.cuda.max_memory_allocated``, reset per preset), the inner step's mean, ``diloco.step()``'s
mean and max (the max is a sync step) and its share of the step time (the sum of ``diloco.step()``
times over the sum of step times). The one-member ``LocalSwarm`` encodes, reduces and decodes inside
``diloco.step()`` (on the host); a peer does that in its averaging service, in the background. So the
time inside the transport's ``all_reduce`` is reported on its own, with the wrapper's share without
it. The plain loop (the same steps without the wrapper, ``--no-plain`` skips it) gives the reference
tokens/s and peak memory, measured in the same run. A codec check (``--codec-numel``, 0 skips it)
encodes and decodes every codec on the GPU and on the CPU: bit-identical bytes and values, and
GB/s next to the GPU -> pinned host copy. A table on stdout, JSON in ``--out``.

Without a CUDA device it prints one line on stderr and exits with code 2 (``--device cpu`` runs the
same loop and codec check on the CPU: the tests do).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from typing import Any

import torch

from benchmarks.harness.results import RESULTS_DIR, markdown_table, relative, time_ops, write_result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "100M"], help="model presets (default: tiny 100M)")
    p.add_argument("--steps", type=int, default=300, help="timed inner steps per preset (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=32_000, help="the paper's vocabulary (default 32000)")
    p.add_argument("--mode", default="eager")
    p.add_argument("--codec", default="fp4-e3m0")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=100)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--outer-device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--no-plain", dest="plain", action="store_false",
                   help="skip the plain loop (the same steps without the wrapper) that tokens/s is compared with")
    p.add_argument("--codec-numel", type=int, default=1 << 24,
                   help="elements of the codec check's tensor (default 2^24; 0 skips the codec check)")
    p.add_argument("--codec-repeats", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions with the most cumulative time inside diloco.step() (cProfile)")
    p.add_argument("--device", default="cuda:0",
                   help="where the model runs (default cuda:0; 'cpu' runs the same loop there, no memory figure)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gpu.json"), help="JSON results (default: %(default)s)")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedTransport:
    """Seconds spent inside a transport's ``all_reduce`` (the one-member LocalSwarm's encode, reduce,
    decode: what a peer's averaging service does in the background)."""

    def __init__(self, transport: Any):
        self.seconds = 0.0
        self._all_reduce = transport.all_reduce
        transport.all_reduce = self

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._all_reduce(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0


def _build(name: str, args: argparse.Namespace, device: torch.device, wrapper: bool):
    """The config, model, optimizer, timed transport and (``wrapper``) StreamingDiLoCo of one preset."""
    from opendiloco_stream.algorithm.diloco import wrap
    from opendiloco_stream.config import load_config
    from opendiloco_stream.train.models import build_model, transformer_blocks
    from opendiloco_stream.transport.factory import local_swarm

    cfg = load_config(overrides={
        "diloco": {"mode": args.mode, "codec": args.codec, "num_fragments": args.fragments,
                   "inner_steps": args.inner_steps, "outer_device": args.outer_device},
        "model": {"name": name, "seq_len": args.seq_len},
        "train": {"batch_size": args.batch_size, "precision": args.precision, "device": str(device)}}, environ={})
    model = build_model(name, vocab_size=args.vocab_size, seq_len=args.seq_len, seed=0).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                            weight_decay=cfg.train.weight_decay)
    transport = local_swarm(cfg, 1).transport(0)
    timed = _TimedTransport(transport)
    diloco = (wrap(model, opt, transport=transport, config=cfg.diloco, blocks=transformer_blocks(model))
              if wrapper else None)
    return cfg, model, opt, timed, diloco


def run_preset(name: str, args: argparse.Namespace, device: str = "cuda:0", wrapper: bool = True) -> dict[str, Any]:
    """One preset's row. ``device``: ``--device cpu`` runs the same loop on the CPU (no memory figure
    there). ``wrapper=False``: the plain loop, the same inner steps with no ``StreamingDiLoCo`` (the
    reference). The inner step is the trainer's own (``train.loop.inner_step``)."""
    from opendiloco_stream.train.loop import inner_step, use_bf16_autocast

    device = torch.device(device)
    cuda = device.type == "cuda"
    cfg, model, opt, timed, diloco = _build(name, args, device, wrapper)
    bf16 = use_bf16_autocast(cfg.train.precision, device)
    gen = torch.Generator(device=device).manual_seed(0)
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    inner, outer, losses = [], [], []
    profiler = cProfile.Profile() if wrapper and getattr(args, "profile", 0) else None
    for step in range(args.warmup + args.steps):
        batch = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=gen)
        _sync(device)
        t0 = time.perf_counter()
        loss = inner_step(model, opt, batch, bf16=bf16, clip_grad_norm=cfg.train.clip_grad_norm)
        _sync(device)
        t1 = time.perf_counter()
        if diloco is not None:
            if profiler is not None and step >= args.warmup:
                profiler.enable()
            diloco.step(tokens=batch[:, 1:].numel())
            _sync(device)
            if profiler is not None:
                profiler.disable()
        if step + 1 == args.warmup:
            timed.seconds = 0.0  # count the timed steps only
        t2 = time.perf_counter() if diloco is not None else t1
        if step >= args.warmup:
            inner.append(t1 - t0)
            outer.append(t2 - t1)
            losses.append(loss.item())
    if diloco is not None:
        diloco.close()
    if profiler is not None:
        print(f"{name}: the {args.profile} functions with the most cumulative time in diloco.step()", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    params = sum(p.numel() for p in model.parameters())
    del model, opt, diloco, loss
    if cuda:
        torch.cuda.empty_cache()
    return _row(name, args, wrapper, params, peak, inner, outer, losses, timed.seconds)


def _row(name: str, args: argparse.Namespace, wrapper: bool, params: int, peak: int, inner: list[float],
         outer: list[float], losses: list[float], in_transport: float) -> dict[str, Any]:
    total = sum(inner) + sum(outer)
    return {"preset": name, "wrapper": wrapper, "params": params, "steps": len(inner),
            "tokens_per_step": args.batch_size * args.seq_len,
            "tokens_per_s": args.batch_size * args.seq_len * len(inner) / total,
            "peak_memory_gib": peak / 2**30, "inner_step_ms": 1e3 * sum(inner) / len(inner),
            "wrapper_step_ms_mean": 1e3 * sum(outer) / len(outer), "wrapper_step_ms_max": 1e3 * max(outer),
            "wrapper_share": sum(outer) / total,
            # what a peer does in the background (its averaging service), here inline in diloco.step()
            "transport_in_process_ms_mean": 1e3 * in_transport / len(inner),
            "wrapper_share_without_transport": (sum(outer) - in_transport) / (total - in_transport),
            "loss_first": losses[0], "loss_last": losses[-1]}


def codec_rows(numel: int, repeats: int, device: str = "cuda:0") -> dict[str, Any]:
    """Every codec on a ``numel``-element outer-gradient-like tensor on ``device`` against the same
    tensor on the CPU: whether the bytes (encode) and the decoded values are bit-identical across
    the two devices, and the GPU's encode (device tensor -> bytes on the host) and decode (bytes ->
    device tensor) throughput over the fp32 input, next to the memcpy reference: the fp32 tensor's
    copy from the device into pinned host memory (what any send must do at least)."""
    from opendiloco_stream.compression import CODEC_NAMES, get_codec

    device = torch.device(device)
    host = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    x = host.to(device)
    nbytes = 4 * numel
    pinned = torch.empty(numel, pin_memory=device.type == "cuda")
    codecs = {name: get_codec(name) for name in CODEC_NAMES}
    data = {name: codec.encode(x) for name, codec in codecs.items()}
    ops = {"copy": lambda: pinned.copy_(x)}
    for name, codec in codecs.items():
        ops[f"{name}/encode"] = lambda codec=codec: codec.encode(x)
        ops[f"{name}/decode"] = lambda codec=codec, payload=data[name]: codec.decode(payload, device=device)
    median = {op: sorted(ts)[len(ts) // 2] for op, ts in time_ops(ops, repeats, lambda: _sync(device)).items()}
    rows = [{"codec": name, "wire_bytes": len(data[name]), "same_bytes_as_cpu": data[name] == codec.encode(host),
             "same_values_as_cpu": torch.equal(codec.decode(data[name], device=device).cpu(), codec.decode(data[name])),
             "encode_gb_per_s": nbytes / median[f"{name}/encode"] / 1e9,
             "decode_gb_per_s": nbytes / median[f"{name}/decode"] / 1e9} for name, codec in codecs.items()]
    return {"numel": numel, "repeats": repeats, "device_to_pinned_host_gb_per_s": nbytes / median["copy"] / 1e9,
            "rows": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine "
              "(or pass --device cpu)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    rows, plain = [], {}
    for name in args.presets:
        if args.plain:
            print(f"{name}: the plain loop ...", file=sys.stderr, flush=True)
            plain[name] = run_preset(name, args, device=args.device, wrapper=False)
        print(f"{name}: with StreamingDiLoCo ...", file=sys.stderr, flush=True)
        rows.append(run_preset(name, args, device=args.device))
    for r in rows:
        ref = plain.get(r["preset"])
        r["plain_tokens_per_s"] = ref["tokens_per_s"] if ref else None
        r["plain_peak_memory_gib"] = ref["peak_memory_gib"] if ref else None
        r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    na = "—"
    table = markdown_table(
        ["preset", "parameters", "tokens/s", "plain loop tokens/s", "vs plain", "peak GPU memory (GiB)",
         "plain loop peak (GiB)", "inner step (ms)", "diloco.step mean (ms)", "diloco.step max (ms)", "wrapper share",
         "of which in-process transport (ms/step)", "wrapper share without it"],
        [[r["preset"], f"{r['params']:,}", f"{r['tokens_per_s']:,.0f}",
          f"{r['plain_tokens_per_s']:,.0f}" if r["plain_tokens_per_s"] else na,
          f"{r['tokens_per_s_vs_plain']:.3f}" if r["tokens_per_s_vs_plain"] else na, f"{r['peak_memory_gib']:.2f}",
          f"{r['plain_peak_memory_gib']:.2f}" if r["plain_peak_memory_gib"] is not None else na,
          f"{r['inner_step_ms']:.1f}", f"{r['wrapper_step_ms_mean']:.2f}", f"{r['wrapper_step_ms_max']:.1f}",
          f"{100 * r['wrapper_share']:.2f}%", f"{r['transport_in_process_ms_mean']:.2f}",
          f"{100 * r['wrapper_share_without_transport']:.2f}%"] for r in rows])
    print(f"{device_name}; {args.mode} {args.codec}, P={args.fragments}, H={args.inner_steps}, "
          f"precision {args.precision}, outer device {args.outer_device}; batch {args.batch_size} x {args.seq_len}")
    print(table)
    codecs = None
    if args.codec_numel > 0:
        print(f"codecs on {args.codec_numel:,} elements ...", file=sys.stderr, flush=True)
        codecs = codec_rows(args.codec_numel, args.codec_repeats, device=args.device)
        print(f"\ncodecs, {codecs['numel']:,} fp32 elements on {device_name}; memcpy reference (GPU -> pinned host): "
              f"{codecs['device_to_pinned_host_gb_per_s']:.1f} GB/s")
        print(markdown_table(
            ["codec", "wire bytes", "same bytes as CPU", "same values as CPU", "encode GB/s", "decode GB/s"],
            [[c["codec"], f"{c['wire_bytes']:,}", "yes" if c["same_bytes_as_cpu"] else "NO",
              "yes" if c["same_values_as_cpu"] else "NO", f"{c['encode_gb_per_s']:.2f}", f"{c['decode_gb_per_s']:.2f}"]
             for c in codecs["rows"]]))
    out = write_result(args.out, settings=vars(args), rows=rows, argv=argv, benchmark="gpu", device=device_name,
                       plain_rows=list(plain.values()), codecs=codecs)
    print(f"wrote {relative(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
