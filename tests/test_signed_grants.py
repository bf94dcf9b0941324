"""Grants signed by the home region (issue 7): real certificates, real nodes, real mTLS.

The threat: a configured peer's node (or its stolen key) holds a valid node
certificate of its own region and forges a grant naming a record's home, within
every integrity bound. With TLS the home signs each grant with its node key and
a merge refuses a fence grant its home did not sign (fencemark.node.security.signing,
docs/security.md *Signed grants*). Certificates come from ``fencemark certs``
(``init_dir``/``issue_into``), nodes are the in-process gRPC servers on loopback,
the hostile peer speaks ``Replication.Push`` with its real certificate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import sqlite3
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from fencemark.client import AsyncClient, tls_credentials
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import Birth, Record, Stamp, codec
from fencemark.node.crdt.fence import Grant
from fencemark.node.security.signing import KEY_ID_SIZE, Keyring, Signer, key_id
from fencemark.node.security.tls import Identity, TlsFiles, init_dir, issue_into
from fencemark.v1 import replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster, all_deciding, eventually, wait_converged
from tests.conftest import StartNode

REGIONS = ["us", "eu", "ap"]


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=REGIONS, clients=["alice"])
    return directory


def files(certs: Path, name: str) -> TlsFiles:
    return TlsFiles.in_dir(certs, name)


def client(node: NodeServer, certs: Path) -> AsyncClient:
    credentials = tls_credentials(certs, "alice")
    return AsyncClient(node.address, credentials=credentials, retries=0, timeout=5)


def cert_der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(Encoding.DER)


async def serving(node: NodeServer, certs: Path) -> None:
    async def claims_serving() -> bool:
        async with client(node, certs) as c:
            return (await c.info()).claims_serving

    await eventually(claims_serving, f"{node.config.region} deciding claims")


async def state_of(node: NodeServer, key: str) -> Record:
    stored = await node.storage.get(key)
    assert stored is not None, f"{node.config.region} has no {key}"
    return stored.record


async def holds_fence(node: NodeServer, key: str, token: int) -> bool:
    stored = await node.storage.get(key)
    return stored is not None and stored.record.fence.fence == token


async def sighted(node: NodeServer, key: str, region: str) -> bool:
    stored = await node.storage.get(key)
    return stored is not None and region in stored.record.seen


async def start_us_and_eu(cluster: Cluster, certs: Path) -> tuple[NodeServer, NodeServer]:
    """us and eu of the three regions, deciding; ap as a node yet to join. A new
    cluster decides once every node has caught up with every peer it has
    (docs/consistency.md, *Catch-up*), so all three start, then ap is stopped and its
    disk wiped: when it starts again it knows nothing, as a new node."""
    nodes = [await cluster.start(region, tls=files(certs, region)) for region in REGIONS]
    for node in nodes:
        await serving(node, certs)
    await cluster.stop("ap")
    cluster.wipe("ap")
    return nodes[0], nodes[1]


async def claimed_at_us(cluster: Cluster, certs: Path, name: str) -> tuple[str, int, Record]:
    """Start us and eu, remember ``name`` at us and claim it for alice; once eu has
    it too: (key, token, us's state)."""
    us, eu = await start_us_and_eu(cluster, certs)
    await serving(us, certs)
    async with client(us, certs) as alice:
        key = (await alice.remember("lattice", "backlog", name)).record.key
        token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
    await wait_converged([us, eu])
    return key, token, await state_of(us, key)


async def push(node: NodeServer, certs: Path, origin: str, state: Record) -> int:
    """Replication.Push from ``origin``'s node, with its own certificate."""
    credentials = files(certs, origin).channel_credentials()
    async with grpc.aio.secure_channel(node.address, credentials) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        request = replication_pb2.PushRequest(
            origin=replication_pb2.Origin(region=origin, node_id="hostile", hlc=0),
            states=[codec.encode(state)],
        )
        response: replication_pb2.PushResponse = await stub.Push(request, timeout=10)
        return response.merged


def databases(path: Path) -> list[Path]:
    return list(path.glob("**/fencemark.sqlite3"))


def with_grant(record: Record, token: int, grant: Grant, expiry_ms: int) -> Record:
    """``record`` with one more grant, exactly as given (no re-signing)."""
    fence = record.fence.grant(token, grant._replace(signature=b""), expiry_ms)
    grants = {**fence.grants, token: grant}
    return record.with_fence(dataclasses.replace(fence, grants=grants))


# -- the keyring ------------------------------------------------------------------------------


def test_the_keyring_takes_only_node_certificates_of_the_cluster_ca(
    certs: Path, tmp_path: Path
) -> None:
    ring = Keyring.for_files(files(certs, "us"))
    us = Signer.from_files(files(certs, "us"))
    assert us.key_id in ring and len(ring) == 1
    assert ring.add(cert_der(certs / "eu.pem")) == Signer.from_files(files(certs, "eu")).key_id
    with pytest.raises(ValueError, match="not a node certificate"):
        ring.add(cert_der(certs / "alice.pem"))  # a client of the CA signs no grant
    other = tmp_path / "other-ca"
    init_dir(other, regions=["us"])
    with pytest.raises(ValueError, match="not issued by the cluster CA"):
        ring.add(cert_der(other / "us.pem"))
    with pytest.raises(ValueError, match="not a DER certificate"):
        ring.add(b"\x30\x03junk")
    assert len(ring) == 2
    # A key id is the certificate's key, so a re-issued certificate is a new signer.
    public = x509.load_pem_x509_certificate((certs / "us.pem").read_bytes()).public_key()
    assert key_id(public) == us.key_id  # type: ignore[arg-type]
    assert len(us.key_id) == KEY_ID_SIZE


# -- a hostile peer --------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_peer_cannot_raise_a_fence_with_a_grant_its_home_did_not_sign(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=files(certs, "us"))
        eu = await cluster.start("eu", tls=files(certs, "eu"))
        await serving(us, certs)
        async with client(us, certs) as alice:
            made = await alice.remember("lattice", "backlog", "held", tags=["homeRegion:us"])
            key = made.record.key
            holder = await alice.claim(key, "alice", lease_seconds=60)
        token = holder.fencing_token
        # eu verified us's signature: it learned us's certificate from us.
        await eventually(lambda: holds_fence(eu, key, token), "eu holding the signed grant")
        us_signer = Signer.from_files(files(certs, "us"))
        assert us_signer.key_id in eu.replica.keyring  # type: ignore[operator]
        # eu's sighting of the claimed record comes back to us: the state the
        # forgeries must leave unchanged includes it.
        await eventually(lambda: sighted(us, key, "eu"), "us holding eu's sighting")

        held = await state_of(us, key)
        real = held.fence.grants[token]
        assert real.signature[:KEY_ID_SIZE] == us_signer.key_id
        now = us.replica.clock.wall_ms()
        forged = Grant(us.replica.clock.now(), "mallory", "us")
        eu_signer = Signer.from_files(files(certs, "eu"))
        foreign = tmp_path / "foreign-ca"
        init_dir(foreign, regions=["us"])  # a "us" key the cluster CA never certified
        outsider = Signer.from_files(files(foreign, "us"))
        attempts = {
            "unsigned_grant": forged,
            "signer_not_home": forged._replace(
                signature=eu_signer.signature(key, token + 1, forged)
            ),
            # The home's real signature, of alice's grant, replayed on mallory's.
            "bad_signature": forged._replace(signature=real.signature),
            "unknown_signer": forged._replace(signature=outsider.signature(key, token + 1, forged)),
        }
        for refused, (reason, grant) in enumerate(attempts.items(), start=1):
            state = with_grant(held, token + 1, grant, now + 60_000)
            assert await push(us, certs, "eu", state) == 0, reason
            peer = us.replicator.peer_stats("eu")
            assert peer.merges_refused == refused
            assert reason in peer.last_refusal, (reason, peer.last_refusal)

        # Nothing changed: the fence stays, alice keeps her claim and can use it.
        assert await state_of(us, key) == held
        async with client(us, certs) as alice:
            status = await alice.claim_status(key)
            assert status.fence == token
            assert status.claim is not None and status.claim.owner == "alice"
            assert (await alice.renew_claim(key, token)).renewed
            await alice.update(key, fields={"body": "still mine"}, fencing_token=token)
        # The eu node was not fooled either, and learned only CA certificates.
        assert (await state_of(eu, key)).fence.fence == token
        assert outsider.key_id not in us.replica.keyring  # type: ignore[operator]


# -- a normal cluster ------------------------------------------------------------------------


@pytest.mark.slow
async def test_three_tls_regions_converge_with_grants_relayed_by_a_region_that_is_not_home(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, REGIONS) as cluster:
        us, eu = await start_us_and_eu(cluster, certs)
        await serving(us, certs)
        await serving(eu, certs)
        async with client(us, certs) as alice:
            at_us = (await alice.remember("lattice", "backlog", "us-1")).record.key
            us_token = (await alice.claim(at_us, "alice", lease_seconds=60)).fencing_token
        async with client(eu, certs) as alice:
            at_eu = (await alice.remember("lattice", "backlog", "eu-1")).record.key
            eu_token = (await alice.claim(at_eu, "bob", lease_seconds=60)).fencing_token
            # Claims are still decided at home only.
            assert (await alice.claim(at_us, "carol")).reason == "wrong_region"
        await wait_converged([us, eu])
        # ap joins while us is down: us's grant reaches it only through eu, and ap
        # fetches us's certificate from eu to verify it.
        await cluster.stop("us")
        ap = await cluster.start("ap", tls=files(certs, "ap"))
        await eventually(lambda: holds_fence(ap, at_us, us_token), "ap holding us's grant")
        await eventually(lambda: holds_fence(ap, at_eu, eu_token), "ap holding eu's grant")
        assert Signer.from_files(files(certs, "us")).key_id in ap.replica.keyring  # type: ignore[operator]

        us = await cluster.start("us", tls=files(certs, "us"))
        await serving(us, certs)
        async with client(us, certs) as alice:
            await alice.release_claim(at_us, us_token)
            again = await alice.claim(at_us, "dave", lease_seconds=60)
            assert again.granted and again.fencing_token > us_token
        await wait_converged([us, eu, ap])
        for node in (us, eu, ap):
            record = await state_of(node, at_us)
            holder = record.fence.holder()
            assert holder is not None and holder.owner == "dave" and holder.signature
            stats = [node.replicator.peer_stats(r) for r in REGIONS if r != node.config.region]
            assert all(p.merges_refused == 0 for p in stats), [p.last_refusal for p in stats]


@pytest.mark.slow
async def test_grants_signed_before_a_certificate_was_reissued_still_verify(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, REGIONS) as cluster:
        us, eu = await start_us_and_eu(cluster, certs)
        await serving(us, certs)
        old_key = Signer.from_files(files(certs, "us")).key_id
        async with client(us, certs) as alice:
            before = (await alice.remember("lattice", "backlog", "before")).record.key
            before_token = (await alice.claim(before, "alice", lease_seconds=60)).fencing_token
        await wait_converged([us, eu])
        # Re-issue us's certificate (a new key) and restart us on the same disk.
        await cluster.stop("us")
        for path in (certs / "us.pem", certs / "us-key.pem"):
            path.unlink()
        issue_into(certs, Identity("region", "us"))
        new_key = Signer.from_files(files(certs, "us")).key_id
        assert new_key != old_key
        us = await cluster.start("us", tls=files(certs, "us"))
        await serving(us, certs)
        async with client(us, certs) as alice:
            after = (await alice.remember("lattice", "backlog", "after")).record.key
            after_token = (await alice.claim(after, "bob", lease_seconds=60)).fencing_token
        signatures = {
            (await state_of(us, k)).fence.grants[t].signature[:KEY_ID_SIZE]
            for k, t in ((before, before_token), (after, after_token))
        }
        assert signatures == {old_key, new_key}
        # A node that never saw the old certificate learns both, and refuses nothing.
        ap = await cluster.start("ap", tls=files(certs, "ap"))
        await wait_converged([us, eu, ap], within=30)
        assert old_key in ap.replica.keyring and new_key in ap.replica.keyring  # type: ignore[operator]
        assert (await state_of(ap, before)).fence.fence == before_token
        assert (await state_of(ap, after)).fence.fence == after_token
        for region in ("us", "eu"):
            assert ap.replicator.peer_stats(region).merges_refused == 0


async def test_a_certificate_renewed_while_the_node_runs_signs_the_grants_made_after_it(
    tmp_path: Path, certs: Path
) -> None:
    """A hot TLS reload (no restart) moves the signer to the new key too; a peer
    learns the new certificate and merges what it signs."""
    async with Cluster(tmp_path, ["us", "eu"], tls_reload_interval=0.1) as cluster:
        us = await cluster.start("us", tls=files(certs, "us"))
        eu = await cluster.start("eu", tls=files(certs, "eu"))
        await serving(us, certs)
        old_key = Signer.from_files(files(certs, "us")).key_id
        staged = tmp_path / "renewed"
        staged.mkdir()
        (staged / "ca.pem").write_bytes((certs / "ca.pem").read_bytes())
        (staged / "ca-key.pem").write_bytes((certs / "ca-key.pem").read_bytes())
        issue_into(staged, Identity("region", "us"))
        for name in ("us.pem", "us-key.pem"):  # each replaced atomically
            (staged / name).replace(certs / name)
        new_key = Signer.from_files(files(certs, "us")).key_id
        assert new_key != old_key

        async def reloaded() -> bool:
            return us.tls is not None and us.tls.reloads >= 1

        await eventually(reloaded, "us taking its renewed certificate")
        async with client(us, certs) as alice:
            key = (await alice.remember("lattice", "backlog", "renewed")).record.key
            token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
        assert (await state_of(us, key)).fence.grants[token].signature[:KEY_ID_SIZE] == new_key
        await wait_converged([us, eu])
        assert (await state_of(eu, key)).fence.fence == token
        assert new_key in eu.replica.keyring  # type: ignore[operator]
        assert eu.replicator.peer_stats("us").merges_refused == 0


@pytest.mark.slow
async def test_a_state_whose_signer_is_not_known_yet_is_merged_once_it_is(
    tmp_path: Path, certs: Path
) -> None:
    """unknown_signer is not final: refused while no peer can say who signed it, merged
    by the next exchange with a peer that can."""
    async with Cluster(tmp_path, REGIONS) as cluster:
        key, token, state = await claimed_at_us(cluster, certs, "later")
        await cluster.stop("us")
        await cluster.stop("eu")
        ap = await cluster.start("ap", tls=files(certs, "ap"))
        # eu's certificate delivers us's signed grant, but eu's node is down: ap cannot
        # learn us's certificate, and refuses the state for now.
        assert await push(ap, certs, "eu", state) == 0
        assert "unknown_signer" in ap.replicator.peer_stats("eu").last_refusal
        assert await ap.storage.get(key) is None
        await cluster.start("eu", tls=files(certs, "eu"))
        await eventually(lambda: holds_fence(ap, key, token), "ap merging us's grant", within=30)
        assert Signer.from_files(files(certs, "us")).key_id in ap.replica.keyring  # type: ignore[operator]


async def test_concurrent_merges_needing_one_unknown_signer_wait_for_its_certificate(
    tmp_path: Path, certs: Path
) -> None:
    """Two exchanges bring a state signed by a key ap does not know yet, at once (a
    kept push and a catch-up round, after a start): the second waits for the first's
    fetch of the certificate instead of being refused unknown_signer meanwhile."""
    async with Cluster(tmp_path, REGIONS) as cluster:
        key, token, state = await claimed_at_us(cluster, certs, "twice")
        await cluster.stop("us")  # only eu can tell ap who signed it
        eu = cluster["eu"]
        ap = await cluster.start("ap", tls=files(certs, "ap"), peers={"eu": eu.address})
        merged = await asyncio.gather(*(push(ap, certs, "eu", state) for _ in range(4)))
        assert sum(merged) <= 1, merged  # one merged it (or ap's own round did)
        stats = ap.replicator.peer_stats("eu")
        assert stats.merges_refused == 0, stats.last_refusal
        assert (await state_of(ap, key)).fence.fence == token


async def test_certificates_answers_the_node_certificates_it_knows_and_only_to_peers(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=files(certs, "us"))
        own = Signer.from_files(files(certs, "us")).key_id

        async def ask(name: str, key_ids: list[bytes]) -> list[bytes]:
            credentials = files(certs, name).channel_credentials()
            async with grpc.aio.secure_channel(us.address, credentials) as channel:
                stub = replication_pb2_grpc.ReplicationStub(channel)
                request = replication_pb2.CertificatesRequest(
                    origin=replication_pb2.Origin(region=name, node_id="probe"), key_ids=key_ids
                )
                response = await stub.Certificates(request, timeout=5)
                return list(response.certificates)

        assert await ask("eu", [own, b"\x00" * KEY_ID_SIZE]) == [cert_der(certs / "us.pem")]
        with pytest.raises(grpc.aio.AioRpcError) as too_many:
            await ask("eu", [bytes([i]) * KEY_ID_SIZE for i in range(65)])
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "key_ids" in (too_many.value.details() or "")
        for stranger in ("alice", "ap"):  # a client; a node that is no peer of us
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await ask(stranger, [own])
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


def format_1(record: Record) -> bytes:
    """The encoding of ``record`` before signed grants (format 1: one optional home,
    grants without a signature, no lapsed tokens, no move), written field by field
    as that version wrote it."""
    from fencemark.node.crdt.codec import _stamp, _str, _varint

    out = bytearray(b"\x01")
    _str(out, record.key)
    home = record.home
    if home is None:
        out.append(0)
    else:
        out.append(1)
        _stamp(out, home.stamp)
        _str(out, home.value)
    _varint(out, len(record.fields))
    for name in sorted(record.fields):
        _str(out, name)
        _stamp(out, record.fields[name].stamp)
        _str(out, record.fields[name].value)
    _varint(out, len(record.tags))
    for tag in sorted(record.tags):
        _str(out, tag)
        _stamp(out, record.tags[tag].stamp)
        out.append(int(record.tags[tag].value))
    _stamp(out, record.deleted.stamp)
    out.append(int(record.deleted.value))
    fence = record.fence
    assert not fence.lapsed and not fence.moved, "format 1 had neither"
    _varint(out, len(fence.grants))
    for token in sorted(fence.grants):
        grant = fence.grants[token]
        _varint(out, token)
        _varint(out, grant.granted_hlc)
        _str(out, grant.owner)
        _str(out, grant.region)
    _varint(out, len(fence.lease_expiry))
    for token in sorted(fence.lease_expiry):
        _varint(out, token)
        _varint(out, fence.lease_expiry[token])
    _varint(out, len(fence.released))
    for token in sorted(fence.released):
        _varint(out, token)
    return bytes(out)


@pytest.mark.slow
async def test_a_file_from_before_signed_grants_is_upgraded_and_its_fences_signed_by_their_home(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start_isolated("us")  # plaintext, alone: the "old version"
        async with AsyncClient(us.address) as plain:
            key = (await plain.remember("lattice", "backlog", "old")).record.key
            token = (await plain.claim(key, "alice", lease_seconds=60)).fencing_token
        record = await state_of(us, key)
        assert not record.fence.grants[token].signature  # --insecure signs nothing
        path = us.config.db_path
        await cluster.stop("us")
        # Turn the file into one the previous version wrote: format-1 states, no marker.
        with sqlite3.connect(path) as db:
            db.execute("UPDATE records SET state = ? WHERE key = ?", (format_1(record), key))
            db.execute("DELETE FROM meta WHERE name IN ('state_format', 'own_states_signed')")
        db.close()

        us = await cluster.start("us", tls=files(certs, "us"))
        upgraded = await state_of(us, key)
        assert upgraded.fence.fence == token and upgraded.fence.holder() is not None
        assert upgraded.fence.grants[token].signature[:KEY_ID_SIZE] == (
            Signer.from_files(files(certs, "us")).key_id
        )
        stored = await us.storage.get(key)
        assert stored is not None and stored.digest == codec.digest(codec.encode(upgraded))
        # A node that never saw the unsigned grant takes the signed one.
        eu = await cluster.start("eu", tls=files(certs, "eu"))
        await wait_converged([us, eu])
        converged = await state_of(eu, key)
        assert converged == await state_of(us, key)
        # ... and, holding a claim born in us, sees it (Record.seen), signed.
        assert converged == upgraded.merge(converged) and converged.seen.keys() == {"eu"}
        assert eu.replicator.peer_stats("us").merges_refused == 0
        await all_deciding(us)  # restarted: it has compared states with eu
        async with client(us, certs) as alice:
            assert (await alice.renew_claim(key, token)).renewed


@pytest.mark.slow
async def test_writes_and_ends_made_without_tls_are_signed_at_the_homes_first_tls_start(
    tmp_path: Path, certs: Path
) -> None:
    """A node that ran ``--insecure`` (or a file of format 3) holds writes under a live
    claim and ends of claims that nobody signed; a TLS node that never merged them
    would refuse them (``unsigned_write``, ``unsigned_end``). The home signs its own
    at its first TLS start (``Replica.sign_own``), and they spread like writes."""
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start_isolated("us")
        async with AsyncClient(us.address) as plain:
            held = (await plain.remember("lattice", "backlog", "held")).record.key
            token = (await plain.claim(held, "alice", lease_seconds=60)).fencing_token
            await plain.update(held, fields={"body": "halfway"}, fencing_token=token)
            done = (await plain.remember("lattice", "backlog", "done")).record.key
            ended = (await plain.claim(done, "alice", lease_seconds=60)).fencing_token
            await plain.update(done, fields={"body": "finished"}, fencing_token=ended)
            assert (await plain.release_claim(done, ended)).released
        unsigned = await state_of(us, held)
        assert not unsigned.fields["body"].signature
        assert not (await state_of(us, done)).fence.seals
        await cluster.stop("us")

        us = await cluster.start("us", tls=files(certs, "us"))
        us_key = Signer.from_files(files(certs, "us")).key_id
        assert (await state_of(us, held)).fields["body"].signature[:KEY_ID_SIZE] == us_key
        assert (await state_of(us, done)).fence.seals[ended][:KEY_ID_SIZE] == us_key
        eu = await cluster.start("eu", tls=files(certs, "eu"))
        await wait_converged([us, eu])
        assert eu.replicator.peer_stats("us").merges_refused == 0
        assert (await state_of(eu, held)) == (await state_of(us, held))
        await all_deciding(us)  # restarted: it has compared states with eu
        async with client(us, certs) as alice:
            await alice.update(held, fields={"body": "done"}, fencing_token=token)

        # A TLS node of the version before (format 3, own_states_signed=1) signed its
        # grants but sealed no end: the seal comes at the first start of this one.
        await cluster.stop("us")
        record = await state_of(eu, done)
        unsealed = record.with_fence(dataclasses.replace(record.fence, seals={}))
        with sqlite3.connect(us.config.db_path) as db:
            db.execute("UPDATE records SET state = ? WHERE key = ?", (codec.encode(unsealed), done))
            db.execute("UPDATE meta SET value = '1' WHERE name = 'own_states_signed'")
        db.close()
        us = await cluster.start("us", tls=files(certs, "us"))
        assert (await state_of(us, done)).fence.seals[ended][:KEY_ID_SIZE] == us_key


async def test_a_node_whose_key_cannot_sign_grants_refuses_to_start(
    tmp_path: Path, certs: Path, start_node: StartNode
) -> None:
    """A certificate made with other tools, with an RSA key: the handshake would work,
    but the node could not sign its grants, so it says so instead of starting."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    ca_key = serialization.load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "us")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("fencemark://region/us"), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    rsa_dir = tmp_path / "rsa"
    rsa_dir.mkdir()
    (rsa_dir / "ca.pem").write_bytes((certs / "ca.pem").read_bytes())
    (rsa_dir / "us.pem").write_bytes(cert.public_bytes(Encoding.PEM))
    (rsa_dir / "us-key.pem").write_bytes(
        key.private_bytes(
            Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(ValueError, match="EC P-256"):
        await start_node("us", tls=files(rsa_dir, "us"))
    assert not databases(tmp_path)  # refused before anything was opened


@pytest.mark.slow
async def test_no_node_can_claim_a_birth_for_another_region(tmp_path: Path, certs: Path) -> None:
    """Regression (issue 14, hole 1): a peer pushed "born in eu 1 ms before us" for a
    us-homed record, us merged it silently, and every region then sent alice to eu.
    A birth is signed by the region that made it: ap can neither leave eu's
    signature off nor sign for eu. Nor can eu itself, signing a back-dated birth of
    its own region: eu held alice's claim, born in us, and said so (its signed
    sighting, ``Record.seen``), so its birth is void everywhere — merged, as evidence
    against eu, and reported ``seen_before_birth`` (issue 33, finding 7)."""
    async with Cluster(tmp_path, REGIONS) as cluster:
        us, eu, ap = [await cluster.start(r, tls=files(certs, r)) for r in REGIONS]
        for node in (us, eu, ap):
            await serving(node, certs)
        async with client(us, certs) as alice:
            made = await alice.remember("lattice", "backlog", "homed", tags=["homeRegion:us"])
            key = made.record.key
            token = (await alice.claim(key, "alice", lease_seconds=60)).fencing_token
        await wait_converged([us, eu, ap])
        state = await state_of(us, key)
        assert state.births["us"].signature  # us signed its own birth
        home = state.home
        assert home is not None
        earlier = Birth(Stamp(0, home.stamp.hlc - (1 << 16), "hostile"))
        forged = state.with_birth("eu", earlier)
        assert await push(us, certs, "ap", forged) == 0
        assert "unsigned_birth" in us.replicator.peer_stats("ap").last_refusal
        signed_by_ap = Signer.from_files(files(certs, "ap")).sign_birth(forged, "eu")
        assert await push(us, certs, "ap", signed_by_ap) == 0
        assert "signer_not_home" in us.replicator.peer_stats("ap").last_refusal
        assert (await state_of(us, key)).home_region == "us"
        async with client(us, certs) as alice:
            assert (await alice.renew_claim(key, token)).renewed

        # eu's own node (or its live key), signing a back-dated birth of its own
        # region, after eu saw the claim: void, on every node.
        assert state.seen.keys() == {"eu", "ap"}
        signed_by_eu = Signer.from_files(files(certs, "eu")).sign_birth(forged, "eu")
        assert await push(us, certs, "eu", signed_by_eu) == 1  # kept, as evidence
        assert "seen_before_birth" in us.replicator.peer_stats("eu").last_refusal
        assert us.replicator.peer_stats("eu").merge_refusals["seen_before_birth"] == 1
        await wait_converged([us, eu, ap])
        for node in (us, eu, ap):
            record = await state_of(node, key)
            assert record.births["eu"] == signed_by_eu.births["eu"]
            assert record.home_region == "us" and record.creators == {"us"}
            assert record.fence.fence == token
        async with client(us, certs) as alice:
            assert (await alice.renew_claim(key, token)).renewed


@pytest.mark.slow
async def test_no_peer_can_overwrite_or_delete_a_live_claims_record(
    tmp_path: Path, certs: Path
) -> None:
    """Regression (issue 14, hole 8): eu pushed a tombstone, and a field write,
    stamped at alice's epoch with a later clock; us merged them, and ``Get``,
    ``ClaimStatus`` and alice's next fenced write answered not found. Only the home
    admits a write at the epoch of an unreleased grant, and signs it: a state
    carrying one its home did not sign is refused like any forgery. So is a forged
    end of the claim (a release, a lapse) or move of the fence, which would let
    such a write in as an unfenced one."""
    async with Cluster(tmp_path, REGIONS) as cluster:
        key, token, _ = await claimed_at_us(cluster, certs, "held")
        us, eu = cluster.nodes["us"], cluster.nodes["eu"]
        async with client(us, certs) as alice:
            await alice.update(key, fields={"body": "halfway"}, fencing_token=token)
        await wait_converged([us, eu])
        held = await state_of(us, key)
        body = held.fields["body"]
        us_key = Signer.from_files(files(certs, "us")).key_id
        assert body.stamp.epoch == token and body.signature[:KEY_ID_SIZE] == us_key
        # eu took alice's signed write from us: nothing was refused on the way.
        assert eu.replicator.peer_stats("us").merges_refused == 0

        later = Stamp(token, us.replica.clock.now() + (1 << 16), us.storage.node_id)
        tombstone = held.clear(later).set_deleted(True, later)
        overwrite = held.set_fields({"body": "mallory's"}, later)
        eu_signer = Signer.from_files(files(certs, "eu"))
        # ... or end the claim first, then write at its epoch as anyone may after.
        released = held.with_fence(held.fence.release(token))
        after_release = released.set_fields({"body": "mallory's"}, later)
        moved = held.with_fence(held.fence.move(token + 1))
        attempts = {
            "unsigned_write": (tombstone, overwrite),
            "unsigned_end": (after_release, held.with_fence(held.fence.lapse(token))),
            "unsigned_move": (
                moved.set_fields({"body": "mallory's"}, later._replace(epoch=token + 1)),
            ),
            # eu's own node key: eu is not the home, nor the region that granted.
            "signer_not_home": (
                eu_signer.sign_writes(overwrite, later),
                after_release.with_fence(eu_signer.seal(key, released.fence, end=True, move=False)),
                moved.with_fence(eu_signer.seal(key, moved.fence, end=False, move=True)),
            ),
        }
        refused = 0
        for reason, states in attempts.items():
            for state in states:
                assert await push(us, certs, "eu", state) == 0, reason
                refused += 1
                peer = us.replicator.peer_stats("eu")
                assert peer.merges_refused == refused
                assert reason in peer.last_refusal, (reason, peer.last_refusal)

        assert await state_of(us, key) == held
        async with client(us, certs) as alice:
            assert (await alice.get(key)).fields["body"] == "halfway"
            status = await alice.claim_status(key)
            assert status.claim is not None and status.claim.owner == "alice"
            await alice.update(key, fields={"body": "done"}, fencing_token=token)
            assert (await alice.release_claim(key, token)).released
        # Released: from now on any node admits unfenced writes, unsigned, everywhere.
        await wait_converged([us, eu])
        async with client(eu, certs) as alice:
            await alice.update(key, fields={"body": "reviewed at eu"})
        await wait_converged([us, eu])
        assert (await state_of(us, key)).field_values()["body"] == "reviewed at eu"
