"""The compute-utilization simulator (``opendiloco_stream.commands.simulator``) and ``simulate`` command."""

from __future__ import annotations

import json
import math

import pytest

from opendiloco_stream import cli
from opendiloco_stream.commands import simulator as sim

TEN_B = sim.PAPER_MODELS[1]
TINY = sim.Model(4.2e6, 4, 0.05, "tiny")
TINY_SETUP = sim.Setup(inner_steps=20, fragment_layers=2)


def _main(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    # The real dispatcher and its error contract, restricted to this command (the other command
    # modules are written separately).
    monkeypatch.setattr(cli, "COMMANDS", ("simulate",))
    return cli.main(["simulate", *argv])


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("model,setup", [(TINY, TINY_SETUP), (TEN_B, sim.Setup())], ids=["tiny", "10B"])
@pytest.mark.parametrize("method", sim.METHODS)
def test_utilization_never_decreases_with_bandwidth(model, setup, method):
    grid = [10 ** (k / 8) for k in range(-40, 33)]  # 1e-5 .. 1e4 Gbit/s
    utils = [sim.utilization(model, setup, method, g) for g in grid]
    assert all(b >= a - 1e-12 for a, b in zip(utils, utils[1:])), utils
    assert utils[0] < 0.5 < utils[-1]  # the grid spans the interesting range
    assert all(0 < u <= 1 for u in utils)


def test_required_bandwidth_ordering_for_10b_at_95_percent():
    need = {m: sim.required_bandwidth(TEN_B, sim.Setup(), m, 0.95) for m in sim.METHODS}
    assert need["data-parallel"] > need["diloco"] > need["streaming"] > need["streaming-overlap"]
    assert need["streaming-overlap"] > need["streaming-overlap-fp4"] >= need["eager-fp4"]
    # The paper's headline: orders of magnitude between data-parallel and overlapped FP4 streaming.
    assert need["data-parallel"] / need["streaming-overlap-fp4"] > 100


@pytest.mark.parametrize("quant_bits", [4.0, 8.0])
@pytest.mark.parametrize("target", [0.5, 0.95])
def test_quantized_payload_needs_bits_ratio_of_bandwidth(quant_bits, target):
    setup = sim.Setup(bits=16, quant_bits=quant_bits)
    full = sim.required_bandwidth(TEN_B, setup, "streaming-overlap", target)
    low = sim.required_bandwidth(TEN_B, setup, "streaming-overlap-fp4", target)
    assert low / full == pytest.approx(quant_bits / 16, rel=3e-3)


@pytest.mark.parametrize("method", sim.METHODS)
def test_infinite_bandwidth_gives_full_utilization(method):
    for model in sim.PAPER_MODELS:
        assert sim.utilization(model, sim.Setup(), method, math.inf) == pytest.approx(1.0, abs=1e-12)


def test_latency_alone_costs_utilization():
    slow = sim.Setup(latency_s=0.05)
    # Data-parallel waits for every step's result: one latency per step.
    assert sim.utilization(TINY, slow, "data-parallel", math.inf) == pytest.approx(0.05 / 0.10)
    # Eager has a whole round to hide it.
    assert sim.utilization(TINY, slow, "eager-fp4", math.inf) == pytest.approx(1.0)


def test_unreachable_target_is_none():
    slow = sim.Setup(latency_s=1.0)
    assert sim.required_bandwidth(TINY, slow, "data-parallel", 0.5) is None
    assert sim.required_bandwidth(TINY, slow, "eager-fp4", 0.5) is not None


@pytest.mark.parametrize("gbit_s", [0.02, 0.5, 3.0])
def test_blocking_full_model_sync_matches_closed_form(gbit_s):
    # One all-reduce per round, sent block by block behind the backward pass over one link; the
    # next forward needs block 0, whose backward ends last, so the round lasts
    # (H-1) steps + forward + one block's backward + all blocks' link time when the link is
    # slower than the backward (b <= c), and H steps + one block's link time otherwise.
    model, setup = TEN_B, sim.Setup()
    L, step, H = model.layers, model.step_time_s, setup.inner_steps
    fwd, b = step / 3, step * 2 / 3 / L
    c = model.params / L * setup.bits * setup.allreduce_factor / (gbit_s * 1e9)
    assert b <= c
    expected = H * step / ((H - 1) * step + fwd + b + L * c)
    assert sim.utilization(model, setup, "diloco", gbit_s) == pytest.approx(expected, rel=1e-9)
    dp = 1 * step / (fwd + b + L * c)
    assert sim.utilization(model, setup, "data-parallel", gbit_s) == pytest.approx(dp, rel=1e-9)


def test_fast_link_data_parallel_pays_only_the_last_block():
    model, setup, gbit_s = TEN_B, sim.Setup(), 1e4
    L, step = model.layers, model.step_time_s
    c = model.params / L * setup.bits * setup.allreduce_factor / (gbit_s * 1e9)
    assert c < step * 2 / 3 / L
    assert sim.utilization(model, setup, "data-parallel", gbit_s) == pytest.approx(step / (step + c))


def test_eager_is_bound_by_link_throughput_alone():
    model, setup = TEN_B, sim.Setup()
    bits_per_round = model.params * setup.quant_bits * setup.allreduce_factor
    for gbit_s in (0.1, 0.5, 0.9):
        link_bound = setup.inner_steps * model.step_time_s * gbit_s * 1e9 / bits_per_round
        assert link_bound < 1
        assert sim.utilization(model, setup, "eager-fp4", gbit_s) == pytest.approx(link_bound, rel=1e-9)


@pytest.mark.parametrize("method,gbit_s", [("eager-fp4", 0.99), ("eager-fp4", 0.5),
                                           ("streaming-overlap", 8.0), ("streaming", 20.0),
                                           ("data-parallel", 300.0)])
def test_steady_state_solution_matches_long_event_simulation(method, gbit_s):
    # Near eager's threshold the backlog takes ~100 rounds to build: a short warm-up is wrong.
    exact = sim.utilization(TEN_B, sim.Setup(), method, gbit_s)
    warm = 400 if method != "data-parallel" else 40
    assert sim.simulated_utilization(TEN_B, sim.Setup(), method, gbit_s, warm, 40) == pytest.approx(
        exact, rel=1e-6)
    if (method, gbit_s) == ("eager-fp4", 0.99):
        assert sim.simulated_utilization(TEN_B, sim.Setup(), method, gbit_s, 4, 4) > exact + 0.005


def test_strided_fragments_beat_sequential_on_a_fast_link():
    # Figure 7 of the paper: strided fragments end their backward spread out, so more overlaps.
    model = sim.PAPER_MODELS[2]
    strided = sim.utilization(model, sim.Setup(pattern="strided"), "streaming", 30.0)
    sequential = sim.utilization(model, sim.Setup(pattern="sequential"), "streaming", 30.0)
    assert strided > sequential


def test_fragments_and_schedule_follow_the_trainer():
    from opendiloco_stream.algorithm.fragments import fragment_offsets

    for H, P in [(100, 8), (100, 16), (100, 36), (30, 36), (20, 2), (7, 3)]:
        assert sim.fragment_offsets(H, P) == fragment_offsets(H, P)
    for pattern in sim.PATTERNS:
        frags = sim.fragment_blocks(24, 8, pattern)
        assert sorted(b for f in frags for b in f) == list(range(24))
        assert all(len(f) == 3 for f in frags)
    assert sim.fragment_blocks(24, 8, "strided")[1] == (1, 9, 17)
    assert sim.fragment_blocks(24, 8, "sequential")[1] == (3, 4, 5)
    assert sim.num_fragments(24, 3) == 8 and sim.num_fragments(25, 3) == 9


def test_default_step_times_reproduce_the_paper_anchors():
    for model in sim.PAPER_MODELS:
        tokens = sim.paper_tokens_per_step(model.params)
        assert sim.step_time_from_flops(model.params, tokens) == pytest.approx(model.step_time_s)
    # Between anchors the step time grows with size; a lower MFU makes steps longer.
    t3, t30 = (sim.step_time_from_flops(n, sim.paper_tokens_per_step(n)) for n in (3e9, 3e10))
    assert 0.1 < t3 < 0.8 < t30 < 4.9
    assert sim.step_time_from_flops(1e9, 1e4, mfu=0.3) == pytest.approx(
        2 * sim.step_time_from_flops(1e9, 1e4, mfu=0.6))


def test_invalid_model_values_raise():
    with pytest.raises(ValueError, match="params"):
        sim.Model(-1, 24, 0.1)
    with pytest.raises(ValueError, match="unknown method"):
        sim.utilization(TINY, TINY_SETUP, "gossip", 1.0)
    with pytest.raises(ValueError, match="target"):
        sim.required_bandwidth(TINY, TINY_SETUP, "diloco", 1.5)


# ---------------------------------------------------------------- the command


def test_json_sweep_has_required_keys_and_method_names(monkeypatch, capsys):
    assert _main(monkeypatch, ["--params", "1e10", "--targets", "95", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in records} == {
        "data-parallel", "diloco", "streaming", "streaming-overlap", "streaming-overlap-fp4", "eager-fp4"}
    for r in records:
        assert {"params", "method", "target_utilization", "required_gbit_s"} <= set(r)
        assert r["params"] == 10_000_000_000 and r["layers"] == 48
        assert r["target_utilization"] == pytest.approx(0.95)
        assert r["required_gbit_s"] > 0
    by_method = {r["method"]: r["required_gbit_s"] for r in records}
    assert by_method["data-parallel"] > by_method["eager-fp4"]


def test_default_run_prints_a_table_per_paper_model(monkeypatch, capsys):
    assert _main(monkeypatch, []) == 0
    out = capsys.readouterr().out
    for heading in ("1B params, 24 layers, step 0.1 s", "10B params, 48 layers, step 0.8 s",
                    "100B params, 108 layers, step 4.9 s"):
        assert heading in out
    for method in sim.METHODS:
        assert out.count(f"\n{method} ") == 3
    assert "50%" in out and "99%" in out


def test_fragments_sets_p_for_every_model_as_the_training_flag(monkeypatch, capsys):
    """``--fragments P`` is P itself (the training commands' flag), at most one per block;
    ``--fragment-layers K`` stays blocks per fragment; the same P gives the same prediction."""
    assert _main(monkeypatch, ["--fragments", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("fragments") >= 3 and "P=4 fragments" in out and "P=8 fragments" not in out
    small = ["--params", "4.2e6", "--layers", "4", "--step-time", "0.05", "--at-mbit", "10", "--json"]
    assert _main(monkeypatch, [*small, "--fragments", "2"]) == 0
    by_p = json.loads(capsys.readouterr().out)
    assert _main(monkeypatch, [*small, "--fragment-layers", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == by_p  # 4 blocks, 2 per fragment: P = 2 either way
    assert _main(monkeypatch, [*small, "--fragments", "9"]) == 0  # capped at one fragment per block
    capped = json.loads(capsys.readouterr().out)
    assert _main(monkeypatch, [*small, "--fragment-layers", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == capped
    assert capped != by_p


def test_at_mbit_predicts_utilization_for_a_measured_step_time(monkeypatch, capsys):
    argv = ["--params", "4.2e6", "--layers", "4", "--step-time", "0.05", "--inner-steps", "20",
            "--fragment-layers", "2", "--at-mbit", "5,20,100"]
    assert _main(monkeypatch, argv) == 0
    table = capsys.readouterr().out
    assert "5 Mbit/s" in table and "100 Mbit/s" in table and "eager-fp4" in table
    assert _main(monkeypatch, [*argv, "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == len(sim.METHODS) * 3
    for r in records:
        assert {"params", "method", "link_mbit", "utilization"} <= set(r)
        expected = sim.utilization(TINY, TINY_SETUP, r["method"], r["link_mbit"] / 1e3)
        assert r["utilization"] == pytest.approx(expected)
    eager = sorted((r["link_mbit"], r["utilization"]) for r in records if r["method"] == "eager-fp4")
    assert [u for _, u in eager] == sorted(u for _, u in eager)


def test_unreachable_target_prints_null_and_word(monkeypatch, capsys):
    argv = ["--params", "1e9", "--latency-ms", "1000", "--methods", "data-parallel", "--targets", "50"]
    assert _main(monkeypatch, [*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["required_gbit_s"] is None
    assert _main(monkeypatch, argv) == 0
    assert "unreachable" in capsys.readouterr().out


@pytest.mark.parametrize("argv,flag", [
    (["--params", "-5"], "--params"),
    (["--params=-1e9"], "--params"),
    (["--params", "lots"], "--params"),
    (["--methods", "diloco,gossip"], "gossip"),
    (["--params", "1e9", "--layers", "2.5"], "--layers"),
    (["--params", "3e9"], "--layers"),
    (["--layers", "24"], "--params"),
    (["--targets", "150"], "--targets"),
    (["--at-mbit", "0"], "--at-mbit"),
    (["--inner-steps", "0"], "--inner-steps"),
    (["--params", "1e9", "--step-time", "0.1", "--mfu", "0.5"], "--step-time"),
    (["--mfu", "1.5"], "--mfu"),
    (["--params", "4e6", "--layers", "2", "--fragment-layers", "3"], "--fragment-layers"),
    (["--fragments", "0"], "--fragments"),
])
def test_bad_values_exit_2_with_one_line(monkeypatch, capsys, argv, flag):
    assert _main(monkeypatch, argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opendiloco-stream simulate: error: ")
    assert flag in lines[0]


# ---------------------------------------------------------------- a round's cost by group size

COSTS = sim.GroupCosts(matchmaking_s=0.1, matchmaking_s_per_peer=0.01, exchange_s_per_byte=1e-9,
                       overhead_bytes_per_peer=100.0, reduce_s_per_element=2e-9, cpu_s_per_element=5e-8,
                       cpu_s_per_groupmate=0.02)


def test_group_round_adds_matchmaking_butterfly_bytes_and_reduce_by_hand():
    # 4 peers, 1M elements as 4 MB: each peer sends 2 * 3/4 * 4e6 + 3 * 100 bytes
    got = sim.group_round(COSTS, 4, payload_bytes=4e6, numel=1_000_000)
    assert got["bytes_sent"] == pytest.approx(6_000_300)
    assert got["matchmaking"] == pytest.approx(0.12)  # 0.1 + 2 peers beyond two * 0.01
    assert got["exchange"] == pytest.approx(6.0003e-3)
    assert got["reduce"] == pytest.approx(2e-3)  # N element-contributions whatever M
    assert got["round"] == pytest.approx(0.12 + 6.0003e-3 + 2e-3)
    assert got["cpu"] == pytest.approx(0.05 + 3 * 0.02)  # 1M elements * 5e-8 s, 3 groupmates * 0.02 s
    assert sim.butterfly_bytes(1, 4e6) == 0.0  # alone: nothing to send


def test_group_link_makes_the_simulator_charge_the_predicted_round():
    numel, payload = 1_000_000, 4e6
    for m in (2, 64, 256):
        setup, gbit_s = sim.group_link(COSTS, m, payload, numel)
        rnd = sim._round(sim.Model(params=numel, layers=1, step_time_s=1.0), setup, "streaming", gbit_s)
        assert rnd.comm_block + rnd.latency == pytest.approx(sim.group_round(COSTS, m, payload, numel)["round"])


def _measured(costs: sim.GroupCosts, sizes, cores=None, numel=1_000_000, payload=4e6):
    samples = []
    for m in sizes:
        got = sim.group_round(costs, m, payload, numel)
        slow = 1.0 if cores is None else max(1.0, m / cores)  # m peers sharing `cores` cores
        samples.append(dict(group_size=m, numel=numel, payload_bytes=payload, bytes_sent=got["bytes_sent"],
                            cpu=got["cpu"], **{k: slow * got[k] for k in ("matchmaking", "exchange", "reduce")}))
    return samples


@pytest.mark.parametrize("cores", [None, 2])
def test_fit_group_costs_recovers_the_costs_that_made_the_rounds(cores):
    fitted = sim.fit_group_costs(_measured(COSTS, (2, 4, 8, 16), cores), cores=cores)
    for name, value in vars(COSTS).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-9), name
    # and so predicts 256 peers as the costs themselves do
    assert sim.group_round(fitted, 256, 4e6, 1_000_000)["round"] == pytest.approx(
        sim.group_round(COSTS, 256, 4e6, 1_000_000)["round"])


def test_fit_group_costs_from_one_size_keeps_matchmaking_fixed():
    fitted = sim.fit_group_costs(_measured(COSTS, (4,)))
    assert fitted.matchmaking_s == pytest.approx(0.12) and fitted.matchmaking_s_per_peer == 0.0
    assert fitted.cpu_s_per_groupmate == 0.0 and fitted.cpu_s_per_element * 1e6 == pytest.approx(0.05 + 3 * 0.02)
    with pytest.raises(ValueError, match="at least one"):
        sim.fit_group_costs([])
    with pytest.raises(ValueError, match="exchange_s_per_byte"):
        sim.GroupCosts(0.1, 0.0, -1.0, 0.0, 0.0)


def test_fit_group_costs_takes_a_matchmaking_that_falls_with_size_as_fixed():
    samples = _measured(COSTS, (2, 4))
    samples[1]["matchmaking"] = samples[0]["matchmaking"] / 2  # noise: the bigger group matched faster
    fitted = sim.fit_group_costs(samples)
    assert fitted.matchmaking_s_per_peer == 0.0
    assert fitted.matchmaking_s == pytest.approx(0.75 * samples[0]["matchmaking"])  # their mean
