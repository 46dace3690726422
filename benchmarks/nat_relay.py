"""Can two peers both behind NAT reach each other through the p2p daemon's circuit relay?

    python -m benchmarks.nat_relay --seconds 240 --out benchmarks/results/nat-relay.json

Builds :class:`benchmarks.harness.nat.NatTopology` with no public peer and two NATed ones, starts
a relay node in ``boot`` (a hivemind DHT with ``use_relay=True`` and ``force_reachability="public"``:
its p2pd serves circuit relay v2) and one hivemind DHT node per NATed namespace with
``use_auto_relay=True`` and ``force_reachability="private"`` (``--no-relay``: both off;
``--announce-circuit``: each also announces ``<relay address>/p2p-circuit`` itself). Each NATed
node pings the other by peer id (a hivemind DHT ping, what matchmaking's first request needs)
every 5 s for ``--seconds`` (on after a success, so that the other can still reach it), and notes when its p2pd reserved a relay slot (p2pd's autorelay log)
and whether it ever announced a ``/p2p-circuit`` address. The report says, per node, the first
ping that got through (None: none did). Results are in docs/networking.md ("Behind NAT").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.nat import NatTopology, exit_if_unavailable
from benchmarks.harness.peers import PeerProcesses
from benchmarks.harness.results import write_result

_NODE = r"""
import json, logging, os, sys, time
from functools import partial
import hivemind
from hivemind.p2p import PeerID

role, workdir, opts, seconds = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
events = open(os.path.join(workdir, role + ".jsonl"), "a", buffering=1)
t0 = time.monotonic()
def note(event, **kw):
    events.write(json.dumps({"t": round(time.monotonic() - t0, 1), "event": event, **kw}) + "\n")

class Reservations(logging.Handler):  # p2pd's log lines reach hivemind's logger (in the DHT process)
    def emit(self, record):
        if "adding new relay" in record.getMessage():
            note("reserved")
from hivemind.utils.logging import get_logger
get_logger("hivemind").addHandler(Reservations())

async def ping(dht, node, pid):
    return await node.protocol.call_ping(PeerID.from_base58(pid))

if role == "boot":
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{opts.pop('ip')}/tcp/0"], start=True, **opts)
    tmp = os.path.join(workdir, "boot.tmp")
    open(tmp, "w").write("\n".join(map(str, dht.get_visible_maddrs())))
    os.rename(tmp, os.path.join(workdir, "boot.addrs"))
    time.sleep(seconds + 60)
    sys.exit(0)
other = "n1" if role == "n0" else "n0"
while not os.path.exists(os.path.join(workdir, "boot.addrs")):
    time.sleep(0.2)
initial = open(os.path.join(workdir, "boot.addrs")).read().split()
if opts.pop("announce_circuit", False):  # announce "reach me through the relay" ourselves
    opts["announce_maddrs"] = [f"{initial[0]}/p2p-circuit"]
dht = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/0.0.0.0/tcp/0"], start=True, **opts)
tmp = os.path.join(workdir, role + ".tmp")
open(tmp, "w").write(str(dht.peer_id))
os.rename(tmp, os.path.join(workdir, role + ".id"))
note("up")
while not os.path.exists(os.path.join(workdir, other + ".id")):
    time.sleep(0.2)
pid = open(os.path.join(workdir, other + ".id")).read()
while time.monotonic() - t0 < seconds:
    circuit = [str(m) for m in dht.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)]
    ok = dht.run_coroutine(partial(ping, pid=pid)) is not None
    note("ping", ok=ok, circuit_addrs=circuit)
    time.sleep(5)  # on after a success too: the other node may still be trying to reach this one
dht.shutdown()
"""


def _summary(path: Path) -> dict:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    pings = [e for e in events if e["event"] == "ping"]
    first_ok = next((e["t"] for e in pings if e["ok"]), None)
    ok_after = [e["ok"] for e in pings if first_ok is not None and e["t"] >= first_ok]
    reserved = next((e["t"] for e in events if e["event"] == "reserved"), None)
    circuit = next((e["t"] for e in pings if e["circuit_addrs"]), None)
    return {"pings": len(pings), "first_ping_ok_s": first_ok, "relay_reserved_s": reserved,
            "circuit_addr_announced_s": circuit, "pings_ok_after_first": f"{sum(ok_after)}/{len(ok_after)}",
            "last_t": pings[-1]["t"] if pings else None}


def run(seconds: float, relay: bool, announce_circuit: bool = False) -> dict:
    """One trial: the relay node and the two NATed nodes; per node, when (if ever) a ping got through."""
    boot_opts = {"use_relay": relay, **({"force_reachability": "public"} if relay else {})}
    peer_opts = {"use_relay": relay, "use_auto_relay": relay, **({"force_reachability": "private"} if relay else {}),
                 "announce_circuit": announce_circuit}
    env = {"GOLOG_LOG_LEVEL": "warn,autorelay=debug", "HIVEMIND_LOGLEVEL": "DEBUG"}
    with tempfile.TemporaryDirectory(prefix="ods-nat-relay-") as workdir, NatTopology(public=0, natted=2) as topo:
        boot_opts["ip"] = topo.ip("boot")
        with PeerProcesses(Path(workdir), grace=5.0, topology=topo) as launched:  # stops them all on the way out
            procs = [launched.launch(node, [sys.executable, "-c", _NODE, node, workdir, json.dumps(opts), str(seconds)],
                                     node=node, env=env)
                     for node, opts in (("boot", boot_opts), ("n0", peer_opts), ("n1", peer_opts))]
            for p in procs[1:]:
                p.wait(seconds + 120)
        report = {"relay": relay, "announce_circuit": announce_circuit, "seconds": seconds,
                  **{n: _summary(Path(workdir) / f"{n}.jsonl") for n in ("n0", "n1")}}
        for node, p in zip(("boot", "n0", "n1"), procs):
            if p.returncode not in (0, None, -9, -15):  # the node's own summary (the relay node's: in errors)
                where = report.setdefault("errors", {}) if node == "boot" else report[node]
                where["error" if node != "boot" else node] = (Path(workdir) / f"{node}.log").read_text()[-600:]
        return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=240.0, help="how long each NATed node keeps pinging")
    ap.add_argument("--no-relay", action="store_true", help="relay off on every node (the baseline)")
    ap.add_argument("--announce-circuit", action="store_true",
                    help="each NATed node announces the relay's circuit address itself (announce_maddrs)")
    ap.add_argument("--out", type=Path, help="write the report (JSON) here")
    args = ap.parse_args(argv)
    exit_if_unavailable("nat_relay")
    t0 = time.monotonic()
    report = run(args.seconds, relay=not args.no_relay, announce_circuit=args.announce_circuit)
    rows = [{"node": n, **report.pop(n)} for n in ("n0", "n1")]
    errors = report.pop("errors", None)
    print(json.dumps({**report, "rows": rows, "errors": errors}, indent=2))
    if args.out:
        write_result(args.out, settings=report, rows=rows, benchmark="nat_relay", errors=errors,
                     wall_s=round(time.monotonic() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
