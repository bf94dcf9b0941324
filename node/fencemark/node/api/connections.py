"""How many connections the node holds open at once (``--max-connections``).

Each client or peer connection is one file descriptor. A process that runs out of
descriptors cannot accept the next connection, and its caller waits for an answer
that never comes — the one failure a limit must not have. So the node raises its
soft open-file limit as far as the hard one allows, fits ``--max-connections`` under
it (less ``KEPT_FILES`` for its store, logs, listeners and peers), and hands the
result to gRPC (``grpc.max_allowed_incoming_connections``): a connection beyond it
is closed as it comes, and the client sees ``UNAVAILABLE``, which it retries.

Calls that arrive faster than the node's one event loop takes them wait in gRPC's
queue of pending requests, whose default (1,000) cancels the oldest beyond it: a
fleet whose agents all call at once (1,500 holders claiming together) saw
``CANCELLED`` for calls the node never got to refuse. The queue is sized to the
connections instead — one call of each waits its turn — so the node's own bounds
(``fencemark.node.api.budgets``) answer them, each refusal a clear, retryable one.

Peers dial in on the peer listener when the node has one (``--peer-listen``): a
second gRPC server, serving replication and health only, with a bound of its own
(``--max-peer-connections``), so clients holding every client connection cannot
keep a peer out (docs/operations.md, *A listener for peers*). Without one, peers
count against the same bound as clients (gRPC has one quota per server): clients
holding every connection keep a peer from dialling in, and the peer's rounds with
this node wait for a connection to close (docs/security.md).
"""

from __future__ import annotations

import logging
import resource

MAX_CONNECTIONS = 10_000
MAX_PEER_CONNECTIONS = 256  # on the peer listener: a few per peer, and room to spare
KEPT_FILES = 256  # descriptors kept for everything but incoming connections
GRPC_PENDING = 1_000  # gRPC's own queue of pending calls, never lowered

log = logging.getLogger(__name__)


def connection_limit(wanted: int, reserved: int = 0) -> int:
    """``wanted`` connections, or as many as the open-file limit leaves room for
    (said once, at WARNING), after raising the soft limit up to the hard one.
    ``reserved`` descriptors (the peer listener's bound) come first."""
    if wanted < 1:
        raise ValueError(f"max_connections: at least 1, got {wanted}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    kept = KEPT_FILES + reserved
    needed = wanted + kept
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fits = max(1, soft - kept)
    log.warning(
        "max_connections lowered from %d to %d: the open-file limit is %d (hard %d);"
        " raise it (ulimit -n, LimitNOFILE=, docker --ulimit nofile=) for more",
        wanted, fits, soft, hard,
    )  # fmt: skip
    return fits


def connection_options(wanted: int, reserved: int = 0) -> list[tuple[str, int]]:
    """The gRPC server options that bound connections to ``wanted`` (as far as the
    open-file limit lets, ``reserved`` descriptors kept aside) and size the queue of
    pending calls to them."""
    allowed = connection_limit(wanted, reserved)
    pending = max(GRPC_PENDING, allowed)  # one call of each connection waits its turn
    return [
        ("grpc.max_allowed_incoming_connections", allowed),
        ("grpc.server.max_pending_requests", pending),
        ("grpc.server.max_pending_requests_hard_limit", 3 * pending),  # gRPC's ratio
    ]


def peer_connection_options(wanted: int) -> list[tuple[str, int]]:
    """The peer listener's bound: ``wanted`` connections, never lowered (its
    descriptors are reserved before the clients' bound is fitted)."""
    if wanted < 1:
        raise ValueError(f"max_peer_connections: at least 1, got {wanted}")
    return [("grpc.max_allowed_incoming_connections", wanted)]
