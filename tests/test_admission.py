"""SPEC §4 admission rules, one test per rule, over gRPC against a real node.

Every refusal must be FAILED_PRECONDITION with a ``google.rpc.ErrorInfo``
(reason CLAIM_CONFLICT, domain fencemark, metadata conflict/fence/home_region,
SPEC §7) and must change nothing: the record's digest is the proof.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from datetime import datetime
from pathlib import Path
from typing import cast

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from hypothesis import example, given
from hypothesis import strategies as st

from fencemark.client import AsyncClient, ClaimConflict, NotFound, WrongRegion
from fencemark.client.errors import from_rpc_error
from fencemark.client.types import Record as ClientRecord
from fencemark.node.api.server import NodeServer
from fencemark.node.crdt import FenceState, Grant, Record, Stamp
from fencemark.node.crdt.fence import HISTORY
from fencemark.node.crdt.hlc import pack
from fencemark.node.rules.admission import (
    ANYONE,
    RECOVERY_GAP,
    TOKENS_PER_MS_BITS,
    Caller,
    Outcome,
    acts_for,
    admit_write,
    decide_claim,
    decide_fenced_release,
    decide_release,
    decide_renew,
    lapse_due,
    next_token,
    split_tokens,
    token_ceiling,
    token_problem,
)
from fencemark.node.rules.errors import ACT_FOR_OTHERS, Denial, PermissionDenied, Reason
from fencemark.node.rules.errors import ClaimConflict as NodeClaimConflict
from fencemark.node.rules.integrity import DEFAULT_MAX_TOKEN_JUMP
from fencemark.v1 import records_pb2, records_pb2_grpc
from tests.conftest import StartNode

REPO, TOPIC = "adm", "backlog"
LONG_LEASE = 60.0


def key_of(id_: str) -> str:
    return f"repo/{REPO}/mem/{TOPIC}/{id_}"


async def make(client: AsyncClient, id_: str) -> str:
    result = await client.remember(REPO, TOPIC, id_, title="t", body="initial", tags=["work"])
    assert result.created
    return result.record.key


async def claim(client: AsyncClient, key: str, owner: str, lease: float = LONG_LEASE) -> int:
    result = await client.claim(key, owner, lease_seconds=lease)
    assert result.granted, result
    return result.fencing_token


async def sleep_past(client: AsyncClient, moment: datetime | None) -> None:
    """Sleep until the node's own clock is past ``moment``."""
    assert moment is not None
    now = (await client.info()).now
    assert now is not None
    await asyncio.sleep(max((moment - now).total_seconds(), 0.0) + 0.15)


async def epoch_of(node: NodeServer, key: str, field: str) -> int:
    stored = await node.storage.get(key)
    assert stored is not None
    return stored.record.fields[field].stamp.epoch


async def assert_refused(
    client: AsyncClient,
    key: str,
    write: Awaitable[object],
    *,
    conflict: str,
    fence: int,
    home_region: str = "local",
) -> None:
    """``write`` is refused with ``conflict`` and leaves the record exactly as it was."""
    before = await client.list(REPO, topic=TOPIC, include_deleted=True)
    with pytest.raises(ClaimConflict) as refused:
        await write
    error = refused.value
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (error.reason, error.fence, error.home_region) == (conflict, fence, home_region)
    after = await client.list(REPO, topic=TOPIC, include_deleted=True)
    assert [(r.key, r.digest) for r in after.records] == [
        (r.key, r.digest) for r in before.records
    ], f"the refused write to {key} changed something"


# -- unfenced writes --------------------------------------------------------------------


async def test_unfenced_write_is_refused_claimed_while_a_claim_is_live(
    client: AsyncClient,
) -> None:
    """SPEC §4: an unfenced write is refused ``claimed`` while the node sees a live claim."""
    key = await make(client, "live")
    token = await claim(client, key, "worker-a")
    await assert_refused(
        client, key, client.update(key, fields={"body": "x"}), conflict="claimed", fence=token
    )


async def test_unfenced_write_is_admitted_when_never_claimed(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4: with no live claim an unfenced write is admitted under the current fence (0)."""
    key = await make(client, "free")
    record = await client.update(key, fields={"body": "free"})
    assert record.body == "free"
    assert await epoch_of(node, key, "body") == 0


async def test_unfenced_write_is_admitted_after_the_lease_lapses(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4: a lapsed claim is not live; the write is stamped with the fence as epoch."""
    key = await make(client, "lapsed")
    granted = await client.claim(key, "worker-a", lease_seconds=1)
    assert granted.granted
    await sleep_past(client, granted.lease_expires_at)
    record = await client.update(key, fields={"body": "after lapse"})
    assert record.body == "after lapse"
    assert await epoch_of(node, key, "body") == granted.fencing_token


async def test_unfenced_write_is_admitted_after_release(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4 and §1 step 6: a released claim readmits unfenced writes."""
    key = await make(client, "released")
    token = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, token)).released
    record = await client.update(key, fields={"body": "after release"})
    assert record.body == "after release"
    assert await epoch_of(node, key, "body") == token


# -- fenced writes ----------------------------------------------------------------------


async def test_fenced_write_with_the_live_token_is_admitted_and_stamped_with_it(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §4: an admitted fenced write is stamped with epoch T."""
    key = await make(client, "stamped")
    first = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, first)).released
    token = await claim(client, key, "worker-b")
    assert token > first
    record = await client.update(key, fields={"body": "fenced"}, fencing_token=token)
    assert record.body == "fenced"
    assert await epoch_of(node, key, "body") == token


