"""The memory a landing takes, per rule, on the CPU: what applying a landed round (and taking the
next outer gradient, at a sync) adds over what the wrapper held when it began, in fragments.

    python -m benchmarks.landing_memory            # every rule, a 12-block MLP (P = 2, H = 4): seconds

Issue 41 ("Memory") bounds the wrapper's memory over the plain loop by the outer state plus one
fragment in flight. Measured with torch's profiler (CPU, ``profile_memory=True``): every
allocation and free made during one fragment's sync, or its landing on arrival, in the order
they happened; the peak of their running sum is what that call held at most above what existed
when it began. The transport's own allocations (its reduction, its result buffers: host memory
on a GPU peer, the averaging service's) are kept out: the transport here writes each round's
result into buffers made at the start, so it allocates nothing during a sync. (Leaving a
LocalSwarm's allocations out of the sum by their Python frame, or by the time its reduction ran,
was not reliable: from one run to the next some of them fell outside.) Each fragment's first
landing is left out: the outer optimizer creates its momentum there (outer state, made once).

Reported per rule: the peak of a sync (a landing at the sync, the new round's outer gradient and
the estimate step), of a landing on arrival, and of the landings at the end of training, in
units of one fragment's fp32 bytes, next to one of its largest tensors. ``tests/test_landing_memory.py``
asserts the bound. Prints a markdown table and writes JSON (``--out``, default
``benchmarks/results/landing-memory.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.results import RESULTS_DIR, markdown_table, write_result
from opendiloco_stream import DiLoCoConfig
from opendiloco_stream.algorithm.diloco import StreamingDiLoCo
from opendiloco_stream.algorithm.fragments import partition
from opendiloco_stream.transport.base import SyncHandle, SyncResult
from opendiloco_stream.transport.local import LocalSwarm, LocalTransport

WIDTH, BLOCKS, P, H = 96, 12, 2, 4

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


class EchoHandle(SyncHandle):
    def __init__(self, result: SyncResult, delay: int):
        self.result, self.looks, self.delay = result, 0, delay

    def done(self) -> bool:
        self.looks += 1
        return self.looks >= self.delay

    def wait(self, timeout=None) -> SyncResult:
        return self.result


class EchoTransport(LocalTransport):
    """One peer alone (what a LocalSwarm of one gives with fp32: the average is the outer gradient
    sent), writing each round's result into buffers it made at the start, three per fragment in
    turn (a rule may keep the last round's): its reductions allocate nothing, so every byte the
    profiler sees during a sync is the wrapper's. Rounds land ``delay`` looks after their launch."""

    def __init__(self, swarm: LocalSwarm, numels: dict[int, int], delay: int = 2):
        super().__init__(swarm, 0)
        self.buffers = {p: [(torch.empty(n), torch.empty(n)) for _ in range(3)] for p, n in numels.items()}
        self.delay = delay

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        fragment, k = key
        average, sent = self.buffers[fragment][k % 3]
        average.copy_(tensor.reshape(-1))
        sent.copy_(tensor.reshape(-1))
        return EchoHandle(SyncResult(average=average, group_size=1, weight_share=1.0, sent=sent), self.delay)


def peak_allocated(prof: profile) -> int:
    """The peak of the running sum of the bytes allocated (+) and freed (-) during ``prof`` (CPU),
    in the order they happened."""
    events = []

    def walk(node: Any) -> None:
        if node.name == "[memory]":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        running += size
        peak = max(peak, running)
    return peak


def landing_peaks(extra: dict, steps: int = 5 * H) -> tuple[dict[str, int], int, int]:
    """Train one worker of a 12-block MLP (P = 2, H = 4, rounds landing 2 steps after launch) and
    profile each fragment's sync and each landing on arrival after the first outer round. Returns
    the peak bytes per kind of call, one fragment's fp32 bytes and its largest tensor's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = DiLoCoConfig(inner_steps=H, num_fragments=P, codec="fp32", **extra)
    numels = {f.index: f.numel for f in partition(model, list(model), P, config.fragment_pattern)}
    transport = EchoTransport(LocalSwarm(1), numels)
    diloco = StreamingDiLoCo(model, opt, transport, config, blocks=list(model))
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



def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "landing-memory.json")
    args = p.parse_args(argv)
    rows = []
    for name, extra in RULES.items():
        for ef in (False, True):
            if ef and name not in ("blocking", "eager-merge"):
                continue
            config = {**extra, "error_feedback": True, "error_feedback_mode": "parameters"} if ef else extra
            peaks, fragment, largest = landing_peaks(config)
            rows.append({"rule": name + (" + error feedback (parameters)" if ef else ""), "fragment_bytes": fragment,
                         "largest_tensor_bytes": largest, **{f"{k}_bytes": v for k, v in peaks.items()}})
    headers = ["rule", "sync", "landing on arrival", "end of training", "largest tensor"]

    def unit(r: dict, key: str) -> Any:
        return None if f"{key}_bytes" not in r else round(r[f"{key}_bytes"] / r["fragment_bytes"], 2)

    table = markdown_table(headers, [[r["rule"], unit(r, "sync"), unit(r, "on_step"), unit(r, "finish"),
                                      round(r["largest_tensor_bytes"] / r["fragment_bytes"], 2)] for r in rows])
    print(table)
    write_result(args.out, settings={"width": WIDTH, "blocks": BLOCKS, "fragments": P, "inner_steps": H,
                                     "link_delay_steps": 2, "unit": "fragments (fp32 bytes)"},
                 rows=rows, argv=argv, benchmark="landing_memory", table=table)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
