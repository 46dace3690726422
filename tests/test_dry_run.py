"""``peer --dry-run`` / ``local --dry-run``: the resolved configuration with origins, checked, nothing started.

The dry runs call the command line's ``main`` in this process (the fixture ``cli``): a new
process per case spent its time importing torch and transformers. One test runs the real
``python -m opendiloco_stream`` process, for what only a process shows: its exit code and that
nothing but the one error line reaches its stderr (no warning, no log line, no traceback).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from opendiloco_stream.cli import main
from tests.support.ports import free_port_range

ROOT = Path(__file__).resolve().parent.parent
REGIONS = ["us-east", "eu-west", "ap-southeast"]
BOOT = "/ip4/127.0.0.1/tcp/31337/p2p/QmSpTXmtPgEzk2VPGiLUtjqhHs7nYeMUesn9Uee7UM62C2"

Cli = Callable[..., subprocess.CompletedProcess]


def _process(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m opendiloco_stream ARGS`` in ``cwd`` with no ``ODS_`` variable but ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ODS_")}
    return subprocess.run([sys.executable, "-m", "opendiloco_stream", *args], capture_output=True, text=True,
                          timeout=180, cwd=cwd, env={**environ, **(env or {})})


@pytest.fixture
def cli(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """``cli(*args, env=..., cwd=...)``: what ``_process`` returns, from ``main(args)`` run in this
    process with the same environment and working directory (output captured at the descriptors)."""
    def run(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith("ODS_")]:
                m.delenv(key)
            for key, value in (env or {}).items():
                m.setenv(key, value)
            m.chdir(cwd)
            capfd.readouterr()
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's own errors
                code = e.code
            out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["opendiloco-stream", *args], code, out, err)
    return run


def _origins(stdout: str) -> dict[str, tuple[str, str]]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"^  ([a-z_]+\.[a-z_]+)\s+(.*?)\s+(default|file|env|flag)$", line)
        if m:
            out[m.group(1)] = (m.group(2), m.group(3))
    return out


@pytest.mark.parametrize("region", REGIONS)
def test_every_region_peer_file_passes_its_dry_run(region, tmp_path, cli):
    proc = cli("peer", "--config", str(ROOT / "peers" / f"{region}.toml"), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "dry run passed" in proc.stdout and "[FAIL]" not in proc.stdout
    origins = _origins(proc.stdout)
    assert origins["data.shard"][1] == "file" and origins["train.batch_size"][1] == "file"
    assert origins["diloco.fragment_pattern"] == ("strided", "default")
    for check in ("addresses", "identity", "ports", "model", "data", "device"):
        assert re.search(rf"\[(ok|warn)\]\s+{check} ", proc.stdout), check
    assert not (tmp_path / "keys").exists()  # a dry run creates no identity file (nothing is started)


def test_region_files_differ_as_real_peers_do():
    import tomllib

    files = {r: tomllib.loads((ROOT / "peers" / f"{r}.toml").read_text()) for r in REGIONS}
    for key in (("train", "batch_size"), ("net", "port"), ("net", "identity_path"), ("data", "shard")):
        values = [f[key[0]][key[1]] for f in files.values()]
        assert len(set(values)) == 3, (key, values)
    # they must agree on everything the peers average together
    assert len({repr((f["diloco"], f["model"], f["net"]["run_id"])) for f in files.values()}) == 1
    boot = tomllib.loads((ROOT / "peers" / "bootstrap.toml").read_text())
    assert all(f["net"]["initial_peers"][0].startswith(f"/ip4/{boot['net']['public_ip']}/tcp/{boot['net']['port']}/")
               for f in files.values())


def test_origins_follow_the_precedence_and_algorithm_presets_pass_with_an_initial_peer(tmp_path, cli):
    proc = cli("peer", "--config", str(ROOT / "peers" / "eager-fp4.toml"), "--initial-peers", BOOT,
                "--steps", "7", "--dry-run", env={"ODS_TRAIN__BATCH_SIZE": "4", "ODS_TRAIN__STEPS": "9"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    origins = _origins(proc.stdout)
    assert origins["train.steps"] == ("7", "flag")          # flag beats env
    assert origins["train.batch_size"] == ("4", "env")      # env beats file
    assert origins["diloco.codec"] == ("fp4-e3m0", "file")
    assert origins["net.initial_peers"] == (BOOT, "flag")
    assert origins["train.lr"][1] == "file" and origins["train.seed"] == ("0", "default")
    assert "[warn] identity" in proc.stdout  # no identity_path: said, not fatal


def test_local_dry_run(tmp_path, cli):
    proc = cli("local", "--workers", "3", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "shard 2/3" not in proc.stdout and "shard 0/3 gives batches of (8, 129)" in proc.stdout
    assert "addresses" not in proc.stdout


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_a_taken_port_fails_with_one_line(tmp_path):
    """In a real process: exit code 2 and the one error line are all its stderr holds."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _process("peer", "--config", str(ROOT / "peers" / "us-east.toml"), "--port", str(port), "--dry-run",
                    cwd=tmp_path)
        line = _one_line_error(proc)
    assert f"p2p port {port}/tcp is in use" in line and "[FAIL] ports" in proc.stdout
    # the other checks still ran and printed
    assert "[ok]   model" in proc.stdout


@pytest.mark.slow
def test_a_taken_data_port_fails_and_free_data_ports_are_listed(tmp_path, cli):
    base = free_port_range(4)  # below the ephemeral range: the other three stay free (tests/support/ports.py)
    with socket.socket() as s:  # us-east has 4 fragments: data ports base..base+3; take base+2
        taken = base + 2
        s.bind(("0.0.0.0", taken))
        s.listen()
        proc = cli("peer", "--config", str(ROOT / "peers" / "us-east.toml"), "--data-port", str(base), "--dry-run",
                    cwd=tmp_path)
        line = _one_line_error(proc)
    assert f"data port {taken}/tcp (net.data_port + fragment) is in use" in line and "--no-direct" in line, line
    free = cli("peer", "--config", str(ROOT / "peers" / "us-east.toml"), "--data-port", "45100", "--dry-run",
                cwd=tmp_path)
    assert free.returncode == 0 and "data 45100-45103 tcp free" in free.stdout, free.stdout + free.stderr
    p2p_only = cli("peer", "--config", str(ROOT / "peers" / "us-east.toml"), "--no-direct", "--dry-run", cwd=tmp_path)
    assert p2p_only.returncode == 0 and "data path: p2p daemon only (--no-direct)" in p2p_only.stdout
    assert _origins(p2p_only.stdout)["net.direct"] == ("False", "flag")


BAD = [
    (["--initial-peers", "127.0.0.1:31337"], "is not a valid multiaddr"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--dataset", "/no/such/dir"], "cannot load dataset"),
    (["--shard", "3/3"], "use R/W with 0 <= R < W"),
    (["--fragments", "12"], "exceeds the model's 9 transformer blocks"),
]


@pytest.mark.parametrize("args,expected", BAD)
def test_bad_settings_fail_with_one_line(tmp_path, args, expected, cli):
    proc = cli("peer", "--config", str(ROOT / "peers" / "eu-west.toml"), *args, "--dry-run", cwd=tmp_path)
    line = _one_line_error(proc)
    assert line.startswith("opendiloco-stream peer: error: dry run failed:") and expected in line, line
