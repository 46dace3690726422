"""N real hivemind peers on 127.0.0.1, each in its own process: support for tests and benchmarks
(not part of the installed package; tests find it through tests/conftest.py).

    with LoopbackSwarm(3, transport_kwargs=dict(codec="fp4-e3m0", target_group_size=3)) as swarm:
        swarm.call_all("prepare", {0: 1000})
        results = swarm.call_all("all_reduce", (0, 0), seed=1, weight=1.0)

Each peer is a spawned process that starts its own session (so killing its process group takes
its DHT process and p2pd with it, as a machine failure would), creates a ``hivemind.DHT``
bootstrapped from peer 0 and a transport, then serves commands over a pipe (see ``_Peer``).
``LoopbackSwarm.close`` stops every peer and SIGKILLs the process group of any that lingers.
A shared ``signal`` event lets code running inside a peer (fault injection in tests) tell the
parent that something happened.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import time
import traceback
from typing import Any, Optional

import torch

from opendiloco_stream.net.lifecycle import kill_session

# What the transport is told 127.0.0.1 carries (one TCP stream moves ~28 Gbit/s here): it derives
# the chunk size (8 MiB) and the timeouts from it. ``--loopback-mbit 100`` gives the 1 MiB chunks
# of the rows measured before the chunk size was derived from the link.
LOOPBACK_MBIT = 10_000.0
START_AHEAD_S = 0.3  # a round's common start, this far after its command is sent

_SIGNAL = None  # the swarm's shared event, inside a peer process


def peer_signal():
    """Inside a peer: the swarm's shared ``multiprocessing.Event`` (fault-injection hooks set it)."""
    return _SIGNAL


def resolve(path: str) -> Any:
    """``"package.module:attr"`` -> the object."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_tensor(seed: int, numel: int, offset: float = 0.0) -> torch.Tensor:
    """The deterministic test tensor ``N(0, 1) + offset`` (peers and the parent build the same)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) + offset


# Functions a peer runs on request (``peer.call("call", "benchmarks.harness.loopback:NAME", ...)``).

def live_ahead(peer, fragment: int, round_index: int) -> int:
    """Inside a peer: the live peers announced for a round (its target if it launched it now)."""
    entries = peer.transport._presence._entries(fragment, round_index)
    return sum(1 for ahead, _ in entries.values() if ahead)


def expect(peer, fragment: int, round_index: int) -> None:
    """Inside a peer: what a joiner does after its state download (StreamingDiLoCo.load_state_dict)."""
    peer.transport.expect_rounds([(fragment, round_index)])


def matching_rounds(peer, fragment: int) -> list[int]:
    """Inside a peer: the rounds of ``fragment`` whose group its matchmaking is forming now."""
    return sorted(peer.transport._lanes[fragment].endpoint.matchmaker.rounds)


def peer_id(peer) -> str:
    """Inside a peer: its peer id (the subkey of its presence announcements)."""
    return peer.transport.peer_id


def serve_initial_marker(peer, rounds: list) -> None:
    """Inside a peer: serve joiners what a donor still at the initial model does
    (``StreamingDiLoCo._shared_state``): the marker, with the joiner reserved in ``rounds``."""
    keys = [tuple(k) for k in rounds]
    peer.transport.set_state_provider(lambda: {"step": 0, "initial": True,
                                               "reserved_at": peer.transport.reserve_rounds(keys)})


def expect_since(peer, fragment: int, round_index: int, since: float) -> None:
    """Inside a peer: a joiner that took the initial-model marker (``load_state_dict``)."""
    peer.transport.expect_rounds([(fragment, round_index)], since=since)


