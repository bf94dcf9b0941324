"""The hostile peer: forged states pushed to a node during a run (issue 14).

A ``forge`` fault holds the node certificate of one region (a configured peer's
node gone bad, or its stolen key) and pushes, speaking for that region, to another
region's node, forgeries of records that node is the home of — the shapes an
attacker with a peer's access tried: a grant far above the fence, a grant by a
region that did not create the record, a lease pushed hours out, a release or a
lapse of a token nobody granted, a write at an epoch above the fence, and a state
over the limits of a client write. Each is pushed on its own, so each answer says
whether that one was merged. The invariant: none is, while the workload's claims
and writes go on around them — and every other invariant still holds.

These are what the integrity bounds refuse; forged births, and grants naming the
home within the token bound, are what signatures refuse (docs/security.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from fencemark.client import AsyncClient, FencemarkError
from fencemark.node.admission import token_ceiling
from fencemark.node.crdt import Grant, Record, Stamp, codec
from fencemark.node.crdt.hlc import wall_clock_ms
from fencemark.node.integrity import DEFAULT_MAX_TOKEN_JUMP
from fencemark.node.tls import TlsFiles
from fencemark.node.workload import REPO, TOPIC
from fencemark.v1 import replication_pb2, replication_pb2_grpc

PER_FAULT = 3  # records forged against per fault
HOUR_MS = 3_600_000


def forgeries(record: Record, posing: str) -> dict[str, Record]:
    """What a hostile ``posing`` region pushes for ``record`` (named by the rule
    that must refuse it)."""
    now = wall_clock_ms()
    hlc = (now << 16) + 1
    fence = record.fence
    home = record.home_region
    beyond = max(fence.fence, token_ceiling(hlc)) + 2 * DEFAULT_MAX_TOKEN_JUMP
    jump = fence.grant(beyond, Grant(hlc, "forger", home), now + 60_000)
    outside = fence.grant(fence.fence + 1, Grant(hlc, "forger", posing), now + 60_000)
    forged = {
        "token_jump": record.with_fence(jump),
        "grant_outside_home": record.with_fence(outside),
        "orphan_token": record.with_fence(
            dataclasses.replace(fence, released=fence.released | {fence.fence + 7})
        ),
        "epoch_beyond_fence": record.set_fields(
            {"body": "forged"}, Stamp(fence.fence + 100, hlc, "forger")
        ),
        "over_limit": record.set_fields(
            {f"forged-{i}": "x" for i in range(300)}, Stamp(fence.fence, hlc, "forger")
        ),
    }
    if fence.holder() is not None:
        longer = dataclasses.replace(
            fence, lease_expiry={**fence.lease_expiry, fence.fence: now + 2 * HOUR_MS}
        )
        forged["lease_too_long"] = record.with_fence(longer)
    return forged


async def forge_against(
    address: str,
    victim: str,
    posing: str,
    files: TlsFiles,
    credentials: grpc.ChannelCredentials,
    log: Callable[[str], None],
) -> tuple[tuple[str, str, int], ...]:
    """Push forgeries of up to ``PER_FAULT`` claimed records homed at ``victim`` to its
    node at ``address``, as ``posing``'s node with its certificate ``files`` (a client's
    ``credentials`` list the records): ``(rule, key, merged)`` per push."""
    async with AsyncClient(address, timeout=3.0, retries=0, credentials=credentials) as client:
        keys = []
        try:
            async for listed in client.iter_records(REPO, topic=TOPIC):
                if listed.home_region == victim:
                    keys.append(listed.key)
                if len(keys) >= 4 * PER_FAULT:
                    break
        except FencemarkError as exc:
            log(f"forger: listing at {victim} failed: {exc}")
            return ()
    pushed: list[tuple[str, str, int]] = []
    origin = replication_pb2.Origin(region=posing, node_id="forger", hlc=0)
    async with grpc.aio.secure_channel(address, files.channel_credentials()) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        fetched = await stub.Fetch(
            replication_pb2.FetchRequest(origin=origin, keys=keys), timeout=3.0
        )
        records = [codec.decode(state) for state in fetched.states]
        claimed = [r for r in records if r.fence.fence and r.home_region == victim]
        for record in (claimed or records)[:PER_FAULT]:
            for rule, state in forgeries(record, posing).items():
                request = replication_pb2.PushRequest(origin=origin, states=[codec.encode(state)])
                try:
                    answer = await stub.Push(request, timeout=3.0)
                except grpc.aio.AioRpcError as exc:
                    log(f"forger: push of {rule} for {record.key}: {exc.code().name}")
                    continue
                pushed.append((rule, record.key, answer.merged))
    return tuple(pushed)
