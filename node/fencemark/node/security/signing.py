"""Grants signed by the home region (issue 7; docs/security.md, *Signed grants*).

With TLS, the node of a record's home region signs every grant it makes with the
private key of its node certificate, and a merge refuses a new fence grant whose
signature is missing, wrong, or made by a key whose certificate is not the cluster
CA's certificate of the record's home region (``fencemark.node.rules.integrity``).

A signature is ``key_id || r || s`` (72 bytes): ``key_id`` is the first 8 bytes of
SHA-256 over the signing certificate's SubjectPublicKeyInfo, and ``r || s`` an
ECDSA P-256 / SHA-256 signature (RFC 6979 deterministic, low ``s``) of
``codec.grant_message``. The key id tells a verifier which certificate to check
it with; a :class:`Keyring` holds the certificates a node knows, each one checked
when it is added: issued by the cluster CA, one ``fencemark://region/R``
identity, an EC P-256 key. Whoever relays such a certificate, it is as
trustworthy as the CA, so a node learns unknown ones from the peer that delivered
the state (``Replication.Certificates``) and keeps them (storage meta), old ones
included: after a node's certificate is re-issued, the grants it signed with the
old key still verify everywhere — unless that certificate is revoked: from the
moment a node has the CRL listing it (``crl.pem``, reloaded while it runs), a new
fence grant it signed is refused ``revoked_signer``. Fence grants a node already
held are not checked again (``integrity.check``), so what it merged before stays.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from fencemark.node.crdt import Birth, Record, Stamp, codec
from fencemark.node.crdt.fence import FenceState, Grant
from fencemark.node.crdt.record import QUEUE, Register
from fencemark.node.security.revocation import Revocations
from fencemark.node.security.tls import TlsFiles, identities_of

KEY_ID_SIZE = 8
SCALAR_SIZE = 32  # P-256
SIGNATURE_SIZE = KEY_ID_SIZE + 2 * SCALAR_SIZE
# The order of P-256's base point: a signature's s must be at most half of it.
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
META_PREFIX = "signer:"  # storage meta: signer:<key id hex> -> certificate PEM
ALGORITHM = ec.ECDSA(hashes.SHA256(), deterministic_signing=True)

# Refusal reasons (integrity.MergeRefused.reason).
UNSIGNED = "unsigned_grant"
UNSIGNED_BIRTH = "unsigned_birth"
UNSIGNED_SEEN = "unsigned_seen"
UNSIGNED_WRITE = "unsigned_write"
UNSIGNED_END = "unsigned_end"
UNSIGNED_MOVE = "unsigned_move"
UNSIGNED_LEASE = "unsigned_lease"
BAD_SIGNATURE = "bad_signature"
UNKNOWN_SIGNER = "unknown_signer"
SIGNER_NOT_HOME = "signer_not_home"
REVOKED_SIGNER = "revoked_signer"


def certificate_pem(der: bytes) -> str:
    """A DER certificate as PEM text (how a data file keeps a signer's certificate)."""
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM).decode()


def key_id(public_key: ec.EllipticCurvePublicKey) -> bytes:
    spki = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()[:KEY_ID_SIZE]