async def test_fenced_write_with_an_older_token_is_refused_superseded(
    client: AsyncClient,
) -> None:
    """SPEC §4: refused ``superseded`` if T < fence."""
    key = await make(client, "superseded")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    new = await claim(client, key, "worker-b")
    await assert_refused(
        client,
        key,
        client.update(key, fields={"body": "late"}, fencing_token=old),
        conflict="superseded",
        fence=new,
    )


async def test_fenced_write_with_a_token_above_the_fence_is_refused_unknown_token(
    client: AsyncClient,
) -> None:
    """SPEC §4: refused ``unknown_token`` if T > fence (also when never claimed)."""
    key = await make(client, "unknown")
    await assert_refused(
        client,
        key,
        client.update(key, fields={"body": "x"}, fencing_token=1),
        conflict="unknown_token",
        fence=0,
    )
    token = await claim(client, key, "worker-a")
    await assert_refused(
        client,
        key,
        client.update(key, fields={"body": "x"}, fencing_token=token + 1),
        conflict="unknown_token",
        fence=token,
    )


async def test_fenced_write_with_a_released_token_is_refused_released(
    client: AsyncClient,
) -> None:
    """SPEC §4: refused ``released`` if T is released."""
    key = await make(client, "rel")
    token = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, token)).released
    await assert_refused(
        client,
        key,
        client.update(key, fields={"body": "x"}, fencing_token=token),
        conflict="released",
        fence=token,
    )


async def test_fenced_write_after_the_lease_lapsed_is_refused_expired(
    client: AsyncClient,
) -> None:
    """SPEC §4: refused ``expired`` if the lease has lapsed."""
    key = await make(client, "expired")
    granted = await client.claim(key, "worker-a", lease_seconds=1)
    assert granted.granted
    await sleep_past(client, granted.lease_expires_at)
    await assert_refused(
        client,
        key,
        client.update(key, fields={"body": "x"}, fencing_token=granted.fencing_token),
        conflict="expired",
        fence=granted.fencing_token,
    )


def test_fenced_write_away_from_home_is_refused_wrong_region_by_the_rule() -> None:
    """SPEC §4: a fenced write is refused ``wrong_region`` unless this node is the home.

    The rule in isolation (a pure function): the same live token is admitted at
    home and refused elsewhere, with the home named.
    """
    now = 1_000_000
    record = Record("repo/a/mem/b/c").create("us", Stamp(0, 1, "n1"))
    fence = FenceState().grant(1, Grant(2, "worker-a", "us"), now + 60_000)
    record = record.with_fence(fence)
    assert admit_write(record, 1, caller=ANYONE, home="us", region="us", now_ms=now) == 1
    with pytest.raises(NodeClaimConflict) as refused:
        admit_write(record, 1, caller=ANYONE, home="us", region="eu", now_ms=now)
    assert refused.value.conflict is Reason.WRONG_REGION
    assert (refused.value.fence, refused.value.home_region) == (1, "us")
    # It says why in words for a fenced write, not for a new record's birth.
    assert str(refused.value) == (
        "fenced writes are decided by the record's home region 'us': send the call there"
    )
    # Unfenced writes away from home: refused while the grant is unreleased, even
    # past its expiry — only the home decides a lapse (issue 13, hole 3a) ...
    for at in (now, now + 60_000, now + 3_600_000):
        with pytest.raises(NodeClaimConflict) as claimed:
            admit_write(record, 0, caller=ANYONE, home="us", region="eu", now_ms=at)
        assert claimed.value.conflict is Reason.CLAIMED
        assert claimed.value.home_region == "us"
    # ... which the home admits once the lease ran out, and everyone once it
    # recorded the lapse (or the holder released).
    assert admit_write(record, 0, caller=ANYONE, home="us", region="us", now_ms=now + 60_000) == 1
    lapsed = record.with_fence(record.fence.lapse(1))
    assert admit_write(lapsed, 0, caller=ANYONE, home="us", region="eu", now_ms=now) == 1
    released = record.with_fence(record.fence.release(1))
    assert admit_write(released, 0, caller=ANYONE, home="us", region="eu", now_ms=now) == 1


async def test_fenced_write_at_a_replica_outside_the_home_region_is_refused_wrong_region(
    start_node: StartNode, tmp_path: Path
) -> None:
    """SPEC §4 over gRPC: a node of region ``eu`` holding a record homed in ``us``.

    The ``eu`` node is started on the data the ``us`` node wrote (what a replica
    would hold after replication): fenced writes, claims, renewals and releases
    there answer ``wrong_region`` naming ``us``; unfenced writes see the live claim.
    """
    data = tmp_path / "shared"
    home = await start_node("us", data_dir=data)
    async with AsyncClient(home.address) as client:
        key = (await client.remember(REPO, TOPIC, "abroad", body="initial")).record.key
        token = await claim(client, key, "worker-a")
    await home.stop()

    away = await start_node("eu", data_dir=data)
    async with AsyncClient(away.address) as client:
        await assert_refused(
            client,
            key,
            client.update(key, fields={"body": "x"}, fencing_token=token),
            conflict="wrong_region",
            fence=token,
            home_region="us",
        )
        await assert_refused(
            client,
            key,
            client.update(key, fields={"body": "x"}),
            conflict="claimed",
            fence=token,
            home_region="us",
        )
        claimed = await client.claim(key, "worker-b")
        assert (claimed.granted, claimed.reason, claimed.home_region) == (
            False,
            "wrong_region",
            "us",
        )
        renewed = await client.renew_claim(key, token)
        assert (renewed.renewed, renewed.reason, renewed.home_region) == (
            False,
            "wrong_region",
            "us",
        )
        released = await client.release_claim(key, token)
        assert (released.released, released.reason, released.home_region) == (
            False,
            "wrong_region",
            "us",
        )
        status = await client.claim_status(key)
        assert status.claim is not None and status.claim.fencing_token == token
        assert status.home_region == "us"


