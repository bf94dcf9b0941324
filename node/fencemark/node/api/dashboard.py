"""The node's read-only web dashboard: an opt-in HTTP listener (``--dashboard-listen``).

What a page needs comes from one snapshot of this node (:meth:`Dashboard.snapshot`):
the backlog by topic and status, the live claims with owner, token and time left,
the latest refusals, the peers with lag, divergence and skew alarms, and a series of
changes per second and replication lag sampled every second. The page follows it
live: ``/api/stream`` is a server-sent event stream that sends a new snapshot as soon
as this node's change feed grows (and every ``IDLE_S`` without a change, for the
clocks and the chart).

Served on the node's own event loop (``asyncio.start_server``): a connection costs a
socket and a small task, never a thread, and a node accepts at most
``MAX_CONNECTIONS`` at once (more are closed at once); a request must arrive within
``REQUEST_TIMEOUT_S``. A snapshot is made at most once per change of the feed (or
every ``IDLE_S``) and shared by every viewer and stream; it is made in slices of
``SLICE`` records with the loop handed back between them, so a viewer never stalls
the node's calls (nor is taken for a nap), and each identity may ask for at most
``RATE`` snapshots a second. Read-only by construction: GET and HEAD of the files
below and the two API paths; every other method is refused 405. With TLS the
listener serves HTTPS with the node's own certificate and asks for a client
certificate of the cluster's CA, and answers only an identity with the ``read`` right
that is not revoked, as the gRPC port does; it shows a claim's token only to a viewer
that ``acts_for`` its grant, as ``ClaimStatus`` does. docs/operations.md, *The dashboard*.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fencemark.node.api.authz import DEFAULT_ACCESS, AccessMap, Right
from fencemark.node.api.handshakes import BACKLOG, HANDSHAKE_TIMEOUT_S, PendingGate, defer_accept
from fencemark.node.api.telemetry import RecentRefusals
from fencemark.node.coordination.member import Member
from fencemark.node.core.claims import Claims
from fencemark.node.core.replica import Replica
from fencemark.node.crdt import Grant
from fencemark.node.crdt.record import DONE, PARKED
from fencemark.node.replication.peers import PeerStats
from fencemark.node.rules.admission import ANYONE, Caller, acts_for
from fencemark.node.security.revocation import Revocations
from fencemark.node.security.tls import Identity, TlsFiles

log = logging.getLogger(__name__)

FILES = {"/": ("index.html", "text/html"), "/app.js": ("app.js", "text/javascript"),
         "/style.css": ("style.css", "text/css")}  # fmt: skip
IDLE_S = 2.0  # a snapshot at least this often on the stream, changes or not
SAMPLES = 300  # the chart's window: five minutes of one-second samples
MAX_SCANNED = 20_000  # records read for the backlog per snapshot; beyond, "partial"
SLICE = 200  # records read between two hand-backs of the event loop
MAX_CONNECTIONS = 64  # open at once, those in their TLS handshake included; more are closed
REQUEST_TIMEOUT_S = 10.0  # for a request to arrive, once the handshake is done
MAX_REQUEST_BYTES = 8192  # a request line and its headers
SEND_TIMEOUT_S = 10.0  # a stream whose viewer takes nothing for this long is closed
RATE, BURST = 5.0, 10.0  # snapshots (a page's stream counts one) per second per identity
MAX_CLAIMS = 100  # live claims listed, soonest to lapse first
STATUSES = ("open", "claimed", DONE, PARKED)


class Dashboard:
    """Snapshots of one node for the page, and the series its chart draws."""

    def __init__(
        self,
        replica: Replica,
        claims: Claims,
        peers: Mapping[str, PeerStats],
        refusals: RecentRefusals,
        member: Member | None = None,
    ) -> None:
        self.replica = replica
        self.claims = claims
        self.peers = peers
        self.refusals = refusals
        self.member = member  # at a member of a region of several
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SAMPLES)
        self._sampler: asyncio.Task[None] | None = None
        # The snapshot every viewer shares: (feed, made at, snapshot), and the one
        # being made, which a viewer asking meanwhile waits for instead of making one.
        self._shared: tuple[int, float, dict[str, Any]] | None = None
        self._making: asyncio.Task[dict[str, Any]] | None = None
        self.made = 0  # snapshots made, however many viewers saw each
        self.site: _Site | None = None  # the listener, once it serves

    def start(self) -> None:
        self._sampler = asyncio.get_running_loop().create_task(self._sample())

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    async def _sample(self) -> None:
        """Every second: changes this node's feed took since the last sample, and the
        largest replication lag to a peer."""
        last = self.replica.feed_last
        while True:
            await asyncio.sleep(1.0)
            now = self.replica.feed_last
            lag = max((p.lag_ms() for p in self.peers.values()), default=0)
            self.series.append({"at_ms": self.replica.wall_ms(), "changes": now - last,
                                "lag_ms": lag})  # fmt: skip
            last = now

    async def next_snapshot(self, after: int) -> dict[str, Any]:
        """A snapshot once the feed has grown past ``after``, or after ``IDLE_S``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(IDLE_S):
                await self.replica.feed_grew(after)
        return await self.snapshot()

    async def snapshot(self) -> dict[str, Any]:
        """The node now, as every viewer shares it: made again only once the feed
        grew or ``IDLE_S`` passed, and by one viewer while the others wait for it."""
        shared = self._shared
        if (
            shared is not None
            and shared[0] == self.replica.feed_last
            and time.monotonic() - shared[1] < IDLE_S
        ):
            return shared[2]
        if self._making is None:
            self._making = asyncio.get_running_loop().create_task(self._make())
        return await asyncio.shield(self._making)

    async def _make(self) -> dict[str, Any]:
        try:
            feed, started = self.replica.feed_last, time.monotonic()
            snapshot = await self._scan()
            self._shared = (feed, started, snapshot)
            self.made += 1
            return snapshot
        finally:
            self._making = None

    async def _scan(self) -> dict[str, Any]:
        replica = self.replica
        now = replica.wall_ms()
        backlog: dict[str, dict[str, int]] = {}
        claims: list[dict[str, Any]] = []
        scanned, after = 0, ""
        while scanned < MAX_SCANNED:
            await asyncio.sleep(0)  # a slice at a time: the node's calls go on between
            page = await replica.scan_all(after, min(SLICE, MAX_SCANNED - scanned))
            if not page:
                break
            scanned += len(page)
            after = page[-1].record.key
            for stored in page:
                record = stored.record
                if not record.visible:
                    continue
                parts = record.key.split("/")  # repo/<repo>/mem/<topic>/<id>
                topic = f"{parts[1]}/{parts[3]}"
                live = record.claim_live(now)
                status = "claimed" if live else record.status
                counts = backlog.setdefault(topic, dict.fromkeys(STATUSES, 0))
                counts[status] = counts.get(status, 0) + 1
                holder = record.fence.holder() if live else None
                if holder is not None:
                    token = record.fence.fence
                    claims.append({"key": record.key, "owner": holder.owner, "token": token,
                                   "left_ms": record.fence.expiry(token) - now,
                                   "home": record.home_region, "grant": holder})  # fmt: skip
        claims.sort(key=lambda c: (c["left_ms"], c["key"]))
        return {
            "region": replica.region,
            "node_id": replica.node_id,
            "now_ms": now,
            "deciding": self.claims.deciding,
            "records": replica.record_count,
            "feed": replica.feed_last,
            "partial": scanned >= MAX_SCANNED,
            "backlog": [{"topic": t, **c} for t, c in sorted(backlog.items())],
            "claims": claims[:MAX_CLAIMS],
            "claims_total": len(claims),
            "refusals": self.refusals.items()[::-1],
            "peers": [_peer(p) for _, p in sorted(self.peers.items())],
            "series": list(self.series),
            **self._membership(),
        }

    def _membership(self) -> dict[str, Any]:
        """At a member of a region of several: its name, the decider it knows and the
        region's configured member set."""
        if self.member is None:
            return {"member": "", "decider": None, "members": []}
        known = self.member.decider()
        decider = None if known is None else {
            "member": known.member, "address": known.address, "term": known.term
        }  # fmt: skip
        members = list(self.member.configured())
        return {"member": self.member.name, "decider": decider, "members": members}


