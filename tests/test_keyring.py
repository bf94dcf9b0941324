"""The keyring under attack: revoked signers, and signers that are slow to learn.

Two holes an attacker with a valid peer certificate found (docs/security.md,
*Signed grants*), pinned with real certificates (``fencemark certs``), real
nodes on loopback and real mutual TLS:

- a grant signed by a revoked node key (the key leaked; the certificate was
  re-issued and the old one revoked) was still merged everywhere, superseding
  the live holder: now it is refused ``revoked_signer`` once the CRL is in use;
- one peer answering ``Replication.Certificates`` slowly stalled every inbound
  merge behind one global learning lock: now only the merges that need that
  signer wait for it, and no longer than the fetch's deadline.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import codec
from fencemark.node.crdt.fence import Grant
from fencemark.node.crdt.record import Birth, Record
from fencemark.node.replication import signers
from fencemark.node.security.revocation import Revocations, read_revoked
from fencemark.node.security.signing import KEY_ID_SIZE, REVOKED_SIGNER, Keyring, Signer
from fencemark.node.security.tls import Identity, init_dir, issue_into
from fencemark.node.tools.cli import main
from fencemark.node.tools.ports import Ports
from fencemark.v1 import replication_pb2
from tests.cluster import Cluster, eventually, wait_converged
from tests.metrics import counters
from tests.test_signed_grants import (
    cert_der,
    client,
    files,
    holds_fence,
    push,
    serving,
    state_of,
    with_grant,
)

REGIONS = ["us", "eu", "ap"]
FAST = 0.1  # --tls-reload-interval: nodes take a new crl.pem within this


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=REGIONS, clients=["alice"])
    return directory


def merge_refusals(node: NodeServer) -> dict[tuple[str, ...], float]:
    return counters(node, "fencemark_replication_merges_refused", "peer", "reason")


def reissue(certs: Path, staged: Path, region: str) -> None:
    """A new certificate and key for ``region`` from the same CA, put in place file
    by file (each replaced atomically), as an operator rotating a leaked key does."""
    staged.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        shutil.copyfile(certs / name, staged / name)
    issue_into(staged, Identity("region", region))
    for name in (f"{region}.pem", f"{region}-key.pem"):
        (staged / name).replace(certs / name)


# -- revoked signers ----------------------------------------------------------------------------


def test_a_signature_is_refused_from_the_moment_its_certificates_revocation_is_loaded(
    certs: Path,
) -> None:
    revocations = Revocations()
    ring = Keyring.for_files(files(certs, "us"), revocations)
    ring.add(cert_der(certs / "eu.pem"))
    eu = Signer.from_files(files(certs, "eu"))
    key, grant = "repo/lattice/mem/backlog/k", Grant(1, "alice", "eu")
    signed = grant._replace(signature=eu.signature(key, 1, grant))
    assert ring.problem(key, 1, signed) is None
    assert main(["certs", "revoke", "--dir", str(certs), "--region", "eu"]) == 0
    assert ring.problem(key, 1, signed) is None  # on the CA's list, not yet in use here
    # What LiveTls.reload does when crl.pem changes: the list is replaced whole.
    revocations.revoked = read_revoked((certs / "ca.pem").read_bytes(), certs / "crl.pem")
    problem = ring.problem(key, 1, signed)
    assert problem is not None and problem[0] == REVOKED_SIGNER, problem
    assert "region 'eu'" in problem[1]
    # Only a genuine signature is called revoked; a mangled one stays bad_signature.
    mangled = signed._replace(owner="mallory")
    assert ring.problem(key, 1, mangled) == (
        "bad_signature",
        "token 1: the signature does not match what it signs",
    )


@pytest.mark.slow
async def test_a_grant_signed_by_a_revoked_key_is_refused_and_the_holder_keeps_its_claim(
    tmp_path: Path, certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The incident: eu's key leaked, eu got a new certificate and the old one was
    revoked; whoever holds the old key and ap's certificate pushed a grant for an
    eu-homed record signed with the old key. It was merged by us, then ap and eu,
    and alice's renewal answered ``superseded``. Now every node refuses it, alice
    keeps her claim, and what the old key signed before its revocation stays."""
    async with Cluster(tmp_path / "cluster", REGIONS, tls_reload_interval=FAST) as cluster:
        nodes = {r: await cluster.start(r, tls=files(certs, r)) for r in REGIONS}
        us, eu, ap = nodes["us"], nodes["eu"], nodes["ap"]
        await serving(eu, certs)
        async with client(eu, certs) as alice:
            key = (await alice.remember("lattice", "backlog", "held")).record.key
            token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
        await wait_converged([us, eu, ap])
        old = Signer.from_files(files(certs, "eu"))  # the key that leaks
        assert (await state_of(us, key)).fence.grants[token].signature[:KEY_ID_SIZE] == (old.key_id)
        for node in (us, ap):
            assert old.key_id in node.replica.keyring  # type: ignore[operator]

        # eu gets a new certificate, then the old one is revoked.
        leaked = tmp_path / "leaked-eu.pem"
        shutil.copyfile(certs / "eu.pem", leaked)
        reissue(certs, tmp_path / "reissued", "eu")
        new = Signer.from_files(files(certs, "eu"))

        async def eu_signs_with_its_new_key() -> bool:
            signer = eu.replica.signer
            return signer is not None and signer.key_id == new.key_id

        await eventually(eu_signs_with_its_new_key, "eu taking its new certificate")
        assert main(["certs", "revoke", "--dir", str(certs), "--cert", str(leaked)]) == 0

        async def every_node_has_the_crl() -> bool:
            return all(n.tls is not None and n.tls.revocations.revoked for n in nodes.values())

        await eventually(every_node_has_the_crl, "every node taking crl.pem in")
        capsys.readouterr()

        # The forgery: mallory's grant above alice's, signed with the leaked key.
        held = await state_of(us, key)
        now = us.replica.clock.wall_ms()
        grant = Grant(us.replica.clock.now(), "mallory", "eu")
        forged = with_grant(
            held, token + 1, grant._replace(signature=old.signature(key, token + 1, grant)),
            now + 60_000,
        )  # fmt: skip
        for target, sender in ((us, "ap"), (eu, "ap"), (ap, "us")):
            assert await push(target, certs, sender, forged) == 0, target.config.region
            stats = target.replicator.peer_stats(sender)
            assert stats.merges_refused == 1, stats.last_refusal
            assert "revoked_signer" in stats.last_refusal, stats.last_refusal
            assert merge_refusals(target) == {(sender, "revoked_signer"): 1.0}
            assert (await state_of(target, key)).fence.fence == token

        # alice still holds the claim and renews it; the renewal reaches every node,
        # where alice's grant (signed before the revocation) stays merged.
        async with client(eu, certs) as alice:
            renewed = await alice.renew_claim(key, token, lease_seconds=120)
            assert renewed.renewed, renewed.reason
            status = await alice.claim_status(key)
            assert status.fence == token
            assert status.claim is not None and status.claim.owner == "alice"
            await alice.update(key, fields={"body": "still mine"}, fencing_token=token)
        await wait_converged([us, eu, ap])
        for node in (us, ap):
            record = await state_of(node, key)
            assert record.fence.fence == token
            assert record.fence.grants[token].signature[:KEY_ID_SIZE] == old.key_id
            assert node.replicator.peer_stats("eu").merges_refused == 0

        # What the new key signs is merged everywhere.
        async with client(eu, certs) as alice:
            after = (await alice.remember("lattice", "backlog", "after")).record.key
            after_token = (await alice.claim(after, "bob", lease_seconds=60)).fencing_token

        async def merged_everywhere() -> bool:
            return all([await holds_fence(n, after, after_token) for n in (us, ap)])

        await eventually(merged_everywhere, "the new key's grant merged by us and ap")
        for node in (us, ap):
            assert new.key_id in node.replica.keyring  # type: ignore[operator]

        # fencemark status shows the refusal with its reason.
        code = await asyncio.to_thread(
            main,
            ["status", "--targets", us.address, "--tls-dir", str(certs), "--tls-name", "alice"],
        )
        assert code == 0
        shown = capsys.readouterr().out
        lines = shown.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("peer ap")]
        assert "REFUSED 1 states" in lines[at], lines[at]
        assert "last refused state" in lines[at + 1] and "revoked_signer" in lines[at + 1]


