"""Repair of a fragment whose theta_bar drifted from its group's (``algorithm/repair.py``): the
winner rule, the adoption in-process, and two real peers whose round a network outage cut off.

In-process, rounds succeed: those tests fake the divergence a failed round leaves (each member's
own local-only outer step, or a peer that missed a round its groupmates averaged) by perturbing
one peer's theta_bar of one fragment directly, between two steps, which is the state such a round
leaves behind (one fragment's theta_bar differs, nothing else); no production code has a hook for
it. The network test needs no fake: the WAN emulator cuts the link between two real peers during
a round (``benchmarks/repair_outage.py``).
"""

from __future__ import annotations

import io
import time

import pytest
import torch

from benchmarks.harness import netns
from benchmarks.harness.repair_outage import run_scenario
from opendiloco_stream import DiLoCoConfig, wrap
from opendiloco_stream.algorithm.repair import adopt, outer_digest, voting_round, winning_digest
from opendiloco_stream.net.prometheus import PeerMetrics, samples
from opendiloco_stream.transport.base import OuterDigest
from opendiloco_stream.transport.local import LinkModel, LocalSwarm, LocalTransport
from tests.support.two_workers import mlp

WIDTH = 8
NETNS_REASON = netns.unavailable_reason()


# ---------------------------------------------------------------------------------------- the winner
def test_the_winner_is_the_digest_most_members_hold_and_a_tie_goes_to_the_most_steps_then_the_smallest_id():
    D = OuterDigest
    assert winning_digest({}) is None
    assert winning_digest({"a": D("x", 1)}) == "x"
    # a majority wins whatever the steps
    assert winning_digest({"a": D("x", 1), "b": D("x", 1), "c": D("y", 99)}) == "x"
    # a tie: the digest of the member with the most inner steps ...
    assert winning_digest({"a": D("x", 5), "b": D("y", 6)}) == "y"
    assert winning_digest({"a": D("x", 7), "b": D("y", 6), "c": D("z", 1)}) == "x"
    # ... then of the smallest peer id; the same for every member, whatever the order it reads them in
    tie = {"b": D("y", 6), "a": D("x", 6)}
    assert winning_digest(tie) == "x" and winning_digest(dict(reversed(list(tie.items())))) == "x"
    assert winning_digest({"b": D("x", 3), "c": D("x", 3), "a": D("y", 3), "d": D("y", 3)}) == "y"


def test_only_digests_after_the_round_most_members_consumed_vote_and_a_tie_goes_to_the_later_round():
    D = OuterDigest
    # two members' digests follow round 4, one's round 5 (a group formed ahead while round 5 was
    # in flight for two of them): only round 4's vote, the odd one out of round 4 loses
    mixed = {"a": D("x", 9, 4), "b": D("y", 9, 4), "c": D("y", 1, 5), "d": D("x", 1, 4)}
    assert voting_round(mixed) == 4 and winning_digest(mixed) == "x"
    # a digest of another round would have tipped a count it may not take part in
    assert winning_digest({"a": D("x", 1, 4), "b": D("y", 1, 5), "c": D("y", 1, 5), "d": D("z", 1, 3)}) == "y"
    # as many after each round: the later round, then the existing rule among its digests
    tie = {"a": D("x", 1, 2), "b": D("y", 7, 3), "c": D("z", 1, 2), "d": D("w", 2, 3)}
    assert voting_round(tie) == 3 and winning_digest(tie) == "y"
    assert voting_round({"a": D("x", 1, -1), "b": D("y", 1, 0)}) == 0  # -1: no round consumed yet
    # an older release's digest (no round) neither votes nor sets the round
    old = {"a": D("x", 1, None), "b": D("x", 1, None), "c": D("y", 1, 2)}
    assert voting_round(old) == 2 and winning_digest(old) == "y"
    assert voting_round({"a": D("x", 1, None)}) is None and winning_digest({"a": D("x", 1, None)}) is None


