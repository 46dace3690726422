"""What the benchmarks share: ways to start peers and one way to write results.

- :mod:`~benchmarks.harness.peers`: peer *processes* (``opendiloco_stream`` commands) started in
  their own sessions, on 127.0.0.1 or inside network namespaces, and stopped through
  ``opendiloco_stream.net.lifecycle``: the one way to start and stop them.
- :mod:`~benchmarks.harness.loopback`: transports in loopback processes driven over a pipe.
- :mod:`~benchmarks.harness.netns`: network namespaces with shaped links (root and ``ip netns``);
  :mod:`~benchmarks.harness.nat`: peers behind masquerading routers in them.
- :mod:`~benchmarks.harness.gloo`: the ``torch.distributed`` gloo reference ranks.
- :mod:`~benchmarks.harness.results`: the result envelope (``write_result``, the one writer;
  ``read_result``), markdown tables and plots.
- :mod:`~benchmarks.harness.codec_work`: one peer's codec work of a round (the codec floor).
- :mod:`~benchmarks.harness.procfs`: this process's memory from ``/proc/self``; CPU of process trees.
- :mod:`~benchmarks.harness.wan_records`, :mod:`~benchmarks.harness.wan_report`: the record of
  one ``wan`` run and the report of a ``wan`` result; :mod:`~benchmarks.harness.quality_report`:
  the tables and plots of ``quality``.

Benchmarks and tests import from here; a benchmark never imports another benchmark, and a test
runs a benchmark as ``python -m benchmarks.NAME`` (benchmarks/README.md).
"""
