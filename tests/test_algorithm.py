"""The algorithm core: schedule, partition, update rules (golden values), equivalences."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Optional

import pytest

import torch
from torch import nn

from opendiloco_stream import DiLoCoConfig, StreamingDiLoCo, wrap
from opendiloco_stream.algorithm import fragments as fr
from opendiloco_stream.algorithm import rules
from opendiloco_stream.algorithm.rules import Landing, SyncRule
from opendiloco_stream.algorithm.outer import (
    OuterOptimizer, eager_estimate, eager_estimate_each, joiner_estimate, joiner_estimate_each, overlap_merge,
)
from opendiloco_stream.transport.base import SyncHandle, SyncResult, Transport
from opendiloco_stream.transport.local import INSTANT_LINK, LinkModel, LocalSwarm


# ---------------------------------------------------------------------------- schedule
def test_offsets_match_design_formula():
    assert fr.fragment_offsets(100, 4) == [25, 50, 75, 0]
    assert fr.fragment_offsets(100, 1) == [0]
    assert fr.fragment_offsets(10, 3) == [3, 6, 0]


def test_each_fragment_syncs_once_per_outer_round_at_its_offset():
    H, P = 100, 4
    offsets = fr.fragment_offsets(H, P)
    steps = {p: [t for t in range(1, 301) if fr.syncs_at(t, offsets[p], H)] for p in range(P)}
    assert steps == {0: [25, 125, 225], 1: [50, 150, 250], 2: [75, 175, 275], 3: [100, 200, 300]}
    assert [fr.round_index(t, offsets[0], H) for t in steps[0]] == [0, 1, 2]
    assert [fr.round_index(t, offsets[3], H) for t in steps[3]] == [0, 1, 2]
    assert not fr.syncs_at(0, 0, H)  # t starts at 1


# ---------------------------------------------------------------------------- partition
class TiedLM(nn.Module):
    def __init__(self, n_blocks=6, d=4, vocab=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n_blocks)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("P", [1, 2, 3, 6])
def test_every_parameter_in_exactly_one_fragment(pattern, P):
    model = TiedLM()
    frags = fr.partition(model, fr.find_blocks(model), P, pattern)
    ids = [id(p) for f in frags for p in f.params]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert sum(f.numel for f in frags) == sum(p.numel() for p in model.parameters())


def test_strided_and_sequential_block_assignment():
    model = TiedLM(n_blocks=6)
    blocks = list(model.layers)

    def owner(frags, module):
        return [f.index for f in frags for p in f.params if p is module.weight][0]

    strided = fr.partition(model, blocks, 3, "strided")
    assert [owner(strided, b) for b in blocks] == [0, 1, 2, 0, 1, 2]
    sequential = fr.partition(model, blocks, 3, "sequential")
    assert [owner(sequential, b) for b in blocks] == [0, 0, 1, 1, 2, 2]


def test_find_blocks_picks_the_block_list_and_partition_rejects_too_many_fragments():
    model = TiedLM(n_blocks=2)
    assert fr.find_blocks(model) == list(model.layers)
    with pytest.raises(ValueError, match="exceeds the number of transformer blocks"):
        fr.partition(model, list(model.layers), 3)
    with pytest.raises(ValueError, match="pass blocks"):
        fr.find_blocks(nn.Linear(2, 2))


def test_config_validation_says_what_to_change():
    with pytest.raises(ValueError, match="overlap_steps >= 1"):
        DiLoCoConfig(mode="overlap", overlap_steps=0)
    with pytest.raises(ValueError, match="must be < inner_steps / num_fragments"):
        DiLoCoConfig(mode="overlap", overlap_steps=25, inner_steps=100, num_fragments=4)
    with pytest.raises(ValueError, match="must be <= inner_steps"):
        DiLoCoConfig(inner_steps=2, num_fragments=3)
    with pytest.raises(ValueError):
        DiLoCoConfig(unknown_knob=1)


# ---------------------------------------------------------------------------- rules
def test_rule_functions_against_hand_values():
    d, avg, sent = torch.tensor([4.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 0.0])
    assert torch.equal(eager_estimate(d, avg, sent, 0.5), torch.tensor([2.0, 2.0]))
    assert torch.equal(joiner_estimate(torch.tensor([4.0]), torch.tensor([1.0]), 2), torch.tensor([2.0]))
    assert torch.equal(overlap_merge(torch.tensor([-6.0]), torch.tensor([-0.5]), 0.5), torch.tensor([-3.25]))


class Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


class ScalarModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scalar()])


def run_scripted(mode: str, displacement: list[list[float]], steps: int, **cfg) -> list[torch.Tensor]:
    """Two workers, one scalar parameter each; at inner step t worker r moves by -displacement[r][t-1].

    Returns each worker's (outer params, local params) after ``steps`` steps. Outer lr 0.5,
    momentum 0, fp32 codec, equal weights: every number below is exact in binary floating point.
    """
    M = len(displacement)
    swarm = LocalSwarm(num_workers=M, codec="fp32", timeout=10)
    config = DiLoCoConfig(mode=mode, outer_lr=0.5, outer_momentum=0.0, codec="fp32", weighting="equal",
                          num_fragments=1, **cfg)
    out = [None] * M

    def worker(rank):
        model = ScalarModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(rank), config=config)
        for t in range(1, steps + 1):
            with torch.no_grad():
                model.layers[0].w -= displacement[rank][t - 1]
            diloco.step()
        out[rank] = (diloco.outer_params[0][0].item(), model.layers[0].w.item(), diloco)
        diloco.close()

    swarm.run(worker)
    return out


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_the_outer_step_one_parameter_at_a_time_is_torch_sgd_bit_for_bit_and_leaves_its_gradient_alone(
        momentum, nesterov):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4)]
    ours = [torch.randn(s, generator=g) for s in shapes]
    theirs = [t.clone() for t in ours]
    opt = OuterOptimizer(ours, lr=0.7, momentum=momentum, nesterov=nesterov)
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=momentum, nesterov=nesterov)
    for _ in range(3):
        flat = torch.randn(sum(t.numel() for t in ours), generator=g)
        lent = flat.clone()
        ahead = opt.lookahead(flat, scale=0.5, out=[torch.empty_like(t) for t in ours])
        opt.step(flat)
        assert torch.equal(flat, lent)  # a lent gradient is never written into
        # the look-ahead as it was written with whole temporaries: the same bits
        for p, v, a in zip(theirs, opt.split(flat), ahead):
            v = v * 0.5
            if momentum > 0:
                buf = sgd.state.get(p, {}).get("momentum_buffer")
                buf = v.clone() if buf is None else buf * momentum + v
                v = v + buf * momentum if nesterov else buf
            assert torch.equal(a, p - v * 0.7)
        for t, v in zip(theirs, opt.split(flat)):
            t.grad = v.clone()
        sgd.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # the estimates one parameter at a time: the same bits as the whole-fragment formulas
    d, avg, sent = (torch.randn(sum(t.numel() for t in ours), generator=g) for _ in range(3))
    each = torch.cat([t.reshape(-1) for t in eager_estimate_each(d, avg, sent, 0.3, opt.pieces)])
    assert torch.equal(each, eager_estimate(d, avg, sent, 0.3))
    each = torch.cat([t.reshape(-1) for t in joiner_estimate_each(d, avg, 2, opt.pieces)])
    assert torch.equal(each, joiner_estimate(d, avg, 2))


# worker r's displacement per inner step; H = 2 so rounds are steps (1,2), (3,4), (5,6)
DISP = [[2, 0, 4, 0, 6, 0], [0, 0, 2, 0, 0, 0]]


def test_blocking_golden():
    # round outer grads d = [2,0], [4,2], [6,0]; averages 1, 3, 3; theta_bar 0 -> -0.5 -> -2 -> -3.5
    out = run_scripted("blocking", DISP, 6, inner_steps=2)
    assert [(o[0], o[1]) for o in out] == [(-3.5, -3.5), (-3.5, -3.5)]


class _ModelAveraging(SyncRule):
    """A rule written here to show what a new one takes (one class, and its config choice): plain
    model averaging, theta_bar <- theta_bar - avg (no outer optimizer), waited for at the sync."""

    waits_at_sync = True
    records_applied = True

    def land(self, pending, result, at_sync):
        d = result.average if result is not None else pending.outer_grad
        with torch.no_grad():
            for o, step in zip(self.f.outer, self.f.split(d)):
                o.sub_(step)
        self.restart_from(self.f.outer)
        return Landing()


def test_a_new_rule_is_one_class_and_its_config_choice(monkeypatch):
    """The same golden run as blocking's with the test rule in blocking's place: every round's full
    average is applied (theta_bar 0 -> -1 -> -4 -> -7), where blocking's outer lr 0.5 moved half."""
    monkeypatch.setitem(rules.MODE_RULES, "blocking", _ModelAveraging)
    out = run_scripted("blocking", DISP, 6, inner_steps=2)
    assert [(o[0], o[1]) for o in out] == [(-7.0, -7.0), (-7.0, -7.0)]
    assert [e["estimate"] for e in out[0][2].events if e["event"] == "sync"] == ["average"] * 3


