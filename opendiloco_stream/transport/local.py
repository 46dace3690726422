"""In-process transport: M simulated peers as threads, deterministic, reducing exactly as the wire does.

``LocalSwarm(num_workers=M)`` plays the group. Each round runs the reduction core of every
transport (``transport/reduce.py``): the tensor is cut into M parts on codec blocks (worker j
reduces part j, as in a butterfly all-reduce), every contribution is encoded with the codec as it
would go on the wire and checked by its reducer (format, size, finite values, norm within
``norm_bound`` x the median), the weighted fp32 mean of the accepted contributions is taken in rank
order and encoded once, and every worker, itself included, decodes those same bytes. Given the
same group order, a round's average is bit-identical to the hivemind transport's. Byte counts are
the encoded payloads the wire would carry: a worker sends its M-1 foreign parts and its reduced
part to M-1 peers, and receives the mirror image.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Union

import torch

from opendiloco_stream.compression import Codec
from opendiloco_stream.compression.spec import DEFAULT_DENSITY, CodecSpec
from opendiloco_stream.transport.base import (
    FetchedFragment, OuterDigest, SyncFailed, SyncHandle, SyncResult, Transport,
)
from opendiloco_stream.transport.failure import FailureReason
from opendiloco_stream.transport.layout import DEFAULT_CHUNK_BYTES
from opendiloco_stream.transport.reduce import DEFAULT_NORM_BOUND, RoundRefused, reduce_in_process


@dataclass(frozen=True)
class LinkModel:
    """When a round of a LocalSwarm lands, counted in the caller's inner steps, so that a run is
    the same bits every time whatever the machine's load.

    ``delay_steps`` D: a round lands D inner steps after its launch. Or, with ``mbit`` and
    ``step_s``, D = ceil(bytes this worker receives x 8 / (mbit x 10^6) / step_s): the round's
    transfer time on a link of that rate, in steps of that length. D = 1 is the instant link (the
    default): the round has landed at the first step after its launch.

    Time is the caller's looks: ``done()`` answers False to a round's first D - 1 looks and True
    from the D-th. StreamingDiLoCo's on-arrival rules look once per inner step from the step after
    the launch, so there the round lands at step t_k + D. ``wait()`` always returns the result: a
    peer that waits for a round is charged no steps (runs compare at equal tokens, not wall time).
    """

    delay_steps: Optional[int] = None
    mbit: Optional[float] = None
    step_s: Optional[float] = None

    def __post_init__(self):
        if self.delay_steps is not None and self.delay_steps < 1:
            raise ValueError(f"link delay must be >= 1 inner step (1: an instant link), got {self.delay_steps}")
        if (self.mbit is None) != (self.step_s is None) or (self.mbit is not None and min(self.mbit, self.step_s) <= 0):
            raise ValueError("a link rate needs both a positive rate (Mbit/s) and a positive step time (s)")
        if self.delay_steps is not None and self.mbit is not None:
            raise ValueError("give a link delay in steps or a link rate with a step time, not both")

    def steps(self, result: Optional[SyncResult]) -> int:
        """D for a round with this result (a failed round: as soon as it is looked at)."""
        if self.delay_steps is not None:
            return self.delay_steps
        if self.mbit is None or result is None:
            return 1
        return max(1, math.ceil(result.bytes_received * 8 / (self.mbit * 1e6) / self.step_s))


INSTANT_LINK = LinkModel()


def peer_name(rank: int) -> str:
    """Worker ``rank``'s peer id (``LocalTransport.peer_id``, the key of ``SyncResult.digests``)."""
    return f"local-{rank}"


class _Round:
    def __init__(self, num_workers: int):
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self.digests: dict[str, OuterDigest] = {}  # by peer id (``LocalTransport.peer_id``)
        self.results: Optional[dict[int, SyncResult]] = None
        self.error: Optional[SyncFailed] = None
        self.num_workers = num_workers
        self.consumed: set[int] = set()


