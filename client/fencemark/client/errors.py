"""Exceptions raised by the client, decoded from gRPC status and its rich details.

A refused fenced write is an exception (``ClaimConflict``); a claim, renewal
or release that is not granted is a value (``granted=False``), never an error.
The node attaches a ``google.rpc.Status`` to the trailing metadata key
``grpc-status-details-bin``; its ``ErrorInfo`` (domain ``fencemark``) and
``BadRequest`` details are what the classes below expose.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError
from google.rpc import (  # type: ignore[import-untyped, unused-ignore]
    error_details_pb2,
    status_pb2,
)

__all__ = [
    "ClaimConflict",
    "FencemarkError",
    "InvalidArgument",
    "NotDecider",
    "NotFound",
    "PermissionDenied",
    "Unavailable",
    "Unimplemented",
    "WrongRegion",
    "from_rpc_error",
]

ERROR_DOMAIN = "fencemark"
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
WRONG_REGION = "wrong_region"


class FencemarkError(Exception):
    """A call failed. ``code`` is the gRPC status code, ``message`` the node's words."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message


class ClaimConflict(FencemarkError):
    """A write was refused by the record's claim (FAILED_PRECONDITION, CLAIM_CONFLICT).

    ``reason`` is one of ``claimed``, ``superseded``, ``unknown_token``,
    ``released``, ``expired``, ``wrong_region``; ``fence`` is the record's fence
    and ``home_region`` the region that decides fenced writes.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str,
        fence: int,
        home_region: str,
    ) -> None:
        super().__init__(code, message)
        self.reason = reason
        self.fence = fence
        self.home_region = home_region


class WrongRegion(ClaimConflict):
    """Only the record's home region decides this call: send it to ``home_region``.

    Raised for a *new* record sent outside its home region and for a fenced write
    at a node that is not the record's home; ``reason`` is always
    ``wrong_region``, so ``except ClaimConflict`` catches it too.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, fence: int, home_region: str
    ) -> None:
        super().__init__(code, message, reason=WRONG_REGION, fence=fence, home_region=home_region)


class InvalidArgument(FencemarkError):
    """The node refused the input; ``violations`` are ``(field, description)`` pairs."""

    def __init__(
        self, code: grpc.StatusCode, message: str, *, violations: list[tuple[str, str]]
    ) -> None:
        super().__init__(code, message)
        self.violations = violations


class NotFound(FencemarkError):
    """No such record (or it is deleted)."""


class PermissionDenied(FencemarkError):
    """The node refused the caller (PERMISSION_DENIED): nothing was read or written.

    ``reason`` is ``missing_right`` (the identity lacks ``right``: read, write,
    claim or replicate), ``no_identity`` (the certificate names no fencemark
    identity), or for replication calls ``unauthenticated_peer``,
    ``unknown_region``, ``unknown_member`` or ``region_mismatch``, or ``revoked_certificate`` (the
    caller's certificate is on the node's revocation list), or ``not_holder`` (a
    renewal, release or fenced write with the token of a claim granted to another
    identity; ``right`` is then ``act-for-others``, the right that would allow it);
    ``identity`` is who the node took the caller for (e.g. ``client/alice``).
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, reason: str, identity: str, right: str
    ) -> None:
        super().__init__(code, message)
        self.reason = reason
        self.identity = identity
        self.right = right


class CursorExpired(FencemarkError):
    """A watch cursor the node can no longer resume from (OUT_OF_RANGE, reason
    ``CURSOR_EXPIRED``): older than the changes it keeps, or of another node's feed.
    List the records again, then watch from now (``cursor=""``)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, cursor: str) -> None:
        super().__init__(code, message)
        self.cursor = cursor


class WatcherTooSlow(FencemarkError):
    """The node cut a watcher off that left an event untaken too long; ``cursor`` is
    the last event whose send completed (the one whose send timed out may still have
    arrived before this error: resume from the last event received). ``watch()``
    resumes by itself, from the last event it gave."""

    def __init__(self, code: grpc.StatusCode, message: str, *, cursor: str) -> None:
        super().__init__(code, message)
        self.cursor = cursor


