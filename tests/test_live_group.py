"""Group size from the live peers of a run (transport/hivemind/presence.py), no --target-group-size.

Real peers on 127.0.0.1 (``LoopbackSwarm``: one process per peer, its own DHT, averager and p2p
daemon), tiny tensors. The swarm is closed, every peer's process group SIGKILLed, in ``finally``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from benchmarks.harness.loopback import LoopbackSwarm
from opendiloco_stream.transport.hivemind import presence as presence_module
from opendiloco_stream.transport.hivemind.presence import Presence, RoundPlan

NUMEL = 1000
LIVE_AHEAD = "benchmarks.harness.loopback:live_ahead"  # run inside a peer: its count of a round
EXPECT = "benchmarks.harness.loopback:expect"  # inside a peer: what a joiner does after its state download


class FakeDHT:
    """The part of hivemind.DHT presence uses: subkey records, the latest expiration wins, expired ones vanish."""

    def __init__(self):
        self.records: dict = {}

    @staticmethod
    def _done(value):
        future = Future()
        future.set_result(value)
        return future

    def store(self, key, subkey, value, expiration_time, return_future=False):
        old = self.records.setdefault(key, {}).get(subkey)
        if old is None or old.expiration_time < expiration_time:
            self.records[key][subkey] = ValueWithExpiration(value, expiration_time)
        return self._done(True)

    def get(self, key, latest=False, return_future=False):
        live = {k: v for k, v in self.records.get(key, {}).items() if v.expiration_time > get_dht_time()}
        return self._done(ValueWithExpiration(live, max(v.expiration_time for v in live.values())) if live else None)


def test_presence_counts_the_peers_of_the_previous_round_and_tells_newcomers_apart():
    """In-process, a fake DHT, no heartbeat (``beat`` by hand): a cold start has no target; then the
    target is the peers that launched the round before; a fresh peer sits its first round out, a
    joiner that announced its round is counted (and has not missed it), a peer that downloaded after
    the round's launch has; a round the others launched is late for a peer
    behind; a closed peer is no longer counted."""
    dht = FakeDHT()
    peers = {name: Presence(dht, "run", name, ttl=60, late_after=0, poll_s=1000) for name in "abc"}
    peers.update(fresh=Presence(dht, "run", "fresh", ttl=60, poll_s=1000),
                 joiner=Presence(dht, "run", "joiner", ttl=60, poll_s=1000),
                 late=Presence(dht, "run", "late", ttl=60, poll_s=1000))
    try:
        plans = [peers[n].before_round(0, 0) for n in "abc"]
        assert [(p.target, p.skip) for p in plans] == [(None, False)] * 3  # a cold start: no target
        assert not peers["c"].is_late(0, 1)  # asked once: now watched by c's heartbeat
        peers["joiner"].expect(0, 1)  # as after a state download
        peers["c"].beat()
        assert not peers["c"].is_late(0, 1)  # nobody launched round 1 (the joiner's is no launch)
        assert not peers["joiner"].launched_by_others(0, 1)  # the joiner's state is current
        plans = [peers[n].before_round(0, 1) for n in "ab"]
        assert [(p.target, p.skip) for p in plans] == [(4, False)] * 2  # a, b, c and the joiner
        # launched after the joiner's expect: planned with it (a target of 4), so not missed by it ...
        assert not peers["joiner"].launched_by_others(0, 1)
        assert peers["late"].launched_by_others(0, 1)  # ... but by a peer that downloaded only now
        assert not peers["joiner"].launched_by_others(0, 2)
        peers["c"].beat()
        assert peers["c"].is_late(0, 1)  # a and b launched round 1: c, still short of it, is late
        assert peers["fresh"].before_round(0, 1).skip  # the others announced round 1, not this peer
        peers["b"].close()  # b's announcement of round 2 is marked as left
        assert peers["a"].before_round(0, 2).target == 2  # a and the fresh peer launched round 1
        peers["joiner"].expect(0, 2)  # a joiner that downloaded again moves its announcement on
        assert peers["c"].before_round(0, 2).target == 4  # ... and counted there: a, fresh, joiner, c
    finally:
        for p in peers.values():
            p.close()


def test_peers_that_joined_with_the_initial_model_marker_plan_a_cold_starts_first_round_without_a_target():
    """Two peers joined a cold start with the initial-model marker (``expect`` of round 0, as
    ``load_state_dict`` does) beside a fresh peer (announced, not ahead): nobody launched a round
    before, so their plan has no target either, and the group forms at the deadline with everyone
    (and with the joiners announced there: ``awaited``).
    A count of the two marker joiners (what it was) left the fresh peer out: the leader started
    its group of two as soon as one other came, without the second joiner on its way (the eager
    third peer's test, tests/test_meeting_peers.py). The round after counts all three."""
    dht = FakeDHT()
    peers = {name: Presence(dht, "run", name, ttl=60, late_after=0, poll_s=1000) for name in ("fresh", "j1", "j2")}
    try:
        assert peers["fresh"].before_round(0, 0) == RoundPlan(target=None)
        peers["j1"].expect(0, 0)
        peers["j2"].expect(0, 0)
        # no target; each waits for the other joiner, still on its way, past its window
        assert peers["j1"].before_round(0, 0) == RoundPlan(target=None, joiner=True, awaited=frozenset({"j2"}))
        assert peers["j2"].before_round(0, 0) == RoundPlan(target=None, joiner=True, awaited=frozenset({"j1"}))
        assert [peers[n].before_round(0, 1).target for n in ("fresh", "j1", "j2")] == [3, 3, 3]
    finally:
        for p in peers.values():
            p.close()


def test_a_donor_reserves_its_joiner_in_the_next_rounds_which_wait_for_it_and_no_longer(monkeypatch):
    """A donor serving its state stores the joiner's announcement of the rounds after it
    (``reserve``) before launching them: its plan of such a round counts the joiner and says so
    (``joiner``: the lane then waits ``joiner_wait`` for it). The joiner, whose own announcement
    names that reservation's time (``since``), has not missed the round while it still waits
    (and is late for it at once: its first step joins it), and has once the wait is nearly over.
    A controlled clock (presence's ``get_dht_time``) stands for the download's seconds."""
    now = [get_dht_time()]
    monkeypatch.setattr(presence_module, "get_dht_time", lambda: now[0])
    dht = FakeDHT()
    donor = Presence(dht, "run", "donor", ttl=60, late_after=0, poll_s=1000, window=5, joiner_wait=20)
    joiner = Presence(dht, "run", "joiner", ttl=60, late_after=0, poll_s=1000, window=5, joiner_wait=20)
    try:
        donor.before_round(0, 0)  # the run is going: round 1 announced ahead
        reserved = donor.reserve("joiner", [(0, 1)])  # serving the state of a step before round 1
        assert reserved == now[0]
        plan = donor.before_round(0, 1)  # launched after the reservation
        assert (plan.target, plan.joiner) == (2, True)
        now[0] += 2.0  # the joiner's manifest arrived: it announces the round itself
        joiner.expect(0, 1, since=reserved)
        now[0] += 8.0  # its download done, 10 s after the launch: the round still waits for it
        assert not joiner.launched_by_others(0, 1)
        assert joiner.is_late(0, 1)  # without a beat: its first step catches up and joins the round
        now[0] += 8.0  # a download of 18 s: within 20 s of the launch, but too late to get there
        assert joiner.launched_by_others(0, 1)
        plan = donor.before_round(0, 2)  # the joiner launched nothing: the donor is alone in round 2's count
        assert (plan.target, plan.joiner) == (None, False)
    finally:
        donor.close()
        joiner.close()


@pytest.mark.network
@pytest.mark.timeout(180)
def test_a_round_forming_when_its_peer_hands_out_the_initial_model_marker_waits_for_that_joiner_past_its_window():
    """A peer alone in a cold start's first round (no target, a 2 s window) serves a joiner the
    initial-model marker over the real state download, reserving it in that round, and the
    joiner gets there only 3.5 s after the round began (what a joiner across a long link does:
    its step, lookups and join request take round trips). The round waits for it past its window
    (``Matchmaker.await_peers``, up to ``joiner_wait``) and both average it together. Before, the
    round failed alone at its window's end, the joiner's too, and each stepped with its own outer
    gradient: their theta_bar stayed apart for good (docs/benchmarks-wan.md, "The join at distance")."""
    swarm = LoopbackSwarm(2, run_id="marker", transport_kwargs=dict(
        codec="fp32", matchmaking_time=2.0, request_timeout=1.0, presence_ttl=10.0))
    try:
        swarm.start()
        donor, joiner = swarm.peers
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        donor.call("call", "benchmarks.harness.loopback:serve_initial_marker", rounds=[(0, 0)])
        t0 = time.monotonic()
        donor.send("all_reduce", (0, 0), seed=1, numel=NUMEL, return_tensors=False)
        time.sleep(0.5)
        state = joiner.call("load_state", 30.0, timeout=60)["state"]
        assert state["initial"] and state["reserved_at"] is not None, state
        joiner.call("call", "benchmarks.harness.loopback:expect_since", fragment=0, round_index=0,
                    since=state["reserved_at"])
        time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))  # past the donor's window
        joiner.send("all_reduce", (0, 0), seed=2, numel=NUMEL, return_tensors=False)
        results = [donor.recv(60), joiner.recv(60)]
        assert [(r["ok"], r.get("group_size")) for r in results] == [(True, 2)] * 2, results
        assert results[0]["sha256"] == results[1]["sha256"]
    finally:
        swarm.close()


