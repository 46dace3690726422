"""In-process transport: M simulated peers as threads, deterministic, with real wire encoding.

``LocalSwarm(num_workers=M)`` plays the group. Each round's tensor is split into M contiguous parts;
worker j reduces part j (as in a butterfly all-reduce): every contribution to a part is encoded
with the codec as it would go on the wire, the reducer decodes them, averages in fp32 in rank
order (deterministic), encodes the average once, and every worker, itself included, decodes those
same bytes. Byte counts are what the wire would carry: a worker sends its M-1 foreign parts and its
reduced part to M-1 peers, and receives the mirror image.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable, Optional

import torch

from opendiloco_stream.compression import NonFiniteError, get_codec
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult, Transport


class _Round:
    def __init__(self, num_workers: int):
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self.results: Optional[dict[int, SyncResult]] = None
        self.error: Optional[SyncFailed] = None
        self.num_workers = num_workers
        self.consumed: set[int] = set()


class LocalSwarm:
    """M workers in one process. ``swarm.transport(rank)`` is worker ``rank``'s Transport;
    ``swarm.run(fn)`` calls ``fn(rank)`` in M threads and re-raises the first error.

    Args:
        num_workers: M.
        codec, block_size, scale_dtype, stochastic, seed: the wire codec (see compression).
        timeout: bound on any wait for the other workers (seconds).
    """

    def __init__(self, num_workers: int, codec: str = "fp32", block_size: int = 64, scale_dtype: str = "fp16",
                 stochastic: bool = False, seed: int = 0, timeout: float = 300.0):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.num_workers = num_workers
        self.codec_args = dict(name=codec, block_size=block_size, scale_dtype=scale_dtype, stochastic=stochastic)
        self.seed = seed
        self.timeout = timeout
        self._rounds: dict[Hashable, _Round] = {}
        self._cond = threading.Condition()
        self._aborted: Optional[str] = None
        self._state_providers: dict[int, Callable[[], dict[str, Any]]] = {}

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
    def _contribute(self, rank: int, key: Hashable, tensor: torch.Tensor, weight: float) -> _Round:
        with self._cond:
            rnd = self._rounds.setdefault(key, _Round(self.num_workers))
            if rank in rnd.contributions:
                raise RuntimeError(f"worker {rank} contributed twice to round {key}")
            rnd.contributions[rank] = (tensor.detach().reshape(-1).float().cpu(), float(weight))
            if len(rnd.contributions) == self.num_workers:
                try:
                    rnd.results = self._reduce(key, rnd)
                except SyncFailed as e:
                    rnd.error = e
                rnd.contributions.clear()
                self._cond.notify_all()
            return rnd

    def _reduce(self, key: Hashable, rnd: _Round) -> dict[int, SyncResult]:
        M = self.num_workers
        ranks = sorted(rnd.contributions)
        numel = rnd.contributions[ranks[0]][0].numel()
        for r in ranks:
            if rnd.contributions[r][0].numel() != numel:
                raise SyncFailed(f"round {key}: contributions differ in size", key=key, reason="rejected")
        bounds = [numel * j // M for j in range(M + 1)]
        seed = hash((self.seed, key)) & 0x7FFFFFFF
        codec = get_codec(**self.codec_args, seed=seed)
        sent_parts: dict[int, list[torch.Tensor]] = {r: [] for r in ranks}
        avg_parts: list[torch.Tensor] = []
        nbytes_contrib = [[0] * M for _ in range(M)]  # [sender][part]
        nbytes_avg = [0] * M
        accepted: list[set[int]] = []
        for j in range(M):  # worker j reduces part j
            lo, hi = bounds[j], bounds[j + 1]
            total = torch.zeros(hi - lo, dtype=torch.float32)
            wsum = 0.0
            ok = set()
            for r in ranks:
                part, w = rnd.contributions[r][0][lo:hi], rnd.contributions[r][1]
                try:
                    payload = codec.encode(part)
                except NonFiniteError:
                    sent_parts[r].append(torch.full_like(part, float("nan")))
                    continue
                nbytes_contrib[r][j] = len(payload)
                decoded = codec.decode(payload)
                sent_parts[r].append(decoded)
                total += decoded * w  # fixed rank order: deterministic
                wsum += w
                ok.add(r)
            if wsum <= 0:
                raise SyncFailed(f"round {key}: no valid contribution for part {j}", key=key, reason="rejected")
            payload = codec.encode(total / wsum)
            nbytes_avg[j] = len(payload)
            avg_parts.append(codec.decode(payload))
            accepted.append(ok)
        average = torch.cat(avg_parts)
        in_all = set.intersection(*accepted)
        total_w = sum(rnd.contributions[r][1] for r in in_all)
        results = {}
        for r in ranks:
            sent_bytes = sum(nbytes_contrib[r][j] for j in range(M) if j != r) + nbytes_avg[r] * (M - 1)
            recv_bytes = sum(nbytes_contrib[s][r] for s in ranks if s != r) + sum(
                nbytes_avg[j] for j in range(M) if j != r)
            included = r in in_all
            results[r] = SyncResult(
                average=average.clone(), group_size=len(in_all),
                weight_share=(rnd.contributions[r][1] / total_w) if included else 0.0,
                sent=torch.cat(sent_parts[r]), bytes_sent=sent_bytes, bytes_received=recv_bytes,
                peers=[str(x) for x in sorted(in_all)], included_self=included,
                rejected=M - len(in_all))
        return results

    def _wait(self, rank: int, key: Hashable, rnd: _Round, timeout: Optional[float]) -> SyncResult:
        bound = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + bound
        with self._cond:
            while rnd.results is None and rnd.error is None:
                if self._aborted:
                    raise SyncFailed(f"round {key}: swarm aborted ({self._aborted})", key=key, reason="closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SyncFailed(f"round {key}: not all {self.num_workers} workers arrived within {bound:.1f}s",
                                     key=key, reason="timeout")
                self._cond.wait(remaining)
            rnd.consumed.add(rank)
            if len(rnd.consumed) == self.num_workers:  # everyone has it: forget the round
                self._rounds.pop(key, None)
            if rnd.error is not None:
                raise rnd.error
            return rnd.results[rank]


class _LocalHandle(SyncHandle):
    def __init__(self, swarm: LocalSwarm, rank: int, key: Hashable, rnd: _Round):
        self.swarm, self.rank, self.key, self._round = swarm, rank, key, rnd
        self._result: Optional[SyncResult] = None

    def done(self) -> bool:
        return self._round.results is not None or self._round.error is not None

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        if self._result is None:
            self._result = self.swarm._wait(self.rank, self.key, self._round, timeout)
        return self._result


class LocalTransport(Transport):
    """Worker ``rank``'s view of a LocalSwarm."""

    def __init__(self, swarm: LocalSwarm, rank: int):
        self.swarm, self.rank = swarm, rank
        self.peer_id = f"local-{rank}"

    def all_reduce(self, key: tuple[int, int], tensor: torch.Tensor, weight: float = 1.0) -> SyncHandle:
        rnd = self.swarm._contribute(self.rank, key, tensor, weight)
        return _LocalHandle(self.swarm, self.rank, key, rnd)

    def set_state_provider(self, provider: Callable[[], dict[str, Any]]) -> None:
        self.swarm._state_providers[self.rank] = provider

    def load_state_from_peers(self, timeout: float) -> Optional[dict[str, Any]]:
        for rank, provider in sorted(self.swarm._state_providers.items()):
            if rank != self.rank:
                return provider()
        return None
