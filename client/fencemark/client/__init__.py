"""Python client for Fencemark nodes: one implementation, two faces.

``AsyncClient`` is the asyncio client; ``Client`` is the same client for
blocking code. Results are frozen dataclasses (``fencemark.client.types``);
failures are ``FencemarkError`` subclasses (``fencemark.client.errors``).
A claim, renewal or release that is not granted is a value, not an error.
"""

from fencemark.client._aio import AsyncClient
from fencemark.client._blocking import Client
from fencemark.client.errors import (
    ClaimConflict,
    CursorExpired,
    FencemarkError,
    InvalidArgument,
    NotDecider,
    NotFound,
    PermissionDenied,
    Unavailable,
    Unimplemented,
    WatcherTooSlow,
    WrongRegion,
)
from fencemark.client.keepalive import ClaimLost, Hold
from fencemark.client.retry import retry_safe_methods
from fencemark.client.tls import tls_credentials
from fencemark.client.types import (
    ClaimEvent,
    ClaimNextResult,
    ClaimResult,
    ClaimStatus,
    DeciderInfo,
    ForceReleaseResult,
    History,
    LiveClaim,
    NodeInfo,
    PeerInfo,
    Record,
    RecordPage,
    ReleaseResult,
    RememberResult,
    RenewResult,
    ReopenResult,
    WatchEvent,
    WatchProgress,
)

__all__ = [
    "AsyncClient",
    "ClaimConflict",
    "ClaimEvent",
    "ClaimLost",
    "ClaimNextResult",
    "ClaimResult",
    "ClaimStatus",
    "Client",
    "CursorExpired",
    "DeciderInfo",
    "FencemarkError",
    "ForceReleaseResult",
    "History",
    "Hold",
    "InvalidArgument",
    "LiveClaim",
    "NodeInfo",
    "NotDecider",
    "NotFound",
    "PeerInfo",
    "PermissionDenied",
    "Record",
    "RecordPage",
    "ReleaseResult",
    "RememberResult",
    "RenewResult",
    "ReopenResult",
    "Unavailable",
    "Unimplemented",
    "WatchEvent",
    "WatchProgress",
    "WatcherTooSlow",
    "WrongRegion",
    "retry_safe_methods",
    "tls_credentials",
]
