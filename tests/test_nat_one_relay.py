"""One relay is enough: a ``--relay`` peer reserves its slot on the relays among its initial peers
at start (static relays, ``net.dht.relayed_peer_kwargs``), not after p2pd's autorelay has found 4
relay candidates or waited 3 minutes.

Two peers, each behind its own symmetric NAT (no punch can work: every exchange crosses the
relay), one ``bootstrap --relay`` in ``boot``. The run is short (24 rounds a peer): with the old
wait every one of them fell in the first 3 minutes, when a relayed peer could not be reached
(failed rounds take 4-8 s each), so no round averaged, or only the last few. Now the peers
average from their first rounds through the one relay, with one digest. Needs root, ``ip netns``
and ``nft``; the test removes its namespaces and processes.
"""

from __future__ import annotations

import pytest

from benchmarks.harness.peers import PeerProcesses
from tests.support.nat import NatTopology, listen_flags, unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.network, pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=f"NAT topology unavailable: {REASON}")]

H, P, STEPS = 5, 2, 60  # 12 rounds of each fragment, 24 a peer
TINY = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--no-progress",
        "--mode", "blocking", "--codec", "fp32", "--fragments", str(P), "--inner-steps", str(H), "--steps", str(STEPS)]
NODES = ["n0", "n1"]


@pytest.mark.timeout(360)
def test_two_peers_behind_symmetric_nats_average_through_one_relay_from_their_first_rounds(tmp_path):
    with NatTopology(public=0, natted=2, symmetric=True) as topo, PeerProcesses(tmp_path, topology=topo) as run:
        run.bootstrap("onerelay", "--relay", node="boot")
        procs = [run.peer(n, "--run-id", "onerelay", *TINY, *listen_flags(topo, n), "--relay", "--shard", f"{i}/2",
                          node=n, env={"ODS_DILOCO__RECORD_DIGESTS": "true"}) for i, n in enumerate(NODES)]
        run.wait(procs, 300)
        records = {n: run.records(n) for n in NODES}
    by_round = []
    for n, recs in records.items():
        syncs = [r for r in recs if r["event"] == "sync"]
        averaged = [i for i, r in enumerate(syncs) if r["ok"] and r["group_size"] == 2]
        summary = recs[-1]
        assert summary["event"] == "summary", recs[-3:]
        context = (n, summary.get("wall_time_s"), [(r["ok"], r.get("reason"), r["group_size"]) for r in syncs])
        assert len(syncs) == 2 * STEPS // H, context
        # the first averaged round is among the first 3 of 24 (the start-up's matchmaking may miss one)
        assert averaged and averaged[0] <= 2, context
        assert len(averaged) >= len(syncs) - 4, context
        assert all(syncs[i]["exchanges"] == {"relayed": 1} for i in averaged), context  # symmetric: no punch
        by_round.append({(syncs[i]["fragment"], syncs[i]["round"]): syncs[i]["digest"] for i in averaged})
    common = set(by_round[0]) & set(by_round[1])
    assert len(common) >= 2 * STEPS // H - 4 and all(by_round[0][k] == by_round[1][k] for k in common), by_round
