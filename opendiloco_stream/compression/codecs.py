"""Wire codecs: tensor -> self-describing bytes -> flat fp32 tensor.

Choosing a codec (``get_codec(name, block_size=64, scale_dtype="fp16", stochastic=False)``):

- ``fp32`` is exact (32 bits/value); ``fp16`` / ``bf16`` halve the bytes with at most 2^-11 / 2^-8
  (~5e-4 / ~4e-3) relative error per value in their normal range.
- ``int8`` (8 + 16/block bits/value): error at most 1/254 of the block absmax. ``fp8-e4m3`` (same
  size): at most 2^-4 of the value itself for values above 2^-6 / 448 of the block absmax.
- ``fp4-e3m0`` (the Streaming DiLoCo paper's 4-bit format) and ``fp4-e2m1`` (OCP MX FP4) cost
  4 + 16/block bits/value: 4.25 with the default block 64 and fp16 scales.
- ``topk-int2`` / ``topk-int4`` (sparse, ``sparse.py``): per chunk of ``block_size`` values (default
  1024 for them), the ``density`` fraction of largest magnitudes, at 2 / 4 bits with a per-chunk
  scale, plus their indices: ~0.25 bits/value for topk-int2 at density 0.02. Use them with error
  feedback (the config turns it on for them). How a reduction's result travels: ``result_codec(M)``.
- ``block_size`` (8..4096): smaller blocks track local magnitudes better at 16/block (fp16 scales)
  or 32/block (fp32 scales) extra bits per value. The paper's range is 32..128.
- ``stochastic=True`` makes rounding unbiased (useful without error feedback); it draws from a
  ``torch.Generator`` per device seeded with ``seed``, so results depend on the seed and on the order
  of ``encode`` calls. Round-to-nearest (the default) is deterministic: the same input always gives
  the same bytes, which is what lets every peer decode a bit-identical average.

Code tables, tie rules and fp16 scale clamping are documented in ``blockwise.py``; the byte layout
in ``wire.py``. Bytes are little-endian.
"""

from __future__ import annotations

import math
import operator
import sys

import numpy as np
import torch

from opendiloco_stream.compression import blockwise, casts, sparse
from opendiloco_stream.compression.spec import DEFAULT_DENSITY, CodecSpec, is_lossless
from opendiloco_stream.compression.wire import (
    BLOCK_CODECS,
    CODEC_NAMES,
    HEADER_SIZE,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    SCALE_DTYPES,
    SPARSE_CODECS,
    NonFiniteError,
    WireHeader,
    read_header,
)

_SCALE_NUMPY = {"fp16": np.float16, "fp32": np.float32}
_NUMPY_CASTS = {"fp32": np.float32, "fp16": np.float16}  # casts numpy reads (and widens) exactly