def test_eager_paper_golden():
    # round 0: no previous average -> local-only: theta_bar = [-1, 0]; launched avg_0 = 1, q_0 = [2, 0]
    # round 1: d = [4, 2]; est = 1 + (d - q_0) * 0.5 = [2, 2]; theta_bar = [-2, -1]; avg_1 = 3, q_1 = [4, 2]
    # round 2: d = [6, 0]; est = 3 + (d - q_1) * 0.5 = [4, 2]; theta_bar = [-4, -2]
    out = run_scripted("eager", DISP, 6, inner_steps=2, eager_rule="paper")
    assert [(o[0], o[1]) for o in out] == [(-4.0, -4.0), (-2.0, -2.0)]
    kinds = [e["estimate"] for e in out[0][2].events if e["event"] == "outer_step"]
    assert kinds == ["local-only", "eager", "eager"]


class TwoScalarModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scalar(), Scalar()])


def run_scripted_blocks(displacement: list[list[list[float]]], steps: int, finish: bool = False,
                        outer_lr: float = 0.5, outer_momentum: float = 0.0, link: LinkModel = INSTANT_LINK,
                        events: Optional[list] = None, **cfg) -> list[list[tuple[float, float]]]:
    """M workers, one scalar per block (block b is fragment b under the strided rule); at inner step t
    block b of worker r moves by -displacement[r][b][t-1]. Returns, per worker, per block, the pair
    (outer parameter, local parameter) after ``steps`` steps (and ``finish()`` if asked)."""
    M, B = len(displacement), len(displacement[0])
    # the hand-worked numbers below use the 'corrected' rule with the 'own' estimate and the correction
    # at the next sync, unless a test names another rule
    cfg = {"eager_rule": "corrected", **cfg}
    if cfg["eager_rule"] == "corrected":  # its knobs; other rules refuse them
        cfg = {"eager_estimate": "own", "eager_correction": "next-sync", **cfg}
    swarm = LocalSwarm(num_workers=M, codec="fp32", timeout=10, link=link)
    config = DiLoCoConfig(outer_lr=outer_lr, outer_momentum=outer_momentum, codec="fp32", weighting="equal",
                          num_fragments=B, **cfg)
    out = [None] * M

    def worker(rank):
        model = ScalarModel() if B == 1 else TwoScalarModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        diloco = wrap(model, opt, transport=swarm.transport(rank), config=config)
        for t in range(1, steps + 1):
            with torch.no_grad():
                for b in range(B):
                    model.layers[b].w -= displacement[rank][b][t - 1]
            diloco.step()
        if finish:
            diloco.finish()
        out[rank] = [(diloco.outer_params[b][0].item(), model.layers[b].w.item()) for b in range(B)]
        if events is not None and rank == 0:
            events.extend(diloco.events)
        diloco.close()

    swarm.run(worker)
    return out


# three workers, H = 2, P = 1: outer gradients per round [2, 0, 4], [4, 2, 0], [6, 0, 3]; averages 2, 2, 3
DISP3 = [[[2, 0, 4, 0, 6, 0]], [[0, 0, 2, 0, 0, 0]], [[4, 0, 0, 0, 3, 0]]]


def test_eager_corrected_golden_two_peers():
    # theta_bar steps only with averages, one round late; the local start is a one-off step with d_k:
    # round 0: start = 0 - 0.5 d_0 = [-1, 0]
    # round 1: theta_bar = 0 - 0.5 avg_0 = -0.5; d_1 = [4, 2]; start = -0.5 - 0.5 d_1 = [-2.5, -1.5]
    # round 2: theta_bar = -0.5 - 0.5 avg_1 = -2; d_2 = [6, 0]; start = -2 - 0.5 d_2 = [-5, -2]
    out = run_scripted_blocks([[DISP[0]], [DISP[1]]], 6, inner_steps=2, mode="eager")
    assert out == [[(-2.0, -5.0)], [(-2.0, -2.0)]]


