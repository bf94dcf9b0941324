"""Claims bound to identities (SPEC §4, issue 14): a fencing token is not a bearer credential.

The hole these tests pin, found by a security review of three TLS regions with an
access map: a grant did not record who it was granted to, so ``bob`` (who may
claim) could claim with ``owner="worker-alice"`` and be handed alice's token as an
idempotent retry, write with it, renew it and release it, and a ``read`` identity
saw the token in ``ClaimStatus``. Now a grant records the identity it was made to
(``Grant.identity``), and only that identity, or one the access map lets act for
others (``act-for-others``), may use its token (docs/security.md, *Claims are bound
to identities*).

Real components only: certificates from ``fencemark certs`` (``init_dir``), nodes
serving mutual TLS on loopback with an access map, the published client.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, ClaimConflict, PermissionDenied, tls_credentials
from fencemark.node.api.authz import load_access
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Record, codec
from fencemark.node.security.tls import init_dir
from fencemark.v1 import replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster, eventually
from tests.conftest import StartNode
from tests.metrics import refusals
from tests.test_cli import fencemark
from tests.test_mcp import call, tools_of
from tests.test_mcp_walkthrough import expect_ok
from tests.test_tls import client, files

REGIONS = ["us", "eu", "ap"]
CLIENTS = ["alice", "bob", "reader", "ops", "mcp"]
ACCESS = """\
[clients]
alice = ["read", "write", "claim"]
bob = ["read", "write", "claim"]
mcp = ["read", "write", "claim"]
reader = ["read"]
ops = ["read", "write", "claim", "act-for-others"]
"""
OWNER = "worker-alice"


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=REGIONS, clients=CLIENTS)
    return directory


@pytest.fixture
async def cluster(tmp_path: Path, certs: Path) -> AsyncIterator[Cluster]:
    """us, eu and ap over mutual TLS with the access map, every one deciding claims."""
    access_file = tmp_path / "access.toml"
    access_file.write_text(ACCESS)
    async with Cluster(tmp_path, REGIONS, access=load_access(access_file)) as nodes:
        for region in REGIONS:
            await nodes.start(region, tls=files(certs, region))
        for region in REGIONS:
            await serving(nodes[region], certs)
        yield nodes


async def serving(node: NodeServer, certs: Path) -> None:
    async def claims_serving() -> bool:
        async with client(node, certs, "reader") as c:
            return (await c.info()).claims_serving

    await eventually(claims_serving, f"{node.config.region} deciding claims")


async def alice_holds(cluster: Cluster, certs: Path, name: str) -> tuple[str, int]:
    """A record homed at us, claimed there by alice as ``worker-alice``: (key, token).

    Returned once eu's and ap's sightings of the claimed record are back at us
    (``Record.seen``): the state a refused call must leave unchanged includes them,
    and one arriving between a test's two looks would be a change no call made."""
    us = cluster["us"]
    async with client(us, certs, "alice") as alice:
        made = await alice.remember("lattice", "backlog", name, tags=["homeRegion:us"])
        granted = await alice.claim(made.record.key, OWNER, lease_seconds=60)
    assert granted.granted, granted
    key = made.record.key
    await eventually(functools.partial(sighted_by, us, key, {"eu", "ap"}), "sightings at us")
    return key, granted.fencing_token


async def state_of(node: NodeServer, key: str) -> tuple[Record, bytes]:
    stored = await node.storage.get(key)
    assert stored is not None, f"{node.config.region} has no {key}"
    return stored.record, stored.digest


async def sighted_by(node: NodeServer, key: str, regions: set[str]) -> bool:
    stored = await node.storage.get(key)
    return stored is not None and regions <= set(stored.record.seen)


async def holds_fence(node: NodeServer, key: str, token: int) -> bool:
    stored = await node.storage.get(key)
    return stored is not None and stored.record.fence.fence == token


def not_holder(refused: pytest.ExceptionInfo[PermissionDenied], who: str) -> None:
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert (refused.value.reason, refused.value.identity) == ("not_holder", f"client/{who}")
    assert refused.value.right == "act-for-others"