@pytest.mark.network
@pytest.mark.timeout(180)
def test_a_follower_that_did_not_count_the_joiner_waits_for_its_leader_holding_the_round_for_it():
    """Three peers: the leader of a cold start's first round (the smallest peer id) serves the
    third the initial-model marker while the round forms; the other peer planned it before and
    knows nothing of the joiner. The leader holds the round past its 2 s window for the joiner
    (3.5 s in); its follower waits for the leader's group that long too (``hold_s``: up to
    ``joiner_wait``) instead of giving up at its own window, and all three average together."""
    swarm = LoopbackSwarm(3, run_id="hold", transport_kwargs=dict(
        codec="fp32", matchmaking_time=2.0, request_timeout=1.0, presence_ttl=10.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        ids = [p.call("call", "benchmarks.harness.loopback:peer_id") for p in swarm.peers]
        order = sorted(range(3), key=lambda i: PeerID.from_base58(ids[i]).to_bytes())
        leader, follower, joiner = (swarm.peers[i] for i in order)
        leader.call("call", "benchmarks.harness.loopback:serve_initial_marker", rounds=[(0, 0)])
        t0 = time.monotonic()
        for peer, seed in ((leader, 1), (follower, 2)):
            peer.send("all_reduce", (0, 0), seed=seed, numel=NUMEL, return_tensors=False)
        time.sleep(0.5)
        state = joiner.call("load_state", 30.0, timeout=60)["state"]
        assert state["initial"] and state["reserved_at"] is not None, state
        joiner.call("call", "benchmarks.harness.loopback:expect_since", fragment=0, round_index=0,
                    since=state["reserved_at"])
        time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))  # past both windows
        joiner.send("all_reduce", (0, 0), seed=3, numel=NUMEL, return_tensors=False)
        results = [leader.recv(60), follower.recv(60), joiner.recv(60)]
        assert [(r["ok"], r.get("group_size")) for r in results] == [(True, 3)] * 3, [
            {k: r.get(k) for k in ("ok", "group_size", "reason", "message", "elapsed_s")} for r in results]
        assert len({r["sha256"] for r in results}) == 1
    finally:
        swarm.close()


