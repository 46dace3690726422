"""Block-scaled quantization kernels: int8, fp8-e4m3, fp4-e3m0, fp4-e2m1.

Every format is symmetric: a block of ``block_size`` consecutive values (the flattened tensor cut
into blocks; the last one may be short) is divided by ``step = scale / top`` and each quotient is
rounded to one of the format's magnitudes ``levels`` (``levels[0] == 0``, ``levels[-1] == top``)
with a sign. ``scale`` is the block's absmax, stored in the scale dtype, so the block's largest
magnitude lands on ``top``.

Code tables (magnitudes; a decoded value is ``sign * level * step``):

- ``int8``: levels 0..127 (top 127); codes are two's-complement int8 in -127..127.
- ``fp8-e4m3``: the 127 finite non-negative ``float8_e4m3fn`` values (top 448); the code byte is the
  e4m3 bit pattern (sign in bit 7), so it decodes with a plain cast.
- ``fp4-e3m0`` (sign + 3-bit exponent, no mantissa; the Streaming DiLoCo format): code 0 is zero and
  codes 1..7 are 2^(c-7), i.e. magnitudes {0, 2^-6, 2^-5, 2^-4, 2^-3, 2^-2, 2^-1, 1}; top 1, so
  ``step == scale`` and every decoded value is 0 or +-2^k * scale with -6 <= k <= 0.
- ``fp4-e2m1`` (OCP MX FP4): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; top 6, ``step = scale / 6``.

4-bit codes are sign-magnitude nibbles (bit 3 = sign, bits 0-2 = magnitude index); element 2i goes
in the low nibble of byte i and element 2i+1 in the high nibble. An odd numel leaves the last high
nibble zero (the decoder checks it).

Rounding: to nearest in the value domain. Ties go to the smaller magnitude for the 4-bit tables and
to even for int8 (``torch.round``) and fp8 (the cast). With a generator, rounding is stochastic
between the two neighbouring levels with probability proportional to proximity, which makes the
decoded value unbiased.

Scales: fp32 scales store the absmax exactly. fp16 scales round the absmax *up* to the next fp16
value (so no value is clipped by scale rounding) and are clamped into the fp16 range: an absmax
below 2^-24 is stored as 2^-24 (such blocks lose resolution, never correctness); an absmax above
65504 is stored as 65504 and that block's larger values saturate to +-65504 (use fp32 scales for
data that large). An all-zero block has scale 0 and decodes to zeros.
"""

from __future__ import annotations

import functools

import torch

from opendiloco_stream.compression import native
from opendiloco_stream.compression.wire import NonFiniteError

FP16_MAX = 65504.0

_FP4_LEVELS = {
    "fp4-e3m0": [0.0] + [2.0 ** (c - 7) for c in range(1, 8)],
    "fp4-e2m1": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
}


@functools.lru_cache(maxsize=None)
def _levels_list(fmt: str) -> list[float]:
    if fmt == "int8":
        return [float(i) for i in range(128)]
    if fmt == "fp8-e4m3":
        # Codes 0x00..0x7E are the finite non-negative e4m3 values in increasing order (0x7F is NaN).
        return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    return list(_FP4_LEVELS[fmt])


def levels(fmt: str) -> torch.Tensor:
    """The format's non-negative magnitudes in increasing order (fp32, CPU)."""
    return torch.tensor(_levels_list(fmt), dtype=torch.float32)


def top(fmt: str) -> float:
    """The largest magnitude of the format: where a block's absmax lands."""
    return _levels_list(fmt)[-1]


@functools.lru_cache(maxsize=64)
def _tables(fmt: str, device: torch.device) -> dict[str, torch.Tensor]:
    lv = levels(fmt)
    gaps = lv[1:] - lv[:-1]
    tables = {"levels": lv, "gaps": gaps}
    if fmt in _FP4_LEVELS:
        signed = torch.cat([lv, -lv])  # nibble c -> value; c = 8 decodes to -0.0
        byte = torch.arange(256)
        # byte -> (low-nibble value, high-nibble value): decoding unpacks and looks up in one gather.
        tables["decode"] = torch.stack([signed[byte & 15], signed[byte >> 4]], dim=1).contiguous()
        tables["nibbles"] = signed  # the native decoder's table
        tables["mids"] = (lv[:-1] + lv[1:]) / 2  # the native encoder's thresholds (exact: dyadic levels)
    elif fmt == "int8":
        tables["bytes"] = torch.arange(256, dtype=torch.uint8).view(torch.int8).float()  # native decoder
    elif fmt == "fp8-e4m3":
        # A 256-entry lookup is ~5x faster than the fp8 -> fp32 cast on CPU, and equal by construction.
        tables["decode"] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        tables["bytes"] = tables["decode"]
    return {k: v.to(device) for k, v in tables.items()}


