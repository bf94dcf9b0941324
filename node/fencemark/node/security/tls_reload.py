"""A node's TLS material, re-read from ``--tls-dir`` while it runs.

Renewing a node's certificate, rotating the CA bundle and revoking a certificate
take effect without a restart. ``LiveTls.reload`` looks at the files
(``ca.pem``, the node's pair, ``crl.pem``); when one changed it reads and checks
them all, and only a complete, consistent set replaces what is in use:

- the ports (the client port, and the peer listener if there is one): each has
  credentials of its own (``server_credentials``), whose
  ``dynamic_ssl_server_credentials`` asks ``_fetch`` for a new certificate
  configuration before every TLS handshake (on gRPC core's own threads, so
  ``_fetch`` only hands over what ``reload`` prepared, one configuration per port:
  gRPC takes each it is given). Connections already open keep the certificates
  they were made with; the next handshake uses the new ones;
- outgoing peer channels: each peer's ``PeerStats.credentials`` is replaced, and
  the replicator opens a new channel with them (closing the old one once its
  calls finish);
- the revocation list (``fencemark.node.security.revocation``), checked on every call,
  and before replicating with a peer against the certificate the peer presents
  (``fencemark.node.replication.peer_check``, which re-checks when it changes).

The node polls every ``--tls-reload-interval`` seconds (a few ``stat`` calls)
and on SIGHUP. Files caught half-written, a key that does not match its
certificate, a certificate of another region, or a CRL no CA signed are logged
and ignored: the node keeps serving with what it had.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fencemark.node.security.revocation import CRL_FILE, Revocations, Revoked, read_revoked
from fencemark.node.security.tls import Identity, TlsFiles, identities_of

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class _Material:
    channel: grpc.ChannelCredentials
    revoked: Revoked
    pems: tuple[bytes, bytes, bytes]  # the CA bundle, the certificate and its key


class LiveTls:
    """The node's certificate, CA bundle and CRL, replaced when the files change.

    Raises at construction (OSError, ValueError) for files the node cannot start
    with; later reloads never raise.
    """

    def __init__(self, files: TlsFiles, region: str) -> None:
        self.files = files
        self.identity = Identity("region", region)
        self.crl_path = files.ca.parent / CRL_FILE
        self._lock = threading.Lock()
        self._renewed: list[bool] = []  # per port: new material not yet handed over
        self._listeners: list[Callable[[grpc.ChannelCredentials], None]] = []
        self._renewal_listeners: list[Callable[[bytes, bytes, bytes], None]] = []
        self._stamp = self._stamp_now()
        material = self._load()
        self.channel_credentials = material.channel
        # (CA bundle, certificate, key) in use, PEM: replication's peer check
        # (fencemark.node.replication.peer_check) handshakes with them.
        self.pems = material.pems
        self.revocations = Revocations(material.revoked)
        self.reloads = 0  # times new material was taken into use
        self.failures = 0  # times changed files were not usable

    def on_channel_credentials(self, listener: Callable[[grpc.ChannelCredentials], None]) -> None:
        """Call ``listener`` with new client credentials after each reload."""
        self._listeners.append(listener)

    def on_renewed(self, listener: Callable[[bytes, bytes, bytes], None]) -> None:
        """Call ``listener(ca, cert, key)`` (PEM) after each reload: the signer of
        grants follows the node's key (docs/security.md, signed grants)."""
        self._renewal_listeners.append(listener)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for one port, following reloads (``_fetch``): one per port,
        as gRPC takes the configurations it is handed."""
        with self._lock:
            port = len(self._renewed)
            self._renewed.append(False)
            pems = self.pems
        return grpc.dynamic_ssl_server_credentials(
            _configuration(pems),
            functools.partial(self._fetch, port),  # type: ignore[arg-type]  # None: no change
            require_client_authentication=True,
        )

    def _fetch(self, port: int) -> grpc.ServerCertificateConfiguration | None:
        # gRPC core calls this before every handshake, on its own threads.
        with self._lock:
            if not self._renewed[port]:
                return None
            self._renewed[port] = False
            pems = self.pems
        return _configuration(pems)

    def _stamp_now(self) -> Stamp:
        def one(path: os.PathLike[str]) -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return (st.st_mtime_ns, st.st_size, st.st_ino)

        return tuple(one(p) for p in (self.files.ca, self.files.cert, self.files.key,
                                      self.crl_path))  # fmt: skip

    def _load(self) -> _Material:
        ca, cert_pem, key_pem = self.files.read()
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except ValueError as exc:
            raise ValueError(f"{self.files.cert} or its key: not PEM ({exc})") from exc
        found = identities_of(cert)
        if found != [self.identity]:
            raise ValueError(
                f"{self.files.cert} is the certificate of"
                f" {', '.join(map(str, found)) or 'no identity'}, not of"
                f" {self.identity}: peers would refuse this node (fencemark certs issue"
                f" --region {self.identity.name})"
            )
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        pem = serialization.Encoding.PEM
        if key.public_key().public_bytes(pem, spki) != cert.public_key().public_bytes(pem, spki):
            raise ValueError(f"{self.files.key} is not the key of {self.files.cert}")
        revoked = read_revoked(ca, self.crl_path)
        return _Material(
            grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key_pem, certificate_chain=cert_pem
            ),
            revoked,
            (ca, cert_pem, key_pem),
        )

    def reload(self) -> bool:
        """Take the files into use if they changed and are consistent; True if so."""
        stamp = self._stamp_now()
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a bad set is reported once, and retried when it changes
        try:
            material = self._load()
        except (OSError, ValueError) as exc:
            log.error("TLS files changed but are not usable, keeping the current ones: %s", exc)
            self.failures += 1
            return False
        with self._lock:
            self.pems = material.pems
            self._renewed = [True] * len(self._renewed)
        self.channel_credentials = material.channel
        self.revocations.revoked = material.revoked
        for listener in self._listeners:
            listener(material.channel)
        for renewed in self._renewal_listeners:
            renewed(*material.pems)
        self.reloads += 1
        log.warning(
            "TLS files reloaded from %s: new handshakes and peer channels use them;"
            " %d certificates revoked",
            self.files.ca.parent,
            len(material.revoked),
        )
        return True


def _configuration(pems: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
    ca, cert, key = pems
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