async def test_remember_of_a_new_record_homed_elsewhere_is_refused_wrong_region(
    client: AsyncClient,
) -> None:
    """SPEC §2: a record is born in its home region; the refusal names the home."""
    count = (await client.info()).record_count
    with pytest.raises(WrongRegion) as refused:
        await client.remember(REPO, TOPIC, "born-abroad", body="x", tags=["homeRegion:elsewhere"])
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.home_region == "elsewhere"
    with pytest.raises(NotFound):
        await client.get(key_of("born-abroad"))
    assert (await client.info()).record_count == count


# -- the wire form of a refusal -----------------------------------------------------------


async def test_a_refusal_is_failed_precondition_with_claim_conflict_error_info_on_the_wire(
    client: AsyncClient, node: NodeServer
) -> None:
    """SPEC §7: FAILED_PRECONDITION + google.rpc.ErrorInfo(CLAIM_CONFLICT, fencemark, metadata).

    Checked with a raw stub, so that nothing in the client library is trusted.
    """
    key = await make(client, "wire")
    token = await claim(client, key, "worker-a")
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = records_pb2_grpc.RecordsStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Update(records_pb2.UpdateRequest(key=key, fields={"body": "x"}), timeout=10)
    info = failed_precondition_info(refused.value)
    assert info.reason == "CLAIM_CONFLICT"
    assert info.domain == "fencemark"
    assert dict(info.metadata) == {
        "conflict": "claimed",
        "fence": str(token),
        "home_region": "local",
    }


async def test_wrong_region_has_one_wire_shape_for_a_birth_and_a_fenced_write(
    client: AsyncClient, node: NodeServer
) -> None:
    """One refusal word, one shape: a new record sent away from home and a fenced
    write away from home are both CLAIM_CONFLICT with conflict ``wrong_region``.

    The fenced write needs a record homed elsewhere that this node holds: its state
    is merged in as a peer's would be.
    """
    key = key_of("wire-abroad")
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = records_pb2_grpc.RecordsStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as born:
            await stub.Remember(
                records_pb2.RememberRequest(
                    repo=REPO, topic=TOPIC, id="wire-abroad", tags=["homeRegion:elsewhere"]
                ),
                timeout=10,
            )
        birth = failed_precondition_info(born.value)
        assert (birth.reason, dict(birth.metadata)) == (
            "CLAIM_CONFLICT",
            {"conflict": "wrong_region", "fence": "0", "home_region": "elsewhere"},
        )
        abroad = Record(key).create("elsewhere", Stamp(0, node.replica.now_hlc(), "elsewhere-n"))
        assert await node.replica.merge(abroad)
        with pytest.raises(grpc.aio.AioRpcError) as fenced:
            await stub.Update(
                records_pb2.UpdateRequest(key=key, fields={"body": "x"}, fencing_token=1),
                timeout=10,
            )
        write = failed_precondition_info(fenced.value)
        assert (write.reason, dict(write.metadata)) == (
            "CLAIM_CONFLICT",
            {"conflict": "wrong_region", "fence": "0", "home_region": "elsewhere"},
        )
    with pytest.raises(ClaimConflict) as caught:
        await client.remember(REPO, TOPIC, "wire-abroad-2", tags=["homeRegion:elsewhere"])
    assert isinstance(caught.value, WrongRegion)
    assert (caught.value.reason, caught.value.fence) == ("wrong_region", 0)


def test_the_client_still_reads_the_wrong_region_shape_of_older_nodes() -> None:
    """Older nodes refused a new record away from home with ErrorInfo WRONG_REGION:
    a client talking to one still raises ``WrongRegion`` (a ``ClaimConflict``)."""
    info = error_details_pb2.ErrorInfo(
        reason="WRONG_REGION", domain="fencemark", metadata={"home_region": "eu"}
    )
    status = status_pb2.Status(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="m")
    status.details.add().Pack(info)
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    old = grpc.aio.AioRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), trailers, "m", None
    )
    decoded = from_rpc_error(old)
    assert isinstance(decoded, WrongRegion)
    assert (decoded.reason, decoded.home_region, decoded.fence) == ("wrong_region", "eu", 0)