def _peer(p: PeerStats) -> dict[str, Any]:
    return {"region": p.region, "name": p.name, "address": p.address, "reachable": p.reachable,
            "lag_ms": p.lag_ms(), "divergence": p.divergence, "skew_alarms": p.skew_alarms,
            "last_error": p.last_error}  # fmt: skip


def _asset(name: str) -> bytes:
    return resources.files("fencemark.node.api").joinpath("static", name).read_bytes()


def for_viewer(snapshot: dict[str, Any], viewer: Caller) -> dict[str, Any]:
    """``snapshot`` as ``viewer`` may see it: a claim's token only where the viewer
    ``acts_for`` its grant (0 elsewhere, as ``ClaimStatus`` answers)."""
    claims = []
    for claim in snapshot["claims"]:
        grant: Grant = claim["grant"]
        shown = {k: v for k, v in claim.items() if k != "grant"}
        if not acts_for(viewer, grant):
            shown["token"] = 0
        claims.append(shown)
    return {**snapshot, "claims": claims}


@dataclass(frozen=True)
class _Gate:
    """Who may look, with TLS: the access map's ``read`` right, and not revoked —
    the same map and CRL as the gRPC port (docs/security.md, *The dashboard*)."""

    access: AccessMap
    revocations: Revocations

    def viewer(self, connection: Any) -> Caller | str:
        """The viewer behind ``connection``, or why it is refused (a 403's body)."""
        cert = connection.getpeercert() or {}
        uris = [v for kind, v in cert.get("subjectAltName", ()) if kind == "URI"]
        identities = [i for i in map(Identity.parse, uris) if i is not None]
        if len(identities) != 1 or len(uris) != 1:
            return "no_identity: the client certificate names no fencemark identity"
        denied = self.revocations.check_der(connection.getpeercert(binary_form=True) or b"")
        if denied is not None:
            return f"revoked_certificate: {denied}"
        if Right.READ not in self.access.rights(identities[0]):
            return f"missing_right: {identities[0]} may not read (it needs the 'read' right)"
        return self.access.caller(identities[0])


