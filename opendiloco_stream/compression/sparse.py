"""Sparse codecs: per chunk, the top-k entries by magnitude, their values at 2 or 4 bits.

``topk-int2`` / ``topk-int4`` (SparseLoCo, arXiv 2508.15706, without its DCT): the flat tensor is
cut into chunks of ``block`` values (the last one may be short). Per chunk:

- *Selection*: the ``k`` entries of largest magnitude (``k = min(k, chunk length)``), ties to the
  lower index, so the same input always gives the same bytes. Everything else decodes to 0; with
  error feedback (on by default for these codecs) it is carried into the next round.
- *Scale*: int4: the chunk's absmax; int2: the mean magnitude of the kept values (one level per
  sign: the least-squares level for the kept signs; the top-k magnitudes of a chunk are close to
  each other, the absmax would overstate most of them by ~40 %). Stored like the block codecs'
  scales (``blockwise.store_scales``: fp16 rounded up).
- *Values*: int2: the sign (-1, +1; 0 only for an exact zero), decoded as ``sign * scale``; int4:
  ``round(v / step)`` with ``step = scale / 7``, levels -7..7, ties to even (a kept value below
  half a step decodes to 0). Codes are two's complement in 2 / 4 bits; -2 / -8 are invalid.
- *Indices*: in-chunk positions, ascending, ``wire.index_bits(block)`` bits each (10 bits for the
  default 1024-value chunk).

Bytes (``wire.py``): header, one scale per chunk, the index bit stream, the value bit stream.
Cost per value at density ``k / block``: ``scale_bits / block + density * (index_bits + value_bits)``:
``topk-int2`` with 1024-value chunks, k = 20 (2 %) and fp16 scales is 0.25 bits per value (128x
below fp32).

A reduction does not re-sparsify: its result is the accepted contributions themselves, which every
member averages in the same order (``Codec.result_codec``, ``transport/reduce.py``, docs/sparse.md).
"""

from __future__ import annotations

import numpy as np
import torch

from opendiloco_stream.compression import native
from opendiloco_stream.compression.blockwise import store_scales
from opendiloco_stream.compression.wire import CODE_BITS, NonFiniteError, WireHeader, index_bits

TOP = {"topk-int2": 1, "topk-int4": 7}
DEFAULT_CHUNK = 1024


def k_for(density: float, block_size: int) -> int:
    """Values kept per chunk for ``density`` (at least 1, at most the chunk)."""
    return max(1, min(block_size, round(density * block_size)))


