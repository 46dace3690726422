"""The reduction core every transport shares: layout, validation, verdicts, weighted fp32 mean.

No networking here. ``LocalSwarm`` runs a whole round with :func:`reduce_in_process`; the hivemind
runner (``transport/hivemind/runner.py``) runs the same steps spread over peers and streams. Both
call the same functions on the same chunks in the same order, so an in-process result predicts
the wire's bit for bit (``tests/test_reduction_parity.py``).

One round of one fragment, in a group whose members are ordered (rank order locally, the
leader's order over hivemind; client-mode peers send but reduce nothing):

1. *Layout* (:class:`GroupLayout`, ``layout.py``). The flat fragment is cut into one contiguous part per reducer,
   with boundaries on whole codec blocks (so encoding part by part equals encoding the whole
   tensor, for deterministic codecs), and each part into chunks of about ``chunk_bytes`` encoded
   bytes. Every member computes the same layout from (numel, group order, codec).
2. *Metadata* (:func:`member_metadata`, :func:`judge_members`). Members agree on protocol version,
   codec, size and round, or the round is refused (:class:`GroupMismatch`); an invalid weight is
   REJECTED, weight 0 ABSTAINED.
3. *Contributions* (:func:`encode_chunk`). Every sender encodes each chunk once; what it sent is
   ``deQ(Q(chunk))``. The reducer of the part checks each chunk (:meth:`PartReducer.take`: format,
   size, finite values).
4. *Verdicts* (:meth:`PartReducer.verdict`, :func:`combine_verdicts`). A reducer judges every
   sender: OK, MISSING (never sent / stalled / disconnected), REJECTED (bad bytes, non-finite, norm
   above ``norm_bound`` x the group median) or ABSTAINED; the group's verdict is the most severe
   status any reducer gave, so all parts average the same contributions.
5. *Results* (:meth:`PartReducer.reduce_chunk`). The weighted fp32 mean of the accepted
   contributions in member order, encoded ONCE; every member decodes those same bytes, hence
   bit-identical averages. Sparse codecs forward the accepted contributions' bytes instead and
   every member computes the same fp32 mean of them (:func:`decode_result`; docs/sparse.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import torch

from opendiloco_stream.compression import Codec, NonFiniteError, all_finite, native
from opendiloco_stream.transport.bundle import pack_bundle, unpack_bundle
from opendiloco_stream.transport.layout import DEFAULT_CHUNK_BYTES, GroupLayout

PROTOCOL_VERSION = 1

# Sender status in a verdict, ordered by severity (combine_verdicts keeps the maximum).
OK, ABSTAINED, MISSING, REJECTED = 0, 1, 2, 3
STATUS_NAMES = {OK: "ok", ABSTAINED: "abstained", MISSING: "missing", REJECTED: "rejected"}

DEFAULT_NORM_BOUND = 10.0


class GroupMismatch(ValueError):
    """Members of one group disagree on protocol, codec, fragment size or round: nothing to average."""


def codec_spec(codec: Codec) -> list:
    """What must match between members for their bytes to be reducible together."""
    spec = [codec.name, codec.block_size if codec.is_blockwise else 0, codec.scale_dtype if codec.is_blockwise else ""]
    return spec + [codec.k] if codec.is_sparse else spec  # dense specs unchanged: older peers still match


# ---------------------------------------------------------------------------------------- members
def member_metadata(codec: Codec, numel: int, key: Hashable, weight: float,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """What a member tells the group about its contribution (gathered by matchmaking over hivemind);
    ``chunk``: its chunk size (the group cuts the smallest, ``layout.group_chunk_bytes``)."""
    return dict(v=PROTOCOL_VERSION, w=float(weight), spec=codec_spec(codec), numel=int(numel),
                key=[int(k) for k in key] if isinstance(key, (tuple, list)) else key, chunk=int(chunk_bytes))


def judge_members(users: Sequence, me: int, is_aux: Sequence[bool]) -> tuple[list[float], list[int]]:
    """From every member's :func:`member_metadata`: weights and initial statuses (REJECTED for an
    invalid weight, ABSTAINED for weight 0 or auxiliary peers).

    Raises ``GroupMismatch`` if a member runs another protocol version, codec, size or round.
    """
    mine = users[me]
    weights, status = [], []
    for i, user in enumerate(users):
        if not isinstance(user, dict) or user.get("v") != PROTOCOL_VERSION:
            raise GroupMismatch(f"member {i} speaks another protocol version: {user!r:.80}")
        for name in ("spec", "numel", "key"):
            if user.get(name) != mine[name]:
                raise GroupMismatch(f"member {i} has {name}={user.get(name)!r}, this peer {mine[name]!r}: "
                                    "peers of a run must share codec and fragments")
        w = user.get("w")
        valid = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
        weights.append(float(w) if valid else 0.0)
        status.append(REJECTED if not valid else ABSTAINED if (is_aux[i] or w == 0) else OK)
    return weights, status


# ---------------------------------------------------------------------------------------- values
def encode_chunk(codec: Codec, chunk: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """A sender's chunk on the wire: its bytes, and ``deQ`` of them (what this member sent).

    Raises ``NonFiniteError`` for NaN or Inf: such a contribution cannot be sent.
    """
    payload = codec.encode(chunk)
    return payload, codec.decode(payload, numel=chunk.numel())


def check_chunk(codec: Codec, payload: bytes, numel: int) -> tuple[Optional[torch.Tensor], str]:
    """Decode one contribution chunk; ``(tensor, "")`` if usable, else ``(None, why)``.

    Checks the format and size against this codec (the header must match exactly) and that every
    value is finite.
    """
    try:
        values = codec.decode(payload, numel=numel, share=True)  # fp32: a view of the received bytes
    except ValueError as e:  # includes NonFiniteError
        return None, str(e)
    if values.numel() != numel:
        return None, f"decoded {values.numel()} values, expected {numel}"
    if not all_finite(values):
        return None, "non-finite values"
    return values, ""


def sum_of_squares(values: torch.Tensor) -> float:
    """``sum(values**2)`` for the norm check: fp32 (pairwise-summed, ~1e-7 relative), or fp64
    where fp32 overflows."""
    sumsq = float(values.square().sum())
    return sumsq if math.isfinite(sumsq) else float(values.double().square().sum())


def norm_verdict(status: list[int], sumsq: Sequence[float], norm_bound: Optional[float]) -> list[int]:
    """Reject OK contributions whose norm exceeds ``norm_bound`` x the median of the OK ones.

    Needs at least 3 OK contributions: with two, the median cannot tell which one is the outlier.
    """
    status = list(status)
    ok = [i for i, s in enumerate(status) if s == OK]
    if norm_bound is None or len(ok) < 3:
        return status
    norms = sorted(math.sqrt(sumsq[i]) for i in ok)
    mid = len(norms) // 2
    median = norms[mid] if len(norms) % 2 else 0.5 * (norms[mid - 1] + norms[mid])
    if median <= 0.0:
        return status
    for i in ok:
        if math.sqrt(sumsq[i]) > norm_bound * median:
            status[i] = REJECTED
    return status


def combine_verdicts(verdicts: Sequence[bytes]) -> bytes:
    """The group's verdict: per sender, the most severe status any reducer gave it."""
    if not verdicts:
        raise ValueError("no verdicts to combine")
    size = len(verdicts[0])
    if any(len(v) != size for v in verdicts):
        raise ValueError("verdicts of different lengths")
    return bytes(max(v[i] for v in verdicts) for i in range(size))


