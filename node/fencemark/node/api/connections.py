"""How many connections the node holds open at once (``--max-connections``).

Each client or peer connection is one file descriptor. A process that runs out of
descriptors cannot accept the next connection, and its caller waits for an answer
that never comes — the one failure a limit must not have. So the node raises its
soft open-file limit as far as the hard one allows, fits ``--max-connections`` under
it (less ``KEPT_FILES`` for its store, logs, listeners and peers), and hands the
result to gRPC (``grpc.max_allowed_incoming_connections``): a connection beyond it
is closed as it comes, and the client sees ``UNAVAILABLE``, which it retries.
"""

from __future__ import annotations

import logging
import resource

MAX_CONNECTIONS = 10_000
KEPT_FILES = 256  # descriptors kept for everything but incoming connections

log = logging.getLogger(__name__)


def connection_limit(wanted: int) -> int:
    """``wanted`` connections, or as many as the open-file limit leaves room for
    (said once, at WARNING), after raising the soft limit up to the hard one."""
    if wanted < 1:
        raise ValueError(f"max_connections: at least 1, got {wanted}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + KEPT_FILES
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fits = max(1, soft - KEPT_FILES)
    log.warning(
        "max_connections lowered from %d to %d: the open-file limit is %d (hard %d);"
        " raise it (ulimit -n, LimitNOFILE=, docker --ulimit nofile=) for more",
        wanted, fits, soft, hard,
    )  # fmt: skip
    return fits
