"""Late joiners: serve this peer's state and download the run's state from peers already in it.

Runs on the averaging service's event loop (``service.py``), over its client of the DHT's p2p
daemon: a donor in the middle of a round answers at once (the round's chunk work runs on
executor threads), and the provider never waits for a round.

Protocol: a donor declares itself under the DHT key ``{run_id}_state.donors`` (subkey: its peer id,
refreshed every ``declare_period``) and serves the p2p handler ``{run_id}_state::download``: one message with the manifest (the state's structure with tensors replaced by
references, and every tensor's dtype and shape), then each tensor serialized and cut in parts.

The joiner tries the donors in random order (joiners spread over donors) and gives each at most
its share of the remaining time. It checks every download against the manifest, because a donor
that dies mid-stream just ends the stream early (hivemind's own ``load_state_from_peers`` returns
such a truncated state as a success), and on any failure moves on to the next donor. When every
donor failed, it reads the donors again and asks again, up to ``LOAD_PASSES`` times, 3, 6 and 12 s
apart (a dial that failed once bars the address for about 5 s in libp2p, "dial backoff"); the
failures are logged as warnings and listed in ``last_load["failures"]``.

*Resuming.* The manifest lists a digest (BLAKE2b-128) of every tensor. The joiner keeps the whole
tensors it received from a donor that failed, and asks the next donor with their digests
(``have``): that donor sends a marker instead of any tensor whose digest is among them. The state
is always the second donor's (its manifest and every value of it): only bytes proven equal are
reused, never parts of two different states (under eager updates donors' states differ slightly;
theta_bar and the outer momentum are bit-identical on every peer of a round, so they are what a
resume mostly saves).

*Lanes: enough in flight at a distance.* One stream through the p2p daemon moves at most its
window per round trip (a 12-14 MB state took 9-13 s at 300 ms RTT). A joiner asks for ``LANES``
streams: the donor keeps the state it flattened for the first one (``_Snapshots``, under an id in
the manifest) and serves the others from it, each stream a share of the parts (part ``k`` of the
list of parts to send goes to lane ``k mod lanes``; the parts carry their tensor and index, and
both sides compute the list from the manifest and the joiner's ``have``). A donor of an older
release ignores the request and sends everything on one stream, as before.

*Refreshing.* A joiner whose state went stale while it downloaded (the swarm launched one of its
next rounds meanwhile) asks again with ``since`` (the stale state): its tensors' digests go in
``have``, so only what changed moves (the fragments that synced since).

*Repairs.* A peer whose theta_bar of a fragment drifted from its group's (``algorithm/repair.py``)
downloads that fragment's state alone from one groupmate the same way: its request names the
``fragment`` and the ``round`` it consumed, and the donor serves ``fragment_provider(fragment,
round)`` instead of its whole state; the peer's own theta_bar goes in ``have``, so parameters that
are equal already do not move.

*Memory.* Tensors travel as their raw bytes in parts of ``PART_BYTES``: a donor copies one part at
a time out of its state, a joiner writes each part in place into a tensor allocated from the
manifest, so a download peaks at the state plus a part or two. Progress
(``load(progress=...)``) is reported every ``PROGRESS_EVERY_S`` seconds and at the end.

With an ``admission`` (``net/auth.py``), the joiner's request and the donor's manifest each carry a
proof of the run key bound to both peer ids (and the run fingerprint): a donor serves nobody
without the key, and a joiner takes nothing from a donor without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from opendiloco_stream.testing import faults
from opendiloco_stream.transport.hivemind.state_format import (  # noqa: F401 (StateError, flatten/unflatten: API)
    PART_BYTES, StateError, _dumps, _loads, flatten_state, tensor_bytes, tensor_digest, unflatten_state,
)

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
LANES = 8  # streams a joiner asks a donor for (see "Lanes")
SNAPSHOT_S = 120.0  # how long a donor keeps a snapshot for the lanes after the first asked for it
SNAPSHOTS_KEPT = 2
LOAD_PASSES = 4  # a joiner whose every donor failed asks again, after LOAD_RETRY_S, then twice and four times that
LOAD_RETRY_S = 3.0  # past libp2p's dial backoff (5 s after a failed dial) by the second retry


def lane_items(manifest: dict, have: set) -> list[tuple[int, int]]:
    """``(tensor, part)`` of every part a donor sends in lane mode, in order: the parts of every
    tensor whose digest is not in ``have`` (both sides compute it the same way)."""
    out = []
    for i, ((_dtype, shape), digest) in enumerate(zip(manifest["tensors"], manifest["digests"])):
        if digest in have:
            continue
        nbytes = _nbytes(manifest["tensors"][i])
        out.extend((i, j) for j in range(max(1, -(-nbytes // PART_BYTES))))
    return out


def _nbytes(entry: list) -> int:
    dtype, shape = entry
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


class _Snapshots:
    """A donor's recent flattened states, by id, for the lanes of one download."""

    def __init__(self):
        self._items: dict[bytes, tuple[float, dict, list]] = {}

    def add(self, manifest: dict, tensors: list) -> bytes:
        now = time.monotonic()
        for key in [k for k, (t, _m, _ts) in self._items.items() if now - t > SNAPSHOT_S]:
            del self._items[key]
        while len(self._items) >= SNAPSHOTS_KEPT:
            del self._items[min(self._items, key=lambda k: self._items[k][0])]
        sid = os.urandom(8)
        self._items[sid] = (now, manifest, tensors)
        return sid

    def get(self, sid: Any) -> Optional[tuple[dict, list]]:
        item = self._items.get(sid) if isinstance(sid, bytes) else None
        return None if item is None else (item[1], item[2])


