"""The node's read-only web dashboard, in a real browser.

Two peered in-process nodes (us, eu), us serving the dashboard on loopback; Debian's
``chromium`` driven by Playwright (``executable_path``: no browser is downloaded).
The page must show what the node holds — the backlog by topic and status, the live
claim with its owner, token and time left, the peers, a refusal just answered — and
follow changes live, from the change feed, without a reload. It offers nothing that
changes anything, and the listener refuses every method but GET and HEAD. Under TLS
it serves HTTPS with the node's certificate and asks for a client certificate of the
cluster's CA, as the gRPC port does.

``FENCEMARK_DASHBOARD_SHOT=docs/images/dashboard.png`` keeps the test's screenshot
there (docs/operations.md shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Page, async_playwright, expect

from fencemark.client import AsyncClient, ClaimConflict, tls_credentials
from fencemark.node.api import dashboard
from fencemark.node.api.authz import load_access
from fencemark.node.api.server import NodeServer
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from tests import components
from tests.cluster import Cluster, all_deciding, eventually
from tests.conftest import StartNode

REPO = "dash"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, ["us", "eu"]) as c:
        await c.start("us", dashboard_listen="127.0.0.1:0")
        await c.start("eu")
        await all_deciding(c["us"], c["eu"])
        yield c


async def fill_backlog(client: AsyncClient) -> tuple[str, int]:
    """Topic ``build``: one open, one claimed (by agent-7), one done; topic ``triage``:
    one parked (it failed its one attempt). Returns the claimed key and its token."""
    for id_ in ("open-1", "claimed-1", "done-1"):
        await client.remember(REPO, "build", id_, title=id_, tags=["homeRegion:us"])
    await client.remember(REPO, "triage", "poison", title="poison",
                          tags=["homeRegion:us", "maxAttempts:1"])  # fmt: skip
    for id_, owner, outcome in (("build/done-1", "agent-1", "done"),
                                ("triage/poison", "agent-2", "failed")):  # fmt: skip
        item = f"repo/{REPO}/mem/{id_}"
        claim = await client.claim(item, owner, lease_seconds=60)
        assert claim.granted, claim
        await client.release_claim(item, claim.fencing_token, outcome=outcome)
    key = f"repo/{REPO}/mem/build/claimed-1"
    claimed = await client.claim(key, "agent-7", lease_seconds=600)
    assert claimed.granted
    return key, claimed.fencing_token


def counts(page: Page, topic: str, status: str) -> Any:
    return page.locator(f'#backlog tr[data-topic="{REPO}/{topic}"] td.{status}')


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
@pytest.mark.timeout(120)
@pytest.mark.requires("chromium")
async def test_the_dashboard_shows_the_node_and_follows_it_live(
    cluster: Cluster, tmp_path: Path
) -> None:
    us = cluster["us"]
    async with AsyncClient(us.address, timeout=5) as client:
        key, token = await fill_backlog(client)
        url = f"http://127.0.0.1:{us.dashboard_port}/"
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=components.CHROMIUM)
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                await page.goto(url)
                await expect(page.locator("#connection")).to_have_text("live")
                await expect(page.locator("#region")).to_contain_text("us")
                shown = (("build", "open"), ("build", "claimed"), ("build", "done"),
                         ("triage", "parked"))  # fmt: skip
                for topic, status in shown:
                    await expect(counts(page, topic, status)).to_have_text("1")
                row = page.locator(f'#claims tr[data-key="{key}"]')
                await expect(row.locator("td.owner")).to_have_text("agent-7")
                await expect(row.locator("td.token")).to_have_text(str(token))
                assert (await row.locator("td.left").inner_text()).endswith(" s")
                await expect(page.locator("#peers tbody tr")).to_have_count(1)
                await expect(page.locator("#peers tbody td").first).to_have_text("eu")

                # Live: a new item and a refusal appear without a reload.
                await client.remember(REPO, "build", "open-2", title="new", tags=["homeRegion:us"])
                await expect(counts(page, "build", "open")).to_have_text("2")
                with pytest.raises(ClaimConflict):
                    await client.update(key, fields={"body": "unfenced"})  # while claimed
                refusal = page.locator("#refusals tbody tr").first
                await expect(refusal.locator("td.reason")).to_have_text("claimed")
                await expect(refusal).to_contain_text("Update")
                # The chart has samples (one a second).
                await expect(page.locator("#changes-line")).not_to_have_attribute("points", "")

                # Read-only: nothing on the page to act with.
                assert await page.locator("form, input, button, select, textarea").count() == 0
                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
                if target := os.environ.get("FENCEMARK_DASHBOARD_SHOT"):
                    shutil.copyfile(shot, target)
                assert errors == []
            finally:
                await browser.close()


async def test_every_method_but_get_and_head_is_refused(cluster: Cluster) -> None:
    await asyncio.to_thread(refusals_of_methods, f"http://127.0.0.1:{cluster['us'].dashboard_port}")


def refusals_of_methods(base: str) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        request = urllib.request.Request(f"{base}/api/snapshot", data=b"{}", method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 405, method
        assert refused.value.headers["Allow"] == "GET, HEAD"
    with urllib.request.urlopen(f"{base}/", timeout=5) as page:
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        html = page.read().decode()
    assert "http" not in html.replace('lang="en"', "")  # nothing fetched from elsewhere
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{base}/../etc/passwd", timeout=5)
    assert missing.value.code == 404


async def test_without_the_option_nothing_listens(start_node: StartNode) -> None:
    node: NodeServer = await start_node()
    assert node.dashboard_port == 0


async def test_under_tls_it_serves_https_to_the_clusters_client_certificates_only(
    start_node: StartNode, tmp_path: Path
) -> None:
    """HTTPS with the node's certificate; no page without a client certificate of the
    cluster's CA; a claim's token only to its holder's identity (or one that acts for
    others), as ``ClaimStatus`` answers; no plain HTTP beside it."""
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["operator", "alice"])
    node = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), dashboard_listen="127.0.0.1:0")
    async with AsyncClient(node.address, credentials=tls_credentials(certs, "operator")) as c:
        await c.remember(REPO, "build", "tls-1", title="t", tags=["homeRegion:us"])
        await c.remember(REPO, "build", "tls-2", title="t", tags=["homeRegion:us"])
        claim = await c.claim(f"repo/{REPO}/mem/build/tls-2", "op-worker", lease_seconds=600)
        assert claim.granted
    url = f"https://localhost:{node.dashboard_port}/api/snapshot"
    # urllib blocks: off the event loop, which serves the node (and the snapshot).
    seen = await asyncio.to_thread(https_checks, url, certs, node.dashboard_port)
    assert seen == {"operator": claim.fencing_token, "alice": 0}


def https_checks(url: str, certs: Path, port: int) -> dict[str, int]:
    """What each client sees of the claim's token."""
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionResetError)):
        urllib.request.urlopen(url, context=context, timeout=5).read()  # no client certificate
    with pytest.raises((urllib.error.URLError, ConnectionResetError, TimeoutError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read()  # no plain HTTP
    tokens = {}
    for name in ("operator", "alice"):
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        context.load_cert_chain(str(certs / f"{name}.pem"), str(certs / f"{name}-key.pem"))
        with urllib.request.urlopen(url, context=context, timeout=5) as answer:
            snapshot = json.loads(answer.read())
        assert snapshot["region"] == "us"
        assert snapshot["backlog"] == [
            {"topic": f"{REPO}/build", "open": 1, "claimed": 1, "done": 0, "parked": 0}
        ]
        [shown] = snapshot["claims"]
        assert shown["owner"] == "op-worker"
        tokens[name] = shown["token"]
    return tokens


async def test_under_tls_it_answers_only_readers_that_are_not_revoked(
    start_node: StartNode, tmp_path: Path
) -> None:
    """Issue 33, finding 1: the dashboard answered a right-less identity (gRPC:
    ``missing_right``) and a revoked one (gRPC: ``revoked_certificate``) with 200. It
    follows the same access map and CRL as the gRPC port: 403 with the reason, and an
    open stream ends at its next frame once its certificate is revoked."""
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=["alice", "bob", "mallory"])
    access = tmp_path / "access.toml"
    access.write_text('[clients]\nalice = ["read"]\nbob = ["read"]\nmallory = []\n')
    node = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), access=load_access(access),
                            dashboard_listen="127.0.0.1:0", tls_reload_interval=0.1)  # fmt: skip
    base = f"https://localhost:{node.dashboard_port}"
    stream = await asyncio.to_thread(open_as, f"{base}/api/stream", certs, "bob")
    assert stream.status == 200
    assert (await asyncio.to_thread(stream.readline)).startswith(b"data: ")
    assert main(["certs", "revoke", "--dir", str(certs), "--client", "bob"]) == 0

    async def bob_refused() -> bool:
        return await asyncio.to_thread(status_as, f"{base}/api/snapshot", certs, "bob") == 403

    await eventually(bob_refused, "bob's revoked certificate refused")
    for path in ("/api/snapshot", "/", "/api/stream"):
        assert await asyncio.to_thread(status_as, base + path, certs, "mallory") == 403
    assert await asyncio.to_thread(status_as, f"{base}/api/snapshot", certs, "alice") == 200
    # bob's stream, open since before, ends at its next frame (one every IDLE_S at most).
    rest = await asyncio.wait_for(asyncio.to_thread(stream.read), 10)
    assert rest.count(b"data: ") <= 1