def failed_precondition_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The one ErrorInfo a FAILED_PRECONDITION refusal carries in its rich status."""
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    # At runtime trailing metadata is (key, value) pairs; grpc-stubs types it opaquely.
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    details = [value for name, value in trailers if name == "grpc-status-details-bin"]
    assert len(details) == 1 and isinstance(details[0], bytes)
    status = status_pb2.Status.FromString(details[0])
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    return info


# -- Remember and Delete obey the same admission --------------------------------------------


async def test_remember_obeys_the_fence_like_update(client: AsyncClient, node: NodeServer) -> None:
    """SPEC §4: Remember on a claimed record needs the live token; it is then stamped with it."""
    key = await make(client, "remember")
    token = await claim(client, key, "worker-a")
    await assert_refused(
        client,
        key,
        client.remember(REPO, TOPIC, "remember", body="unfenced"),
        conflict="claimed",
        fence=token,
    )
    await assert_refused(
        client,
        key,
        client.remember(REPO, TOPIC, "remember", body="wrong", fencing_token=token + 1),
        conflict="unknown_token",
        fence=token,
    )
    result = await client.remember(REPO, TOPIC, "remember", body="fenced", fencing_token=token)
    assert (result.created, result.record.body) == (False, "fenced")
    assert await epoch_of(node, key, "body") == token
    assert (await client.release_claim(key, token)).released
    newer = await claim(client, key, "worker-b")
    await assert_refused(
        client,
        key,
        client.remember(REPO, TOPIC, "remember", body="late", fencing_token=token),
        conflict="superseded",
        fence=newer,
    )


async def test_delete_obeys_the_fence_like_update(client: AsyncClient) -> None:
    """SPEC §4: Delete on a claimed record needs the live token."""
    key = await make(client, "delete")
    old = await claim(client, key, "worker-a")
    assert (await client.release_claim(key, old)).released
    token = await claim(client, key, "worker-b")
    await assert_refused(client, key, client.delete(key), conflict="claimed", fence=token)
    await assert_refused(
        client, key, client.delete(key, fencing_token=old), conflict="superseded", fence=token
    )
    tombstone: ClientRecord = await client.delete(key, fencing_token=token)
    assert tombstone.deleted
    assert tombstone.fence == token
    with pytest.raises(NotFound):
        await client.get(key)


# -- the rules as pure functions ------------------------------------------------------------

NOW_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def claimed_at_home(expiry_ms: int) -> Record:
    """A record homed at ``local`` whose token 1 was granted there, leased until ``expiry_ms``."""
    record = Record(key_of("pure")).create("local", Stamp(0, pack(NOW_MS - 1), "n1"))
    grant = Grant(pack(NOW_MS), "worker-a", "local")
    return record.with_fence(FenceState().grant(1, grant, expiry_ms))


@given(st.integers(-3, 3))
@example(0)  # now == expiry: the lease is over
def test_a_token_is_honoured_exactly_while_its_claim_is_live(offset_ms: int) -> None:
    """SPEC §3: a claim is live while ``now < expiry``. Every rule that asks whether the
    lease is over must answer alike, so at ``now == expiry`` the token is refused
    ``expired`` (fenced write, renewal), the home admits unfenced writes, and the home
    records the lapse; a millisecond earlier none of that holds."""
    expiry = NOW_MS + 60_000
    record = claimed_at_home(expiry)
    now = expiry + offset_ms
    live = now < expiry
    assert record.fence.is_live(now) is live
    assert record.claim_live(now) is live
    assert token_problem(record.fence, 1, now) == (None if live else Reason.EXPIRED)
    _, renewal = decide_renew(record, 1, caller=ANYONE, lease_ms=60_000, now_ms=now, region="local")
    assert (renewal.ok, renewal.reason) == (live, None if live else Reason.EXPIRED)
    assert lapse_due(record, "local", now) is not live
    if live:
        assert admit_write(record, 1, home="local", region="local", now_ms=now, caller=ANYONE) == 1
        with pytest.raises(NodeClaimConflict) as claimed:
            admit_write(record, 0, home="local", region="local", now_ms=now, caller=ANYONE)
        assert claimed.value.conflict is Reason.CLAIMED
    else:
        with pytest.raises(NodeClaimConflict) as expired:
            admit_write(record, 1, home="local", region="local", now_ms=now, caller=ANYONE)
        assert expired.value.conflict is Reason.EXPIRED
        assert admit_write(record, 0, home="local", region="local", now_ms=now, caller=ANYONE) == 1


def test_a_free_record_goes_to_the_line_not_to_a_newcomer() -> None:
    """SPEC §4, FIFO: while others wait in line (``queued_ahead``), a free record is
    ``contended`` for a newcomer: no token, the fence unmoved. The head of the line,
    which has nobody ahead, is granted the next token."""
    record = claimed_at_home(NOW_MS)  # the lease of token 1 is over: the record is free

    def claim_now(owner: str, *, queued_ahead: bool) -> tuple[FenceState, Outcome]:
        hlc = pack(NOW_MS, 1)
        return decide_claim(
            record,
            owner,
            caller=ANYONE,
            lease_ms=60_000,
            now_ms=NOW_MS,
            hlc=hlc,
            region="local",
            queued_ahead=queued_ahead,
        )

    fence, newcomer = claim_now("newcomer", queued_ahead=True)
    assert newcomer == Outcome(False, Reason.CONTENDED, home_region="local", fence=1)
    assert fence == record.fence
    fence, head = claim_now("head", queued_ahead=False)
    assert (head.ok, head.token, fence.fence) == (True, 2, 2)


def test_the_recovery_floor_is_the_gap_of_2_to_the_20_and_the_time_ceiling() -> None:
    """A node that lost its disk grants its first token of a record at least
    RECOVERY_GAP above the fence it caught up to, past whatever its earlier life
    granted that never reached a peer, and at least at its recovery millisecond's
    ceiling (2**10 tokens a millisecond), past whatever an even earlier life granted
    (docs/replication.md, catch-up). Every node must agree on both: peers refuse a
    token further than max_token_jump (twice the gap) above both the grant below it
    and its own time's ceiling (integrity)."""
    assert RECOVERY_GAP == 2**20
    assert TOKENS_PER_MS_BITS == 10
    assert DEFAULT_MAX_TOKEN_JUMP == 2 * RECOVERY_GAP
    fence = claimed_at_home(NOW_MS).fence
    before_the_loss, after_it = pack(NOW_MS) - 1, pack(NOW_MS) + 1
    floor = NOW_MS * 2**10
    assert token_ceiling(after_it) == floor
    assert next_token(fence) == 2
    assert next_token(fence, recovered_hlc=after_it) == floor  # holder of its earlier life
    assert next_token(fence, recovered_hlc=before_the_loss) == 2  # granted since the recovery
    assert next_token(FenceState(), recovered_hlc=after_it) == floor
    # The gap still rules when the fence is that high already.
    high = FenceState().grant(floor, Grant(pack(NOW_MS - 5), "w", "local"), NOW_MS + 60_000)
    assert next_token(high, recovered_hlc=after_it) == floor + 1 + 2**20


