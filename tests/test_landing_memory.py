"""The memory a landing takes: applying a landed round (and taking the next outer gradient) adds at
most one fragment over what the wrapper held before, for every rule (issue 41, "Memory": the
wrapper's memory over the plain loop is the outer state plus one fragment in flight).

Measured with torch's profiler (CPU, ``profile_memory=True``): every allocation and free made
during one fragment's sync, or its landing on arrival, in the order they happened; the peak of
their running sum is what that call held at most above what existed when it began. The
transport's own allocations (its reduction, its result buffers: host memory on a GPU peer, the
averaging service's) are left out: the test transport runs ``all_reduce`` inside a profiler scope
whose allocations, and the later frees of those, are not counted.

The bound is one fragment (fp32) plus one of its largest tensors: the outer gradient of the round
launched at the sync is the fragment in flight, and a landing works one parameter at a time,
holding at most one parameter's temporary. 1 KiB more covers the scalar tensors torch makes for
Python numbers (8 bytes each). Each fragment's first landing is left out: the outer optimizer
creates its momentum there (outer state, allocated once).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from opendiloco_stream import DiLoCoConfig
from opendiloco_stream.algorithm.diloco import StreamingDiLoCo
from opendiloco_stream.transport.local import LinkModel, LocalSwarm, LocalTransport

WIDTH, BLOCKS, P, H = 96, 12, 2, 4
TRANSPORT_SCOPE = "test-transport"

RULES = {
    "blocking": dict(mode="blocking"),
    "overlap": dict(mode="overlap", overlap_steps=1),
    "eager-merge": dict(mode="eager"),
    "eager-overlap": dict(mode="eager", eager_rule="overlap"),
    "eager-corrected": dict(mode="eager", eager_rule="corrected"),
    "eager-corrected-mixed": dict(mode="eager", eager_rule="corrected", eager_estimate="mixed"),
    "eager-corrected-on-arrival": dict(mode="eager", eager_rule="corrected", eager_correction="on-arrival"),
    "eager-paper": dict(mode="eager", eager_rule="paper"),
    "naive-delayed": dict(mode="naive-delayed"),
}


class _ScopedTransport(LocalTransport):
    """A LocalSwarm worker whose reduction runs in a profiler scope (its memory is the transport's)."""

    def all_reduce(self, key, tensor, weight=1.0):
        with record_function(TRANSPORT_SCOPE):
            return super().all_reduce(key, tensor, weight)


def peak_allocated(prof: profile) -> int:
    """The peak of the running sum of the bytes allocated and freed during ``prof`` (CPU), the
    transport scope's allocations and their frees left out."""
    events: list[tuple[int, int]] = []
    transport_ptrs: set[int] = set()

    def walk(node: Any, in_transport: bool) -> None:
        in_transport = in_transport or node.name == TRANSPORT_SCOPE
        fields = node.extra_fields
        if node.name == "[memory]":
            size, ptr = fields.alloc_size, fields.ptr
            if in_transport:
                if size > 0:
                    transport_ptrs.add(ptr)
            elif not (size < 0 and ptr in transport_ptrs):
                events.append((node.start_time_ns, size))
        for child in node.children:
            walk(child, in_transport)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    running = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        running += size
        peak = max(peak, running)
    return peak


def landing_peaks(extra: dict, codec: str = "fp32", steps: int = 5 * H) -> tuple[dict[str, int], int, int]:
    """Train one worker of a 12-block MLP (P = 2, H = 4, rounds landing 2 steps after launch) and
    profile each fragment's sync and each landing on arrival after the first outer round. Returns
    the peak bytes per kind of call, one fragment's fp32 bytes and its largest tensor's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    swarm = LocalSwarm(1, codec=codec, link=LinkModel(delay_steps=2))
    config = DiLoCoConfig(inner_steps=H, num_fragments=P, codec=codec, **extra)
    diloco = StreamingDiLoCo(model, opt, _ScopedTransport(swarm, 0), config, blocks=list(model))
    peaks: dict[str, int] = {}
    measuring = [False]

    def profiled(kind: str, call: Callable, lands: Callable[[], bool]) -> Callable:
        def run(*args):
            if not measuring[0] or not lands():
                return call(*args)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = call(*args)
            peaks[kind] = max(peaks.get(kind, 0), peak_allocated(prof))
            return out
        return run

    for s in diloco.syncs:
        s.sync = profiled("sync", s.sync, lambda: True)
        s.on_step = profiled("on_step", s.on_step, lambda s=s: s.pending is not None)
        s.finish = profiled("finish", s.finish, lambda s=s: s.pending is not None)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    for i in range(steps):
        measuring[0] = i >= 2 * H  # every fragment has landed a round: its momentum exists
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=4)
    diloco.finish()
    diloco.close()
    fragment = max(4 * f.numel for f in diloco.fragments)
    largest = max(4 * p.numel() for p in model.parameters())
    return peaks, fragment, largest


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_sync_and_a_landing_hold_at_most_one_fragment_over_what_was_there(rule):
    peaks, fragment, largest = landing_peaks(RULES[rule])
    assert "sync" in peaks, "no sync was measured"
    bound = fragment + largest + 1024
    for kind, peak in peaks.items():
        assert peak <= bound, f"{rule} {kind}: {peak / fragment:.2f} fragments (bound {bound / fragment:.2f})"


@pytest.mark.parametrize("rule", ["eager-merge", "blocking"])
def test_a_lossy_codec_with_error_feedback_in_the_parameters_stays_within_the_bound(rule):
    peaks, fragment, largest = landing_peaks({**RULES[rule], "error_feedback": True,
                                              "error_feedback_mode": "parameters"}, codec="fp4-e3m0")
    bound = fragment + largest + 1024
    for kind, peak in peaks.items():
        assert peak <= bound, f"{rule} {kind}: {peak / fragment:.2f} fragments (bound {bound / fragment:.2f})"