def open_as(url: str, certs: Path, name: str) -> Any:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / f"{name}.pem"), str(certs / f"{name}-key.pem"))
    return urllib.request.urlopen(url, context=context, timeout=10)


def status_as(url: str, certs: Path, name: str) -> int:
    try:
        with open_as(url, certs, name) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        body = refused.read().decode()
        assert body.split(":")[0] in ("missing_right", "revoked_certificate"), body
        return refused.code


async def test_silent_connections_never_reach_the_dashboard(start_node: StartNode) -> None:
    """Issue 43: a connection that sends nothing is kept by the kernel until it speaks
    (``TCP_DEFER_ACCEPT``, fencemark.node.api.handshakes): 200 of them are never met,
    while a page asked for meanwhile is served."""
    node = await start_node(dashboard_listen="127.0.0.1:0")
    address = ("127.0.0.1", node.dashboard_port)
    idle = await asyncio.to_thread(lambda: [socket.create_connection(address) for _ in range(200)])
    try:
        site = node._dashboard.site if node._dashboard is not None else None
        assert site is not None
        page = await asyncio.to_thread(_get, node.dashboard_port, "/")
        assert page.startswith(b"HTTP/1.1 200 OK")
        assert site.connections == 1  # the page's, and none of the silent ones
    finally:
        for sock in idle:
            sock.close()