@dataclass(frozen=True)
class Signer:
    """A home node's signing key and the key id of its certificate."""

    key: ec.EllipticCurvePrivateKey
    key_id: bytes

    @classmethod
    def from_pem(cls, key_pem: bytes) -> Signer:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
            raise ValueError("a node key must be EC P-256 to sign grants")
        return cls(key, key_id(key.public_key()))

    @classmethod
    def from_files(cls, files: TlsFiles) -> Signer:
        return cls.from_pem(files.read()[2])

    def _sign(self, message: bytes) -> bytes:
        r, s = decode_dss_signature(self.key.sign(message, ALGORITHM))
        s = min(s, P256_ORDER - s)  # one signature per message: no (r, n - s) twin
        return self.key_id + r.to_bytes(SCALAR_SIZE, "big") + s.to_bytes(SCALAR_SIZE, "big")

    def signature(self, record_key: str, token: int, grant: Grant) -> bytes:
        return self._sign(codec.grant_message(record_key, token, grant))

    def sign_birth(self, record: Record, region: str) -> Record:
        """``record`` with ``region``'s birth signed (unchanged when it already is):
        a region vouches that it created the record at that stamp."""
        birth = record.births.get(region)
        if birth is None or birth.signature:
            return record
        signature = self._sign(codec.birth_message(record.key, region, birth))
        return record.with_birth(region, birth._replace(signature=signature))

    def sign_seen(self, record: Record, region: str) -> Record:
        """``record`` with ``region``'s sighting signed (unchanged when it already is,
        or there is none): a region vouches that it held the record, born elsewhere,
        at that stamp — so a birth of its own can never take the record's home."""
        seen = record.seen.get(region)
        if seen is None or seen.signature:
            return record
        signature = self._sign(codec.seen_message(record.key, region, seen))
        return record.see(region, seen._replace(signature=signature))

    def sign_writes(self, record: Record, stamp: Stamp) -> Record:
        """``record`` with the registers written at ``stamp`` signed: a write this
        node admitted at the epoch of an unreleased grant, which only the home (or
        the region that made the grant) can admit (docs/security.md, *Signed
        writes*)."""

        def signature(kind: str, name: str, register: Register) -> bytes:
            return self._sign(codec.write_message(record.key, kind, name, register))

        return record.with_signed_writes(stamp, signature)

    def seal(self, record_key: str, fence: FenceState, *, end: bool, move: bool) -> FenceState:
        """``fence`` with the end of its fence token's claim sealed, or else its
        lease's expiry (``end``: this node decides that claim), and its move signed
        (``move``: this node is the home), where they are not yet: only the node that
        decides them can say a claim ended, how long its lease runs, or that the
        fence moved (docs/security.md, *Signed writes*)."""
        top = fence.fence
        if end and top in fence.grants and fence.ended(top) and top not in fence.seals:
            fence = fence.sealed(self._sign(codec.end_message(record_key, top)))
        if end and fence.unreleased() and fence.expiry(top) and not fence.lease_seal():
            expiry = fence.expiry(top)
            fence = fence.lease_sealed(self._sign(codec.lease_message(record_key, top, expiry)))
        if move and fence.moved and not fence.moved_signature:
            fence = fence.move_signed(self._sign(codec.move_message(record_key, fence.moved)))
        return fence

    def sign_fence(self, record_key: str, fence: FenceState) -> FenceState:
        """``fence`` with its fence grant signed (unchanged when it already is)."""
        holder = fence.holder()
        if holder is None or holder.signature:
            return fence
        return fence.signed(self.signature(record_key, fence.fence, holder))


@dataclass(frozen=True)
class _Signer:
    region: str
    public_key: ec.EllipticCurvePublicKey
    der: bytes
    issuer: str  # with the serial: what a CRL names (fencemark.node.security.revocation)
    serial: int


