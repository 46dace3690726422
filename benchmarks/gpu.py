"""The GPU peer: two ``peer`` processes on one GPU through the averaging service, next to the plain loop.

    python -m benchmarks.gpu                                # tiny and 100M on cuda:0
    python -m benchmarks.gpu --presets 1B --steps 200 --out benchmarks/results/gpu-1b.json
    python -m benchmarks.gpu --smoke-cpu                    # the same code path on the CPU (tiny): no GPU figure

For each preset, three parts, in one run on one device:

1. **The peers** (``--no-peers`` skips them). Two real peers (``opendiloco-stream local --transport
   hivemind --workers 2``: a bootstrap and two ``peer`` processes on 127.0.0.1, the averaging
   service, the direct data path) train on the same GPU with the built-in corpus: eager,
   fp4-e3m0, P = 4, H = ``--inner-steps``, ``train.device`` and ``diloco.outer_device`` left at
   ``auto``. Next to them, the **plain loop** (``train.loop.inner_step`` with no wrapper) runs as
   two processes on the same GPU at the same time, with the same model, batch and vocabulary. Reported:
   the peers' tokens/s (both together, over the steps after ``--warmup``, from the step records'
   times) against the two plain loops' together; the training thread's time inside ``diloco.step()``
   per step (host time: the launch and landing copies are on a side stream) and its share of the
   step; each process's peak GPU memory (``torch.cuda.max_memory_allocated``) and the peer's extra
   over the plain loop, next to the bound it should stay under: the outer state where it lives
   (on the GPU or, with ``outer_device`` auto on a full GPU, pinned host memory: 0 on the GPU) plus
   the largest fragment in flight; and the final eval loss.
2. **A CPU reference** (``--no-cpu-reference`` skips it): the same preset, steps, batch and data as
   two workers on the CPU (``local --device cpu --precision fp32``, the in-process transport, which
   reduces exactly as the hivemind one): its eval loss at equal tokens against the peers' (the GPU
   peers compute their forward passes under bf16 autocast, the CPU in fp32: the difference includes
   that). For the large presets this part takes long on a CPU.
3. **The in-process loop** (``--no-loop`` skips it): one worker with ``StreamingDiLoCo`` over a
   one-member ``LocalSwarm``, every step timed with ``torch.cuda.synchronize()``, against the plain
   loop in the same process (random tokens, ``--vocab-size``). The in-process transport's own time
   is reported apart (a peer's averaging service does that work in the background).

A codec check (``--codec-numel``, 0 skips it) encodes and decodes every codec on the device and
on the CPU: bit-identical bytes and values, and GB/s next to the device -> pinned host copy.

Without a CUDA device it prints one line on stderr and exits with code 2, unless ``--smoke-cpu``:
then the same parts run on the CPU with the tiny preset and a few steps (a check that the code
path works; its figures are CPU figures, labelled so, never GPU ones). A table on stdout, JSON in
``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.results import RESULTS_DIR, markdown_table, relative, time_ops, write_result

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=None, help="model presets (default: tiny 100M; --smoke-cpu: tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed inner steps per run (default 300; --smoke-cpu: 6)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; --smoke-cpu: 2)")
    p.add_argument("--batch-size", type=int, default=None, help="default 16 (--smoke-cpu: 2)")
    p.add_argument("--seq-len", type=int, default=None, help="default 512 (--smoke-cpu: 32)")
    p.add_argument("--vocab-size", type=int, default=32_000,
                   help="the in-process loop's vocabulary (default 32000, the paper's; the peers use the built-in "
                        "corpus' byte-level one)")
    p.add_argument("--mode", default="eager")
    p.add_argument("--codec", default="fp4-e3m0")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=None, help="H (default 100; --smoke-cpu: 4)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--outer-device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip the two peers and their plain loops")
    p.add_argument("--no-cpu-reference", dest="cpu_reference", action="store_false",
                   help="skip the CPU run the peers' eval loss is compared with")
    p.add_argument("--no-loop", dest="loop", action="store_false", help="skip the in-process loop")
    p.add_argument("--no-plain", dest="plain", action="store_false",
                   help="in-process loop: skip the plain loop (the same steps without the wrapper) it is compared with")
    p.add_argument("--codec-numel", type=int, default=None,
                   help="elements of the codec check's tensor (default 2^24; --smoke-cpu: 4096; 0 skips it)")
    p.add_argument("--codec-repeats", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N functions with the most cumulative time inside diloco.step() (cProfile)")
    p.add_argument("--device", default=None,
                   help="where the model runs (default cuda:0; 'cpu' runs the in-process loop there: the tests do)")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="run every part on the CPU with the tiny preset and a few steps: checks the code path, "
                        "gives no GPU figure")
    p.add_argument("--peer-timeout", type=float, default=3600.0, help="bound on one peers or CPU run (s)")
    p.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/gpu.json; --smoke-cpu: "
                                               "a temporary file)")
    p.add_argument("--plain-worker", metavar="JSON", default=None, help=argparse.SUPPRESS)  # one plain-loop process
    args = p.parse_args(argv)
    smoke = args.smoke_cpu
    defaults = {"presets": (["tiny"] if smoke else ["tiny", "100M"]), "steps": 6 if smoke else 300,
                "warmup": 2 if smoke else 20, "batch_size": 2 if smoke else 16, "seq_len": 32 if smoke else 512,
                "inner_steps": 4 if smoke else 100, "codec_numel": 4096 if smoke else 1 << 24,
                "device": "cpu" if smoke else "cuda:0",
                "out": (str(Path(tempfile.gettempdir()) / "gpu-smoke-cpu.json") if smoke
                        else str(RESULTS_DIR / "gpu.json"))}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if smoke and args.device != "cpu":
        p.error("--smoke-cpu runs on the CPU: drop --device")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedTransport:
    """Seconds the training thread spends inside a transport's ``all_reduce`` (the one-member
    LocalSwarm's encode, reduce, decode: what a peer's averaging service does in the background). On
    CUDA the staging thread launches the rounds (``algorithm/staging.py``): nothing is counted there."""

    def __init__(self, transport: Any):
        self.seconds = 0.0
        self._all_reduce = transport.all_reduce
        self._thread = threading.get_ident()  # the training thread's time only: on CUDA the launch runs elsewhere
        transport.all_reduce = self

    def __call__(self, *a, **k):
        if threading.get_ident() != self._thread:
            return self._all_reduce(*a, **k)
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
    from opendiloco_stream.train.loop import inner_step
    from opendiloco_stream.train.loss import use_bf16_autocast

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


# ---------------------------------------------------------------------------- the peers
def _cli(*args: str, timeout: float, log: Path) -> None:
    """``python -m opendiloco_stream ARGS``; its output in ``log``; a failure raises with its end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", *args], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"opendiloco-stream {args[0]} exited with {proc.returncode}; end of {log}:\n"
                           f"{log.read_text()[-2000:]}")