def test_the_digest_travels_with_its_round_and_an_older_releases_has_none():
    d = OuterDigest("00ff00ff00ff00ff", 12, 3)
    assert OuterDigest.from_wire(d.to_wire()) == d and OuterDigest.from_wire(tuple(d.to_wire())) == d
    assert OuterDigest.from_wire(["00ff00ff00ff00ff", 12]) == OuterDigest("00ff00ff00ff00ff", 12, None)
    assert OuterDigest("a", 1).round == -1  # none consumed yet
    for garbage in (None, "x", ["a"], ["a", 1, "3"], ["a", 1, True], ["a", True], [1, 2], ["a", 1, 2, 3]):
        assert OuterDigest.from_wire(garbage) is None


def test_the_digest_is_of_theta_bars_fp32_bytes():
    a = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4)]
    b = [t.clone() for t in a]
    assert outer_digest(a, 3) == outer_digest(b, 3) and outer_digest(a, 3).steps == 3
    assert outer_digest(a, 3, 7).round == 7 and outer_digest(a, 3, 7).digest == outer_digest(a, 3).digest
    b[1][2] = torch.nextafter(b[1][2], torch.tensor(2.0))  # one ulp
    assert outer_digest(a, 3).digest != outer_digest(b, 3).digest
    assert len(outer_digest(a, 0).digest) == 16  # 8 bytes, hex


@pytest.mark.parametrize("mode,extra,steps", [("blocking", {}, 3), ("eager", {"eager_rule": "corrected"}, 6),
                                              ("eager", {"eager_rule": "merge"}, 6)])
def test_adopting_a_groupmates_theta_bar_keeps_the_local_progress_relative_to_the_rules_reference(mode, extra, steps):
    """After ``adopt``: theta_bar and momentum are the groupmate's, and local - reference (the next
    outer gradient, up to its sign) is what it was; with eager the fragment has a round in flight
    (launched at step 2 or 6, not landed), and 'corrected''s reference is its look-ahead ``start``."""
    model, data = _model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = DiLoCoConfig(mode=mode, inner_steps=4, num_fragments=2, **extra)
    diloco = wrap(model, opt, transport=LocalSwarm(1, link=LinkModel(delay_steps=3)).transport(0), config=config,
                  blocks=list(model))
    for i in range(steps):
        model(data[i % 3]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=5)
    s = diloco.syncs[0]
    assert s.in_flight == (mode == "eager")
    progress = [q - r for q, r in zip(s.f.local_copy(), s.reference)]
    theirs = [t + 0.25 * torch.randn_like(t) for t in s.f.outer]
    their_opt = torch.load(io.BytesIO(_saved(s.f.opt.state_dict())))  # a copy, as a download delivers it
    for st in their_opt["state"].values():
        st["momentum_buffer"] += 1.0
    other = [t.clone() for t in diloco.syncs[1].f.outer]
    adopt(s, theirs, their_opt)
    assert all(torch.equal(o, t) for o, t in zip(s.f.outer, theirs))
    mine = s.f.opt.state_dict()["state"]
    assert mine and all(torch.equal(mine[i]["momentum_buffer"], st["momentum_buffer"])
                        for i, st in their_opt["state"].items())
    assert all(torch.allclose(q - r, p, atol=1e-6) for q, r, p in zip(s.f.local_copy(), s.reference, progress))
    assert all(torch.equal(a, b) for a, b in zip(other, diloco.syncs[1].f.outer))
    diloco.close()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Recording(LocalTransport):
    """A one-worker LocalSwarm's transport that records the digest of every group formed ahead
    (``prematch``, which LocalSwarm ignores) and of every launch."""

    def __init__(self, swarm: LocalSwarm):
        super().__init__(swarm, 0)
        self.early, self.launched = {}, {}

    def prematch(self, key, weight=1.0, lead_s=0.0, digest=None):
        self.early[tuple(key)] = digest

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        self.launched[tuple(key)] = digest
        return super().all_reduce(key, tensor, weight, digest)


