"""Replicated states obey the limits of client writes (SPEC §2, §4), and no record stops
anti-entropy.

The bug these pin: a peer (with a valid node certificate) pushed 10 001 tags, 300
fields, a 5 MiB body and a home named ``no such region!/..``, and all of it was
merged and passed on; two pushes grew one record to 18 MB, after which every
anti-entropy round with its holder failed RESOURCE_EXHAUSTED and missed pushes were
never repaired. Now a remote state, and the result of merging it, is checked with
the limits of a client write (``validation.state``) before anything is written;
one over them is refused ``over_limit``, counted and logged like the integrity
refusals, and a state too large to send is left out of its batch instead of
failing the round (docs/consistency.md, *Limits and merges*).
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, tls_credentials
from fencemark.node.api.server import MAX_RECEIVE_BYTES, NodeServer
from fencemark.node.crdt import Record, Stamp, codec
from fencemark.node.rules.validation import MAX_FIELDS, MAX_RECORD_BYTES, MAX_TAGS, MAX_VALUE_BYTES
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.v1 import replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster, eventually, wait_converged
from tests.metrics import counters

MiB = 1 << 20


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=["us", "eu"], clients=["alice"])
    return directory


def alice(node: NodeServer, certs: Path) -> AsyncClient:
    credentials = tls_credentials(certs, "alice")
    return AsyncClient(node.address, credentials=credentials, retries=0, timeout=10)


async def push_as_eu(node: NodeServer, certs: Path, *states: Record) -> int:
    """Replication.Push with eu's real node certificate, as a hostile eu node would."""
    credentials = TlsFiles.in_dir(certs, "eu").channel_credentials()
    options = [("grpc.max_send_message_length", MAX_RECEIVE_BYTES)]
    async with grpc.aio.secure_channel(node.address, credentials, options=options) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        request = replication_pb2.PushRequest(
            origin=replication_pb2.Origin(region="eu", node_id="hostile", hlc=0),
            states=[codec.encode(state) for state in states],
        )
        response: replication_pb2.PushResponse = await stub.Push(request, timeout=30)
        return response.merged


def refused_over_limit(node: NodeServer, peer: str) -> float:
    refused = counters(node, "fencemark_replication_merges_refused", "peer", "reason")
    return refused.get((peer, "over_limit"), 0)


async def state_of(node: NodeServer, key: str) -> Record | None:
    stored = await node.storage.get(key)
    return stored.record if stored is not None else None


