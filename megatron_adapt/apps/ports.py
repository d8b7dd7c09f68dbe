"""A free local port for a rendezvous that the caller binds later.

Binding port 0 hands out a port from the kernel's ephemeral range, the same range that outgoing
connections and gloo's own listeners draw from; between picking such a port and rank 0 binding it,
another process (CI runs two suites side by side) can take it, and the run dies with EADDRINUSE.
So the port is drawn at random from below the ephemeral range, where only another explicit pick
can land, and checked bindable before it is handed out."""
from __future__ import annotations

import random
import socket

_FLOOR = 20000
_RANDOM = random.SystemRandom()  # not the global generator: Megatron and tests seed that one


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems fall back to binding port 0 below


def free_port() -> int:
    low = _ephemeral_low()
    if low - _FLOOR >= 1000:
        for _ in range(50):
            port = _RANDOM.randrange(_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