def test_eager_corrected_golden_three_peers():
    # round 0: start = -0.5 [2, 0, 4] = [-1, 0, -2]
    # round 1: theta_bar = -0.5 * 2 = -1; start = -1 - 0.5 [4, 2, 0] = [-3, -2, -1]
    # round 2: theta_bar = -1 - 0.5 * 2 = -2; start = -2 - 0.5 [6, 0, 3] = [-5, -2, -3.5]
    out = run_scripted_blocks(DISP3, 6, inner_steps=2, mode="eager")
    assert out == [[(-2.0, -5.0)], [(-2.0, -2.0)], [(-2.0, -3.5)]]
    # finish(): avg_2 = 3 lands: theta_bar = -3.5 on every peer, the blocking result (no drift since the restart)
    assert run_scripted_blocks(DISP3, 6, finish=True, inner_steps=2, mode="eager") == [[(-3.5, -3.5)]] * 3
    assert run_scripted_blocks(DISP3, 6, inner_steps=2, mode="blocking") == [[(-3.5, -3.5)]] * 3


def test_eager_corrected_golden_three_peers_two_fragments():
    # H = 2, P = 2: fragment 0 (block 0) syncs at t = 1, 3, 5 with the outer gradients of DISP3, so it
    # ends as in the P = 1 case; fragment 1 (block 1) syncs at t = 2, 4, 6 with [6, 0, 3], [0, 6, 0],
    # [2, 2, 2] (averages 3, 2, 2): start -0.5 [6, 0, 3] = [-3, 0, -1.5]; theta_bar -1.5,
    # start -1.5 - 0.5 [0, 6, 0] = [-1.5, -4.5, -1.5]; theta_bar -2.5, start -2.5 - 1 = -3.5
    disp = [[[2, 0, 4, 0, 6, 0], [0, 6, 0, 0, 0, 2]],
            [[0, 0, 2, 0, 0, 0], [0, 0, 0, 6, 0, 2]],
            [[4, 0, 0, 0, 3, 0], [0, 3, 0, 0, 0, 2]]]
    out = run_scripted_blocks(disp, 6, inner_steps=2, mode="eager")
    assert out == [[(-2.0, -5.0), (-2.5, -3.5)], [(-2.0, -2.0), (-2.5, -3.5)], [(-2.0, -3.5), (-2.5, -3.5)]]


def test_eager_corrected_golden_with_nesterov_momentum():
    # lr 0.5, Nesterov momentum 0.5; the look-ahead is the step the optimizer would take, not taken:
    # round 0: buf' = d = [2, 0]; step d + 0.5 buf' = [3, 0]; start = [-1.5, 0]
    # round 1: commit avg_0 = 1: buf = 1, step 1.5, theta_bar = -0.75; d = [4, 2]: buf' = 0.5 + d = [4.5, 2.5],
    #          step d + 0.5 buf' = [6.25, 3.25]; start = -0.75 - 0.5 step = [-3.875, -2.375]
    # round 2: commit avg_1 = 3: buf = 3.5, step 4.75, theta_bar = -3.125; d = [6, 0]: buf' = [7.75, 1.75],
    #          step [9.875, 0.875]; start = [-8.0625, -3.5625]
    out = run_scripted_blocks([[DISP[0]], [DISP[1]]], 6, inner_steps=2, mode="eager", outer_momentum=0.5)
    assert out == [[(-3.125, -8.0625)], [(-3.125, -3.5625)]]
    # finish(): avg_2 = 3 lands: buf = 1.75 + 3 = 4.75, step 5.375, theta_bar = -5.8125, as blocking
    blocking = run_scripted_blocks([[DISP[0]], [DISP[1]]], 6, inner_steps=2, mode="blocking", outer_momentum=0.5)
    finished = run_scripted_blocks([[DISP[0]], [DISP[1]]], 6, finish=True, inner_steps=2, mode="eager",
                                   outer_momentum=0.5)
    assert blocking == finished == [[(-5.8125, -5.8125)]] * 2


def test_eager_corrected_on_arrival_ends_where_blocking_ends():
    # on arrival, theta_bar commits each average as it lands and the local parameters move by the same
    # amount, keeping local - start: whenever the averages landed, finish() ends at the blocking result
    for disp, momentum in ((DISP3, 0.0), ([[DISP[0]], [DISP[1]]], 0.5)):
        blocking = run_scripted_blocks(disp, 6, inner_steps=2, mode="blocking", outer_momentum=momentum)
        arrival = run_scripted_blocks(disp, 6, finish=True, inner_steps=2, mode="eager", outer_momentum=momentum,
                                      eager_correction="on-arrival")
        assert arrival == blocking


def test_eager_corrected_estimates_golden():
    # 'mixed': est = avg_{k-1} + (d_k - q_{k-1}) / 2; round 1: 1 + ([4, 2] - [2, 0]) / 2 = [2, 2],
    # start -0.5 - 1 = -1.5; round 2: 3 + ([6, 0] - [4, 2]) / 2 = [4, 2], start -2 - [2, 1] = [-4, -3]
    two = [[DISP[0]], [DISP[1]]]
    assert run_scripted_blocks(two, 6, inner_steps=2, mode="eager", eager_estimate="mixed") == \
        [[(-2.0, -4.0)], [(-2.0, -3.0)]]
    # 'scaled': est = c d_k, c = <q_{k-1}, avg_{k-1}> / |q_{k-1}|^2 in [0, 1]; round 1: c = 2/4 and 0
    # (nothing sent), est [2, 0], start [-1.5, -0.5]; round 2: c = 12/16 and min(1, 6/4), est [4.5, 0],
    # start [-4.25, -2]
    assert run_scripted_blocks(two, 6, inner_steps=2, mode="eager", eager_estimate="scaled") == \
        [[(-2.0, -4.25)], [(-2.0, -2.0)]]


def test_naive_delayed_golden():
    # round 0 local-only: [-1, 0]; round 1 uses avg_0 = 1: [-1.5, -0.5]; round 2 uses avg_1 = 3: [-3, -2]
    out = run_scripted("naive-delayed", DISP, 6, inner_steps=2)
    assert [(o[0], o[1]) for o in out] == [(-3.0, -3.0), (-2.0, -2.0)]