@pytest.mark.slow
async def test_states_over_the_limits_of_a_client_write_are_refused_and_change_nothing(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with alice(us, certs) as client:
            held = (await client.remember("lattice", "backlog", "held", title="t")).record.key
            other = (await client.remember("lattice", "backlog", "other", title="t")).record.key
        before = await state_of(us, held)
        assert before is not None
        stamp = Stamp(0, us.replica.clock.now(), "hostile")

        def new(name: str, home: str = "us") -> Record:
            return Record(f"repo/lattice/mem/backlog/{name}").create(home, stamp)

        forged = {
            "tags": new("tags").add_tags([f"t{i}" for i in range(10_001)], stamp),
            "fields": before.set_fields({f"f{i}": "x" for i in range(300)}, stamp),
            "body": before.set_fields({"body": "b" * (5 * MiB)}, stamp),
            "home": new("home", home="no such region!/.."),
            "long tag": new("long-tag").add_tags(["t" * 257], stamp),
            "field name": before.set_fields({"no spaces": "x"}, stamp),
            "home tag": before.add_tags(["homeRegion:eu"], stamp),
            "queue name": before.set_queue({"priority": "1"}, stamp),
            "status": before.set_queue({"status": "finished"}, stamp),
            "attempts": before.set_queue({"attempts": "-1"}, stamp),
            "not_before": before.set_queue({"not_before": "0" + "1" * 20}, stamp),
        }
        honest = await state_of(us, other)
        assert honest is not None
        written = honest.set_fields({"body": "written at eu"}, stamp)

        assert await push_as_eu(us, certs, *forged.values(), written) == 1
        # The one honest state was merged; nothing of the others was written.
        assert await state_of(us, held) == before
        for name in ("tags", "home", "long-tag"):
            assert await state_of(us, f"repo/lattice/mem/backlog/{name}") is None
        assert (await state_of(us, other)) == honest.merge(written)

        # Counted per peer and reason, and shown by Info (fencemark status) and metrics.
        assert refused_over_limit(us, "eu") == len(forged)
        async with alice(us, certs) as client:
            eu = next(p for p in (await client.info()).peers if p.region == "eu")
        assert eu.merges_refused == len(forged)
        assert "over_limit" in eu.last_refusal and "the state sent" in eu.last_refusal
        remembered = us.replicator.peer_stats("eu").refused
        assert {reason for reason, *_ in remembered.values()} == {"over_limit"}


@pytest.mark.slow
async def test_two_states_within_the_limits_whose_merge_is_not_are_refused(
    tmp_path: Path, certs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each push alone is a state a client could write; the second one's merge with
    what the first left is not (18 MB grew from pushes like these)."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=TlsFiles.in_dir(certs, "us"))
        async with alice(us, certs) as client:
            key = (await client.remember("lattice", "backlog", "grown", title="t")).record.key
        created = await state_of(us, key)
        assert created is not None
        stamp = Stamp(0, us.replica.clock.now(), "hostile")
        megabyte = "m" * MAX_VALUE_BYTES

        first = created.set_fields({f"a{i}": megabyte for i in range(3)}, stamp)
        assert len(codec.encode(first)) <= MAX_RECORD_BYTES
        assert await push_as_eu(us, certs, first) == 1
        grown = await state_of(us, key)
        second = created.set_fields({f"b{i}": megabyte for i in range(3)}, stamp)
        many = created.set_fields({f"c{i}": "x" for i in range(MAX_FIELDS - 1)}, stamp)
        tagged = created.add_tags([f"t{i}" for i in range(MAX_TAGS)], stamp)
        with caplog.at_level(logging.WARNING, logger="fencemark.node.replication.intake"):
            for _ in range(2):  # the second time is counted, not logged again
                assert await push_as_eu(us, certs, second) == 0
            assert await push_as_eu(us, certs, many) == 0  # 3 + 255 fields
            assert await push_as_eu(us, certs, tagged) == 1  # 256 tags are allowed ...
            more = created.add_tags(["one-too-many"], Stamp(0, us.replica.clock.now(), "h"))
            assert await push_as_eu(us, certs, more) == 0  # ... 257 are not
        assert len((await state_of(us, key)).tags) == MAX_TAGS  # type: ignore[union-attr]
        assert (await state_of(us, key)).fields == grown.fields  # type: ignore[union-attr]
        assert refused_over_limit(us, "eu") == 4
        stats = us.replicator.peer_stats("eu")
        assert "merged with this node's state" in stats.last_refusal
        logged = [r for r in caplog.records if key in r.getMessage()]
        assert len(logged) == 1, [r.getMessage()[:120] for r in logged]


@pytest.mark.slow
async def test_a_record_too_large_to_send_does_not_stop_anti_entropy(tmp_path: Path) -> None:
    """An 18 MB state, stored before merges were limited, fits no message: rounds leave
    it out and repair everything else, and it replicates again once deleted."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        # Written at eu while it is cut off, so only anti-entropy brings them to us.
        eu = await cluster.start_isolated("eu")
        async with AsyncClient(eu.address) as client:
            missed = [
                (await client.remember("lattice", "missed", f"m{i}", title="x")).record.key
                for i in range(20)
            ]
        stamp = Stamp(0, eu.replica.clock.now(), eu.replica.node_id)
        huge = Record("repo/lattice/mem/missed/huge").create("eu", stamp)
        huge = huge.set_fields({f"f{i}": "h" * MAX_VALUE_BYTES for i in range(18)}, stamp)
        assert len(codec.encode(huge)) > MAX_RECEIVE_BYTES  # no message could carry it
        await eu.storage.put(huge, hlc=eu.replica.clock.last)
        await cluster.stop("eu")

        us = await cluster.start("us")
        eu = await cluster.start("eu")

        from_eu = us.replicator.peer_stats("eu")

        async def repaired() -> bool:
            # us's own round with eu completed, not only eu's pushes: us started first,
            # its first calls found eu down, and eu's pushes may repair before us's
            # back-off ends.
            synced = from_eu.reachable and from_eu.last_sync is not None
            return synced and all([await us.storage.get(k) is not None for k in missed])

        await eventually(repaired, "us completing a round with eu, pulling eu's records")
        assert await us.storage.get(huge.key) is None
        assert from_eu.merges_refused == 1 and huge.key in from_eu.last_refusal
        assert refused_over_limit(us, "eu") == 1
        assert eu.replicator.peer_stats("us").states_too_large == 1
        # Further rounds do not ask for it again while it is unchanged.
        for _ in range(2):
            await us.replicator.sync_with("eu")
        assert from_eu.merges_refused == 1
        assert eu.replicator.peer_stats("us").states_too_large == 1

        # A client Delete makes it small again, and it replicates.
        async with AsyncClient(eu.address) as client:
            await client.delete(huge.key)
        await wait_converged([us, eu])


@pytest.mark.slow
async def test_concurrent_writes_whose_union_is_over_the_limits_wait_until_one_side_gives_way(
    tmp_path: Path,
) -> None:
    """The documented price of strict limits (docs/consistency.md, *Limits and merges*):
    each region's writes were within the limits in its own view, their union is not.
    That record stops converging, visibly; every other record keeps converging; and a
    write that brings the union within the limits lets it converge."""
    half = MAX_FIELDS // 2 + 10
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us, eu = await cluster.start_all()
        async with AsyncClient(us.address) as client:
            key = (await client.remember("lattice", "split", "wide", title="t")).record.key
        await wait_converged([us, eu])
        await cluster.stop("eu")
        async with AsyncClient(us.address) as client:
            await client.update(key, fields={f"us{i}": "x" for i in range(half)})
        eu = await cluster.start_isolated("eu")
        async with AsyncClient(eu.address) as client:
            await client.update(key, fields={f"eu{i}": "x" for i in range(half)})
            elsewhere = (await client.remember("lattice", "split", "other", title="t")).record
        await cluster.stop("eu")
        eu = await cluster.start("eu")

        async def arrived() -> bool:
            return await us.storage.get(elsewhere.key) is not None

        await eventually(arrived, "the other record written at eu reaching us")

        async def refused() -> bool:
            return refused_over_limit(us, "eu") + refused_over_limit(eu, "us") > 0

        await eventually(refused, "the union of the two sides being refused")
        mine = await state_of(us, key)
        assert mine is not None and len(mine.field_values()) == half + 1  # with the title
        # us gives way: it clears its fields, and the union fits.
        async with AsyncClient(us.address) as client:
            await client.update(key, fields={f"us{i}": "" for i in range(half)})
        await wait_converged([us, eu])
        merged = await state_of(us, key)
        assert merged is not None
        assert sorted(merged.field_values()) == sorted(["title", *(f"eu{i}" for i in range(half))])