# -- who may use a token, outcomes as values, the split, the boundaries (issue 15) ---------

ALICE, BOB = Caller("client/alice"), Caller("client/bob")
OPERATOR = Caller("client/ops", acts_for_others=True)


def granted_to(
    identity: str, *, owner: str = "worker-a", expiry_ms: int = NOW_MS + 60_000
) -> Record:
    """``claimed_at_home``, its token 1 granted to ``identity`` ("": none recorded)."""
    record = Record(key_of("pure")).create("local", Stamp(0, pack(NOW_MS - 1), "n1"))
    grant = Grant(pack(NOW_MS), owner, "local", identity=identity)
    return record.with_fence(FenceState().grant(1, grant, expiry_ms))


def test_a_token_binds_the_identity_it_was_granted_to() -> None:
    """docs/security.md, *Claims are bound to identities*: the grant's own identity, or
    one with ``act-for-others`` (every caller of a node without TLS: ``ANYONE``); a
    grant that records no identity binds nobody. A caller is not ``act-for-others``
    unless the access map says so."""
    to_alice = Grant(pack(NOW_MS), "w", "local", identity="client/alice")
    unbound = Grant(pack(NOW_MS), "w", "local")
    assert Caller("client/bob").acts_for_others is False
    assert (ANYONE.identity, ANYONE.acts_for_others) == ("", True)
    assert [acts_for(c, to_alice) for c in (ALICE, BOB, OPERATOR, ANYONE)] == [
        True, False, True, True,
    ]  # fmt: skip
    assert [acts_for(c, unbound) for c in (ALICE, BOB, OPERATOR, ANYONE)] == [True] * 4


@pytest.mark.parametrize("rule", ["renew", "release", "write"])
def test_only_the_holders_identity_renews_releases_or_writes_with_its_token(rule: str) -> None:
    """Another identity is refused ``not_holder`` (PERMISSION_DENIED naming the right it
    lacks), whatever the token's state; the holder's identity and an operator pass."""
    record = granted_to("client/alice")

    def use(caller: Caller) -> object:
        if rule == "renew":
            return decide_renew(
                record, 1, caller=caller, lease_ms=60_000, now_ms=NOW_MS, region="local"
            )[1].ok
        if rule == "release":
            return decide_release(record, 1, caller=caller, region="local")[1].ok
        return admit_write(record, 1, caller=caller, home="local", region="local", now_ms=NOW_MS)

    with pytest.raises(PermissionDenied) as refused:
        use(BOB)
    assert (refused.value.denial, refused.value.identity, refused.value.right) == (
        Denial.NOT_HOLDER,
        "client/bob",
        ACT_FOR_OTHERS,
    )
    assert use(ALICE) in (True, 1)
    assert use(OPERATOR) in (True, 1)


def test_a_token_the_record_no_longer_remembers_is_not_checked_for_its_identity() -> None:
    """Only grants kept in the record (its last ``HISTORY``) name an identity; an older
    token is ``superseded`` for everyone, and its release changes nothing."""
    record = granted_to("client/alice")
    fence = record.fence.release(1)
    for token in range(2, 2 + HISTORY + 1):
        grant = Grant(pack(NOW_MS), "w", "local", identity="client/alice")
        fence = fence.grant(token, grant, NOW_MS + 60_000).release(token)
    record = record.with_fence(fence)
    assert 1 not in record.fence.grants
    _, released = decide_release(record, 1, caller=BOB, region="local")
    assert (released.ok, released.fence) == (True, 1 + HISTORY + 1)
    _, renewed = decide_renew(record, 1, caller=BOB, lease_ms=1_000, now_ms=NOW_MS, region="local")
    assert renewed.reason is Reason.SUPERSEDED


