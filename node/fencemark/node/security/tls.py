"""Transport security: a development CA, certificates, gRPC credentials, peer identities.

Every identity in a cluster is a certificate signed by the cluster's CA whose
subject alternative names hold exactly one ``fencemark://`` URI (a URI SAN: no
other name type and not the common name is ever read as an identity):

- ``fencemark://region/<name>`` for the node of a region (it serves and calls
  other nodes, so it is both a TLS server and a TLS client);
- ``fencemark://client/<name>`` for a client (a CLI user, an agent, the MCP
  server).

Nodes verify every caller's certificate (mutual TLS, ``require_client_auth``)
and read the identity from the call's auth context (:func:`peer_identity`);
what an identity may do is ``fencemark.node.api.authz``'s business. Clients verify
the node's certificate against the same CA, so the node's SANs must name the
host clients dial (``localhost``, ``127.0.0.1`` and the region's name by default,
plus ``--host`` values).

The CA here is a *development* CA: one EC P-256 key in a file next to the
certificates. docs/operations.md says how to rotate, and what a production CA
should do instead.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fencemark.node.rules import validation

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "Identity",
    "Kind",
    "TlsFiles",
    "create_ca",
    "init_dir",
    "issue",
    "issue_into",
    "p12_bundle",
    "peer_channel",
    "peer_identity",
    "retire_channel",
    "write_p12",
]

SCHEME = "fencemark"
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
CA_DAYS = 3650
LEAF_DAYS = 825  # what browsers accept for a leaf; rotate long before (operations.md)
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
P12_KDF_ROUNDS = 200_000  # PBKDF2 iterations of a PKCS#12 file's password
Kind = Literal["region", "client"]
KINDS: tuple[Kind, ...] = ("region", "client")

# The auth-context property gRPC core fills with the URI subject alternative
# names of a verified peer certificate, and with nothing else. (DNS names, e-mail
# addresses and IPs have properties of their own; ``x509_subject_alternative_name``
# holds every type alike, so a certificate whose DNS name reads
# ``fencemark://region/ap`` would pass there for the node of region ap.)
URI_SAN_PROPERTY = "peer_uri"


@dataclass(frozen=True, order=True)
class Identity:
    """Who a verified certificate says its holder is."""

    kind: Kind
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}://{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> Identity | None:
        """The identity a ``fencemark://KIND/NAME`` URI names; None for anything else."""
        prefix = f"{SCHEME}://"
        if not uri.startswith(prefix):
            return None
        kind, sep, name = uri[len(prefix) :].partition("/")
        if not sep or kind not in KINDS or validation.REGION.fullmatch(name) is None:
            return None
        return cls(kind, name)


def check_name(name: str, what: str = "name") -> str:
    """An identity name: the region name syntax (it is also a file name)."""
    return validation.region(name, what)


# -- files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """Where one identity's certificate, key and the cluster CA are."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path | str, name: str) -> TlsFiles:
        """The layout ``fencemark certs`` writes: ``ca.pem``, ``NAME.pem``, ``NAME-key.pem``."""
        d = Path(directory)
        return cls(d / CA_CERT, d / f"{name}.pem", d / f"{name}-key.pem")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificates, certificate chain, private key), PEM; OSError names the file."""
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(path.read_bytes())
            except OSError as exc:
                raise OSError(f"cannot read {path}: {exc.strerror or exc}") from exc
        return out[0], out[1], out[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        """A node's port: its certificate, and every caller must present one from the CA."""
        ca, cert, key = self.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A caller's side: verify the node against the CA and present this certificate."""
        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def identity(self) -> Identity:
        """The identity this certificate carries (ValueError if it carries none)."""
        cert = x509.load_pem_x509_certificate(self.read()[1])
        found = identities_of(cert)
        if len(found) != 1:
            raise ValueError(f"{self.cert}: expected one {SCHEME}:// identity, found {found}")
        return found[0]


def peer_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to a peer node: mutual TLS with ``credentials``, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


_RETIRING: set[asyncio.Task[None]] = set()
RETIRE_GRACE_S = 10.0


