"""What the tools' input schemas are made of: the argument types every tool shares
(with the descriptions agents read) and how a tool is registered (``ToolSpec``).

The bounds are SPEC §2's, published in the schemas so that a client sees them; the
node checks them as well. ``fencemark.mcp.arguments`` makes every tool take exactly
what its schema says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from mcp.server.mcpserver.tools import Tool
from mcp_types import ToolAnnotations
from pydantic import Field

from fencemark.mcp.arguments import strict_tool

__all__ = [
    "MAX_LEASE_S",
    "MAX_RETRY_AFTER_S",
    "MAX_TOKEN",
    "MAX_WAIT_FOR_WORK_S",
    "MAX_WAIT_S",
    "KeepAlive",
    "Key",
    "LeaseSeconds",
    "Owner",
    "Token",
    "ToolSpec",
    "WaitSeconds",
    "hints",
]

MAX_TOKEN = 2**64 - 1  # fencing tokens are uint64 on the wire
MIN_LEASE_S, MAX_LEASE_S, MAX_WAIT_S = 1, 3600, 300
MAX_RETRY_AFTER_S = 30 * 24 * 3600  # a deferral of at most 30 days
MAX_WAIT_FOR_WORK_S = 3600  # repocontext_wait_for_work: waits of the node's line, one after another

Key = Annotated[
    str,
    Field(
        description="The record's key, repo/{repoId}/mem/{topic}/{id}, e.g. "
        "repo/lattice/mem/backlog/issue-2101 (repocontext_remember returns it)."
    ),
]
Token = Annotated[
    int,
    Field(ge=1, le=MAX_TOKEN, description="The fencingToken repocontext_claim granted you."),
]
LeaseSeconds = Annotated[
    float,
    Field(
        ge=MIN_LEASE_S,
        le=MAX_LEASE_S,
        allow_inf_nan=False,
        description="How long the lease lasts unless renewed: 1 to 3600 seconds.",
    ),
]
RepoId = Annotated[str, Field(description="Repository name, e.g. lattice.")]
Topic = Annotated[str, Field(description="Topic of the items, e.g. backlog.")]
ItemTags = Annotated[
    list[str] | None,
    Field(description='Only items carrying every one of these tags, e.g. ["lang:go"].'),
]
Owner = Annotated[
    str,
    Field(
        description="Who you are, unique per worker (e.g. worker-a-7f3c): two workers "
        "sharing an owner name are one worker to Fencemark."
    ),
]
WaitSeconds = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="Wait up to this long (0 to 300 s) in a FIFO line: for the claim when "
        "someone else holds it, or for an item when none is eligible; 0 answers at once.",
    ),
]
KeepAlive = Annotated[
    bool,
    Field(
        description="true: this server renews the claim for you (every leaseSeconds/3) for "
        "as long as this MCP session lasts, so you need no repocontext_renew_claim. It stops "
        "when you release the claim, or when the session ends: the claim then lapses at its "
        "lease end (it is not released). If the claim is lost meanwhile (superseded, expired, "
        "...), the next result about the key says so in keepAlive, and a log message too."
    ),
]


@dataclass(frozen=True)
class ToolSpec:
    """How one tool is registered: its method, description and behaviour hints."""

    name: str
    method: str
    description: str
    annotations: ToolAnnotations

    def tool(self, tools: object) -> Tool:
        """The tool over ``tools``' method, taking exactly what its input schema says."""
        fn: Callable[..., Any] = getattr(tools, self.method)
        return strict_tool(
            Tool.from_function(
                fn,
                name=self.name,
                title=self.annotations.title,
                description=self.description,
                annotations=self.annotations,
            )
        )


def hints(title: str, *, read_only: bool, idempotent: bool, destructive: bool) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=None if read_only else destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )
