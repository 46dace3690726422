"""The networked transport over hivemind's DHT and p2p (see docs/architecture.md, "hivemind transport").

- ``transport.py``: ``HivemindTransport`` (the ``Transport``); ``lane.py``: its handles, one worker per fragment
- ``service.py``: the averaging service, one asyncio loop in a background thread of the peer process
- ``endpoint.py``: one fragment on the service: its groups, rounds, and the streams it serves
- ``matchmaking.py``: group formation per round (announcements on the DHT, the smallest peer id leads)
- ``runner.py``: one round's all-reduce (the core of ``transport/reduce.py`` over streams)
- ``direct.py``, ``seal.py``: the direct TCP data path and its AES-256-GCM sealing
- ``protocol.py``: the frames of a round; ``presence.py``: the live peers of each round
- ``timeouts.py``: the timeout hierarchy and its defaults
- ``state.py``: late joiners (state donors and downloads); ``state_format.py``: its manifest, digests and parts
"""

from opendiloco_stream.transport.hivemind.transport import HivemindSyncHandle, HivemindTransport

__all__ = ["HivemindSyncHandle", "HivemindTransport"]