def retire_channel(channel: grpc.aio.Channel, grace: float = RETIRE_GRACE_S) -> None:
    """Close a replaced peer channel in the background, once its calls end (or ``grace``)."""
    task = asyncio.get_running_loop().create_task(channel.close(grace))
    _RETIRING.add(task)
    task.add_done_callback(_RETIRING.discard)


# -- the server's side: who is calling ----------------------------------------------------


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
    """The caller's identity, from its verified certificate; None when there is none.

    gRPC core puts a peer certificate's properties in the auth context only
    after verifying it against the server's root certificates, so what is read
    here is as trustworthy as the CA. Only URI SANs are read, as
    :func:`identities_of` reads a certificate: a DNS name, an e-mail address or
    a common name spelling ``fencemark://region/ap`` names no one. A
    certificate carrying no ``fencemark://`` URI, or more than one, identifies
    no one.
    """
    sans = context.auth_context().get(URI_SAN_PROPERTY) or ()
    found = {i for raw in sans if (i := Identity.parse(_text(raw))) is not None}
    return found.pop() if len(found) == 1 else None


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def identities_of(cert: x509.Certificate) -> list[Identity]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    return sorted({i for uri in uris if (i := Identity.parse(uri)) is not None})


# -- making certificates -----------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    """Write a new file (never overwrite: FileExistsError); keys readable by the owner only.

    Whole or not at all: written beside it, then linked into place (a link never
    replaces a file), so a node waiting for its certificate (the image's entrypoint)
    never reads half of one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(partial, flags, 0o600 if secret else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(partial, path)
    finally:
        partial.unlink()


def _key_usage(*, key_cert_sign: bool = False, crl_sign: bool = False) -> x509.KeyUsage:
    """Signatures (the TLS handshake's ECDSA), and for a CA signing certificates."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def create_ca(
    common_name: str = "Fencemark development CA", days: int = CA_DAYS
) -> tuple[bytes, bytes]:
    """A new CA: (certificate PEM, private key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    identity: Identity,
    *,
    hosts: Iterable[str] = (),
    days: int = LEAF_DAYS,
) -> tuple[bytes, bytes]:
    """A certificate for ``identity`` signed by the CA: (certificate PEM, key PEM).

    A region's certificate is good for serving (its SANs: ``localhost``,
    ``127.0.0.1``, the region's name and ``hosts``) and for calling other
    nodes; a client's only for calling.
    """
    check_name(identity.name)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    serving = identity.kind == "region"
    if serving:
        hosts = (*DEFAULT_HOSTS, identity.name, *hosts)
    # The common name is never read by a node (identities are URI SANs), but etcd
    # takes it as the user a member is: kind-qualified, so that no client's
    # certificate can be the user of a region (fencemark.node.coordination.access).
    return _sign(ca_cert_pem, ca_key_pem, str(identity), names + _host_names(hosts),
                 serving=serving, days=days)  # fmt: skip


def issue_named(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    common_name: str,
    *,
    server_hosts: Iterable[str] = (),
    days: int = LEAF_DAYS,
) -> tuple[bytes, bytes]:
    """A certificate of the CA that names no Fencemark identity (no ``fencemark://``
    URI: a node refuses it, ``no_identity``), for etcd: a client certificate whose
    common name is the etcd user it is (``root``), or with ``server_hosts`` an etcd
    server's, good for those names. (certificate PEM, key PEM)."""
    names = _host_names(server_hosts)
    return _sign(ca_cert_pem, ca_key_pem, common_name, names, serving=bool(names), days=days)


def _host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _sign(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    common_name: str,
    names: list[x509.GeneralName],
    *,
    serving: bool,
    days: int,
) -> tuple[bytes, bytes]:
    """A leaf certificate of the CA for ``common_name`` and ``names`` (SANs), for
    calling and, when ``serving``, for serving too."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key is not an EC key made by fencemark certs")
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if serving:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_into(
    directory: Path, identity: Identity, *, hosts: Iterable[str] = (), days: int = LEAF_DAYS
) -> TlsFiles:
    """Sign a certificate for ``identity`` with ``directory``'s CA and write it there."""
    files = TlsFiles.in_dir(directory, identity.name)
    ca_cert = (directory / CA_CERT).read_bytes()
    ca_key = (directory / CA_KEY).read_bytes()
    cert, key = issue(ca_cert, ca_key, identity, hosts=hosts, days=days)
    _write_new(files.cert, files.key, cert, key)
    return files


def issue_named_into(
    directory: Path, common_name: str, *, server_hosts: Iterable[str] = ()
) -> tuple[Path, Path]:
    """``issue_named`` with ``directory``'s CA, written there as ``NAME.pem`` and
    ``NAME-key.pem`` (refused if either exists): (certificate, key)."""
    cert_path, key_path = directory / f"{common_name}.pem", directory / f"{common_name}-key.pem"
    cert, key = issue_named(
        (directory / CA_CERT).read_bytes(), (directory / CA_KEY).read_bytes(), common_name,
        server_hosts=server_hosts,
    )  # fmt: skip
    _write_new(cert_path, key_path, cert, key)
    return cert_path, key_path


def _write_new(cert_path: Path, key_path: Path, cert: bytes, key: bytes) -> None:
    """A new certificate and its key (readable by the owner only); FileExistsError if
    either file is there already."""
    for path in (cert_path, key_path):
        if path.exists():
            raise FileExistsError(f"{path} exists: remove it first to issue a new one")
    _write(key_path, key, secret=True)
    _write(cert_path, cert)


def init_dir(
    directory: Path,
    *,
    regions: Sequence[str],
    clients: Sequence[str] = (),
    hosts: Iterable[str] = (),
) -> list[Path]:
    """A development CA and one certificate per region and client, in ``directory``.

    Refuses (FileExistsError) to overwrite a CA that is already there: a new CA
    would lock every holder of the old one's certificates out.
    """
    names = [check_name(n, "--regions") for n in regions]
    names += [check_name(n, "--clients") for n in clients]
    if len(set(names)) != len(names):
        raise ValueError("region and client names must all differ (each names its files)")
    if (directory / CA_KEY).exists() or (directory / CA_CERT).exists():
        raise FileExistsError(f"{directory} already holds a CA; use `fencemark certs issue`")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = create_ca()
    _write(directory / CA_KEY, key, secret=True)
    _write(directory / CA_CERT, cert)
    written = [directory / CA_CERT, directory / CA_KEY]
    extra = tuple(hosts)
    for region in regions:
        files = issue_into(directory, Identity("region", region), hosts=extra)
        written += [files.cert, files.key]
    for client in clients:
        files = issue_into(directory, Identity("client", client))
        written += [files.cert, files.key]
    return written


# -- a browser's copy: PKCS#12 ------------------------------------------------------------


def p12_bundle(files: TlsFiles, password: bytes) -> bytes:
    """``files``' certificate, key and CA in one PKCS#12 file, for a browser to import.

    Encrypted with ``password`` (PBES2: PBKDF2-SHA256 and AES-256-CBC, MAC SHA-256),
    which Chromium's and Firefox's certificate stores import; its friendly name is the
    certificate's ``fencemark://`` identity, what a browser lists it by."""
    if not password:
        raise ValueError("a PKCS#12 file holds the private key: give it a password")
    ca_pem, cert_pem, key_pem = files.read()
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{files.key}: not an EC key made by fencemark certs")
    encryption = (
        serialization.PrivateFormat.PKCS12.encryption_builder()
        .kdf_rounds(P12_KDF_ROUNDS)
        .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC)
        .hmac_hash(hashes.SHA256())
        .build(password)
    )
    return pkcs12.serialize_key_and_certificates(
        files.identity().uri.encode(),
        key,
        x509.load_pem_x509_certificate(cert_pem),
        x509.load_pem_x509_certificates(ca_pem),
        encryption,
    )


def write_p12(directory: Path, name: str, password: bytes) -> Path:
    """``directory/NAME.p12`` from ``NAME.pem``, ``NAME-key.pem`` and ``ca.pem`` there
    (owner-readable only; FileExistsError if it is there already)."""
    path = directory / f"{check_name(name)}.p12"
    if path.exists():
        raise FileExistsError(f"{path} exists: remove it first to make a new one")
    _write(path, p12_bundle(TlsFiles.in_dir(directory, name), password), secret=True)
    return path
