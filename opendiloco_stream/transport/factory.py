"""Transports built from the configuration: the one place that maps config fields to constructors
(the hivemind transport's settings: ``HivemindSettings.from_config``, beside the settings).

    swarm = local_swarm(cfg, workers=4)            # M workers in this process (LocalSwarm)
    transport = hivemind_transport(cfg, dht)       # one peer over hivemind (HivemindSettings.from_config(cfg))
    codec = codec_from_config(cfg)                 # the wire codec both use (cfg.diloco.codec_spec())

Commands (``local``, ``peer``) and benchmarks build their transports here, so a new transport knob
is a config field plus one line here (or in ``HivemindSettings.from_config``).
"""

from __future__ import annotations

from typing import Any, Optional

from opendiloco_stream.compression import Codec
from opendiloco_stream.config import RunConfig
from opendiloco_stream.transport.hivemind import HivemindTransport
from opendiloco_stream.transport.hivemind.settings import HivemindSettings
from opendiloco_stream.transport.layout import resolve_chunk_bytes
from opendiloco_stream.transport.local import INSTANT_LINK, LinkModel, LocalSwarm


def codec_from_config(cfg: RunConfig) -> Codec:
    """The wire codec of ``cfg`` (``DiLoCoConfig.codec_spec``), built."""
    return Codec.from_spec(cfg.diloco.codec_spec())


def chunk_bytes(cfg: RunConfig) -> int:
    """``net.chunk_bytes``, or the size derived from ``net.link_mbit`` (the same for both transports,
    so a local run cuts parts as the hivemind run of the same config)."""
    return resolve_chunk_bytes(cfg.net.chunk_bytes, cfg.net.link_mbit)


def local_swarm(cfg: RunConfig, workers: int, link: Optional[LinkModel] = None) -> LocalSwarm:
    """``workers`` simulated peers in this process, reducing exactly as the hivemind transport does;
    ``link``: when rounds land, in inner steps (default: at once)."""
    return LocalSwarm(num_workers=workers, codec=cfg.diloco.codec_spec(), seed=cfg.train.seed,
                      timeout=cfg.diloco.sync_timeout, chunk_bytes=chunk_bytes(cfg), norm_bound=cfg.net.norm_bound,
                      link=link or INSTANT_LINK)


def hivemind_transport(cfg: RunConfig, dht: Any, admission: Any = None) -> HivemindTransport:
    """This peer's transport over a running hivemind DHT (the caller owns the DHT); ``admission``
    (``net.auth.Admission``): what groupmates, donors and joiners must prove."""
    return HivemindTransport(dht, HivemindSettings.from_config(cfg), admission=admission)