async def test_a_claim_with_alices_owner_name_from_bob_is_contended_not_her_token(
    cluster: Cluster, certs: Path
) -> None:
    """The hole's first step: bob claimed as ``worker-alice`` and got her token back
    as an idempotent retry. A retry is the same owner *from the same identity*."""
    us = cluster["us"]
    key, token = await alice_holds(cluster, certs, "contended")
    _, before = await state_of(us, key)
    async with client(us, certs, "bob") as bob:
        taken = await bob.claim(key, OWNER, lease_seconds=60)
        assert (taken.granted, taken.reason, taken.fencing_token) == (False, "contended", 0)
        assert taken.lease_expires_at is None
    _, after = await state_of(us, key)
    assert after == before  # not even alice's lease was extended by bob's call
    async with client(us, certs, "alice") as alice:
        again = await alice.claim(key, OWNER, lease_seconds=60)
        assert (again.granted, again.fencing_token) == (True, token)  # her own retry still is
        assert (await alice.release_claim(key, token)).released
    # Free again: bob's claim under that owner name is a new grant, bound to bob, and
    # now alice's "retry" is the other claimer's.
    async with client(us, certs, "bob") as bob:
        taken = await bob.claim(key, OWNER, lease_seconds=60)
        assert (taken.granted, taken.fencing_token) == (True, token + 1)
    async with client(us, certs, "alice") as alice:
        lost = await alice.claim(key, OWNER, lease_seconds=60)
        assert (lost.granted, lost.reason) == (False, "contended")
    record, _ = await state_of(us, key)
    assert record.fence.grants[token].identity == "client/alice"
    assert record.fence.grants[token + 1].identity == "client/bob"


async def test_bob_cannot_renew_release_or_write_with_alices_token(
    cluster: Cluster, certs: Path
) -> None:
    """The rest of the hole: with her token bob wrote, renewed and released (alice
    then heard ``released``). Each is refused ``not_holder`` and changes nothing."""
    us = cluster["us"]
    key, token = await alice_holds(cluster, certs, "not-hers")
    _, before = await state_of(us, key)
    async with client(us, certs, "bob") as bob:
        with pytest.raises(PermissionDenied) as renew:
            await bob.renew_claim(key, token, lease_seconds=60)
        not_holder(renew, "bob")
        with pytest.raises(PermissionDenied) as release:
            await bob.release_claim(key, token)
        not_holder(release, "bob")
        with pytest.raises(PermissionDenied) as update:
            await bob.update(key, fields={"body": "bob was here"}, fencing_token=token)
        not_holder(update, "bob")
        with pytest.raises(PermissionDenied) as delete:
            await bob.delete(key, fencing_token=token)
        not_holder(delete, "bob")
        with pytest.raises(PermissionDenied) as remember:
            await bob.remember("lattice", "backlog", "not-hers", body="x", fencing_token=token)
        not_holder(remember, "bob")
        with pytest.raises(ClaimConflict) as unfenced:  # as before: the claim is live
            await bob.update(key, fields={"body": "bob was here"})
        assert unfenced.value.reason == "claimed"
    _, after = await state_of(us, key)
    assert after == before
    refused = refusals(us)  # counted like every refusal, by its machine-readable reason
    for method in ("RenewClaim", "ReleaseClaim", "Update", "Delete", "Remember"):
        assert refused[(method, "not_holder")] == 1, method
    async with client(us, certs, "alice") as alice:
        assert (await alice.renew_claim(key, token, lease_seconds=60)).renewed
        written = await alice.update(key, fields={"body": "alice's"}, fencing_token=token)
        assert written.fields["body"] == "alice's"


async def test_a_read_identity_sees_the_claim_but_not_its_token(
    cluster: Cluster, certs: Path
) -> None:
    """ClaimStatus shows the token only to its holder's identity and to identities
    that act for others; everyone else sees the owner and expiry, token 0 — at the
    home and at any other node, which holds the grant's identity by replication."""
    key, token = await alice_holds(cluster, certs, "status")
    for region in ("us", "eu"):
        node = cluster[region]
        await eventually(functools.partial(holds_fence, node, key, token), f"{region} merging")
        seen = {}
        for name in ("reader", "bob", "alice", "ops"):
            async with client(node, certs, name) as c:
                status = await c.claim_status(key)
            assert status.claim is not None, (region, name)
            assert status.claim.owner == OWNER and status.claim.lease_expires_at is not None
            seen[name] = status.claim.fencing_token
        assert seen == {"reader": 0, "bob": 0, "alice": token, "ops": token}, region


