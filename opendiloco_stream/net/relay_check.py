"""Whether this machine's circuit relay carries a round: a self-test that ``bootstrap --relay`` runs.

hivemind's p2pd (go-libp2p-daemon, learning-at-home fork, shipped with hivemind 1.1.12) serves
circuit relay v2 twice on one hop protocol: the relay service configured from its flags
(``-relayDataLimit`` 4 GiB and ``-relayTimeLimit`` 30 minutes per relayed connection), started by
go-libp2p once the node is public, and a second one that ``EnableRelayV2`` starts with go-libp2p's
default resources (``relay.DefaultResources()``: 128 KiB per direction and 2 minutes per relayed
connection). Whichever registers its stream handler last serves every reservation and connection,
and the order is a race between two goroutines. When the default one wins, the relay resets each
relayed connection after 128 KiB (its log: ``relayed 131072 bytes from ...``), so no relayed
exchange of a round (hundreds of KB) ever completes, for the whole life of that relay.

:func:`probe_relay` tells the two apart from outside the daemon: two throwaway p2p daemons on this
machine, one holding a reservation on the relay and serving a stream handler, the other
connecting to it through the relay, send ``PROBE_BYTES`` (over 128 KiB) through one relayed stream.
``bootstrap --relay`` restarts its daemon (same identity, same port) until the probe passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib.resources
import logging
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from hivemind import hivemind_cli
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon import P2PD_FILENAME
from hivemind.utils.multiaddr import Multiaddr

from opendiloco_stream.config import NetConfig
from opendiloco_stream.net.dht import listen_maddrs, start_dht, stop_dht, visible_maddrs

logger = logging.getLogger(__name__)

DEFAULT_RELAY_DATA_LIMIT = 128 << 10  # go-libp2p's relay.DefaultResources().Limit.Data (v0.32)
PROBE_BYTES = 512 << 10  # through one relayed stream: 4x what the default relay lets through
PROBE_TIMEOUT_S = 30.0
PROBE_RETRIES = 5  # more probes of one start while a probe's daemons cannot reach the relay (1, 2, ... s apart)
RELAY_ATTEMPTS = 12  # starts of the relay's daemon before giving up (the race was lost at 50 of 102 starts
                     # in NAT runs on a loaded 2-core machine, up to 12 in a row for one relay)


class RelayVerdict(enum.Enum):
    CARRIES = "carries"  # the probe's bytes crossed the relay
    LIMITED = "limited"  # the relayed connection was reset before they did: go-libp2p's default limits
    UNKNOWN = "unknown"  # no relayed stream could be opened (the probe says nothing of the limit)


@dataclasses.dataclass(frozen=True)
class RelayProbe:
    """What :func:`probe_relay` saw: the verdict, the bytes that crossed, and why it stopped."""

    verdict: RelayVerdict
    moved_bytes: int
    seconds: float
    detail: str = ""


def _p2pd_path() -> Path:
    """The p2pd binary shipped in hivemind's package (where ``P2P.create`` finds it)."""
    return Path(str(importlib.resources.files(hivemind_cli) / P2PD_FILENAME))


class Daemon:
    """A p2pd started with exactly ``flags`` (``P2P.create`` passes a fixed set: the probe needs
    ``-relayDiscovery=0``, without which autorelay waits for 4 relay candidates or 3 minutes, and
    the tests ``-relayService=0``), driven through hivemind's public ``P2P.replicate``."""

    def __init__(self, proc: asyncio.subprocess.Process, p2p: P2P, drain: asyncio.Task, sock: Path):
        self.proc, self.p2p, self._drain, self._sock = proc, p2p, drain, sock

    @classmethod
    async def start(cls, flags: dict[str, Any], timeout: float = 20.0) -> "Daemon":
        sock = Path(tempfile.gettempdir()) / f"ods-p2pd-{secrets.token_hex(6)}.sock"
        argv = [str(_p2pd_path()), f"-listen=/unix{sock}",
                *(f"-{k}={int(v) if isinstance(v, bool) else v}" for k, v in flags.items())]
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            seen = []
            while True:  # p2pd prints its peer id once it serves its control socket
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
                if not line:
                    raise OSError(f"p2pd exited: {' '.join(seen[-3:])}")
                seen.append(line.decode(errors="replace").strip())
                if seen[-1].startswith("Peer ID:"):
                    break
            drain = asyncio.ensure_future(proc.stdout.read())  # never let its pipe fill up
            return cls(proc, await P2P.replicate(Multiaddr(f"/unix{sock}")), drain, sock)
        except BaseException:
            proc.kill()
            await proc.wait()
            sock.unlink(missing_ok=True)
            raise

    async def stop(self) -> None:
        await self.p2p.shutdown()
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._drain.cancel()
        self._sock.unlink(missing_ok=True)  # p2pd leaves its control socket behind


def local_relay_maddrs(visible: Sequence[str], host_maddrs: Sequence[str]) -> list[str]:
    """Where a process on this machine dials the relay: each TCP port it listens on, at the
    listening IP (127.0.0.1 for a wildcard ``0.0.0.0``), with the relay's ``/p2p/`` id taken from
    ``visible`` (its announced addresses may be a public IP this machine cannot reach itself)."""
    peer_id = Multiaddr(visible[0])["p2p"]
    ports = [Multiaddr(m)["tcp"] for m in visible if "tcp" in Multiaddr(m)]
    out = []
    for host in host_maddrs:
        h = Multiaddr(host)
        if "ip4" not in h or "tcp" not in h:
            continue
        ip = "127.0.0.1" if h["ip4"] == "0.0.0.0" else h["ip4"]
        for port in ([h["tcp"]] if h["tcp"] != "0" else ports):
            out.append(f"/ip4/{ip}/tcp/{port}/p2p/{peer_id}")
    return list(dict.fromkeys(out))


