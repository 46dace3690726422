"""``CodecSpec``: which wire codec, with which parameters, as one value.

The configuration builds it once (``DiLoCoConfig.codec_spec``) and the transports take it as it
is; ``Codec.from_spec`` (``codecs.py``) builds the codec. It imports without torch, like
``wire.py``, so the configuration and the CLI's help stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from opendiloco_stream.compression.wire import CODEC_NAMES

#: the fraction of each chunk a sparse codec keeps, unless told
DEFAULT_DENSITY = 0.02
#: codecs whose decoded bytes are the values sent, bit for bit
LOSSLESS_CODECS = frozenset({"fp32"})


def is_lossless(name: str) -> bool:
    """Whether codec ``name`` sends the values themselves (what a peer sent is its input)."""
    return name in LOSSLESS_CODECS


@dataclass(frozen=True)
class CodecSpec:
    """A wire codec and its parameters (``compression.get_codec``'s arguments but the seed).

    ``block_size`` None: the codec's default (64; a sparse codec's chunk: 1024); ``density``:
    sparse codecs only; ``stochastic``: low-bit codecs only. The parameters are checked when the
    codec is built."""

    name: str
    block_size: Optional[int] = None
    scale_dtype: str = "fp16"
    stochastic: bool = False
    density: float = DEFAULT_DENSITY

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.name!r}; choose one of {', '.join(CODEC_NAMES)}")

    @property
    def lossless(self) -> bool:
        """What a peer sends decodes to its input exactly (fp32): no copy of it is kept."""
        return is_lossless(self.name)
