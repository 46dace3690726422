"""Bad input, walked over every subcommand: a bad flag value, an unknown flag, a missing value and a
missing required argument each print one error line naming the flag, the value and the fix (then
``usage: opendiloco-stream COMMAND --help``), exit with code 2, and never show a traceback.

In-process through ``cli.main`` (argparse's exits are SystemExit(2)); one subprocess case checks the
real console output end to end."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from opendiloco_stream.cli import COMMANDS, build_parser, main

# (argv, what the one line must say): per subcommand, values that are wrong for its flags
CASES = [
    (["local", "--codec", "fp5"], ["--codec", "'fp5'", "fp4-e3m0", "did you mean"]),
    (["local", "--steps", "x"], ["--steps", "'x'", "an integer"]),
    (["local", "--alpha", "half"], ["--alpha", "'half'", "a number"]),
    (["local", "--steps", "0", "--dry-run"], ["--steps 0", "greater than or equal to 1"]),
    (["local", "--fragments", "0", "--dry-run"], ["--fragments 0", ">= 1 or 'auto'"]),
    (["local", "--workers", "0"], ["--workers", ">= 1"]),
    (["local", "--mode", "overlap", "--overlap-steps", "0", "--dry-run"], ["overlap_steps >= 1"]),
    (["local", "--link-mbit", "5"], ["link rate", "--link-step-s"]),
    (["local", "--no-such-flag"], ["unknown flag", "'--no-such-flag'", "local --help"]),
    (["local", "--inner-step", "5", "--inner-stepz", "4"], ["unknown flag", "'--inner-stepz'", "did you mean --inner-steps?"]),
    (["local", "--mode"], ["--mode", "needs a value"]),
    (["peer", "--codec", "fp4"], ["--codec", "'fp4'", "fp4-e3m0", "did you mean"]),
    (["peer", "--port", "99999", "--dry-run"], ["--port 99999", "less than or equal to 65535"]),
    (["peer", "--log-level", "LOUD"], ["--log-level", "'LOUD'", "DEBUG"]),
    (["peer", "--request-timeout", "5", "--dry-run"], ["request_timeout", "--matchmaking-time"]),
    (["peer", "--initial-peers", "nowhere"], ["'nowhere'", "not a valid multiaddr", "/ip4/"]),
    (["peer"], ["--initial-peers", "bootstrap"]),
    (["bootstrap", "--port", "x"], ["--port", "'x'", "an integer"]),
    (["bootstrap", "--relay=yes"], ["--relay", "takes no value"]),
    (["bootstrap", "--bogus"], ["unknown flag", "'--bogus'"]),
    (["doctor", "--timeout", "soon"], ["--timeout", "'soon'", "a number"]),
    (["doctor", "--bogus"], ["unknown flag", "'--bogus'"]),
    (["monitor", "--interval", "fast"], ["--interval", "'fast'", "a number"]),
    (["monitor", "--bogus"], ["unknown flag", "'--bogus'"]),
    (["simulate", "--params", "lots"], ["--params", "lots"]),
    (["simulate", "--fragment-pattern", "zigzag"], ["--fragment-pattern", "'zigzag'", "strided"]),
    (["simulate", "--targets", "150"], ["--targets", "150"]),
    (["export"], ["missing", "--checkpoint-dir", "--out"]),
    (["export", "--checkpoint-dir", "/nonexistent-ods", "--out", "/tmp/x", "--rank", "one"], ["--rank", "'one'", "an integer"]),
    (["sample"], ["missing", "--model", "--prompt"]),
    (["sample", "--model", "m", "--prompt", "p", "--top-k", "many"], ["--top-k", "'many'", "an integer"]),
    (["frobnicate"], ["COMMAND", "'frobnicate'", "local"]),
]


def test_every_subcommand_is_walked():
    assert {argv[0] for argv, _ in CASES} >= set(COMMANDS)


@pytest.mark.parametrize("argv, says", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_naming_flag_value_and_fix(argv, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("opendiloco-stream peer: note",))]
    assert code == 2, err
    assert "Traceback" not in err
    assert 1 <= len(lines) <= 2, err
    if len(lines) == 2:
        assert lines[1] == f"usage: opendiloco-stream {argv[0] if argv[0] in COMMANDS else ''}".rstrip() + " --help", err
    assert lines[0].startswith("opendiloco-stream") and ": error: " in lines[0], err
    for word in says:
        assert word in lines[0], (word, lines[0])


def test_every_flag_of_every_subcommand_has_help_text():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, p in sub.choices.items() for a in p._actions
               if a.option_strings and not (a.help and a.help.strip())]
    assert missing == []


def test_a_deprecated_spelling_still_works_with_a_notice(capsys):
    args = build_parser().parse_args(["local", "--link-mbps", "5", "--link-step-s", "0.1"])
    assert args.link_mbps == 5.0
    assert "--link-mbps is deprecated" in capsys.readouterr().err
    args = build_parser().parse_args(["peer", "-v"])
    assert args.log_level == "DEBUG"
    args = build_parser().parse_args(["simulate", "--pattern", "sequential"])
    assert args.pattern == "sequential"
    assert build_parser().parse_args(["bootstrap", "--no-relay"]).relay is False


def test_the_console_shows_one_line_and_the_usage_hint():
    proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", "peer", "--codec", "fp4"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "opendiloco-stream peer: error: --codec 'fp4' is not one of: fp32, fp16, bf16, int8, fp8-e4m3, fp4-e3m0, "
        "fp4-e2m1, topk-int2, topk-int4 (did you mean fp4-e3m0?)",
        "usage: opendiloco-stream peer --help"]
