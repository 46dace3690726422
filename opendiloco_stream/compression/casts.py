"""Plain-cast formats: fp32 (exact), fp16 and bf16 (round to nearest even, or stochastic).

fp16 and bf16 saturate: finite fp32 values beyond the format's largest finite value (65504 for fp16,
about 3.39e38 for bf16) are sent as that value, never as Inf, so the bytes always decode.
"""

from __future__ import annotations

import torch

CAST_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WIRE_INT = {"fp32": torch.int32, "fp16": torch.int16, "bf16": torch.int16}


def encode_cast(x32: torch.Tensor, fmt: str, generator: torch.Generator | None) -> torch.Tensor:
    """Flat finite fp32 ``x32`` -> payload bytes as a uint8 tensor on the same device."""
    dtype = CAST_DTYPES[fmt]
    if dtype == torch.float32:
        return x32.contiguous().view(torch.uint8)
    limit = torch.finfo(dtype).max
    y = x32.clamp(-limit, limit)
    near = y.to(dtype)
    if generator is not None:
        near = _stochastic(y, near, generator)
    return near.view(torch.uint8)


def _stochastic(y: torch.Tensor, near: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Replace round-to-nearest by an unbiased choice between the two neighbours of each value.

    The other neighbour is one bit pattern away: these formats are sign-magnitude, so pattern + 1
    moves away from zero and pattern - 1 towards it, across subnormals and the zero boundary alike.
    """
    near_f = near.float()
    err = y - near_f
    away = near_f.abs() < y.abs()
    direction = torch.where(away, 1, -1).to(near.view(torch.int16).dtype)
    other = (near.view(torch.int16) + direction).view(near.dtype)
    # P(other) = distance to near / gap; NaN where y is exact (then the comparison is False).
    p = err.abs_().div_((other.float() - near_f).abs_())
    take_other = torch.rand(y.shape, generator=generator, device=y.device) < p
    return torch.where(take_other, other, near)


def decode_cast(payload: torch.Tensor, fmt: str) -> torch.Tensor:
    """Payload bytes (a uint8 tensor the caller owns, any device) -> flat fp32 values.

    For fp32 the result shares memory with ``payload``.
    """
    return payload.view(_WIRE_INT[fmt]).view(CAST_DTYPES[fmt]).float()
