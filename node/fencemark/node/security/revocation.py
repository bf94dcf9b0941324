"""Certificate revocation: a CRL in the TLS directory, checked on every call.

``fencemark certs revoke`` adds a certificate's serial number to ``crl.pem``, an
X.509 CRL signed by the CA in the same directory (the standard format, so
``openssl crl -in crl.pem -text`` reads it and other tools can write it). A node
reads ``crl.pem`` from its ``--tls-dir`` at start and again whenever the file
changes (``fencemark.node.security.tls_reload``); each CRL in it must be signed by a CA of
the node's ``ca.pem``, or the node refuses it (at start: refuses to start).

Revocation names a *certificate* (issuer and serial), not an identity: a client
whose key leaked is revoked, and the same name gets a new certificate that works.
The node checks the caller's certificate on every ``fencemark.v1`` call, clients
and peers alike, in the ``Authorize`` interceptor before any servicer runs:
``PERMISSION_DENIED``, denial ``revoked_certificate``. gRPC's TLS handshake in
Python takes no CRL, so the check cannot happen in the handshake itself.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from fencemark.node.rules.errors import Denial, PermissionDenied
from fencemark.node.security.tls import CA_CERT, CA_DAYS, CA_KEY, identities_of

__all__ = ["CRL_FILE", "Revocations", "certificate_refusal", "read_revoked", "revoke"]

CRL_FILE = "crl.pem"
_CRL_BLOCK = re.compile(rb"-----BEGIN X509 CRL-----.+?-----END X509 CRL-----\s*", re.DOTALL)
PEM_PROPERTY = "x509_pem_cert"  # the auth-context property with the caller's certificate

Revoked = frozenset[tuple[str, int]]  # (issuer DN, serial)


def _cas(ca_pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise ValueError(f"{CA_CERT}: not PEM certificates ({exc})") from exc


def _crls(pem: bytes, where: str) -> list[x509.CertificateRevocationList]:
    blocks = _CRL_BLOCK.findall(pem)
    if not blocks and pem.strip():
        raise ValueError(f"{where}: no PEM X509 CRL in it")
    try:
        return [x509.load_pem_x509_crl(block) for block in blocks]
    except ValueError as exc:
        raise ValueError(f"{where}: not a valid CRL ({exc})") from exc


def _signed_by_one_of(crl: x509.CertificateRevocationList, cas: Iterable[x509.Certificate]) -> bool:
    for ca in cas:
        if ca.subject != crl.issuer:
            continue
        key = ca.public_key()
        if isinstance(key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey) and (
            crl.is_signature_valid(key)
        ):
            return True
    return False


def read_revoked(ca_pem: bytes, crl_path: Path) -> Revoked:
    """The certificates the CRLs at ``crl_path`` revoke; empty when there is no file.

    ValueError (naming the file) for a CRL that does not parse or that no CA of
    ``ca_pem`` signed: a forged or foreign list must not lock anyone out, and a
    broken one must not silently readmit anyone.
    """
    try:
        pem = crl_path.read_bytes()
    except FileNotFoundError:
        return frozenset()
    except OSError as exc:
        raise OSError(f"cannot read {crl_path}: {exc.strerror or exc}") from exc
    cas = _cas(ca_pem)
    revoked: set[tuple[str, int]] = set()
    for crl in _crls(pem, str(crl_path)):
        if not _signed_by_one_of(crl, cas):
            raise ValueError(
                f"{crl_path}: a CRL of {crl.issuer.rfc4514_string()!r} not signed by a CA"
                f" in {CA_CERT}"
            )
        issuer = crl.issuer.rfc4514_string()
        revoked.update((issuer, entry.serial_number) for entry in crl)
    return frozenset(revoked)


@dataclass(frozen=True)
class _Caller:
    issuer: str
    serial: int
    identity: str


@functools.lru_cache(maxsize=4096)
def _caller(pem: bytes) -> _Caller:
    """A verified certificate's issuer, serial and identity (cached: parsed once per cert)."""
    return _described(x509.load_pem_x509_certificate(pem))


