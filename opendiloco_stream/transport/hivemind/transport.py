"""The networked Transport: hivemind's DHT and p2p, and our averaging service.

    dht = hivemind.DHT(initial_peers=[...], start=True)
    transport = HivemindTransport(dht, HivemindSettings.from_config(cfg))  # settings.py, from the config
    transport.prepare({0: numel_0, 1: numel_1})       # one endpoint per fragment on the service
    handle = transport.all_reduce((fragment, round), outer_gradient, weight=tokens)  # returns in ~ms
    result = handle.wait()                             # bounded: never past the round's bound

Design (docs/architecture.md, "hivemind transport"):

- One averaging service per peer (``service.py``): an asyncio loop in a background thread of this
  process, with its own client of the DHT's p2p daemon. Nothing is forked and no buffer is shared:
  a round reads the outer gradient where it lies and decodes the average into the tensor returned.
- One ``FragmentEndpoint`` per fragment on it (``endpoint.py``), prefix ``{run_id}_f{fragment}``:
  independent group formation per fragment, so the P rounds that eager mode keeps in flight never
  queue behind each other, and a stuck fragment does not stall the others.
- Groups form per round (``matchmaking.py``: announcements under a DHT key of the round, the
  smallest announced peer id leads): peers at different rounds cannot meet. A round starts as soon
  as the run's live peers are in the group (``presence.py``: every peer announces itself on the
  DHT per fragment and round, the count is the round's target), or after ``matchmaking_time`` with
  whoever is there. A fixed ``target_group_size`` overrides the count (a swarm larger than it
  splits into disjoint groups).
- Our all-reduce (``runner.py``, over the shared core ``transport/reduce.py``) replaces hivemind's: quantized contributions, fp32 reduction,
  validation of every contribution, one quantization of each part's average sent as the same bytes
  to everyone (bit-identical results), verdicts exchanged so all parts average the same
  contributions, and any missing or inconsistent part fails the round (``reason=FailureReason.PARTIAL``).
- One worker thread per fragment (``lane.py``) runs the rounds of that fragment in order, so ``all_reduce``
  never blocks.
- Timeouts (``timeouts.py``): derived from ``link_mbit`` and ``window_s`` unless given, then from
  the RTT and rate each fragment measured to its groupmates in its rounds (``link.py``).
- Before its rounds measured a groupmate, the RTT it reports (``groupmate_rtt_s``: how far ahead
  ``prematch_steps = "auto"`` forms groups) is the worst of DHT pings to the swarm's peers, sent
  from its start on (``start_rtt.py``), so a first round at a distance forms its group ahead too.
- Late joiners (``state.py``): state served and downloaded on the same service loop.
- Partitions (``net/routes.py``): the DHT re-pings the peers it dropped, so a healed link rejoins.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from hivemind.dht import DHT

from opendiloco_stream.compression import Codec
from opendiloco_stream.net.ping import ping_swarm
from opendiloco_stream.net.routes import keep_routes
from opendiloco_stream.transport.base import FetchedFragment, OuterDigest, Transport
from opendiloco_stream.transport.failure import FailureReason
from opendiloco_stream.transport.hivemind.endpoint import FragmentEndpoint
from opendiloco_stream.transport.hivemind.lane import HivemindSyncHandle, _Lane  # noqa: F401 (re-exported)
from opendiloco_stream.transport.hivemind.presence import Presence
from opendiloco_stream.transport.hivemind.punch import find_echoes
from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner
from opendiloco_stream.transport.hivemind.service import AveragingService
from opendiloco_stream.transport.hivemind.settings import HivemindSettings
from opendiloco_stream.transport.hivemind.start_rtt import StartRtt
from opendiloco_stream.transport.hivemind.state import StateSharing
from opendiloco_stream.transport.hivemind.timeouts import RoundTimeouts, derive_timeouts
from opendiloco_stream.transport.layout import resolve_chunk_bytes

logger = logging.getLogger(__name__)

_RUN_ID = re.compile(r"[A-Za-z0-9_-]+")
START_PING_TIMEOUT_S = 3.0  # one probe of the swarm's RTTs (start_rtt.py): 3 pings each at up to ~1 s RTT
START_WAIT_S = 3.0  # prepare() waits this long at most for a fresh probe (the first rounds are sized from it)


def _check_weight(weight: float) -> None:
    if not (isinstance(weight, (int, float)) and weight >= 0 and weight == weight and weight != float("inf")):
        raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")


class HivemindTransport(Transport):
    """One peer of a run over hivemind (see the module docstring for the design).

    Args:
        dht: a running ``hivemind.DHT`` (the caller owns it; ``close`` leaves it running).
        settings: :class:`HivemindSettings` (``HivemindSettings.from_config(cfg)``); ``None``:
            the configuration's defaults (``HivemindSettings.defaults()``).
        admission: what groupmates, state donors and joiners must prove (``net/auth.py``: the run
            key, the run fingerprint); ``None`` admits every peer of the run.
        **overrides: fields of :class:`HivemindSettings` to change (tests and benchmarks:
            ``HivemindTransport(dht, run_id="r", codec="fp4-e3m0")``).
    """

    runner_cls = HvAllReduceRunner  # a round's all-reduce (tests override it to fake bad senders)

    def __init__(self, dht: DHT, settings: Optional[HivemindSettings] = None, *, admission: Any = None,
                 **overrides: Any):
        s = HivemindSettings.defaults(**overrides) if settings is None else replace(settings, **overrides)
        if not isinstance(s.run_id, str) or not _RUN_ID.fullmatch(s.run_id):
            raise ValueError(f"run_id {s.run_id!r}: use letters, digits, '_' and '-' only")
        if s.target_group_size is not None and s.target_group_size < 2:
            raise ValueError(f"target_group_size must be >= 2 (or None), got {s.target_group_size}")
        if s.norm_bound is not None and not s.norm_bound > 1:
            raise ValueError(f"norm_bound must be > 1 (or None), got {s.norm_bound}")
        self.settings = s
        self.codec = Codec.from_spec(s.codec)
        self.dht, self.run_id, self.client_mode = dht, s.run_id, s.client_mode
        self.chunk_bytes = resolve_chunk_bytes(s.chunk_bytes, s.link_mbit)
        self.target_group_size, self.norm_bound = s.target_group_size, s.norm_bound
        self.link_mbit, self.window_s, self.startup_timeout = s.link_mbit, s.window_s, s.startup_timeout
        self.timeout_args = dict(matchmaking_time=s.matchmaking_time, request_timeout=s.request_timeout,
                                 allreduce_timeout=s.allreduce_timeout, next_chunk_timeout=s.next_chunk_timeout)
        derive_timeouts(encoded_bytes=0, numel=0, chunk_bytes=self.chunk_bytes, link_mbit=s.link_mbit,
                        window_s=s.window_s, **self.timeout_args)  # fail on a broken hierarchy now, not in prepare
        if s.direct_port is not None and not 1 <= s.direct_port <= 65535:
            raise ValueError(f"direct_port must be in 1..65535 (or None), got {s.direct_port}")
        self.state_timeout, self.admission, self.direct = s.state_timeout, admission, s.direct
        self.direct_port, self.direct_plaintext = s.direct_port, s.direct_plaintext
        if s.direct and s.direct_plaintext:
            logger.warning("--direct-plaintext: the direct data path is not sealed; anyone on the network path "
                           "can read and alter contributions (use it only to measure what sealing costs)")
        self.peer_id = str(dht.peer_id)
        self._dht_lock = threading.Lock()  # the DHT's control pipe: one sender at a time (service, presence)
        self._service: Optional[AveragingService] = None
        self._lanes: dict[int, _Lane] = {}
        self._numels: dict[int, int] = {}
        self._state: Optional[StateSharing] = None
        self.presence_ttl, self._presence = s.presence_ttl, None
        self._closed = False
        keep_routes(dht)  # a healed partition must not leave the run split in two (net/routes.py)
        # the swarm's RTTs until a round measured groupmates (start_rtt.py); pings answer in ms near by
        self._start_rtt = StartRtt(lambda: ping_swarm(dht, START_PING_TIMEOUT_S, lock=self._dht_lock),
                                   measured=self._links_measured)

    def timeouts(self, numel: int) -> RoundTimeouts:
        """The timeouts a fragment of ``numel`` elements gets before any round measured its links."""
        return derive_timeouts(link_mbit=self.link_mbit, **self.timeout_base(numel))

    def timeout_base(self, numel: int) -> dict:
        """``derive_timeouts``' arguments for a fragment of ``numel`` elements but the link's rate
        and RTT (which the fragment's endpoint fills in from its measures: ``link_timeouts``)."""
        return dict(encoded_bytes=self.codec.encoded_size(numel), numel=numel, chunk_bytes=self.chunk_bytes,
                    window_s=self.window_s, **self.timeout_args)

    def prepare(self, numels: dict[int, int]) -> None:
        numels = {int(p): int(n) for p, n in numels.items()}
        if self._lanes:
            if numels != self._numels:
                raise ValueError(f"prepare() was already called with other fragments: {self._numels}")
            return
        if any(n < 1 for n in numels.values()) or any(p < 0 for p in numels):
            raise ValueError(f"fragments must have indices >= 0 and at least one element: {numels}")
        if self.direct_port is not None and self.direct_port + max(numels) > 65535:
            raise ValueError(f"data ports {self.direct_port}..{self.direct_port + max(numels)} go past 65535: "
                             f"pick a lower net.data_port")
        service = self.service()
        with service.dht_lock:  # echo servers for hole punching (punch.py): bootstrap --relay serves one
            echoes = find_echoes(self.dht, self.run_id) if self.direct and self.settings.punch else []
        endpoints: dict[int, FragmentEndpoint] = {}
        try:
            for p, n in sorted(numels.items()):
                endpoints[p] = endpoint = FragmentEndpoint(
                    service, n, prefix=f"{self.run_id}_f{p}", codec=self.codec, timeouts=self.timeouts(n),
                    timeout_base=self.timeout_base(n), link_mbit=self.link_mbit,
                    chunk_bytes=self.chunk_bytes, norm_bound=self.norm_bound, client_mode=self.client_mode,
                    admission=self.admission, direct=self.direct,
                    direct_port=0 if self.direct_port is None else self.direct_port + p,
                    direct_plaintext=self.direct_plaintext, runner_cls=self.runner_cls,
                    relayed=self.settings.relayed, echoes=tuple(echoes))
                service.call(endpoint.start(), self.startup_timeout)
        except BaseException:
            for endpoint in endpoints.values():
                self._close_endpoint(endpoint)
            raise
        # a round others launched a quarter of the matchmaking time ago is late for a slower peer
        self._presence = Presence(self.dht, self.run_id, self.peer_id, ttl=self.presence_ttl,
                                  late_after=self.timeout_args["matchmaking_time"] / 4,
                                  window=self.timeout_args["matchmaking_time"],
                                  # the shortest of the fragments' (a joiner's check must not count on more)
                                  joiner_wait=min(e.timeouts.joiner_wait for e in endpoints.values()),
                                  dht_timeout=self.timeout_args["request_timeout"], dht_lock=self._dht_lock)
        self._lanes = {p: _Lane(p, endpoint, endpoint.timeouts, self._presence, self.target_group_size)
                       for p, endpoint in endpoints.items()}
        self._numels = numels
        # the first rounds' lead ("auto") is sized from it: a probe now counts the peers met since the last
        self._start_rtt.probe_now(START_WAIT_S)

    def service(self) -> AveragingService:
        """This peer's averaging service (started on first use)."""
        if self._closed:
            raise RuntimeError("transport closed")
        if self._service is None:
            self._service = AveragingService(self.dht, self._dht_lock, request_timeout=self.timeout_args["request_timeout"],
                                             startup_timeout=self.startup_timeout,
                                             pin_buffers=self.settings.pin_buffers)
        return self._service

    def early_group(self, fragment: int) -> Optional[str]:
        """The state of the group formed ahead for ``fragment`` (``prematch``): None (none),
        "MATCHING", "FORMED" (waiting for its round) or "FAILED" (it will match at the round)."""
        lane = self._lanes.get(fragment)
        return None if lane is None else lane.early_state()

    def direct_addresses(self, fragment: int) -> Optional[list]:
        """Where groupmates stream fragment ``fragment``'s parts to this peer (None: p2p daemon only)."""
        lane = self._lanes.get(fragment)
        return None if lane is None else lane.endpoint.direct_addresses

    def _close_endpoint(self, endpoint: FragmentEndpoint) -> None:
        try:
            endpoint.service.call(endpoint.close(), max(5.0, self.timeout_args["request_timeout"]))
        except Exception as e:
            logger.warning("%s did not close cleanly: %r", endpoint.prefix, e)

    def all_reduce(self, key: tuple[int, int], tensor: torch.Tensor, weight: float = 1.0,
                   digest: Optional[OuterDigest] = None) -> HivemindSyncHandle:
        fragment, _round = key
        lane = self._lanes.get(fragment)
        if lane is None and not self._closed:
            raise ValueError(f"fragment {fragment} was not declared in prepare() (declared: {sorted(self._lanes)})")
        _check_weight(weight)
        if self._closed:
            handle = HivemindSyncHandle(key, time.monotonic())
            handle.fail(FailureReason.CLOSED, "transport closed")
            return handle
        if tensor.numel() != lane.numel:
            raise ValueError(f"fragment {fragment} has {lane.numel} elements, got a tensor of {tensor.numel()}")
        handle = HivemindSyncHandle(key, time.monotonic() + lane.timeouts.round_bound)
        lane.submit(handle, tensor, float(weight), digest)
        return handle

    def wire_codec(self):
        return self.codec

    def prematch(self, key: tuple[int, int], weight: float = 1.0, lead_s: float = 0.0,
                 digest: Optional[OuterDigest] = None) -> None:
        fragment, _round = key
        lane = self._lanes.get(fragment)
        if lane is None or self._closed:
            return  # a hint: nothing to form ahead (all_reduce says what is wrong)
        _check_weight(weight)
        lane.prematch(key, float(weight), max(0.0, float(lead_s)), digest)

    def groupmate_rtt_s(self) -> Optional[float]:
        """The worst groupmate RTT the rounds measured; before they measured any, the worst DHT
        ping to the swarm's peers since the start (``start_rtt.py``; None before one answered)."""
        rtts = [lane.endpoint.links.worst()[0] for lane in list(self._lanes.values()) if len(lane.endpoint.links)]
        return max(rtts) if rtts else self._start_rtt.rtt_s()

    def start_rtts(self) -> dict[str, float]:
        """The RTT (s) to each of the swarm's peers DHT-pinged before the rounds measured groupmates."""
        return self._start_rtt.peers()

    def _links_measured(self) -> bool:
        return any(len(lane.endpoint.links) for lane in list(self._lanes.values()))

    @property
    def watches_swarm(self) -> bool:
        return self._presence is not None and not self._closed

    def round_late(self, key: tuple[int, int]) -> bool:
        presence = self._presence
        return presence is not None and not self._closed and presence.is_late(*key)

    def expect_rounds(self, keys: list[tuple[int, int]], since: Optional[float] = None) -> None:
        if self._presence is not None and not self._closed:
            for fragment, round_index in keys:
                self._presence.expect(fragment, round_index, since=since)

    def reserve_rounds(self, keys: list[tuple[int, int]]) -> Optional[float]:
        joiner = self._state.serving() if self._state is not None else None
        if joiner is None or self._presence is None or self._closed:
            return None
        reserved_at = self._presence.reserve(joiner, keys)
        for fragment, round_index in keys:  # a round forming already planned without the joiner
            lane = self._lanes.get(fragment)
            if lane is not None:
                lane.await_joiner(round_index, joiner)
        return reserved_at

    def rounds_launched(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if self._presence is None or self._closed:
            return []
        return [key for key in keys if self._presence.launched_by_others(*key)]

    # ------------------------------------------------------------------ late joiners
    def _sharing(self) -> StateSharing:
        if self._state is None:
            self._state = StateSharing(self.service(), self.run_id, can_serve=not self.client_mode,
                                       chunk_timeout=self.state_timeout, admission=self.admission)
        return self._state

    def set_state_provider(self, provider: Callable[[], dict[str, Any]]) -> None:
        """``provider()`` runs in this process, in a background thread, when a joiner asks: it must
        return copies (the transport serializes them right away) and must not block on a round."""
        if self._closed:
            raise RuntimeError("transport closed")
        self._sharing().set_provider(provider)

    def set_fragment_provider(self, provider: Callable[[int, int], dict[str, Any]]) -> None:
        if self._closed:
            raise RuntimeError("transport closed")
        self._sharing().set_fragment_provider(provider)

    def fetch_fragment(self, peer: str, fragment: int, round_index: int, timeout: float,
                       since: Optional[dict[str, Any]] = None) -> Optional[FetchedFragment]:
        if self._closed:
            return None
        sharing = self._sharing()
        state = sharing.fetch(peer, fragment, round_index, timeout, since=since)
        return None if state is None else FetchedFragment(state, int(sharing.last_load.get("received_bytes", 0)))

    def load_state_from_peers(self, timeout: float, progress: Optional[Callable[[dict[str, Any]], None]] = None,
                              since: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        if self._closed:
            raise RuntimeError("transport closed")
        return self._sharing().load(timeout, progress, since=since)

    def close(self) -> None:
        """Fail pending rounds ("closed"), stop serving rounds and state, stop the service."""
        self._closed = True
        self._start_rtt.close()
        if self._presence is not None:  # first: the others stop counting this peer at once
            self._presence.close()
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            try:
                lane.close()
            except Exception as e:
                logger.warning("fragment %d did not close cleanly: %r", lane.fragment, e)
            self._close_endpoint(lane.endpoint)
        if self._state is not None:
            self._state.close()
            self._state = None
        if self._service is not None:
            self._service.close()