def test_overlap_golden():
    # tau = 1, alpha = 0.5, H = 2. Worked by hand (see docs/algorithm.md):
    # t2 sync d=[2,0] avg 1; t3 local [-6,-2], theta_tilde -0.5, local = [-3.25, -1.25];
    # t4 sync d=[2.75, .75] avg 1.75; t5 local [-9.25,-1.25], theta_tilde -1.375, local = [-5.3125,-1.3125];
    # t6 sync d=[3.9375,-.0625] avg 1.9375; t7 theta_tilde -2.34375, local = [-3.828125, -1.828125]
    disp = [[2, 0, 4, 0, 6, 0, 0], [0, 0, 2, 0, 0, 0, 0]]
    out = run_scripted("overlap", disp, 7, inner_steps=2, overlap_steps=1, alpha=0.5)
    assert [(o[0], o[1]) for o in out] == [(-2.34375, -3.828125), (-2.34375, -1.828125)]


def test_eager_overlap_and_merge_golden_two_peers_instant_link():
    # H = 2, P = 1, lr 0.5, alpha 0.5, workers move [2, 2, 4, 0, 6, 0] and [0, 2, 2, 0, 0, 0]; rounds land
    # at t_k + 1. Eager 'overlap' is overlap with tau = the link's delay: theta_bar <- theta_bar - 0.5 avg,
    # local <- 0.5 local + 0.5 theta_bar:
    # t2 sync d = [4, 2] (avg 3); t3 locals [-8, -4], theta_bar -1.5, merge [-19/4, -11/4];
    # t4 sync d = [13/4, 5/4] (avg 9/4); t5 locals [-43/4, -11/4], theta_bar -21/8, merge [-107/16, -43/16];
    # t6 sync d = [65/16, 1/16] (avg 33/16); finish: theta_bar -117/32, merge [-331/64, -203/64]
    two = [[[2, 2, 4, 0, 6, 0]], [[0, 2, 2, 0, 0, 0]]]
    overlap = run_scripted_blocks(two, 6, finish=True, inner_steps=2, mode="eager", eager_rule="overlap")
    assert overlap == [[(-3.65625, -5.171875)], [(-3.65625, -3.171875)]]
    assert run_scripted_blocks(two, 6, finish=True, inner_steps=2, mode="overlap", overlap_steps=1) == overlap
    # eager 'merge' keeps the progress made in flight: local <- local + 0.5 (theta_bar - theta_k), theta_k the
    # local parameters at the launch: t2 theta_k [-4, -2], d [4, 2] (avg 3); t3 locals [-8, -4],
    # theta_bar -1.5, + 0.5 ([-1.5, -1.5] - [-4, -2]) = [-27/4, -15/4]; t4 d [21/4, 9/4] (avg 15/4);
    # t5 locals [-51/4, -15/4], theta_bar -27/8, + 0.5 (-27/8 - theta_k) = [-177/16, -57/16];
    # t6 d [123/16, 3/16] (avg 63/16); finish: theta_bar -171/32, locals [-525/64, -285/64]
    merge = run_scripted_blocks(two, 6, finish=True, inner_steps=2, mode="eager", eager_rule="merge")
    assert merge == [[(-5.34375, -8.203125)], [(-5.34375, -4.453125)]]


def test_eager_merge_golden_three_peers_rounds_land_at_the_next_sync():
    # D = 2 = H: each round lands at the fragment's next sync, is merged, and only then is the next
    # outer gradient taken. DISP3, H = 2, P = 1:
    # t2 sync theta_k = [-2, 0, -4], d = [2, 0, 4] (avg 2); t4 locals [-6, -2, -4], lands: theta_bar -1,
    #    + 0.5 (-1 - theta_k) = [-11/2, -5/2, -5/2], sync d = [9/2, 3/2, 3/2] (avg 5/2);
    # t6 locals [-23/2, -5/2, -11/2], lands: theta_bar -9/4, + 0.5 (-9/4 - theta_k) = [-79/8, -19/8, -43/8]
    events: list = []
    out = run_scripted_blocks(DISP3, 6, inner_steps=2, mode="eager", eager_rule="merge",
                              link=LinkModel(delay_steps=2), events=events)
    assert out == [[(-2.25, -9.875)], [(-2.25, -2.375)], [(-2.25, -5.375)]]
    assert [e["land_steps"] for e in events if e["event"] == "sync"] == [2, 2]


@pytest.mark.parametrize("delay", [2, 3])
def test_eager_merge_golden_three_peers_two_fragments(delay):
    # H = 2, P = 2: fragment 0 syncs at t = 1, 3, 5 and lands as in the P = 1 case; fragment 1 syncs at
    # t = 2, 4, 6: t2 theta_k [-6, 0, -3], d = [6, 0, 3] (avg 3); t4 locals [-6, -6, -3], theta_bar -3/2,
    # + 0.5 (-3/2 - theta_k) = [-15/4, -27/4, -9/4], d = [9/4, 21/4, 3/4] (avg 11/4); t6 locals
    # [-23/4, -35/4, -17/4], theta_bar -23/8, + 0.5 (-23/8 - theta_k) = [-85/16, -109/16, -73/16].
    # D = 3 > H: the round is waited for at the next sync, same numbers.
    disp = [[[2, 0, 4, 0, 6, 0], [0, 6, 0, 0, 0, 2]],
            [[0, 0, 2, 0, 0, 0], [0, 0, 0, 6, 0, 2]],
            [[4, 0, 0, 0, 3, 0], [0, 3, 0, 0, 0, 2]]]
    link = LinkModel(delay_steps=delay)
    out = run_scripted_blocks(disp, 6, inner_steps=2, mode="eager", eager_rule="merge", link=link)
    assert out == [[(-2.25, -9.875), (-2.875, -5.3125)], [(-2.25, -2.375), (-2.875, -6.8125)],
                   [(-2.25, -5.375), (-2.875, -4.5625)]]
    # finish(): fragment 0's avg 29/8 -> theta_bar -65/16, locals [-223/32, -103/32, -151/32];
    # fragment 1's avg 43/16 -> theta_bar -135/32, locals [-305/64, -353/64, -281/64]
    done = run_scripted_blocks(disp, 6, finish=True, inner_steps=2, mode="eager", eager_rule="merge", link=link)
    assert done == [[(-4.0625, -6.96875), (-4.21875, -4.765625)], [(-4.0625, -3.21875), (-4.21875, -5.515625)],
                    [(-4.0625, -4.71875), (-4.21875, -4.390625)]]