def test_a_claim_by_the_holders_owner_name_is_a_retry_only_from_its_identity() -> None:
    """SPEC §4: a retry by the live claim's owner gets its token again (its lease
    extended); the same owner name from another identity is another claimer."""
    record = granted_to("client/alice", expiry_ms=NOW_MS + 10_000)

    def claim(owner: str, caller: Caller) -> tuple[FenceState, Outcome]:
        return decide_claim(record, owner, caller=caller, lease_ms=60_000, now_ms=NOW_MS,
                            hlc=pack(NOW_MS, 1), region="local", queued_ahead=False)  # fmt: skip

    fence, retry = claim("worker-a", ALICE)
    assert retry == Outcome(True, None, 1, NOW_MS + 60_000, "local", 1)
    assert fence.expiry(1) == NOW_MS + 60_000
    for owner, caller in (("worker-a", BOB), ("worker-b", ALICE)):
        fence, other = claim(owner, caller)
        assert other == Outcome(False, Reason.CONTENDED, home_region="local", fence=1)
        assert fence == record.fence


def test_a_refusal_outcome_carries_no_token_and_no_expiry() -> None:
    """claims.proto: a refused claim answers token 0 and no expiry; only ``home_region``
    and ``fence`` say where to go and what was seen."""
    refused = Outcome(False, Reason.MISSING)
    assert (refused.token, refused.expiry_ms, refused.home_region, refused.fence) == (0, 0, "", 0)
    _, missing = decide_claim(Record(key_of("none")), "w", caller=ANYONE, lease_ms=1_000,
                              now_ms=NOW_MS, hlc=pack(NOW_MS), region="local",
                              queued_ahead=False)  # fmt: skip
    assert missing == Outcome(False, Reason.MISSING)


def test_a_deleted_record_answers_missing_except_to_its_holders_release() -> None:
    """A tombstone keeps its grants: its holder may still release (only release); a claim
    or a renewal answers ``missing``."""
    record = granted_to("")
    stamp = Stamp(1, pack(NOW_MS, 2), "n1")
    tombstone = record.set_deleted(True, stamp)
    assert tombstone.is_deleted
    _, claim = decide_claim(tombstone, "w", caller=ANYONE, lease_ms=1_000, now_ms=NOW_MS,
                            hlc=pack(NOW_MS, 3), region="local", queued_ahead=False)  # fmt: skip
    assert (claim.ok, claim.reason) == (False, Reason.MISSING)
    _, renewal = decide_renew(tombstone, 1, caller=ANYONE, lease_ms=1_000, now_ms=NOW_MS,
                              region="local")  # fmt: skip
    assert (renewal.ok, renewal.reason) == (False, Reason.MISSING)
    fence, release = decide_release(tombstone, 1, caller=ANYONE, region="local")
    assert release == Outcome(True, None, 1, home_region="local", fence=1)
    assert 1 in fence.released


def test_a_renewal_extends_the_lease_to_now_plus_its_length() -> None:
    record = granted_to("", expiry_ms=NOW_MS + 1_000)
    fence, renewed = decide_renew(record, 1, caller=ANYONE, lease_ms=30_000, now_ms=NOW_MS + 500,
                                  region="local")  # fmt: skip
    assert renewed == Outcome(True, None, 1, NOW_MS + 30_500, "local", 1)
    assert fence.expiry(1) == NOW_MS + 30_500


def test_a_token_the_fence_was_moved_to_was_never_granted() -> None:
    """A move raises the fence without a grant (SPEC §2): that token is nobody's,
    ``unknown_token``, like one above the fence."""
    fence = granted_to("").fence.move(5)
    assert fence.fence == 5
    assert token_problem(fence, 5, NOW_MS) is Reason.UNKNOWN_TOKEN
    assert token_problem(fence, 6, NOW_MS) is Reason.UNKNOWN_TOKEN
    assert token_problem(fence, 1, NOW_MS) is Reason.SUPERSEDED


def born_in_two(*grants: tuple[int, str], moved: int = 0) -> Record:
    """A record born in us and, apart, in eu (us's birth earlier: the home), with
    ``grants`` (token, granting region) and the fence moved to ``moved``."""
    us = Record(key_of("split")).create("us", Stamp(0, pack(NOW_MS - 10), "us-n"))
    eu = Record(key_of("split")).create("eu", Stamp(0, pack(NOW_MS - 5), "eu-n"))
    record = us.merge(eu)
    assert (set(record.births), record.home_region) == ({"us", "eu"}, "us")
    fence = record.fence
    for token, region in grants:
        fence = fence.grant(token, Grant(pack(NOW_MS), "w", region), NOW_MS + 60_000)
    if moved:
        fence = fence.move(moved)
    return record.with_fence(fence)


def test_split_time_claims_are_those_the_fence_has_not_moved_past() -> None:
    """SPEC §2: with one birth there is no split; when two births first meet (never
    moved) every grant may be from the split; after the home's move, only a grant by
    another birth region at or above the move still is."""
    single = Record(key_of("one")).create("us", Stamp(0, pack(NOW_MS), "us-n"))
    assert not split_tokens(single.with_fence(single.fence.grant(
        1, Grant(pack(NOW_MS), "w", "eu"), NOW_MS)))  # fmt: skip
    assert split_tokens(born_in_two())
    assert split_tokens(born_in_two((1, "us")))
    assert not split_tokens(born_in_two((1, "eu"), moved=2))
    assert not split_tokens(born_in_two((1, "eu"), (3, "us"), moved=2))
    assert split_tokens(born_in_two((1, "us"), (3, "eu"), moved=2))
    # eu granted token 2 apart, and the home moved its fence to 2: the same token.
    moved, apart = born_in_two((1, "us"), moved=2), born_in_two((1, "us"), (2, "eu"))
    met = moved.merge(apart)
    assert (met.fence.moved, met.fence.grants[2].region) == (2, "eu")
    assert split_tokens(met)