class Unavailable(FencemarkError):
    """The node could not be reached in time (UNAVAILABLE or DEADLINE_EXCEEDED), or
    answered that it decides nothing yet: ``reason`` ``NOT_SERVING`` (it catches up or
    settles; nothing was done), with ``retry_after`` seconds when the node knows when
    to ask again (``RetryInfo``; 0 otherwise). ``reason`` ``NO_MAJORITY``: a member
    of a region of several wrote it, but too few of the region's members acknowledged
    it; its outcome is unknown, as a lost reply's (retry it: a retried claim of the
    same owner gets the same token back)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, *, reason: str = "", retry_after: float = 0.0
    ) -> None:
        super().__init__(code, message)
        self.reason = reason
        self.retry_after = retry_after


class NotDecider(FencemarkError):
    """A deciding call (claim, renewal, release, fenced write, ``ClaimNext``, reopen,
    force-release) reached a member of a region of several that is not its decider
    (FAILED_PRECONDITION, reason ``NOT_DECIDER``): nothing was done. Member
    ``decider`` decides for ``region`` in ``term``, at ``address``."""

    def __init__(
        self, code: grpc.StatusCode, message: str, *, region: str, decider: str, address: str,
        term: int,
    ) -> None:  # fmt: skip
        super().__init__(code, message)
        self.region = region
        self.decider = decider
        self.address = address
        self.term = term


class Unimplemented(FencemarkError):
    """The node does not serve the method, e.g. a write on a node without writes enabled."""


def from_rpc_error(error: grpc.RpcError) -> FencemarkError:
    """The exception that tells the caller what a failed call means."""
    code = error.code()
    message = error.details() or ""
    # At runtime metadata is (key, value) pairs (grpc.aio.Metadata, or the
    # sync namedtuples); grpc-stubs types it as an opaque _Metadatum.
    metadata_pairs = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    error_info, bad_request, retry_info = _rich_details(metadata_pairs)
    if error_info is not None and error_info.domain == ERROR_DOMAIN:
        metadata = error_info.metadata
        conflict = str(metadata.get("conflict", ""))
        fence = _to_int(metadata.get("fence", ""))
        home_region = str(metadata.get("home_region", ""))
        # Older nodes refused a new record away from home with reason WRONG_REGION.
        if error_info.reason == "WRONG_REGION" or (
            error_info.reason == "CLAIM_CONFLICT" and conflict == WRONG_REGION
        ):
            return WrongRegion(code, message, fence=fence, home_region=home_region)
        if error_info.reason == "CLAIM_CONFLICT":
            return ClaimConflict(
                code, message, reason=conflict, fence=fence, home_region=home_region
            )
        if error_info.reason == "CURSOR_EXPIRED":
            return CursorExpired(code, message, cursor=str(metadata.get("cursor", "")))
        if error_info.reason == "WATCHER_TOO_SLOW":
            return WatcherTooSlow(code, message, cursor=str(metadata.get("cursor", "")))
        if error_info.reason in ("NOT_SERVING", "NO_MAJORITY"):
            wait = retry_info.retry_delay.ToMilliseconds() / 1000 if retry_info else 0.0
            return Unavailable(code, message, reason=error_info.reason, retry_after=wait)
        if error_info.reason == "NOT_DECIDER":
            return NotDecider(
                code,
                message,
                region=str(metadata.get("region", "")),
                decider=str(metadata.get("decider", "")),
                address=str(metadata.get("address", "")),
                term=_to_int(metadata.get("term", "")),
            )
        if error_info.reason == "PERMISSION_DENIED":
            return PermissionDenied(
                code,
                message,
                reason=str(metadata.get("denial", "")),
                identity=str(metadata.get("identity", "")),
                right=str(metadata.get("right", "")),
            )
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = (
            [(str(v.field), str(v.description)) for v in bad_request.field_violations]
            if bad_request is not None
            else []
        )
        return InvalidArgument(code, message, violations=violations)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(code, message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(code, message)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(code, message)
    return FencemarkError(code, message)


def _rich_details(trailing_metadata: Iterable[tuple[str, str | bytes]]) -> tuple[Any, Any, Any]:
    """The first ErrorInfo, BadRequest and RetryInfo in the status details, or None each.

    Read from the metadata directly rather than through
    ``grpc_status.rpc_status.from_call``: that works on grpc.aio errors too, but
    raises when the status message and the details' message differ, and a
    malformed detail must never hide the status code itself.
    """
    found: dict[Any, Any] = {
        error_details_pb2.ErrorInfo: None,
        error_details_pb2.BadRequest: None,
        error_details_pb2.RetryInfo: None,
    }
    for key, value in trailing_metadata:
        if key != _STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:  # a garbled detail still leaves a usable status code
            return None, None, None
        for detail in status.details:
            for kind, seen in found.items():
                if seen is None and detail.Is(kind.DESCRIPTOR):
                    found[kind] = kind()
                    detail.Unpack(found[kind])
    error_info, bad_request, retry_info = found.values()
    return error_info, bad_request, retry_info


def _to_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