def test_eager_overlap_at_a_link_delay_is_overlap_with_that_tau_bit_for_bit():
    torch.manual_seed(5)
    data = [torch.randn(6, 8) for _ in range(2)]

    def run(**cfg):
        delay = cfg.pop("delay")
        swarm = LocalSwarm(num_workers=2, link=LinkModel(delay_steps=delay))
        config = DiLoCoConfig(inner_steps=8, num_fragments=2, codec="fp32", **cfg)
        out = [None, None]

        def worker(rank):
            model = make_mlp()
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            dl = StreamingDiLoCo(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
            for _ in range(24):
                model(data[rank]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                dl.step()
            out[rank] = [p.detach().clone() for p in model.parameters()]
            dl.close()

        swarm.run(worker)
        return out

    eager = run(mode="eager", eager_rule="overlap", delay=3)
    overlap = run(mode="overlap", overlap_steps=3, delay=1)
    assert all(torch.equal(a, b) for m, o in zip(eager, overlap) for a, b in zip(m, o))
    assert not all(torch.equal(a, b) for a, b in zip(eager[0], run(mode="eager", eager_rule="overlap", delay=1)[0]))


def test_link_model_lands_rounds_a_given_number_of_steps_late():
    for delay in (1, 4, 9):  # H = 8: 9 is waited for at the next sync, 8 steps after the launch
        events: list = []
        run_scripted_blocks([[[1.0] * 24]] * 2, 24, inner_steps=8, mode="eager", eager_estimate="scaled",
                            eager_correction="on-arrival", link=LinkModel(delay_steps=delay), events=events)
        assert {e["land_steps"] for e in events if e["event"] == "sync"} == {min(delay, 8)}
    # from the bytes: a round that brings 26 bytes, at 1e-5 Mbit/s (10 bit/s) in 1 s steps, takes 20.8 s
    link = LinkModel(mbit=1e-5, step_s=1.0)
    result = SyncResult(average=torch.zeros(1), group_size=2, weight_share=0.5, sent=torch.zeros(1),
                        bytes_sent=26, bytes_received=26)
    assert link.steps(result) == 21
    with pytest.raises(ValueError, match=">= 1"):
        LinkModel(delay_steps=0)
    with pytest.raises(ValueError, match="both"):
        LinkModel(mbit=5.0)


# ---------------------------------------------------------------------------- equivalences
_INIT_LOCK = threading.Lock()


def make_mlp(seed=0):
    """The same model for every caller: LocalSwarm workers build theirs in threads at once, and the
    global RNG is one (without the lock a thread's seed could land in the middle of another's draws)."""
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def train_plain(model, data, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        model(data[i % len(data)]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_single_worker_with_unit_outer_lr_reproduces_local_training(mode):
    torch.manual_seed(1)
    data = [torch.randn(5, 8) for _ in range(3)]
    reference = train_plain(make_mlp(), data, 12)
    swarm = LocalSwarm(num_workers=1)
    model = make_mlp()
    config = DiLoCoConfig(inner_steps=4, num_fragments=1, mode=mode, outer_lr=1.0, outer_momentum=0.0, codec="fp32")

    def worker(rank):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
        for i in range(12):
            model(data[i % len(data)]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        diloco.close()

    swarm.run(worker)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode,extra", [("blocking", {}), ("eager", {}), ("eager", {"eager_rule": "overlap"}),
                                        ("eager", {"eager_rule": "corrected", "eager_estimate": "mixed"}),
                                        ("eager", {"eager_rule": "corrected", "eager_estimate": "scaled"}),
                                        ("eager", {"eager_rule": "corrected", "eager_estimate": "own"}),
                                        ("eager", {"eager_rule": "paper"}), ("overlap", {"overlap_steps": 1}),
                                        ("data-parallel", {})])
def test_workers_fed_identical_data_behave_like_one(mode, extra):
    """Blocking, overlap, data-parallel, eager 'merge' and 'overlap', and eager 'corrected' ('own' and
    'scaled' estimates): M identical
    workers == one worker (the estimate is exact when every peer sends the same outer gradient). Eager
    'paper' and the 'mixed' estimate are not, by design (the others' share of its estimate is one round stale, 1/M of it is fresh), but
    the M workers still stay identical to each other."""
    torch.manual_seed(2)
    data = [torch.randn(5, 8) for _ in range(3)]
    config = DiLoCoConfig(inner_steps=4, num_fragments=2, mode=mode, codec="fp32", **extra)

    def run(M):
        swarm = LocalSwarm(num_workers=M)
        models = [make_mlp() for _ in range(M)]

        def worker(rank):
            model = models[rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            diloco = wrap(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
            for i in range(16):
                model(data[i % len(data)]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                diloco.step(tokens=5)
            diloco.close()

        swarm.run(worker)
        return models

    (one,), three = run(1), run(3)
    # the 'paper' rule and the 'mixed' estimate use last round's average for the others' part
    paper = extra.get("eager_rule") == "paper" or extra.get("eager_estimate") == "mixed"
    for m in three:
        reference = three[0] if paper else one
        for a, b in zip(m.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if paper:  # ...and differ from a single worker, or the test above proves nothing
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(three[0].parameters(), one.parameters()))


def test_public_api_example_runs_and_moves_the_model():
    """The usage from the issue, as written."""
    M = 2
    models = [torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]) for _ in range(M)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    before = copy.deepcopy(models[0].state_dict())
    data = [torch.randn(5, 8) for _ in range(M)]
    swarm = LocalSwarm(num_workers=M)
    config = DiLoCoConfig(inner_steps=4, num_fragments=2, fragment_pattern="strided", mode="eager",
                          overlap_steps=0, alpha=0.5, outer_lr=0.7, outer_momentum=0.9, codec="fp32")
    events = []

    def worker(rank):
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(rank), config=config,
                                 blocks=list(model))
        for _ in range(16):
            model(data[rank]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        events.extend(diloco.events)
        diloco.close()

    swarm.run(worker)
    assert any(not torch.equal(before[k], v) for k, v in models[0].state_dict().items())
    syncs = [e for e in events if e["event"] == "sync"]
    # 2 fragments x 4 rounds launched per worker (fragment 0 at t = 2, 6, 10, 14; fragment 1 at 4, 8, 12,
    # 16); each lands at the step after its launch (on arrival), so only fragment 1's last is in flight
    assert len(syncs) == 2 * (4 + 3) and all(e["ok"] and e["group_size"] == 2 for e in syncs)


@pytest.mark.parametrize("extra", [{}, {"eager_rule": "corrected", "eager_estimate": "own"},
                                   {"eager_rule": "corrected", "eager_estimate": "scaled"}, {"eager_rule": "paper"},
                                   {"eager_rule": "overlap"}])
def test_state_dict_round_trip_resumes_exactly(extra):
    torch.manual_seed(3)
    data = [torch.randn(5, 8) for _ in range(3)]
    config = DiLoCoConfig(inner_steps=4, num_fragments=2, mode="eager", codec="fp32", error_feedback=True, **extra)

    def run(split: bool):
        swarm = LocalSwarm(num_workers=1)
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(0), config=config, blocks=list(model))
        for i in range(20):
            if split and i == 10:  # checkpoint, rebuild everything from the checkpoint
                state = copy.deepcopy(diloco.state_dict())
                model_state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                model = make_mlp(seed=99)
                model.load_state_dict(model_state)
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                opt.load_state_dict(opt_state)
                diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(0), config=config, blocks=list(model))
                diloco.load_state_dict(state)
            model(data[i % 3]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step()
        return model

    a, b = run(False), run(True)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)


class _SlowLinkTransport(Transport):
    """A stand-in link whose rounds land only when the test says so (a real link's timing cannot be
    set precisely in a test): it records every wait() and whether that round had landed. The parts
    of the Transport protocol it does not override are a transport's without a view of the swarm."""

    peer_id = "slow"

    def __init__(self):
        self.handles, self.waits = [], []

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        outer = self

        class Handle(SyncHandle):
            def __init__(self):
                self.key, self.landed = key, False
                self.result = SyncResult(average=tensor.clone(), group_size=1, weight_share=1.0, sent=tensor.clone())

            def done(self):
                return self.landed

            def wait(self, timeout=None):
                outer.waits.append((self.key, self.landed))
                self.landed = True  # a blocking wait: the caller waited for the link
                return self.result

        h = Handle()
        self.handles.append(h)
        return h


def _eager_h4(link):
    """Eager, H = 4, P = 1 over ``link``: (diloco, model, its SGD optimizer, a batch)."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = StreamingDiLoCo(model, opt, transport=link, config=DiLoCoConfig(inner_steps=4, num_fragments=1,
                                                                             mode="eager"), blocks=list(model))
    return diloco, model, opt, torch.randn(5, 8)


def test_eager_waits_only_for_a_round_that_took_the_whole_window():
    """Eager (corrected, on arrival) never waits for a round that lands in time, and waits at the next
    sync only for a round that has not landed by then: the fix adds no waiting."""
    link = _SlowLinkTransport()
    diloco, model, opt, data = _eager_h4(link)
    for t in range(1, 13):
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if t == 6:
            link.handles[0].landed = True  # round 0 (launched at t = 4) lands within its window
        diloco.step()
    # round 0 landed in time: consumed without waiting; round 1 (t = 8) never landed: waited at t = 12
    assert link.waits == [((0, 0), True), ((0, 1), False)]


class _SwarmAheadTransport(_SlowLinkTransport):
    """Rounds land at once; ``late`` holds the (fragment, round) keys the swarm launched a while ago."""

    def __init__(self):
        super().__init__()
        self.late, self.launched, self.expected = set(), [], []

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        self.launched.append((key, weight))
        handle = super().all_reduce(key, tensor, weight)
        handle.landed = True
        return handle

    def round_late(self, key):
        return key in self.late

    def expect_rounds(self, keys, since=None):
        self.expected.append(list(keys))
        self.since = since


def _eager_h10_p2(link, **config):
    """Eager, H = 10, P = 2 (and ``config``) over ``link``; and one inner step of 100 tokens."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = StreamingDiLoCo(model, opt, transport=link, config=DiLoCoConfig(inner_steps=10, num_fragments=2,
                                                                             mode="eager", **config),
                             blocks=list(model))
    data = torch.randn(5, 8)

    def inner_step():
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        diloco.step(tokens=100)

    return diloco, inner_step


def test_a_peer_behind_the_swarm_catches_up_and_sends_the_tokens_it_processed():
    """H = 10, P = 2 (fragment 0 syncs at 5, 15..., fragment 1 at 10, 20...): told at step 3 that round
    0 of fragment 0 is late, the peer jumps to step 5 and syncs it with 3 steps' tokens; told at step 6
    that both next rounds are late, it jumps to step 15, syncing each fragment once on the way."""
    link = _SwarmAheadTransport()
    diloco, inner_step = _eager_h10_p2(link)

    inner_step(), inner_step()
    assert diloco.step_count == 2 and not link.launched  # nothing late: the own schedule
    link.late.add((0, 0))
    inner_step()
    assert diloco.step_count == 5 and link.launched == [((0, 0), 300.0)]
    link.late |= {(1, 0), (0, 1)}
    inner_step()  # own step 6: fragment 1's round 0 (step 10) and fragment 0's round 1 (step 15)
    assert diloco.step_count == 15
    assert link.launched[1:] == [((1, 0), 400.0), ((0, 1), 100.0)]
    assert diloco.stats.caught_up_steps == 2 + 9
    assert [(e["from_step"], e["to_step"]) for e in diloco.events if e["event"] == "catch_up"] == [(3, 5), (6, 15)]
    link.late.clear()
    for _ in range(5):
        inner_step()
    assert diloco.step_count == 20 and link.launched[-1] == ((1, 1), 500.0)  # back on its own schedule


class _StuckRoundsTransport(_SlowLinkTransport):
    """Rounds never land by themselves (they wait for a group the swarm left); ``late`` as above.
    ``abandon()`` fails a round at once and is recorded; the real one is tested on hivemind peers."""

    def __init__(self):
        super().__init__()
        self.late, self.abandoned, self.launched = set(), [], []

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        from opendiloco_stream.transport.base import SyncFailed

        self.launched.append(key)
        handle = super().all_reduce(key, tensor, weight)
        outer, wait = self, handle.wait

        def abandon():
            outer.abandoned.append(handle.key)
            handle.gave_up = True
            return True

        def wait_or_fail(timeout=None):
            if getattr(handle, "gave_up", False):
                raise SyncFailed("abandoned", key=handle.key, reason="matchmaking")
            return wait(timeout)

        handle.abandon, handle.wait = abandon, wait_or_fail
        return handle

    def round_late(self, key):
        return key in self.late


def test_a_peer_rounds_behind_jumps_to_the_swarms_round_and_abandons_the_rounds_it_passes():
    """H = 10, P = 2 (fragment 0 syncs at 5, 15..., fragment 1 at 10, 20...). At step 11 the swarm has
    launched rounds 1-3 of fragment 0 (not round 1 of fragment 1): one look jumps to round 3's sync
    step (35). On the way, each pending round of fragment 0 the swarm moved past is abandoned instead
    of waited for; fragment 1's rounds, still current, are waited for."""
    link = _StuckRoundsTransport()
    diloco, inner_step = _eager_h10_p2(link)

    for _ in range(10):
        inner_step()
    assert link.launched == [(0, 0), (1, 0)] and not link.abandoned
    link.late |= {(0, 1), (0, 2), (0, 3)}
    inner_step()
    assert diloco.step_count == 35
    assert [(e["from_step"], e["to_step"]) for e in diloco.events if e["event"] == "catch_up"] == [(11, 35)]
    assert link.launched == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]
    assert link.abandoned == [(0, 0), (0, 1), (0, 2)]  # round 3 is the swarm's current one: kept
    assert ((1, 0), False) in link.waits and ((1, 1), False) in link.waits  # waited for, not abandoned
    syncs = {(e["fragment"], e["round"]): e for e in diloco.events if e["event"] == "sync"}
    assert all(not syncs[(0, k)]["ok"] and syncs[(0, k)]["reason"] == "matchmaking" for k in range(3))