@pytest.mark.parametrize("mode,extra", [("blocking", {}), ("eager", {"eager_rule": "merge"})])
def test_a_group_formed_ahead_carries_the_latest_digest_with_the_round_it_follows(mode, extra):
    """prematch_steps = 1, H = 4, P = 2: blocking has no round in flight a step before the sync, so
    the group formed ahead of round k carries the digest the launch sends (after round k - 1);
    eager with rounds landing 4 steps late (at the next sync) still has round k - 1 in flight then:
    the digest after round k - 2, the one round k - 1's launch sent."""
    model, data = _model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    transport = _Recording(LocalSwarm(1, link=LinkModel(delay_steps=4)))
    config = DiLoCoConfig(mode=mode, inner_steps=4, num_fragments=2, prematch_steps=1, **extra)
    diloco = wrap(model, opt, transport=transport, config=config, blocks=list(model))
    for i in range(12):
        model(data[i % 3]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=5)
    diloco.close()
    later = [k for k in transport.early if k[1] >= 1]  # a fragment's first round has nothing in flight
    assert later
    for key in later:
        early, launched = transport.early[key], transport.launched[key]
        previous = transport.launched[key[0], key[1] - 1]
        assert launched.round == key[1] - 1
        if mode == "blocking":
            assert (early.digest, early.round) == (launched.digest, launched.round)
        else:
            assert (early.digest, early.round) == (previous.digest, previous.round) == (previous.digest, key[1] - 2)


def test_repair_records_count_in_prometheus_by_fragment_and_outcome():
    metrics = PeerMetrics({"run": "demo", "peer": "p"})
    for outcome in ("repaired", "repaired", "stale"):
        metrics.observe({"event": "repair", "fragment": 1, "round": 3, "step": 9, "from": "q", "bytes": 10,
                         "seconds": 0.1, "outcome": outcome})
    got = samples(metrics.exposition())
    lab = (("fragment", "1"), ("peer", "p"), ("run", "demo"))
    assert got[("ods_repairs_total", tuple(sorted(lab + (("outcome", "repaired"),))))] == 2
    assert got[("ods_repairs_total", tuple(sorted(lab + (("outcome", "stale"),))))] == 1


