"""scripts/setup.sh (the README's first command) installs the main job only, and chooses torch by
the machine: an installed torch is kept; without one, the CPU build where no NVIDIA driver is
present, a CUDA build where one is (``nvidia-smi`` on PATH or /proc/driver/nvidia); ODS_TORCH
overrides. The choice is checked on a venv without pip, so nothing is downloaded: the script says
which build it picks, then fails to install it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_setup_installs_no_system_package_and_test_sh_adds_the_test_tools():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    code = "\n".join(line for line in setup.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(apt-get|apt|dpkg|yum|dnf|sudo)\b", code)
    assert '-m pip install -q -e . ' in code  # the package alone: no test, bench or logger extra
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert '".[test,bench]"' in test and "missing+=(prometheus)" in test and "missing+=(nftables)" in test
    assert "bash scripts/setup.sh" in (ROOT / "scripts" / "test.sh").read_text()


def _setup(venv: Path, path_dirs: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ODS_VENV": str(venv), "PATH": os.pathsep.join(path_dirs), **env})


@pytest.fixture
def bare_venv(tmp_path):
    """A venv without pip (and so without torch): the script's install attempts fail at once."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv


BASE_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="this machine has an NVIDIA driver")
def test_no_driver_no_torch_picks_the_cpu_build(bare_venv):
    proc = _setup(bare_venv, BASE_PATH)
    assert "installing torch==2.13.0, CPU build (no NVIDIA driver here" in proc.stderr, proc.stderr
    assert "did not serve it: trying pip's own configuration" in proc.stderr, proc.stderr
    assert proc.returncode != 0 and "torch install failed" in proc.stderr


def test_a_driver_and_no_torch_picks_a_cuda_build_and_the_variable_overrides(bare_venv, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # a stand-in: this machine has no NVIDIA driver
    (fake / "nvidia-smi").chmod(0o755)
    proc = _setup(bare_venv, [str(fake), *BASE_PATH])
    assert "installing torch==2.13.0, CUDA build cu128 (an NVIDIA driver is present" in proc.stderr, proc.stderr
    assert proc.returncode != 0
    proc = _setup(bare_venv, [str(fake), *BASE_PATH], ODS_TORCH="cpu")
    assert "CPU build" in proc.stderr, proc.stderr
    proc = _setup(bare_venv, BASE_PATH, ODS_TORCH="cuda", ODS_TORCH_CUDA="cu126")
    assert "CUDA build cu126" in proc.stderr, proc.stderr
    proc = _setup(bare_venv, BASE_PATH, ODS_TORCH="gpu")
    assert proc.returncode == 2 and "ODS_TORCH=gpu: use auto, cpu, cuda or pip" in proc.stderr, proc.stderr


def test_an_installed_torch_is_kept():
    """The test's own venv has torch and the package: the script checks and changes nothing."""
    venv = Path(sys.prefix)
    proc = _setup(venv, [str(venv / "bin"), *BASE_PATH], PYTHONPATH=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "installing" not in proc.stderr and "[setup] ready: torch" in proc.stderr, proc.stderr