def _mlp_diloco(link, config, seed=0):
    """StreamingDiLoCo over ``link`` with ``config`` on a fresh MLP (seed ``seed``) trained by SGD."""
    model = make_mlp(seed)
    return StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), transport=link, config=config,
                           blocks=list(model))


def test_a_joiner_announces_its_next_round_of_every_fragment():
    """After loading a running swarm's state (joiner=True), the transport hears which rounds this peer
    takes part in next, so the others count it there; a checkpoint restore announces nothing."""
    config = DiLoCoConfig(inner_steps=10, num_fragments=2, mode="eager")
    donor = _mlp_diloco(_SwarmAheadTransport(), config)
    for _ in range(12):
        donor.step(tokens=1)
    state = donor.state_dict()
    link = _SwarmAheadTransport()
    joiner = _mlp_diloco(link, config, seed=1)
    joiner.load_state_dict(state)
    assert link.expected == []
    joiner.load_state_dict(state, joiner=True)
    assert link.expected == [[(0, 1), (1, 1)]]  # step 12: fragment 0 syncs next at 15, fragment 1 at 20
    # a donor still at the initial model hands out a marker: the joiner keeps its own (identical)
    # initial model and is counted in the first round of every fragment, not sat out as a newcomer
    fresh_link = _SwarmAheadTransport()
    fresh = _mlp_diloco(fresh_link, config, seed=2)
    fresh.load_state_dict({"step": 0, "initial": True}, joiner=True)
    assert fresh_link.expected == [[(0, 0), (1, 0)]] and fresh.step_count == 0 and fresh.at_initial_model()


