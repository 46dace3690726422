"""Memory per rank of a multi-rank peer: DDP (whole model on every rank) against FSDP2 (``--sharding fsdp``).

    python -m benchmarks.ranks_memory                        # 35M and 100M presets, 2 ranks (~3 min)
    python -m benchmarks.ranks_memory --models tiny --ranks 2  # a smoke run

For each preset and each kind, K gloo ranks on 127.0.0.1 (one child process each, this script with
``--child``) build the model, wrap it (``DistributedDataParallel``, or ``fully_shard`` per block and
root as ``train/sharded.py`` does), create AdamW and take ``--steps`` inner steps on random tokens.
Each rank then reports:

- ``state_mib``: the bytes of the tensors the inner loop keeps between steps on this rank (its
  parameters, their gradients, AdamW's moments: local shards under FSDP2), counted by torch
  (storages, each once): no allocator involved. DDP's gradient buckets are not included.
- ``peak_extra_mib``: peak RSS (VmHWM) minus the RSS before the model was built: everything,
  activations and communication buffers included.

No StreamingDiLoCo here: the outer state is rank 0's either way (``--outer-device cpu`` puts it in
host memory; ``benchmarks/memory.py`` measures it). On CPU this shows the split of the inner state,
not GPU figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.procfs import status_kib as _rss_kib
from benchmarks.harness.results import REPO_ROOT, RESULTS_DIR, markdown_table, write_result

MiB = 1 << 20


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from opendiloco_stream.train.loop import inner_step
    from opendiloco_stream.train.models import build_model, transformer_blocks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    base = _rss_kib("VmRSS")
    model = build_model(args.model, vocab_size=args.vocab, seq_len=args.seq_len, seed=0, dtype=torch.float32)
    if args.kind == "fsdp":
        from opendiloco_stream.train.sharded import shard_model

        shard_model(model, transformer_blocks(model), torch.device("cpu"), args.world)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(args.rank)
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
        inner_step(net, opt, batch, set_to_none=False)  # gradients stay allocated, as between two steps of a run
    params = list(model.parameters())
    moments = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    state = _storage_bytes(params) + _storage_bytes(p.grad for p in params) + _storage_bytes(moments)
    numel = sum(p.numel() for p in params)
    print(json.dumps({"rank": args.rank, "params": numel, "state_mib": state / MiB,
                      "peak_extra_mib": (_rss_kib("VmHWM") - base) / 1024}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: str, kind: str, ranks: int, steps: int, timeout: float) -> dict:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.ranks_memory", "--child", "--model", model, "--kind",
                               kind, "--rank", str(r), "--world", str(ranks), "--steps", str(steps)],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env=env)
             for r in range(ranks)]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{model} {kind}: a rank exited with {p.returncode}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"model": model, "kind": kind, "ranks": ranks, "params": out[0]["params"],
            "state_mib_per_rank": max(r["state_mib"] for r in out),
            "peak_extra_mib_per_rank": max(r["peak_extra_mib"] for r in out), "per_rank": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["35M", "100M"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="per configuration (s)")
    p.add_argument("--out", type=Path, default=None)
    # child-only
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=32000, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for model in args.models:
        for kind in ("ddp", "fsdp"):
            print(f"{model} {kind} x {args.ranks} ranks ...", file=sys.stderr, flush=True)
            rows.append(measure(model, kind, args.ranks, args.steps, args.timeout))
    table = []
    for model in args.models:
        ddp, fsdp = [next(r for r in rows if r["model"] == model and r["kind"] == k) for k in ("ddp", "fsdp")]
        table.append([model, f"{ddp['params'] / 1e6:.1f}M", f"{ddp['state_mib_per_rank']:.0f}",
                      f"{fsdp['state_mib_per_rank']:.0f}", f"{fsdp['state_mib_per_rank'] / ddp['state_mib_per_rank']:.2f}",
                      f"{ddp['peak_extra_mib_per_rank']:.0f}", f"{fsdp['peak_extra_mib_per_rank']:.0f}"])
    print(markdown_table(["model", "params", "DDP state MiB/rank", "FSDP2 state MiB/rank", "ratio",
                          "DDP peak extra MiB/rank", "FSDP2 peak extra MiB/rank"], table))
    out = args.out or RESULTS_DIR / "ranks-memory.json"
    settings = {k: v for k, v in vars(args).items() if k in ("models", "ranks", "steps", "timeout", "out")}
    write_result(out, settings=settings, rows=rows, benchmark="ranks_memory")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
