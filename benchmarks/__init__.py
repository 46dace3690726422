"""Benchmarks: each script runs from the repository root as ``python -m benchmarks.NAME``.

What they share lives in :mod:`benchmarks.harness`: starting peers (``loopback``, ``netns``,
``gloo``, ``peers``), and the result envelope and report helpers (``results``). How to run one
and where its result goes: benchmarks/README.md.
"""
