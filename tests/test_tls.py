"""Transport security (issue 7): mutual TLS on every port, node identities, authorization.

Real components only: certificates made by ``fencemark certs`` (the helper the
deployment uses) under ``tmp_path``, real gRPC servers on loopback, the
published client. docs/security.md is the model these tests hold the code to.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12
from google.rpc import error_details_pb2, status_pb2

from fencemark.client import AsyncClient, PermissionDenied, Unavailable, tls_credentials
from fencemark.node.api.authz import load_access
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import codec
from fencemark.node.security.signing import Signer
from fencemark.node.security.tls import Identity, TlsFiles, init_dir
from fencemark.node.tools.cli import main
from fencemark.node.tools.process import NodeProcess
from fencemark.v1 import node_pb2, node_pb2_grpc, replication_pb2, replication_pb2_grpc
from tests.cluster import Cluster, wait_converged
from tests.conftest import StartNode
from tests.metrics import refusals

REGIONS = ["us", "eu", "ap"]
CLIENTS = ["alice", "reader", "stranger"]


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A cluster CA with node certificates for us, eu, ap and three clients."""
    directory = tmp_path / "certs"
    init_dir(directory, regions=REGIONS, clients=CLIENTS)
    return directory


def files(certs: Path, name: str) -> TlsFiles:
    return TlsFiles.in_dir(certs, name)


def client(node: NodeServer, certs: Path, name: str) -> AsyncClient:
    return AsyncClient(node.address, credentials=tls_credentials(certs, name), retries=0, timeout=5)


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    (raw,) = [v for k, v in trailers if k == "grpc-status-details-bin"]
    assert isinstance(raw, bytes)
    status = status_pb2.Status.FromString(raw)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def push(
    node: NodeServer,
    credentials: grpc.ChannelCredentials,
    origin: str,
    states: list[bytes],
    *,
    address: str = "",
) -> replication_pb2.PushResponse:
    """Replication.Push as a peer would send it, over ``credentials``, to ``node``'s
    client port or ``address`` (its peer listener)."""
    async with grpc.aio.secure_channel(address or node.address, credentials) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        request = replication_pb2.PushRequest(
            origin=replication_pb2.Origin(region=origin, node_id="probe", hlc=0), states=states
        )
        response: replication_pb2.PushResponse = await stub.Push(request, timeout=10)
        return response


async def a_state(
    start_node: StartNode, key_id: str, certs: Path | None = None
) -> tuple[str, bytes]:
    """A real record state, written by a plaintext node of region eu of its own; with
    ``certs``, its birth signed with eu's node key, as a TLS node of eu signs it."""
    other = await start_node("eu")
    async with AsyncClient(other.address) as c:
        record = (await c.remember("lattice", "backlog", key_id, title="forged?")).record
    state = (await other.storage.states([record.key]))[record.key]
    if certs is not None:
        signer = Signer.from_files(TlsFiles.in_dir(certs, "eu"))
        state = codec.encode(signer.sign_birth(codec.decode(state), "eu"))
    return record.key, state


def knowing_eu(node: NodeServer, certs: Path) -> None:
    """``node`` knows eu's node certificate (as after any exchange with eu), so it can
    verify what eu signed without asking a peer."""
    assert node.replica.keyring is not None
    node.replica.keyring.add(
        x509.load_pem_x509_certificate((certs / "eu.pem").read_bytes()).public_bytes(
            serialization.Encoding.DER
        )
    )


# -- the helper ------------------------------------------------------------------------------


