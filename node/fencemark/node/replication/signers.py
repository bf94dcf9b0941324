"""Learning the certificates that signed grants, from the peer that delivered them.

A grant can reach a node from any peer (gossip is transitive), so a node may
receive a fence grant signed by a key it has never seen. Before merging such
states it asks the peer that delivered them (``Replication.Certificates``): that
peer merged the grant, so it verified it and knows the certificate. A region of
several members is asked at each of its addresses in turn, until every key id is
known: the member that delivered the states may not be the one asked first. Each one is
checked here against the cluster CA (``Keyring.add``) whoever relayed it, kept in
the keyring and persisted (storage meta), so it is known after a restart and can
be relayed on.

Learning never holds up a merge that does not need it: there is one fetch in
flight per (peer, key id), which every merge of states from that peer needing
that key id awaits, and nothing else does — a merge whose signers are all known
awaits nothing, whatever is being learned meanwhile. A fetch has a deadline
(``TIMEOUT_S``); a state whose signer is still unknown after it is refused
``unknown_signer``, and a later exchange retries. Asking is throttled per peer
and key id (``ASK_AGAIN_S`` after the last fetch ended), so a peer that does
not answer, or answers slowly, is not asked in a loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fencemark.node.core.replica import Replica
from fencemark.node.crdt import Record
from fencemark.node.replication.peers import PeerStats, origin
from fencemark.node.security.signing import META_PREFIX, Keyring
from fencemark.node.security.tls import peer_channel
from fencemark.node.store.storage import Storage
from fencemark.v1 import replication_pb2, replication_pb2_grpc

log = logging.getLogger(__name__)

MAX_KEY_IDS = 64  # per Certificates request
ASK_AGAIN_S = 5.0  # a peer is asked for a key id again this long after the last fetch ended
TIMEOUT_S = 5.0  # the deadline of one fetch (the Certificates call)
MAX_ASKED = 10_000  # (peer, key id) pairs remembered for the throttle


async def learn_signers(replica: Replica, peer: PeerStats, records: Sequence[Record]) -> int:
    """Fetch from ``peer`` the certificates of unknown signers in ``records``, or
    await the fetch of them already in flight; returns how many of them are known
    afterwards. Returns at once when every signer is known."""
    keyring = replica.keyring
    if keyring is None:
        return 0
    missing = keyring.missing(records)
    if not missing:
        return 0
    now = time.monotonic()
    waits: set[asyncio.Task[None]] = set()
    ask: list[bytes] = []
    for kid in sorted(missing):
        fetch = keyring.fetches.get((peer.region, kid))
        if fetch is not None:
            waits.add(fetch)
        elif (
            now - keyring.asked.get((peer.region, kid), -ASK_AGAIN_S) >= ASK_AGAIN_S
            and len(ask) < MAX_KEY_IDS
        ):
            ask.append(kid)
    if ask:
        waits.add(_start_fetch(replica, keyring, peer, ask))
    if waits:
        # Each fetch ends by its deadline. asyncio.wait cancels nothing: should this
        # merge's caller give up, a fetch that others await runs on.
        await asyncio.wait(waits)
    return sum(kid in keyring for kid in missing)


def _start_fetch(
    replica: Replica, keyring: Keyring, peer: PeerStats, ask: list[bytes]
) -> asyncio.Task[None]:
    """One Certificates call for ``ask``, registered as in flight for each key id."""
    asked = keyring.asked
    if len(asked) > MAX_ASKED:
        asked.clear()
    now = time.monotonic()
    for kid in ask:
        asked[(peer.region, kid)] = now
    fetch = asyncio.get_running_loop().create_task(_fetch(replica, keyring, peer, ask))
    for kid in ask:
        keyring.fetches[(peer.region, kid)] = fetch

    def done(task: asyncio.Task[None]) -> None:
        ended = time.monotonic()
        for kid in ask:
            asked[(peer.region, kid)] = ended  # throttled from when it ended
            if keyring.fetches.get((peer.region, kid)) is task:
                del keyring.fetches[(peer.region, kid)]

    fetch.add_done_callback(done)
    return fetch


async def _fetch(replica: Replica, keyring: Keyring, peer: PeerStats, ask: list[bytes]) -> None:
    """Ask the peer for the certificates of ``ask``: at the address it is reached at,
    then at its other addresses (the other members of its region) for those still
    unknown. The member that delivered the states knows their signers, but may not be
    the one this node reaches the region at, which may not have merged them yet."""
    at = peer.addresses.index(peer.address) if peer.address in peer.addresses else 0
    addresses = [*peer.addresses[at:], *peer.addresses[:at]]
    try:
        # Each call's deadline tells the peer; the outer one bounds them all, with
        # connecting, closing the channels, and keeping what they answered.
        async with asyncio.timeout(TIMEOUT_S):
            for address in addresses:
                wanted = [kid for kid in ask if kid not in keyring]
                if not wanted:
                    return
                try:
                    async with peer_channel(address, peer.credentials) as channel:
                        stub = replication_pb2_grpc.ReplicationStub(channel)
                        request = replication_pb2.CertificatesRequest(
                            origin=origin(replica), key_ids=wanted
                        )
                        response = await stub.Certificates(request, timeout=TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    log.info("could not fetch signer certificates from %s at %s: %s",
                             peer.region, address, exc.code().name)  # fmt: skip
                    continue
                known = list(response.certificates[:MAX_KEY_IDS])
                await _keep(replica, keyring, peer.region, known)
    except TimeoutError:
        log.info("could not fetch signer certificates from %s: no answer in time", peer.region)
    except Exception:  # a local fault (storage): the states wait for a later exchange
        log.exception("keeping signer certificates from %s failed", peer.region)


async def _keep(replica: Replica, keyring: Keyring, region: str, certificates: list[bytes]) -> int:
    # All into the keyring first (no await between them), then persisted: merges
    # use the keyring, and persisting only lets a restart skip asking again.
    added: list[tuple[bytes, bytes]] = []
    for der in certificates:
        try:
            added.append((keyring.add(der), der))
        except ValueError as exc:
            log.warning("refused a signer certificate relayed by %s: %s", region, exc)
    for kid, der in added:
        await replica.keep_signer(kid, der)
    return len(added)


def load_keyring(storage: Storage, keyring: Keyring) -> None:
    """Add to ``keyring`` every signer ``storage`` kept (``Replica.keep_signer``
    writes them)."""
    for name, pem in storage.meta.items():
        if not name.startswith(META_PREFIX):
            continue
        try:
            der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(
                serialization.Encoding.DER
            )
            keyring.add(der)
        except ValueError as exc:  # e.g. the cluster moved to a new CA
            log.warning("a kept signer certificate %s is no longer trusted: %s", name, exc)
