"""A port to hand to another program (torchrun's ``--master_port``, a lab's ``--port``): free now, and not one the
system hands to anyone meanwhile.

Asking the system for a free port (binding port 0) and closing it leaves a gap before the other program binds the
number, and the system gives numbers of that same range to every port-0 bind and outgoing connection of the
machine: on a busy machine another process's connection can take it in the gap, and then the program fails to
bind it, or worse, connects to that process's listener and waits for a rendezvous that never comes. A number below
that range is taken only by a process that asks for it by number.
"""

from __future__ import annotations

import random
import socket

#: the ports tried, below Linux's default ephemeral range (32768-60999) and macOS's (49152-65535)
RANGE = (20000, 32767)


def ephemeral_range() -> tuple[int, int]:
    """The ports the system picks from for port-0 binds and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = map(int, fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 65535   # no /proc (macOS: 49152-65535; older systems and Windows start at 32768 or above)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now, outside the system's ephemeral range when that leaves any."""
    low, high = ephemeral_range()
    pick = random.Random()
    for _ in range(64):
        port = pick.randint(*RANGE)
        if low <= port <= high:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every number tried is taken or ephemeral here: the system's choice
        s.bind((host, 0))
        return s.getsockname()[1]
