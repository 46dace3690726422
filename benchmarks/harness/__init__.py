"""What the benchmarks share: ways to start peers and one way to write results.

- :mod:`~benchmarks.harness.peers`: peer *processes* (``opendiloco_stream`` commands) started in
  their own sessions and stopped through ``opendiloco_stream.net.lifecycle``.
- :mod:`~benchmarks.harness.loopback`: transports in loopback processes driven over a pipe.
- :mod:`~benchmarks.harness.netns`: network namespaces with shaped links (root and ``ip netns``).
- :mod:`~benchmarks.harness.gloo`: the ``torch.distributed`` gloo reference ranks.
- :mod:`~benchmarks.harness.results`: the result envelope, markdown tables and plots.
"""