def test_a_grant_made_at_the_recovery_moment_is_this_lifes() -> None:
    """``next_token``: a holder granted at or after the recovery's HLC was granted by
    this life, which knows its tokens: the next is ``fence + 1``; only one granted
    before it gets the recovery floor. Without a recovery, never a floor."""
    recovered = pack(NOW_MS)
    at = FenceState().grant(7, Grant(recovered, "w", "local"), NOW_MS + 60_000)
    assert next_token(at, recovered_hlc=recovered) == 8
    before = FenceState().grant(7, Grant(recovered - 1, "w", "local"), NOW_MS + 60_000)
    assert next_token(before, recovered_hlc=recovered) > 7 + RECOVERY_GAP
    assert next_token(before) == 8
    assert next_token(FenceState()) == 1  # a node that never recovered: no floor, ever
    _, first = decide_claim(granted_to("", expiry_ms=NOW_MS), "w", caller=ANYONE,
                            lease_ms=1_000, now_ms=NOW_MS, hlc=pack(NOW_MS, 1), region="local",
                            queued_ahead=False)  # fmt: skip
    assert first.token == 2
    fresh = Record(key_of("fresh")).create("local", Stamp(0, pack(NOW_MS - 1), "n1"))
    _, very_first = decide_claim(fresh, "w", caller=ANYONE, lease_ms=1_000, now_ms=NOW_MS,
                                 hlc=pack(NOW_MS), region="local", queued_ahead=False)  # fmt: skip
    assert very_first.token == 1


# -- a release that writes: the holder's last fenced write (SPEC §8) -------------------------


def fenced_release(
    record: Record, token: int, *, caller: Caller = ANYONE, region: str = "local", now: int = NOW_MS
) -> Outcome | None:
    return decide_fenced_release(record, token, caller=caller, region=region, now_ms=now)


def test_a_release_with_an_outcome_goes_ahead_only_for_the_live_claim() -> None:
    """SPEC §8: a release that records an outcome (or final fields) is refused, as a
    value, for every token that is not the live claim — a superseded worker can never
    mark an item done — by the same words a fenced write gets; the live claim's token
    goes ahead (None). A refusal names the home and the fence it saw."""
    expiry = NOW_MS + 60_000
    record = claimed_at_home(expiry)
    assert fenced_release(record, 1) is None
    assert fenced_release(record, 1, now=expiry - 1) is None

    def refused(reason: Reason, fence: int = 1) -> Outcome:
        return Outcome(False, reason, home_region="local", fence=fence)

    assert fenced_release(record, 1, now=expiry) == refused(Reason.EXPIRED)
    assert fenced_release(record, 2) == refused(Reason.UNKNOWN_TOKEN)
    lapsed = record.with_fence(record.fence.lapse(1))
    assert fenced_release(lapsed, 1) == refused(Reason.EXPIRED)
    released = record.with_fence(record.fence.release(1))
    assert fenced_release(released, 1) == refused(Reason.RELEASED)
    successor = Grant(pack(NOW_MS, 5), "worker-b", "local")
    superseded = record.with_fence(record.fence.grant(2, successor, expiry))
    assert fenced_release(superseded, 1) == refused(Reason.SUPERSEDED, fence=2)
    assert fenced_release(superseded, 2) is None
    moved = record.with_fence(record.fence.move(3))
    assert fenced_release(moved, 3) == refused(Reason.UNKNOWN_TOKEN, fence=3)


def test_a_release_with_an_outcome_is_decided_only_at_a_live_home_record() -> None:
    """Away from the home it answers ``wrong_region``; a record that does not exist, or
    a tombstone (unlike a plain release), ``missing``; a token the record was granted
    by another birth region, live in its fence but not the home's claim, ``superseded``
    (as ``admit_write`` says at the meet); another identity is refused ``not_holder``."""
    record = granted_to("client/alice")
    away = fenced_release(record, 1, region="eu")
    assert away == Outcome(False, Reason.WRONG_REGION, home_region="local", fence=1)
    assert fenced_release(Record(key_of("none")), 1) == Outcome(False, Reason.MISSING)
    tombstone = record.set_deleted(True, Stamp(1, pack(NOW_MS, 2), "n1"))
    assert fenced_release(tombstone, 1, caller=ALICE) == Outcome(
        False, Reason.MISSING, home_region="local", fence=1
    )
    assert fenced_release(record, 1, caller=ALICE) is None
    assert fenced_release(record, 1, caller=OPERATOR) is None
    with pytest.raises(PermissionDenied) as refused:
        fenced_release(record, 1, caller=BOB)
    assert refused.value.denial is Denial.NOT_HOLDER
    split = born_in_two((1, "eu"))
    assert split.fence.is_live(NOW_MS) and not split.claim_live(NOW_MS)
    assert fenced_release(split, 1, region="us") == Outcome(
        False, Reason.SUPERSEDED, home_region="us", fence=1
    )


