"""Late joiners: serve this peer's state and download the run's state from peers already in it.

Runs in the host process, on an event-loop thread of its own, over a replica of the DHT's P2P
daemon: no averager is involved, so a donor in the middle of a round answers at once and the
provider never waits for an averager lock.

Protocol: a donor declares itself under the DHT key ``{run_id}_state.donors`` (subkey: its peer id,
refreshed every ``declare_period``) and serves ``rpc_download_state`` in the P2P namespace
``{run_id}_state``: one message with the manifest (the state's structure with tensors replaced by
references, and every tensor's dtype and shape), then each tensor serialized and cut in parts.

The joiner tries the donors in random order (joiners spread over donors) and gives each at most
its share of the remaining time. It checks every download against the manifest, because a donor
that dies mid-stream just ends the stream early (hivemind's own ``load_state_from_peers`` returns
such a truncated state as a success), and on any failure moves on to the next donor. One donor
per download, not parts from several: under eager updates donors' states differ slightly and must
not be mixed.

With an ``admission`` (``net/auth.py``), the joiner's request and the donor's manifest each carry a
proof of the run key bound to both peer ids (and the run fingerprint): a donor serves nobody
without the key, and a joiner takes nothing from a donor without it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import msgpack
import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

logger = logging.getLogger(__name__)

PART_BYTES = 1 << 20
_REF = "__ods_tensor__"
_SCALARS = (int, float, bool, str, bytes, type(None))


def _dumps(obj: Any) -> bytes:
    return MSGPackSerializer.dumps(obj)  # tuples survive (hivemind's ext type)


def _loads(data: bytes) -> Any:
    # hivemind's loads refuses non-string map keys; optimizer state dicts are keyed by ints
    return msgpack.loads(data, ext_hook=MSGPackSerializer._decode_ext_types, raw=False, strict_map_key=False)


class StateError(ValueError):
    """A download that does not match its manifest (truncated, wrong dtype or shape)."""


def flatten_state(state: Any) -> tuple[dict, list[torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples; tensors and plain scalars) into a manifest and tensors."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach().cpu().contiguous())
            return {_REF: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v, f"{where}[{k!r}]") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return tuple(items) if isinstance(obj, tuple) else items
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, _SCALARS):
            return obj
        raise TypeError(f"state{where}: cannot share a {type(obj).__name__}; use tensors, numbers, strings, dicts, lists")

    structure = walk(state, "")
    specs = [[str(t.dtype).replace("torch.", ""), list(t.shape)] for t in tensors]
    return {"v": 1, "structure": structure, "tensors": specs}, tensors


def unflatten_state(manifest: dict, tensors: list[torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``; checks the tensors against the manifest."""
    specs = manifest["tensors"]
    if len(tensors) != len(specs):
        raise StateError(f"got {len(tensors)} tensors, the manifest lists {len(specs)}")
    for i, (t, (dtype, shape)) in enumerate(zip(tensors, specs)):
        if str(t.dtype).replace("torch.", "") != dtype or list(t.shape) != list(shape):
            raise StateError(f"tensor {i} is {t.dtype}{list(t.shape)}, the manifest says {dtype}{shape}")

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_REF}:
                return tensors[obj[_REF]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(manifest["structure"])


class _StateServicer(ServicerBase):
    def __init__(self, sharing: "StateSharing"):
        self._sharing = sharing

    async def rpc_download_state(self, request: averaging_pb2.DownloadData, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # the request is a DownloadData (hivemind's is empty): its metadata carries the joiner's proof
        provider, admission = self._sharing.provider, self._sharing.admission
        if provider is None:
            return  # an empty stream: the joiner moves on
        me, joiner = self._sharing.peer_id.to_bytes(), context.remote_id.to_bytes()
        if admission is not None:
            try:
                proof = _loads(request.metadata) if request.metadata else None
            except Exception:
                proof = None
            why = admission.check_state_proof(proof, "request", joiner, me)
            if why is not None:
                logger.info("not serving state to %s: %s", context.remote_id, why)
                return
        loop = asyncio.get_event_loop()
        try:
            manifest, tensors = await loop.run_in_executor(None, lambda: flatten_state(provider()))
        except Exception as e:
            logger.warning("state provider failed, not serving %s: %r", context.remote_id, e)
            return
        if admission is not None:
            manifest["auth"] = admission.state_proof("reply", me, joiner)
        yield averaging_pb2.DownloadData(metadata=_dumps(manifest))
        for tensor in tensors:
            serialized = await loop.run_in_executor(None, serialize_torch_tensor, tensor)
            for part in split_for_streaming(serialized, PART_BYTES):
                yield averaging_pb2.DownloadData(tensor_part=part)
        # Keep the stream open until the joiner closes it (which cancels us): closing first may
        # drop the last parts in flight (see protocol.py, "Closing").
        await asyncio.sleep(self._sharing.chunk_timeout)


class StateSharing:
    """Donor and joiner sides of late joining for one run (see the module docstring)."""

    def __init__(self, dht: DHT, run_id: str, *, can_serve: bool, chunk_timeout: float, declare_period: float = 10.0,
                 admission: Any = None):
        self.dht, self.can_serve, self.admission = dht, can_serve, admission
        self.key, self.namespace = f"{run_id}_state.donors", f"{run_id}_state"
        self.chunk_timeout, self.declare_period = chunk_timeout, declare_period
        self.provider: Optional[Callable[[], dict]] = None
        self._servicer = _StateServicer(self)
        self._declare_task: Optional[asyncio.Task] = None
        self._expiration = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"state-{run_id}", daemon=True)
        self._thread.start()
        try:
            self._p2p: P2P = self._call(self._connect(), timeout=30.0)
            self.peer_id = self._p2p.peer_id
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self) -> P2P:
        maddr = await self._loop.run_in_executor(None, self.dht.run_coroutine, DHT._get_p2p_daemon_listen_maddr)
        return await P2P.replicate(maddr)

    # ------------------------------------------------------------------ donor
    def set_provider(self, provider: Callable[[], dict]) -> None:
        self.provider = provider
        if self.can_serve and self._declare_task is None:
            self._call(self._start_serving(), timeout=30.0)

    async def _start_serving(self) -> None:
        await self._servicer.add_p2p_handlers(self._p2p, namespace=self.namespace)
        await self._declare()  # joiners can find us as soon as set_provider returns
        self._declare_task = asyncio.ensure_future(self._declare_periodically())

    async def _declare(self) -> None:
        self._expiration = get_dht_time() + 2 * self.declare_period
        try:
            await self.dht.store(self.key, subkey=self._p2p.peer_id.to_bytes(), value=get_dht_time(),
                                 expiration_time=self._expiration, return_future=True)
        except Exception as e:
            logger.debug("could not declare as state donor: %r", e)

    async def _declare_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.declare_period)
            await self._declare()

    async def _stop_serving(self) -> None:
        self._declare_task.cancel()
        try:  # withdraw: a newer record with no value hides ours from joiners
            await asyncio.wait_for(self.dht.store(
                self.key, subkey=self._p2p.peer_id.to_bytes(), value=None,
                expiration_time=max(self._expiration, get_dht_time()) + 1e-3, return_future=True), 2.0)
        except Exception as e:
            logger.debug("could not withdraw as state donor: %r", e)
        await self._servicer.remove_p2p_handlers(self._p2p, namespace=self.namespace)

    # ------------------------------------------------------------------ joiner
    def load(self, timeout: float) -> Optional[dict]:
        """The state of one donor of the run, or None if none is there or none delivered within ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            return self._call(asyncio.wait_for(self._load(deadline), timeout), timeout + 2.0)
        except (asyncio.TimeoutError, TimeoutError):
            logger.warning("no peer delivered the run's state within %.1fs", timeout)
            return None

    async def _donors(self) -> list[PeerID]:
        found = await self.dht.get(self.key, latest=True, return_future=True)
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

    async def _load(self, deadline: float) -> Optional[dict]:
        donors = await self._donors()
        random.shuffle(donors)
        for i, donor in enumerate(donors):
            budget = (deadline - time.monotonic()) / (len(donors) - i)
            if budget <= 0:
                break
            t0 = time.monotonic()
            try:
                state = await asyncio.wait_for(self._download(donor), budget)
            except Exception as e:  # dead, stalled, empty or truncated: try the next donor
                logger.info("state download from %s failed after %.1fs: %r", donor, time.monotonic() - t0, e)
                continue
            logger.info("downloaded the run's state from %s in %.2fs", donor, time.monotonic() - t0)
            return state
        return None

    async def _download(self, donor: PeerID) -> dict:
        stub = _StateServicer.get_stub(self._p2p, donor, namespace=self.namespace)
        me, theirs = self.peer_id.to_bytes(), donor.to_bytes()
        request = averaging_pb2.DownloadData()
        if self.admission is not None:
            request.metadata = _dumps(self.admission.state_proof("request", me, theirs))
        stream = await stub.rpc_download_state(request)
        try:
            it = stream.__aiter__()
            try:
                first = await it.__anext__()  # the provider may take a while: bounded by the donor's budget
            except StopAsyncIteration:
                raise StateError("the stream ended before the manifest (the donor left, or has no state)") from None
            manifest = _loads(first.metadata)
            if self.admission is not None:
                why = self.admission.check_state_proof(manifest.get("auth"), "reply", theirs, me)
                if why is not None:
                    raise StateError(f"the donor is refused: {why}")
            expected = len(manifest["tensors"])
            groups: list[list] = []

            def complete() -> bool:
                return len(groups) == expected and (not groups or len(groups[-1]) == max(1, groups[-1][0].chunks))

            while not complete():  # we know what to expect: stop there and close (the donor waits for that)
                try:
                    msg = await asyncio.wait_for(it.__anext__(), self.chunk_timeout)
                except StopAsyncIteration:
                    raise StateError(f"the stream ended after {len(groups)} of {expected} tensors (donor left?)") from None
                if msg.tensor_part.dtype:  # the first part of a tensor carries its dtype
                    if groups and len(groups[-1]) != max(1, groups[-1][0].chunks):
                        raise StateError(f"tensor {len(groups) - 1} is missing parts")
                    groups.append([])
                if not groups or len(groups) > expected:
                    raise StateError("the stream does not match its manifest")
                groups[-1].append(msg.tensor_part)
            tensors = await asyncio.get_event_loop().run_in_executor(
                None, lambda: [deserialize_torch_tensor(combine_from_streaming(p)) for p in groups])
            return unflatten_state(manifest, tensors)
        finally:
            await stream.aclose()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        try:
            if self._declare_task is not None:
                self._call(self._stop_serving(), timeout=5.0)
            self._call(self._p2p.shutdown(), timeout=5.0)  # also removes our client's socket file
            self._call(self._loop.shutdown_default_executor(), timeout=5.0)
        except Exception as e:
            logger.debug("state sharing did not close cleanly: %r", e)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