class Keyring:
    """The node certificates of the cluster CA this node knows, by key id.

    ``revocations`` is the node's revocation list in use (``LiveTls.revocations``,
    replaced whole when ``crl.pem`` changes): a signature by a revoked certificate
    is refused from the moment its revocation is loaded.
    """

    def __init__(
        self, cas: Iterable[x509.Certificate], revocations: Revocations | None = None
    ) -> None:
        self.cas = list(cas)
        self.revocations = revocations if revocations is not None else Revocations()
        self._signers: dict[bytes, _Signer] = {}
        # When each (peer region, key id) was last asked for (replication.signers).
        self.asked: dict[tuple[str, bytes], float] = {}
        # The fetches of certificates in flight, by (peer region, key id): a merge
        # needing a key id already asked of its peer awaits that fetch instead of
        # being refused meanwhile; merges needing nothing new await nothing.
        self.fetches: dict[tuple[str, bytes], asyncio.Task[None]] = {}

    @classmethod
    def for_files(cls, files: TlsFiles, revocations: Revocations | None = None) -> Keyring:
        """A keyring trusting ``files``' CA bundle, knowing ``files``' own certificate."""
        ca, cert, _ = files.read()
        keyring = cls(x509.load_pem_x509_certificates(ca), revocations)
        keyring.add(x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER))
        return keyring

    def __contains__(self, kid: bytes) -> bool:
        return kid in self._signers

    def __len__(self) -> int:
        return len(self._signers)

    def add(self, der: bytes) -> bytes:
        """Check a certificate and keep it; returns its key id (ValueError says why not)."""
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:
            raise ValueError(f"not a DER certificate: {exc}") from exc
        if not any(_issued_by(cert, ca) for ca in self.cas):
            raise ValueError(f"{cert.subject.rfc4514_string()} is not issued by the cluster CA")
        found = identities_of(cert)
        if len(found) != 1 or found[0].kind != "region":
            raise ValueError(f"not a node certificate: identities {[str(i) for i in found]}")
        public_key = cert.public_key()
        if not isinstance(public_key, ec.EllipticCurvePublicKey) or (
            public_key.curve.name != "secp256r1"
        ):
            raise ValueError("a signer's key must be EC P-256")
        kid = key_id(public_key)
        self._signers[kid] = _Signer(
            found[0].name,
            public_key,
            cert.public_bytes(serialization.Encoding.DER),
            cert.issuer.rfc4514_string(),
            cert.serial_number,
        )
        return kid

    def known(self) -> list[tuple[bytes, bytes]]:
        """(key id, DER certificate) of every signer known."""
        return [(kid, signer.der) for kid, signer in self._signers.items()]

    def certificates(self, kids: Iterable[bytes]) -> list[bytes]:
        """The DER certificates of the key ids this keyring knows (others left out)."""
        return [self._signers[k].der for k in dict.fromkeys(kids) if k in self._signers]

    def missing(self, records: Iterable[Record]) -> set[bytes]:
        """Key ids of the fence grants and births in ``records`` that this keyring
        does not know."""
        out = set()
        for record in records:
            holder = record.fence.holder()
            signatures = [birth.signature for birth in record.births.values()]
            signatures.extend(seen.signature for seen in record.seen.values())
            if holder is not None:
                signatures.append(holder.signature)
                signatures.extend(reg.signature for _, _, reg in record.registers())
            signatures.extend(record.fence.seals.values())
            signatures.extend(sig for _, sig in record.fence.lease_seals.values())
            signatures.append(record.fence.moved_signature)
            for sig in signatures:
                if len(sig) == SIGNATURE_SIZE and sig[:KEY_ID_SIZE] not in self._signers:
                    out.add(sig[:KEY_ID_SIZE])
        return out

    def problem(self, record_key: str, token: int, grant: Grant) -> tuple[str, str] | None:
        """Why ``grant`` of ``token`` is not signed by its region's node with a
        certificate that is not revoked: (reason, detail), or None when it is."""
        if not grant.signature:
            return UNSIGNED, f"token {token}'s grant carries no signature"
        message = codec.grant_message(record_key, token, grant)
        return self._check(f"token {token}", grant.signature, grant.region, message)

    def birth_problem(
        self, record_key: str, region: str, birth: Birth, *, takes_home: bool = False
    ) -> tuple[str, str] | None:
        """Why ``region``'s birth of the record is not signed by that region's node
        (docs/security.md, *Signed births*): (reason, detail), or None when it is.
        A birth that ``takes_home`` from another region's is refused when its key is
        revoked too; any other is not: a birth never changes, so one signed before its
        key was revoked would be refused for good by every node that had not merged it."""
        if not birth.signature:
            return UNSIGNED_BIRTH, f"the birth in region {region!r} carries no signature"
        message = codec.birth_message(record_key, region, birth)
        what = f"the birth in region {region!r}"
        return self._check(what, birth.signature, region, message, revocable=takes_home)

    def seen_problem(self, record_key: str, region: str, seen: Birth) -> tuple[str, str] | None:
        """Why ``region``'s sighting of the record is not signed by that region's node:
        (reason, detail), or None when it is. A revoked key's sighting is accepted: it
        only ever holds against its own region, and one signed before the revocation
        must reach every node alike, or their homes would differ."""
        what = f"the sighting by region {region!r}"
        if not seen.signature:
            return UNSIGNED_SEEN, f"{what} carries no signature"
        message = codec.seen_message(record_key, region, seen)
        return self._check(what, seen.signature, region, message, revocable=False)

    def write_problem(
        self, record_key: str, kind: str, name: str, register: Register, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """Why ``register``, written at the epoch of an unreleased grant (or a
        work-queue register), is not signed by the node of one of ``regions`` (the
        home, and the region that made the grant; for the queue, the regions that
        created the record): (reason, detail), or None when it is."""
        what = (
            f"the write of {kind} {name!r} at {tuple(register.stamp)}"
            if name
            else (f"the write of {kind} at {tuple(register.stamp)}")
        )
        allowed = sorted(set(regions))
        if not register.signature:
            which = "a work-queue register" if kind == QUEUE else "at the epoch of a claim"
            return UNSIGNED_WRITE, (
                f"{what} is {which} and carries no signature: only"
                f" {' or '.join(map(repr, allowed))} admits such a write"
            )
        message = codec.write_message(record_key, kind, name, register)
        region = self._region_of(register.signature, allowed)
        return self._check(what, register.signature, region, message)

    def end_problem(
        self, record_key: str, token: int, seal: bytes, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """Why the end of ``token``'s claim (its release or lapse) is not sealed by
        the node of one of ``regions``: (reason, detail), or None when it is."""
        what = f"the end of token {token}'s claim"
        if not seal:
            return UNSIGNED_END, f"{what} carries no seal of the node that ended it"
        message = codec.end_message(record_key, token)
        return self._check(what, seal, self._region_of(seal, regions), message)

    def lease_problem(
        self, record_key: str, token: int, expiry_ms: int, seal: bytes, regions: Iterable[str]
    ) -> tuple[str, str] | None:
        """Why ``token``'s lease ending at ``expiry_ms`` is not sealed by the node of
        one of ``regions`` (the deciders of its claim): (reason, detail), or None."""
        what = f"token {token}'s lease to {expiry_ms}"
        if not seal:
            return UNSIGNED_LEASE, f"{what} carries no seal of the node that decides the claim"
        message = codec.lease_message(record_key, token, expiry_ms)
        return self._check(what, seal, self._region_of(seal, regions), message)

    def move_problem(
        self, record_key: str, token: int, signature: bytes, home: str
    ) -> tuple[str, str] | None:
        """Why the fence's move to ``token`` is not signed by ``home``'s node."""
        what = f"the move of the fence to {token}"
        if not signature:
            return UNSIGNED_MOVE, f"{what} carries no signature of the home {home!r}"
        return self._check(what, signature, home, codec.move_message(record_key, token))

    def _region_of(self, signature: bytes, regions: Iterable[str]) -> str:
        """The region of ``regions`` to check ``signature`` against: its signer's,
        when that is one of them (else the first, which then refuses it)."""
        allowed = sorted(set(regions))
        found = self._signers.get(signature[:KEY_ID_SIZE])
        return found.region if found is not None and found.region in allowed else allowed[0]

    def _check(
        self, what: str, sig: bytes, region: str, message: bytes, *, revocable: bool = True
    ) -> tuple[str, str] | None:
        if len(sig) != SIGNATURE_SIZE:
            return BAD_SIGNATURE, f"{what}: the signature is {len(sig)} bytes, not 72"
        kid = sig[:KEY_ID_SIZE]
        signer = self._signers.get(kid)
        if signer is None:
            return UNKNOWN_SIGNER, f"{what} is signed by key {kid.hex()}, unknown here"
        if signer.region != region:
            return SIGNER_NOT_HOME, (
                f"{what} of region {region!r} is signed by the node of region {signer.region!r}"
            )
        r = int.from_bytes(sig[KEY_ID_SIZE : KEY_ID_SIZE + SCALAR_SIZE], "big")
        s = int.from_bytes(sig[KEY_ID_SIZE + SCALAR_SIZE :], "big")
        if not (0 < r < P256_ORDER and 0 < s <= P256_ORDER // 2):
            return BAD_SIGNATURE, f"{what}: the signature is not canonical"
        try:
            signer.public_key.verify(encode_dss_signature(r, s), message, ALGORITHM)
        except InvalidSignature:
            return BAD_SIGNATURE, f"{what}: the signature does not match what it signs"
        # Last: a refusal names a key that really signed it.
        if revocable and (signer.issuer, signer.serial) in self.revocations.revoked:
            return REVOKED_SIGNER, (
                f"{what} is signed by key {kid.hex()}, whose certificate (region"
                f" {signer.region!r}, serial {signer.serial:x}) is revoked"
            )
        return None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