class _ReservingTransport(_SwarmAheadTransport):
    """A donor's transport that reserves its joiner's rounds (``reserve_rounds``), at a fixed time."""

    def __init__(self):
        super().__init__()
        self.reserved = []

    def reserve_rounds(self, keys):
        self.reserved.append(list(keys))
        return 123.0


def test_a_donor_reserves_its_joiner_in_the_rounds_after_its_state_and_the_joiner_knows_since_when():
    """The state a donor serves comes with its joiner reserved in the next round of every fragment
    (asked of the transport while the state is taken, before the donor trains on) and the time of
    that (``reserved_at``); the joiner announces the same rounds with that time, from the step in
    the download's first message (``expect_rounds_after``) and again once the state is loaded.
    With ``record_digests`` every round consumed adds theta_bar's digest (``outer_digest``), and the
    joiner's after loading equals the donor's."""
    config = DiLoCoConfig(inner_steps=10, num_fragments=2, mode="eager", record_digests=True)
    donor_link = _ReservingTransport()
    donor = _mlp_diloco(donor_link, config)
    for _ in range(12):
        donor.step(tokens=1)
    digests = [e for e in donor.events if e["event"] == "outer_digest"]
    assert [(e["fragment"], e["round"]) for e in digests] == [(0, 0), (1, 0)]  # fragment 0 at 5, fragment 1 at 10
    state = donor._shared_state()
    assert donor_link.reserved == [[(0, 1), (1, 1)]] and state["reserved_at"] == 123.0
    link = _SwarmAheadTransport()
    joiner = _mlp_diloco(link, config, seed=1)
    joiner.expect_rounds_after(state["step"], since=state["reserved_at"])  # the manifest's step, before the tensors
    assert link.expected == [[(0, 1), (1, 1)]] and link.since == 123.0
    joiner.load_state_dict(state, joiner=True)
    assert link.expected[-1] == [(0, 1), (1, 1)] and link.since == 123.0
    assert all(torch.equal(a, b) for f, g in zip(donor.frags, joiner.frags) for a, b in zip(f.outer, g.outer))


def test_a_donor_handing_out_the_initial_model_marker_reserves_its_joiner_in_the_first_rounds():
    """The marker comes with the joiner reserved in the first round of every fragment (the
    rounds a joiner from the initial model takes, whatever step the donor is at), so that the one
    forming waits for it; the joiner announces them with that reservation's time."""
    config = DiLoCoConfig(inner_steps=10, num_fragments=2, mode="eager")
    donor_link = _ReservingTransport()
    donor = _mlp_diloco(donor_link, config)
    for _ in range(3):
        donor.step(tokens=1)
    assert donor._shared_state() == {"step": 0, "initial": True, "reserved_at": 123.0}
    assert donor_link.reserved == [[(0, 0), (1, 0)]]
    link = _SwarmAheadTransport()
    joiner = _mlp_diloco(link, config, seed=1)
    joiner.load_state_dict({"step": 0, "initial": True, "reserved_at": 123.0}, joiner=True)
    assert link.expected == [[(0, 0), (1, 0)]] and link.since == 123.0 and joiner.at_initial_model()