def all_finite(tensor: torch.Tensor) -> bool:
    """``bool(torch.isfinite(tensor).all())``, 20-40x faster on CPU for finite tensors: one read-only
    sum instead of a bool tensor (NaN and Inf make the sum non-finite; a finite tensor whose sum
    overflows gets the exact check)."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


class Codec:
    """One wire format with fixed parameters; see the module docstring for how to choose.

    ``encode`` accepts any shape and float dtype on any device (the math runs there in fp32) and
    returns bytes; ``decode`` needs only those bytes and returns a flat fp32 tensor. Instances hold
    no state except the stochastic-rounding generators, so one codec may serve many tensors.
    """

    def __init__(
        self,
        name: str,
        block_size: int | None = None,
        scale_dtype: str = "fp16",
        stochastic: bool = False,
        seed: int | None = None,
        density: float = DEFAULT_DENSITY,
        k: int | None = None,
    ) -> None:
        if name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
        self.is_sparse = name in SPARSE_CODECS
        if block_size is None:
            block_size = sparse.DEFAULT_CHUNK if self.is_sparse else 64
        try:
            block_size = operator.index(block_size)  # accepts numpy integers, rejects 64.0
        except TypeError:
            raise ValueError(f"block_size must be an integer, got {block_size!r}") from None
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, got {block_size}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
        if sys.byteorder != "little":
            raise RuntimeError("the wire format is little-endian; big-endian hosts are not supported")
        if not (isinstance(density, (int, float)) and 0.0 < density <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.name = name
        # Sparse codecs are blockwise too: parts and chunks of a reduction fall on whole chunks.
        self.is_blockwise = name in BLOCK_CODECS or self.is_sparse
        self.block_size = block_size
        self.scale_dtype = scale_dtype
        # Values kept per chunk (sparse codecs only; ``k`` overrides ``density``: result codecs).
        self.k = (k if k is not None else sparse.k_for(density, block_size)) if self.is_sparse else 0
        if self.is_sparse and not 1 <= self.k <= block_size:
            raise ValueError(f"k must be in 1..{block_size}, got {self.k}")
        self.density = self.k / block_size if self.is_sparse else 1.0
        # Stochastic rounding is meaningless for the exact fp32 cast; top-k is biased anyway and
        # relies on error feedback, so sparse codecs always round to nearest.
        self.stochastic = bool(stochastic) and not is_lossless(name) and not self.is_sparse
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def from_spec(cls, spec: CodecSpec, seed: int | None = None) -> "Codec":
        """The codec ``spec`` names (``seed``: stochastic rounding's, reproducible where given)."""
        return cls(spec.name, block_size=spec.block_size, scale_dtype=spec.scale_dtype, stochastic=spec.stochastic,
                   seed=seed, density=spec.density)

    @property
    def lossless(self) -> bool:
        """What this codec sends decodes to its input exactly (fp32)."""
        return is_lossless(self.name)

    def __repr__(self) -> str:
        parts = [repr(self.name)]
        if self.is_blockwise:
            parts += [f"block_size={self.block_size}", f"scale_dtype={self.scale_dtype!r}"]
        if self.is_sparse:
            parts += [f"k={self.k}"]
        if self.stochastic:
            parts += ["stochastic=True", f"seed={self.seed}"]
        return f"Codec({', '.join(parts)})"

    # ---- sizes -----------------------------------------------------------------------------

    def _header(self, numel: int) -> WireHeader:
        if self.is_blockwise:
            return WireHeader(self.name, numel, self.block_size, self.scale_dtype, self.k)
        return WireHeader(self.name, numel, 0, None)

    def encoded_size(self, numel: int) -> int:
        """Exactly ``len(self.encode(t))`` for any ``t`` with ``t.numel() == numel``."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return self._header(numel).total_nbytes

    def result_codec(self, group_size: int) -> "Codec | None":
        """How a reduction's result over ``group_size`` accepted contributions goes on the wire:
        a codec that encodes the fp32 mean once (this codec, for dense codecs), or ``None``: the
        accepted contributions themselves, which every member averages identically (sparse codecs;
        lossless). Sparse codecs switch to a dense ``fp4-e2m1`` mean (block 64) once ``group_size``
        contributions would be larger than it (docs/sparse.md)."""
        if not self.is_sparse:
            return self
        dense = Codec("fp4-e2m1", 64, self.scale_dtype)
        probe = 64 * self.block_size
        return None if group_size * self.encoded_size(probe) <= dense.encoded_size(probe) else dense

    def bits_per_value(self, numel: int) -> float:
        """Wire bits per element, header and scales included."""
        if numel <= 0:
            raise ValueError(f"numel must be positive, got {numel}")
        return 8 * self.encoded_size(numel) / numel

    # ---- encode ----------------------------------------------------------------------------

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if not self.stochastic:
            return None
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Flatten ``tensor`` and encode it; raises ``NonFiniteError`` if it holds NaN or Inf."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"encode expects a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"encode expects a floating-point tensor, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        header = self._header(flat.numel()).pack()
        generator = self._generator(flat.device)
        if self.is_sparse:
            scales, indices, codes = sparse.quantize(flat.cpu(), self.name, self.block_size, self.k, self.scale_dtype)
            return b"".join([header, scales.numpy().tobytes(), indices.tobytes(), codes.tobytes()])
        if self.is_blockwise:
            scales, codes = blockwise.quantize(flat, self.name, self.block_size, self.scale_dtype, generator)
            parts = [scales.view(torch.uint8), codes]
        else:
            x32 = flat.to(torch.float32)
            self._require_finite(x32)
            parts = [casts.encode_cast(x32, self.name, generator)]
        return b"".join([header, *(part.cpu().numpy() for part in parts)])

    def encode_parts(self, tensor: torch.Tensor) -> tuple:
        """``encode(tensor)`` as buffers whose concatenation is those bytes. For fp32 from a
        contiguous fp32 CPU tensor: the header and a view of the tensor's own memory (no copy; the
        caller keeps the tensor unchanged until the parts are sent). Other codecs: ``(encode(tensor),)``."""
        if self.name == "fp32" and tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous():
            flat = tensor.detach().reshape(-1)
            self._require_finite(flat)
            return self._header(flat.numel()).pack(), memoryview(flat.numpy()).cast("B")
        return (self.encode(tensor),)

    def _require_finite(self, x32: torch.Tensor) -> None:
        if not all_finite(x32):
            raise NonFiniteError(f"cannot encode a tensor holding NaN or Inf ({self.name}, numel={x32.numel()})")

    # ---- decode ----------------------------------------------------------------------------

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        numel: int | None = None,
        device: torch.device | str = "cpu",
        share: bool = False,
    ) -> torch.Tensor:
        """Bytes from ``encode`` (of a codec with the same parameters) -> flat fp32 tensor.

        ``numel`` (optional) is the size the receiver expects. Raises ``ValueError`` with one line
        for truncated, malformed or mismatching bytes, ``NonFiniteError`` for NaN/Inf content.
        ``share=True`` lets an fp32 result on the CPU be a view of ``data`` when ``data`` is a
        writable buffer (no copy): the caller must then keep ``data`` alive and unchanged.
        """
        header = self._checked_header(data, numel)
        if share and header.codec == "fp32" and torch.device(device).type == "cpu" and _writable(data) and header.numel:
            values = torch.frombuffer(data, dtype=torch.float32, count=header.numel, offset=HEADER_SIZE)
            if not all_finite(values):
                raise NonFiniteError("malformed fp32 data: it holds NaN or Inf")
            return values
        return decode_with_header(data, header, device)

    def _checked_header(self, data: bytes | bytearray | memoryview, numel: int | None) -> WireHeader:
        header = read_header(data)
        expected = self._header(header.numel)
        if header != expected:
            raise ValueError(f"bytes were encoded as {_describe(header)}, but this codec is {_describe(expected)}")
        if numel is not None and header.numel != numel:
            raise ValueError(f"encoded tensor has {header.numel} elements, expected {numel}")
        return header

    def decode_into(self, data: bytes | bytearray | memoryview, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = decode(data, numel=out.numel())`` (same checks and errors), without an
        intermediate tensor where the format allows it: plain fp32 / fp16 bytes are copied
        straight into ``out`` (a contiguous fp32 CPU tensor). Returns ``out``."""
        if self.name in _NUMPY_CASTS and out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous():
            header = self._checked_header(data, out.numel())
            np.copyto(out.numpy(), np.frombuffer(data, dtype=_NUMPY_CASTS[self.name], count=header.numel,
                                                 offset=HEADER_SIZE))
            if not all_finite(out):
                raise NonFiniteError(f"malformed {self.name} data: it holds NaN or Inf")
            return out
        if self.name in BLOCK_CODECS:  # straight into out where the native decoder runs (blockwise.dequantize)
            return decode_with_header(data, self._checked_header(data, out.numel()), out.device, out=out)
        return out.copy_(self.decode(data, numel=out.numel()))

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """``decode(encode(tensor))`` shaped like ``tensor``, fp32, on its device: what a peer sends."""
        return self.decode(self.encode(tensor), device=tensor.device).view(tensor.shape)


