"""One config source: every field is a flag (names, help, defaults, choices from the tree), the old
flag names keep working, each value says where it came from, and the reference doc is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from opendiloco_stream.cli import build_parser
from opendiloco_stream.compression import CODEC_NAMES
from opendiloco_stream.config import MODES, ConfigError, RunConfig, load_config
from opendiloco_stream.config_cli import config_from_args, config_reference, flag_specs

ROOT = Path(__file__).resolve().parent.parent

# Every flag of the training commands before flags were generated, with a value and where it lands.
LEGACY_TRAINING = [
    ("--mode", "overlap", "diloco.mode", "overlap"), ("--fragments", "2", "diloco.num_fragments", 2),
    ("--fragment-pattern", "sequential", "diloco.fragment_pattern", "sequential"),
    ("--inner-steps", "40", "diloco.inner_steps", 40), ("--tau", "3", "diloco.overlap_steps", 3),
    ("--alpha", "0.25", "diloco.alpha", 0.25), ("--outer-lr", "0.4", "diloco.outer_lr", 0.4),
    ("--outer-momentum", "0.8", "diloco.outer_momentum", 0.8), ("--codec", "fp4-e3m0", "diloco.codec", "fp4-e3m0"),
    ("--block-size", "32", "diloco.codec_block_size", 32), ("--scale-dtype", "fp32", "diloco.codec_scale_dtype", "fp32"),
    ("--stochastic-rounding", None, "diloco.stochastic_rounding", True),
    ("--error-feedback", None, "diloco.error_feedback", True), ("--weighting", "equal", "diloco.weighting", "equal"),
    ("--sync-timeout", "12.5", "diloco.sync_timeout", 12.5), ("--model", "35M", "model.name", "35M"),
    ("--seq-len", "64", "model.seq_len", 64), ("--dataset", "x.jsonl", "data.dataset", "x.jsonl"),
    ("--dataset-config", "c", "data.dataset_config", "c"), ("--text-field", "body", "data.text_field", "body"),
    ("--tokenizer", "tok", "data.tokenizer", "tok"), ("--steps", "9", "train.steps", 9),
    ("--batch-size", "4", "train.batch_size", 4), ("--lr", "0.001", "train.lr", 0.001),
    ("--warmup-steps", "5", "train.warmup_steps", 5), ("--eval-every", "3", "train.eval_every", 3),
    ("--seed", "7", "train.seed", 7), ("--device", "cpu", "train.device", "cpu"),
    ("--metrics-file", "m.jsonl", "train.metrics_file", "m.jsonl"), ("--checkpoint-dir", "ck", "train.checkpoint_dir", "ck"),
    ("--checkpoint-every", "4", "train.checkpoint_every", 4), ("--resume", None, "train.resume", True),
]
LEGACY_PEER = [
    ("--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "net.initial_peers", ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]),
    ("--run-id", "r1", "net.run_id", "r1"), ("--port", "31337", "net.port", 31337),
    ("--public-ip", "203.0.113.7", "net.public_ip", "203.0.113.7"),
    ("--host-maddrs", "/ip4/0.0.0.0/tcp/1", "net.host_maddrs", ["/ip4/0.0.0.0/tcp/1"]),
    ("--announce-maddrs", "/ip4/1.2.3.4/tcp/1", "net.announce_maddrs", ["/ip4/1.2.3.4/tcp/1"]),
    ("--identity-path", "id.key", "net.identity_path", "id.key"), ("--client-mode", None, "net.client_mode", True),
    ("--link-mbit", "20", "net.link_mbit", 20.0), ("--matchmaking-time", "4", "net.matchmaking_time", 4.0),
    ("--allreduce-timeout", "30", "net.allreduce_timeout", 30.0), ("--target-group-size", "3", "net.target_group_size", 3),
    ("--window-s", "60", "net.window_s", 60.0), ("--metrics-port", "0", "net.metrics_port", 0),
    ("--shard", "1/3", "data.shard", "1/3"),
]


def value(cfg: RunConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def parse(command: str, argv: list[str]):
    return build_parser().parse_args([command, *argv])


@pytest.mark.parametrize("command, flags", [("local", LEGACY_TRAINING), ("peer", LEGACY_TRAINING + LEGACY_PEER)])
def test_every_existing_flag_name_still_sets_its_field(command, flags):
    argv = [x for flag, v, _, _ in flags for x in ([flag] if v is None else [flag, v])]
    cfg, sources = config_from_args(parse(command, argv), return_sources=True)
    for flag, _, dotted, expected in flags:
        assert value(cfg, dotted) == expected, flag
        assert sources.of(dotted) == "flag", flag
    assert sources.of("diloco.alpha") == "flag" and sources.of("net.run_key") == "default"


def test_aliases_and_the_monitor_and_bootstrap_subsets():
    assert value(config_from_args(parse("local", ["--num-fragments", "3"])), "diloco.num_fragments") == 3
    assert value(config_from_args(parse("local", ["--overlap-steps", "2"])), "diloco.overlap_steps") == 2
    assert value(config_from_args(parse("local", ["--no-resume"])), "train.resume") is False
    args = parse("monitor", ["--initial-peers", "/ip4/1.2.3.4/tcp/5/p2p/QmX", "--run-id", "r"])
    assert vars(args)["net.run_id"] == "r"
    with pytest.raises(SystemExit):  # monitor does not listen: no --port
        parse("monitor", ["--port", "1"])
    parse("bootstrap", ["--port", "31337", "--identity-path", "b.key", "--public-ip", "1.2.3.4"])


def test_every_field_is_a_flag_with_its_default_and_choices_from_the_one_list(capsys):
    specs = {s.dest: s for s in flag_specs()}
    hidden = {"net.run_key"}  # a secret on the command line would show in the process list
    fields = {f"{s}.{n}" for s, f in RunConfig.model_fields.items() for n in f.annotation.model_fields}
    assert set(specs) == fields - hidden  # a new field is a new flag, with nothing else to write
    assert specs["diloco.codec"].argparse_kwargs()["choices"] == CODEC_NAMES
    assert specs["diloco.mode"].argparse_kwargs()["choices"] == MODES
    with pytest.raises(SystemExit):
        parse("peer", ["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tau TAU" in help_text and "(default: 100)" in help_text and "--no-client-mode" in help_text
    assert "{" + ",".join(CODEC_NAMES) + "}" in help_text


def test_sources_say_default_file_env_or_flag(tmp_path):
    f = tmp_path / "peer.toml"
    f.write_text('[diloco]\ninner_steps = 40\ncodec = "int8"\n[train]\nsteps = 7\n')
    cfg, sources = load_config(str(f), {"train": {"steps": 11}}, environ={"ODS_DILOCO__CODEC": '"fp16"'},
                               return_sources=True)
    assert (cfg.diloco.inner_steps, cfg.diloco.codec, cfg.train.steps) == (40, "fp16", 11)
    assert sources.of("diloco.inner_steps") == "file"
    assert sources.of("diloco.codec") == "env"  # env beats file
    assert sources.of("train.steps") == "flag"  # flag beats file
    assert sources.of("model.name") == "default"
    assert set(sources.values()) == {"default", "file", "env", "flag"}
    assert load_config(str(f), environ={}) == cfg.model_copy(update={"diloco": cfg.diloco.model_copy(
        update={"codec": "int8"}), "train": cfg.train.model_copy(update={"steps": 7})})  # plain call: config only
    with pytest.raises(ConfigError):
        load_config(None, {"diloco": {"codec": "fp5"}}, environ={}, return_sources=True)


def test_the_configuration_reference_is_generated_and_up_to_date():
    assert (ROOT / "docs" / "configuration.md").read_text() == config_reference(), \
        "run: python scripts/gen_config_docs.py"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_config_and_its_flags_load_without_torch():
    code = ("import sys, opendiloco_stream.config_cli as c; c.flag_specs(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
