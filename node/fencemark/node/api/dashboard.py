"""The node's read-only web dashboard: an opt-in HTTP listener (``--dashboard-listen``).

What a page needs comes from one snapshot of this node (:meth:`Dashboard.snapshot`):
the backlog by topic and status, the live claims with owner, token and time left,
the latest refusals, the peers with lag, divergence and skew alarms, and a series of
changes per second and replication lag sampled every second. The page follows it
live: ``/api/stream`` is a server-sent event stream that sends a new snapshot as soon
as this node's change feed grows (and every ``IDLE_S`` without a change, for the
clocks and the chart).

Served by the standard library's threaded HTTP server, as ``/metrics`` is
(prometheus_client): its threads ask the event loop for snapshots
(``run_coroutine_threadsafe``), never touch the node's state themselves. Read-only
by construction: GET and HEAD of the files below and the two API paths; every other
method is refused 405. With TLS the listener serves HTTPS with the node's own
certificate and asks for a client certificate of the cluster's CA, as the gRPC port
does, and shows a claim's token only to a viewer that ``acts_for`` its grant (its
holder's identity, or one with the ``act-for-others`` right), as ``ClaimStatus``
does. docs/operations.md, *The dashboard*.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import http.server
import json
import logging
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fencemark.node.api.authz import DEFAULT_ACCESS, AccessMap, Right
from fencemark.node.api.telemetry import RecentRefusals
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
    ) -> None:
        self.replica = replica
        self.claims = claims
        self.peers = peers
        self.refusals = refusals
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SAMPLES)
        self._sampler: asyncio.Task[None] | None = None

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
        replica = self.replica
        now = replica.wall_ms()
        backlog: dict[str, dict[str, int]] = {}
        claims: list[dict[str, Any]] = []
        scanned, after = 0, ""
        while scanned < MAX_SCANNED:
            page = await replica.scan_all(after, min(1000, MAX_SCANNED - scanned))
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
        }


def _peer(p: PeerStats) -> dict[str, Any]:
    return {"region": p.region, "address": p.address, "reachable": p.reachable,
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


def _handler(
    dashboard: Dashboard, loop: asyncio.AbstractEventLoop, gate: _Gate | None
) -> type[Any]:
    def ask(make: Callable[[], Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), loop).result(timeout)

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "fencemark-dashboard"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("dashboard: " + format, *args)

        def _send(self, code: int, body: bytes, kind: str, *, head: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            # Only the page's own files: no CDN, no inline script, no frames.
            policy = "default-src 'self'; frame-ancestors 'none'"
            self.send_header("Content-Security-Policy", policy)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            path = self.path.split("?", 1)[0]
            viewer = _viewer(self.connection, gate)
            if isinstance(viewer, str):
                self._send(403, viewer.encode() + b"\n", "text/plain", head=head)
            elif path in FILES:
                name, kind = FILES[path]
                self._send(200, _asset(name), kind, head=head)
            elif path == "/api/snapshot":
                snapshot = for_viewer(ask(dashboard.snapshot, 30.0), viewer)
                self._send(200, json.dumps(snapshot).encode(), "application/json", head=head)
            elif path == "/api/stream" and not head:
                self._stream(viewer)
            else:
                self._send(404, b"not found\n", "text/plain", head=head)

        def _stream(self, viewer: Caller) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            after = -1
            try:
                while not self.server.closing:  # type: ignore[attr-defined]
                    snapshot = ask(functools.partial(dashboard.next_snapshot, after), IDLE_S + 30)
                    if isinstance(_viewer(self.connection, gate), str):
                        return  # revoked (or its right taken) since the stream began
                    after = snapshot["feed"]
                    shown = json.dumps(for_viewer(snapshot, viewer)).encode()
                    self.wfile.write(b"data: " + shown + b"\n\n")
                    self.wfile.flush()
            except (OSError, ssl.SSLError, RuntimeError, TimeoutError):
                return  # the page went away, or the node is stopping

        def refuse(self) -> None:
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            body = b"read-only: the dashboard takes GET and HEAD only\n"
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = refuse

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    closing = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A page that went away, a failed TLS handshake: logged, not printed."""
        log.debug("dashboard: a request from %s failed", client_address, exc_info=True)


def serve(
    dashboard: Dashboard,
    listen: str,
    tls: TlsFiles | None = None,
    access: AccessMap | None = None,
    revocations: Revocations | None = None,
) -> tuple[int, Callable[[], None]]:
    """Serve the dashboard on ``listen`` (HOST:PORT; port 0 picks one); returns the
    bound port and a stopper. HTTPS with client certificates when ``tls`` is given,
    their identities' rights from ``access``, refused when ``revocations`` lists them."""
    host, _, port = listen.rpartition(":")
    loop = asyncio.get_running_loop()
    gate = (
        _Gate(access or DEFAULT_ACCESS, revocations or Revocations()) if tls is not None else None
    )
    server = _Server((host.strip("[]"), int(port)), _handler(dashboard, loop, gate))
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
        context.load_cert_chain(str(tls.cert), str(tls.key))
        context.verify_mode = ssl.CERT_REQUIRED
        # The handshake in the request's thread, not in the one accepting connections.
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    dashboard.start()

    def stop() -> None:
        server.closing = True
        server.shutdown()
        server.server_close()

    return int(server.server_address[1]), stop
