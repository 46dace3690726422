"""The networked transport over hivemind 1.1.12 (see docs/architecture.md, "hivemind transport").

- ``transport.py``: ``HivemindTransport`` (the ``Transport``), its handles, one worker per fragment
- ``averager.py``: ``FragmentAverager``, hivemind's averager process with our all-reduce plugged in
- ``runner.py``: one round inside the averager process (the core of ``transport/reduce.py`` over streams)
- ``protocol.py``: the frames of a round and the round's group bits
- ``timeouts.py``: the timeout hierarchy and its defaults
- ``state.py``: late joiners (state donors and downloads); ``state_format.py``: its manifest, digests and parts
"""

from opendiloco_stream.transport.hivemind.transport import HivemindSyncHandle, HivemindTransport

__all__ = ["HivemindSyncHandle", "HivemindTransport"]
