"""The Dockerfile and compose file are real and complete; without a Docker engine here they are
validated statically: the commands they run exist, the files they copy exist, the config they use
loads."""

from __future__ import annotations

import re
import shlex
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


def test_compose_services_run_real_commands_with_valid_flags():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"bootstrap", "peer-a", "peer-b", "monitor"} <= set(services)
    parser = build_parser()
    for name, svc in services.items():
        if "command" in svc:
            argv = list(svc["command"])
        else:
            script = svc["entrypoint"][-1]
            argv = shlex.split(script.replace("$$(head -n1 /identity/bootstrap.addrs)", "/ip4/10.0.0.1/tcp/31337/p2p/QmX"))
            assert argv[:2] == ["exec", "opendiloco-stream"], name
            argv = argv[2:]
        assert argv[0] in COMMANDS, name
        parser.parse_args(argv)  # raises SystemExit on an unknown flag
        if "--config" in argv:
            load_config(str(ROOT / argv[argv.index("--config") + 1]))
    assert services["peer-a"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / services["peer-a"]["build"]["context"].replace("..", ".")).exists()
