"""What a round reports: its summary, its phases, and where it stood when it timed out.

The runner stamps wall-clock marks (``time.time()``, comparable with the host's on one machine) as
its phases end: ``group`` (the round started), ``contributions`` (every contribution to our part
arrived), ``verdicts``, ``reduced``, ``results`` (every part's average arrived), ``end``. The host
adds its own (before the checks and copy, before ``step``, and after its copy of the result) and
turns them into ``SyncResult.phases`` (:func:`round_phases`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opendiloco_stream.compression import all_finite
from opendiloco_stream.transport.hivemind.protocol import RoundError
from opendiloco_stream.transport.reduce import summarize_verdict

if TYPE_CHECKING:
    from opendiloco_stream.transport.hivemind.runner import HvAllReduceRunner


def round_summary(runner: "HvAllReduceRunner") -> dict:
    """A finished round's metadata for the host; ``RoundError`` if its parts do not agree or the
    average is not finite."""
    verdicts = set(runner.part_status.values())
    if len(verdicts) != 1:
        raise RoundError("partial", f"round {runner.key}: parts were averaged over different groups")
    final, total_weight = verdicts.pop()
    outcome = summarize_verdict(final, runner.weights, runner.me)
    if not all_finite(runner.result):
        raise RoundError("partial", f"round {runner.key}: the average holds non-finite values")
    return dict(
        group_size=outcome.group_size,
        weight_share=runner.weights[runner.me] / total_weight if outcome.included_self else 0.0,
        included_self=outcome.included_self, peers=[str(runner.peer_ids[s]) for s in outcome.accepted],
        rejected=outcome.rejected, missing=outcome.missing,
        bytes_sent=runner.bytes_sent, bytes_received=runner.bytes_received,
        marks=dict(runner.marks, end=time.time()), sent_is_input=runner.sent_is_input,
        links={str(runner.peer_ids[q]): seen for q, seen in runner.links_seen.items()},
    )


def describe_progress(runner: "HvAllReduceRunner") -> str:
    """Where a round stands, for a timeout's message: what we got from whom, and the phases done."""
    start = runner.marks["group"]
    marks = ", ".join(f"{k} at +{v - start:.2f}s" for k, v in runner.marks.items() if k != "group")
    items = []
    for i in range(len(runner.peer_ids)):
        if i == runner.me:
            continue
        got = []
        if i in runner.sender_done:
            got.append("contribution " + ("in" if runner.sender_done[i].is_set() else
                                          "streaming" if i in runner.connected else "not connected"))
        if i in runner.verdicts:
            got.append("verdict " + ("in" if runner.verdicts[i].done() else "awaited"))
        if runner.is_reducer[i]:
            got.append("results " + ("begun" if i in runner.part_status else "awaited"))
        items.append(f"peer {i}: {', '.join(got) or 'nothing expected'}")
    return f"I am {runner.me}; {'; '.join(items)}; {marks or 'no phase done'}"


# runner mark -> the phase it ends
_PHASE_ENDS = {"contributions": "contributions", "verdicts": "verdicts", "reduced": "reduce", "results": "results",
               "end": "drain"}


def round_phases(start: float, step: float, marks: dict, end: float) -> dict[str, float]:
    """Seconds spent in each phase of a round (``SyncResult.phases``), from the host's and the
    runner's wall-clock marks. A phase this peer did not run (no part to reduce) is left out.

    prepare: the finite check (and a copy to the CPU, if needed); matchmaking: until the group started its round;
    contributions: until every contribution to our part arrived; verdicts: until the reducers'
    verdicts did; reduce: our part averaged and encoded; results: until every part's average
    arrived; drain: until groupmates finished reading our part's average; finish: until the host
    holds its copy of the result."""
    phases = {"prepare": step - start}
    if "group" not in marks:
        return phases
    phases["matchmaking"] = marks["group"] - step
    last = marks["group"]
    for mark, phase in _PHASE_ENDS.items():  # in the order they end
        if mark in marks:
            phases[phase] = marks[mark] - last
            last = marks[mark]
    phases["finish"] = end - last
    return {k: max(0.0, v) for k, v in phases.items()}
