"""System tools some tests need (promtool, nft): outside CI a missing one skips the test with the
line that installs it; under ``CI=true`` it fails, so CI never goes green by skipping."""

from __future__ import annotations

import os
import shutil

import pytest

#: what installs each tool (scripts/test.sh runs these as root)
INSTALL = {
    "promtool": "apt-get install prometheus (scripts/test.sh does it as root)",
    "prometheus": "apt-get install prometheus (scripts/test.sh does it as root)",
    "nft": "apt-get install nftables (scripts/test.sh does it as root)",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require_tool(tool: str) -> str:
    """The path of ``tool``; missing: skip with the install line, or fail under CI=true."""
    path = shutil.which(tool)
    if path:
        return path
    message = f"{tool} is missing: {INSTALL[tool]}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing tool is a failure, not a skip)", pytrace=False)
    pytest.skip(message)
