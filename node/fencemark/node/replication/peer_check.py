"""Which certificate a peer's address presents, checked before replicating with it.

The node serving a call refuses a revoked caller (``fencemark.node.api.authz``), but
gRPC's Python client does not show the caller the *server's* certificate, so
without this module a node would keep pulling from, and pushing to, a peer whose
certificate is on its CRL. :class:`PeerCheck` closes that gap from the calling
side: it opens a separate TLS connection to the peer's address with the standard
library's ``ssl`` module (this node's own certificate, the CA bundle, ALPN
``h2``, TLS 1.3 only, ``PROBE_TIMEOUT_S``; in a thread, so the event loop never
blocks), reads the certificate the peer presents and checks it:

- against the node's revocation list in use (``LiveTls.revocations``, the CRL
  ``fencemark.node.security.revocation`` reads): ``revoked_certificate``;
- for the identity of that peer's region, as the Replication servicer checks a
  caller's: another region's node certificate is ``region_mismatch``, one that is
  no node's ``unauthenticated_peer``.

The verdict is cached and taken again whenever the CRL in use or the node's own
channel credentials change, after ``RECHECK_S`` for an admitted peer and after
``REFUSED_RECHECK_S`` for a refused one (a peer given a new certificate is taken
back within seconds, without a restart). A probe that cannot complete (the peer
is down, a handshake the CA does not vouch for) admits nothing either; it is
retried at the next call. The replicator asks :meth:`PeerCheck.admit` before every
call to the peer; a refusal is raised as :class:`PeerRefused`, a
``grpc.aio.AioRpcError`` (``PERMISSION_DENIED``, or ``UNAVAILABLE`` when the probe
failed) made locally, so the replicator handles it as it handles the same
refusal from the peer: nothing is sent, the peer is backed off and shows
``reachable=false`` with the reason in ``last_error``.

The probe is a separate connection, not the one gRPC calls on: it shows what the
address presents to anyone connecting now. The replicator reopens the peer's
channel when it refuses the peer, so the connection it calls on after the peer
is admitted again is a new handshake.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from cryptography import x509

from fencemark.node.replication.peers import PeerStats
from fencemark.node.rules.errors import Denial
from fencemark.node.security.revocation import CRL_FILE, Revoked, certificate_refusal
from fencemark.node.security.tls import Identity, identities_of
from fencemark.node.security.tls_reload import LiveTls

__all__ = [
    "PROBE_TIMEOUT_S",
    "RECHECK_S",
    "REFUSED_RECHECK_S",
    "PeerCheck",
    "PeerRefused",
    "presented_certificate",
]

log = logging.getLogger(__name__)

RECHECK_S = 60.0  # an admitted peer's certificate is looked at again after this
REFUSED_RECHECK_S = 5.0  # a refused peer's sooner: a re-issued certificate is taken quickly
FAILED_RECHECK_S = 0.5  # a probe that failed: concurrent callers share it, then retry
PROBE_TIMEOUT_S = 5.0  # connecting, and the handshake, each


class PeerRefused(grpc.aio.AioRpcError):
    """A call to a peer refused on this side, before anything was sent."""

    def __init__(self, code: grpc.StatusCode, denial: str, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)
        self.denial = denial  # a Denial value, or "" when the probe failed


@dataclass(frozen=True)
class _Verdict:
    revoked: Revoked  # the revocation list in use when it was taken (compared by identity)
    channel: object  # the node's channel credentials then (compared by identity)
    until: float  # time.monotonic() after which it is taken again
    code: grpc.StatusCode | None = None  # None: admitted
    denial: str = ""
    details: str = ""

    address: str = ""  # the address it was taken at (a peer of several addresses moves on)

    def current(self, revoked: Revoked, channel: object, address: str) -> bool:
        return (
            self.revoked is revoked
            and self.channel is channel
            and self.address == address
            and time.monotonic() < self.until
        )


class PeerCheck:
    """The verdict on the certificate one peer's address presents (module docstring)."""

    def __init__(self, stats: PeerStats, tls: LiveTls, *, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.stats = stats
        self.tls = tls
        self.identity = Identity("region", stats.region)
        self.timeout = timeout
        self._verdict: _Verdict | None = None
        self._lock = asyncio.Lock()
        self.probes = 0  # handshakes made

    @property
    def refused(self) -> bool:
        """Whether the last verdict refused the peer (revoked, or another identity)."""
        v = self._verdict
        return v is not None and v.code == grpc.StatusCode.PERMISSION_DENIED

    async def admit(self) -> None:
        """Return if the peer may be called now; raise :class:`PeerRefused` if not."""
        verdict = self._verdict
        revoked, channel = self.tls.revocations.revoked, self.stats.credentials
        address = self.stats.address
        if verdict is None or not verdict.current(revoked, channel, address):
            async with self._lock:  # one probe at a time; the others take its verdict
                verdict = self._verdict
                revoked, channel = self.tls.revocations.revoked, self.stats.credentials
                address = self.stats.address
                if verdict is None or not verdict.current(revoked, channel, address):
                    verdict = replace(await self._probe(revoked, channel), address=address)
                    self._verdict = verdict
        if verdict.code is not None:
            # A new exception each time: re-raising one would grow its traceback.
            raise PeerRefused(verdict.code, verdict.denial, verdict.details)

    async def _probe(self, revoked: Revoked, channel: object) -> _Verdict:
        self.probes += 1
        now = time.monotonic()
        try:
            der = await asyncio.to_thread(
                presented_certificate, self.stats.address, self.tls.pems, self.timeout
            )
        except (OSError, ValueError) as exc:  # ssl.SSLError and timeouts are OSErrors
            return _Verdict(
                revoked,
                channel,
                now + FAILED_RECHECK_S,
                grpc.StatusCode.UNAVAILABLE,
                details=f"no TLS handshake with {self.stats.address} to check its certificate:"
                f" {exc}",
            )
        refusal = self._refusal(der, revoked)
        if refusal is None:
            return _Verdict(revoked, channel, now + RECHECK_S)
        denial, details = refusal
        self.stats.certificate_refusals[denial] = self.stats.certificate_refusals.get(denial, 0) + 1
        if not self.refused:  # the previous verdict: say it once
            log.warning("not replicating with %s: %s", self.stats.name, details)
        return _Verdict(
            revoked,
            channel,
            now + REFUSED_RECHECK_S,
            grpc.StatusCode.PERMISSION_DENIED,
            denial,
            f"{denial}: {details}",
        )

    def _refusal(self, der: bytes, revoked: Revoked) -> tuple[str, str] | None:
        """(denial, why) for a certificate this node must not replicate with; None if fine."""
        where = f"the certificate {self.stats.address} presents"
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as exc:  # ssl verified it, so this is not expected
            return Denial.UNAUTHENTICATED_PEER.value, f"{where} does not parse ({exc})"
        revoked_as = certificate_refusal(cert, revoked)
        if revoked_as is not None:
            return (
                Denial.REVOKED_CERTIFICATE.value,
                f"{where} ({revoked_as}) is revoked ({CRL_FILE}): peer {self.stats.region}"
                f" needs a new one (fencemark certs issue --region {self.stats.region})",
            )
        found = identities_of(cert)
        if found == [self.identity]:
            return None
        if len(found) == 1 and found[0].kind == "region":
            return (
                Denial.REGION_MISMATCH.value,
                f"{where} is the certificate of {found[0]}, not of {self.identity}"
                f" (check --peer {self.stats.region}=...)",
            )
        return (
            Denial.UNAUTHENTICATED_PEER.value,
            f"{where} names {', '.join(map(str, found)) or 'no identity'}, not {self.identity}",
        )


# -- the handshake (in a thread) ---------------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


@functools.lru_cache(maxsize=4)
def _context(pems: tuple[bytes, bytes, bytes]) -> ssl.SSLContext:
    """A client context: trust the CA bundle, present the node's pair, speak h2, TLS 1.3.

    Every node's port speaks TLS 1.3 (docs/security.md, the handshake), so an
    address that offers only TLS 1.2 is no node of ours: no verified handshake.
    """
    ca, cert, key = pems
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=ca.decode())
    # load_cert_chain reads files only: a private directory (0700), gone at once.
    with tempfile.TemporaryDirectory(prefix="fencemark-probe-") as directory:
        pair = Path(directory) / "pair.pem"
        pair.touch(mode=0o600)
        pair.write_bytes(cert + b"\n" + key)
        context.load_cert_chain(pair)
    context.set_alpn_protocols(["h2"])
    return context


def presented_certificate(
    address: str, pems: tuple[bytes, bytes, bytes], timeout: float = PROBE_TIMEOUT_S
) -> bytes:
    """The certificate (DER) ``address`` presents in a TLS handshake that verifies it
    against the CA bundle in ``pems`` (CA bundle, certificate, key; PEM) and the host
    name, presenting the node's own pair. Blocks: call it in a thread.
    OSError (ssl.SSLError included) when no verified handshake completes."""
    host, port = split_address(address)
    context = _context(pems)
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if der is None:
        raise ssl.SSLError(f"{address} presented no certificate")
    return der
