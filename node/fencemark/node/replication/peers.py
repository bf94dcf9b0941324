"""Static peers (region -> address) and what this node knows about each."""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc

from fencemark.node import validation
from fencemark.node.errors import InvalidInput

log = logging.getLogger("fencemark.node.replication")

# States refused from one peer, remembered so that they are not fetched again
# while the peer still holds the same state (SPEC §2: never re-fetched in a loop).
MAX_REFUSED_STATES = 10_000
REFUSAL_RETRY_S = (1.0, 60.0)  # first and longest pause before fetching one again


def parse_peers(specs: Iterable[str], *, own_region: str) -> dict[str, str]:
    """``["eu=host:port", ...]`` (also comma-separated) -> ``{"eu": "host:port"}``."""
    peers: dict[str, str] = {}
    for spec in specs:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            region, sep, address = item.partition("=")
            if not sep or not address or ":" not in address:
                raise InvalidInput.field("peer", f"expected REGION=HOST:PORT, got {item!r}")
            validation.region(region, "peer")
            if region == own_region:
                raise InvalidInput.field("peer", f"{region!r} is this node's own region")
            if region in peers and peers[region] != address:
                raise InvalidInput.field("peer", f"region {region!r} given twice")
            peers[region] = address
    return peers


@dataclass
class PeerStats:
    """Replication accounting for one peer, both directions, as this node sees it."""

    region: str
    address: str
    started: float = 0.0
    last_sync: float | None = None  # wall-clock seconds of the last completed round
    records_sent: int = 0
    records_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    divergence: int = 0
    skew_alarms: int = 0
    merges_refused: int = 0  # states from this peer that failed integrity.check
    last_refusal: str = ""
    # The same refusals by reason (token_jump, unknown_signer, revoked_signer, ...).
    merge_refusals: Counter[str] = field(default_factory=Counter)
    # key -> (digest of the refused state, monotonic time to try it again, refusals so far)
    refused_states: OrderedDict[str, tuple[bytes, float, int]] = field(default_factory=OrderedDict)
    reachable: bool = False
    last_error: str = ""
    failures: int = 0  # consecutive failed attempts
    # Checks of the certificate the peer's address presents that refused it, by
    # denial (revoked_certificate, region_mismatch, ...; replication.peer_check).
    certificate_refusals: dict[str, int] = field(default_factory=dict)
    # How this node reaches the peer: mutual TLS with its own certificate
    # (fencemark.node.tls), or None for plaintext (--insecure).
    credentials: grpc.ChannelCredentials | None = None

    def __post_init__(self) -> None:
        self.started = self.started or time.time()

    def lag_ms(self, now: float | None = None) -> int:
        since = self.last_sync if self.last_sync is not None else self.started
        return max(0, round(((now or time.time()) - since) * 1000))

    def refused(self, key: str, reason: str, detail: str, digest: bytes) -> None:
        """Count a state refused from this peer, log it once per key and reason, and
        back off fetching it again while the peer holds the same state."""
        self.merges_refused += 1
        self.merge_refusals[reason] += 1
        self.last_refusal = f"{key}: {reason}: {detail}"[:500]
        seen, _, times = self.refused_states.pop(key, (b"", 0.0, 0))
        times = times + 1 if seen == digest else 1
        first, longest = REFUSAL_RETRY_S
        self.refused_states[key] = (
            digest,
            time.monotonic() + min(longest, first * 2 ** (times - 1)),
            times,
        )
        if len(self.refused_states) > MAX_REFUSED_STATES:
            self.refused_states.popitem(last=False)
        if times == 1:
            log.warning("refused a state from %s: %s: %s: %s", self.region, key, reason, detail)
        else:
            log.debug("refused the same state from %s again (%d times): %s: %s",
                      self.region, times, key, reason)  # fmt: skip

    def skips(self, key: str, digest: bytes) -> bool:
        """Whether to leave ``key`` unfetched: its state at the peer is one this node
        refused, and the pause before trying it again is not over."""
        memo = self.refused_states.get(key)
        return memo is not None and memo[0] == digest and time.monotonic() < memo[1]

    def succeeded(self) -> None:
        self.reachable = True
        self.last_error = ""
        self.failures = 0

    def failed(self, why: str) -> None:
        self.reachable = False
        self.last_error = why
        self.failures += 1


def stats_for(
    peers: Mapping[str, str], credentials: grpc.ChannelCredentials | None = None
) -> dict[str, PeerStats]:
    return {
        region: PeerStats(region, address, credentials=credentials)
        for region, address in peers.items()
    }
