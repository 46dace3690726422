"""Staging: how outer gradients leave the outer device and landed averages come back, off the
training thread, and where the outer state lives (``diloco.outer_device``).

On a CUDA outer device (the outer state on the model's GPU):

* **launch** (:meth:`Staging.launch`): the training thread records an event on its stream after
  the outer gradient ``d`` is computed and returns at once. The staging thread then, on a side
  CUDA stream, encodes ``d`` on the GPU where the codec allows it (:func:`device_encodes`: the fp4 formats, round to
  nearest, fp16 scales: 1/8 of the fp32 bytes cross to the host), copies the result into pinned
  host memory, waits for that copy (its own wait, not the trainer's), decodes it on the host into
  a pinned fp32 buffer and hands that to the transport's ``all_reduce``, whose encode of those
  values sends the values it would have sent for ``d`` (up to the sign of a zero).
* **landing** (:class:`StagedHandle`, :class:`OuterView`): the round counts as landed once the
  transport's round is done; its average (and, for a lossy codec, what this peer sent) stay where
  the transport decoded them, in its host buffers (pinned on a GPU peer). The rule that applies
  the round reads them through :class:`OuterView`, one parameter at a time: each parameter's
  piece is copied to the GPU when the rule reaches it (``non_blocking`` from pinned memory, on the
  training thread's current stream, so the kernels that read it come after it in stream order and
  the host thread does not block), and the host buffer is held until that copy finished. A landed
  round comes to the GPU one parameter at a time, never as a whole fragment (two exceptions that
  read it whole on purpose: eager 'corrected''s 'scaled' coefficient, ``rules.py``; error feedback
  in a buffer, ``fragment_sync.Rounds.wait``). For fp32 on the wire, what this peer sent is its
  outer gradient itself, already on the device.

On the CPU the same code runs with the streams and events as no-ops: nothing moves (the transport
takes the outer gradient itself, the average is read as per-parameter views of the tensor the
transport returned: zero copies), and the launch runs inline, so every CPU test goes through
:class:`StagedHandle` and :class:`OuterView`. With ``encode=`` given, a CPU staging also takes the
encode-copy-decode path (tests check its values are exact).

:func:`place_outer_state` decides ``outer_device = "auto"``: the model's GPU when the outer state
fits in its free memory next to the model and its AdamW state, else pinned host memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from opendiloco_stream.compression import blockwise
from opendiloco_stream.compression.codecs import Codec
from opendiloco_stream.compression.wire import NonFiniteError
from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult


# ---------------------------------------------------------------------- the outer state's place
@dataclass(frozen=True)
class OuterPlacement:
    """Where the outer state lives and why (printed at start, part of the summary)."""

    device: str          # "cpu" or the model's CUDA device
    pinned: bool         # host memory pinned for DMA (a CUDA model's outer state on the CPU)
    outer_bytes: int     # the outer state's size
    reason: str

    def line(self) -> str:
        where = "pinned host memory" if self.pinned else self.device
        return f"outer state: {self.outer_bytes / 2**30:.2f} GiB in {where} ({self.reason})"


def outer_state_bytes(numel: int, momentum: bool, eager_start: bool) -> int:
    """fp32 bytes of the outer state for ``numel`` parameters: theta_bar, the outer momentum
    (when momentum > 0) and eager 'corrected''s look-ahead start point."""
    return 4 * numel * (1 + int(momentum) + int(eager_start))