def store_scales(amax: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Block absmax (fp32) -> stored scales, rounded up and clamped as the module docstring says."""
    if scale_dtype == "fp32":
        return amax
    clamped = amax.clamp(max=FP16_MAX)
    stored = clamped.to(torch.float16)
    # Positive fp16 bit patterns are ordered like their values, so +1 is the next value up.
    bump = (stored.float() < clamped).to(torch.int16)
    return (stored.view(torch.int16) + bump).view(torch.float16)


def block_steps(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored scales -> fp32 step per block (``scale / top``), identical on every device.

    The divisor is a full tensor on purpose: CUDA turns division by a CPU scalar into a multiply by
    its reciprocal, which can differ from true division in the last bit.
    """
    scales = scales.float()
    return scales / torch.full_like(scales, top(fmt))


def quantize(
    x: torch.Tensor, fmt: str, block_size: int, scale_dtype: str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize flat ``x`` (any float dtype) -> (stored scales, code bytes uint8).

    Raises ``NonFiniteError`` if ``x`` holds NaN or Inf: a NaN/Inf anywhere in a block makes that
    block's absmax non-finite, which is cheaper to check than a separate pass over ``x``.
    """
    numel = x.numel()
    if generator is None and fmt != "fp8-e4m3" and x.dtype == torch.float32 and native.usable(x):
        return _quantize_native(x, fmt, block_size, scale_dtype)
    n_blocks = -(-numel // block_size)
    # One fp32 working buffer, padded to whole blocks, doubles as the quotient y = x / step.
    y = torch.empty(n_blocks * block_size, dtype=torch.float32, device=x.device)
    y[:numel].copy_(x)
    y[numel:].zero_()
    yb = y.view(n_blocks, block_size)
    # Two plain reductions: faster than aminmax on CPU and no |y| temporary.
    # abs_: an all-zero block's absmax is +0 whatever the signs of its zeros (as the native kernel)
    amax = torch.maximum(yb.amax(dim=1), yb.amin(dim=1).neg()).abs_()
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteError(f"cannot encode a tensor holding NaN or Inf ({fmt}, numel={numel})")
    scales = store_scales(amax, scale_dtype)
    step = block_steps(scales, fmt)
    yb.div_(torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1))
    limit = top(fmt)
    y.clamp_(-limit, limit)

    if fmt == "int8":
        if generator is None:
            y.round_()
        else:
            y.add_(_uniform(y, generator)).floor_()
        codes = y.to(torch.int8).view(torch.uint8)
    elif fmt == "fp8-e4m3" and generator is None:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        sign_bit = 7 if fmt == "fp8-e4m3" else 3
        codes = _round_table(y, fmt, sign_bit, generator)

    if fmt in _FP4_LEVELS:
        codes = _pack_nibbles(codes, numel)
    else:
        codes = codes[:numel]
    return scales, codes


def _quantize_native(x: torch.Tensor, fmt: str, block_size: int, scale_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` of a contiguous fp32 CPU tensor, round to nearest, in the C kernels (same bytes)."""
    amax, finite = native.block_absmax(x, block_size)
    if not finite:
        raise NonFiniteError(f"cannot encode a tensor holding NaN or Inf ({fmt}, numel={x.numel()})")
    scales = store_scales(amax, scale_dtype)
    step = block_steps(scales, fmt)
    if fmt == "int8":
        return scales, native.quantize_int8(x, block_size, step)
    return scales, native.quantize4(x, block_size, step, _tables(fmt, x.device)["mids"], top(fmt))


def _uniform(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)


def _round_table(y: torch.Tensor, fmt: str, sign_bit: int, generator: torch.Generator | None) -> torch.Tensor:
    """Sign-magnitude codes (uint8) of y, |y| <= top, rounded onto the format's level table."""
    t = _tables(fmt, y.device)
    lv = _levels_list(fmt)
    negative = y < 0
    a = y.abs_()
    if generator is None:
        # Count the midpoints strictly below a: a tie goes to the smaller level.
        mids = [(lo + hi) / 2 for lo, hi in zip(lv[:-1], lv[1:])]
        mag = _count_below(a, mids, strict=True, dtype=torch.uint8, in_place=True)
    else:
        # Index of the largest level <= a, at most the second-highest so that mag + 1 exists.
        if fmt == "fp8-e4m3":
            # e4m3 codes are ordered like their values: the nearest code, minus one if above a.
            mag = a.to(torch.float8_e4m3fn).view(torch.uint8).int()
            mag.sub_((torch.index_select(t["levels"], 0, mag) > a).int())
        else:
            mag = _count_below(a, lv[1:], strict=False, dtype=torch.int32)
        mag.clamp_(0, len(lv) - 2)
        # a becomes the fraction of the way from the lower level to the next one: P(round up).
        a.sub_(torch.index_select(t["levels"], 0, mag)).div_(torch.index_select(t["gaps"], 0, mag))
        mag.add_(_uniform(a, generator) < a)
    codes = mag.to(torch.uint8)
    codes.bitwise_or_(negative.to(torch.uint8) << sign_bit)
    return codes


def _count_below(
    a: torch.Tensor, bounds: list[float], strict: bool, dtype: torch.dtype, in_place: bool = False
) -> torch.Tensor:
    """Per element of ``a`` (0 <= a < 2 * bounds[-1]), how many ascending bounds are < a (strict) or <= a.

    ``in_place`` lets it overwrite ``a`` to save a full-size temporary.
    """
    # All bounds of the 4-bit tables are integer multiples of a power of two `unit`, so with
    # k = ceil(a / unit) (strict) or floor(a / unit) the count is a lookup: a few cheap passes
    # instead of a binary search (bucketize is ~3x slower on CPU).
    unit, table = _grid(tuple(bounds), strict, dtype, a.device)
    k = a.mul_(1.0 / unit) if in_place else a * (1.0 / unit)  # exact: unit is a power of two
    k = k.ceil_() if strict else k.floor_()
    return torch.index_select(table, 0, k.int().clamp_(0, table.numel() - 1))


@functools.lru_cache(maxsize=64)
def _grid(
    bounds: tuple[float, ...], strict: bool, dtype: torch.dtype, device: torch.device
) -> tuple[float, torch.Tensor]:
    unit = 1.0
    while any(b / unit != int(b / unit) for b in bounds):
        unit /= 2
    size = int(2 * bounds[-1] / unit) + 2  # a is clamped to the format's top, below 2 * bounds[-1]
    steps = [int(b / unit) for b in bounds]
    k = torch.arange(size)
    table = sum(((k > s) if strict else (k >= s)).to(torch.int32) for s in steps)
    return unit, table.to(dtype=dtype, device=device)


def _pack_nibbles(codes: torch.Tensor, numel: int) -> torch.Tensor:
    n_pairs = (numel + 1) // 2
    if codes.numel() < 2 * n_pairs:  # odd numel filling its last block exactly
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes[: 2 * n_pairs].view(n_pairs, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


# (mask, value): 8-bit codes c with c & mask == value are no encoder's (int8 -128, fp8 NaN)
_FORBIDDEN = {"int8": (0xFF, 0x80), "fp8-e4m3": (0x7F, 0x7F)}


def dequantize(scales: torch.Tensor, codes: torch.Tensor, fmt: str, numel: int, block_size: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored scales + code bytes (on one device) -> flat fp32 values of length numel.

    ``out`` (optional, a contiguous fp32 tensor of numel values on the codes' device) receives
    the values, saving a copy where the native decoder runs; the return value is then ``out``.

    Raises ``ValueError`` for scales or codes no encoder produces (negative scales, int8 -128,
    fp8 NaN patterns, a non-zero padding nibble) and ``NonFiniteError`` for NaN/Inf scales.
    """
    scales = scales.float()
    if not bool(torch.isfinite(scales).all()):
        raise NonFiniteError(f"malformed {fmt} data: a block scale is NaN or Inf")
    if bool((scales < 0).any()):
        raise ValueError(f"malformed {fmt} data: a block scale is negative")
    step = block_steps(scales, fmt)
    if fmt in _FP4_LEVELS and numel % 2 and int(codes[-1]) >> 4:
        raise ValueError(f"malformed {fmt} data: the padding nibble after the last value is not zero")
    if native.usable(codes) and (out is None or (out.dtype == torch.float32 and native.usable(out))):
        table = _tables(fmt, codes.device)["nibbles" if fmt in _FP4_LEVELS else "bytes"]
        target = torch.empty(numel, dtype=torch.float32) if out is None else out
        if native.dequantize(codes, numel, block_size, step, table, target, _FORBIDDEN.get(fmt, (0, 1))):
            return target
    if fmt == "int8" and bool((codes == 0x80).any()):
        raise ValueError("malformed int8 data: code -128 is outside the symmetric range -127..127")
    if fmt == "fp8-e4m3" and bool(((codes & 0x7F) == 0x7F).any()):
        raise ValueError("malformed fp8-e4m3 data: NaN code")
    if fmt == "int8":
        values = codes.view(torch.int8).float()
    elif fmt == "fp8-e4m3":
        values = torch.index_select(_tables(fmt, codes.device)["decode"], 0, codes.int())
    else:
        values = torch.index_select(_tables(fmt, codes.device)["decode"], 0, codes.int()).view(-1)
    # Scale whole blocks through a 2-D view and the short last block apart: no padded copy.
    n_full = numel // block_size
    values[: n_full * block_size].view(n_full, block_size).mul_(step[:n_full].unsqueeze(1))
    if n_full * block_size < numel:
        values[n_full * block_size : numel].mul_(step[n_full])
    if out is not None:
        return out.copy_(values[:numel])
    return values[:numel]
