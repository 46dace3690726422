"""Transports built from the configuration: the one place that maps config fields to constructors.

    swarm = local_swarm(cfg, workers=4)            # M workers in this process (LocalSwarm)
    transport = hivemind_transport(cfg, dht)       # one peer over hivemind (hivemind_settings(cfg))
    codec = codec_from_config(cfg)                 # the wire codec both use (cfg.diloco.codec_spec())

Commands (``local``, ``peer``) and benchmarks build their transports here, so a new transport knob
is a config field plus one line in this module.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from opendiloco_stream.config import RunConfig

if TYPE_CHECKING:  # the constructors import lazily: torch and hivemind only when a transport is built
    from opendiloco_stream.compression import Codec
    from opendiloco_stream.transport.hivemind import HivemindTransport
    from opendiloco_stream.transport.hivemind.transport import HivemindSettings
    from opendiloco_stream.transport.local import LinkModel, LocalSwarm


def codec_from_config(cfg: RunConfig) -> "Codec":
    """The wire codec of ``cfg`` (``DiLoCoConfig.codec_spec``), built."""
    from opendiloco_stream.compression import Codec

    return Codec.from_spec(cfg.diloco.codec_spec())


def chunk_bytes(cfg: RunConfig) -> int:
    """``net.chunk_bytes``, or the size derived from ``net.link_mbit`` (the same for both transports,
    so a local run cuts parts as the hivemind run of the same config)."""
    from opendiloco_stream.transport.layout import resolve_chunk_bytes

    return resolve_chunk_bytes(cfg.net.chunk_bytes, cfg.net.link_mbit)


def local_swarm(cfg: RunConfig, workers: int, link: Optional["LinkModel"] = None) -> "LocalSwarm":
    """``workers`` simulated peers in this process, reducing exactly as the hivemind transport does;
    ``link``: when rounds land, in inner steps (default: at once)."""
    from opendiloco_stream.transport.local import INSTANT_LINK, LocalSwarm

    return LocalSwarm(num_workers=workers, codec=cfg.diloco.codec_spec(), seed=cfg.train.seed,
                      timeout=cfg.diloco.sync_timeout, chunk_bytes=chunk_bytes(cfg), norm_bound=cfg.net.norm_bound,
                      link=link or INSTANT_LINK)


def hivemind_settings(cfg: RunConfig, **overrides: Any) -> "HivemindSettings":
    """The hivemind transport's settings from ``cfg.net`` and the codec fields of ``cfg.diloco``;
    ``overrides``: fields of ``HivemindSettings`` to change (a ``codec`` override brings its own
    codec parameters: a sparse codec's chunk, not the dense codecs' block)."""
    from opendiloco_stream.transport.hivemind.transport import HivemindSettings

    if isinstance(overrides.get("codec"), str):  # a name: the configuration's parameters for that codec
        cfg = cfg.model_copy(update={"diloco": cfg.diloco.model_copy(update={"codec": overrides.pop("codec")})})
    n = cfg.net
    settings = HivemindSettings(
        run_id=n.run_id, codec=cfg.diloco.codec_spec(), target_group_size=n.target_group_size,
        matchmaking_time=n.matchmaking_time, request_timeout=n.request_timeout,
        allreduce_timeout=n.allreduce_timeout, next_chunk_timeout=n.next_chunk_timeout, link_mbit=n.link_mbit,
        client_mode=n.client_mode, window_s=n.window_s, chunk_bytes=chunk_bytes(cfg), norm_bound=n.norm_bound,
        direct=n.direct, direct_port=n.data_port, direct_plaintext=n.direct_plaintext, relayed=n.relay,
        punch=n.punch, pin_buffers=cfg.train.device.startswith("cuda"))
    return replace(settings, **overrides)


def default_hivemind_settings(**overrides: Any) -> "HivemindSettings":
    """:func:`hivemind_settings` of the default configuration (``HivemindTransport(dht, **overrides)``)."""
    return hivemind_settings(RunConfig(), **overrides)


def hivemind_transport(cfg: RunConfig, dht: Any, admission: Any = None) -> "HivemindTransport":
    """This peer's transport over a running hivemind DHT (the caller owns the DHT); ``admission``
    (``net.auth.Admission``): what groupmates, donors and joiners must prove."""
    from opendiloco_stream.transport.hivemind import HivemindTransport

    return HivemindTransport(dht, hivemind_settings(cfg), admission=admission)
