"""An identity is a URI subject alternative name, and nothing else (issue: identities
read from any SAN type).

The bug this pins: the node read identities from gRPC's
``x509_subject_alternative_name`` auth property, which holds every SAN type alike,
so a certificate of the cluster CA whose only SAN was a DNS name or an e-mail
address reading ``fencemark://region/ap`` replicated as the node of region ap.
Real certificates signed by the test CA (``cryptography``), a real TLS node on
loopback, real calls.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fencemark.client import AsyncClient, PermissionDenied
from fencemark.node.security.tls import TlsFiles, init_dir
from tests.conftest import StartNode
from tests.test_tls import a_state, error_info, knowing_eu, push

NOWHERE = "127.0.0.1:9"  # ap's node is never up: only its certificate matters here


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=["us", "eu"], clients=["alice"])
    return directory


def issue_with(
    certs: Path, name: str, sans: list[x509.GeneralName], *, common_name: str = "probe"
) -> TlsFiles:
    """A certificate signed by ``certs``' CA with exactly ``sans`` (none if empty)."""
    ca_key = serialization.load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    files = TlsFiles(certs / "ca.pem", certs / f"{name}.pem", certs / f"{name}-key.pem")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


AP = "fencemark://region/ap"
NOT_URIS: dict[str, tuple[list[x509.GeneralName], str]] = {
    "dns": ([x509.DNSName(AP)], "probe"),
    "email": ([x509.RFC822Name(AP)], "probe"),
    "common-name": ([], AP),
}


@pytest.mark.parametrize("where", sorted(NOT_URIS))
async def test_fencemark_uri_outside_a_uri_san_does_not_make_a_node(
    start_node: StartNode, certs: Path, where: str
) -> None:
    """A CA-signed certificate spelling fencemark://region/ap as a DNS name, an e-mail
    address or its common name is no node of ap: its pushes are refused, unmerged."""
    key, state = await a_state(start_node, f"not-ap-{where}")
    us = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), peers={"ap": NOWHERE})
    sans, common_name = NOT_URIS[where]
    forged = issue_with(certs, f"ap-{where}", sans, common_name=common_name)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await push(us, forged.channel_credentials(), "ap", [state])
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(refused.value)
    assert (info.reason, info.domain) == ("PERMISSION_DENIED", "fencemark")
    assert info.metadata["denial"] == "no_identity"
    assert await us.storage.get(key) is None
    # Nor is it a client: no identity, no rights.
    async with AsyncClient(
        us.address, credentials=forged.channel_credentials(), retries=0, timeout=5
    ) as caller:
        with pytest.raises(PermissionDenied) as denied:
            await caller.info()
    assert denied.value.reason == "no_identity"


async def test_the_same_uri_in_a_uri_san_is_the_node_of_ap(
    start_node: StartNode, certs: Path
) -> None:
    """The control: the same CA, the same text, as a URI SAN: merged."""
    key, state = await a_state(start_node, "ap-uri", certs)
    us = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), peers={"ap": NOWHERE})
    knowing_eu(us, certs)
    node_of_ap = issue_with(certs, "ap-uri", [x509.UniformResourceIdentifier(AP)])
    merged = await push(us, node_of_ap.channel_credentials(), "ap", [state])
    assert merged.merged == 1
    assert await us.storage.get(key) is not None


async def test_a_dns_name_beside_a_uri_san_adds_no_identity(
    start_node: StartNode, certs: Path
) -> None:
    """alice's URI SAN with a DNS name reading fencemark://region/ap is alice alone:
    she reads as a client, and may not replicate as ap."""
    key, state = await a_state(start_node, "alice-as-ap")
    us = await start_node("us", tls=TlsFiles.in_dir(certs, "us"), peers={"ap": NOWHERE})
    both = issue_with(
        certs,
        "alice-and-ap",
        [x509.UniformResourceIdentifier("fencemark://client/alice"), x509.DNSName(AP)],
    )
    async with AsyncClient(
        us.address, credentials=both.channel_credentials(), retries=0, timeout=5
    ) as alice:
        assert (await alice.info()).region == "us"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await push(us, both.channel_credentials(), "ap", [state])
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(refused.value)
    assert (info.metadata["denial"], info.metadata["identity"]) == ("missing_right", "client/alice")
    assert await us.storage.get(key) is None
