"""The MCP tool surface of Fencemark: the ``repocontext_*`` tools agents call.

An MCP server built on the official ``mcp`` SDK that is a client of a node (or
of a region map): ``fencemark mcp --target HOST:PORT`` serves it over stdio or
streamable HTTP. Claims that are not granted are results; a write refused by a
claim is a tool error naming ``RepoContextClaimConflictException``. A node
without writes gets no mutating tools at all. Besides the tools: a topic's changes
as a resource to subscribe to (``fencemark.mcp.feed``), and claims kept alive for
as long as an MCP session lasts (``fencemark.mcp.holds``, ``fencemark.mcp.sessions``).
docs/mcp.md is the user's guide.
"""

from fencemark.mcp.models import CONFLICT_EXCEPTION
from fencemark.mcp.server import (
    INSTRUCTIONS,
    RepoContextServer,
    create_server,
    open_server,
    serve,
)
from fencemark.mcp.tools import MUTATING_TOOLS, READ_TOOLS
from fencemark.mcp.work import WORK_TOOLS

MUTATING_TOOL_NAMES = tuple(spec.name for spec in (*MUTATING_TOOLS, *WORK_TOOLS))
READ_TOOL_NAMES = tuple(spec.name for spec in READ_TOOLS)

__all__ = [
    "CONFLICT_EXCEPTION",
    "INSTRUCTIONS",
    "MUTATING_TOOL_NAMES",
    "READ_TOOL_NAMES",
    "RepoContextServer",
    "create_server",
    "open_server",
    "serve",
]