async def _probe(relay: Sequence[str], nbytes: int, timeout: float) -> RelayProbe:
    t0 = time.monotonic()
    deadline = t0 + timeout
    relay = list(relay)
    moved = [0]
    joined = ",".join(relay)
    target = await Daemon.start({"relay": True, "autoRelay": True, "relayDiscovery": False, "trustedRelays": joined,
                                 "forceReachabilityPrivate": True, "noListenAddrs": True, "b": True,
                                 "bootstrapPeers": joined, "dhtServer": True,
                                 "announceAddrs": ",".join(f"{m}/p2p-circuit" for m in relay)})
    dialer = None
    try:
        async def count(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while moved[0] < nbytes:
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        return
                    moved[0] += len(chunk)
                writer.write(b"ok")
                await writer.drain()
                await reader.read()  # until the dialer closes
            except OSError:
                pass

        await target.p2p.add_binary_stream_handler("ods-relay-probe", count)
        dialer = await Daemon.start({"relay": True, "forceReachabilityPrivate": True, "noListenAddrs": True, "b": True,
                                     "bootstrapPeers": joined, "dhtClient": True})
        last = ""
        while True:  # until the target's reservation is up and the dialer finds it through the relay
            try:
                _, reader, writer = await asyncio.wait_for(
                    dialer.p2p.call_binary_stream_handler(target.p2p.peer_id, "ods-relay-probe"), 5.0)
                break
            except Exception as e:
                last = repr(e)[:200]
                if time.monotonic() + 0.5 > deadline:
                    return RelayProbe(RelayVerdict.UNKNOWN, 0, time.monotonic() - t0, f"no relayed stream: {last}")
                await asyncio.sleep(0.5)
        try:
            writer.write(b"\0" * nbytes)
            await writer.drain()
            answer = await asyncio.wait_for(reader.readexactly(2), max(1.0, deadline - time.monotonic()))
            ok = answer == b"ok"
            return RelayProbe(RelayVerdict.CARRIES if ok else RelayVerdict.LIMITED, moved[0], time.monotonic() - t0,
                              "" if ok else f"answered {answer!r}")
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            await asyncio.sleep(0.2)  # the count of what arrived before the reset
            return RelayProbe(RelayVerdict.LIMITED, moved[0], time.monotonic() - t0, repr(e)[:200])
        finally:
            writer.close()
    finally:
        for daemon in (dialer, target):
            if daemon is not None:
                await daemon.stop()


def probe_relay(relay: Sequence[str], nbytes: int = PROBE_BYTES, timeout: float = PROBE_TIMEOUT_S) -> RelayProbe:
    """Send ``nbytes`` through one connection relayed by the relay at ``relay`` (its multiaddrs,
    dialable from here) and say whether they crossed (see the module docstring). Blocking; runs
    its own event loop; the two daemons it starts are shut down before it returns. A probe that
    cannot start its daemons is ``UNKNOWN``, with the reason."""
    t0 = time.monotonic()
    try:
        return asyncio.run(_probe(relay, nbytes, timeout))
    except Exception as e:  # e.g. P2PDaemonError: a helper daemon did not reach the relay
        return RelayProbe(RelayVerdict.UNKNOWN, 0, time.monotonic() - t0, repr(e)[:200])


def pin_port(host: Sequence[str], visible: Sequence[str]) -> list[str]:
    """``host`` with a random TCP port (``/tcp/0``) replaced by the one the node got, so a restart
    listens where the first start did (the address already printed stays valid)."""
    port = next((Multiaddr(m)["tcp"] for m in visible if "tcp" in Multiaddr(m)), None)
    return [m.replace("/tcp/0", f"/tcp/{port}") if port and m.endswith("/tcp/0") else m for m in host]


def start_relay(net: NetConfig, attempts: int = RELAY_ATTEMPTS, **dht_kwargs: Any) -> tuple[Any, RelayProbe]:
    """Start ``net``'s DHT node as a circuit relay and probe it (:func:`probe_relay`); while it
    resets relayed connections at go-libp2p's default limits, restart it with the same identity
    (a temporary key where ``net`` has none) and the same port, up to ``attempts`` starts. Returns
    the node and the last probe (``LIMITED`` after ``attempts``: the caller says so)."""
    host, _ = listen_maddrs(net)
    with tempfile.TemporaryDirectory(prefix="ods-relay-") as tmp:
        if not net.identity_path:  # the same /p2p/ id across restarts, for this process's life
            net = net.model_copy(update={"identity_path": str(Path(tmp) / "relay.key")})
        for attempt in range(1, attempts + 1):
            dht = start_dht(net, **dht_kwargs)
            visible = visible_maddrs(dht)
            local = local_relay_maddrs(visible, host)
            probe = probe_relay(local)
            for retry in range(PROBE_RETRIES):  # a helper daemon that came too early fails to reach the relay
                if probe.verdict is not RelayVerdict.UNKNOWN:
                    break
                logger.info("relay self-test inconclusive (%s): once more", probe.detail)
                time.sleep(1.0 + retry)
                probe = probe_relay(local)
            if probe.verdict is not RelayVerdict.LIMITED or attempt == attempts:
                return dht, probe
            logger.warning("the relay reset a relayed connection after %d bytes (p2pd serves go-libp2p's default "
                           "limits: 128 KiB and 2 minutes per relayed connection): restarting its p2p daemon "
                           "(start %d of %d)", probe.moved_bytes, attempt + 1, attempts)
            stop_dht(dht)
            host = pin_port(host, visible)
            net = net.model_copy(update={"host_maddrs": host})
    raise AssertionError("unreachable")
