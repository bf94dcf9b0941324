"""SPEC §1: the walkthrough that must work, word for word, over gRPC."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, ClaimConflict, Unavailable
from fencemark.client.walkthrough import _Walkthrough, run_walkthrough
from fencemark.node.api.server import NodeServer
from tests.cluster import Cluster, all_deciding

KEY = "repo/lattice/mem/backlog/issue-2101"
TAGS = [
    "backlog",
    "priority:P1",
    "phase:implementation",
    "homeRegion:local",
    "baseBranch:feat/epic/wal-batching",
]
LEASE_SECONDS = 1.0


async def _sleep_until(client: AsyncClient, moment: datetime) -> None:
    """Sleep until the node's clock is surely past ``moment``."""
    now = (await client.info()).now
    assert now is not None
    remaining = (moment - now).total_seconds()
    await asyncio.sleep(max(remaining, 0.0) + 0.15)


async def test_the_spec_walkthrough_holds_step_by_step(client: AsyncClient) -> None:
    """SPEC §1, steps 1-7, each checked explicitly."""

    # Step 1: remember creates the key; repeating it merges in place.
    async def remember() -> tuple[bool, str, tuple[str, ...]]:
        result = await client.remember(
            repo="lattice",
            topic="backlog",
            id="issue-2101",
            kind="Note",
            author="backlog-pm",
            title="Batch WAL fsyncs",
            body="Group commits so that one fsync covers many writes.",
            tags=TAGS,
        )
        return result.created, result.record.key, result.record.tags

    created, key, tags = await remember()
    assert (created, key) == (True, KEY)
    assert set(TAGS) <= set(tags)
    created_again, key_again, _ = await remember()
    assert (created_again, key_again) == (False, KEY)
    listed = [r.key async for r in client.iter_records("lattice", topic="backlog")]
    assert listed == [KEY]

    # Step 2: worker-a's claim is granted with a token and a server-decided expiry.
    before = (await client.info()).now
    claim_a = await client.claim(KEY, owner="worker-a", lease_seconds=LEASE_SECONDS)
    after = (await client.info()).now
    assert claim_a.granted and claim_a.reason == ""
    assert claim_a.fencing_token > 0
    assert claim_a.lease_expires_at is not None and before is not None and after is not None
    assert claim_a.lease_expires_at.utcoffset() == timedelta(0)
    lease = timedelta(seconds=LEASE_SECONDS)
    assert before + lease <= claim_a.lease_expires_at <= after + lease
    token_a = claim_a.fencing_token

    # Step 3: an unfenced update is refused while the claim is live; fenced is admitted.
    with pytest.raises(ClaimConflict) as refused:
        await client.update(KEY, fields={"body": "started"})
    assert refused.value.reason == "claimed"
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (await client.get(KEY)).body != "started"
    updated = await client.update(KEY, fields={"body": "started"}, fencing_token=token_a)
    assert updated.body == "started"

    # Step 4: after the lease lapses without renewal, worker-b gets a higher token.
    await _sleep_until(client, claim_a.lease_expires_at)
    claim_b = await client.claim(KEY, owner="worker-b")
    assert claim_b.granted
    assert claim_b.fencing_token > token_a
    token_b = claim_b.fencing_token

    # Step 5: worker-a's old token is refused (superseded), and so is its renewal.
    with pytest.raises(ClaimConflict) as lost:
        await client.update(KEY, fields={"body": "worker-a was here"}, fencing_token=token_a)
    assert lost.value.reason == "superseded"
    renewal = await client.renew_claim(KEY, token_a)
    assert (renewal.renewed, renewal.reason) == (False, "superseded")

    # Step 7 (while claimed): status reports the live claim, queue, fence, never authority.
    status = await client.claim_status(KEY)
    assert status.claim is not None
    assert status.claim.owner == "worker-b"
    assert status.claim.fencing_token == token_b
    assert status.claim.lease_expires_at == claim_b.lease_expires_at
    assert status.queue_depth == 0
    assert status.fence == token_b
    assert status.authoritative is False

    # Step 6: release succeeds, is idempotent, readmits unfenced writes, never lowers the fence.
    first = await client.release_claim(KEY, token_b)
    second = await client.release_claim(KEY, token_b)
    assert (first.released, first.fence) == (True, token_b)
    assert (second.released, second.fence) == (True, token_b)
    assert (await client.update(KEY, fields={"body": "done"})).body == "done"
    with pytest.raises(ClaimConflict) as still_lost:
        await client.update(KEY, fields={"body": "worker-a was here"}, fencing_token=token_a)
    assert still_lost.value.reason == "superseded"
    assert (await client.get(KEY)).body == "done"

    # Step 7 (after release): no live claim, the fence stays, never authoritative.
    status = await client.claim_status(KEY)
    assert status.claim is None
    assert status.fence == token_b
    assert status.authoritative is False


async def test_the_bundled_walkthrough_passes_and_reports_every_check(
    node: NodeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPEC §1 as shipped: ``run_walkthrough`` returns True and prints ✓ lines only."""
    ok = await run_walkthrough(node.address, lease_seconds=1)
    out = capsys.readouterr().out
    assert ok is True
    checks = [line for line in out.splitlines() if line[:1] in ("✓", "✗")]
    assert checks, out
    assert all(line.startswith("✓") for line in checks), out
    for step in ("step 1", "step 2", "step 3", "step 4", "step 5", "step 6", "step 7"):
        assert any(f"✓ {step}:" in line for line in checks), (step, out)


async def test_the_bundled_walkthrough_can_run_twice_against_one_node(
    node: NodeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPEC §1 step 1: the id is deterministic, so a second run merges in place."""
    assert await run_walkthrough(node.address, lease_seconds=1)
    assert await run_walkthrough(node.address, lease_seconds=1)
    out = capsys.readouterr().out
    assert "✗" not in out
    async with AsyncClient(node.address) as client:
        keys = [r.key async for r in client.iter_records("lattice", include_deleted=True)]
    assert keys == [KEY]


async def test_a_fenced_write_at_a_settling_home_is_refused_not_serving_and_the_walkthrough_waits(
    tmp_path: Path,
) -> None:
    """us restarted with eu down waits ``start_wait_s`` for it and answers a fenced
    write ``UNAVAILABLE`` with reason ``NOT_SERVING`` (nothing done);
    the walkthrough sends it again once the home decides (a CI host starved a
    container's node for a second, and the walkthrough stopped at that refusal)."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address) as client:
            key = (await client.remember("lattice", "backlog", "settling")).record.key
            token = (await client.claim(key, "w", lease_seconds=60)).fencing_token
        await cluster.stop("eu")
        await cluster.stop("us")
        us = await cluster.start("us", start_wait_s=2)
        async with AsyncClient(us.address, retries=0) as client:
            with pytest.raises(Unavailable) as refused:
                await client.update(key, fields={"body": "x"}, fencing_token=token)
            assert refused.value.reason == "NOT_SERVING"
            assert refused.value.retry_after == 0  # when it ends is not known: polled
            assert (await client.get(key)).body == ""  # nothing done
            lines: list[str] = []
            walkthrough = _Walkthrough(client, lines.append)
            record = await walkthrough.write(
                lambda: client.update(key, fields={"body": "x"}, fencing_token=token)
            )
            assert record.body == "x" and us.replica.deciding
            assert any("settles before it decides" in line for line in lines), lines
