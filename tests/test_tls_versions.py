"""Which TLS versions a node's port negotiates, and the peer check's floor (issue: TLS
1.2 accepted although docs/security.md said 1.3).

gRPC Python (grpcio 1.85) has no setting for a server's TLS versions: gRPC core
negotiates TLS 1.3 with every client that offers it and still accepts TLS 1.2,
with its own short list of suites. These tests hold docs/security.md ("The
handshake") to what a real node does, with standard-library ``ssl`` clients
forced to each version, and show that the node's own peer check, which the
project controls, speaks TLS 1.3 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fencemark.node.api.server import NodeServer
from fencemark.node.replication.peer_check import presented_certificate
from fencemark.node.security.tls import TlsFiles, init_dir
from tests.conftest import StartNode

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_EMPTY_SETTINGS = bytes.fromhex("000000040000000000")  # length 0, type 4, no flags
SETTINGS = 0x04
# gRPC core's TLS 1.2 suites that an EC P-256 node certificate can serve.
GRPC_TLS12_SUITES = {"ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384"}
IO_LIMIT_S = 10.0


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=["us", "eu"], clients=["alice"])
    return directory


@pytest.fixture
async def node(start_node: StartNode, certs: Path) -> NodeServer:
    return await start_node("us", tls=TlsFiles.in_dir(certs, "us"))


def client_context(
    certs: Path,
    name: str | None = "alice",
    *,
    maximum: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED,
    ciphers: str | None = None,
) -> ssl.SSLContext:
    """A client of the cluster CA, presenting ``name``'s certificate (none if None)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.maximum_version = maximum
    context.load_verify_locations(certs / "ca.pem")
    if name is not None:
        context.load_cert_chain(certs / f"{name}.pem", certs / f"{name}-key.pem")
    if ciphers is not None:
        context.set_ciphers(ciphers)
    context.set_alpn_protocols(["h2"])
    return context


def speak_http2(address: str, context: ssl.SSLContext) -> tuple[str, str, str, int]:
    """Handshake with ``address``, send the HTTP/2 preface and read the node's first frame:
    (TLS version, suite, ALPN protocol, frame type). Blocks: run it in a thread."""
    host, port = address.rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=IO_LIMIT_S) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(HTTP2_PREFACE + HTTP2_EMPTY_SETTINGS)
        header = b""
        while len(header) < 9:
            chunk = tls.recv(9 - len(header))
            if not chunk:
                raise ConnectionError(f"{address} closed the connection")
            header += chunk
        version, cipher = tls.version(), tls.cipher()
        assert version is not None and cipher is not None
        return version, cipher[0], tls.selected_alpn_protocol() or "", header[3]


async def test_a_client_that_offers_tls_1_3_gets_tls_1_3(node: NodeServer, certs: Path) -> None:
    """Every gRPC client offers TLS 1.3, so this is what clients and peers speak."""
    version, _, alpn, frame = await asyncio.to_thread(
        speak_http2, node.address, client_context(certs)
    )
    assert (version, alpn, frame) == ("TLSv1.3", "h2", SETTINGS)


async def test_a_tls_1_2_client_with_a_cluster_certificate_is_served(
    node: NodeServer, certs: Path
) -> None:
    """What docs/security.md says: gRPC core still accepts TLS 1.2, with ECDHE and
    AES-GCM only, and serves HTTP/2 on it; grpcio offers no server setting against it."""
    context = client_context(certs, maximum=ssl.TLSVersion.TLSv1_2)
    version, suite, alpn, frame = await asyncio.to_thread(speak_http2, node.address, context)
    assert (version, alpn, frame) == ("TLSv1.2", "h2", SETTINGS)
    assert suite in GRPC_TLS12_SUITES


@pytest.mark.parametrize(
    "suites", ["ECDHE-ECDSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA", "ECDHE-ECDSA-CHACHA20-POLY1305"]
)
async def test_tls_1_2_without_an_aes_gcm_suite_is_refused(
    node: NodeServer, certs: Path, suites: str
) -> None:
    context = client_context(certs, maximum=ssl.TLSVersion.TLSv1_2, ciphers=suites)
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(speak_http2, node.address, context)


async def test_tls_1_2_without_a_client_certificate_is_cut_off_in_the_handshake(
    node: NodeServer, certs: Path
) -> None:
    context = client_context(certs, None, maximum=ssl.TLSVersion.TLSv1_2)
    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(speak_http2, node.address, context)


# -- the peer check ----------------------------------------------------------------------------


@contextlib.contextmanager
def stdlib_tls_server(files: TlsFiles, maximum: ssl.TLSVersion) -> Iterator[str]:
    """A TLS server presenting ``files`` (mutual TLS, the same CA), speaking at most
    ``maximum``, that completes handshakes and hangs up; yields its address."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.maximum_version = maximum
    context.load_cert_chain(files.cert, files.key)
    context.load_verify_locations(files.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            raw.settimeout(IO_LIMIT_S)
            with raw, contextlib.suppress(OSError):
                context.wrap_socket(raw, server_side=True).close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


async def test_the_peer_check_speaks_tls_1_3_only(certs: Path) -> None:
    """us probing an address that presents eu's real node certificate: over TLS 1.3 the
    certificate is read; over TLS 1.2 there is no verified handshake at all."""
    pems = TlsFiles.in_dir(certs, "us").read()
    eu = TlsFiles.in_dir(certs, "eu")
    with stdlib_tls_server(eu, ssl.TLSVersion.TLSv1_3) as address:
        der = await asyncio.to_thread(presented_certificate, address, pems)
    assert der == ssl.PEM_cert_to_DER_cert(eu.cert.read_text())
    with (
        stdlib_tls_server(eu, ssl.TLSVersion.TLSv1_2) as address,
        pytest.raises(ssl.SSLError),
    ):
        await asyncio.to_thread(presented_certificate, address, pems)
