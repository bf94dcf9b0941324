"""The work queue under mutual TLS: queue state is the home's alone, and the
operator's calls need the ``operate`` right.

Two nodes on loopback with real certificates (``fencemark certs``' CA): what the
home writes into the queue registers is signed and merges everywhere; a peer with
a valid node certificate that writes them itself (marking an item done, reopening
a parked one) is refused ``unsigned_write``; a client without ``operate`` may not
force-release or reopen.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, PermissionDenied, tls_credentials
from fencemark.node.api.authz import parse_access
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Record, Stamp
from fencemark.node.crdt.record import DONE, OPEN, STATUS
from fencemark.node.security.tls import TlsFiles, init_dir
from tests.cluster import Cluster, all_deciding, wait_converged
from tests.metrics import counters
from tests.test_merge_limits import push_as_eu

REPO, TOPIC = "work", "tls"
ACCESS = {
    "clients": {
        "alice": ["read", "write", "claim"],
        "bob": ["read", "write", "claim"],
        "ops": ["read", "operate"],
    }
}


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=["us", "eu"], clients=["alice", "bob", "ops"])
    return directory


def client(node: NodeServer, certs: Path, name: str) -> AsyncClient:
    return AsyncClient(node.address, credentials=tls_credentials(certs, name), timeout=10)


async def test_queue_state_written_by_the_home_merges_signed_everywhere(
    tmp_path: Path, certs: Path
) -> None:
    access = parse_access(ACCESS)
    async with Cluster(tmp_path, ["us", "eu"], access=access) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        eu = await cluster.start("eu", tls=TlsFiles.in_dir(certs, "eu"))
        await all_deciding(us, eu)
        async with client(us, certs, "alice") as alice:
            made = await alice.remember(REPO, TOPIC, "signed", title="t")
            picked = await alice.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            assert picked.granted
            done = await alice.release_claim(made.record.key, picked.fencing_token, outcome="done")
            assert done.released
        await wait_converged([us, eu])
        stored = await eu.storage.get(made.record.key)
        assert stored is not None and stored.record.status == DONE
        assert all(reg.signature for reg in stored.record.queue.values())
        refused = counters(eu, "fencemark_replication_merges_refused", "peer", "reason")
        assert not refused, refused


async def test_a_peer_cannot_write_queue_state_of_its_own(tmp_path: Path, certs: Path) -> None:
    """A node with a valid certificate that marks an item done (or reopens it) by
    writing the queue registers itself is refused: only the home signs them."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with client(us, certs, "alice") as alice:
            made = await alice.remember(REPO, TOPIC, "forged", title="t")
        stored = await us.storage.get(made.record.key)
        assert stored is not None
        before = stored.record
        stamp = Stamp(before.fence.fence, us.replica.clock.now(), "hostile")
        forged: list[Record] = [
            before.set_queue({STATUS: DONE}, stamp),
            before.set_queue({STATUS: OPEN, "attempts": "0"}, stamp),
        ]
        assert await push_as_eu(us, certs, *forged) == 0
        after = await us.storage.get(made.record.key)
        assert after is not None and after.record == before
        refused = counters(us, "fencemark_replication_merges_refused", "peer", "reason")
        assert refused.get(("eu", "unsigned_write"), 0) == len(forged)


async def test_force_release_and_reopen_need_the_operate_right(tmp_path: Path, certs: Path) -> None:
    access = parse_access(ACCESS)
    async with Cluster(tmp_path, ["us"], access=access) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with client(us, certs, "alice") as alice, client(us, certs, "ops") as ops:
            made = await alice.remember(REPO, TOPIC, "operated", title="t")
            key = made.record.key
            picked = await alice.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            for call in (alice.force_release(key, "mine"), alice.reopen(key, "mine")):
                with pytest.raises(PermissionDenied) as denied:
                    await call
                assert (denied.value.reason, denied.value.right) == ("missing_right", "operate")
            taken = await ops.force_release(key, "stuck worker")
            assert taken.released and taken.superseded_token == picked.fencing_token
            reopened = await ops.reopen(key, "try again")
            assert reopened.reopened


async def test_only_the_holder_hears_that_its_release_with_an_outcome_took_effect(
    tmp_path: Path, certs: Path
) -> None:
    """A retried release is answered from the state, but only to the claim's identity:
    bob repeating alice's release is refused not_holder, as any use of her token is."""
    access = parse_access(ACCESS)
    async with Cluster(tmp_path, ["us"], access=access) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with client(us, certs, "alice") as alice, client(us, certs, "bob") as bob:
            made = await alice.remember(REPO, TOPIC, "retried", title="t")
            key = made.record.key
            picked = await alice.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            token = picked.fencing_token
            assert (await alice.release_claim(key, token, outcome="done")).released
            assert (await alice.release_claim(key, token, outcome="done")).released  # retry
            with pytest.raises(PermissionDenied) as denied:
                await bob.release_claim(key, token, outcome="done")
            assert denied.value.reason == "not_holder"


async def test_a_claim_next_is_a_retry_only_from_the_identity_it_was_granted_to(
    tmp_path: Path, certs: Path
) -> None:
    """The same owner name from another identity is another worker: it gets the next
    item, never the claim (or the token) of the identity that holds the first."""
    async with Cluster(tmp_path, ["us"], access=parse_access(ACCESS)) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        await all_deciding(us)
        async with client(us, certs, "alice") as alice, client(us, certs, "bob") as bob:
            await alice.remember(REPO, TOPIC, "one", title="t")
            await alice.remember(REPO, TOPIC, "two", title="t")
            first = await alice.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            again = await alice.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            assert first.record is not None and again.record is not None
            assert (again.record.id, again.fencing_token) == (first.record.id, first.fencing_token)
            other = await bob.claim_next(REPO, TOPIC, "worker", lease_seconds=60)
            assert other.record is not None and other.record.id != first.record.id
            retried = await bob.claim_next(REPO, TOPIC, "worker")
            assert retried.record is not None and retried.record.key == other.record.key
            assert retried.fencing_token == other.fencing_token


async def test_watch_under_tls_needs_read_and_feeds_who_has_it(tmp_path: Path, certs: Path) -> None:
    """Regression: authorization refused every streaming method, ``Records.Watch``
    included, so under mutual TLS nobody could watch. It needs ``read``, like Get."""
    access = parse_access({"clients": {"alice": ["read", "write"], "bob": ["claim"]}})
    async with Cluster(tmp_path, ["us"], access=access) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with client(us, certs, "alice") as alice, client(us, certs, "bob") as bob:
            events = alice.watch(REPO, topic=TOPIC)
            first = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0.2)  # the stream is open: it watches from now
            made = await alice.remember(REPO, TOPIC, "watched", title="t")
            async with asyncio.timeout(10):
                event = await first
            assert (event.kind, event.key) == ("created", made.record.key)
            await events.aclose()
            with pytest.raises(PermissionDenied):
                async with asyncio.timeout(10):
                    await anext(bob.watch(REPO, topic=TOPIC))