def _steps(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    scales = scales.float()
    return scales / torch.full_like(scales, float(TOP[fmt]))  # true division, as blockwise.block_steps


def pack_bits(values: torch.Tensor, bits: int) -> np.ndarray:
    """Non-negative integers < 2**bits -> LSB-first bit stream, zero-padded to whole bytes."""
    v = values.to(torch.int64).cpu()
    planes = ((v.unsqueeze(1) >> torch.arange(bits)) & 1).to(torch.uint8).numpy()
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(data: np.ndarray, count: int, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``; raises ``ValueError`` if the padding bits are not zero."""
    planes = np.unpackbits(data, bitorder="little")
    if planes[count * bits :].any():
        raise ValueError("malformed sparse data: padding bits after the last entry are not zero")
    planes = torch.from_numpy(planes[: count * bits].astype(np.int64)).view(count, bits)
    return (planes << torch.arange(bits)).sum(dim=1)


def quantize(x: torch.Tensor, fmt: str, block_size: int, k: int, scale_dtype: str
             ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Flat ``x`` -> (stored scales, packed indices, packed values). Raises ``NonFiniteError``."""
    numel = x.numel()
    if numel == 0:
        return torch.zeros(0, dtype=torch.float16 if scale_dtype == "fp16" else torch.float32), *(
            np.zeros(0, np.uint8),) * 2
    n_chunks = -(-numel // block_size)
    flat = x.detach().reshape(-1)
    y = torch.zeros(n_chunks * block_size, dtype=torch.float32)
    y[:numel].copy_(flat)
    yb = y.view(n_chunks, block_size)
    fast = flat.dtype == torch.float32 and native.usable(flat)  # the C kernels: same choice, same scales
    if fast:
        amax, finite = native.block_absmax(flat, block_size)
    else:
        a = yb.abs()
        amax = a.amax(dim=1)
        finite = bool(torch.isfinite(amax).all())
    if not finite:
        raise NonFiniteError(f"cannot encode a tensor holding NaN or Inf ({fmt}, numel={numel})")
    if fast:
        idx = native.topk_indices(flat, block_size, k)
    else:
        # Stable descending sort: among equal magnitudes the lower index comes first, so the padding
        # of a short last chunk (zeros after its real entries) is never picked over a real entry.
        order = torch.sort(a, dim=1, descending=True, stable=True).indices[:, :k]
        idx = torch.sort(order, dim=1).values
    vals = torch.gather(yb, 1, idx)
    rest = numel - (n_chunks - 1) * block_size  # length of the last chunk
    keep = torch.ones(n_chunks, k, dtype=torch.bool)
    keep[-1, min(k, rest):] = False
    if fmt == "topk-int2":  # one level per sign: the mean kept magnitude (least squares for the signs)
        level = vals.abs().sum(dim=1) / keep.sum(dim=1).to(torch.float32)
    else:
        level = amax
    scales = store_scales(level, scale_dtype)
    step = _steps(scales, fmt)
    if fmt == "topk-int2":  # every kept value is +-level (0 only for an exact zero)
        q = torch.sign(vals)
    else:
        q = vals.div_(torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1)).round_()
        q.clamp_(-TOP[fmt], TOP[fmt])
    idx, q = idx[keep], q[keep].to(torch.int64)
    bits = CODE_BITS[fmt]
    return scales, pack_bits(idx, index_bits(block_size)), pack_bits(q & ((1 << bits) - 1), bits)


def dequantize(scales: torch.Tensor, indices: np.ndarray, codes: np.ndarray, header: WireHeader) -> torch.Tensor:
    """Stored scales and the two bit streams -> flat fp32 tensor of ``header.numel`` values.

    Raises ``ValueError`` for bytes no encoder produces (indices out of the chunk or not strictly
    ascending, the invalid code, non-zero padding) and ``NonFiniteError`` for NaN/Inf scales.
    """
    fmt, block, k, numel = header.codec, header.block_size, header.k, header.numel
    scales = scales.float()
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError(f"malformed {fmt} data: a chunk scale is NaN or Inf")
    if bool((scales < 0).any()):
        raise ValueError(f"malformed {fmt} data: a chunk scale is negative")
    kept, bits = header.kept, CODE_BITS[fmt]
    idx = unpack_bits(indices, kept, index_bits(block))
    q = unpack_bits(codes, kept, bits)
    q = torch.where(q >= (1 << (bits - 1)), q - (1 << bits), q)  # two's complement
    if bool((q < -TOP[fmt]).any()):
        raise ValueError(f"malformed {fmt} data: code {-(1 << (bits - 1))} is outside the symmetric range")
    chunk = torch.arange(kept) // k  # entries are k per chunk, the last chunk's at most its length
    if kept:
        rest = numel - (chunk[-1].item()) * block
        if bool((idx >= block).any()) or int(idx[chunk == chunk[-1]].max()) >= rest:
            raise ValueError(f"malformed {fmt} data: an index lies outside its chunk")
        same = chunk[1:] == chunk[:-1]
        if bool((idx[1:][same] <= idx[:-1][same]).any()):
            raise ValueError(f"malformed {fmt} data: indices are not strictly ascending within a chunk")
    out = torch.zeros(numel, dtype=torch.float32)
    values = q.float() * _steps(scales, fmt)[chunk]
    out[chunk * block + idx] = values
    return out