def _viewer(connection: Any, gate: _Gate | None) -> Caller | str:
    """Who looks: ``ANYONE`` without TLS; with it, as ``gate`` says."""
    return ANYONE if gate is None else gate.viewer(connection)


class _Rate:
    """At most ``RATE`` snapshots a second per identity, in bursts of ``BURST``."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def allows(self, identity: str) -> bool:
        now = time.monotonic()
        tokens, last = self._buckets.get(identity, (BURST, now))
        tokens = min(BURST, tokens + (now - last) * RATE)
        if tokens < 1:
            self._buckets[identity] = (tokens, now)
            return False
        self._buckets[identity] = (tokens - 1, now)
        if len(self._buckets) > 10_000:  # identities are few; addresses may not be
            self._buckets.clear()
        return True


class _Site:
    """The listener's connections, each a task on the node's loop."""

    def __init__(
        self,
        dashboard: Dashboard,
        gate: _Gate | None,
        tls: ssl.SSLContext | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.dashboard = dashboard
        self.gate = gate
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s
        # Connections in their TLS handshake, per source address and in all
        # (fencemark.node.api.handshakes): below MAX_CONNECTIONS, so a flood of them
        # leaves room for viewers who completed theirs.
        self.pending = PendingGate()
        self.open: set[asyncio.Task[Any]] = set()
        self.rate = _Rate()
        self.connections = 0  # accepted, ever
        self.refused_connections = 0  # of them, closed at once: MAX_CONNECTIONS were open
        self.most_open = 0

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections += 1
        if len(self.open) >= MAX_CONNECTIONS:
            self.refused_connections += 1
            writer.close()
            return
        source = _address(writer)
        if self.tls is not None and not self.pending.admit(source):
            self.refused_connections += 1
            writer.close()
            return
        self.open.add(task)
        self.most_open = max(self.most_open, len(self.open))
        try:
            if self.tls is not None:
                try:
                    await writer.start_tls(self.tls, ssl_handshake_timeout=self.handshake_timeout_s)
                finally:
                    self.pending.done(source)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            await self._answer(head.decode("latin-1").split("\r\n", 1)[0].split(), writer)
        except (
            TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ConnectionError, ssl.SSLError,
        ):  # fmt: skip
            pass  # a page that went away, a silent or oversized request: closed
        finally:
            self.open.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _answer(self, request_line: list[str], writer: asyncio.StreamWriter) -> None:
        if len(request_line) != 3:
            return await _send(writer, 400, b"bad request\n", "text/plain")
        method, target, _ = request_line
        path, head = target.split("?", 1)[0], method == "HEAD"
        if method not in ("GET", "HEAD"):
            body = b"read-only: the dashboard takes GET and HEAD only\n"
            return await _send(writer, 405, body, "text/plain", allow=True)
        viewer = _viewer(writer.get_extra_info("ssl_object"), self.gate)
        if isinstance(viewer, str):
            return await _send(writer, 403, viewer.encode() + b"\n", "text/plain", head=head)
        if path in FILES:
            name, kind = FILES[path]
            return await _send(writer, 200, _asset(name), kind, head=head)
        if path not in ("/api/snapshot", "/api/stream") or (head and path == "/api/stream"):
            return await _send(writer, 404, b"not found\n", "text/plain", head=head)
        if not self.rate.allows(viewer.identity or _address(writer)):
            body = b"too many snapshots: at most a few a second per viewer\n"
            return await _send(writer, 429, body, "text/plain", head=head, retry_after=1)
        if path == "/api/snapshot":
            snapshot = for_viewer(await self.dashboard.snapshot(), viewer)
            return await _send(writer, 200, json.dumps(snapshot).encode(), "application/json",
                               head=head)  # fmt: skip
        await self._stream(writer, viewer)

    async def _stream(self, writer: asyncio.StreamWriter, viewer: Caller) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-store\r\nConnection: close\r\n\r\n")  # fmt: skip
        after = -1
        while True:
            snapshot = await self.dashboard.next_snapshot(after)
            if isinstance(_viewer(writer.get_extra_info("ssl_object"), self.gate), str):
                return  # revoked (or its right taken) since the stream began
            after = snapshot["feed"]
            writer.write(b"data: " + json.dumps(for_viewer(snapshot, viewer)).encode() + b"\n\n")
            async with asyncio.timeout(SEND_TIMEOUT_S):  # a viewer that reads nothing goes
                await writer.drain()

    async def close(self) -> None:
        for task in list(self.open):
            task.cancel()
        await asyncio.gather(*self.open, return_exceptions=True)


async def _send(
    writer: asyncio.StreamWriter,
    code: int,
    body: bytes,
    kind: str,
    *,
    head: bool = False,
    allow: bool = False,
    retry_after: int = 0,
) -> None:
    reasons = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
               405: "Method Not Allowed", 429: "Too Many Requests"}  # fmt: skip
    headers = [
        f"HTTP/1.1 {code} {reasons[code]}",
        f"Content-Type: {kind}; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        # Only the page's own files: no CDN, no inline script, no frames.
        "Content-Security-Policy: default-src 'self'; frame-ancestors 'none'",
        "X-Content-Type-Options: nosniff",
        "Connection: close",
    ]
    if allow:
        headers.append("Allow: GET, HEAD")
    if retry_after:
        headers.append(f"Retry-After: {retry_after}")
    writer.write(("\r\n".join(headers) + "\r\n\r\n").encode("latin-1"))
    if not head:
        writer.write(body)
    async with asyncio.timeout(SEND_TIMEOUT_S):
        await writer.drain()


def _address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if peer else "?"


async def serve(
    dashboard: Dashboard,
    listen: str,
    tls: TlsFiles | None = None,
    access: AccessMap | None = None,
    revocations: Revocations | None = None,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[int, Callable[[], Awaitable[None]]]:
    """Serve the dashboard on ``listen`` (HOST:PORT; port 0 picks one) on the running
    loop; returns the bound port and a stopper. HTTPS with client certificates when
    ``tls`` is given, their identities' rights from ``access``, refused when
    ``revocations`` lists them; a connection has ``handshake_timeout_s`` for its TLS
    handshake once it spoke, and none reaches the node before (``api.handshakes``)."""
    host, _, port = listen.rpartition(":")
    context: ssl.SSLContext | None = None
    gate: _Gate | None = None
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        context.verify_mode = ssl.CERT_REQUIRED
        gate = _Gate(access or DEFAULT_ACCESS, revocations or Revocations())
    site = _Site(dashboard, gate, context, handshake_timeout_s)
    # TLS is started per connection (_Site.connection), once it passed the bounds.
    server = await asyncio.start_server(
        site.connection, host.strip("[]"), int(port), limit=MAX_REQUEST_BYTES, backlog=BACKLOG
    )
    for sock in server.sockets:
        defer_accept(sock)
    dashboard.site = site
    dashboard.start()

    async def stop() -> None:
        server.close()
        await site.close()
        await server.wait_closed()

    return int(server.sockets[0].getsockname()[1]), stop
