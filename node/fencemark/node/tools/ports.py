"""Ports held for servers that will bind them later, with no window in between.

A local cluster must tell each node its peers' addresses before any of them
listens. A port found by binding port 0 and closing the socket again belongs to
nobody until its server binds it; meanwhile the kernel may hand it to anyone who
binds port 0 or connects out, and the server then fails to start (``Address
already in use``). So the port is *held* instead: a socket bound with
``SO_REUSEADDR`` and never listening, kept open for as long as the server may
(re)bind the port.

What Linux makes of such a socket:

- an outgoing connection never takes it as its local port, and binding port 0
  never picks it, while any other socket is bound to it;
- a plain ``bind`` of the port fails;
- a server that sets ``SO_REUSEADDR`` itself — gRPC, asyncio's ``start_server``,
  etcd and Redis all do — binds and listens on it, because the holder does not
  listen; only that server's socket accepts connections.

A second server on a port whose first server listens still fails, as without the
hold. The scheme relies on Linux's rules; the cluster helpers that use it are for
one Linux machine.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Self

__all__ = ["Ports"]


class Ports:
    """Ports taken for servers not started yet, held until ``close()``.

    ``take()`` binds a new port (the kernel picks it, in one step); the server
    started afterwards on ``host:port`` binds it as if it were free. Close the
    holder only once nothing will bind the ports again (a restarted node reuses
    its port)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._held: list[socket.socket] = []

    def take(self) -> int:
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind((self.host, 0))
        except BaseException:
            holder.close()
            raise
        self._held.append(holder)
        return int(holder.getsockname()[1])

    def address(self) -> str:
        """A new ``host:port``, held like ``take()``'s."""
        return f"{self.host}:{self.take()}"

    def close(self) -> None:
        for holder in self._held:
            holder.close()
        self._held.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
