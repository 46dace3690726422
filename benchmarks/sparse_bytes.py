"""Bytes per peer of a sparse round, and bytes per token against data-parallel fp32, as a function of M.

Computed from the codecs' exact encoded sizes and the reduction's layout (``transport/reduce.py``),
checked against what ``reduce_in_process`` counts (the bytes ``LocalSwarm`` reports) for one round
of a 1M-element fragment at each M. No network: the WAN benchmark measures the same payloads plus
framing (0.01-0.06 % at 1 MiB chunks, docs/architecture.md).

    python -m benchmarks.sparse_bytes                      # markdown table (docs/sparse.md)
    python -m benchmarks.sparse_bytes --numel 2000000 --inner-steps 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness.results import RESULTS_DIR, write_result
from opendiloco_stream.compression import get_codec
from opendiloco_stream.transport.reduce import reduce_in_process


def peer_bits_per_value(name: str, density: float, M: int, numel: int, check: bool) -> float:
    """Bits each peer sends per fragment value in one round among M peers (measured in-process)."""
    codec = get_codec(name, density=density)
    if check:
        gen = torch.Generator().manual_seed(M)
        tensors = [torch.randn(numel, generator=gen) for _ in range(M)]
        outcomes = reduce_in_process(codec, tensors, [1.0] * M, (0, 0), norm_bound=None)
        return 8 * max(o.bytes_sent for o in outcomes) / numel
    part = numel // M
    contrib = codec.encoded_size(part)
    result = codec.result_codec(M)
    result_bytes = (4 + 8 * M + M * contrib) if result is None else result.encoded_size(part)
    return 8 * ((M - 1) * contrib + (M - 1) * result_bytes) / numel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--inner-steps", type=int, default=100, help="H (data-parallel syncs H times per outer round)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--no-check", action="store_true", help="formula only (no in-process round)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sparse-bytes.json", help="JSON results (default: %(default)s)")
    args = p.parse_args(argv)
    H, n = args.inner_steps, args.numel
    rows = [("fp32", 1.0), ("fp4-e3m0", 1.0), ("topk-int2", 0.01), ("topk-int2", 0.02), ("topk-int2", 0.05)]
    print(f"| codec | density | M | result | bits sent / value / peer / round | vs fp32 DiLoCo | "
          f"vs data-parallel fp32 (H={H}) |")
    print("|---|---:|---:|---|---:|---:|---:|")
    table = []
    for M in args.workers:
        dp = None
        for name, density in rows:
            bits = peer_bits_per_value(name, density, M, n, check=not args.no_check and M <= 8)
            if name == "fp32":
                dp = bits  # data-parallel fp32 sends one fp32 round per inner step
            result = get_codec(name, density=density).result_codec(M)
            how = "forwarded contributions" if result is None else f"mean in {result.name}"
            print(f"| {name} | {density if name.startswith('topk') else '—'} | {M} | {how} | {bits:.3f} | "
                  f"{dp / bits:.1f}x | {H * dp / bits:,.0f}x |")
            table.append({"codec": name, "density": density, "workers": M, "result": how, "bits_per_value": bits,
                          "vs_fp32_diloco": dp / bits, "vs_data_parallel_fp32": H * dp / bits})
    write_result(args.out, settings=vars(args), rows=table, argv=argv, benchmark="sparse_bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