def weighted_mean(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """fp32 weighted mean, summed in the given order, every product and sum rounded on its own (no
    fused multiply-add): bit-identical on any thread count, and in the native kernel (one pass)."""
    total = float(sum(weights))
    if native.usable(*values) and all(v.dtype == torch.float32 and v.dim() == 1 for v in values):
        return native.weighted_mean(list(values), [float(w) for w in weights], total)
    acc = values[0] * weights[0]
    for v, w in zip(values[1:], weights[1:]):
        acc.add_(v * w)
    return acc.div_(total)


# ---------------------------------------------------------------------------------------- reducer
DECODED_LIMIT_BYTES = 1 << 30  # a part's decoded contributions above this are kept encoded (PartReducer)


class PartReducer:
    """A reducer's state for its part: the contributions per sender and chunk, their squared norms
    and each sender's status. ``check`` is pure (safe in an executor thread); the other methods
    mutate and belong to one thread (the event loop, or the caller locally).

    Until the reduction, contributions are kept decoded (fp32: a view of the received bytes). Where
    that would take more than ``decoded_limit`` bytes (4 per element of the part, per sender), a
    lossy codec's contributions are kept as their bytes instead (5.6x less for fp4) and decoded again,
    chunk by chunk, when reduced: the same values, for one more decode (docs/benchmarks.md)."""

    def __init__(self, codec: Codec, chunks: Sequence[tuple[int, int]], status: Sequence[int],
                 norm_bound: Optional[float], decoded_limit: int = DECODED_LIMIT_BYTES):
        self.codec, self.chunks, self.norm_bound = codec, tuple(chunks), norm_bound
        decoded = 4 * sum(hi - lo for lo, hi in self.chunks) * len(status)
        self.keep_bytes = not codec.lossless and decoded > decoded_limit
        self.status = list(status)
        self.values: list[list[Optional[torch.Tensor]]] = [[None] * len(self.chunks) for _ in self.status]
        self.payloads: list[list[Optional[bytes]]] = [[None] * len(self.chunks) for _ in self.status]
        self.sumsq = [0.0] * len(self.status)

    def check(self, j: int, payload: bytes) -> tuple[Optional[torch.Tensor], str, float, Optional[bytes]]:
        """Validate chunk ``j`` of a contribution: values (or None and why), squared norm, and the
        payload itself where the result forwards it (sparse codecs)."""
        lo, hi = self.chunks[j]
        values, why = check_chunk(self.codec, payload, hi - lo)
        sumsq = sum_of_squares(values) if values is not None else 0.0
        if values is None or not (self.keep_bytes or self.codec.is_sparse):
            return values, why, sumsq, None
        return values, why, sumsq, bytes(payload) if self.codec.is_sparse else payload

    def accept(self, s: int, j: int, checked: tuple[Optional[torch.Tensor], str, float, Optional[bytes]]) -> str:
        """Record sender ``s``'s checked chunk ``j``; returns why it was rejected ("" if it was not)."""
        if self.status[s] != OK:
            return ""  # already rejected, missing or abstaining: the rest is ignored
        values, why, sumsq, payload = checked
        if values is None:
            self.drop(s, REJECTED)
            return why
        self.values[s][j] = None if self.keep_bytes else values  # (its bytes are kept: decoded again when reduced)
        self.payloads[s][j] = payload
        self.sumsq[s] += sumsq
        return ""

    def take(self, s: int, j: int, payload: bytes) -> str:
        return self.accept(s, j, self.check(j, payload))

    def drop(self, s: int, status: int) -> None:
        """Count sender ``s`` out (REJECTED, or MISSING if it was OK or abstaining) and forget its values."""
        if status == REJECTED:
            self.status[s] = REJECTED
        elif self.status[s] in (OK, ABSTAINED):
            self.status[s] = MISSING
        self.values[s] = [None] * len(self.chunks)
        self.payloads[s] = [None] * len(self.chunks)

    def verdict(self) -> bytes:
        """This reducer's verdict once every sender was heard or given up on (norms checked)."""
        return bytes(norm_verdict(self.status, self.sumsq, self.norm_bound))

    def reduce_chunk(self, j: int, final: bytes, weights: Sequence[float], parts: bool = False) -> tuple:
        """Chunk ``j`` of the result under the group's verdict ``final``: the bytes every member
        receives and what they decode to (:func:`decode_result`). Dense codecs: the weighted fp32
        mean, encoded once. Sparse codecs: the accepted contributions' own bytes, forwarded, whose
        weighted fp32 mean every member computes the same way (or a dense fp4 mean for large groups).
        With ``parts``, an fp32 result's bytes are ``Codec.encode_parts`` of the mean (no copy)."""
        accepted = [s for s in range(len(final)) if final[s] == OK]
        lo, hi = self.chunks[j]
        values = [self.codec.decode(self.payloads[s][j], numel=hi - lo, share=True) if self.keep_bytes
                  else self.values[s][j] for s in accepted]
        mean = weighted_mean(values, [weights[s] for s in accepted])
        fmt = self.codec.result_codec(len(accepted))
        if fmt is None:
            payload, result = pack_bundle([self.payloads[s][j] for s in accepted]), mean
        elif parts and fmt.lossless:  # lossless: the mean is the result, its memory the bytes
            payload, result = fmt.encode_parts(mean), mean
        else:
            payload = fmt.encode(mean)
            result = fmt.decode(payload, numel=hi - lo)
        for s in accepted:
            self.values[s][j] = self.payloads[s][j] = None
        return payload, result


def decode_result(codec: Codec, payload: bytes, final: bytes, weights: Sequence[float], numel: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What a member makes of a result chunk under the verdict ``final`` (the reducer's own result
    is the same tensor, bit for bit), written into ``out`` if given. Raises ``ValueError`` for
    bytes that do not fit the verdict."""
    accepted = [s for s in range(len(final)) if final[s] == OK]
    fmt = codec.result_codec(len(accepted))
    if fmt is not None:
        return fmt.decode(payload, numel=numel) if out is None else fmt.decode_into(payload, out)
    values = [codec.decode(p, numel=numel) for p in unpack_bundle(payload, len(accepted))]
    mean = weighted_mean(values, [weights[s] for s in accepted])
    return mean if out is None else out.copy_(mean)


@dataclass
class RoundSummary:
    """What the group's verdict means for one member."""

    group_size: int
    weight_share: float
    included_self: bool
    accepted: list[int]
    rejected: int
    missing: int
    total_weight: float


def summarize_verdict(final: bytes, weights: Sequence[float], me: int) -> RoundSummary:
    accepted = [s for s in range(len(final)) if final[s] == OK]
    total = float(sum(weights[s] for s in accepted))
    included = final[me] == OK
    return RoundSummary(group_size=len(accepted), weight_share=weights[me] / total if included and total > 0 else 0.0,
                        included_self=included, accepted=accepted, rejected=sum(1 for s in final if s == REJECTED),
                        missing=sum(1 for s in final if s == MISSING), total_weight=total)


# ---------------------------------------------------------------------------------------- in-process round
class RoundRefused(ValueError):
    """No average: the members disagree (``GroupMismatch``) or nothing valid is left."""


@dataclass
class MemberOutcome:
    """One member's view of an in-process round (``reduce_in_process``)."""

    average: torch.Tensor
    sent: torch.Tensor
    summary: RoundSummary
    bytes_sent: int = 0
    bytes_received: int = 0
    why: list[str] = field(default_factory=list)


def reduce_in_process(codec: Codec, tensors: Sequence[torch.Tensor], weights: Sequence[float], key: Hashable,
                      *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, norm_bound: Optional[float] = DEFAULT_NORM_BOUND
                      ) -> list[MemberOutcome]:
    """One whole round among ``len(tensors)`` members (all reducers), member order = list order.

    Every step is the one the networked runner takes: the same layout, the same bytes, the same
    checks and verdicts, the same mean in the same order, encoded once. Byte counts are the
    encoded payloads a member would put on / take off the wire (no framing). Raises
    :class:`RoundRefused` when the members disagree or no valid contribution is left.
    """
    n = len(tensors)
    flats = [t.detach().reshape(-1).float() for t in tensors]
    metadata = [member_metadata(codec, f.numel(), key, w, chunk_bytes) for f, w in zip(flats, weights)]
    try:
        weights, status = judge_members(metadata, 0, [False] * n)
    except GroupMismatch as e:
        raise RoundRefused(f"round {key}: {e}") from None
    numel = flats[0].numel()
    layout = GroupLayout.for_codec(codec, numel, [True] * n, chunk_bytes)  # every member cuts the same size
    sent = [torch.empty(numel) for _ in range(n)]
    wire_contrib = [[0] * n for _ in range(n)]  # [sender][reducer] bytes
    wire_result = [0] * n  # [reducer] bytes of its part's result, sent to each other member
    reducers = [PartReducer(codec, layout.chunks[q], status, norm_bound) for q in range(n)]
    why: list[list[str]] = [[] for _ in range(n)]
    for s in range(n):  # senders encode every chunk once; each reducer checks what it receives
        for q in range(n):
            for j, (lo, hi) in enumerate(layout.chunks[q]):
                try:
                    payload, sent[s][lo:hi] = encode_chunk(codec, flats[s][lo:hi])
                except NonFiniteError as e:  # a NaN contribution is not sendable: rejected at the source
                    sent[s][lo:hi] = float("nan")
                    reducers[q].drop(s, REJECTED)
                    why[s].append(str(e))
                    continue
                wire_contrib[s][q] += len(payload)
                rejected = reducers[q].take(s, j, payload)
                if rejected:
                    why[s].append(rejected)
    final = combine_verdicts([r.verdict() for r in reducers])
    if not any(final[s] == OK for s in range(n)) or sum(weights[s] for s in range(n) if final[s] == OK) <= 0:
        raise RoundRefused(f"round {key}: no valid contribution left")
    average = torch.empty(numel)
    for q, reducer in enumerate(reducers):
        for j, (lo, hi) in enumerate(layout.chunks[q]):
            payload, average[lo:hi] = reducer.reduce_chunk(j, final, weights)
            wire_result[q] += len(payload)
    outcomes = []
    for m in range(n):
        outcomes.append(MemberOutcome(
            average=average.clone(), sent=sent[m], summary=summarize_verdict(final, weights, m),
            bytes_sent=sum(wire_contrib[m][q] for q in range(n) if q != m) + wire_result[m] * (n - 1),
            bytes_received=sum(wire_contrib[s][m] for s in range(n) if s != m) + sum(
                wire_result[q] for q in range(n) if q != m),
            why=why[m]))
    return outcomes
