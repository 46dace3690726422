"""Wire compression of outer gradients: codecs (tensor <-> self-describing bytes) and error feedback.

    from opendiloco_stream.compression import get_codec, ErrorFeedback
    codec = get_codec("fp4-e3m0", block_size=64, scale_dtype="fp16")
    data = codec.encode(delta)            # bytes: 24-byte header + scales + codes
    sent = codec.decode(data)             # flat fp32, bit-identical on every receiver

See ``codecs.py`` for choosing a codec, ``blockwise.py`` for the code tables and rounding rules,
``wire.py`` for the byte layout.
"""

from opendiloco_stream.compression.codecs import Codec, decode, get_codec
from opendiloco_stream.compression.error_feedback import ErrorFeedback
from opendiloco_stream.compression.wire import (
    CODEC_NAMES,
    HEADER_SIZE,
    NonFiniteError,
    WireHeader,
    read_header,
)

__all__ = [
    "CODEC_NAMES",
    "HEADER_SIZE",
    "Codec",
    "ErrorFeedback",
    "NonFiniteError",
    "WireHeader",
    "decode",
    "get_codec",
    "read_header",
]
