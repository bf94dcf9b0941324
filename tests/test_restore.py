"""Whole-cluster restore from a backup (issue 7): no fencing token is ever granted twice.

A backup forgets the grants made after it. Restored as it is, the cluster grants
again a token a worker of the lost timeline may still hold, and that worker's
writes get through; ``fencemark restore`` marks each node's copy so its first
grant on each record jumps past every token the backup forgot. Both are shown
end to end: real nodes, the documented backup method (SQLite's backup API on the
live file), the restore command as an operator runs it.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimConflict
from fencemark.node.api.server import NodeServer
from fencemark.node.core.restore import RestoreError, mark_restored
from fencemark.node.rules.admission import RECOVERY_GAP, token_ceiling
from fencemark.node.store.storage import DB_FILE
from fencemark.node.tools.cli import main
from tests.cluster import Cluster, backup, eventually, wait_converged
from tests.conftest import StartNode

KEY = "repo/lattice/mem/backlog/restore-1"


async def fence_at(node: NodeServer) -> int:
    stored = await node.storage.get(KEY)
    return stored.record.fence.fence if stored is not None else 0


@pytest.mark.slow
@pytest.mark.parametrize("restore_mode", [True, False], ids=["fencemark-restore", "plain-copy"])
async def test_a_restored_cluster_never_reissues_a_token_the_backup_forgot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_mode: bool
) -> None:
    saved = tmp_path / "backup.sqlite3"
    async with Cluster(tmp_path / "cluster", ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()

        async def deciding() -> bool:  # a new cluster's nodes first catch up with each other
            return us.replica.deciding and eu.replica.deciding

        await eventually(deciding, "the new cluster deciding claims")
        async with AsyncClient(us.address, retries=0) as c:
            await c.remember("lattice", "backlog", "restore-1", title="t", tags=["homeRegion:us"])
            first = await c.claim(KEY, "worker-a", lease_seconds=1)
            assert first.granted
            await wait_converged([us, eu])
            backup(us, saved)  # the backup knows token `first`, live
            await asyncio.sleep(1.1)  # worker-a's lease lapses
            # After the backup: worker-b gets the next token and works with it.
            stale = await c.claim(KEY, "worker-b", lease_seconds=60)
            assert stale.granted and stale.fencing_token == first.fencing_token + 1
            await c.update(KEY, fields={"body": "b's work"}, fencing_token=stale.fencing_token)
        await wait_converged([us, eu])

        # Every region is lost; each is restored from the same backup.
        for region in ("us", "eu"):
            await cluster.stop(region)
            cluster.wipe(region)
            if restore_mode:
                args = ["restore", "--data", str(cluster.data_dirs[region]), "--from", str(saved)]
                assert main(args) == 0
                assert "marked restored" in capsys.readouterr().out
            else:
                cluster.data_dirs[region].mkdir(parents=True)
                shutil.copyfile(saved, cluster.data_dirs[region] / DB_FILE)
        # us first, alone: with its peer down it cannot have compared states yet, so
        # what it does before deciding is seen (started together, the first round can
        # finish before a test looks).
        us = await cluster.start("us")
        assert await fence_at(us) == first.fencing_token  # the backup's fence
        # A restored file owes a catch-up with the peers before its node decides; a
        # plain copy is a file that went back in time: it compares states first too
        # (bounded by start_wait_s, 10 s, for a plain copy).
        assert not us.replica.deciding
        eu = await cluster.start("eu")
        assert us.storage.node_id != eu.storage.node_id or not restore_mode
        await eventually(deciding, "the restored cluster deciding claims")

        async with AsyncClient(us.address, retries=0) as c:
            fresh = await c.claim(KEY, "worker-c", lease_seconds=60)
            assert fresh.granted
            if restore_mode:
                # The mode: the new grant is above every token granted before the
                # restore, by the recovery gap ...
                assert fresh.fencing_token >= first.fencing_token + 1 + RECOVERY_GAP
            else:
                # A plain copy (once the hazard: the forgotten token granted again, the
                # stale worker's writes getting through): a new life of the file starts
                # a new era of tokens (docs/replication.md, *A disk that goes back in
                # time*).
                assert fresh.fencing_token >= token_ceiling(us.replica.gate.life_hlc)
            assert fresh.fencing_token > stale.fencing_token
            # ... so the stale worker is told it lost the item.
            with pytest.raises(ClaimConflict) as refused:
                await c.update(KEY, fields={"body": "stale"}, fencing_token=stale.fencing_token)
            assert refused.value.reason == "superseded"
            renewed = await c.renew_claim(KEY, stale.fencing_token)
            assert (renewed.renewed, renewed.reason) == (False, "superseded")

        # The peer, restored from the same backup, accepts the jumped grant.
        async def eu_has_it() -> bool:
            return await fence_at(eu) == fresh.fencing_token

        await eventually(eu_has_it, "eu merging the jumped grant")
        async with AsyncClient(eu.address, retries=0) as c:
            assert all(p.merges_refused == 0 for p in (await c.info()).peers)

        # The recovery gap is not owed again: a restart starts its life's era (the
        # time floor), and the next grants follow one by one.
        await cluster.stop("us")
        us = await cluster.start("us")
        await eventually(deciding, "us deciding after its restart")
        async with AsyncClient(us.address, retries=0) as c:
            assert (await c.release_claim(KEY, fresh.fencing_token)).released
            after = await c.claim(KEY, "worker-d", lease_seconds=60)
            floor = max(fresh.fencing_token + 1, token_ceiling(us.replica.gate.life_hlc))
            assert after.fencing_token == floor
            assert (await c.release_claim(KEY, after.fencing_token)).released
            then = await c.claim(KEY, "worker-e", lease_seconds=60)
            assert then.fencing_token == after.fencing_token + 1


async def test_restore_refuses_a_running_node_and_a_file_it_would_overwrite(
    start_node: StartNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = await start_node("us")
    async with AsyncClient(node.address) as c:
        await c.remember("lattice", "backlog", "restore-2")
    data = node.config.db_path.parent
    saved = tmp_path / "backup.sqlite3"
    backup(node, saved)
    # The node is running: the mark would be neither seen nor kept.
    with pytest.raises(RestoreError, match="stop its node first"):
        mark_restored(data)
    # --from never overwrites a database (another timeline) already in place.
    assert main(["restore", "--data", str(data), "--from", str(saved)]) == 2
    assert "move them away first" in capsys.readouterr().err
    await node.stop()
    # Not a Fencemark file, or no file at all: refused, naming what to fix.
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / DB_FILE).write_bytes(b"not a database at all, just some bytes" * 100)
    with pytest.raises(RestoreError, match="not a Fencemark database"):
        mark_restored(junk)
    assert main(["restore", "--data", str(tmp_path / "empty")]) == 2
    assert "no database at" in capsys.readouterr().err
    fresh = tmp_path / "fresh"
    assert main(["restore", "--data", str(fresh), "--from", str(junk / DB_FILE)]) == 2
    assert "cannot copy" in capsys.readouterr().err
    assert not (fresh / DB_FILE).exists()  # nothing half-copied is left behind
    assert main(["restore", "--data", str(fresh), "--from", str(tmp_path / "nothing")]) == 2
    assert "--from: no backup file" in capsys.readouterr().err
    # The stopped node's own file is marked, and the node starts on it.
    restored = mark_restored(data)
    assert restored.records == 1
    again = await start_node("us", data_dir=data)
    assert again.replica.recovered_hlc == restored.recovered_hlc
    assert again.storage.node_id == restored.node_id
    assert again.replica.clock.now() > restored.recovered_hlc
