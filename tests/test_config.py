"""One config tree: TOML < environment < flags; unknown keys are errors."""

from __future__ import annotations

import argparse

import pytest

from opendiloco_stream.commands._common import add_training_flags, config_from_args
from opendiloco_stream.config import ConfigError, load_config


def parse(argv):
    p = argparse.ArgumentParser()
    add_training_flags(p)
    return p.parse_args(argv)


def test_precedence_file_then_env_then_flags(tmp_path, monkeypatch):
    f = tmp_path / "peer.toml"
    f.write_text('[diloco]\ninner_steps = 40\nnum_fragments = 4\ncodec = "int8"\n[train]\nsteps = 7\n')
    monkeypatch.setenv("ODS_DILOCO__NUM_FRAGMENTS", "2")
    monkeypatch.setenv("ODS_TRAIN__STEPS", "9")
    cfg = config_from_args(parse(["--config", str(f), "--steps", "11"]))
    assert cfg.diloco.inner_steps == 40      # file
    assert cfg.diloco.codec == "int8"        # file
    assert cfg.diloco.num_fragments == 2     # env beats file
    assert cfg.train.steps == 11             # flag beats env


def test_unknown_keys_are_errors_everywhere(tmp_path, monkeypatch):
    f = tmp_path / "bad.toml"
    f.write_text("[diloco]\ninner_stepz = 3\n")
    with pytest.raises(ConfigError, match=r"\[diloco\] inner_stepz in .*bad.toml: unknown key: did you mean inner_steps\?"):
        load_config(str(f))
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(None, environ={"ODS_NOPE__X": "1"})
    with pytest.raises(ConfigError, match="ODS_TRAIN__STEPZ: unknown key: did you mean ODS_TRAIN__STEPS"):
        load_config(None, environ={"ODS_TRAIN__STEPZ": "1"})


def test_a_bad_value_names_the_flag_the_variable_or_the_file_it_came_from(tmp_path):
    """The error says where the user typed the value: the flag, the environment variable or the
    file's key, with the value, not the config tree's dotted name."""
    with pytest.raises(ConfigError, match=r"--steps 0: Input should be greater than or equal to 1"):
        load_config(None, {"train": {"steps": 0}}, environ={})
    with pytest.raises(ConfigError, match=r"ODS_TRAIN__STEPS=-3: Input should be greater than or equal to 1"):
        load_config(None, environ={"ODS_TRAIN__STEPS": "-3"})
    with pytest.raises(ConfigError, match=r"--fragments 0: .*must be >= 1 or 'auto'"):
        load_config(None, {"diloco": {"num_fragments": 0}}, environ={})
    f = tmp_path / "x.toml"
    f.write_text("[train]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match=r"\[train\] lr = -1.0 in .*x.toml: Input should be greater than 0"):
        load_config(str(f), environ={})


def test_cross_field_errors_name_the_fields():
    with pytest.raises(ConfigError, match="overlap_steps"):
        load_config(None, {"diloco": {"mode": "overlap", "overlap_steps": 0}})


def test_knobs_of_another_eager_rule_are_refused_not_ignored():
    """eager_estimate and eager_correction drive the 'corrected' rule only: set away from their
    defaults under another eager rule (the default 'merge' included) the run would silently ignore
    them, so the config is refused with the fix; the defaults, and other modes, pass."""
    with pytest.raises(ConfigError, match="eager_correction = 'next-sync' applies to eager_rule 'corrected' only, "
                                          "and this run's rule is 'merge': add --eager-rule corrected"):
        load_config(None, {"diloco": {"mode": "eager", "eager_correction": "next-sync"}})
    with pytest.raises(ConfigError, match="eager_estimate = 'own' and eager_correction = 'next-sync' apply"):
        load_config(None, {"diloco": {"mode": "eager", "eager_rule": "paper", "eager_estimate": "own",
                                      "eager_correction": "next-sync"}})
    knobs = {"eager_estimate": "own", "eager_correction": "next-sync"}
    assert load_config(None, {"diloco": {"mode": "eager", "eager_rule": "corrected", **knobs}}).diloco.eager_estimate == "own"
    assert load_config(None, {"diloco": {"mode": "blocking", **knobs}}).diloco.mode == "blocking"
    assert load_config(None, {"diloco": {"mode": "eager", "eager_correction": "on-arrival"}}).diloco.eager_rule == "merge"


def test_shipped_peer_configs_are_valid():
    from pathlib import Path

    files = sorted((Path(__file__).parent.parent / "peers").glob("*.toml"))
    assert files, "peers/ ships example configs"
    for f in files:
        load_config(str(f))


def test_data_parallel_runs_as_one_process_per_peer_checked_in_one_place():
    """The rule lives in config.check_data_parallel; RunConfig, the rank launcher, the rank wrapper
    and algorithm.wrap all call it, so the refusal reads the same wherever it is hit."""
    from opendiloco_stream.config import check_data_parallel

    dp = {"diloco": {"mode": "data-parallel"}}
    with pytest.raises(ConfigError, match=r"one process per peer, not as several ranks \(--nproc-per-node 1"):
        load_config(overrides={**dp, "train": {"nproc_per_node": 2}}, environ={})
    with pytest.raises(ConfigError, match="one process per peer, not with train.sharding 'fsdp'"):
        load_config(overrides={**dp, "train": {"nproc_per_node": 2, "sharding": "fsdp"}}, environ={})
    assert load_config(overrides=dp, environ={}).train.nproc_per_node == 1
    sharded = load_config(overrides={"train": {"nproc_per_node": 2, "sharding": "fsdp"}}, environ={})
    assert sharded.train.sharding == "fsdp"  # the streaming modes may shard
    check_data_parallel("data-parallel")  # one process, whole model: fine
    for mode in ("blocking", "overlap", "eager"):
        check_data_parallel(mode, ranked=True, sharded=True)  # the rule is data-parallel's only
    with pytest.raises(ConfigError, match="not as several ranks"):
        check_data_parallel("data-parallel", ranked=True)