def _describe(header: WireHeader) -> str:
    if header.scale_dtype is None:
        return header.codec
    if header.k:
        return f"{header.codec} (chunk {header.block_size}, k {header.k}, {header.scale_dtype} scales)"
    return f"{header.codec} (block {header.block_size}, {header.scale_dtype} scales)"


def _writable(data: bytes | bytearray | memoryview) -> bool:
    return isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly and data.contiguous)


def _owned_slice(data: bytes | bytearray | memoryview, offset: int, count: int, dtype: type) -> torch.Tensor:
    # numpy reads any bytes-like object at any alignment; the copy gives torch a writable, aligned
    # tensor that does not alias the caller's buffer.
    return torch.from_numpy(np.frombuffer(data, dtype=dtype, count=count, offset=offset).copy())


def decode_with_header(
    data: bytes | bytearray | memoryview, header: WireHeader, device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``data`` whose header was already validated by ``read_header``. ``out`` (block codecs
    only: a flat fp32 tensor of ``header.numel`` values on ``device``) receives the values."""
    if header.numel == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    if header.k:
        scales = _owned_slice(data, HEADER_SIZE, header.n_blocks, _SCALE_NUMPY[header.scale_dtype])
        offset = HEADER_SIZE + header.scales_nbytes
        indices = np.frombuffer(data, dtype=np.uint8, count=header.indices_nbytes, offset=offset)
        codes = np.frombuffer(data, dtype=np.uint8, count=header.codes_nbytes, offset=offset + header.indices_nbytes)
        return sparse.dequantize(scales, indices, codes, header).to(device)
    codes_offset = HEADER_SIZE + header.scales_nbytes
    codes = _owned_slice(data, codes_offset, header.codes_nbytes, np.uint8).to(device)
    if header.scale_dtype is None:
        values = casts.decode_cast(codes, header.codec)
        if not all_finite(values):
            raise NonFiniteError(f"malformed {header.codec} data: it holds NaN or Inf")
        return values
    scales = _owned_slice(data, HEADER_SIZE, header.n_blocks, _SCALE_NUMPY[header.scale_dtype]).to(device)
    return blockwise.dequantize(scales, codes, header.codec, header.numel, header.block_size, out=out)


def decode(data: bytes | bytearray | memoryview, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode bytes from any codec, reading format and parameters from the header alone."""
    return decode_with_header(data, read_header(data), device)


def get_codec(
    name: str,
    block_size: int | None = None,
    scale_dtype: str = "fp16",
    stochastic: bool = False,
    seed: int | None = None,
    density: float = DEFAULT_DENSITY,
) -> Codec:
    """Build the codec ``name`` (one of ``CODEC_NAMES``); raises ``ValueError`` for bad parameters.

    ``block_size`` defaults to 64 (block codecs) or 1024 (sparse codecs: the chunk); ``density``
    is the fraction of each chunk a sparse codec keeps."""
    return Codec(name, block_size=block_size, scale_dtype=scale_dtype, stochastic=stochastic, seed=seed,
                 density=density)