def test_a_fixed_group_size_announces_rounds_without_waiting_for_the_dht_and_plans_nothing():
    """``before_round(plan=False)`` (``--target-group-size`` given): no plan and no DHT lookup in
    the round's path, yet the announcements land, so a peer behind still learns it is late."""
    dht = FakeDHT()
    gets = []
    real_get = dht.get
    dht.get = lambda *a, **k: gets.append(a) or real_get(*a, **k)
    a, b = (Presence(dht, "run", name, ttl=60, late_after=0, poll_s=1000) for name in "ab")
    try:
        assert a.before_round(0, 0, plan=False) is None
        assert a.before_round(0, 1, plan=False) is None
        assert gets == []  # nothing read on the way
        assert not b.is_late(0, 1)  # watched from now on
        b.beat()
        assert b.is_late(0, 1)  # a's announcement of round 1 arrived
    finally:
        a.close()
        b.close()


def test_a_stuck_dht_store_delays_neither_the_heartbeat_nor_its_look_at_late_rounds():
    """A store that never answers (a fake: a DHT stuck on one request cannot be produced on demand):
    the heartbeat does not wait for it, still learns that a round is late, and sends no second
    refresh of the same round while the first is unanswered."""
    dht = FakeDHT()
    stores, stuck, waits = [], [], []
    real_store = dht.store

    class Stuck(Future):
        def result(self, timeout=None):  # a wait on a stuck store: recorded
            waits.append(timeout)
            return super().result(timeout)

    def store(key, subkey, value, expiration_time, return_future=False):
        stores.append((key, subkey))
        if subkey == "b":  # b's stores hang forever; they never reach the records
            stuck.append(Stuck())
            return stuck[-1]
        return real_store(key, subkey, value, expiration_time, return_future)

    dht.store = store
    a, b = (Presence(dht, "run", name, ttl=60, late_after=0, poll_s=1000, dht_timeout=2) for name in "ab")
    try:
        b.before_round(0, 0, plan=False)  # b announces round 1 ahead: one stuck store
        assert not b.is_late(0, 1)  # watched from now on
        a.before_round(0, 0, plan=False)
        a.before_round(0, 1, plan=False)  # a launched round 1: b, still in round 0's window, is late
        for _ in range(3):
            b.beat()
        assert waits == []  # no beat waited for the stuck store
        assert b.is_late(0, 1)
        b_refreshes = [k for k, subkey in stores if subkey == "b" and k.endswith("_r1")]
        assert len(b_refreshes) == 2, stores  # the announcement, then one refresh; then nothing while it hangs
        stuck[-1].set_result(True)  # it answers at last: the next beat refreshes again
        b.beat()
        assert len([k for k, subkey in stores if subkey == "b" and k.endswith("_r1")]) == 3
    finally:
        for f in stuck:
            if not f.done():
                f.set_result(True)
        a.close()
        b.close()


