"""Free TCP ports for tests that hand a port to a process started later.

A port the kernel hands out for ``bind(port 0)`` lies in its ephemeral range
(``net.ipv4.ip_local_port_range``, 32768-60999 by default), the range every ``connect()`` and
every ``/tcp/0`` listener of another process draws from too: between the check and the later
bind, the other test worker's peers can take it (a fresh-clone suite saw a peer fail with
"cannot listen on data port 33323/tcp (Address already in use)"). These are drawn at random below
that range instead, where only an explicit bind can take them, and checked by binding each.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # above the ports services usually listen on
_draw = random.SystemRandom()  # not the test's seeded ``random``: two workers draw apart


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int, host: str = "0.0.0.0") -> int:
    """A base port with ``count`` consecutive TCP ports free on ``host``, below the ephemeral range."""
    high = ephemeral_low() - count
    if high <= LOWEST:
        raise RuntimeError(f"the ephemeral port range starts at {ephemeral_low()}: no room below it for "
                           f"{count} ports from {LOWEST}")
    for _ in range(200):
        base = _draw.randrange(LOWEST, high)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found between {LOWEST} and {high + count}")


def free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on ``host``, below the ephemeral range."""
    return free_port_range(1, host)
