"""Pure-torch Streaming DiLoCo: fragments and schedule, outer optimizer and update rules, the wrapper.

This package imports neither hivemind nor anything network-related.
"""