def adamw_pending_bytes(optimizer: torch.optim.Optimizer, device_type: str = "cuda") -> int:
    """Bytes the optimizer has still to allocate on ``device_type``: AdamW's two moment buffers,
    made at its first step, for every parameter there whose state does not exist yet."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type == device_type and not optimizer.state.get(p):
                total += 2 * p.numel() * p.element_size()
    return total


def place_outer_state(setting: str, model_device: torch.device, outer_bytes: int, pending_bytes: int = 0,
                      mem_get_info: Optional[Callable[[torch.device], tuple[int, int]]] = None) -> OuterPlacement:
    """Where ``diloco.outer_device`` puts the outer state of a model on ``model_device``.

    ``auto`` on a CUDA model: on the GPU if its free memory (``torch.cuda.mem_get_info``) less
    ``pending_bytes`` (what AdamW allocates at its first step) holds the outer state, else in
    pinned host memory. ``cpu``: pinned host memory for a CUDA model. ``cuda``: the model's GPU.
    A CPU model keeps everything on the CPU."""
    if model_device.type != "cuda":
        if setting == "cuda":
            raise ValueError(f"outer_device 'cuda' needs the model on a CUDA device; it is on {model_device}")
        return OuterPlacement("cpu", False, outer_bytes, "the model is on the CPU")
    if setting == "cpu":
        return OuterPlacement("cpu", True, outer_bytes, "--outer-device cpu")
    if setting == "cuda":
        return OuterPlacement(str(model_device), False, outer_bytes, "--outer-device cuda")
    free, _total = (mem_get_info or torch.cuda.mem_get_info)(model_device)
    left = free - pending_bytes
    if left >= outer_bytes:
        return OuterPlacement(str(model_device), False, outer_bytes,
                              f"auto: {left / 2**30:.2f} GiB free on the GPU next to the model and AdamW")
    return OuterPlacement("cpu", True, outer_bytes,
                          f"auto: the model and AdamW leave {max(0, left) / 2**30:.2f} GiB free on the GPU, "
                          f"less than the outer state")


# ---------------------------------------------------------------------- events and codecs
class Ready:
    """The point in a side stream where a copy is complete; always complete on the CPU."""

    def __init__(self, event: Optional[Any] = None, device: Optional[torch.device] = None):
        self.event, self.device = event, device

    def query(self) -> bool:
        return self.event is None or bool(self.event.query())

    def synchronize(self) -> None:
        """The calling host thread waits (the staging thread only)."""
        if self.event is not None:
            self.event.synchronize()

    def wait_here(self) -> None:
        """The calling thread's current stream waits for the copy (on the GPU; the host goes on)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)


DEVICE_CODECS = frozenset({"fp4-e3m0", "fp4-e2m1"})


def device_encodes(codec: Optional[Codec]) -> bool:
    """Whether the outer gradient is encoded on the GPU before it crosses to the host: the codec
    is torch ops that run on any device and encoding its own decoded values gives them back, so
    the transport's encode of what the host decoded sends the same values. That holds for the fp4
    formats with fp16 scales, rounding to nearest: a block's largest code decodes to exactly its
    stored scale (the scale has 11 significant bits, the division and product are fp32), which the
    re-encode stores again. Not for int8 / fp8-e4m3 (127 x (s / 127) may exceed s by an fp32 ulp,
    and the rounded-up scale moves a step: 1652 and 9088 of 2^20 random values changed), nor for
    stochastic rounding (another generator on the GPU), the sparse codecs (they pick and pack on the
    CPU) or fp16 / bf16 (2x at most)."""
    return (codec is not None and codec.name in DEVICE_CODECS and codec.scale_dtype == "fp16"
            and not codec.stochastic)