class _Peer:
    """The command loop inside a peer process."""

    def __init__(self, dht, transport):
        self.dht, self.transport = dht, transport
        self.last_average: Optional[torch.Tensor] = None

    def prepare(self, numels: dict) -> None:
        self.transport.prepare(numels)

    def prematch(self, key: tuple, weight: float = 1.0, wait_formed_s: float = 0.0) -> Optional[str]:
        """``Transport.prematch``; with ``wait_formed_s``, wait (bounded) until the group formed
        and waits for the round: returns the early group's state then (None if there is none)."""
        self.transport.prematch(tuple(key), weight)
        stage, deadline = None, time.monotonic() + wait_formed_s
        while time.monotonic() < deadline:
            stage = self.early_stage(key[0])
            if stage == "FORMED":
                break
            time.sleep(0.02)
        return stage

    def early_stage(self, fragment: int) -> Optional[str]:
        """The state of the fragment's group formed ahead (``HivemindTransport.early_group``)."""
        return self.transport.early_group(fragment)

    def all_reduce(self, key: tuple, tensor: Optional[torch.Tensor] = None, *, seed: int = 0, numel: int = 0,
                   offset: float = 0.0, weight: float = 1.0, wait_timeout: Optional[float] = None,
                   return_tensors: bool = True, abandon_after_s: Optional[float] = None,
                   digest_later: bool = False) -> dict:
        """One round. ``sha256``: the average's digest, taken here, or with ``digest_later`` by
        :meth:`digest` (a timed round: the first peer's hashing would compete with the peers still
        finishing theirs for the machine's cores)."""
        from opendiloco_stream.transport.base import SyncFailed

        if tensor is None:
            tensor = make_tensor(seed, numel, offset)
        t0 = time.perf_counter()
        handle = self.transport.all_reduce(tuple(key), tensor, weight=weight)
        launch_s = time.perf_counter() - t0
        abandoned = None
        if abandon_after_s is not None:  # give the round up after a while (a peer catching up)
            time.sleep(abandon_after_s)
            abandoned = handle.abandon()
        try:
            result = handle.wait(wait_timeout)
        except SyncFailed as e:
            return dict(ok=False, reason=e.reason, message=str(e), launch_s=launch_s, elapsed_s=time.perf_counter() - t0,
                        finished_at=time.time(), abandoned=abandoned)
        out = dict(ok=True, launch_s=launch_s, elapsed_s=time.perf_counter() - t0, finished_at=time.time(),
                   abandoned=abandoned,
                   group_size=result.group_size,
                   weight_share=result.weight_share, bytes_sent=result.bytes_sent,
                   bytes_received=result.bytes_received, peers=result.peers, included_self=result.included_self,
                   rejected=result.rejected, expected_size=result.expected_size, phases=result.phases)
        self.last_average = result.average
        if not digest_later:
            out["sha256"] = self.digest()
        if return_tensors:
            out.update(average=result.average, sent=result.sent)
        return out

    def digest(self) -> str:
        """sha256 of the last round's average (hashed in place)."""
        return hashlib.sha256(self.last_average.numpy()).hexdigest()

    def set_state_provider(self, factory: str, **kwargs) -> None:
        self.transport.set_state_provider(resolve(factory)(**kwargs))

    def load_state(self, timeout: float) -> dict:
        t0 = time.perf_counter()
        state = self.transport.load_state_from_peers(timeout)
        return dict(state=state, elapsed_s=time.perf_counter() - t0)

    def call(self, function: str, **kwargs) -> Any:
        return resolve(function)(self, **kwargs)


def _send(conn, obj: Any) -> None:
    # Plain pickle, not multiprocessing's: tensors travel by value instead of through torch's
    # shared-memory manager (hivemind selects "file_system" sharing, whose manager daemon outlives
    # the peer and holds its pipes open).
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn) -> Any:
    return pickle.loads(conn.recv_bytes())