def test_a_plain_release_of_a_token_above_the_fence_changes_nothing() -> None:
    """SPEC §4: a release is idempotent up to the fence: a token below it answers ok and
    changes nothing, the fence's own token is released; a token above it was never
    granted, ``unknown_token``, and is not checked for its identity (it has none)."""
    record = granted_to("client/alice")
    fence, above = decide_release(record, 2, caller=BOB, region="local")
    assert above == Outcome(False, Reason.UNKNOWN_TOKEN, home_region="local", fence=1)
    assert fence == record.fence
    successor = Grant(pack(NOW_MS, 5), "worker-b", "local")
    record = record.with_fence(record.fence.grant(2, successor, NOW_MS + 60_000))
    fence, below = decide_release(record, 1, caller=ALICE, region="local")
    assert below == Outcome(True, None, 1, home_region="local", fence=2)
    assert fence == record.fence
    fence, current = decide_release(record, 2, caller=ALICE, region="local")
    assert current == Outcome(True, None, 2, home_region="local", fence=2)
    assert fence.released == record.fence.released | {2}


# -- a data file that went back in time: every life of a file is a new era of tokens ---


@given(
    fence_token=st.integers(min_value=0, max_value=2**40),
    since_ms=st.integers(min_value=0, max_value=10_000),
)
@example(fence_token=0, since_ms=0)
@example(fence_token=NOW_MS * 2**10, since_ms=0)  # a fence at the era's floor already
def test_the_first_grant_of_a_life_is_above_every_token_an_earlier_life_can_have_granted(
    fence_token: int, since_ms: int
) -> None:
    """A restarted node's file may have forgotten grants (a reverted snapshot, a
    lost fsync): its first grant on a record whose holder it did not grant in this
    life is at least the time ceiling of the life's start, and above the fence. An
    earlier life granted its tokens before that millisecond, at most 2**10 a
    millisecond above its own floor, so none of them is handed out again
    (docs/replication.md, *A disk that goes back in time*)."""
    life = pack(NOW_MS + since_ms)
    earlier = pack(NOW_MS - 1)
    fence = FenceState()
    if fence_token:
        fence = fence.grant(fence_token, Grant(earlier, "w", "local"), NOW_MS + 60_000)
    token = next_token(fence, life_hlc=life, region="local")
    assert token == max(fence_token + 1, (NOW_MS + since_ms) * 2**10)
    assert token > fence_token


@given(
    fence_token=st.integers(min_value=0, max_value=2**40),
    recovered_ms=st.integers(min_value=0, max_value=60_000),
    era_ms=st.integers(min_value=0, max_value=60_000),
    granted_ms=st.integers(min_value=0, max_value=60_000),
)
@example(fence_token=0, recovered_ms=0, era_ms=35_000, granted_ms=0)  # a member's later term
def test_a_grant_is_above_every_floor_that_applies(
    fence_token: int, recovered_ms: int, era_ms: int, granted_ms: int
) -> None:
    """A node that recovered (a lost disk) early in its life and, as a member, decides
    in a later term: its first grant on a record is above the recovery's floor and
    the term's alike. Were it above the recovery's only, a grant an earlier term
    made without it (unacknowledged, so not in the new decider's hands) could carry
    a larger token and, merged later, take the claim from the holder the new term
    answered."""
    recovered, era = pack(NOW_MS + recovered_ms), pack(NOW_MS + era_ms)
    fence = FenceState()
    if fence_token:
        granted = Grant(pack(NOW_MS + granted_ms), "w", "other")  # not this era's own
        fence = fence.grant(fence_token, granted, NOW_MS + 60_000)
    token = next_token(fence, recovered_hlc=recovered, life_hlc=era, region="local")
    assert token > fence_token
    assert token >= token_ceiling(era)
    if not fence_token or pack(NOW_MS + granted_ms) < recovered:
        assert token >= token_ceiling(recovered)


def test_a_life_continues_its_own_tokens_one_by_one() -> None:
    """Once this life granted a record's fence, the next token is ``fence + 1``; a
    holder granted before the life began, or by another region (two births), gets
    the floor; without a life (a brand-new file) no floor at all."""
    life = pack(NOW_MS)
    mine = FenceState().grant(NOW_MS * 2**10, Grant(life, "w", "local"), NOW_MS + 60_000)
    assert next_token(mine, life_hlc=life, region="local") == NOW_MS * 2**10 + 1
    # Who granted decides, not how large the token is: a grant of this region at or
    # after the life's first HLC is this life's, and the next token follows it.
    for granted_at in (life, life + 3):
        own = FenceState().grant(7, Grant(granted_at, "w", "local"), NOW_MS + 60_000)
        assert next_token(own, life_hlc=life, region="local") == 8
    at_start = FenceState().grant(7, Grant(life - 1, "w", "local"), NOW_MS + 60_000)
    assert next_token(at_start, life_hlc=life, region="local") == NOW_MS * 2**10
    theirs = FenceState().grant(7, Grant(life + 5, "w", "eu"), NOW_MS + 60_000)
    assert next_token(theirs, life_hlc=life, region="local") == NOW_MS * 2**10
    assert next_token(theirs, region="local") == 8
    assert next_token(FenceState(), region="local") == 1
    # A recovery's floor (lost disk) still adds its gap on top.
    recovered = pack(NOW_MS + 1)
    assert next_token(at_start, recovered_hlc=recovered, life_hlc=life, region="local") == max(
        7 + 1 + RECOVERY_GAP, (NOW_MS + 1) * 2**10
    )
    _, first = decide_claim(
        Record(key_of("life")).create("local", Stamp(0, life - 1, "n1")),
        "w", caller=ANYONE, lease_ms=1_000, now_ms=NOW_MS, hlc=life + 1, region="local",
        queued_ahead=False, life_hlc=life,
    )  # fmt: skip
    assert first.token == NOW_MS * 2**10