def encode_parts(codec: Codec, flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` quantized where it lives: [scales as bytes, codes] (``blockwise.quantize``)."""
    scales, codes = blockwise.quantize(flat, codec.name, codec.block_size, codec.scale_dtype, None)
    return [scales.contiguous().view(torch.uint8), codes.contiguous()]


def decode_parts(codec: Codec, parts: list[torch.Tensor], numel: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`encode_parts`' result (on the host) back to fp32 values in ``out``."""
    scale_dtype = torch.float16 if codec.scale_dtype == "fp16" else torch.float32
    scales = parts[0].view(scale_dtype)
    return blockwise.dequantize(scales, parts[1], codec.name, numel, codec.block_size, out=out)


# ---------------------------------------------------------------------- staging
class Staging:
    """Moves outer gradients to the host, off the training thread (module docstring); landed
    averages are read from the host per parameter by :class:`OuterView`.

    Args:
        device: the outer device (where outer gradients are taken and averages applied).
        codec: the wire codec; used on the device when :func:`device_encodes` says it can be.
        encode: encode on the device first (default: on CUDA when the codec allows it).
    """

    def __init__(self, device: torch.device, codec: Optional[Codec] = None, encode: Optional[bool] = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.codec = codec if (self.cuda if encode is None else encode) and device_encodes(codec) else None
        # fp32 on the wire: what this peer sent is its outer gradient itself, already on the device
        self.lossless = codec is not None and codec.lossless
        # the side stream (CUDA only). Typed Any: torch's stubs declare ``record_stream``'s argument a
        # ``torch._C.Stream``, which ``torch.cuda.Stream`` is not declared to be (torch 2.x)
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def _record(self) -> Ready:
        if self.stream is None:
            return Ready()
        event = torch.cuda.Event()
        event.record(self.stream)
        return Ready(event, self.device)

    def host_empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A host buffer (pinned when staging for a GPU: the copies are then DMA, asynchronous)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    # ------------------------------------------------------------------ outer gradients -> host
    def to_host(self, flat: torch.Tensor, after: Optional[Ready] = None) -> torch.Tensor:
        """``flat`` (fp32, on the outer device) as a host fp32 tensor the transport may read at
        once: itself if it is already there (and no device encode is asked), else a copy through
        the side stream (encoded on the device first where the codec runs there). Waits for the
        copy: call it off the training thread on CUDA (``launch`` does)."""
        if self.codec is None and flat.device.type == "cpu":
            return flat
        with self._side():
            if after is not None and after.event is not None:
                self.stream.wait_event(after.event)
            parts = [flat]
            if self.codec is not None:
                try:
                    parts = encode_parts(self.codec, flat)
                except NonFiniteError:  # the transport refuses it as it refuses any non-finite contribution
                    pass
            host = [self.host_empty(p.numel(), p.dtype) for p in parts]
            for h, p in zip(host, parts):
                h.copy_(p, non_blocking=True)
            done = self._record()
        done.synchronize()
        if self.codec is None or len(host) == 1:
            return host[0]
        return decode_parts(self.codec, host, flat.numel(), self.host_empty(flat.numel()))

    def launch(self, key: Any, flat: torch.Tensor, start: Callable[[torch.Tensor], SyncHandle]) -> "StagedHandle":
        """``start(host_tensor)`` (the transport's ``all_reduce``) once ``flat`` is on the host.

        On the CPU at once, in this thread. On CUDA the training thread only records an event on
        its stream; the staging thread waits for it, copies and launches, in launch order."""
        handle = StagedHandle(key, self, flat if self.lossless else None)
        if not self.cuda:
            handle.started(self._launch_now(flat, None, start))
            return handle
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        after = Ready(event, self.device)
        flat.record_stream(self.stream)  # the allocator must not reuse it before the side stream read it
        self._submit(lambda: handle.started(self._launch_now(flat, after, start)))
        return handle

    def _launch_now(self, flat: torch.Tensor, after: Optional[Ready], start: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(start(self.to_host(flat, after)))
        except BaseException as e:  # re-raised where the round is waited for
            future.set_exception(e)
        return future

    def _submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ods-staging", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None


class StagedHandle(SyncHandle):
    """A round as the algorithm sees it: launched by :meth:`Staging.launch` (maybe still being
    copied to the host), landed once the transport's round is done. Its result's tensors are the
    transport's (host buffers on a GPU peer; ``sent`` the outer gradient itself for fp32 on the
    wire): the rules read them per parameter on the outer device (:class:`OuterView`). Delegates
    the transport's answers to the transport's handle."""

    def __init__(self, key: Any, staging: Staging, sent: Optional[torch.Tensor] = None):
        self.key, self.staging, self._sent = key, staging, sent  # _sent: what was sent, on the device (fp32)
        self._launched = threading.Event()
        self._inner: Optional["concurrent.futures.Future[SyncHandle]"] = None
        self._landed: Optional[SyncResult] = None
        self._failure: Optional[BaseException] = None

    def started(self, inner: "concurrent.futures.Future[SyncHandle]") -> None:
        self._inner = inner
        self._launched.set()

    def _launch_future(self) -> "concurrent.futures.Future[SyncHandle]":
        """The launch's outcome (the transport's handle, or why it failed); only once launched."""
        assert self._inner is not None, "asked for a launch that has not happened"
        return self._inner

    def _transport_handle(self, timeout: Optional[float] = 0.0) -> Optional[SyncHandle]:
        """The transport's handle; None while the launch is still copying (or failed: see wait)."""
        if not self._launched.wait(timeout):
            return None
        future = self._launch_future()
        return None if future.exception() is not None else future.result()

    def _land(self, result: SyncResult) -> SyncResult:
        if self._landed is None:
            self._landed = result if self._sent is None else dataclasses.replace(result, sent=self._sent.view(-1))
        return self._landed

    def done(self) -> bool:
        if self._landed is not None:
            return True
        if not self._launched.is_set():
            return False
        inner = self._transport_handle()
        if inner is None:
            return True  # the launch failed: wait() says why at once
        if not inner.done():
            return False
        try:
            self._land(inner.wait(0.0))
        except SyncFailed:
            pass
        return True

    def wait(self, timeout: Optional[float] = None) -> SyncResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        landed = self._landed
        if landed is None:
            if not self._launched.wait(timeout):
                raise SyncFailed(f"round {self.key}: its outer gradient was not on the host within {timeout:.1f}s",
                                 key=self.key, reason="timeout")
            future = self._launch_future()
            failure = future.exception()
            if failure is not None:
                raise failure
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            landed = self._land(future.result().wait(left))
        return landed

    def settle(self, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        inner = self._transport_handle(timeout)
        if inner is None:
            return self._launched.is_set()
        return inner.settle(max(0.0, deadline - time.monotonic()))

    def takes_newcomers(self) -> bool:
        """The transport handle's answer; True while still on its way to the transport, and for a
        launch that failed (the round closes nothing: ``wait`` fails at once)."""
        if not self._launched.is_set():
            return True
        inner = self._transport_handle()
        return True if inner is None else inner.takes_newcomers()

    def abandon(self) -> bool:
        inner = self._transport_handle()
        return inner is not None and inner.abandon()


# ---------------------------------------------------------------------- landed rounds, per parameter
class OuterView:
    """A landed round's tensors, per parameter, on the outer device: flat fragment tensors (an
    average, what this peer sent, an outer gradient) read as one tensor per parameter of ``like``
    (the outer parameters: their shapes, device and dtype), in order.

    A piece already on the parameter's device, in its dtype, is a view of the flat tensor (the
    CPU's case, and a GPU outer gradient's: zero copies). Any other piece is copied when it is
    reached (:meth:`fetch`), so a landing holds one converted parameter at a time, never the
    fragment. From host memory to a CUDA device the copy is ``non_blocking`` on the calling
    thread's current stream: stream order puts it before the kernels that then read the piece (no
    event to wait on, no host-side wait), and from pinned memory it is an asynchronous DMA; the host
    tensor is held here until an event recorded after the copy has completed, since the transport's
    buffer pool reuses a block as soon as nothing refers to it. It is not on the side stream: a copy
    issued there ahead of its use would need the piece's device memory ahead of its use too (the
    whole fragment, unless the copies were paced), and it would still make the training stream wait
    for it.

    ``copies`` and ``largest_copy`` count the pieces copied and the largest of them (elements):
    what tests can check of the per-parameter contract without a GPU."""

    def __init__(self, like: list[torch.Tensor]):
        self.like = like
        self.copies = 0
        self.largest_copy = 0
        self._held: list[tuple[Ready, torch.Tensor]] = []  # host pieces an H2D copy may still read
        self._held_lock = threading.Lock()

    def pieces(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        """``flat`` one parameter at a time on the outer device (each copied, if it must be, only
        when it is reached)."""
        total = sum(p.numel() for p in self.like)
        if total != flat.numel():
            raise ValueError(f"outer gradient has {flat.numel()} elements, fragment has {total}")
        offset = 0
        for p in self.like:
            v = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            yield v if v.device == p.device and v.dtype == p.dtype else self.fetch(v, p)

    def fetch(self, piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``piece`` as a new tensor on ``like``'s device, in its dtype (the class docstring says
        how a host-to-GPU copy is made)."""
        self.copies += 1
        self.largest_copy = max(self.largest_copy, piece.numel())
        if like.device.type != "cuda" or piece.device.type != "cpu":
            return piece.to(like.device, like.dtype)
        out = torch.empty(piece.shape, dtype=piece.dtype, device=like.device)  # on the current stream
        out.copy_(piece, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(like.device))
        self._hold(Ready(event, like.device), piece)
        return out if out.dtype == like.dtype else out.to(like.dtype)

    def _hold(self, ready: Ready, host: torch.Tensor) -> None:
        with self._held_lock:
            self._held = [(r, t) for r, t in self._held if not r.query()]
            if not ready.query():
                self._held.append((ready, host))
