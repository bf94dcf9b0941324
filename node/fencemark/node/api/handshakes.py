"""Connections that have not authenticated yet: kept out of the process, then bounded.

Every port a node listens on (clients, peers, the dashboard, metrics) is open to
anyone who can reach it, before any certificate is shown. Three rules keep such
connections from holding what authenticated ones need (docs/security.md,
*Connection floods*):

- **Nothing until the client speaks.** gRPC, HTTP and TLS clients send first. Each
  listening socket has ``TCP_DEFER_ACCEPT``: the kernel completes a connection for
  the node only once its first bytes arrive, and keeps one that sends nothing in its
  own queue of half-open connections — no descriptor, no slot of the port's bound —
  for about ``DEFER_ACCEPT_S`` (then hands it over, and the handshake deadline ends
  it).
- **A deadline for the handshake.** A connection that spoke gets
  ``--handshake-timeout`` seconds (gRPC's ``grpc.server_handshake_timeout_ms``; the
  dashboard's own TLS handshake) to complete it, then it is closed.
- **A bound on connections in handshake**, on the ports the node accepts itself
  (the dashboard, metrics): ``PendingGate``, per source address and in all, below the
  port's bound. On a gRPC port gRPC accepts; its one bound counts connections in
  handshake too, which the deadline empties.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # --handshake-timeout's default
DEFER_ACCEPT_S = 30  # how long the kernel keeps a connection that has sent nothing
# The listen backlog of the ports the node opens itself (gRPC's own is the kernel's
# maximum, somaxconn): it also bounds how many silent connections the kernel keeps
# waiting for their first bytes. Beyond it, new ones are SYN-cookied and handed over
# at once, to the handshake deadline and the bounds below.
BACKLOG = socket.SOMAXCONN
PENDING_PER_SOURCE = 8  # connections in handshake from one address (dashboard, metrics)
PENDING_TOTAL = 32  # ... from all addresses


def defer_accept(sock: socket.socket, seconds: int = DEFER_ACCEPT_S) -> None:
    """Have the kernel hand ``sock``'s connections over only once they carry data."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, seconds)


def defer_listeners(port: int, seconds: int = DEFER_ACCEPT_S) -> int:
    """``defer_accept`` on every socket of this process listening on TCP ``port``
    (gRPC's, which it opens itself); how many there were."""
    found = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))  # a second handle on the same socket
        except OSError:
            continue  # closed meanwhile, or not ours to read
        with sock:
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if sock.type != socket.SOCK_STREAM or not listening:
                    continue
                if sock.getsockname()[1] != port:
                    continue
                defer_accept(sock, seconds)
            except OSError:
                continue
            found += 1
    return found


@dataclass
class PendingGate:
    """Connections accepted but not yet authenticated, bounded per source address
    and in all. ``admit`` answers whether one more may start its handshake; each
    admitted connection is ``done`` once, handshake finished or failed."""

    per_source: int = PENDING_PER_SOURCE
    total: int = PENDING_TOTAL
    refused: int = 0  # connections closed at once, since the start
    _by_source: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def pending(self) -> int:
        return sum(self._by_source.values())

    def admit(self, source: str) -> bool:
        if self._by_source[source] >= self.per_source or self.pending >= self.total:
            self.refused += 1
            return False
        self._by_source[source] += 1
        return True

    def done(self, source: str) -> None:
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]
