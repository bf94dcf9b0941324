"""The compose stack's dashboards, in Debian's chromium with the operator's PKCS#12 file.

The stack of deploy/docker-compose.yml with ``FENCEMARK_DASHBOARD_LISTEN=0.0.0.0:8400``
(fresh directories, free ports, the ``image`` and ``compose`` fixtures as in
tests/test_deploy.py). ``fencemark certs p12``, run in the stack's ``certs`` service
as docs/deploy.md tells the operator, bundles the operator's certificate, key and the
CA; Playwright hands that file to chromium as its client certificate for region us's
dashboard. The page must show the backlog, the operator's live claim with its token,
both peers and a refusal, live; a browser without a client certificate gets no page.
Every region's dashboard answers the operator, over HTTPS checked against the CA.

``FENCEMARK_DEPLOY_DASHBOARD_SHOT=docs/images/deploy-dashboard.png`` keeps the
screenshot there (docs/deploy.md shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import urllib.request
from pathlib import Path

import pytest
from playwright.async_api import Error, Locator, Page, async_playwright, expect

from fencemark.client import AsyncClient, ClaimConflict, tls_credentials
from tests import components
from tests.compose import (
    DATA_VARIABLE,
    MEMBERS,
    Stack,
    dashboard_ports,
    data_root,
    published_ports,
    region_of,
)
from tests.dockerenv import BUILD_LIMIT_S, wait_until

REPO = "stack"
PASSWORD = "operator's browser"
READY_LIMIT_S = 90.0
SHOT_VARIABLE = "FENCEMARK_DEPLOY_DASHBOARD_SHOT"
TLS_DIR = "/etc/fencemark/tls"  # the certs service's view of REPOCONTEXT_MEMORY_ARCHIVE_PATH/certs


def client(port: int, certs: Path) -> AsyncClient:
    return AsyncClient(
        f"127.0.0.1:{port}", timeout=5.0, credentials=tls_credentials(certs, "operator")
    )


async def deciding(port: int, certs: Path) -> bool:
    """Whether the node at ``port`` decides claims (its Claims service serves)."""
    try:
        async with client(port, certs) as c:
            return await c.health("fencemark.v1.Claims") == "SERVING"
    except Exception:  # not published yet, not serving yet: not deciding
        return False


async def fill_backlog(c: AsyncClient) -> tuple[str, int]:
    """Topic ``deploys``: two open items, one claimed by ``rollout-us``, one done.
    Returns the claimed key and its token."""
    for id_ in ("canary", "eu-rollout", "ap-rollout", "us-rollout"):
        await c.remember(REPO, "deploys", id_, title=id_, tags=["homeRegion:us"])
    done = f"repo/{REPO}/mem/deploys/canary"
    grant = await c.claim(done, "rollout-canary", lease_seconds=60)
    assert grant.granted, grant
    await c.release_claim(done, grant.fencing_token, outcome="done")
    key = f"repo/{REPO}/mem/deploys/us-rollout"
    claimed = await c.claim(key, "rollout-us", lease_seconds=600)
    assert claimed.granted, claimed
    return key, claimed.fencing_token


def cell(page: Page, status: str) -> Locator:
    return page.locator(f'#backlog tr[data-topic="{REPO}/deploys"] td.{status}')


async def the_operators_browser(api: int, dashboard: int, certs: Path, shot: Path) -> None:
    """Member us-a's dashboard in chromium, with and without the operator's .p12 file
    (its claims reach us's decider, whichever member that is: the client follows)."""
    origin = f"https://127.0.0.1:{dashboard}"
    async with client(api, certs) as c, async_playwright() as playwright:
        key, token = await fill_backlog(c)
        browser = await playwright.chromium.launch(executable_path=components.CHROMIUM)
        try:
            # The node's certificate is checked against the CA in the .p12 file: Playwright
            # makes the TLS connection for a context with client certificates, and answers
            # 503 where the node's certificate does not verify (ignore_https_errors unset).
            operator = await browser.new_context(
                client_certificates=[
                    {"origin": origin, "pfxPath": str(certs / "operator.p12"),
                     "passphrase": PASSWORD}
                ],
                viewport={"width": 1280, "height": 900},
            )  # fmt: skip
            page = await operator.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            answer = await page.goto(f"{origin}/")
            assert answer is not None and answer.status == 200, await page.content()
            await expect(page.locator("#connection")).to_have_text("live")
            await expect(page.locator("#region")).to_contain_text("us")
            # Member us-a names itself, and the decider when it is not that.
            await expect(page.locator("#summary")).to_contain_text("member us-a: ")
            for status, count in (("open", "2"), ("claimed", "1"), ("done", "1")):
                await expect(cell(page, status)).to_have_text(count)
            row = page.locator(f'#claims tr[data-key="{key}"]')
            await expect(row.locator("td.owner")).to_have_text("rollout-us")
            await expect(row.locator("td.token")).to_have_text(str(token))  # the operator's
            peers = page.locator("#peers tbody tr")  # the other regions, its fellow members
            fellows = [f"us/{m}" for m in MEMBERS if m != "us-a"]
            await expect(peers).to_have_count(2 + len(fellows))
            named = sorted(await peers.locator("td:first-child").all_inner_texts())
            assert named == ["ap", "eu", *fellows]
            # Live, without a reload: a new item, and a write refused under the claim.
            await c.remember(REPO, "deploys", "sa-rollout", title="new", tags=["homeRegion:us"])
            await expect(cell(page, "open")).to_have_text("3")
            with pytest.raises(ClaimConflict):
                await c.update(key, fields={"body": "unfenced"})
            refusal = page.locator("#refusals tbody tr").first
            await expect(refusal.locator("td.reason")).to_have_text("claimed")
            await expect(page.locator("#changes-line")).not_to_have_attribute("points", "")
            await page.screenshot(path=str(shot), full_page=True)
            assert errors == []

            # No client certificate, no page. ignore_https_errors only so that what is
            # missing is the client certificate (this browser does not know the CA).
            stranger = await browser.new_context(ignore_https_errors=True)
            with pytest.raises(Error, match=r"net::ERR_"):
                await (await stranger.new_page()).goto(f"{origin}/")
        finally:
            await browser.close()


def snapshot(port: int, certs: Path) -> dict[str, object]:
    """A region's /api/snapshot over HTTPS as the operator, the node checked against the CA."""
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "operator.pem"), str(certs / "operator-key.pem"))
    url = f"https://127.0.0.1:{port}/api/snapshot"
    with urllib.request.urlopen(url, context=context, timeout=5) as answer:
        found: dict[str, object] = json.loads(answer.read())
    return found


