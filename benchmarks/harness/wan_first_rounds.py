"""The first round of each fragment, per peer, from ``benchmarks.wan --workdir`` records.

    python -m benchmarks.harness.wan_first_rounds benchmarks/results/wan-300-first-round/*/

A peer forms a round's group ahead (``prematch_steps = "auto"``) only once it knows an RTT; this
shows what each fragment's first round paid for matchmaking, and whether the peer's first
``prematch`` record (the RTT it sized the lead from) came before its first round. Each argument is
a folder holding ``peer-<i>.jsonl`` (the run's folder of the workdir, or a copy of those files).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def first_rounds(path: Path) -> dict:
    """One peer's records -> its first round of each fragment and its first ``prematch`` record."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    syncs = [(i, r) for i, r in enumerate(recs) if r.get("event") == "sync"]
    prematch = next(((i, r) for i, r in enumerate(recs) if r.get("event") == "prematch"), None)
    first: dict[int, dict] = {}
    for _, r in syncs:
        first.setdefault(r["fragment"], r)
    later = [r["phases"].get("matchmaking", 0.0) for _, r in syncs if r["round"] > 0 and r.get("ok")]
    return {"first": first, "later_median": statistics.median(later) if later else None,
            "prematch_first": prematch is not None and bool(syncs) and prematch[0] < syncs[0][0],
            "prematch_rtt_ms": None if prematch is None else prematch[1].get("rtt_ms")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+")
    args = p.parse_args(argv)
    head = ["run", "peer", "fragment 0: step, matchmaking (s), round (s)", "fragment 1: same",
            "prematch record before the first round (RTT)", "later rounds' matchmaking, median (s)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for folder in args.folders:
        for path in sorted(Path(folder).glob("peer-*.jsonl")):
            fr = first_rounds(path)
            cells = [f"{r['step']}, {r['phases'].get('matchmaking', 0.0):.2f}, {r['wait_s']:.2f}"
                     for _, r in sorted(fr["first"].items())]
            rtt = f"yes ({fr['prematch_rtt_ms']:g} ms)" if fr["prematch_first"] else \
                f"no (first at {fr['prematch_rtt_ms']} ms after it)" if fr["prematch_rtt_ms"] else "none"
            later = "-" if fr["later_median"] is None else f"{fr['later_median']:.2f}"
            print("| " + " | ".join([Path(folder).name, path.stem, *cells, rtt, later]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