async def test_idle_connections_cost_no_thread_and_are_closed(
    start_node: StartNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, finding 2: 500 idle connections to the dashboard took the node from
    14 to 514 threads, held until the client closed them. Now a connection is a task
    on the node's loop: no thread, at most MAX_CONNECTIONS at once (more are closed at
    once), and one that sends no whole request is closed after REQUEST_TIMEOUT_S
    (each of these sends one byte: a silent one never reaches the node at all)."""
    monkeypatch.setattr(dashboard, "REQUEST_TIMEOUT_S", 1.0)
    node = await start_node(dashboard_listen="127.0.0.1:0")
    await asyncio.to_thread(lambda: None)  # the loop's worker thread, before counting
    threads = threading.active_count()
    address = ("127.0.0.1", node.dashboard_port)

    def started(count: int) -> list[socket.socket]:
        socks = [socket.create_connection(address) for _ in range(count)]
        for sock in socks:
            sock.sendall(b"G")  # a request begun, never finished
        return socks

    # Connected from another thread: the node's loop accepts them meanwhile.
    idle = await asyncio.to_thread(started, 200)
    try:
        site = node._dashboard.site if node._dashboard is not None else None
        assert site is not None

        async def all_met() -> bool:
            return site.connections == len(idle)

        await eventually(all_met, "every connection met")
        assert threading.active_count() == threads
        assert site.most_open == dashboard.MAX_CONNECTIONS and site.refused_connections > 0
        async with AsyncClient(node.address) as client:  # the node's calls go on
            assert (await client.info()).region == "local"

        async def all_closed() -> bool:
            return not site.open

        await eventually(all_closed, "the idle connections closed")
    finally:
        for sock in idle:
            sock.close()


def _get(port: int, path: str) -> bytes:
    """One plain HTTP GET of the dashboard: its whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_a_burst_of_viewers_shares_one_snapshot_within_a_rate(
    start_node: StartNode,
) -> None:
    """Issue 33, finding 3: every viewer made its own snapshot (1.5 s of node time at
    20,000 records each), and 60 of them stalled claims long enough for the node to
    take it for a nap. Now a snapshot is made once per change of the feed and shared,
    in slices; and each viewer gets at most a burst of them before 429."""
    node = await start_node(dashboard_listen="127.0.0.1:0")
    async with AsyncClient(node.address) as client:
        for index in range(50):
            await client.remember(REPO, "build", f"item-{index}", title="t")
    assert node._dashboard is not None
    made = node._dashboard.made
    url = f"http://127.0.0.1:{node.dashboard_port}/api/snapshot"
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=20) as viewers:  # all 20 at once
        asks = [loop.run_in_executor(viewers, status_of, url) for _ in range(20)]
        codes = await asyncio.gather(*asks)
    # The bucket refills at RATE while the viewers arrive: on a loaded machine they
    # spread over a little time, and each 1/RATE s of it may let one more through.
    refilled = dashboard.RATE * (time.monotonic() - started)
    served, refused = codes.count(200), codes.count(429)
    assert served + refused == 20, codes
    assert dashboard.BURST <= served <= dashboard.BURST + refilled, (codes, refilled)
    assert refused >= 20 - dashboard.BURST - refilled, (codes, refilled)
    assert node._dashboard.made == made + 1, "one snapshot, shared by every viewer"


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            json.loads(answer.read())
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return refused.code
