"""Group size from the live peers: round times through deaths and a join (loopback, real peers).

    .venv/bin/python -m benchmarks.live_group --out benchmarks/results/live-group.json

Six ``HivemindTransport`` peers (``benchmarks/harness/loopback.py``: one process each, own DHT
and p2p daemon), no ``target_group_size``, default timeouts (matchmaking 5 s, request 3 s,
presence ttl 10 s), one fragment of 1000 fp32 elements, rounds driven by this script:

1. rounds 0-2 with the 6 peers (round 0 is a cold start: no target yet);
2. two peers SIGKILLed (whole sessions: LoopbackPeer.kill) right after round 2; rounds 3 and 4 launched at once
   by the 4 survivors: the dead announced round 3 (when they launched round 2), not round 4;
3. one more peer SIGKILLed right after round 4; the time until its announcement of round 5
   expires (the survivors' count drops to 3), then round 5;
4. a joiner (as after a state download: it announces the round it expects, ``expect_rounds``) is
   in round 6 at once; a fresh peer that did not (a restart without state) sits round 7 out and
   is in round 8.

Per round: each peer's time from ``all_reduce`` to its result (max over peers), group size,
expected size. Loopback: these are matchmaking and CPU times, not link times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.harness.results import markdown_table, write_result
from benchmarks.harness.loopback import LoopbackSwarm

NUMEL = 1000


def run_round(swarm: LoopbackSwarm, peers: list, rnd: int, note: str) -> dict:
    args = [dict(seed=10 * rnd + p.index, numel=NUMEL, return_tensors=False) for p in peers]
    results = swarm.call_all("all_reduce", (0, rnd), per_peer=args, peers=peers, timeout=120)
    ok = [r for r in results if r["ok"]]
    row = dict(round=rnd, note=note, peers=len(peers), ok=len(ok),
               failed=[r["reason"] for r in results if not r["ok"]],
               group_size=sorted({r["group_size"] for r in ok}), expected_size=sorted({str(r["expected_size"]) for r in ok}),
               round_s=max(r["elapsed_s"] for r in ok) if ok else None)
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    swarm = LoopbackSwarm(6, run_id=f"livegroup{os.getpid()}", transport_kwargs=dict(codec="fp32"))
    rows, events = [], {}
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        for rnd in (0, 1, 2):
            rows.append(run_round(swarm, swarm.peers, rnd, "6 peers" + (" (cold start)" if rnd == 0 else "")))
        killed_at = time.monotonic()
        for victim in swarm.peers[4:]:  # their sessions: DHT and p2p daemon die too
            victim.kill()
        survivors = swarm.peers[:4]
        rows.append(run_round(swarm, survivors, 3, "2 peers killed just before (they announced it)"))
        rows.append(run_round(swarm, survivors, 4, "the round after (not announced by the dead)"))
        killed_at = time.monotonic()
        survivors[3].kill()
        survivors = survivors[:3]
        while swarm.peers[0].call("call", "benchmarks.harness.loopback:live_ahead", fragment=0, round_index=5) != 3:
            time.sleep(0.2)
        events["announcement_expired_after_s"] = time.monotonic() - killed_at
        print(events, flush=True)
        rows.append(run_round(swarm, survivors, 5, "1 more killed, its announcement expired"))
        joiner = swarm.add_peer()
        joiner.call("prepare", {0: NUMEL}, timeout=120)
        joiner.call("call", "benchmarks.harness.loopback:expect", fragment=0, round_index=6)
        survivors.append(joiner)
        rows.append(run_round(swarm, survivors, 6, "a joiner that announced it"))
        fresh = swarm.add_peer()
        fresh.call("prepare", {0: NUMEL}, timeout=120)
        rows.append(run_round(swarm, survivors + [fresh], 7, "a fresh peer's first round"))
        rows.append(run_round(swarm, survivors + [fresh], 8, "its second round"))
    finally:
        swarm.close()
    table = markdown_table(["round", "what", "ok", "group size", "expected", "round s (max)"],
                           [[r["round"], r["note"], f"{r['ok']}/{r['peers']}", ",".join(map(str, r["group_size"])),
                             ",".join(r["expected_size"]), f"{r['round_s']:.2f}" if r["round_s"] else "—"]
                            for r in rows])
    print(table)
    if args.out:
        write_result(args.out, settings=vars(args), rows=rows, argv=argv, benchmark="live_group", events=events,
                     table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