def _run_flags(name: str, args: argparse.Namespace, metrics: Path) -> list[str]:
    return ["--model", name, "--mode", args.mode, "--codec", args.codec, "--fragments", str(args.fragments),
            "--inner-steps", str(args.inner_steps), "--steps", str(args.warmup + args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--metrics-file", str(metrics),
            "--no-progress"]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _largest_fragment_numel(name: str, args: argparse.Namespace, vocab: int) -> int:
    """The largest fragment's elements (the model built on the meta device: shapes only)."""
    from opendiloco_stream.algorithm.fragments import partition
    from opendiloco_stream.train.models import build_model, transformer_blocks

    with torch.device("meta"):
        model = build_model(name, vocab_size=vocab, seq_len=args.seq_len)
    return max(f.numel for f in partition(model, transformer_blocks(model), args.fragments))


def plain_processes(name: str, args: argparse.Namespace, vocab: int, workdir: Path) -> list[dict[str, Any]]:
    """The plain loop as two processes on the device at the same time (what the two peers share)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    spec = {"preset": name, "device": args.device, "steps": args.steps, "warmup": args.warmup,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "vocab_size": vocab, "precision": args.precision,
            "mode": args.mode, "codec": args.codec, "fragments": args.fragments, "inner_steps": args.inner_steps,
            "outer_device": args.outer_device}
    procs = []
    for r in range(2):
        out = workdir / f"plain-{r}.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--plain-worker", json.dumps({**spec, "out": str(out)})]
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True), out))
    rows = []
    for proc, out in procs:
        _, err = proc.communicate(timeout=args.peer_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a plain-loop process exited with {proc.returncode}: {err[-2000:]}")
        rows.append(json.loads(out.read_text()))
    return rows


def _plain_worker(spec_json: str) -> int:
    spec = json.loads(spec_json)
    if spec["device"] == "cpu":  # as the two peers of a local run share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    args = argparse.Namespace(**{k: v for k, v in spec.items() if k not in ("preset", "device", "out")}, profile=0)
    row = run_preset(spec["preset"], args, device=spec["device"], wrapper=False)
    Path(spec["out"]).write_text(json.dumps(row))
    return 0


def _peer_figures(records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Per peer (rank): tokens/s over the steps after ``warmup`` (from the step records' times),
    the training thread's mean time in ``diloco.step()`` and its share, peak GPU memory, eval loss,
    where the outer state lived."""
    peers = []
    for rank in sorted({r["rank"] for r in records if r.get("event") == "step"}):
        steps = [r for r in records if r.get("event") == "step" and r["rank"] == rank]
        timed = [r for r in steps if r["step"] > warmup]
        start = next(r["t"] for r in steps if r["step"] == warmup) if warmup else 0.0
        span = timed[-1]["t"] - start
        summary = next(r for r in records if r.get("event") == "summary" and r.get("rank") == rank)
        placed = next((r for r in records if r.get("event") == "outer_state" and r.get("rank") == rank), {})
        wrapper = sum(r["sync_s"] for r in timed)
        peers.append({"rank": rank, "timed_steps": len(timed), "tokens_per_s": sum(r["tokens"] for r in timed) / span,
                      "wrapper_ms_per_step": 1e3 * wrapper / len(timed), "wrapper_share": wrapper / span,
                      "wrapper_ms_max": 1e3 * max(r["sync_s"] for r in timed),
                      "peak_memory_gib": summary.get("peak_gpu_memory_bytes", 0) / GiB,
                      "eval_loss": summary["eval_loss"], "device": summary.get("device"),
                      "outer_device": summary.get("outer_device"), "outer_state_gib": placed.get("bytes", 0) / GiB,
                      "outer_state_reason": placed.get("reason")})
    return peers


def run_peers(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Part 1 (and 2): two peers on the device, two plain-loop processes, the CPU reference."""
    from opendiloco_stream.train.data import load_tokenizer

    vocab = load_tokenizer(None).vocab_size  # the built-in corpus' byte-level tokenizer
    print(f"{name}: two plain-loop processes on {args.device} ...", file=sys.stderr, flush=True)
    plain = plain_processes(name, args, vocab, workdir)
    print(f"{name}: two peers on {args.device} (averaging service, 127.0.0.1) ...", file=sys.stderr, flush=True)
    metrics = workdir / f"peers-{name}.jsonl"
    device_flags = [] if args.device == "cuda:0" else ["--device", args.device]  # cuda:0 is what 'auto' picks
    _cli("local", "--transport", "hivemind", "--workers", "2", *_run_flags(name, args, metrics), *device_flags,
         "--precision", args.precision, "--outer-device", args.outer_device,
         timeout=args.peer_timeout, log=workdir / f"peers-{name}.log")
    peers = _peer_figures(_records(metrics), args.warmup)
    fragment_gib = 4 * _largest_fragment_numel(name, args, vocab) / GiB
    plain_tps = sum(r["tokens_per_s"] for r in plain)
    plain_peak = max(r["peak_memory_gib"] for r in plain)
    peak = max(p["peak_memory_gib"] for p in peers)
    outer_on_gpu = max(p["outer_state_gib"] for p in peers if not str(p["outer_device"]).startswith("cpu")) \
        if any(not str(p["outer_device"]).startswith("cpu") for p in peers) else 0.0
    row = {"preset": name, "device": args.device, "peers": peers, "plain": plain,
           "tokens_per_s": sum(p["tokens_per_s"] for p in peers), "plain_tokens_per_s": plain_tps,
           "tokens_per_s_vs_plain": sum(p["tokens_per_s"] for p in peers) / plain_tps,
           "wrapper_ms_per_step": max(p["wrapper_ms_per_step"] for p in peers),
           "wrapper_share": max(p["wrapper_share"] for p in peers),
           "peak_memory_gib": peak, "plain_peak_memory_gib": plain_peak, "extra_memory_gib": peak - plain_peak,
           "memory_bound_gib": outer_on_gpu + fragment_gib, "largest_fragment_gib": fragment_gib,
           "outer_device": peers[0]["outer_device"], "eval_loss": sum(p["eval_loss"] for p in peers) / len(peers),
           "precision": "bf16 autocast" if args.device.startswith("cuda") and args.precision != "fp32" else "fp32"}
    if args.cpu_reference:
        print(f"{name}: the CPU reference (two workers, in-process, fp32) ...", file=sys.stderr, flush=True)
        cpu_metrics = workdir / f"cpu-{name}.jsonl"
        _cli("local", "--workers", "2", *_run_flags(name, args, cpu_metrics), "--device", "cpu", "--precision",
             "fp32", timeout=args.peer_timeout, log=workdir / f"cpu-{name}.log")
        cpu = next(r for r in _records(cpu_metrics) if r.get("event") == "summary")
        peer_tokens = sum(r["tokens"] for r in _records(metrics) if r.get("event") == "step")
        row.update(cpu_eval_loss=cpu["eval_loss"], cpu_tokens=cpu["tokens"], peer_tokens=peer_tokens,
                   eval_loss_vs_cpu=row["eval_loss"] - cpu["eval_loss"])
    return row


def _peer_table(rows: list[dict[str, Any]]) -> str:
    na = "-"
    return markdown_table(
        ["preset", "peers tokens/s", "2 plain loops tokens/s", "vs plain", "wrapper ms/step (training thread)",
         "wrapper share", "peak GPU memory (GiB)", "plain loop peak (GiB)", "extra (GiB)",
         "bound: outer state on GPU + one fragment (GiB)", "outer state", "eval loss", "CPU eval loss (fp32)"],
        [[r["preset"], f"{r['tokens_per_s']:,.0f}", f"{r['plain_tokens_per_s']:,.0f}",
          f"{r['tokens_per_s_vs_plain']:.3f}", f"{r['wrapper_ms_per_step']:.2f}", f"{100 * r['wrapper_share']:.2f}%",
          f"{r['peak_memory_gib']:.2f}", f"{r['plain_peak_memory_gib']:.2f}", f"{r['extra_memory_gib']:+.2f}",
          f"{r['memory_bound_gib']:.2f}", r["outer_device"], f"{r['eval_loss']:.4f} ({r['precision']})",
          f"{r['cpu_eval_loss']:.4f}" if "cpu_eval_loss" in r else na] for r in rows])


# ---------------------------------------------------------------------------- main
def _loop_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, plain = [], {}
    for name in args.presets:
        if args.plain:
            print(f"{name}: the plain loop in-process ...", file=sys.stderr, flush=True)
            plain[name] = run_preset(name, args, device=args.device, wrapper=False)
        print(f"{name}: with StreamingDiLoCo in-process ...", file=sys.stderr, flush=True)
        rows.append(run_preset(name, args, device=args.device))
    for r in rows:
        ref = plain.get(r["preset"])
        r["plain_tokens_per_s"] = ref["tokens_per_s"] if ref else None
        r["plain_peak_memory_gib"] = ref["peak_memory_gib"] if ref else None
        r["tokens_per_s_vs_plain"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    return rows, plain


def _loop_table(rows: list[dict[str, Any]]) -> str:
    na = "-"
    return markdown_table(
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plain_worker is not None:
        return _plain_worker(args.plain_worker)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or pass --smoke-cpu to check the code path on the CPU", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    label = "CPU SMOKE RUN (tiny preset, a few steps: checks the code path; not a GPU figure)" if args.smoke_cpu \
        else device_name
    settings = (f"{label}; {args.mode} {args.codec}, P={args.fragments}, H={args.inner_steps}, precision "
                f"{args.precision}, outer device {args.outer_device}; batch {args.batch_size} x {args.seq_len}, "
                f"{args.steps} timed steps after {args.warmup}")
    peer_rows = []
    if args.peers:
        workdir = Path(tempfile.mkdtemp(prefix="ods-gpu-bench-"))
        for name in args.presets:
            peer_rows.append(run_peers(name, args, workdir))
        print(f"two peers on one device through the averaging service; {settings}")
        print(_peer_table(peer_rows))
        print(f"(runs' logs and metrics in {workdir})")
    rows, plain = _loop_rows(args) if args.loop else ([], {})
    if rows:
        print(f"\nthe in-process loop; {settings}")
        print(_loop_table(rows))
    codecs = None
    if args.codec_numel > 0:
        print(f"codecs on {args.codec_numel:,} elements ...", file=sys.stderr, flush=True)
        codecs = codec_rows(args.codec_numel, args.codec_repeats, device=args.device)
        print(f"\ncodecs, {codecs['numel']:,} fp32 elements on {label}; memcpy reference (device -> pinned host): "
              f"{codecs['device_to_pinned_host_gb_per_s']:.1f} GB/s")
        print(markdown_table(
            ["codec", "wire bytes", "same bytes as CPU", "same values as CPU", "encode GB/s", "decode GB/s"],
            [[c["codec"], f"{c['wire_bytes']:,}", "yes" if c["same_bytes_as_cpu"] else "NO",
              "yes" if c["same_values_as_cpu"] else "NO", f"{c['encode_gb_per_s']:.2f}", f"{c['decode_gb_per_s']:.2f}"]
             for c in codecs["rows"]]))
    out = write_result(args.out, settings=vars(args), rows=rows, argv=argv, benchmark="gpu", device=device_name,
                       smoke_cpu=args.smoke_cpu, peer_rows=peer_rows, plain_rows=list(plain.values()), codecs=codecs)
    print(f"wrote {relative(out)}" + (" (a CPU smoke run: no GPU figure)" if args.smoke_cpu else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
