"""``HivemindSettings``: what one peer's hivemind transport is set to, and where its defaults come from.

The defaults are the configuration's (``NetConfig``, and ``DiLoCoConfig``'s codec): the settings
are filled from a ``RunConfig`` (:meth:`HivemindSettings.from_config`; ``transport/factory.py``
passes the run's), or from the default one (:meth:`HivemindSettings.defaults`, what
``HivemindTransport(dht, **overrides)`` uses), so no default is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from opendiloco_stream.compression.spec import CodecSpec
from opendiloco_stream.config import RunConfig
from opendiloco_stream.transport.hivemind.presence import DEFAULT_TTL_S
from opendiloco_stream.transport.layout import resolve_chunk_bytes


@dataclass(frozen=True)
class HivemindSettings:
    """What one peer's transport is set to: :meth:`from_config` fills it from ``NetConfig`` (and
    the codec of ``DiLoCoConfig``), so the defaults are the configuration's (:meth:`defaults`).

    Fields:
        run_id: the run's name ([A-Za-z0-9_-]); peers group only within a run.
        codec: the wire codec (``compression.CodecSpec``; a name: that codec with its default parameters).
        target_group_size: start every round as soon as this many peers are there (an override);
            ``None``: as soon as the run's live peers are there (``presence.py``).
        matchmaking_time, request_timeout, allreduce_timeout, next_chunk_timeout, window_s,
            link_mbit: the timeout hierarchy, see ``timeouts.py``.
        client_mode: for peers that cannot accept connections: they send and receive but reduce
            no part and serve no state.
        chunk_bytes: encoded bytes per streamed chunk; ``None``: what the link carries in 40 ms,
            1-8 MiB (``layout.chunk_bytes_for_link``); a group cuts the smallest its members announce.
        norm_bound: reject contributions whose norm exceeds this multiple of the group median
            (with 3+ contributions); ``None`` disables the check.
        direct: stream a round's bytes over direct TCP connections between groupmates (each
            reducing peer listens on one port per fragment, next to the DHT's address; every message
            sealed with AES-256-GCM, ``seal.py``), with the p2p daemon as fallback; ``False``: p2p
            daemon only (encrypted, slower). See ``direct.py``.
        direct_plaintext: do not seal the direct path's messages (only to measure what sealing
            costs; every peer of the run must set it the same).
        direct_port: fragment ``p``'s data port is ``direct_port + p`` (ports to open in a firewall);
            ``None``: random free ports.
        relayed: reached through a circuit relay (``--relay``): no data port; groupmates punch a
            direct connection where the run has echo servers (``punch.py``), else use the relay.
        punch: open direct connections to groupmates without an address of their own by hole
            punching where the run has echo servers (``punch.py``); off: through the relay.
        presence_ttl: how long a peer's presence outlives its last refresh (a dead peer stays
            counted, and costs a round ``matchmaking_time``, for at most this long).
        state_timeout: the longest silence tolerated inside a state download.
        startup_timeout: bound on connecting the averaging service to the p2p daemon.

    The last four are no config fields: their defaults live here (``pin_buffers``: set for a peer
    that trains on CUDA, :meth:`from_config`).
    """

    run_id: str
    codec: CodecSpec
    target_group_size: Optional[int]
    matchmaking_time: float
    request_timeout: float
    allreduce_timeout: Optional[float]
    next_chunk_timeout: Optional[float]
    link_mbit: float
    client_mode: bool
    window_s: Optional[float]
    chunk_bytes: Optional[int]
    norm_bound: Optional[float]
    direct: bool
    direct_port: Optional[int]
    direct_plaintext: bool
    relayed: bool = False
    punch: bool = True
    presence_ttl: float = DEFAULT_TTL_S
    state_timeout: float = 30.0
    startup_timeout: float = 60.0
    pin_buffers: bool = False  # a GPU peer: rounds decode into pinned host memory (buffers.py)

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):  # HivemindTransport(dht, codec="fp32"): the codec's defaults
            object.__setattr__(self, "codec", CodecSpec(self.codec))

    @classmethod
    def from_config(cls, cfg: RunConfig, **overrides: Any) -> "HivemindSettings":
        """The settings of ``cfg.net`` and ``cfg.diloco``'s codec; ``overrides``: fields to change (a
        codec given by name brings the configuration's parameters for it: a sparse codec's chunk,
        not the dense codecs' block)."""
        if isinstance(overrides.get("codec"), str):
            cfg = cfg.model_copy(update={"diloco": cfg.diloco.model_copy(update={"codec": overrides.pop("codec")})})
        n = cfg.net
        settings = cls(
            run_id=n.run_id, codec=cfg.diloco.codec_spec(), target_group_size=n.target_group_size,
            matchmaking_time=n.matchmaking_time, request_timeout=n.request_timeout,
            allreduce_timeout=n.allreduce_timeout, next_chunk_timeout=n.next_chunk_timeout, link_mbit=n.link_mbit,
            client_mode=n.client_mode, window_s=n.window_s, chunk_bytes=resolve_chunk_bytes(n.chunk_bytes, n.link_mbit),
            norm_bound=n.norm_bound, direct=n.direct, direct_port=n.data_port, direct_plaintext=n.direct_plaintext,
            relayed=n.relay, punch=n.punch, pin_buffers=cfg.train.device.startswith("cuda"))
        return replace(settings, **overrides)

    @classmethod
    def defaults(cls, **overrides: Any) -> "HivemindSettings":
        """:meth:`from_config` of the default configuration (``HivemindTransport(dht, **overrides)``)."""
        return cls.from_config(RunConfig(), **overrides)