@functools.lru_cache(maxsize=4096)
def _caller_der(der: bytes) -> _Caller:
    return _described(x509.load_der_x509_certificate(der))


def _described(cert: x509.Certificate) -> _Caller:
    found = identities_of(cert)
    return _Caller(
        cert.issuer.rfc4514_string(), cert.serial_number, str(found[0]) if found else "?"
    )


def certificate_refusal(cert: x509.Certificate, revoked: Revoked) -> str | None:
    """``IDENTITY, serial HEX`` when ``revoked`` lists ``cert``; None when it does not.

    For a certificate a node was shown rather than a caller's: the one a peer's
    address presents (``fencemark.node.replication.peer_check``).
    """
    if (cert.issuer.rfc4514_string(), cert.serial_number) not in revoked:
        return None
    found = identities_of(cert)
    return f"{found[0] if found else '?'}, serial {cert.serial_number:x}"


class Revocations:
    """The certificates this node refuses; replaced whole when ``crl.pem`` changes."""

    def __init__(self, revoked: Revoked = frozenset()) -> None:
        self.revoked = revoked

    def check(self, context: grpc.aio.ServicerContext[Any, Any]) -> PermissionDenied | None:
        """Why the caller's certificate is refused, or None. Free while nothing is revoked."""
        if not self.revoked:
            return None
        pems = context.auth_context().get(PEM_PROPERTY) or ()
        for pem in pems:
            if (denied := self._refusal(_caller(bytes(pem)))) is not None:
                return denied
        return None

    def check_der(self, der: bytes) -> PermissionDenied | None:
        """``check`` for a caller met outside gRPC (the dashboard's HTTPS): its
        verified certificate in DER."""
        return self._refusal(_caller_der(der)) if self.revoked else None

    def _refusal(self, caller: _Caller) -> PermissionDenied | None:
        if (caller.issuer, caller.serial) not in self.revoked:
            return None
        return PermissionDenied(
            Denial.REVOKED_CERTIFICATE,
            f"the certificate of {caller.identity} (serial {caller.serial:x}) is"
            f" revoked ({CRL_FILE}): get a new one (fencemark certs issue)",
            identity=caller.identity,
        )


# -- writing the list ----------------------------------------------------------------


def serial_of(cert_path: Path) -> int:
    try:
        return x509.load_pem_x509_certificate(cert_path.read_bytes()).serial_number
    except OSError as exc:
        raise OSError(f"cannot read {cert_path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{cert_path}: not a PEM certificate ({exc})") from exc


def revoke(directory: Path, serials: Iterable[int]) -> tuple[Path, int]:
    """Add ``serials`` to ``directory``'s CRL, signed by the CA there; (path, entries).

    CRLs of other CAs in the file (during a CA rotation) are kept as they are.
    The file is replaced atomically, so a node never reads half of it.
    """
    ca_cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key is not an EC key made by fencemark certs")
    path = directory / CRL_FILE
    others: list[x509.CertificateRevocationList] = []
    entries: dict[int, datetime.datetime] = {}
    if path.exists():
        for crl in _crls(path.read_bytes(), str(path)):
            if crl.issuer == ca_cert.subject and crl.is_signature_valid(ca_key.public_key()):
                entries.update((e.serial_number, e.revocation_date_utc) for e in crl)
            else:
                others.append(crl)
    now = datetime.datetime.now(datetime.UTC)
    for serial in serials:
        entries.setdefault(serial, now)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        # Nodes do not expire the list; this only satisfies the format.
        .next_update(now + datetime.timedelta(days=CA_DAYS))
    )
    for serial, when in sorted(entries.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in (crl, *others))
    temporary = path.with_name(f".{CRL_FILE}.tmp")
    temporary.write_bytes(pem)
    os.replace(temporary, path)
    return path, len(entries)