@pytest.mark.slow
async def test_a_birth_signed_by_a_revoked_key_never_takes_a_home(
    tmp_path: Path, certs: Path
) -> None:
    """Issue 33, finding 7 (its revoked half): a birth of eu, back-dated before us's,
    signed with eu's revoked key and relayed by another region, was accepted
    everywhere: the home of a record alice held at us moved to eu, and her renewal
    answered ``wrong_region``. A birth that would take a home from another region's
    is refused when its key is revoked (``revoked_signer``), relayed or not; the home
    stays, and alice renews. (eu had seen alice's claim, so that birth is void by its
    sighting first — ``test_signed_grants``; the refusal is shown on a record nobody
    claimed, which eu's node had no reason to say it saw.)"""
    async with Cluster(tmp_path / "cluster", REGIONS, tls_reload_interval=FAST) as cluster:
        nodes = {r: await cluster.start(r, tls=files(certs, r)) for r in REGIONS}
        us, eu, ap = nodes["us"], nodes["eu"], nodes["ap"]
        await serving(us, certs)
        async with client(us, certs) as alice:
            made = await alice.remember("lattice", "backlog", "homed", tags=["homeRegion:us"])
            key = made.record.key
            token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
            made = await alice.remember("lattice", "backlog", "quiet", tags=["homeRegion:us"])
            quiet = made.record.key
        async with client(eu, certs) as bob:  # a birth eu signs: every node knows its key
            await bob.remember("lattice", "backlog", "of-eu", tags=["homeRegion:eu"])
        await wait_converged([us, eu, ap])
        old = Signer.from_files(files(certs, "eu"))  # the key that leaks
        for node in (us, ap):
            assert old.key_id in node.replica.keyring  # type: ignore[operator]
        leaked = tmp_path / "leaked-eu.pem"
        shutil.copyfile(certs / "eu.pem", leaked)
        reissue(certs, tmp_path / "reissued", "eu")
        assert main(["certs", "revoke", "--dir", str(certs), "--cert", str(leaked)]) == 0

        async def every_node_has_the_crl() -> bool:
            return all(n.tls is not None and n.tls.revocations.revoked for n in nodes.values())

        await eventually(every_node_has_the_crl, "every node taking crl.pem in")

        def back_dated(held: Record) -> Record:
            ours = held.births["us"].stamp
            earlier = Birth(ours._replace(hlc=ours.hlc - (1 << 16)))  # a millisecond before
            return old.sign_birth(held.with_birth("eu", earlier), "eu")

        forged = back_dated(await state_of(us, quiet))
        assert forged.home_region == "eu", "premise: merged as it is, it takes the home"
        for target, sender in ((us, "ap"), (ap, "us"), (eu, "ap")):
            assert await push(target, certs, sender, forged) == 0, target.config.region
            stats = target.replicator.peer_stats(sender)
            assert "revoked_signer" in stats.last_refusal, stats.last_refusal
            assert (await state_of(target, quiet)).home_region == "us"
        claimed = back_dated(await state_of(us, key))
        assert claimed.home_region == "us"  # void: eu had seen alice's claim
        for target, sender in ((us, "ap"), (ap, "us")):
            await push(target, certs, sender, claimed)
            assert (await state_of(target, key)).home_region == "us"
        async with client(us, certs) as alice:
            renewed = await alice.renew_claim(key, token, lease_seconds=60)
        assert renewed.renewed, renewed.reason


