"""Loopback ports for servers whose address a test must know before they start.

A port found by binding port 0 and closing it again belongs to nobody until the
server binds it, and meanwhile the kernel may hand it to anyone who binds port 0 or
connects out — with tests running side by side (``make test`` runs pytest-xdist
workers), another worker's node. So each test process draws from a range of its
own, below the kernel's ephemeral range (which port 0 and outgoing connections take
from: 32768-60999 on Linux), and checks each port free before handing it out. Two
workers never draw the same port; one worker hands a port out again only after its
whole range (``SPAN``) went round.

In-process nodes that need no fixed address listen on ``127.0.0.1:0`` instead: the
kernel picks and binds in one step, with no window at all.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import threading

LOOPBACK = "127.0.0.1"
FIRST = 12000  # above the well-known services a test machine may run
SPAN = 1500  # ports per test process: 13 ranges fit below 32768
RANGES = (32768 - FIRST) // SPAN


def _worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` → 3); 0 outside xdist."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) % RANGES if match else 0


_start = FIRST + _worker_index() * SPAN
_candidates = itertools.cycle(range(_start, _start + SPAN))
_lock = threading.Lock()


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_ports(count: int, *, consecutive: bool = False) -> list[int]:
    """``count`` distinct ports of this process's range, each free right now.

    ``consecutive`` asks for a run of neighbours (``fencemark cluster --base-port``).
    """
    with _lock:
        ports: list[int] = []
        for _ in range(SPAN + count):
            candidate = next(_candidates)
            if consecutive and ports and candidate != ports[-1] + 1:
                ports = []  # the range went round
            if _free(candidate):
                ports.append(candidate)
                if len(ports) == count:
                    return ports
            elif consecutive:
                ports = []
    raise RuntimeError(f"no {count} free ports in {_start}-{_start + SPAN - 1}")


def free_port() -> int:
    """One port of this process's range, free right now."""
    (port,) = free_ports(1)
    return port
