"""opendiloco-stream: Streaming DiLoCo with overlapped, quantized, eager fragment synchronization.

Public API::

    from opendiloco_stream import DiLoCoConfig, wrap   # StreamingDiLoCo or DataParallel by mode
    from opendiloco_stream.transport.local import LocalSwarm

Imports are lazy so that torch-free parts (the simulator, the CLI's help) start fast.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["DiLoCoConfig", "StreamingDiLoCo", "DataParallel", "wrap", "RunConfig", "load_config"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from opendiloco_stream.algorithm.diloco import StreamingDiLoCo
    from opendiloco_stream.config import DiLoCoConfig, RunConfig, load_config


def __getattr__(name: str) -> Any:
    if name in ("StreamingDiLoCo", "wrap"):
        from opendiloco_stream.algorithm import diloco  # lazy: PEP 562 re-export, torch on first use

        return getattr(diloco, name)
    if name == "DataParallel":
        from opendiloco_stream.algorithm.data_parallel import DataParallel  # lazy: PEP 562 re-export, torch on first use

        return DataParallel
    if name in ("DiLoCoConfig", "RunConfig", "load_config"):
        from opendiloco_stream import config  # lazy: PEP 562 re-export (see the docstring)

        return getattr(config, name)
    raise AttributeError(f"module 'opendiloco_stream' has no attribute {name!r}")
