"""Pure-torch Streaming DiLoCo: fragments and schedule, outer optimizer and update rules, the wrappers.

This package imports neither hivemind nor anything network-related. ``wrap(model, optimizer,
transport, config)`` builds the wrapper for ``config.mode``.
"""

from opendiloco_stream.algorithm.diloco import StreamingDiLoCo, wrap

__all__ = ["StreamingDiLoCo", "wrap"]
