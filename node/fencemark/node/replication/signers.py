"""Learning the certificates that signed grants, from the peer that delivered them.

A grant can reach a node from any peer (gossip is transitive), so a node may
receive a fence grant signed by a key it has never seen. Before merging such
states it asks the peer that delivered them (``Replication.Certificates``): that
peer merged the grant, so it verified it and knows the certificate. Each one is
checked here against the cluster CA (``Keyring.add``) whoever relayed it, kept in
the keyring and persisted (storage meta), so it is known after a restart and can
be relayed on. Asking is throttled per peer and key id; a state whose signer is
still unknown is refused ``unknown_signer`` and the next exchange retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fencemark.node.crdt import Record
from fencemark.node.replica import Replica
from fencemark.node.replication.peers import PeerStats
from fencemark.node.signing import META_PREFIX, Keyring
from fencemark.node.tls import peer_channel
from fencemark.v1 import replication_pb2, replication_pb2_grpc

log = logging.getLogger(__name__)

MAX_KEY_IDS = 64  # per Certificates request
ASK_AGAIN_S = 5.0  # a peer that did not know a key id is asked again after this
TIMEOUT_S = 5.0


async def learn_signers(replica: Replica, peer: PeerStats, records: Sequence[Record]) -> int:
    """Fetch from ``peer`` the certificates of unknown signers in ``records``;
    returns how many were added to the keyring."""
    keyring = replica.keyring
    if keyring is None:
        return 0
    async with keyring.learning:
        return await _learn(replica, keyring, peer, records)


async def _learn(
    replica: Replica, keyring: Keyring, peer: PeerStats, records: Sequence[Record]
) -> int:
    now = time.monotonic()
    asked = keyring.asked
    ask = sorted(
        kid
        for kid in keyring.missing(records)
        if now - asked.get((peer.region, kid), -ASK_AGAIN_S) >= ASK_AGAIN_S
    )[:MAX_KEY_IDS]
    if not ask:
        return 0
    if len(asked) > 10_000:
        asked.clear()
    for kid in ask:
        asked[(peer.region, kid)] = now
    origin = replication_pb2.Origin(
        region=replica.region, node_id=replica.node_id, hlc=replica.clock.now()
    )
    try:
        async with peer_channel(peer.address, peer.credentials) as channel:
            stub = replication_pb2_grpc.ReplicationStub(channel)
            response = await stub.Certificates(
                replication_pb2.CertificatesRequest(origin=origin, key_ids=ask), timeout=TIMEOUT_S
            )
    except grpc.aio.AioRpcError as exc:
        log.info("could not fetch signer certificates from %s: %s", peer.region, exc.code().name)
        return 0
    return await _keep(replica, keyring, peer.region, list(response.certificates[:MAX_KEY_IDS]))


async def _keep(replica: Replica, keyring: Keyring, region: str, certificates: list[bytes]) -> int:
    added = 0
    for der in certificates:
        try:
            kid = keyring.add(der)
        except ValueError as exc:
            log.warning("refused a signer certificate relayed by %s: %s", region, exc)
            continue
        added += 1
        await persist(replica, kid, der)
    return added


async def persist(replica: Replica, kid: bytes, der: bytes) -> None:
    name = META_PREFIX + kid.hex()
    if name not in replica.storage.meta:
        pem = x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
        await replica.storage.put_meta(name, pem.decode())


async def load_keyring(replica: Replica, keyring: Keyring) -> None:
    """Give ``replica`` ``keyring`` plus every signer it kept; persist the ones it lacks."""
    for name, pem in replica.storage.meta.items():
        if not name.startswith(META_PREFIX):
            continue
        try:
            der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(
                serialization.Encoding.DER
            )
            keyring.add(der)
        except ValueError as exc:  # e.g. the cluster moved to a new CA
            log.warning("a kept signer certificate %s is no longer trusted: %s", name, exc)
    for kid, der in keyring.known():
        await persist(replica, kid, der)
    replica.keyring = keyring
