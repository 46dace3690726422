"""The NAT topology for tests (:mod:`benchmarks.harness.nat`), and starting a run's nodes in it."""

from __future__ import annotations

import time

from benchmarks.harness.nat import NatTopology, unavailable_reason  # noqa: F401 (re-exported)
from benchmarks.harness.peers import PeerProcesses


def start_bootstrap(run: PeerProcesses, topo: NatTopology, run_id: str, *flags: str, timeout: float = 60.0) -> list[str]:
    """A ``bootstrap`` node in ``boot`` (listening on its public address) started through ``run``;
    the multiaddrs it wrote to its address file, which ``run.peer`` then passes as initial peers."""
    addr_file = run.workdir / "bootstrap.addrs"
    proc = run.start("bootstrap", ["bootstrap", "--run-id", run_id, "--addr-file", str(addr_file),
                                   "--host-maddrs", f"/ip4/{topo.ip('boot')}/tcp/0", *flags], node="boot")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if addr_file.exists() and addr_file.read_text().strip():  # written atomically by the bootstrap
            run.addrs = addr_file.read_text().split()
            return run.addrs
        time.sleep(0.1)
    raise RuntimeError(f"bootstrap did not come up in {timeout:g} s: {(run.workdir / 'bootstrap.log').read_text()[-800:]}")


def listen_flags(topo: NatTopology, node: str) -> list[str]:
    """A public peer listens on its bridge address; a private one on every interface (the default
    for remote initial peers), so what it announces is its private address, as behind a real NAT."""
    return [] if node in topo.private else ["--host-maddrs", f"/ip4/{topo.ip(node)}/tcp/0"]
