"""Starting real peers from tests, and the registry of everything that starts one.

Every launcher a test can reach is registered with :func:`~tests.support.markers.launches_peers`
here, so that ``tests/conftest.py`` can fail collection for a test that starts peers without the
``network`` marker. A test module's own spawning helper registers itself with the same decorator.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import hivemind

from benchmarks.harness.gloo import GlooRanks
from benchmarks.harness.loopback import LoopbackSwarm
from benchmarks.harness.nat import NatTopology
from benchmarks.harness.netns import Topology
from benchmarks.harness.peers import PeerProcesses, train_peers, wait_for  # noqa: F401  (wait_for: for the tests)
from opendiloco_stream.commands.local_hivemind import start_bootstrap
from opendiloco_stream.net.dht import start_dht
from tests.support.markers import launches_peers

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--no-progress"]

for _launcher in (hivemind.DHT, start_dht, start_bootstrap, LoopbackSwarm, Topology, NatTopology, GlooRanks, PeerProcesses,
                  train_peers):
    launches_peers(_launcher)


@launches_peers
def start_peer(tmp: Path, name: str, addrs: list[str], *flags: str, env=None) -> subprocess.Popen:
    """A ``peer`` process of the tiny model in its own session, logging to ``tmp/NAME.log`` and
    writing metrics to ``tmp/NAME.jsonl``."""
    cmd = [sys.executable, "-m", "opendiloco_stream", "peer", "--initial-peers", *addrs, *SMALL, *flags,
           "--metrics-file", str(tmp / f"{name}.jsonl")]
    return subprocess.Popen(cmd, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "ODS_DILOCO__RECORD_DIGESTS": "true", **(env or {})})


#: the benchmarks that start peer processes (run through :func:`run_benchmark`)
PEER_BENCHMARKS = ("group_scaling", "join_state", "live_group", "monitor_page", "peer_memory", "prematch", "prometheus_scrape", "service_gil", "soak",
                   "straggler", "transport_rounds", "wan")


@functools.partial(launches_peers, when=PEER_BENCHMARKS)
def run_benchmark(name: str, *args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME ARGS`` from the repository root, output captured as text."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**env, **kwargs.pop("env", {})}, **kwargs)