class _StateServicer:
    """The donor's side: one stream per joiner (registered as ``{run_id}_state::download``)."""

    def __init__(self, sharing: "StateSharing"):
        self._sharing = sharing

    async def rpc_download_state(self, request: averaging_pb2.DownloadData, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # the request is a DownloadData (hivemind's is empty): its metadata carries the joiner's proof
        provider, admission = self._sharing.provider, self._sharing.admission
        if provider is None and self._sharing.fragment_provider is None:
            return  # an empty stream: the joiner moves on
        me, joiner = self._sharing.peer_id.to_bytes(), context.remote_id.to_bytes()
        try:
            req = _loads(request.metadata) if request.metadata else {}
        except Exception:
            req = {}
        req = req if isinstance(req, dict) else {}
        have = set(h for h in req.get("have", ()) if isinstance(h, str))  # digests the joiner holds
        if admission is not None:
            why = admission.check_state_proof(req.get("auth"), "request", joiner, me)
            if why is not None:
                logger.info("not serving state to %s: %s", context.remote_id, why)
                return
        lane = req.get("lane")
        if isinstance(lane, int) and lane > 0:  # a further lane of a download begun on another stream
            async for msg in self._serve_lane(req.get("snapshot"), lane, have):
                yield msg
            return
        fragment, round_index = req.get("fragment"), req.get("round")
        if isinstance(fragment, int) and isinstance(round_index, int):  # a groupmate's repair of one fragment
            fragment_provider = self._sharing.fragment_provider
            if fragment_provider is None:
                return
            make = lambda: fragment_provider(fragment, round_index)  # noqa: E731
        else:
            make = lambda: self._sharing.provide(provider, context.remote_id.to_base58())  # noqa: E731
        loop = asyncio.get_event_loop()
        try:
            manifest, tensors = await loop.run_in_executor(None, lambda: flatten_state(make()))
        except Exception as e:
            logger.warning("state provider failed, not serving %s: %r", context.remote_id, e)
            return
        lanes = req.get("lanes")
        lanes = min(int(lanes), LANES) if isinstance(lanes, int) and lanes > 1 else 1
        if lanes > 1:
            manifest = dict(manifest, lanes=lanes)
            manifest["snapshot"] = self._sharing.snapshots.add(manifest, tensors)
        reply = dict(manifest)
        if admission is not None:
            reply["auth"] = admission.state_proof("reply", me, joiner)
        yield averaging_pb2.DownloadData(metadata=_dumps(reply))
        if lanes > 1:
            async for msg in self._lane_parts(manifest, tensors, 0, have):
                yield msg
        else:
            for msg in self._whole(manifest, tensors, have):
                yield msg
        # Keep the stream open until the joiner closes it (which cancels us): closing first may
        # drop the last parts in flight (see protocol.py, "Closing").
        await asyncio.sleep(self._sharing.chunk_timeout)

    def _whole(self, manifest: dict, tensors: list, have: set):
        """Every tensor in order on this one stream (a joiner that asked for one lane, or an older one)."""
        for i, (tensor, digest) in enumerate(zip(tensors, manifest["digests"])):
            if i == faults.die_after_tensors():  # tests only (opendiloco_stream/testing/faults.py)
                os._exit(1)
            if digest in have:  # the joiner has it already (from a donor that failed mid-way)
                yield averaging_pb2.DownloadData(metadata=_dumps({"have": i}))
                continue
            raw, dtype = tensor_bytes(tensor), manifest["tensors"][i][0]
            n = max(1, -(-len(raw) // PART_BYTES))
            for j in range(n):  # one part's copy at a time: a donor holds no serialized tensor
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(
                    buffer=bytes(raw[j * PART_BYTES:(j + 1) * PART_BYTES]), chunks=n, dtype=dtype if j == 0 else ""))

    async def _lane_parts(self, manifest: dict, tensors: list, lane: int, have: set
                          ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Lane ``lane``'s parts: each with its tensor and part index in the metadata."""
        lanes = manifest["lanes"]
        for k, (i, j) in enumerate(lane_items(manifest, have)):
            if k % lanes != lane:
                continue
            die = faults.die_after_tensors()  # tests only (opendiloco_stream/testing/faults.py)
            if die is not None and i >= die:
                await faults.stop_lane()
            raw = tensor_bytes(tensors[i])
            yield averaging_pb2.DownloadData(metadata=_dumps({"t": i, "p": j}), tensor_part=runtime_pb2.Tensor(
                buffer=bytes(raw[j * PART_BYTES:(j + 1) * PART_BYTES])))

    async def _serve_lane(self, sid: Any, lane: int, have: set) -> AsyncIterator[averaging_pb2.DownloadData]:
        found = self._sharing.snapshots.get(sid)
        if found is None or lane >= found[0].get("lanes", 1):
            return  # no such snapshot (expired, or another donor's): the joiner's download fails here
        manifest, tensors = found
        yield averaging_pb2.DownloadData(metadata=_dumps({"snapshot": sid, "lane": lane}))
        async for msg in self._lane_parts(manifest, tensors, lane, have):
            yield msg
        await asyncio.sleep(self._sharing.chunk_timeout)


@dataclass
class _Filling:
    """The tensor being received: its parts land in place, so the peak is the state plus one part."""

    tensor: torch.Tensor
    parts: int  # how many the donor cut it into
    offset: int = 0  # bytes in
    count: int = 0  # parts in

    @classmethod
    def first(cls, part: Any, entry: list, index: int) -> "_Filling":
        """An empty tensor for the manifest's ``entry`` (dtype, shape), checked against the first part."""
        dtype, shape = entry
        if part.dtype != dtype or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise StateError(f"tensor {index} is {part.dtype}, the manifest says {dtype}")
        return cls(torch.empty(shape, dtype=getattr(torch, dtype)), max(1, part.chunks))

    def add(self, part: Any, index: int) -> bool:
        """Write one part in place; True once the last part is in (and the bytes add up)."""
        raw = tensor_bytes(self.tensor)
        if self.offset + len(part.buffer) > len(raw):
            raise StateError(f"tensor {index} has more bytes than its shape")
        raw[self.offset:self.offset + len(part.buffer)] = part.buffer
        self.offset, self.count = self.offset + len(part.buffer), self.count + 1
        if self.count < self.parts:
            return False
        if self.offset != len(raw):
            raise StateError(f"tensor {index} is short of bytes")
        return True


def _state_step(manifest: dict) -> tuple[Optional[int], Optional[float]]:
    """The step of the state a manifest describes (a streaming state's ``step``), if it says one,
    and when the donor reserved the rounds after it for this joiner (``reserved_at``, DHT time);
    (None, None) for a donor still at the initial model (nothing to wait for: the first rounds form anyway)."""
    structure = manifest.get("structure")
    if not isinstance(structure, dict) or structure.get("initial") or isinstance(structure.get("step"), bool):
        return None, None
    step, reserved_at = structure.get("step"), structure.get("reserved_at")
    return (step if isinstance(step, int) else None,
            float(reserved_at) if isinstance(reserved_at, (int, float)) and not isinstance(reserved_at, bool) else None)


class _Progress:
    """A download's progress records, every ``PROGRESS_EVERY_S`` and once at the end."""

    def __init__(self, sink: Optional[Callable[[dict], None]], donor: str, total: int, last_load: dict,
                 state_step: tuple[Optional[int], Optional[float]] = (None, None)):
        self.sink, self.donor, self.total, self.last_load = sink, donor, total, last_load
        self.done_bytes, self.t0 = 0, time.monotonic()
        self.next_at = self.t0 + PROGRESS_EVERY_S
        step, reserved_at = state_step
        if step is not None and sink is not None:  # the manifest's: before any tensor arrives
            sink({"donor": donor, "bytes": 0, "total_bytes": total, "received_bytes": 0, "reused_bytes": 0,
                  "seconds": 0.0, "mib_per_s": 0.0, "done": False, "state_step": step, "reserved_at": reserved_at})

    def add(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if time.monotonic() >= self.next_at:
            self()
            self.next_at = time.monotonic() + PROGRESS_EVERY_S

    def __call__(self, final: bool = False) -> None:
        if self.sink is not None:
            elapsed = max(time.monotonic() - self.t0, 1e-9)
            self.sink({"donor": self.donor, "bytes": self.done_bytes, "total_bytes": self.total,
                       "received_bytes": self.last_load["received_bytes"],
                       "reused_bytes": self.last_load["reused_bytes"], "seconds": round(elapsed, 3),
                       "mib_per_s": round(self.done_bytes / elapsed / (1 << 20), 2), "done": final})


class StateSharing:
    """Donor and joiner sides of late joining for one run (see the module docstring)."""

    def __init__(self, service: Any, run_id: str, *, can_serve: bool, chunk_timeout: float,
                 declare_period: float = 10.0, admission: Any = None):
        self.service, self.can_serve, self.admission = service, can_serve, admission
        self.key, self.handler = f"{run_id}_state.donors", f"{run_id}_state::download"
        self.chunk_timeout, self.declare_period = chunk_timeout, declare_period
        self.provider: Optional[Callable[[], dict]] = None
        self.fragment_provider: Optional[Callable[[int, int], dict]] = None  # one fragment's state (a repair)
        self.snapshots = _Snapshots()  # states flattened for a download's lanes (donor side)
        self.lanes = LANES  # streams a download asks a donor for (joiner side)
        self.last_load: dict[str, Any] = {}  # the last load(): donors tried, tensors and bytes reused
        self._servicer = _StateServicer(self)
        self._serving = threading.local()  # .joiner: the peer the provider in this thread serves
        self._declare_task: Optional[asyncio.Task] = None
        self._expiration = 0.0
        self._p2p: P2P = service.p2p
        self.peer_id = self._p2p.peer_id

    def _call(self, coro, timeout: float) -> Any:
        return self.service.call(coro, timeout)

    # ------------------------------------------------------------------ donor
    def provide(self, provider: Callable[[], dict], joiner: str) -> dict:
        """``provider()`` for ``joiner`` (its peer id), which the provider's thread can ask for
        (:meth:`serving`): the donor reserves the joiner's rounds from inside it."""
        self._serving.joiner = joiner
        try:
            return provider()
        finally:
            self._serving.joiner = None

    def serving(self) -> Optional[str]:
        """The joiner the state provider running in this thread serves, if any."""
        return getattr(self._serving, "joiner", None)

    def set_provider(self, provider: Callable[[], dict]) -> None:
        self.provider = provider
        if self.can_serve and self._declare_task is None:
            self._call(self._start_serving(), timeout=30.0)

    def set_fragment_provider(self, provider: Callable[[int, int], dict]) -> None:
        """Serve one fragment's state (``provider(fragment, round)``) to groupmates that repair
        theirs, on the same handler (a request naming a ``fragment`` and a ``round``)."""
        self.fragment_provider = provider

    async def _start_serving(self) -> None:
        await self._p2p.add_protobuf_handler(self.handler, self._servicer.rpc_download_state,
                                             averaging_pb2.DownloadData, stream_output=True)
        await self._declare()  # joiners can find us as soon as set_provider returns
        self._declare_task = asyncio.ensure_future(self._declare_periodically())

    async def _declare(self) -> None:
        self._expiration = get_dht_time() + 2 * self.declare_period
        try:
            await self.service.dht_call("store", self.key, subkey=self._p2p.peer_id.to_bytes(), value=get_dht_time(),
                                        expiration_time=self._expiration)
        except Exception as e:
            logger.debug("could not declare as state donor: %r", e)

    async def _declare_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.declare_period)
            await self._declare()

    async def _stop_serving(self) -> None:
        self._declare_task.cancel()
        try:  # withdraw: a newer record with no value hides ours from joiners
            await asyncio.wait_for(self.service.dht_call(
                "store", self.key, subkey=self._p2p.peer_id.to_bytes(), value=None,
                expiration_time=max(self._expiration, get_dht_time()) + 1e-3), 2.0)
        except Exception as e:
            logger.debug("could not withdraw as state donor: %r", e)
        await self._p2p.remove_protobuf_handler(self.handler, stream_output=True)

    # ------------------------------------------------------------------ joiner
    def load(self, timeout: float, progress: Optional[Callable[[dict], None]] = None,
             since: Optional[dict] = None) -> Optional[dict]:
        """The state of one donor of the run, or None if none is there or none delivered within ``timeout``.
        ``progress(record)`` (called on this object's event-loop thread: keep it short) gets the
        donor, bytes received and reused, the state's bytes and the rate, every few seconds and at the end.
        ``since``: a state loaded before (stale now): its tensors are reused where unchanged ("Refreshing")."""
        deadline = time.monotonic() + timeout
        self.last_load = {"donors": [], "failures": [], "reused_tensors": 0, "reused_bytes": 0,
                          "received_bytes": 0, "lanes": 1}
        held = {}
        if since is not None:
            _manifest, tensors = flatten_state(since)
            held = {digest: t for digest, t in zip(_manifest["digests"], tensors)}
        try:
            return self._call(asyncio.wait_for(self._load(deadline, progress, held), timeout), timeout + 2.0)
        except (asyncio.TimeoutError, TimeoutError):
            logger.warning("no peer delivered the run's state within %.1fs", timeout)
            return None

    def fetch(self, peer: str, fragment: int, round_index: int, timeout: float,
              since: Optional[dict] = None) -> Optional[dict]:
        """Fragment ``fragment``'s state after round ``round_index`` from groupmate ``peer`` (base58):
        a download like a joiner's from one donor (``have``: the digests of ``since``'s tensors,
        which it holds, so only the tensors that differ move); None if it failed or took longer
        than ``timeout``."""
        self.last_load = {"donors": [peer], "reused_tensors": 0, "reused_bytes": 0, "received_bytes": 0, "lanes": 1}
        held = {}
        if since is not None:
            _manifest, tensors = flatten_state(since)
            held = {digest: t for digest, t in zip(_manifest["digests"], tensors)}
        try:
            donor = PeerID.from_base58(peer)
            fields = {"fragment": int(fragment), "round": int(round_index)}
            return self._call(asyncio.wait_for(self._download(donor, held, fields=fields), timeout), timeout + 2.0)
        except Exception as e:  # dead, stalled, refused or no provider: the caller retries at the next round
            logger.info("fetching fragment %d's state from %s failed: %r", fragment, peer, e)
            return None

    async def _donors(self) -> list[PeerID]:
        found = await self.service.dht_call("get", self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        me = self._p2p.peer_id
        donors = []
        for subkey, entry in found.value.items():
            if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (int, float)):
                try:
                    peer = PeerID(subkey)
                except Exception:
                    continue
                if peer != me:
                    donors.append(peer)
        return donors

    async def _load(self, deadline: float, progress: Optional[Callable[[dict], None]],
                    held: dict[str, torch.Tensor]) -> Optional[dict]:
        """``held``: digest -> whole tensor this peer has (a stale state's; then every whole tensor
        received from a donor that failed)."""
        for attempt in range(LOAD_PASSES):
            donors = await self._donors()
            if not donors:
                if attempt == 0:
                    logger.info("no state donor of the run is announced: this peer starts from its own initial model")
                else:
                    logger.warning("no state donor of the run is announced any more: this peer starts from its own "
                                   "initial model")
                return None
            state = await self._load_pass(donors, deadline, progress, held)
            if state is not None:
                return state
            wait = min(LOAD_RETRY_S * 2 ** attempt, deadline - time.monotonic())
            if attempt == LOAD_PASSES - 1 or wait <= 0:
                break
            # one dial that failed (a link or a daemon slow for a moment) bars that address for
            # a few seconds in libp2p ("dial backoff"): ask again after it, not never
            logger.warning("no donor of %d delivered the run's state (%s): asking again in %.0fs (%d whole "
                           "tensors kept)", len(donors), self.last_load["failures"][-1], wait, len(held))
            await asyncio.sleep(wait)
        logger.warning("no donor delivered the run's state after %d tries (%s): this peer starts from its own "
                       "initial model", len(self.last_load["failures"]), self.last_load["failures"][-1]
                       if self.last_load["failures"] else "no time left")
        return None

    async def _load_pass(self, donors: list[PeerID], deadline: float, progress: Optional[Callable[[dict], None]],
                         held: dict[str, torch.Tensor]) -> Optional[dict]:
        """Each donor in random order, with its share of the time left, until one delivers."""
        random.shuffle(donors)
        for i, donor in enumerate(donors):
            budget = (deadline - time.monotonic()) / (len(donors) - i)
            if budget <= 0:
                break
            t0 = time.monotonic()
            self.last_load["donors"].append(str(donor))
            try:
                state = await asyncio.wait_for(self._download(donor, held, progress), budget)
            except Exception as e:  # dead, stalled, empty or truncated: try the next donor
                self.last_load["failures"].append(f"{str(donor)[-8:]}: {e!r}"[:300])
                logger.info("state download from %s failed after %.1fs (%d whole tensors kept for the next "
                            "donor): %r", donor, time.monotonic() - t0, len(held), e)
                continue
            logger.info("downloaded the run's state from %s in %.2fs", donor, time.monotonic() - t0)
            return state
        return None

    async def _download(self, donor: PeerID, held: dict[str, torch.Tensor],
                        progress: Optional[Callable[[dict], None]] = None, fields: Optional[dict] = None) -> dict:
        """One donor's state. ``held``: whole tensors from donors that failed (by digest): asked
        for as ``have``, reused where this donor's manifest lists the same digest; every whole
        tensor received here is added to it, so a failure here leaves them to the next donor."""
        me, theirs = self.peer_id.to_bytes(), donor.to_bytes()
        have = sorted(held)
        stream = await self._p2p.iterate_protobuf_handler(
            donor, self.handler, self._request(theirs, have, lanes=self.lanes, **(fields or {})),
            averaging_pb2.DownloadData)
        try:
            it = stream.__aiter__()
            manifest = await self._manifest(it, theirs, me)
            report = _Progress(progress, str(donor), int(manifest.get("bytes", 0)), self.last_load,
                               _state_step(manifest))
            if isinstance(manifest.get("lanes"), int) and manifest["lanes"] > 1:
                tensors = await self._receive_lanes(donor, it, manifest, held, have, report)
            else:
                tensors = await self._receive(it, manifest, held, report)
            report(final=True)
            return unflatten_state(manifest, tensors)
        finally:
            await stream.aclose()

    def _request(self, theirs: bytes, have: list, **fields: Any) -> averaging_pb2.DownloadData:
        me = self.peer_id.to_bytes()
        return averaging_pb2.DownloadData(metadata=_dumps({
            "auth": None if self.admission is None else self.admission.state_proof("request", me, theirs),
            "have": have, **fields}))

    async def _receive_lanes(self, donor: PeerID, first: Any, manifest: dict, held: dict[str, torch.Tensor],
                             have: list, report: "_Progress") -> list:
        """Every tensor of the manifest: reused from ``held``, or its parts from the ``lanes``
        streams (``first``: lane 0, the manifest's own), written in place, each checked whole."""
        lanes, digests = manifest["lanes"], manifest["digests"]
        asked = set(have)  # what the donor skips: reused from ``held`` as it was when asked
        items = lane_items(manifest, asked)
        tensors: list[Optional[torch.Tensor]] = [None] * len(digests)
        for i, digest in enumerate(digests):
            if digest in asked:
                tensors[i] = held[digest]
                self.last_load["reused_tensors"] += 1
                self.last_load["reused_bytes"] += tensors[i].numel() * tensors[i].element_size()
                report.add(tensors[i].numel() * tensors[i].element_size())
            else:
                dtype, shape = manifest["tensors"][i]
                if not isinstance(getattr(torch, dtype, None), torch.dtype):
                    raise StateError(f"tensor {i} has an unknown dtype {dtype}")
                tensors[i] = torch.empty(shape, dtype=getattr(torch, dtype))
        parts_left = {}
        for i, _j in items:
            parts_left[i] = parts_left.get(i, 0) + 1
        self.last_load["lanes"] = lanes
        streams = []
        try:
            # the further lanes open together: one after the other, each open's round trip would add up
            opened = await asyncio.gather(*(self._p2p.iterate_protobuf_handler(
                donor, self.handler, self._request(donor.to_bytes(), have, lane=lane, snapshot=manifest.get("snapshot")),
                averaging_pb2.DownloadData) for lane in range(1, lanes)), return_exceptions=True)
            streams = [s for s in opened if not isinstance(s, BaseException)]
            failed = next((s for s in opened if isinstance(s, BaseException)), None)
            if failed is not None:
                raise StateError(f"a lane of the download could not be opened: {failed!r}")
            its = [first] + [s.__aiter__() for s in streams]
            tasks = [asyncio.ensure_future(self._lane(its[lane], lane, lanes, manifest, items, tensors, parts_left,
                                                      held, report)) for lane in range(lanes)]
            try:
                await asyncio.gather(*tasks)
            finally:  # a lane that failed ends the others: none may write into ``held`` after this download
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for stream in streams:
                await stream.aclose()
        return tensors

    async def _lane(self, it: Any, lane: int, lanes: int, manifest: dict, items: list, tensors: list,
                    parts_left: dict, held: dict, report: "_Progress") -> None:
        loop = asyncio.get_event_loop()
        mine = [item for k, item in enumerate(items) if k % lanes == lane]
        if lane > 0:  # a further lane opens with its header
            head = await self._next(it, lane)
            marker = _loads(head.metadata) if head.metadata else None
            if not isinstance(marker, dict) or marker.get("lane") != lane or marker.get("snapshot") != manifest.get("snapshot"):
                raise StateError(f"lane {lane} does not belong to this download")
        for i, j in mine:
            msg = await self._next(it, lane)
            where = _loads(msg.metadata) if msg.metadata else None
            if not isinstance(where, dict) or (where.get("t"), where.get("p")) != (i, j):
                raise StateError(f"lane {lane} does not match the manifest at tensor {i} part {j}")
            raw, buf = tensor_bytes(tensors[i]), msg.tensor_part.buffer
            lo = j * PART_BYTES
            if len(buf) != min(PART_BYTES, len(raw) - lo):
                raise StateError(f"tensor {i} part {j} has {len(buf)} bytes")
            raw[lo:lo + len(buf)] = buf
            self.last_load["received_bytes"] += len(buf)
            report.add(len(buf))
            parts_left[i] -= 1
            if parts_left[i] == 0:  # whole: check it, keep it for another donor if this one fails
                if await loop.run_in_executor(None, tensor_digest, tensors[i]) != manifest["digests"][i]:
                    raise StateError(f"tensor {i} does not match its digest")
                held[manifest["digests"][i]] = tensors[i]

    async def _next(self, it: Any, lane: int) -> Any:
        try:
            return await asyncio.wait_for(it.__anext__(), self.chunk_timeout)
        except StopAsyncIteration:
            raise StateError(f"lane {lane} ended early (donor left, or its snapshot expired)") from None

    async def _manifest(self, it: Any, theirs: bytes, me: bytes) -> dict:
        """The stream's first message: what the donor will send, checked (its proof, a digest each)."""
        try:
            first = await it.__anext__()  # the provider may take a while: bounded by the donor's budget
        except StopAsyncIteration:
            raise StateError("the stream ended before the manifest (the donor left, or has no state)") from None
        manifest = _loads(first.metadata)
        if self.admission is not None:
            why = self.admission.check_state_proof(manifest.get("auth"), "reply", theirs, me)
            if why is not None:
                raise StateError(f"the donor is refused: {why}")
        if len(manifest.get("digests") or []) != len(manifest["tensors"]):
            raise StateError("the manifest has no digest for every tensor")
        return manifest

    async def _receive(self, it: Any, manifest: dict, held: dict[str, torch.Tensor], report: "_Progress") -> list:
        """Every tensor of the manifest, reused from ``held`` or received in parts and checked."""
        expected, digests = len(manifest["tensors"]), manifest["digests"]
        loop = asyncio.get_event_loop()
        tensors: list[torch.Tensor] = []
        filling: Optional[_Filling] = None
        while len(tensors) < expected:  # we know what to expect: stop there and close (the donor waits for that)
            try:
                msg = await asyncio.wait_for(it.__anext__(), self.chunk_timeout)
            except StopAsyncIteration:
                raise StateError(f"the stream ended after {len(tensors)} of {expected} tensors (donor left?)") from None
            index = len(tensors)
            if msg.metadata:  # "you have tensor i": reuse it
                marker = _loads(msg.metadata)
                if filling is not None or not isinstance(marker, dict) or marker.get("have") != index or digests[index] not in held:
                    raise StateError(f"the stream does not match its manifest at tensor {index}")
                t = held[digests[index]]
                self.last_load["reused_tensors"] += 1
                self.last_load["reused_bytes"] += t.numel() * t.element_size()
            else:
                part = msg.tensor_part
                if bool(part.dtype) != (filling is None):  # the first part of a tensor carries its dtype
                    raise StateError(f"tensor {index} is missing parts")
                filling = filling or _Filling.first(part, manifest["tensors"][index], index)
                self.last_load["received_bytes"] += len(part.buffer)
                if not filling.add(part, index):
                    continue
                t, filling = filling.tensor, None
                if await loop.run_in_executor(None, tensor_digest, t) != digests[index]:
                    raise StateError(f"tensor {index} does not match its digest")
                held[digests[index]] = t
            tensors.append(t)
            report.add(t.numel() * t.element_size())
        return tensors

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop serving (withdraw the declaration); the service's loop and p2p client stay the transport's."""
        try:
            if self._declare_task is not None:
                self._call(self._stop_serving(), timeout=5.0)
        except Exception as e:
            logger.debug("state sharing did not close cleanly: %r", e)
