"""How a tool call ends: a result, or a tool error a model can read and act on.

A claim, renewal or release that is not granted is a normal result (see
``models``). Everything that did not happen is a tool error (``isError:
true``) whose text says what went wrong and what to do, never a stack trace:

- a write refused by the record's claim names ``RepoContextClaimConflictException``
  and carries the conflict word, the fence and the home region as structured
  content (``{"error": {...}}``, which the tool's output schema admits: a client
  such as the MCP Inspector validates error results against it too);
- arguments the node refuses name the argument, in the tools' camelCase spelling
  (``fencemark.mcp.arguments`` words the ones the tool's own schema refuses);
- an unreachable node says so and that the call can be retried;
- a caller the node refuses (PERMISSION_DENIED) is told why: the server's identity
  lacks a right, or the token was granted to another identity (``not_holder``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from mcp_types import CallToolResult, TextContent
from pydantic import BaseModel

from fencemark.client.errors import (
    ClaimConflict,
    FencemarkError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    Unimplemented,
    WrongRegion,
)
from fencemark.mcp.models import CONFLICT_EXCEPTION, ClaimConflictOut, KeepAliveOut

__all__ = [
    "argument_name",
    "conflict_result",
    "error_result",
    "failure_result",
    "success",
    "with_keep_alive",
]

# Request fields (as the node names them in INVALID_ARGUMENT) -> tool arguments.
_ARGUMENT_NAMES = {
    "repo": "repoId",
    "lease_seconds": "leaseSeconds",
    "wait_seconds": "waitSeconds",
    "fencing_token": "fencingToken",
    "page_token": "pageToken",
}

# What an agent should do after each conflict word (docs/api.md, "The error model").
_CONFLICT_ADVICE = {
    "claimed": "The record is claimed by another worker: claim it with repocontext_claim and "
    "pass its fencingToken, or wait until the claim is released.",
    "superseded": "A higher fencing token has been granted: you lost this item. Stop working "
    "on it now and do not retry this write.",
    "expired": "Your lease lapsed before this write. Stop; claim the item again if you still "
    "want it.",
    "released": "Your token was released. Claim the item again if you still want it.",
    "unknown_token": "That token was never granted for this record: pass the fencingToken "
    "repocontext_claim returned.",
    "wrong_region": "Only the node of the record's home region creates it and decides its "
    "fenced writes: run the MCP server with --regions naming that region's node.",
}


def success(out: BaseModel) -> CallToolResult:
    """A result: structured content, and the same JSON as text for the model to read."""
    structured = out.model_dump(mode="json", by_alias=True, exclude_none=True)
    text = json.dumps(structured, indent=2, ensure_ascii=False)
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=structured
    )


def with_keep_alive(result: CallToolResult, status: KeepAliveOut) -> CallToolResult:
    """``result`` saying what the session's keepalive of its key is doing (``keepAlive``).

    A result gets it in its structured content (and its text, which repeats it); an
    error with structured content (a write's conflict) too, since the output schema
    admits it there; any other error only in its text.
    """
    if result.is_error and result.structured_content is None:
        structured = None
    else:
        structured = {**(result.structured_content or {}), "keepAlive": status.wire()}
    if result.is_error or structured is None:
        texts = [block.text for block in result.content if isinstance(block, TextContent)]
        said = f" ({status.reason})" if status.reason else ""
        text = " ".join(
            [*texts, f"keepAlive of token {status.fencing_token}: {status.state}{said}."]
        )
    else:
        text = json.dumps(structured, indent=2, ensure_ascii=False)
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structured_content=structured,
        is_error=result.is_error,
    )


def error_result(text: str, structured: Mapping[str, object] | None = None) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structured_content=dict(structured) if structured is not None else None,
        is_error=True,
    )


def conflict_result(tool: str, key: str, refused: ClaimConflict) -> CallToolResult:
    """A write refused by the record's claim: a tool error naming the conflict."""
    conflict = ClaimConflictOut(
        key=key,
        conflict=refused.reason,
        fence=refused.fence,
        home_region=refused.home_region,
        message=refused.message,
    )
    advice = _CONFLICT_ADVICE.get(refused.reason, "")
    text = (
        f"{CONFLICT_EXCEPTION}: {tool} of {key} was refused: {refused.reason}"
        f" (fence {refused.fence}, home region {refused.home_region or 'unknown'})."
        f" {advice} Node says: {refused.message}"
    )
    return error_result(text, {"error": conflict.model_dump(mode="json", by_alias=True)})


def failure_result(
    tool: str, error: FencemarkError, *, target: str, key: str = "", applied_maybe: bool = False
) -> CallToolResult:
    """Any other failed call, as a sentence naming what failed and what to do.

    ``applied_maybe`` is for writes the client does not retry (``update``): after
    a lost reply the write may have landed, so retrying blindly is not safe.
    """
    subject = f"{tool} of {key}" if key else tool
    if isinstance(error, InvalidArgument):
        problems = error.violations or [("", error.message)]
        listed = "; ".join(
            f"{argument_name(name)}: {why}" if name else why for name, why in problems
        )
        return error_result(f"Invalid arguments for {tool}: {listed}")
    if isinstance(error, WrongRegion):
        return error_result(
            f"WrongRegion: {subject} was refused: a new record is created only in its home"
            f" region, {error.home_region!r}. Run the MCP server with --regions naming that"
            f" region's node, or create the record there. Node says: {error.message}"
        )
    if isinstance(error, NotFound):
        return error_result(
            f"NotFound: {subject}: no such record (or it was deleted). Keys look like"
            " repo/{repoId}/mem/{topic}/{id}; create a record with repocontext_remember."
        )
    if isinstance(error, Unavailable):
        caution = (
            " An update is not retried for you and may or may not have been applied:"
            " repocontext_recall the record before writing again."
            if applied_maybe
            else ""
        )
        return error_result(
            f"Unavailable (retryable): {subject} failed because the Fencemark node"
            f" (target {target}) could not be reached in time: {error}. Retry in a few"
            f" seconds.{caution}"
        )
    if isinstance(error, PermissionDenied):
        advice = (
            "That fencingToken was granted to another identity than this server's: use"
            " the token your own repocontext_claim returned, or claim the item."
            if error.reason == "not_holder"
            else "This server's identity may not make this call: ask the node's operator"
            " for the right named, or run the server with --tls-name of one that has it."
        )
        return error_result(
            f"PermissionDenied ({error.reason}): {subject} was refused to"
            f" {error.identity or 'this server'}. {advice} Node says: {error.message}"
        )
    if isinstance(error, Unimplemented):
        return error_result(
            f"Unimplemented: {subject}: the node does not serve this call, e.g. it was"
            f" started without --enable-writes. Node says: {error.message}"
        )
    return error_result(f"FencemarkError: {subject} failed: {error}")


def argument_name(field: str) -> str:
    """The tool argument a request field stands for: ``lease_seconds`` -> ``leaseSeconds``."""
    head, bracket, rest = field.partition("[")
    return _ARGUMENT_NAMES.get(head, head) + bracket + rest