# ---------------------------------------------------------------------------------------- in-process
def _model_and_data() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The seeded MLP and batches (built before the workers' threads: torch's seed is global)."""
    torch.manual_seed(3)
    data = [torch.randn(5, WIDTH) for _ in range(3)]
    return mlp(WIDTH), data


def _train(rank: int, transport, config: DiLoCoConfig, steps: int, perturb_at: int, step_s: float = 0.0,
           model_and_data=None):
    """Train one worker of the small MLP ``steps`` steps; after step ``perturb_at`` worker 1 moves
    its theta_bar of fragment 0 (the fake of a failed round's divergence, module docstring). Returns
    the wrapper and, per repair record, whether fragment 1's theta_bar changed in that step."""
    model, data = model_and_data or _model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = wrap(model, opt, transport=transport, config=config, blocks=list(model))
    other_touched = []
    adopt_arrived = diloco.repairs.poll

    def poll(syncs):  # watches fragment 1 across the adoption of a repair (no change to what it does)
        before, repairs = [t.clone() for t in diloco.frags[1].outer], diloco.stats.repairs
        adopt_arrived(syncs)
        if diloco.stats.repairs != repairs:
            other_touched.append(any(not torch.equal(a, b) for a, b in zip(before, diloco.frags[1].outer)))

    diloco.repairs.poll = poll
    for i in range(steps):
        model(data[(i + rank) % 3]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=5)
        if rank == 1 and diloco.step_count == perturb_at:
            with torch.no_grad():
                diloco.frags[0].outer[0].add_(0.01)
        time.sleep(step_s)
    diloco.finish()
    diloco.close()
    return diloco, other_touched


def _digests(diloco, fragment: int) -> dict[int, str]:
    return {e["round"]: e["digest"] for e in diloco.events
            if e["event"] == "outer_digest" and e["fragment"] == fragment}


def _one_repair_of_worker_1(out: list, round_: int) -> tuple[dict[int, str], dict[int, str]]:
    """Worker 0 repaired nothing; worker 1 repaired fragment 0 once, from ``local-0`` after round
    ``round_``, and never touched fragment 1 (whose digests are the same on both throughout).
    Returns both workers' fragment-0 digests by round."""
    (d0, _), (d1, touched1) = out
    assert [e for e in d0.events if e["event"] == "repair"] == [] and d0.stats.repairs == 0
    repairs = [e for e in d1.events if e["event"] == "repair"]
    assert [(e["fragment"], e["round"], e["from"], e["outcome"]) for e in repairs] == \
        [(0, round_, "local-0", "repaired")]
    assert d1.stats.repairs == 1 and d1.stats.failed_repairs == 0 and touched1 == [False]
    assert _digests(d0, 1) == _digests(d1, 1)  # the other fragment: always the same
    return _digests(d0, 0), _digests(d1, 0)


@pytest.mark.parametrize("mode,extra", [("blocking", {}), ("overlap", {"overlap_steps": 1}),
                                        ("eager", {"eager_rule": "merge"}), ("eager", {"eager_rule": "corrected"})])
def test_a_drifted_fragment_is_repaired_from_the_group_and_training_goes_on_from_it_in_process(mode, extra):
    """H = 4, P = 2 (fragment 0 syncs at steps 2, 6, 10...). Worker 1's theta_bar of fragment 0 is
    moved after step 1, before round 0 (a round hashes theta_bar when it changes it: a fake that
    wrote theta_bar after a round would not be seen until the next one); round 0 shows two digests,
    the tie goes to the smaller peer id (``local-0``): worker 1 fetches worker 0's state and from
    round 1 on both hold the same theta_bar of fragment 0 again. Fragment 1 is never touched."""
    config = DiLoCoConfig(mode=mode, inner_steps=4, num_fragments=2, record_digests=True, **extra)
    swarm, made = LocalSwarm(2), [_model_and_data() for _ in range(2)]
    out = swarm.run(lambda rank: _train(rank, swarm.transport(rank), config, steps=16, perturb_at=1, step_s=0.02,
                                        model_and_data=made[rank]))
    f0 = _one_repair_of_worker_1(out, 0)
    assert f0[0][0] != f0[1][0]  # round 0 was averaged onto two different theta_bars
    assert all(f0[0][k] == f0[1][k] for k in range(1, 4))  # repaired: the same from the next round on


class _FormedAhead(LocalTransport):
    """A LocalSwarm transport whose round tells the group the digest given at ``prematch`` when
    the round was announced ahead, as the hivemind transport does for a group formed ahead (its
    member metadata is sent when the group forms; LocalSwarm forms no group ahead): the fake of
    that one behaviour, everything else is LocalSwarm's."""

    def __init__(self, swarm: LocalSwarm, rank: int):
        super().__init__(swarm, rank)
        self.early: dict = {}

    def prematch(self, key, weight=1.0, lead_s=0.0, digest=None):
        self.early[tuple(key)] = digest

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        key = tuple(key)
        return super().all_reduce(key, tensor, weight, self.early.pop(key) if key in self.early else digest)


def test_eager_with_groups_formed_ahead_repairs_a_drifted_fragment_a_round_later_in_process():
    """Eager 'merge', rounds landing at the next sync (4 steps late), groups formed a step ahead:
    each group is told the digest after the round before the one in flight. H = 4, P = 2 (fragment
    0 syncs at steps 2, 6, 10, 14, 18); worker 1's theta_bar of fragment 0 is moved after step 1,
    after round 0's group was formed (round 0 and round 1 carry the digest from before: equal).
    Round 0 lands on two theta_bars (at step 6); round 2 (formed ahead at step 9) carries both
    digests after round 0; the tie goes to ``local-0``, and worker 1 fetches its state after round
    2, the round it just consumed. Round 3, in flight then, was told of worker 1's theta_bar from
    before the repair: not judged again. From round 3 on both hold the same theta_bar."""
    config = DiLoCoConfig(mode="eager", eager_rule="merge", inner_steps=4, num_fragments=2, prematch_steps=1,
                          record_digests=True)
    swarm, made = LocalSwarm(2, link=LinkModel(delay_steps=4)), [_model_and_data() for _ in range(2)]
    out = swarm.run(lambda rank: _train(rank, _FormedAhead(swarm, rank), config, steps=24, perturb_at=1, step_s=0.02,
                                        model_and_data=made[rank]))
    f0 = _one_repair_of_worker_1(out, 2)
    assert all(f0[0][k] != f0[1][k] for k in range(3))  # rounds 0-2 were averaged onto two theta_bars
    assert all(f0[0][k] == f0[1][k] for k in range(3, 5))  # repaired: the same from round 3 on


def test_repair_off_or_a_rule_whose_theta_bar_is_its_own_sends_no_digest_and_repairs_nothing():
    """``diloco.repair = false``, and eager 'paper' (theta_bar steps with each peer's own estimate):
    the drift stays."""
    for config in (DiLoCoConfig(mode="blocking", inner_steps=4, num_fragments=2, record_digests=True, repair=False),
                   DiLoCoConfig(mode="eager", eager_rule="paper", inner_steps=4, num_fragments=2, record_digests=True)):
        swarm, made = LocalSwarm(2), [_model_and_data() for _ in range(2)]
        (d0, _), (d1, _) = swarm.run(lambda rank: _train(rank, swarm.transport(rank), config, steps=12, perturb_at=1,
                                                         model_and_data=made[rank]))
        assert d0.stats.repairs == d1.stats.repairs == 0
        assert not any(e["event"] == "repair" for e in d0.events + d1.events)
        assert _digests(d0, 0)[2] != _digests(d1, 0)[2]


# ---------------------------------------------------------------------------------------- real peers
@pytest.mark.network
@pytest.mark.timeout(150)
@pytest.mark.skipif(NETNS_REASON is not None, reason=f"WAN emulation unavailable: {NETNS_REASON}")
def test_a_round_cut_off_by_an_outage_fails_for_both_peers_and_repair_brings_them_back():
    """Two hivemind peers 100 ms apart in the WAN emulator, blocking, H = 4, P = 2 (fragment 0
    syncs at steps 2, 6, 10 ...), no fake: the link goes down for 4 s after peer 0's step 5, so
    fragment 0's round 1 fails for both (each takes its own local-only outer step) and their
    theta_bar of fragment 0 differ. A later round carries both digests; one peer repairs from the
    other (``benchmarks/harness/repair_outage.py``), and the last rounds' digests of both fragments agree.
    Both peers also knew their swarm was far before their first round (DHT pings at start:
    ``prematch_steps = "auto"`` formed that round's group ahead)."""
    res = run_scenario(100.0, "blocking", steps=18, cut_after=5, outage_s=4.0, timeout=90.0)
    (a, b), c = res["peers"], res["checks"]
    assert res["emulator"]["outage_drops"] > 0, res["emulator"]
    assert [0, 1] in c["failed_on_both"], c
    assert "0/1" in c["digests_differed_after"], c
    repairs = a["repairs"] + b["repairs"]
    assert repairs and all(r["outcome"] == "repaired" and r["bytes"] > 0 for r in repairs), repairs
    fixed = {r["fragment"] for r in repairs}
    assert 0 in fixed and fixed <= {f for f, _ in c["failed_on_both"]}, (repairs, c)
    for peer, other in ((a, b), (b, a)):  # from the other peer, which repaired nothing of that fragment
        for repair in peer["repairs"]:
            assert repair["from"] == other["peer_id"], repair
            assert not any(r["fragment"] == repair["fragment"] for r in other["repairs"]), (a, b)
    assert c["equal_at_the_end"], c
    assert int(c["last_averaged_by_both"][0].split("/")[1]) >= 3, c  # compared after the repair's round
    assert c["averaged_by_both_after_repair"] >= 2 and c["equal_after_repair"], c
    for peer in (a, b):
        first = peer["prematch_before_first_round"]
        assert first is not None and first["steps"] >= 1 and first["rtt_ms"] >= 20, peer