# -- slow signers -------------------------------------------------------------------------------


class SlowPeer:
    """A peer's node that answers ``Certificates`` only once ``release`` is set (or
    never, until the caller gives up); every other method is UNIMPLEMENTED. With
    ``certificate`` empty, it knows no certificate (it answers none)."""

    def __init__(self, certificate: bytes) -> None:
        self.certificate = certificate
        self.calls = 0
        self.asked = asyncio.Event()  # a Certificates call arrived
        self.release = asyncio.Event()  # the test lets it answer
        self.ended = asyncio.Event()  # a call answered, or its caller gave up on it

    async def certificates(
        self, request: replication_pb2.CertificatesRequest, context: Any
    ) -> replication_pb2.CertificatesResponse:
        self.calls += 1
        self.asked.set()
        try:
            await asyncio.wait_for(self.release.wait(), 60)
            known = [self.certificate] if self.certificate else []
            return replication_pb2.CertificatesResponse(certificates=known)
        finally:
            self.ended.set()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        method = grpc.unary_unary_rpc_method_handler(
            self.certificates,
            request_deserializer=replication_pb2.CertificatesRequest.FromString,
            response_serializer=replication_pb2.CertificatesResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            "fencemark.v1.Replication", {"Certificates": method}
        )


async def slow_eu(cluster: Cluster, certs: Path) -> tuple[bytes, int, SlowPeer, grpc.aio.Server]:
    """eu's state of a record claimed there (signed by eu's key), made by eu's real
    node alone (so no other node knows eu's certificate yet); then, at eu's address
    and with eu's certificate, a SlowPeer instead of eu's node."""
    eu = await cluster.start_isolated("eu", tls=files(certs, "eu"))
    async with client(eu, certs) as alice:
        key = (await alice.remember("lattice", "backlog", "slow")).record.key
        token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
    state = (await eu.storage.states([key]))[key]
    await cluster.stop("eu")
    peer = SlowPeer(cert_der(certs / "eu.pem"))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((peer.handler(),))
    server.add_secure_port(cluster.addresses["eu"], files(certs, "eu").server_credentials())
    await server.start()
    return state, token, peer, server