def _enter_netns(name: str) -> None:
    """Move this process (and so everything it starts later: DHT, p2pd) into the network
    namespace ``/var/run/netns/<name>`` (``ip netns add``); needs root. Python 3.11 has no os.setns."""
    import ctypes

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def _peer_main(conn, index: int, initial_peers: list, transport_cls: str, transport_kwargs: dict, signal_event,
               netns: Optional[str] = None, host: str = "127.0.0.1") -> None:
    global _SIGNAL
    os.setsid()  # our own process group: DHT and p2pd die with us when the parent kills it
    if netns:
        _enter_netns(netns)
    mp.set_start_method("fork", force=True)  # a spawned child inherits 'spawn'; hivemind forks its DHT
    _SIGNAL = signal_event
    torch.set_num_threads(1)  # N peers share the machine's cores
    if os.environ.get("ODS_LOOPBACK_LOG"):  # e.g. ODS_LOOPBACK_LOG=INFO to see what peers do
        logging.basicConfig(level=os.environ["ODS_LOOPBACK_LOG"].upper(),
                            format=f"%(asctime)s peer{index} %(processName)s %(name)s %(levelname)s: %(message)s")
    import hivemind

    dht = transport = None
    try:
        try:
            dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial_peers or None)
            transport = resolve(transport_cls)(dht, **transport_kwargs)
        except BaseException as e:
            _send(conn, ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return
        _send(conn, ("ready", ([str(m) for m in dht.get_visible_maddrs()], str(dht.peer_id))))
        peer = _Peer(dht, transport)
        while True:
            method, args, kwargs = _recv(conn)
            if method == "close":
                break
            try:
                _send(conn, ("ok", getattr(peer, method)(*args, **kwargs)))
            except BaseException as e:
                _send(conn, ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        t0 = time.monotonic()
        if transport is not None:
            transport.close()
        t1 = time.monotonic()
        if dht is not None:
            dht.shutdown()
        logging.getLogger(__name__).info("peer %d closed: transport %.2fs, DHT %.2fs", index, t1 - t0,
                                         time.monotonic() - t1)
        _send(conn, ("closed", None))



class PeerError(RuntimeError):
    """A command raised inside a peer (the message carries its traceback)."""


class LoopbackPeer:
    """The parent's handle on one peer process."""

    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.maddrs: list[str] = []
        self.peer_id = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, method: str, *args, **kwargs) -> None:
        _send(self.conn, (method, args, kwargs))

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.index} did not answer within {timeout:.0f}s")
        status, value = _recv(self.conn)
        if status == "error":
            raise PeerError(f"peer {self.index}: {value}")
        return value

    def call(self, method: str, *args, timeout: float = 60.0, **kwargs) -> Any:
        self.send(method, *args, **kwargs)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL the peer's whole session at once (it is its own session leader): a crash."""
        kill_session(self.pid, timeout=10, hard=True)
        self.process.join(10)


