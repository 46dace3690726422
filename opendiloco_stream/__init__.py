"""opendiloco-stream: Streaming DiLoCo with overlapped, quantized, eager fragment synchronization.

Public API::

    from opendiloco_stream import DiLoCoConfig, StreamingDiLoCo
    from opendiloco_stream.transport.local import LocalSwarm
"""

from opendiloco_stream.algorithm.diloco import StreamingDiLoCo
from opendiloco_stream.config import DiLoCoConfig, RunConfig, load_config

__all__ = ["DiLoCoConfig", "StreamingDiLoCo", "RunConfig", "load_config"]
__version__ = "0.1.0"