def test_certs_init_writes_a_ca_and_one_identity_per_region_and_client(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "made"
    assert main(["certs", "init", "--dir", str(directory), "--regions", "us,eu",
                 "--clients", "alice", "--hosts", "node.example,10.0.0.7"]) == 0  # fmt: skip
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted(["ca.pem", "ca-key.pem", "us.pem", "us-key.pem", "eu.pem",
                            "eu-key.pem", "alice.pem", "alice-key.pem"])  # fmt: skip
    for key in directory.glob("*-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert files(directory, "us").identity() == Identity("region", "us")
    assert files(directory, "alice").identity() == Identity("client", "alice")
    # A second init would replace the CA and lock every holder out: refused.
    assert main(["certs", "init", "--dir", str(directory), "--regions", "us"]) == 2
    assert "already holds a CA" in capsys.readouterr().err
    assert main(["certs", "init", "--dir", str(directory), "--regions", "us", "--if-missing"]) == 0
    # One more client from the same CA.
    assert main(["certs", "issue", "--dir", str(directory), "--client", "bob"]) == 0
    assert files(directory, "bob").identity() == Identity("client", "bob")
    assert main(["certs", "issue", "--dir", str(directory), "--client", "bob"]) == 2


def test_certs_init_with_etcd_makes_its_servers_and_root_certificates_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the compose stack's certs service runs: a region's etcd in the same call."""
    directory = tmp_path / "made"
    assert main(["certs", "init", "--dir", str(directory), "--regions", "us",
                 "--etcd", "etcd-0,etcd-1"]) == 0  # fmt: skip
    for name in ("etcd-0", "etcd-1", "root"):
        cert = x509.load_pem_x509_certificate((directory / f"{name}.pem").read_bytes())
        common = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        assert [a.value for a in common] == [name]
        assert stat.S_IMODE((directory / f"{name}-key.pem").stat().st_mode) == 0o600
    server = x509.load_pem_x509_certificate((directory / "etcd-0.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "etcd-0" in names.get_values_for_type(x509.DNSName)
    # An etcd named like a region would overwrite its certificate: refused, nothing made.
    other = tmp_path / "other"
    assert main(["certs", "init", "--dir", str(other), "--regions", "us", "--etcd", "us"]) == 2
    assert "--etcd: ['us'] would overwrite another certificate" in capsys.readouterr().err
    assert not other.exists()


def open_p12(path: Path, password: bytes, certs: Path, name: str) -> None:
    """``path`` opens with ``password`` alone and holds ``name``'s certificate and key, under
    the identity as its friendly name, and the CA."""
    with pytest.raises(ValueError):
        pkcs12.load_pkcs12(path.read_bytes(), b"not " + password)
    bundle = pkcs12.load_pkcs12(path.read_bytes(), password)
    assert bundle.cert is not None and bundle.key is not None
    assert bundle.cert.certificate == x509.load_pem_x509_certificate(
        (certs / f"{name}.pem").read_bytes()
    )
    assert bundle.cert.friendly_name == f"fencemark://client/{name}".encode()
    key = serialization.load_pem_private_key((certs / f"{name}-key.pem").read_bytes(), None)
    assert bundle.key.private_numbers() == key.private_numbers()  # type: ignore[union-attr]
    assert [c.certificate for c in bundle.additional_certs] == x509.load_pem_x509_certificates(
        (certs / "ca.pem").read_bytes()
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_certs_p12_gives_a_browser_a_clients_certificate_key_and_the_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "made"
    init_dir(directory, regions=["us"], clients=["operator"])
    secret = tmp_path / "password"
    secret.write_text("correct horse\nnot this line\n")
    made = ["certs", "p12", "--dir", str(directory), "--client", "operator"]
    assert main([*made, "--password-file", str(secret)]) == 0
    open_p12(directory / "operator.p12", b"correct horse", directory, "operator")
    before = (directory / "operator.p12").read_bytes()
    assert main([*made, "--password-file", str(secret)]) == 2  # never overwritten
    assert "operator.p12 exists" in capsys.readouterr().err
    assert (directory / "operator.p12").read_bytes() == before

    # A new client and its .p12 at once, the password from standard input.
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    issue = ["certs", "issue", "--dir", str(directory), "--p12"]
    assert main([*issue, "--client", "browser", "--password-file", "-"]) == 0
    assert files(directory, "browser").identity() == Identity("client", "browser")
    open_p12(directory / "browser.p12", b"s3cret", directory, "browser")

    # No password (an empty one, none on a pipe), or a region's certificate: refused
    # before anything is written.
    secret.write_text("\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    for refused, says in (
        ([*issue, "--client", "carol", "--password-file", str(secret)], "give it a password"),
        ([*issue, "--client", "carol"], "--password-file FILE"),
        ([*issue, "--region", "eu", "--password-file", str(secret)], "--p12 is for client"),
    ):
        assert main(refused) == 2, refused
        assert says in capsys.readouterr().err
    assert not {"carol.pem", "carol.p12", "eu.pem"} & {p.name for p in directory.iterdir()}


# -- the handshake ------------------------------------------------------------------------------


async def test_a_caller_without_a_certificate_of_the_cluster_ca_never_reaches_the_node(
    start_node: StartNode, certs: Path, tmp_path: Path
) -> None:
    node = await start_node("us", tls=files(certs, "us"))
    async with client(node, certs, "alice") as alice:
        assert (await alice.info()).region == "us"

    no_certificate = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    other_ca = tmp_path / "other-ca"
    init_dir(other_ca, regions=["us"], clients=["alice"])
    # Trusts the cluster's CA (so it would accept the node), presents another CA's certificate.
    foreign = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(other_ca / "alice-key.pem").read_bytes(),
        certificate_chain=(other_ca / "alice.pem").read_bytes(),
    )
    for credentials in (no_certificate, foreign):
        async with AsyncClient(node.address, credentials=credentials, retries=0, timeout=5) as c:
            with pytest.raises(Unavailable):
                await c.info()
    async with AsyncClient(node.address, retries=0, timeout=5) as plaintext:
        with pytest.raises(Unavailable):
            await plaintext.info()
    # The node's state is untouched and it still serves its real clients.
    assert node.storage.record_count == 0


# -- replication --------------------------------------------------------------------------------


async def test_nodes_replicate_over_mutual_tls(tmp_path: Path, certs: Path) -> None:
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=files(certs, "us"))
        eu = await cluster.start("eu", tls=files(certs, "eu"))
        async with client(us, certs, "alice") as alice:
            await alice.remember("lattice", "backlog", "tls-1", title="over TLS")
        await wait_converged([us, eu])
        async with client(eu, certs, "alice") as alice:
            record = await alice.get("repo/lattice/mem/backlog/tls-1")
            assert record.fields["title"] == "over TLS"
            peers = {p.region: p for p in (await alice.info()).peers}
        assert peers["us"].reachable and not peers["us"].last_error


async def test_replication_from_a_region_that_is_no_peer_is_refused_and_merges_nothing(
    tmp_path: Path, certs: Path, start_node: StartNode
) -> None:
    key, state = await a_state(start_node, "from-ap", certs)
    async with Cluster(tmp_path, ["us", "eu"]) as cluster:
        us = await cluster.start("us", tls=files(certs, "us"))
        knowing_eu(us, certs)
        # ap holds a node certificate of the cluster CA, but us has no peer ap.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(us, files(certs, "ap").channel_credentials(), "ap", [state])
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(refused.value).metadata["denial"] == "unknown_region"
        # eu's certificate speaking for ap: refused too.
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:
            await push(us, files(certs, "eu").channel_credentials(), "ap", [state])
        assert mismatch.value.code() == grpc.StatusCode.PERMISSION_DENIED
        info = error_info(mismatch.value)
        assert info.reason == "PERMISSION_DENIED"
        assert info.metadata["denial"] == "region_mismatch"
        assert info.metadata["identity"] == "region/eu"
        # A client certificate cannot replicate at all.
        with pytest.raises(grpc.aio.AioRpcError) as client_push:
            await push(us, files(certs, "alice").channel_credentials(), "eu", [state])
        assert client_push.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(client_push.value).metadata["denial"] == "missing_right"
        assert await us.storage.get(key) is None
        assert us.storage.record_count == 0
        # The control: eu's own certificate, speaking for eu, is merged.
        merged = await push(us, files(certs, "eu").channel_credentials(), "eu", [state])
        assert merged.merged == 1
        assert await us.storage.get(key) is not None


async def test_a_node_whose_certificate_is_another_regions_refuses_to_start(
    start_node: StartNode, certs: Path
) -> None:
    with pytest.raises(ValueError, match="region/eu"):
        await start_node("us", tls=files(certs, "eu"))


# -- authorization -------------------------------------------------------------------------------


async def test_a_read_only_identity_reads_but_cannot_write_or_claim(
    start_node: StartNode, certs: Path, tmp_path: Path
) -> None:
    access = tmp_path / "access.toml"
    access.write_text('[clients]\nalice = ["read", "write", "claim"]\nreader = ["read"]\n')
    node = await start_node("us", tls=files(certs, "us"), access=load_access(access))
    async with client(node, certs, "alice") as alice:
        record = (await alice.remember("lattice", "backlog", "ro-1", title="mine")).record
    before = await node.storage.get(record.key)
    async with client(node, certs, "reader") as reader:
        assert (await reader.get(record.key)).fields["title"] == "mine"
        with pytest.raises(PermissionDenied) as write:
            await reader.update(record.key, fields={"title": "theirs"})
        assert (write.value.reason, write.value.right) == ("missing_right", "write")
        assert write.value.identity == "client/reader"
        with pytest.raises(PermissionDenied) as claim:
            await reader.claim(record.key, "reader-1")
        assert (claim.value.reason, claim.value.right) == ("missing_right", "claim")
    after = await node.storage.get(record.key)
    assert before is not None and after is not None and after.digest == before.digest
    # A client the map does not name gets nothing, not even reads.
    async with client(node, certs, "stranger") as stranger:
        with pytest.raises(PermissionDenied):
            await stranger.get(record.key)
        assert await stranger.health() == "SERVING"  # health stays open to the CA's callers
    refused = refusals(node)
    assert refused[("Update", "missing_right")] == 1
    assert refused[("Claim", "missing_right")] == 1


async def test_a_reader_watches_the_change_feed_and_a_stranger_is_refused_under_tls(
    start_node: StartNode, certs: Path, tmp_path: Path
) -> None:
    """Regression: the authorization interceptor took only unary methods and failed
    every Records.Watch (a stream written to the context) with UNKNOWN, so under
    mutual TLS, as deployed, the change feed could not be watched at all."""
    access = tmp_path / "access.toml"
    access.write_text('[clients]\nalice = ["read", "write"]\nreader = ["read"]\n')
    node = await start_node("us", tls=files(certs, "us"), access=load_access(access))
    async with client(node, certs, "reader") as reader, client(node, certs, "alice") as alice:
        events = reader.watch("lattice", cursor=f"{(await reader.info()).node_id}.0")
        made = await alice.remember("lattice", "backlog", "fed", title="seen")
        async with asyncio.timeout(10):
            event = await anext(events)
        await events.aclose()
    assert (event.kind, event.key) == ("created", made.record.key)
    async with client(node, certs, "stranger") as stranger:
        with pytest.raises(PermissionDenied) as refused:
            async with asyncio.timeout(10):
                await anext(stranger.watch("lattice"))
    assert (refused.value.reason, refused.value.right) == ("missing_right", "read")


async def test_without_an_access_map_every_client_of_the_ca_may_read_write_and_claim(
    start_node: StartNode, certs: Path
) -> None:
    node = await start_node("us", tls=files(certs, "us"))
    async with client(node, certs, "stranger") as stranger:
        record = (await stranger.remember("lattice", "backlog", "open-1")).record
        assert (await stranger.claim(record.key, "s-1")).granted
    # A node certificate reads (probes, status), and may not write as a client.
    async with client(node, certs, "eu") as eu:
        assert (await eu.get(record.key)).key == record.key
        with pytest.raises(PermissionDenied):
            await eu.update(record.key, fields={"body": "x"})


# -- the command line ----------------------------------------------------------------------------


def test_the_node_command_insists_on_a_choice_of_transport(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("FENCEMARK_INSECURE", "FENCEMARK_TLS_DIR", "FENCEMARK_ACCESS"):
        monkeypatch.delenv(name, raising=False)
    data = str(tmp_path / "data")
    assert main(["node", "--listen", "127.0.0.1:0", "--data", data]) == 2
    err = capsys.readouterr().err
    assert "--tls-dir" in err and "--insecure" in err
    assert main(["node", "--data", data, "--insecure", "--tls-dir", str(tmp_path)]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["node", "--data", data, "--insecure", "--access", "a.toml"]) == 2
    assert "--access needs --tls-dir" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before anything was opened


@pytest.mark.slow
async def test_a_node_started_with_tls_dir_serves_the_cli_and_clients(
    tmp_path: Path, certs: Path
) -> None:
    node = await NodeProcess.start(tmp_path / "data", region="us", tls_dir=certs)
    try:
        async with AsyncClient(
            node.address, credentials=tls_credentials(certs, "alice"), timeout=5
        ) as alice:
            await alice.remember("lattice", "backlog", "cli-1", title="via the CLI node")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEMARK_")}
        env |= {"FENCEMARK_TLS_DIR": str(certs), "FENCEMARK_TLS_NAME": "alice"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencemark.node", "get", "repo/lattice/mem/backlog/cli-1",
            "--target", node.address, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        assert "via the CLI node" in out.decode()
        # The same command in plaintext does not get through.
        del env["FENCEMARK_TLS_DIR"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencemark.node", "info", "--target", node.address,
            "--timeout", "2", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 4  # not reached (docs/api.md, Exit codes), and why:
        assert b"the node serves TLS: pass --tls-dir/--tls-name or set FENCEMARK_TLS_DIR" in err
    finally:
        await node.stop()


async def test_node_info_over_a_raw_stub_carries_the_identity_check(
    start_node: StartNode, certs: Path
) -> None:
    """The table covers Node.Info: a raw stub with a client certificate gets through."""
    node = await start_node("us", tls=files(certs, "us"))
    async with grpc.aio.secure_channel(
        node.address, files(certs, "reader").channel_credentials()
    ) as channel:
        answer = await node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=5)
    assert answer.region == "us"