def run_round(swarm, peers, rnd):
    args = [dict(seed=10 * rnd + p.index, numel=NUMEL, return_tensors=False) for p in peers]
    return swarm.call_all("all_reduce", (0, rnd), per_peer=args, peers=peers, timeout=60)


def sizes(results):
    return [(r["ok"], r.get("group_size"), r.get("expected_size")) for r in results]


@pytest.mark.network
@pytest.mark.timeout(240)
def test_one_group_of_every_live_peer_follows_deaths_and_joins():
    """6 peers, no target: round 0 (cold start) forms one group of 6 at the matchmaking deadline,
    later rounds start with the 6 announced peers; two SIGKILLed peers drop out once their
    announcements expire (groups of 4 that expect 4); a joiner that announced its first round (as
    after a state download) is in it (5); a fresh peer that did not sits it out and is in the
    next one (6)."""
    swarm = LoopbackSwarm(6, run_id="live6", transport_kwargs=dict(
        codec="fp32", matchmaking_time=3.0, request_timeout=1.0, presence_ttl=3.0))
    try:
        swarm.start()
        swarm.call_all("prepare", {0: NUMEL}, timeout=120)
        for rnd in (0, 1, 2):
            results = run_round(swarm, swarm.peers, rnd)
            expected = None if rnd == 0 else 6
            assert sizes(results) == [(True, 6, expected)] * 6, (rnd, results)
            assert len({r["sha256"] for r in results}) == 1
        for victim in swarm.peers[4:]:
            victim.kill()
        survivors = swarm.peers[:4]
        deadline = time.monotonic() + 60
        while swarm.peers[0].call("call", LIVE_AHEAD, fragment=0, round_index=3) != 4:
            assert time.monotonic() < deadline, "the killed peers' announcements never expired"
            time.sleep(0.5)
        for rnd in (3, 4):
            assert sizes(run_round(swarm, survivors, rnd)) == [(True, 4, 4)] * 4, rnd
        joiner = swarm.add_peer()
        joiner.call("prepare", {0: NUMEL}, timeout=120)
        joiner.call("call", EXPECT, fragment=0, round_index=5)
        survivors.append(joiner)
        assert sizes(run_round(swarm, survivors, 5)) == [(True, 5, 5)] * 5
        fresh = swarm.add_peer()
        fresh.call("prepare", {0: NUMEL}, timeout=120)
        results = run_round(swarm, survivors + [fresh], 6)
        assert sizes(results[:5]) == [(True, 5, 5)] * 5 and results[5]["reason"] == "joining", results
        assert sizes(run_round(swarm, survivors + [fresh], 7)) == [(True, 6, 6)] * 6
    finally:
        swarm.close()


async def _pending_gets(_dht, node) -> int:
    return len(node.pending_get_requests)


@pytest.mark.network
def test_upkeep_prunes_the_dht_bookkeeping_of_finished_lookups():
    """hivemind keeps an empty entry per key ever looked up (DHTNode.pending_get_requests): every
    round looks up new keys, so a long run's DHT process grew (docs/benchmarks.md, soak). A real
    DHT: 50 lookups of new keys leave 50 entries; upkeep removes them and a later lookup works."""
    from hivemind import DHT

    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    presence = Presence(dht, "run", "me", ttl=60, poll_s=1000)
    try:
        before = dht.run_coroutine(_pending_gets)
        for r in range(50):
            assert dht.get(f"run_live_f0_r{r}", latest=True) is None
        assert dht.run_coroutine(_pending_gets) >= before + 50
        assert presence.upkeep() >= 50
        assert dht.run_coroutine(_pending_gets) == 0
        presence.expect(0, 3)
        assert presence.launched_by_others(0, 2) is False  # lookups still work after the prune
        assert set(presence._entries(0, 3)) == {"me"}
    finally:
        presence.close()
        dht.shutdown()