async def test_a_slow_signer_holds_up_only_the_merges_that_need_it(
    tmp_path: Path, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The incident: a fake eu answering Certificates slowly, pushing states signed
    by a key us does not know, made an ordinary push from ap wait behind one global
    learning lock. Now ap's push (which needs no new signer) is merged while the
    slow fetch is still in flight; the merges that need eu's key all await that one
    fetch, and merge once it answers."""
    # A long deadline, so that only who waits for whom is under test: behind one
    # global lock, ap's push could not land before this fetch ended.
    monkeypatch.setattr(signers, "TIMEOUT_S", 30.0)
    async with Cluster(tmp_path / "cluster", REGIONS) as cluster:
        state, token, fake, server = await slow_eu(cluster, certs)
        record = codec.decode(state)
        pushes: list[asyncio.Task[int]] = []
        try:
            us = await cluster.start("us", tls=files(certs, "us"))
            ap = await cluster.start("ap", tls=files(certs, "ap"))
            pushes.append(asyncio.create_task(push(us, certs, "eu", record)))
            await asyncio.wait_for(fake.asked.wait(), 15)
            pushes.append(asyncio.create_task(push(us, certs, "eu", record)))  # needs it too

            async with client(ap, certs) as alice:
                key = (await alice.remember("lattice", "backlog", "ordinary")).record.key

            async def us_has_aps_write() -> bool:
                return await us.storage.get(key) is not None

            await eventually(us_has_aps_write, "ap's push merged at us")
            assert not fake.ended.is_set(), "ap's push waited for the slow signer"
            assert not any(p.done() for p in pushes)

            fake.release.set()
            merged = await asyncio.gather(*pushes)
            assert sorted(merged) == [0, 1]  # one fetch, then both merged it
            assert fake.calls == 1
            stats = us.replicator.peer_stats("eu")
            assert stats.merges_refused == 0, stats.last_refusal
            assert (await state_of(us, record.key)).fence.fence == token
            eu_key = Signer.from_files(files(certs, "eu")).key_id
            assert eu_key in us.replica.keyring  # type: ignore[operator]
        finally:
            fake.release.set()
            await asyncio.gather(*pushes, return_exceptions=True)
            await server.stop(0)


@pytest.mark.slow
async def test_a_signer_fetch_that_runs_past_its_deadline_is_refused_and_asked_again_later(
    tmp_path: Path, certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that never answers Certificates: the state is refused unknown_signer
    once the fetch's deadline passes, an exchange right after it is refused without
    asking again (no loop), and a later one asks again and merges."""
    monkeypatch.setattr(signers, "TIMEOUT_S", 1.0)
    async with Cluster(tmp_path / "cluster", REGIONS) as cluster:
        state, token, fake, server = await slow_eu(cluster, certs)
        try:
            record = codec.decode(state)
            us = await cluster.start("us", tls=files(certs, "us"))
            assert await push(us, certs, "eu", record) == 0
            await asyncio.wait_for(fake.ended.wait(), 15)  # us gave up on it
            stats = us.replicator.peer_stats("eu")
            assert "unknown_signer" in stats.last_refusal, stats.last_refusal
            assert await us.storage.get(record.key) is None
            assert await push(us, certs, "eu", record) == 0  # throttled: not asked
            assert fake.calls == 1
            assert merge_refusals(us) == {("eu", "unknown_signer"): 2.0}

            fake.release.set()  # it answers from now on

            async def merged_by_a_later_exchange() -> bool:
                return await push(us, certs, "eu", record) == 1

            await eventually(merged_by_a_later_exchange, "a later push merging", every=0.5)
            assert fake.calls == 2
            assert (await state_of(us, record.key)).fence.fence == token
        finally:
            await server.stop(0)


async def test_a_signer_is_asked_for_at_each_address_of_a_region_until_one_knows_it(
    tmp_path: Path, certs: Path
) -> None:
    """eu as a region of several members, reached at three addresses: the first one
    down, the second a member that has not merged eu's grant yet (it knows no
    certificate to answer with), the third one that has. A state signed by eu's key,
    relayed by eu, is merged at once: the certificate is asked for at each address in
    turn until one knows it, not refused ``unknown_signer`` until a later exchange."""
    async with Cluster(tmp_path / "cluster", REGIONS) as cluster:
        state, token, knowing, server = await slow_eu(cluster, certs)
        knowing.release.set()
        unknowing = SlowPeer(b"")
        unknowing.release.set()
        ports = Ports()
        closed, behind = ports.address(), ports.address()
        other = grpc.aio.server()
        other.add_generic_rpc_handlers((unknowing.handler(),))
        other.add_secure_port(behind, files(certs, "eu").server_credentials())
        await other.start()
        try:
            record = codec.decode(state)
            peers = {
                "eu": f"{closed},{behind},{cluster.addresses['eu']}",
                "ap": cluster.addresses["ap"],
            }
            us = await cluster.start("us", tls=files(certs, "us"), peers=peers)
            assert await push(us, certs, "eu", record) == 1
            assert (unknowing.calls, knowing.calls) == (1, 1)
            stats = us.replicator.peer_stats("eu")
            assert stats.merges_refused == 0, stats.last_refusal
            assert (await state_of(us, record.key)).fence.fence == token
        finally:
            await other.stop(0)
            await server.stop(0)
            ports.close()