class LocalSwarm:
    """M workers in one process. ``swarm.transport(rank)`` is worker ``rank``'s Transport;
    ``swarm.run(fn)`` calls ``fn(rank)`` in M threads and re-raises the first error.

    Args:
        num_workers: M.
        codec: the wire codec, a ``CodecSpec`` (``DiLoCoConfig.codec_spec()``), or its name with
            ``block_size``, ``scale_dtype``, ``stochastic`` and ``density`` (see ``compression.spec``).
        seed: stochastic rounding's (a round's codec is seeded from it and the round's key).
        timeout: bound on any wait for the other workers (seconds).
        chunk_bytes, norm_bound: as in ``HivemindTransport`` (chunks of a part; the norm check).
        link: when a round lands, in inner steps (:class:`LinkModel`; default: at once).
    """

    def __init__(self, num_workers: int, codec: Union[str, CodecSpec] = "fp32", block_size: Optional[int] = None,
                 scale_dtype: str = "fp16", stochastic: bool = False, seed: int = 0, density: float = DEFAULT_DENSITY,
                 timeout: float = 300.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 norm_bound: Optional[float] = DEFAULT_NORM_BOUND, link: LinkModel = INSTANT_LINK):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        if isinstance(codec, str):
            codec = CodecSpec(codec, block_size=block_size, scale_dtype=scale_dtype, stochastic=stochastic,
                              density=density)
        self.codec_spec = codec
        Codec.from_spec(codec)  # bad codec parameters fail here, not in the first round
        self.seed = seed
        self.timeout = timeout
        self.chunk_bytes, self.norm_bound = int(chunk_bytes), norm_bound
        self.link = link
        self._rounds: dict[Hashable, _Round] = {}
        self._cond = threading.Condition()
        self._aborted: Optional[str] = None
        self._state_providers: dict[int, Callable[[], dict[str, Any]]] = {}
        self._fragment_providers: dict[int, Callable[[int, int], dict[str, Any]]] = {}

    def transport(self, rank: int) -> "LocalTransport":
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank} out of range for {self.num_workers} workers")
        return LocalTransport(self, rank)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run ``fn(rank)`` for every rank in its own thread; return the results in rank order."""
        results: list[Any] = [None] * self.num_workers
        errors: list[tuple[int, BaseException]] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append((rank, e))
                self.abort(f"worker {rank} failed: {e!r}")

        threads = [threading.Thread(target=target, args=(r,), name=f"worker-{r}", daemon=True)
                   for r in range(self.num_workers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            errors.sort(key=lambda x: x[0])
            raise errors[0][1]
        return results

    def abort(self, why: str) -> None:
        """Fail every pending and future round (a worker died: nobody waits for it)."""
        with self._cond:
            self._aborted = why
            self._cond.notify_all()

    # ------------------------------------------------------------------ the reduction
    def _contribute(self, rank: int, key: Hashable, tensor: torch.Tensor, weight: float,
                    digest: Optional[OuterDigest] = None) -> _Round:
        with self._cond:
            rnd = self._rounds.setdefault(key, _Round(self.num_workers))
            if rank in rnd.contributions:
                raise RuntimeError(f"worker {rank} contributed twice to round {key}")
            rnd.contributions[rank] = (tensor.detach().reshape(-1).float().cpu(), float(weight))
            if digest is not None:
                rnd.digests[peer_name(rank)] = digest
            if len(rnd.contributions) == self.num_workers:
                try:
                    rnd.results = self._reduce(key, rnd)
                except SyncFailed as e:
                    rnd.error = e
                rnd.contributions.clear()
                self._cond.notify_all()
            return rnd

    def _reduce(self, key: Hashable, rnd: _Round) -> dict[int, SyncResult]:
        ranks = sorted(rnd.contributions)
        seed = hash((self.seed, key)) & 0x7FFFFFFF  # stochastic rounding: reproducible per round
        codec = Codec.from_spec(self.codec_spec, seed=seed)
        try:
            outcomes = reduce_in_process(codec, [rnd.contributions[r][0] for r in ranks],
                                         [rnd.contributions[r][1] for r in ranks], key,
                                         chunk_bytes=self.chunk_bytes, norm_bound=self.norm_bound)
        except RoundRefused as e:
            raise SyncFailed(str(e), key=key, reason=FailureReason.REJECTED) from None
        return {r: SyncResult(
            average=o.average, group_size=o.summary.group_size, weight_share=o.summary.weight_share, sent=o.sent,
            bytes_sent=o.bytes_sent, bytes_received=o.bytes_received,
            peers=[str(ranks[s]) for s in o.summary.accepted], included_self=o.summary.included_self,
            rejected=o.summary.rejected, digests=dict(rnd.digests)) for r, o in zip(ranks, outcomes)}

    def _wait(self, rank: int, key: Hashable, rnd: _Round, timeout: Optional[float]) -> SyncResult:
        bound = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + bound
        with self._cond:
            while rnd.results is None and rnd.error is None:
                if self._aborted:
                    raise SyncFailed(f"round {key}: swarm aborted ({self._aborted})", key=key,
                                     reason=FailureReason.CLOSED)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SyncFailed(f"round {key}: not all {self.num_workers} workers arrived within {bound:.1f}s",
                                     key=key, reason=FailureReason.TIMEOUT)
                self._cond.wait(remaining)
            rnd.consumed.add(rank)
            if len(rnd.consumed) == self.num_workers:  # everyone has it: forget the round
                self._rounds.pop(key, None)
            if rnd.error is not None:
                raise rnd.error
            return rnd.results[rank]


class _LocalHandle(SyncHandle):
    """A round of a LocalSwarm. A round is reduced as soon as every worker has launched it; when
    it *lands* is the swarm's :class:`LinkModel`. ``done()`` waits for the other workers to reach
    the round (threads in one process: at most about one inner step) and then counts its looks
    against the link's delay, so code that acts "as soon as a round has landed" (eager's
    on-arrival rules) does so at the same step in every run: in-process runs stay deterministic."""

    def __init__(self, swarm: LocalSwarm, rank: int, key: Hashable, rnd: _Round):
        self.swarm, self.rank, self.key, self._round = swarm, rank, key, rnd
        self._result: Optional[SyncResult] = None
        self._error: Optional[SyncFailed] = None
        self._looks = 0

    def done(self) -> bool:
        try:
            self.wait()
        except SyncFailed:
            pass
        self._looks += 1
        return self._looks >= self.swarm.link.steps(self._result)

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                self._result = self.swarm._wait(self.rank, self.key, self._round, timeout)
            except SyncFailed as e:
                if e.reason != FailureReason.TIMEOUT or timeout is None:  # a caller's shorter bound may be retried
                    self._error = e
                raise
        return self._result


class LocalTransport(Transport):
    """Worker ``rank``'s view of a LocalSwarm."""

    def __init__(self, swarm: LocalSwarm, rank: int):
        self.swarm, self.rank = swarm, rank
        self.peer_id = peer_name(rank)

    def all_reduce(self, key: tuple[int, int], tensor: torch.Tensor, weight: float = 1.0,
                   digest: Optional[OuterDigest] = None) -> SyncHandle:
        rnd = self.swarm._contribute(self.rank, key, tensor, weight, digest)
        return _LocalHandle(self.swarm, self.rank, key, rnd)

    def wire_codec(self):
        return Codec.from_spec(self.swarm.codec_spec)  # its own: a codec's rounding generators are state

    def set_state_provider(self, provider: Callable[[], dict[str, Any]]) -> None:
        self.swarm._state_providers[self.rank] = provider

    def set_fragment_provider(self, provider: Callable[[int, int], dict[str, Any]]) -> None:
        self.swarm._fragment_providers[self.rank] = provider

    def fetch_fragment(self, peer: str, fragment: int, round_index: int, timeout: float,
                       since: Optional[dict[str, Any]] = None) -> Optional[FetchedFragment]:
        """The provider of worker ``peer`` called in this thread (no bytes cross a wire)."""
        provider = self.swarm._fragment_providers.get(int(peer.rsplit("-", 1)[-1]))
        return None if provider is None else FetchedFragment(provider(fragment, round_index))

    def load_state_from_peers(self, timeout: float, progress: Optional[Callable[[dict[str, Any]], None]] = None,
                              since: Optional[dict[str, Any]] = None
                              ) -> Optional[dict[str, Any]]:  # in-process: no download to report
        for rank, provider in sorted(self.swarm._state_providers.items()):
            if rank != self.rank:
                return provider()
        return None
