"""The averaging service's event loop: uvloop against asyncio's default loop, in the same run.

    python -m benchmarks.event_loop --out benchmarks/results/event-loop.json

What the service's loop does for a round's direct path (``transport/hivemind/direct.py``), on a
loopback TCP connection inside one loop made by ``service.new_loop``:

* ``bulk``: one sender writes ``--bulk-mib`` MiB as messages of 1 MiB (``write_message``), the
  other end reads them (``read_message``) and answers with the same bytes: MiB/s of the pair.
* ``pingpong``: ``--pings`` small messages (a frame's head, 64 bytes) back and forth, one at a
  time: microseconds per round trip, i.e. the loop's own cost per message and wake-up.

The kinds alternate (``--repeats`` times each, the order flipped every repeat) so a machine whose
load changes meanwhile weighs on both; medians are reported. Plaintext messages (no sealing): the
cost compared is the loop's, not AES-GCM's. A table is written next to the JSON (``.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

from opendiloco_stream.transport.hivemind.direct import read_message, write_message
from opendiloco_stream.transport.hivemind.protocol import Message
from opendiloco_stream.transport.hivemind.service import loop_kind, new_loop


async def _pair() -> tuple[socket.socket, socket.socket]:
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    client = socket.socket()
    client.setblocking(False)
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    await loop.sock_connect(client, listener.getsockname())
    server, _ = await accept
    listener.close()
    for s in (client, server):
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


async def bulk(mib: int) -> float:
    """MiB/s of ``mib`` MiB sent one way and echoed back, in 1 MiB messages."""
    client, server = await _pair()
    payload = bytes(1 << 20)

    async def echo() -> None:
        for _ in range(mib):
            msg = await read_message(server, 2 << 20)
            await write_message(server, Message(msg.code, b"", (bytes(msg.buffer),)))

    t0 = time.perf_counter()
    task = asyncio.ensure_future(echo())

    async def send() -> None:
        for _ in range(mib):
            await write_message(client, Message(1, b"", (payload,)))

    sender = asyncio.ensure_future(send())
    for _ in range(mib):
        await read_message(client, 2 << 20)
    await asyncio.gather(task, sender)
    elapsed = time.perf_counter() - t0
    client.close()
    server.close()
    return 2 * mib / elapsed


async def pingpong(n: int) -> float:
    """Microseconds per round trip of a 64-byte message, ``n`` of them one after the other."""
    client, server = await _pair()
    small = Message(1, b"", (bytes(64),))

    async def echo() -> None:
        for _ in range(n):
            await read_message(server, 1024)
            await write_message(server, small)

    task = asyncio.ensure_future(echo())
    t0 = time.perf_counter()
    for _ in range(n):
        await write_message(client, small)
        await read_message(client, 1024)
    elapsed = time.perf_counter() - t0
    await task
    client.close()
    server.close()
    return elapsed / n * 1e6


def on_loop(kind: str, bulk_mib: int, pings: int) -> dict:
    """One measurement of each on a fresh loop of ``kind``, run in a thread as the service runs it."""
    loop = new_loop(kind)
    out: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        out["bulk_mib_s"] = loop.run_until_complete(bulk(bulk_mib))
        out["pingpong_us"] = loop.run_until_complete(pingpong(pings))
        out["loop"] = loop_kind(loop)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    loop.close()
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bulk-mib", type=int, default=64)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kinds = ["asyncio", "uvloop"]
    samples: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(args.repeats):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            samples[kind].append(on_loop(kind, args.bulk_mib, args.pings))
    rows = {k: {"bulk_mib_s_median": round(statistics.median(s["bulk_mib_s"] for s in v), 1),
                "pingpong_us_median": round(statistics.median(s["pingpong_us"] for s in v), 1),
                "samples": v} for k, v in samples.items()}
    table = ["| loop | bulk, MiB/s (median) | ping-pong, us per round trip (median) |", "|---|---|---|"]
    table += [f"| {k} | {r['bulk_mib_s_median']} | {r['pingpong_us_median']} |" for k, r in rows.items()]
    print("\n".join(table))
    if args.out:
        result = {"command": "python -m benchmarks.event_loop " + " ".join(argv or []),
                  "bulk_mib": args.bulk_mib, "pings": args.pings, "repeats": args.repeats,
                  "note": "loopback TCP, plaintext direct-path messages, one loop per thread; the machine was "
                          "shared with other work (2 cores)", "loops": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))
        Path(args.out).with_suffix(".md").write_text(
            "# Event loop of the averaging service: uvloop vs asyncio (same run)\n\n"
            f"`python -m benchmarks.event_loop --out {args.out}` ({args.repeats} repeats each, alternating; "
            f"{args.bulk_mib} MiB echoed in 1 MiB messages; {args.pings} round trips of 64 B; loopback; "
            "2 shared cores with other work running)\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