async def test_history_hides_the_live_token_and_the_holders_identity_as_status_does(
    cluster: Cluster, certs: Path
) -> None:
    """Issue 33, finding 8: Records.History showed the live token and the holder's
    identity to a reader, to another client and to node certificates, which
    ClaimStatus hides. Now each sees of the history what ClaimStatus shows it: the
    live token only to alice and to ops (act-for-others), alice's identity likewise;
    an ended claim's token is no secret (it is refused for good)."""
    key, first = await alice_holds(cluster, certs, "history")
    async with client(cluster["us"], certs, "alice") as alice:
        assert (await alice.release_claim(key, first)).released
        again = await alice.claim(key, OWNER, lease_seconds=60)
    live = again.fencing_token
    seen = {}
    for name in ("reader", "bob", "us", "alice", "ops"):
        async with client(cluster["us"], certs, name) as c:
            events = (await c.history(key)).events
        seen[name] = [(e.kind, e.fencing_token, e.identity) for e in events]
    hidden = [("granted", first, ""), ("released", first, ""), ("granted", 0, "")]
    shown = [("granted", first, "client/alice"), ("released", first, "client/alice"),
             ("granted", live, "client/alice")]  # fmt: skip
    assert seen == {"reader": hidden, "bob": hidden, "us": hidden, "alice": shown, "ops": shown}


async def test_an_identity_that_acts_for_others_may_release_alices_claim(
    cluster: Cluster, certs: Path
) -> None:
    """``act-for-others`` (an operator's right) lets ops act on the claim as its holder
    would: the retry by owner name, a renewal, the release. Alice then hears
    ``released`` — the outcome the holder of a released token always hears."""
    us = cluster["us"]
    key, token = await alice_holds(cluster, certs, "ops")
    async with client(us, certs, "ops") as ops:
        retry = await ops.claim(key, OWNER, lease_seconds=60)
        assert (retry.granted, retry.fencing_token) == (True, token)
        assert (await ops.renew_claim(key, token, lease_seconds=60)).renewed
        released = await ops.release_claim(key, token)
        assert (released.released, released.fence) == (True, token)
    async with client(us, certs, "alice") as alice:
        renewed = await alice.renew_claim(key, token)
        assert (renewed.renewed, renewed.reason) == (False, "released")
        with pytest.raises(ClaimConflict) as write:
            await alice.update(key, fields={"body": "late"}, fencing_token=token)
        assert write.value.reason == "released"
        await alice.update(key, fields={"body": "unfenced"})  # readmitted


async def test_alices_own_flow_is_unchanged(cluster: Cluster, certs: Path) -> None:
    """The walkthrough of SPEC §1 for one identity: claim, retry, fenced writes,
    renew, release (idempotent), unfenced writes readmitted, the fence kept."""
    us = cluster["us"]
    key, token = await alice_holds(cluster, certs, "own")
    async with client(us, certs, "alice") as alice:
        with pytest.raises(ClaimConflict) as unfenced:
            await alice.update(key, fields={"body": "started"})
        assert unfenced.value.reason == "claimed"
        assert (await alice.claim(key, OWNER, lease_seconds=60)).fencing_token == token
        written = await alice.update(key, fields={"body": "started"}, fencing_token=token)
        assert written.fields["body"] == "started"
        renewed = await alice.renew_claim(key, token, lease_seconds=120)
        assert (renewed.renewed, renewed.fencing_token) == (True, token)
        for _ in range(2):
            released = await alice.release_claim(key, token)
            assert (released.released, released.fence) == (True, token)
        assert (await alice.update(key, fields={"body": "free"})).fields["body"] == "free"
        status = await alice.claim_status(key)
        assert (status.claim, status.fence) == (None, token)


async def test_a_grant_merged_at_another_region_keeps_its_identity(
    cluster: Cluster, certs: Path
) -> None:
    """Replication carries the identity with the grant, signed by the home: a peer
    that rebinds alice's grant to bob (keeping the home's signature) is refused, and
    every region keeps alice's."""
    us, eu = cluster["us"], cluster["eu"]
    key, token = await alice_holds(cluster, certs, "replicated")
    for region in ("eu", "ap"):
        node = cluster[region]
        await eventually(functools.partial(holds_fence, node, key, token), f"{region} merging")
        record, _ = await state_of(cluster[region], key)
        grant = record.fence.grants[token]
        assert (grant.identity, grant.owner) == ("client/alice", OWNER)
        assert grant.signature  # the home's, over the identity too (codec.grant_message)

    held, digest = await state_of(us, key)
    rebound = held.fence.grants[token]._replace(identity="client/bob")
    fence = dataclasses.replace(held.fence, grants={**held.fence.grants, token: rebound})
    forged = codec.encode(held.with_fence(fence))
    credentials = files(certs, "eu").channel_credentials()
    async with grpc.aio.secure_channel(us.address, credentials) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        request = replication_pb2.PushRequest(
            origin=replication_pb2.Origin(region="eu", node_id="hostile", hlc=0), states=[forged]
        )
        pushed: replication_pb2.PushResponse = await stub.Push(request, timeout=10)
    assert pushed.merged == 0
    assert "bad_signature" in us.replicator.peer_stats("eu").last_refusal
    assert (await state_of(us, key))[1] == digest
    async with client(eu, certs, "bob") as bob:
        assert (await bob.claim_status(key)).claim.fencing_token == 0  # type: ignore[union-attr]


