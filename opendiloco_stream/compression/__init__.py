"""Wire compression of outer gradients: codecs (tensor <-> self-describing bytes) and error feedback.

    from opendiloco_stream.compression import get_codec, ErrorFeedback
    codec = get_codec("fp4-e3m0", block_size=64, scale_dtype="fp16")
    data = codec.encode(delta)            # bytes: 24-byte header + scales + codes
    sent = codec.decode(data)             # flat fp32, bit-identical on every receiver

See ``codecs.py`` for choosing a codec, ``blockwise.py`` for the code tables and rounding rules,
``spec.py`` for ``CodecSpec`` (a codec and its parameters, as the configuration names them),
``wire.py`` for the byte layout and the registry of codec names (``CODEC_NAMES``: the one list the
config, the CLI choices and the wire ids derive from). Names from ``wire.py`` import without torch,
so the configuration and the CLI's help stay light; the codecs themselves load on first use.
"""

import importlib
from typing import Any

from opendiloco_stream.compression.spec import CodecSpec
from opendiloco_stream.compression.wire import (
    CODEC_NAMES,
    HEADER_SIZE,
    NonFiniteError,
    WireHeader,
    read_header,
)

_LAZY = {"Codec": "codecs", "all_finite": "codecs", "decode": "codecs", "get_codec": "codecs",
         "ErrorFeedback": "error_feedback"}

__all__ = [
    "CODEC_NAMES",
    "HEADER_SIZE",
    "Codec",
    "CodecSpec",
    "all_finite",
    "ErrorFeedback",
    "NonFiniteError",
    "WireHeader",
    "decode",
    "get_codec",
    "read_header",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"opendiloco_stream.compression.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'opendiloco_stream.compression' has no attribute {name!r}")
