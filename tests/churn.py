"""Port churn: a process that keeps taking the kernel's ephemeral ports, for a bounded time.

It holds ``--hold`` sockets bound to port 0 on loopback (the kernel picks each from
its ephemeral range, as it does for an outgoing connection), and replaces the
oldest with a new one as fast as it can, so that at any moment thousands of
ephemeral ports are taken and which ones keeps changing. A server that picked
its port by binding port 0 and closing it, then bound it a second later, finds
it taken about as often as the held share of the range (``tests/test_ports.py``).

``python -m tests.churn --hold 3000 --seconds 60``; prints ``churning`` once it
holds them all, and ends by itself after ``--seconds``.
"""

from __future__ import annotations

import argparse
import collections
import resource
import socket
import sys
import time

LOOPBACK = "127.0.0.1"


def churn(hold: int, seconds: float) -> int:
    """Hold ``hold`` ephemeral ports, replacing the oldest, until ``seconds`` pass;
    returns how many ports were taken in all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hold + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, hold + 64), hard))
    held: collections.deque[socket.socket] = collections.deque()
    taken = 0
    deadline = time.monotonic() + seconds
    announced = False
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((LOOPBACK, 0))
        held.append(sock)
        taken += 1
        if len(held) > hold:
            held.popleft().close()
        if not announced and len(held) >= hold:
            print("churning", flush=True)
            announced = True
    for sock in held:
        sock.close()
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=int, default=3000, help="ports held at once")
    parser.add_argument("--seconds", type=float, default=60.0, help="when to stop")
    args = parser.parse_args()
    taken = churn(args.hold, args.seconds)
    print(f"took {taken} ports", file=sys.stderr)


if __name__ == "__main__":
    main()