class LoopbackSwarm:
    """Start ``n`` peers (peer 0 bootstraps the others); a context manager that always cleans up."""

    def __init__(self, n: int, *, transport_kwargs: dict, run_id: str = "loopback",
                 transport_cls: str = "opendiloco_stream.transport.hivemind:HivemindTransport",
                 peer_overrides: Optional[dict[int, dict]] = None, start_timeout: float = 90.0):
        self.n, self.run_id, self.transport_cls, self.transport_kwargs = n, run_id, transport_cls, transport_kwargs
        self.peer_overrides, self.start_timeout = peer_overrides or {}, start_timeout
        self.ctx = mp.get_context("spawn")
        self.signal = self.ctx.Event()
        self.peers: list[LoopbackPeer] = []

    def _spawn(self, overrides: dict) -> LoopbackPeer:
        index = len(self.peers)
        spec = dict(self.peer_overrides.get(index, {}), **overrides)
        cls = spec.pop("transport_cls", self.transport_cls)
        # peer-side options, not transport arguments: a network namespace to run in and the address
        # to listen on there (tests/test_faults.py), the addresses to bootstrap from (default: peer 0's)
        netns, host = spec.pop("netns", None), spec.pop("host", "127.0.0.1")
        initial = spec.pop("initial_peers", None)
        if initial is None:
            initial = self.peers[0].maddrs if self.peers else []
        kwargs = dict(self.transport_kwargs, run_id=self.run_id, **spec)
        parent, child = self.ctx.Pipe()
        process = self.ctx.Process(target=_peer_main, args=(child, index, initial, cls, kwargs, self.signal, netns, host),
                                   name=f"loopback-peer-{index}")  # not daemonic: it forks the DHT
        process.start()
        peer = LoopbackPeer(index, process, parent)
        self.peers.append(peer)
        return peer

    def _await_ready(self, peer: LoopbackPeer) -> LoopbackPeer:
        peer.maddrs, peer.peer_id = peer.recv(self.start_timeout)
        return peer

    def add_peer(self, **overrides) -> LoopbackPeer:
        """Start one more peer (joined to peer 0, or to ``initial_peers=[...]``), e.g. a late joiner;
        other ``overrides`` go to its transport."""
        return self._await_ready(self._spawn(overrides))

    def start(self) -> "LoopbackSwarm":
        try:
            self.add_peer()
            others = [self._spawn({}) for _ in range(1, self.n)]
            for peer in others:  # started concurrently: the imports dominate start-up
                self._await_ready(peer)
        except BaseException:
            self.close()
            raise
        return self

    def call_all(self, method: str, *args, timeout: float = 60.0, per_peer: Optional[list[dict]] = None,
                 peers: Optional[list[LoopbackPeer]] = None, **kwargs) -> list[Any]:
        """Send the same command to several peers at once, then collect the answers in order."""
        peers = self.peers if peers is None else peers
        for i, peer in enumerate(peers):
            peer.send(method, *args, **dict(kwargs, **(per_peer[i] if per_peer else {})))
        return [peer.recv(timeout) for peer in peers]

    def close(self, timeout: float = 20.0) -> None:
        for peer in self.peers:
            if peer.process.is_alive():
                try:
                    peer.send("close")
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for peer in self.peers:
            peer.process.join(max(0.1, deadline - time.monotonic()))
        for peer in self.peers:  # the session may hold orphans (p2pd, the DHT) even if the peer exited
            if peer.pid is not None:
                kill_session(peer.pid, timeout=5, hard=True)
            peer.process.join(5)

    def __enter__(self) -> "LoopbackSwarm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


#: ``SyncResult.phases`` -> where a round's time goes; a phase not listed (a renamed or new one) is "other"
PHASE_GROUPS = {
    "matchmaking": ("matchmaking",),
    "exchange": ("contributions", "verdicts", "results", "drain"),  # bytes moving between peers
    "reduce": ("reduce",),  # the peer's own part
    "host": ("prepare", "finish"),  # the copies into and out of the transport
}
GROUP_NAMES = (*PHASE_GROUPS, "other")


def group_phases(phases: dict[str, float]) -> dict[str, float]:
    """One peer's ``SyncResult.phases`` summed per :data:`PHASE_GROUPS` (every group present)."""
    owner = {phase: group for group, names in PHASE_GROUPS.items() for phase in names}
    out = dict.fromkeys(GROUP_NAMES, 0.0)
    for phase, seconds in phases.items():
        out[owner.get(phase, "other")] += seconds
    return out


def stage_tensor(peer, seed: int, numel: int) -> None:
    """Inside a peer (``LoopbackPeer.call``): draw the tensor of the next round."""
    peer.staged = make_tensor(seed, numel)


def reduce_staged(peer, key: tuple, weight: float, start_at: float, prematch: bool = False) -> dict:
    """Inside a peer: the round, on the staged tensor, started at ``start_at`` (``time.time()``,
    the same for every peer: a common start, as gloo's barrier). ``prematch``: the group forms
    ahead, from the command's arrival (``Transport.prematch``, as the trainer's ``prematch_steps``)."""
    if prematch:
        peer.transport.prematch(tuple(key), weight)
    time.sleep(max(0.0, start_at - time.time()))
    started = time.time()
    out = peer.all_reduce(tuple(key), peer.staged, weight=weight, return_tensors=False, digest_later=True)
    return dict(out, started_late_s=started - start_at)