def test_a_donor_at_the_initial_model_hands_out_the_marker_only_while_its_rounds_take_newcomers():
    """Eager trains on while its first round runs: a donor still at the initial model whose round
    is closed to newcomers (it has its group, or waits only for the peers it counted) serves its
    state after the round landed, not the initial-model marker: a joiner starting from the initial
    model could not be in that round and would stay its outer step behind the others."""
    link = _SlowLinkTransport()
    donor, model, opt, data = _eager_h4(link)
    for _ in range(5):  # round 0 launched at step 4, in flight at step 5
        model(data).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        donor.step()
    handle = link.handles[0]
    assert donor.at_initial_model() and not handle.done()
    handle.takes_newcomers = lambda: True  # a cold start's first round, still matching
    assert donor._shared_state() == {"step": 0, "initial": True}
    # its group formed (or it counts only the peers it knew); SyncHandle's default, a transport
    # without matchmaking, says the same
    del handle.takes_newcomers
    assert handle.takes_newcomers() is False
    state = donor._shared_state()
    assert not state.get("initial") and state["step"] == 5
    assert state["fragments"][0]["pending"] is not None and link.waits == [((0, 0), False)]  # landed first


class _PrematchRecorder(_SlowLinkTransport):
    """Records every ``prematch`` and every round's launch, with the inner step each came at."""

    def __init__(self):
        super().__init__()
        self.now, self.early, self.launched = 0, [], []

    def prematch(self, key, weight=1.0, lead_s=0.0, digest=None):
        assert lead_s >= 0.0
        self.early.append((self.now, key, weight))

    def all_reduce(self, key, tensor, weight=1.0, digest=None):
        self.launched.append((self.now, key, weight))
        handle = super().all_reduce(key, tensor, weight)
        handle.landed = True  # no waiting: this test is about when rounds are announced
        return handle


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_prematch_steps_announce_each_round_ahead_with_the_weight_it_will_have(ahead):
    """H = 10, P = 2: fragment 0 syncs at 5, 15, 25, fragment 1 at 10, 20. With ``prematch_steps``
    = k the transport hears of each round k steps before its sync, with the weight the round then
    has (tokens since the fragment's last sync); k = 0 asks for nothing."""
    link = _PrematchRecorder()
    _, inner_step = _eager_h10_p2(link, prematch_steps=ahead)
    for t in range(1, 26):
        link.now = t
        inner_step()
    assert [key for _, key, _ in link.launched] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    assert [w for _, _, w in link.launched] == [500.0, 1000.0, 1000.0, 1000.0, 1000.0]
    if ahead == 0:
        assert link.early == []
        return
    early = [(t, key, w) for t, key, w in link.early if t + ahead <= 25]  # those whose sync came in the run
    assert early == [(t - ahead, key, w) for t, key, w in link.launched]
    assert all(t + ahead > 25 for t, _, _ in link.early[len(early):])


@pytest.mark.parametrize("flags, message", [
    (["--link-delay-steps", "0"], "link delay must be >= 1 inner step"),
    (["--link-mbit", "5"], "a link rate needs both"),
    (["--link-delay-steps", "3", "--transport", "hivemind"], "simulate a link for --transport local"),
])
def test_local_link_flags_that_cannot_be_are_one_line_and_exit_2(capsys, flags, message):
    from opendiloco_stream.cli import main as cli_main

    assert cli_main(["local", "--workers", "2", "--steps", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_state_dict_is_a_snapshot_that_later_steps_do_not_change(mode):
    """A donor streams its state while it trains on: nothing in a state_dict may be a live tensor
    (the outer optimizer's momentum was one, and a joiner's download failed its digest check)."""
    from opendiloco_stream.transport.hivemind.state_format import flatten_state, tensor_digest

    swarm, model, seen = LocalSwarm(num_workers=1), make_mlp(), {}
    config = DiLoCoConfig(inner_steps=5, num_fragments=2, mode=mode, outer_nesterov=True, codec="fp32")

    def worker(rank):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        diloco = StreamingDiLoCo(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
        for i in range(25):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            diloco.step(tokens=1)
            if i == 11:  # past the first outer steps: the momentum buffers exist
                seen["manifest"], seen["tensors"] = flatten_state(diloco.state_dict())
        diloco.close()

    swarm.run(worker)
    assert "momentum_buffer" in repr(seen["manifest"]["structure"])
    assert [tensor_digest(t) for t in seen["tensors"]] == seen["manifest"]["digests"]



@pytest.mark.parametrize("mode", ["eager", "blocking", "data-parallel"])
def test_the_with_form_trains_the_same_bits_as_explicit_step_calls(mode):
    """``with wrap(...) as diloco``: the optimizer's step post-hook calls ``diloco.step`` with the
    tokens ``count_tokens`` gave, so 12 inner steps of two peers (token-weighted rounds) end with
    the same parameters as the explicit ``opt.step(); diloco.step(tokens=...)`` loop; leaving the
    block removes the hook and closes the wrapper."""
    config = DiLoCoConfig(inner_steps=4, num_fragments=2, mode=mode, codec="fp32")

    def train(with_form: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        models = [make_mlp() for _ in range(2)]
        swarm = LocalSwarm(num_workers=2)

        def worker(rank):
            model = models[rank]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            gen = torch.Generator().manual_seed(rank)
            diloco = wrap(model, opt, transport=swarm.transport(rank), config=config, blocks=list(model))
            batches = [torch.randn(3 + rank + t % 2, 8, generator=gen) for t in range(12)]
            if with_form:
                with diloco:
                    for x in batches:
                        model(x).pow(2).mean().backward()
                        diloco.count_tokens(x.numel())
                        opt.step()
                        opt.zero_grad()
                with pytest.raises(RuntimeError, match="after close"):
                    diloco.step()  # closed on leaving the block
                opt.step()  # the hook is gone: a closed wrapper's step would raise
                assert diloco.step_count == 12
            else:
                for x in batches:
                    model(x).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                    diloco.step(tokens=x.numel())
                diloco.close()

        swarm.run(worker)
        return [p.detach().clone() for m in models for p in m.parameters()]

    hooked, explicit = train(True), train(False)
    assert len(hooked) == len(explicit) and all(torch.equal(a, b) for a, b in zip(hooked, explicit))
    assert any(not torch.equal(a, b) for a, b in zip(hooked, make_mlp().parameters()))  # it trained


def test_the_readme_python_example_runs_as_written_and_trains_both_workers():
    """README.md's Python example (its first python block), run as it is printed."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    setup, run = code.split("swarm.run(worker)")  # the models as built, before training
    namespace: dict = {}
    exec(compile(setup, "README.md", "exec"), namespace)  # noqa: S102 - the project's own example
    before = [[p.detach().clone() for p in m.parameters()] for m in namespace["models"]]
    exec(compile("swarm.run(worker)" + run, "README.md", "exec"), namespace)  # noqa: S102
    for m, initial in zip(namespace["models"], before):
        assert any(not torch.equal(a, b) for a, b in zip(m.parameters(), initial))
