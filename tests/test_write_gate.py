"""SPEC §6: writes are fail-closed; a node without writes enabled serves reads only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, Unimplemented
from fencemark.node.tools.cli import build_parser
from tests.conftest import StartNode

REPO, TOPIC, ID = "gate", "backlog", "item-1"
KEY = f"repo/{REPO}/mem/{TOPIC}/{ID}"


async def seed(start_node: StartNode, data: Path) -> tuple[int, str]:
    """Write a record with a live claim through a writing node, then stop it."""
    writer = await start_node(data_dir=data, enable_writes=True)
    async with AsyncClient(writer.address) as client:
        await client.remember(REPO, TOPIC, ID, title="seeded", tags=["seed"])
        for i in range(3):
            await client.remember(REPO, TOPIC, f"other-{i}")
        granted = await client.claim(KEY, "worker-a", lease_seconds=600)
        assert granted.granted
        node_id = (await client.info()).node_id
    await writer.stop()
    return granted.fencing_token, node_id


async def test_a_read_only_node_answers_unimplemented_to_every_mutating_method(
    start_node: StartNode, tmp_path: Path
) -> None:
    """SPEC §6: without --enable-writes no mutating RPC is registered at all."""
    data = tmp_path / "gate"
    token, _ = await seed(start_node, data)
    reader = await start_node(data_dir=data, enable_writes=False)
    async with AsyncClient(reader.address) as client:
        writes: dict[str, Callable[[], Awaitable[object]]] = {
            "Remember": lambda: client.remember(REPO, TOPIC, "new", title="x"),
            "Update": lambda: client.update(KEY, fields={"body": "x"}, fencing_token=token),
            "Delete": lambda: client.delete(KEY, fencing_token=token),
            "Claim": lambda: client.claim(KEY, "worker-b"),
            "RenewClaim": lambda: client.renew_claim(KEY, token),
            "ReleaseClaim": lambda: client.release_claim(KEY, token),
        }
        for name, write in writes.items():
            with pytest.raises(Unimplemented) as refused:
                await write()
            assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED, name
        # Nothing changed: the claim is still live with the same token, the record intact.
        status = await client.claim_status(KEY)
        assert status.claim is not None and status.claim.fencing_token == token
        record = await client.get(KEY)
        assert (record.title, record.body, record.deleted) == ("seeded", "", False)


async def test_a_read_only_node_serves_reads_of_data_written_earlier(
    start_node: StartNode, tmp_path: Path
) -> None:
    """SPEC §6: reads keep working on a read-only node (Get, List, ClaimStatus, Info)."""
    data = tmp_path / "gate"
    token, node_id = await seed(start_node, data)
    reader = await start_node(data_dir=data, enable_writes=False)
    async with AsyncClient(reader.address) as client:
        record = await client.get(KEY)
        assert record.title == "seeded"
        assert set(record.tags) == {"seed", "homeRegion:local"}
        assert record.fence == token
        listed = [r.key async for r in client.iter_records(REPO, topic=TOPIC, page_size=2)]
        assert listed == sorted([KEY, *(f"repo/{REPO}/mem/{TOPIC}/other-{i}" for i in range(3))])
        status = await client.claim_status(KEY)
        assert status.claim is not None
        assert (status.claim.owner, status.claim.fencing_token) == ("worker-a", token)
        assert (status.fence, status.authoritative) == (token, False)
        info = await client.info()
        assert info.writes_enabled is False
        assert info.record_count == 4
        assert info.node_id == node_id
        assert await client.health() == "SERVING"


async def test_a_writing_node_says_so_in_info(start_node: StartNode) -> None:
    """SPEC §7: Node.Info reports whether writes are enabled."""
    writer = await start_node(enable_writes=True)
    reader = await start_node(enable_writes=False)
    async with AsyncClient(writer.address) as w, AsyncClient(reader.address) as r:
        assert (await w.info()).writes_enabled is True
        assert (await r.info()).writes_enabled is False


def test_the_cli_node_is_read_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEC §6: no --enable-writes and no FENCEMARK_ENABLE_WRITES means read-only."""
    monkeypatch.delenv("FENCEMARK_ENABLE_WRITES", raising=False)
    assert build_parser().parse_args(["node"]).enable_writes is False
    assert build_parser().parse_args(["node", "--enable-writes"]).enable_writes is True


@pytest.mark.parametrize(("value", "enabled"), [("1", True), ("0", False), ("", False)])
def test_fencemark_enable_writes_turns_writes_on(
    monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool
) -> None:
    """SPEC §6: env FENCEMARK_ENABLE_WRITES=1 is the same as --enable-writes."""
    monkeypatch.setenv("FENCEMARK_ENABLE_WRITES", value)
    assert build_parser().parse_args(["node"]).enable_writes is enabled