async def test_without_tls_a_token_is_a_bearer_credential(start_node: StartNode) -> None:
    """``--insecure`` knows no identities (docs/security.md): any caller that presents
    a token may use it, and a claim by the holder's owner name is a retry."""
    node = await start_node()
    async with AsyncClient(node.address) as one, AsyncClient(node.address) as other:
        key = (await one.remember("lattice", "backlog", "bearer")).record.key
        token = (await one.claim(key, OWNER, lease_seconds=60)).fencing_token
        assert (await other.claim(key, OWNER, lease_seconds=60)).fencing_token == token
        assert (await other.claim_status(key)).claim.fencing_token == token  # type: ignore[union-attr]
        assert (await other.release_claim(key, token)).released
    record, _ = await state_of(node, key)
    assert record.fence.grants[token].identity == ""


async def test_the_mcp_server_claims_as_its_own_identity(cluster: Cluster, certs: Path) -> None:
    """Every agent behind one ``fencemark mcp`` is that server's identity: its own
    claims work as before (owner names tell its agents apart), and a token granted
    to another identity is a tool error naming ``not_holder``."""
    us = cluster["us"]
    key, token = await alice_holds(cluster, certs, "mcp")
    async with tools_of(us.address, credentials=tls_credentials(certs, "mcp")) as tools:
        status = expect_ok(await call(tools, "repocontext_claim_status", key=key))
        assert status["claim"] == {
            "owner": OWNER, "leaseExpiresAtUtc": status["claim"]["leaseExpiresAtUtc"]
        }  # fmt: skip
        refused = await call(
            tools, "repocontext_update", key=key, fields={"body": "x"}, fencingToken=token
        )
        assert refused.is_error and refused.text.startswith("PermissionDenied (not_holder)")
        taken = await call(tools, "repocontext_claim", key=key, owner=OWNER, leaseSeconds=60)
        assert (taken.structured["granted"], taken.structured["reason"]) == (False, "contended")

        other = expect_ok(
            await call(tools, "repocontext_remember", repoId="lattice", topic="backlog", id="m2")
        )["record"]["key"]
        held = expect_ok(
            await call(tools, "repocontext_claim", key=other, owner="agent-1", leaseSeconds=60)
        )
        mine = held["fencingToken"]
        again = expect_ok(
            await call(tools, "repocontext_claim", key=other, owner="agent-1", leaseSeconds=60)
        )
        assert again["fencingToken"] == mine
        written = expect_ok(
            await call(
                tools, "repocontext_update", key=other, fields={"body": "done"}, fencingToken=mine
            )
        )
        assert written["record"]["body"] == "done"
        renew = {"key": other, "fencingToken": mine, "leaseSeconds": 60}
        assert expect_ok(await call(tools, "repocontext_renew_claim", **renew))["renewed"]
        release = {"key": other, "fencingToken": mine}
        assert expect_ok(await call(tools, "repocontext_release_claim", **release))["released"]


@pytest.mark.slow
async def test_the_cli_acts_as_the_identity_of_its_tls_name(cluster: Cluster, certs: Path) -> None:
    """Each ``fencemark`` command is a new process and connection; the identity, not
    the connection, holds the claim, so claim, renew and release in three commands
    work for alice, and bob's release of her token is refused ``not_holder``."""
    us = cluster["us"]
    async with client(us, certs, "alice") as alice:
        made = await alice.remember("lattice", "backlog", "cli", tags=["homeRegion:us"])
    key = made.record.key

    def as_(name: str) -> list[str]:
        return ["--target", us.address, "--tls-dir", str(certs), "--tls-name", name]

    claimed = (await fencemark("claim", key, "--owner", OWNER, *as_("alice"))).json()
    token = str(claimed["fencing_token"])
    renewed = await fencemark("renew-claim", key, "--fencing-token", token, *as_("alice"))
    assert renewed.json()["renewed"] is True
    refused = await fencemark("release-claim", key, "--fencing-token", token, *as_("bob"))
    assert refused.code == 1
    assert refused.stderr.startswith("fencemark: PERMISSION_DENIED not_holder (client/bob): ")
    released = await fencemark("release-claim", key, "--fencing-token", token, *as_("alice"))
    assert released.json()["released"] is True
