"""Replication's bounds, pauses and channel options: each constant with why it is
what it is, and ``Tuning``, the ones a node may be given (``NodeConfig.replication``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_FRONTIER = 1024  # tree nodes descended into per level and round
# A differing node is listed rather than descended into when listing it costs
# less than asking for its 16 children: a listed record costs about ENTRY_BYTES, a
# child CHILD_BYTES, and only the records that differ are worth listing — their
# share is estimated from how many nodes differ at that level (after a partition
# most records do: listing wins; a few scattered changes: descending does).
ENTRY_BYTES = 60  # key, digest, max_hlc and framing of one BucketEntry
CHILD_BYTES = 6  # a 4-byte check value and a count
SALT_BYTES = 8  # of each round's salt for check values (digest_tree.CHECK_BYTES)
MAX_ROUND_RECORDS = 32768  # records listed per round; the rest waits for the next
# A round that differs but pulls nothing found a peer that is behind: it pulls what it
# lacks in its own rounds, and until then each round with it would list the same
# differences again (docs/performance.md, *Repair bytes*). Such a peer gets no round
# from this node for this long; should it hold something this node lacks after all
# (an older write concurrent with a newer one), that waits this much longer.
BEHIND_PAUSE_S = 5.0
# A round lists a large difference a chunk at a time, the first of FIRST_LISTING
# records; once BEHIND_AFTER differing records have turned out to be all the peer's
# to pull, the rest is not listed (a peer that is behind after a partition would
# otherwise cost its bystanders a listing of everything that differs).
FIRST_LISTING = 1024
BEHIND_AFTER = 32
PUSH_QUEUE_LIMIT = 100_000  # keys waiting per peer; beyond this anti-entropy repairs
# A peer that no call has reached (UNAVAILABLE, DEADLINE_EXCEEDED) for this many
# attempts in a row and this many seconds has its push queue dropped, and no keys
# are queued for it until it is reached again: once back, it pulls what it missed
# in its own rounds. Pushing the backlog as well would deliver every state twice
# (docs/performance.md, *Repair bytes*). Short blips, and peers still starting,
# keep their queue; a peer that answers but refuses (clock skew) keeps it too.
UNREACHABLE_AFTER = 3
UNREACHABLE_AFTER_S = 5.0
# A push that does not reach the peer keeps at most this many keys queued for it: a
# short blip's few writes are pushed once it is back, a larger backlog is left to
# the peer's own pulls, which its round would otherwise fetch beside the pushes
# (docs/performance.md, *Small-K repair*).
KEPT_PUSH_LIMIT = 128
# A failing peer is retried after FIRST_BACKOFF_S doubling up to MAX_BACKOFF_S,
# jittered by 0.5x-1.5x.
# Kept short: after a symmetric partition neither side calls the other until a
# back-off ends, so this bounds how long a healed link lies idle (docs/performance.md).
# A call to a peer that is down costs one refused connection attempt.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 2.0
# A life of a calling node id not heard for this long has ended (replication.lives):
# far above the back-off, so a twin that is refused and backs off is still
# remembered when it calls again, and the survivor of a pair of twins is
# heard alone again this long after the other one stopped.
TWIN_FORGET_S = 30.0
# A live node calls every peer at least this often — a root-only Tree call when no
# round or push went out meanwhile — so each peer hears each of its lives within it.
# A restarted node decides only after a round with each peer that began
# HEARTBEAT_S + 2 x max_clock_offset + SETTLE_SLACK_S after that peer first answered
# it: were another live process still calling with its node id (a twin), the peer
# would have heard both lives overlap by then and refuse the round (replication.lives).
HEARTBEAT_S = 1.0
# The heartbeat's own lateness in a busy or starved event loop, and the network: the
# chaos tier's nodes (three containers and the load sharing two cores) saw their
# loops stand still for up to 0.66 s (fencemark_naps_total at a 0.25 s threshold).
SETTLE_SLACK_S = 2.0
# A node whose event loop stood still longer than this (a paused process, a suspended
# VM, a starved host) called nobody meanwhile: a copy of it may have settled unseen,
# so it settles again before it decides (grant_gate, *naps*). Half of SETTLE_SLACK_S:
# a copy settles unseen only if the original was silent for a heartbeat and the
# whole slack; the other half is left for the heartbeat's usual lateness, and the
# stalls of a loaded host (up to 0.66 s measured) stay below it.
NAP_S = SETTLE_SLACK_S / 2
# A node that woke from a nap refuses replication calls this long: the calls that
# waited in its sockets meanwhile are refused, not served in an order that could
# let a settling copy's round pass before its original's heartbeat (grant_gate.quiet).
NAP_QUIET_S = 1.0
# A partition that drops packets (rather than refusing connections) leaves a TCP
# connection that looks open while its retransmission timer backs off towards
# minutes; after the heal, calls on it would keep timing out. Keepalive pings
# find such a connection dead within KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS and the
# channel reconnects, with its reconnect backoff capped so a healed link is
# used again within seconds (the chaos tier's partitions are such drops).
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# The channel's own retries, the same reason: a call made while the channel waits
# out its reconnect backoff fails at once, so after a heal neither side reaches the
# other before it ends. Every RECONNECT_BACKOFF_MS (x0.8-1.2), not gRPC's default of
# 1 s growing to 2 minutes: a channel to a peer that is down costs a refused connection
# attempt twice a second, a healed link is used within half a second
# (docs/performance.md, *Issue 19 levers, continued*).
RECONNECT_BACKOFF_MS = 500
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
]


@dataclass(frozen=True)
class Tuning:
    """The replicator's tunables, each a constructor parameter (the defaults are the
    constants above, with why each is what it is): a test lowers one to reach a
    bound with a small store, a deployment could tune one without a patch."""

    max_frontier: int = MAX_FRONTIER
    max_round_records: int = MAX_ROUND_RECORDS
    first_listing: int = FIRST_LISTING
    behind_after: int = BEHIND_AFTER
    behind_pause_s: float = BEHIND_PAUSE_S
    push_queue_limit: int = PUSH_QUEUE_LIMIT
    unreachable_after: int = UNREACHABLE_AFTER
    unreachable_after_s: float = UNREACHABLE_AFTER_S
    first_backoff_s: float = FIRST_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    twin_forget_s: float = TWIN_FORGET_S
    kept_push_limit: int = KEPT_PUSH_LIMIT
    heartbeat_s: float = HEARTBEAT_S
    settle_slack_s: float = SETTLE_SLACK_S
    nap_s: float = NAP_S
    nap_quiet_s: float = NAP_QUIET_S
