"""Peer processes for benchmarks and tests: ``opendiloco_stream`` commands (``bootstrap``, ``peer``,
``monitor``, ``local``) each in its own session, logging to a work directory, and stopped through
:mod:`opendiloco_stream.net.lifecycle` (SIGTERM, a grace period, then every process of the session).

The three ways the benchmarks start peers are this module (command processes on 127.0.0.1 or,
with a :class:`~benchmarks.harness.netns.Topology`, inside network namespaces), the loopback
transports of :mod:`benchmarks.harness.loopback` (a transport per process, driven over a pipe),
and the in-process ``LocalSwarm`` of the package itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Optional, Sequence

from benchmarks.harness import netns
from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes
from opendiloco_stream.train.loop import read_metrics

#: the tiny model on one thread, no progress bars: what the benchmarks' peers train
TINY = ["--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--threads", "1", "--no-progress"]


RELAY_START_S = 300.0  # bootstrap --relay: up to 12 starts of its daemon, each with a self-test, on a loaded machine


class PeerProcesses:
    """Command processes of one run; a context manager that stops every one of them on exit.

    With a ``topology`` (:class:`~benchmarks.harness.netns.Topology` or a subclass), ``node=``
    starts a process inside that node's namespace, and stopping also empties the namespaces used:
    a helper process (p2pd) whose parent died is no longer in the parent's process tree.
    """

    def __init__(self, workdir: Path, *, grace: float = 10.0, topology: Optional[netns.Topology] = None):
        self.workdir, self.grace, self.topology = Path(workdir), grace, topology
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.addrs: list[str] = []
        self.nodes: set[str] = set()  # namespaces of the topology that a process was started in
        self._logs: list[IO] = []

    def bootstrap(self, run_id: str, *flags: str, node: Optional[str] = None, timeout: float = 60.0,
                  name: str = "bootstrap") -> list[str]:
        """Start a ``bootstrap`` node and return its multiaddrs; ``run.peer`` passes those of every
        bootstrap started so far on (a second one, e.g. another relay, gets its own ``name``).

        On 127.0.0.1, or with ``node`` inside that namespace, listening on the node's address.
        Raises ``RuntimeError`` with the end of its log when no address comes within ``timeout``."""
        if node is None:
            boot, addrs = start_bootstrap(self.workdir, run_id, timeout)
            self.procs.append(boot)
            self.addrs = self.addrs + addrs
            return addrs
        if "--relay" in flags:  # a relay tests itself and restarts while p2pd serves 128 KiB (net/relay_check.py)
            timeout = max(timeout, RELAY_START_S)
        addr_file = self.workdir / f"{name}.addrs"
        proc = self.start(name, ["bootstrap", "--run-id", run_id, "--addr-file", str(addr_file),
                                 "--host-maddrs", f"/ip4/{self.topology.ip(node)}/tcp/0", *flags], node=node)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if addr_file.exists() and addr_file.read_text().strip():  # written atomically by the bootstrap
                addrs = addr_file.read_text().split()
                self.addrs = self.addrs + addrs
                return addrs
            time.sleep(0.1)
        log = (self.workdir / f"{name}.log").read_text()[-800:]
        raise RuntimeError(f"{name} did not come up in {timeout:g} s: {log}")

    def start(self, name: str, command: Sequence[str], *, node: Optional[str] = None,
              prefix: Sequence[str] = (), env: Optional[dict] = None, stdout: Any = None) -> subprocess.Popen:
        """``python -m opendiloco_stream COMMAND...`` as ``name`` (log: ``workdir/NAME.log``).

        ``node``: run inside that namespace of the topology; ``prefix``: argv run before python
        (e.g. entering a cgroup) that ``exec``s it."""
        return self.launch(name, [*prefix, sys.executable, "-m", "opendiloco_stream", *command], node=node, env=env,
                           stdout=stdout)

    def launch(self, name: str, argv: Sequence[str], *, node: Optional[str] = None, env: Optional[dict] = None,
               stdout: Any = None) -> subprocess.Popen:
        """Any ``argv`` as ``name``, in its own session (log: ``workdir/NAME.log``), inside the
        topology's namespace ``node`` if given: stopped with the others by :meth:`stop`."""
        argv = list(argv)
        if node is not None:
            argv = self.topology.exec_argv(node, argv)
            self.nodes.add(node)
        out = stdout
        if out is None:  # the child keeps its own copy of the descriptor; ours is closed on stop
            out = open(self.workdir / f"{name}.log", "w")
            self._logs.append(out)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def peer(self, name: str, *flags: str, **kwargs) -> subprocess.Popen:
        """A ``peer`` of this run's bootstrap writing metrics to ``workdir/NAME.jsonl``."""
        return self.start(name, ["peer", "--initial-peers", *self.addrs, *flags, "--metrics-file",
                                 str(self.workdir / f"{name}.jsonl")], **kwargs)

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> None:
        """Wait for ``procs`` to exit; raise with the end of its log when one fails."""
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                name = Path(getattr(p.stdout, "name", "") or "").name or str(p.args)
                log = self.workdir / name if name.endswith(".log") else None
                tail = log.read_text()[-2000:] if log and log.exists() else ""
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")

    def records(self, name: str) -> list[dict]:
        return read_metrics(self.workdir / f"{name}.jsonl")

    def stop(self, procs: Optional[Sequence[subprocess.Popen]] = None, grace: Optional[float] = None) -> None:
        """SIGTERM (peers stop at a safe point), wait ``grace``, then kill their process trees.

        Stopping every process (``procs`` None) also kills whatever is left in the namespaces
        used (p2pd, DHT processes, anything orphaned) and closes the log files."""
        stop_processes(list(self.procs if procs is None else procs), grace=self.grace if grace is None else grace)
        if procs is None:
            if self.topology is not None and self.nodes:
                netns.kill_namespace_processes([self.topology.ns(n) for n in sorted(self.nodes)])
            for log in self._logs:
                log.close()
            self._logs = []

    def __enter__(self) -> "PeerProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def train_peers(workdir: Path, run_id: str, per_peer: Sequence[Sequence[str]], *, common: Sequence[str] = (),
                timeout: float = 600.0, prefixes: Optional[dict[int, Sequence[str]]] = None,
                envs: Optional[dict[int, dict]] = None) -> list[list[dict]]:
    """Train one ``peer`` per entry of ``per_peer`` (its own flags, after ``common``) over a fresh
    bootstrap until each exits; their metrics records. ``prefixes``: peer index -> argv before
    python; ``envs``: peer index -> extra environment (e.g. ``opendiloco_stream.testing.faults.env``)."""
    with PeerProcesses(workdir) as run:
        run.bootstrap(run_id)
        peers = [run.peer(f"peer-{i}", "--run-id", run_id, *common, *flags, prefix=(prefixes or {}).get(i, ()),
                          env=(envs or {}).get(i)) for i, flags in enumerate(per_peer)]
        run.wait(peers, timeout)
        return [run.records(f"peer-{i}") for i in range(len(peers))]


def wait_for(pred: Callable[[], bool], timeout: float, what: str, procs: Iterable[subprocess.Popen] = ()) -> None:
    """Poll ``pred`` until true; fail when ``timeout`` passes or one of ``procs`` exits non-zero."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{what}: a process exited with {p.returncode}")
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