@pytest.mark.docker
@pytest.mark.requires("chromium")
@pytest.mark.timeout(2 * BUILD_LIMIT_S)
def test_the_stack_serves_its_dashboards_to_the_operators_browser_only(
    image: str, compose: list[str], tmp_path: Path
) -> None:
    root, user = data_root(tmp_path)
    certs = root / "certs"
    ports, _, port_settings = published_ports()
    dashboards = dashboard_ports(port_settings)
    settings = {DATA_VARIABLE: str(root), "FENCEMARK_DASHBOARD_LISTEN": "0.0.0.0:8400"}
    stack = Stack(compose, tmp_path, {**settings, **port_settings, **user})
    try:
        stack("up", "--detach")
        for node, port in dashboards.items():
            published = stack("port", node, "8400").stdout.strip()
            assert published == f"127.0.0.1:{port}", f"{node}'s dashboard is on {published}"

        def every_region_deciding() -> bool:  # us: one of its members, its decider
            deciding_nodes = {n for n, p in ports.items() if asyncio.run(deciding(p, certs))}
            return {region_of(n) for n in deciding_nodes} == {"us", "eu", "ap"}

        wait_until("every region deciding claims", READY_LIMIT_S, every_region_deciding)
        # As docs/deploy.md has the operator do it, the password from a file here.
        (certs / "operator.password").write_text(PASSWORD + "\n")
        password = f"{TLS_DIR}/operator.password"
        stack("run", "--rm", "-T", "certs", "certs", "p12", "--dir", TLS_DIR,
              "--client", "operator", "--password-file", password)  # fmt: skip
        for node, port in dashboards.items():
            assert snapshot(port, certs)["region"] == region_of(node)
        shot = tmp_path / "deploy-dashboard.png"
        asyncio.run(the_operators_browser(ports["us-a"], dashboards["us-a"], certs, shot))
        if target := os.environ.get(SHOT_VARIABLE):
            shutil.copyfile(shot, target)
    except BaseException:
        print(stack("logs", "--no-color", "--tail", "40", check=False).stdout)
        raise
    finally:
        stack.down()
