"""A region of several members (SPEC §10): node servers on loopback, each a member of
region ``us``, electing their decider through a real etcd (mutual TLS, authentication
on, as an operator sets it: tests/etcd_server.py).

Pinned here: one member decides and every other answers a deciding call with a
redirect naming it (reads go on everywhere); the decider's health serves claims and
the others' does not; when the decider stops, another member decides within a lease
time, in a later term, and its first grant on a record jumps above every token the
earlier term can have granted; while etcd is away nobody decides (``NOT_SERVING``
with a retry hint) and reads go on, and once it is back a member decides again.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fencemark.client import AsyncClient, tls_credentials
from fencemark.client.errors import NotDecider, Unavailable, from_rpc_error
from fencemark.node.api.config import NodeConfig
from fencemark.node.api.gate_follower import CLAIMS_SERVICE
from fencemark.node.api.server import NodeServer
from fencemark.node.coordination.decider import DECIDE_SHARE
from fencemark.node.coordination.member import MemberConfig
from fencemark.node.crdt import Record, Stamp, codec
from fencemark.node.crdt.hlc import pack, wall_clock_ms
from fencemark.node.rules.admission import token_ceiling
from fencemark.node.security.tls import TlsFiles
from fencemark.node.tools.cli import main
from fencemark.node.tools.ports import Ports
from fencemark.v1 import (
    claims_pb2,
    claims_pb2_grpc,
    records_pb2,
    replication_pb2,
    replication_pb2_grpc,
)
from tests.cluster import eventually, shared_loop, stop_within, wait_converged
from tests.etcd_server import EtcdServer, member_config, restricted, serving
from tests.test_replication import error_info

pytestmark = pytest.mark.slow  # elections and lease times: seconds each

TTL_S = 2
OFFSET_MS = 500  # the nodes' --max-clock-offset
REPO, TOPIC = "lattice", "backlog"


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[tuple[EtcdServer, Path]]:
    async with restricted(tmp_path) as running:
        yield running


async def member(
    tmp_path: Path, server: EtcdServer, certs: Path, name: str, **overrides: Any
) -> NodeServer:
    """A member of us named ``name``, on its own data file; etcd reached with us's
    certificate unless ``etcd_as`` names another."""
    config = member_config(
        tmp_path, server, certs, name, max_clock_offset_ms=OFFSET_MS, ttl_s=TTL_S, **overrides
    )
    return await NodeServer.start(config)


MEMBERS = ("us-a", "us-b", "us-c")


@pytest.fixture
async def members(tmp_path: Path, etcd: tuple[EtcdServer, Path]) -> AsyncIterator[list[NodeServer]]:
    """us-a, us-b and us-c, the members of us (its configured set), campaigning and
    replicating with each other."""
    server, certs = etcd
    nodes = [await member(tmp_path, server, certs, name, initial=MEMBERS) for name in MEMBERS]
    try:
        yield nodes
    finally:
        for node in nodes:
            await stop_within(node)


async def one_decides(nodes: Sequence[NodeServer], within: float = 10.0) -> NodeServer:
    async def exactly_one() -> bool:
        return sum(n.replica.gate.deciding for n in nodes) == 1

    await eventually(exactly_one, "exactly one member deciding", within=within)
    return next(n for n in nodes if n.replica.gate.deciding)


async def all_caught_up(nodes: Sequence[NodeServer]) -> None:
    """Until no member owes its new file's catch-up any more."""

    async def none_owes() -> bool:
        return not any(n.replica.gate.owed for n in nodes)

    await eventually(none_owes, "every member caught up", within=10)


async def claims_health(node: NodeServer) -> int:
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=CLAIMS_SERVICE))
        return int(answer.status)


async def test_one_member_decides_and_the_others_redirect_deciding_calls_to_it(
    members: list[NodeServer],
) -> None:
    decider = await one_decides(members)
    other = next(n for n in members if n is not decider)
    serving_status = int(health_pb2.HealthCheckResponse.SERVING)

    async def health_follows() -> bool:
        here, there = await claims_health(decider), await claims_health(other)
        return here == serving_status and there != serving_status

    await eventually(health_follows, "claims health SERVING at the decider alone")

    async def named() -> bool:
        campaign = other.member.campaign if other.member is not None else None
        return campaign is not None and campaign.decider is not None

    await eventually(named, "the other member naming the decider")
    async with AsyncClient(other.address, retries=0) as client:
        # Created at a member that does not decide: a birth is not a decision.
        item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
        assert (await client.get(item.key)).key == item.key  # reads go on at every member
    async with grpc.aio.insecure_channel(other.address) as channel:
        stub = claims_pb2_grpc.ClaimsStub(channel)
        deciding: list[Awaitable[object]] = [
            stub.Claim(claims_pb2.ClaimRequest(key=item.key, owner="w", lease_seconds=30)),
            stub.ClaimNext(claims_pb2.ClaimNextRequest(repo=REPO, topic=TOPIC, owner="w")),
        ]
        for call in deciding:
            with pytest.raises(grpc.RpcError) as refused:
                await call
            said = from_rpc_error(refused.value)
            assert isinstance(said, NotDecider), said
            assert said.code == grpc.StatusCode.FAILED_PRECONDITION
            assert (said.region, said.address) == ("us", decider.address)
            assert said.term == decider.replica.gate.term > 0
            assert said.decider in MEMBERS
    async with AsyncClient(decider.address, retries=0) as client:
        mine = (await client.remember(REPO, TOPIC, "item-2", tags=["homeRegion:us"])).record
        granted = await client.claim(mine.key, "worker-a", lease_seconds=30)
        assert granted.granted


async def test_the_next_decider_grants_above_every_token_an_earlier_term_can_have_granted(
    members: list[NodeServer],
) -> None:
    """A failover is invisible to a holder, and starts an era of tokens: the first
    decider's grant, acknowledged by a majority, is the claim at its successor (the
    holder renews and releases it there); the successor's first grant on the record,
    in a later term, is above the ceiling of the moment the first decider stopped
    plus twice the clock offset — above anything the earlier term can have granted,
    acknowledged or not."""
    first = await one_decides(members)
    async with AsyncClient(first.address, retries=0) as client:
        made = await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
        key = made.record.key
        held = await client.claim(key, "worker-a", lease_seconds=30)
    assert held.granted
    old_term = first.replica.gate.term
    stopped_ms = wall_clock_ms()
    await stop_within(first)  # lets its key go: the successor is elected at once, catches up
    second = await one_decides([n for n in members if n is not first], within=3 * TTL_S)
    assert second.replica.gate.term > old_term
    async with AsyncClient(second.address, retries=0) as client:
        renewed = await client.renew_claim(key, held.fencing_token, lease_seconds=30)
        assert renewed.renewed, "the claim survived the failover"
        assert (await client.release_claim(key, held.fencing_token)).released
        again = await client.claim(key, "worker-b", lease_seconds=30)
    assert again.granted
    assert again.fencing_token > held.fencing_token
    assert again.fencing_token >= token_ceiling(pack(stopped_ms + 2 * OFFSET_MS))


async def test_every_member_keeps_the_claim_history_its_decider_decided(
    members: list[NodeServer],
) -> None:
    """The decider's claim events go with their states in the majority push, and
    each fellow member keeps them: Records.History answers alike at every member, and
    a successor's history goes on from its predecessor's."""
    first = await one_decides(members)
    await paired(members)
    others = [n for n in members if n is not first]
    async with AsyncClient(first.address, retries=0) as client:
        key = (await client.remember(REPO, TOPIC, "told", tags=["homeRegion:us"])).record.key
        held = await client.claim(key, "worker-a", lease_seconds=30)
        assert (await client.renew_claim(key, held.fencing_token, lease_seconds=30)).renewed
        assert (await client.release_claim(key, held.fencing_token, outcome="done")).released
        decided = (await client.history(key)).events
    assert [(e.kind, e.fencing_token) for e in decided] == [
        ("granted", held.fencing_token), ("renewed", held.fencing_token),
        ("released", held.fencing_token),
    ]  # fmt: skip

    for node in others:  # the one the majority did not wait for may be a moment late

        async def told(at: str = node.address) -> bool:
            async with AsyncClient(at, retries=0) as client:
                return (await client.history(key)).events == decided

        await eventually(told, f"{node.address} keeping the history")
    await stop_within(first)
    second = await one_decides(others, within=3 * TTL_S)
    async with AsyncClient(second.address, retries=0) as client:
        again = await client.claim(key, "worker-b", lease_seconds=30)
        assert again.granted
        events = (await client.history(key)).events
    assert events[:3] == decided
    assert [(e.kind, e.fencing_token) for e in events[3:]] == [("granted", again.fencing_token)]


async def test_a_fellow_members_push_with_malformed_events_is_refused_naming_the_field(
    members: list[NodeServer],
) -> None:
    """Claim events ride on a fellow member's push; one that names no state of the
    push, an unknown kind, or too many for one state refuses the whole push
    (INVALID_ARGUMENT naming the field) and merges nothing."""
    us_b = members[1]
    new = Record(f"repo/{REPO}/mem/{TOPIC}/told-wrong").create(
        "us", Stamp(0, pack(wall_clock_ms()), "probe")
    )
    origin = replication_pb2.Origin(
        region="us", member="us-a", node_id="probe", hlc=pack(wall_clock_ms())
    )

    def event(state: int, kind: str) -> replication_pb2.DecidedEvent:
        return replication_pb2.DecidedEvent(state=state, event=records_pb2.ClaimEvent(kind=kind))

    def push(*events: replication_pb2.DecidedEvent) -> replication_pb2.PushRequest:
        return replication_pb2.PushRequest(origin=origin, states=[codec.encode(new)],
                                           events=events)  # fmt: skip

    bad = [
        (push(event(1, "granted")), "events[0].state"),
        (push(event(0, "granted"), event(0, "stolen")), "events[1].event.kind"),
        (push(*[event(0, "renewed")] * 17), "events[16]"),
    ]
    async with grpc.aio.insecure_channel(us_b.address) as channel:
        stub = replication_pb2_grpc.ReplicationStub(channel)
        for request, field in bad:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Push(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in (refused.value.details() or ""), (field, refused.value.details())
    assert await us_b.storage.get(new.key) is None


async def test_two_commits_of_one_record_in_one_push_keep_both_commits_events(
    members: list[NodeServer],
) -> None:
    """A batched push carries each commit's state, so one record can come twice in
    it: merged in the order sent, each state keeps its own claim events (the later
    state holds the earlier; merged first, it would leave the earlier's events no
    change to go with)."""
    us_b = members[1]
    key = f"repo/{REPO}/mem/{TOPIC}/twice"
    now = pack(wall_clock_ms())
    first = Record(key).create("us", Stamp(0, now, "probe"))
    second = first.set_fields({"body": "later"}, Stamp(0, now + 1, "probe"))
    origin = replication_pb2.Origin(region="us", member="us-a", node_id="probe", hlc=now + 1)

    def event(state: int, kind: str, token: int) -> replication_pb2.DecidedEvent:
        told = records_pb2.ClaimEvent(kind=kind, fencing_token=token, owner="worker-a")
        told.at.FromMilliseconds(wall_clock_ms())
        return replication_pb2.DecidedEvent(state=state, event=told)

    request = replication_pb2.PushRequest(
        origin=origin, states=[codec.encode(first), codec.encode(second)],
        events=[event(0, "granted", 7), event(1, "released", 7)],
    )  # fmt: skip
    async with grpc.aio.insecure_channel(us_b.address) as channel:
        answer = await replication_pb2_grpc.ReplicationStub(channel).Push(request, timeout=10)
    assert (answer.merged, answer.refused) == (2, 0)
    async with AsyncClient(us_b.address, retries=0) as client:
        told = (await client.history(key)).events
    assert [(e.kind, e.fencing_token) for e in told] == [("granted", 7), ("released", 7)]


async def test_while_etcd_is_away_nobody_decides_reads_go_on_and_a_decider_is_back_after(
    members: list[NodeServer], etcd: tuple[EtcdServer, Path]
) -> None:
    server, certs = etcd
    async with AsyncClient(members[0].address, retries=0) as client:
        item = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
    await wait_converged(members)
    await one_decides(members)
    await server.kill()
    killed = time.monotonic()

    async def nobody() -> bool:
        return not any(n.replica.gate.deciding for n in members)

    await eventually(nobody, "no member deciding", within=3 * TTL_S)
    assert time.monotonic() - killed <= TTL_S * DECIDE_SHARE + 0.5
    for node in members:
        async with AsyncClient(node.address, retries=0) as client:
            with pytest.raises(Unavailable) as refused:
                await client.claim(item.key, "worker-a", lease_seconds=30)
            assert refused.value.reason == "NOT_SERVING"
            assert refused.value.retry_after == TTL_S
            assert (await client.get(item.key)).key == item.key
    await server.run()
    await serving(server, certs)
    back = await one_decides(members, within=3 * TTL_S)
    async with AsyncClient(back.address, retries=0) as client:
        assert (await client.claim(item.key, "worker-a", lease_seconds=30)).granted


async def test_clients_follow_the_redirect_unnoticed_and_ask_again_after_a_failover(
    members: list[NodeServer],
) -> None:
    """A client of a member that does not decide: its deciding calls reach the
    decider without the caller seeing the redirect, and go there directly from then
    on; once that decider is gone, the member is asked again and names the next."""
    decider = await one_decides(members)
    other = next(n for n in members if n is not decider)
    async with AsyncClient(other.address, retries=0) as client:
        key = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key

    async def named() -> bool:
        campaign = other.member.campaign if other.member is not None else None
        return campaign is not None and campaign.decider is not None

    await eventually(named, "the other member naming the decider")
    async with AsyncClient(other.address, timeout=10) as client:
        granted = await client.claim(key, "worker-a", lease_seconds=30)
        assert granted.granted
        assert client.deciders == {other.address: decider.address}
        renewed = await client.renew_claim(key, granted.fencing_token, lease_seconds=30)
        assert renewed.renewed
        await client.update(key, fields={"body": "fenced"}, fencing_token=granted.fencing_token)
        released = await client.release_claim(key, granted.fencing_token)
        assert released.released
        await stop_within(decider)  # lets the key go: another member decides at once
        left = [n for n in members if n is not decider]
        successor = await one_decides(left, within=3 * TTL_S)
        again = await client.claim(key, "worker-b", lease_seconds=30)
        assert again.granted and again.fencing_token > granted.fencing_token
        if successor is other:
            assert client.deciders == {}  # the target decides itself now
        else:
            assert client.deciders == {other.address: successor.address}


async def test_status_names_each_members_decider_in_text_and_json(
    members: list[NodeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    decider = await one_decides(members)
    other = next(n for n in members if n is not decider)
    name = decider.member.name if decider.member is not None else ""
    term = decider.replica.gate.term

    async def named() -> bool:
        known = other.member.decider() if other.member is not None else None
        return known is not None and known.term == term

    await eventually(named, "the other member naming the decider")
    await paired(members)
    targets = ["--targets", decider.address, other.address, "--timeout", "5"]
    assert await asyncio.to_thread(main, ["status", *targets]) == 0
    text = capsys.readouterr().out
    assert f"member {name}: decides for region us (term {term})" in text
    other_name = other.member.name if other.member is not None else ""
    assert f"member {other_name}: decider {name} (term {term}) at {decider.address}" in text
    assert "members of region us: us-a, us-b, us-c\n" in text
    # The CLAIMS column: the decider serves them, the other leaves them to it.
    rows = {r.split()[0]: r.split()[4] for r in text.splitlines() if r.startswith("127.")}
    assert rows == {decider.address: "serving", other.address: "to-decider"}
    assert text.count("  member us/") == 4  # each of the two shows its two fellow members
    # --decider: the name alone, for scripts (docs/deploy.md kills its container).
    assert await asyncio.to_thread(main, ["status", *targets, "--decider"]) == 0
    assert capsys.readouterr().out == f"{name}\n"
    assert await asyncio.to_thread(main, ["status", *targets, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["nodes"]
    wanted = {"member": name, "address": decider.address, "term": term}
    assert [n["decider"] for n in said] == [wanted, wanted]
    assert [n["member"] for n in said] == [name, other_name]
    assert [n["claims_serving"] for n in said] == [True, False]
    assert [n["members"] for n in said] == [list(MEMBERS), list(MEMBERS)]


async def peers_of(node: NodeServer) -> dict[str, tuple[str, str]]:
    """The node's peers as Node.Info lists them: name -> (region, member)."""
    async with AsyncClient(node.address, retries=0) as client:
        info = await client.info()
    return {p.name: (p.region, p.member) for p in info.peers}


async def paired(members: Sequence[NodeServer]) -> None:
    """Until each of ``members`` lists every other as a peer (registry polls)."""

    async def each_a_peer() -> bool:
        for node in members:
            name = node.member.name if node.member is not None else ""
            others = {f"us/{n}" for n in MEMBERS if n != name}
            if not others <= (await peers_of(node)).keys():
                return False
        return True

    await eventually(each_a_peer, "each member a peer of the others", within=10)


async def test_members_find_each_other_in_etcd_and_replicate_with_each_other(
    tmp_path: Path, members: list[NodeServer], etcd: tuple[EtcdServer, Path]
) -> None:
    """Each member registers its address in etcd; every other member makes it a peer
    (``us/NAME``), pushes to it and syncs with it. A write at any member reaches the
    others, and so does a grant made by the decider; a member that stops drops out
    of the others' peers once its entry's lease is gone."""
    us_a, us_b, us_c = members
    await paired(members)
    assert (await peers_of(us_a))["us/us-b"] == ("us", "us-b")
    async with AsyncClient(us_a.address, retries=0) as a, AsyncClient(us_b.address) as b:
        one = (await a.remember(REPO, TOPIC, "from-a", tags=["homeRegion:us"])).record
        two = (await b.remember(REPO, TOPIC, "from-b", tags=["homeRegion:us"])).record
        await wait_converged(members)
        assert (await b.get(one.key)).key == one.key and (await a.get(two.key)).key == two.key
        granted = await b.claim(one.key, "worker-a", lease_seconds=30)  # follows the redirect
        assert granted.granted
        await wait_converged(members)
        for node in members:
            async with AsyncClient(node.address, retries=0) as there:
                assert (await there.claim_status(one.key)).fence == granted.fencing_token
    await stop_within(us_c)

    async def dropped() -> bool:
        return "us/us-c" not in await peers_of(us_a)

    await eventually(dropped, "us-c out of us-a's peers", within=3 * TTL_S + 5)


async def test_a_write_reaches_each_fellow_member_once_not_by_both_pushes(
    members: list[NodeServer],
) -> None:
    """A member's write goes to its fellow members in the majority round; the eager
    push that follows its commit skips a member that acknowledged it, so each state
    travels once per member (twice would be every write's traffic doubled). The push
    to the member that answered after the majority is left to finish, not cancelled:
    cancelled, the receiver's handler was cut short after its merge, uncounted, and
    the eager push sent the same states again."""
    us_a = members[0]
    await paired(members)
    await wait_converged(members)
    fellows = ("us/us-b", "us/us-c")
    before = sum(us_a.replicator.peer_stats(f).records_sent for f in fellows)

    def received() -> int:
        return sum(m.replicator.peer_stats("us/us-a").records_received for m in members[1:])

    got_before = received()
    writes = 10
    async with AsyncClient(us_a.address, retries=0) as a:
        for n in range(writes):
            await a.remember(REPO, TOPIC, f"once-{n}", tags=["homeRegion:us"])
    await wait_converged(members)
    await asyncio.sleep(0.5)  # an eager push would have gone by now
    sent = sum(us_a.replicator.peer_stats(f).records_sent for f in fellows) - before
    got = received() - got_before
    # Each write once to each fellow, by us-a's pushes; a round's pull may add a few,
    # never a second copy of every write.
    assert 2 * writes <= sent < 3 * writes, sent
    assert 2 * writes <= got < 3 * writes, got


async def test_majority_pushes_asked_while_one_is_under_way_go_together_in_the_next(
    members: list[NodeServer],
) -> None:
    """Under load a fellow member gets one Push per round trip, not one per commit:
    pushes asked while one to the same member is under way wait for it, then go in
    one call, and each asker hears that the member holds its states."""
    us_a, us_b = members[0], members[1]
    await paired(members)
    async with AsyncClient(us_a.address, retries=0) as a:
        made = [
            (await a.remember(REPO, TOPIC, f"batched-{n}", tags=["homeRegion:us"])).record.key
            for n in range(20)
        ]
    states = await us_a.storage.states(made)

    def pushes() -> float:
        served = us_b.metrics.registry.get_sample_value(
            "fencemark_requests_total", {"method": "Push", "code": "OK"}
        )
        return served or 0.0

    before = pushes()
    held = await asyncio.gather(
        *(us_a.replicator.push_to_member("us-b", [states[key]]) for key in made)
    )
    assert held == [True] * len(made)

    async def counted() -> bool:  # the server counts a call once it has answered it
        return pushes() > before

    await eventually(counted, "us-b counting the pushes it answered", within=5)
    await asyncio.sleep(0.3)
    # The first alone and the 19 asked meanwhile together; or all 20 together, behind
    # a push of the writes above that was still under way. Never one call each.
    assert 1 <= pushes() - before <= 2


async def test_a_member_joins_as_a_learner_and_counts_once_added_one_change_at_a_time(
    tmp_path: Path, etcd: tuple[EtcdServer, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The procedure of docs/operations.md, *Adding or removing a member*: a new
    member started in a running region replicates and catches up at once, but its
    acknowledgement counts for no majority until ``fencemark etcd members --add``
    puts it in the set; only a running member can be added, one change at a time,
    and the last member cannot leave. Once us-c is in the set and us-b has left it,
    writes are acknowledged by us-a and us-c, with us-b stopped."""
    server, certs = etcd
    tool = ["etcd", "members", "--etcd", f"https://{server.endpoint}",
            "--tls-dir", str(certs), "--region", "us"]  # fmt: skip
    start = [
        await member(tmp_path, server, certs, n, initial=("us-a", "us-b")) for n in ("us-a", "us-b")
    ]
    us_a, us_b = start
    us_c = await member(tmp_path, server, certs, "us-c", initial=())
    nodes = [us_a, us_b, us_c]
    try:

        async def set_read() -> bool:  # until then us-a acknowledges nothing (NO_MAJORITY)
            return us_a.member is not None and us_a.member.configured() == ("us-a", "us-b")

        await eventually(set_read, "us-a reading the member set from etcd", within=10)
        async with AsyncClient(us_a.address, retries=0) as a:
            made = (await a.remember(REPO, TOPIC, "before", tags=["homeRegion:us"])).record
        await wait_converged(nodes, within=20)  # the learner caught up
        assert await asyncio.to_thread(main, tool) == 0
        assert "region us: members us-a, us-b" in capsys.readouterr().out
        # Refused, changing nothing: a member that is not running, two changes at once
        # (argparse), removing one that is not there.
        for refused, says in (
            (["--add", "us-z"], "is not running"),
            (["--remove", "us-z"], "is not in the member set of region 'us'"),
            (["--add", "us-a"], "in the member set of region 'us' already"),
        ):
            assert await asyncio.to_thread(main, [*tool, *refused]) == 2, refused
            assert says in capsys.readouterr().err, refused
        assert await asyncio.to_thread(main, [*tool, "--add", "us-c"]) == 0
        assert "region us: members us-a, us-b, us-c" in capsys.readouterr().out
        assert await asyncio.to_thread(main, [*tool, "--remove", "us-b"]) == 0
        assert "region us: members us-a, us-c" in capsys.readouterr().out

        async def everyone_knows() -> bool:
            return all(
                n.member is not None and n.member.configured() == ("us-a", "us-c") for n in nodes
            )

        await eventually(everyone_knows, "the new set at every member", within=5)
        await stop_within(us_b)
        async with AsyncClient(us_a.address, retries=0) as a:
            await a.update(made.key, fields={"after": "us-b left"})
        assert (await us_c.storage.get(made.key)) is not None
        found = await us_c.storage.get(made.key)
        assert found is not None and found.record.fields["after"].value == "us-b left"
        assert await asyncio.to_thread(main, [*tool, "--remove", "us-c"]) == 0
        capsys.readouterr()
        assert await asyncio.to_thread(main, [*tool, "--remove", "us-a"]) == 2
        assert "the last of region 'us': it cannot leave" in capsys.readouterr().err
    finally:
        for node in nodes:
            await stop_within(node)


async def test_a_member_alone_does_not_campaign_and_one_decides_once_a_second_is_back(
    members: list[NodeServer],
) -> None:
    """One of three members, started again alone after all three stopped, reaches
    no majority of its members: elected, it could get nothing acknowledged, so it
    does not campaign at all — the decider key stays free however long it waits —
    and refuses deciding calls NOT_SERVING, saying why. Once a second member is
    back, one of the two is elected, catches up with the other and decides, and a
    claim granted before the failover is still its holder's there. (That an elected
    member decides only once it holds a majority's states, when the one it reaches
    is on a lost disk, is the next test's.)"""
    first = await one_decides(members)
    async with AsyncClient(first.address, retries=0) as client:
        key = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key
        held = await client.claim(key, "worker-a", lease_seconds=60)
    assert held.granted
    await all_caught_up(members)  # a new file stopped before it has owes it still
    for node in members:
        await stop_within(node)
    alone, stopped = [n for n in members if n is not first]
    survivor = await NodeServer.start(alone.config)
    members.append(survivor)  # the fixture stops it
    campaign = survivor.member.campaign if survivor.member is not None else None
    assert campaign is not None

    async def aside() -> bool:
        return campaign.aside

    await eventually(aside, "the survivor standing aside", within=3 * TTL_S)
    async with AsyncClient(survivor.address, retries=0) as client:
        for _ in range(2 * TTL_S):
            assert campaign.term == 0 and not survivor.replica.gate.deciding
            assert (await client.info()).decider is None  # nobody holds the key
            with pytest.raises(Unavailable) as refused:
                await client.renew_claim(key, held.fencing_token, lease_seconds=60)
            assert refused.value.reason == "NOT_SERVING"
            said = str(refused.value)  # its restart's wait first, then the member's
            assert "does not reach a majority" in said or "just started" in said, said
            await asyncio.sleep(0.5)
    back = await NodeServer.start(stopped.config)
    try:
        await one_decides([survivor, back], within=3 * TTL_S)
        decider = survivor if survivor.replica.gate.deciding else back
        async with AsyncClient(decider.address, retries=0) as client:
            renewed = await client.renew_claim(key, held.fencing_token, lease_seconds=60)
        assert renewed.renewed, "the claim granted before the failover is its holder's"
    finally:
        await stop_within(back)


@pytest.mark.parametrize("losses", [1, 2], ids=["lost-once", "lost-again-before-caught-up"])
async def test_a_member_back_on_a_lost_disk_counts_for_no_majority_until_it_caught_up(
    members: list[NodeServer], capsys: pytest.CaptureFixture[str], losses: int
) -> None:
    """A member that lost its disk may lack what it acknowledged (SPEC §10). With
    the third member stopped, the decider and one other acknowledge a claim; all
    stop, that other's file is lost, and it comes back with the third: two of
    three, but the claim is on neither's disk. So the one on the lost disk owes a
    catch-up, says so, counts for no majority, and nobody decides — the claim is
    granted to no one else. Once the decider's member is back, one decides, the
    claim is still its holder's, and the member on the lost disk catches up. Its
    disk lost a second time before it caught up, it is no vote either: the new
    file's first start is not its name's first life (etcd remembers the name)."""
    decider = await one_decides(members)
    await all_caught_up(members)
    lost, late = [n for n in members if n is not decider]
    await stop_within(late)
    async with AsyncClient(decider.address, retries=0) as client:
        key = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key
        held = await client.claim(key, "worker-a", lease_seconds=60)
    assert held.granted  # acknowledged by the decider and `lost`: a majority of three
    await stop_within(decider)
    await stop_within(lost)
    assert lost.config.data_dir is not None
    await asyncio.to_thread(shutil.rmtree, lost.config.data_dir)  # its disk lost
    late = await NodeServer.start(late.config)
    members.append(late)  # the fixture stops it
    lost = await NodeServer.start(lost.config)
    members.append(lost)
    assert lost.replica.gate.owed
    if losses == 2:  # nobody to catch up from (the decider is down): lost again
        await stop_within(lost)
        await asyncio.to_thread(shutil.rmtree, lost.config.data_dir or "")
        lost = await NodeServer.start(lost.config)
        members.append(lost)
        assert lost.replica.gate.owed
    async with AsyncClient(late.address, retries=0) as client:
        for _ in range(2 * TTL_S):
            assert not late.replica.gate.deciding and not lost.replica.gate.deciding
            assert lost.replica.gate.owed
            with pytest.raises(Unavailable):
                await client.claim(key, "worker-b", lease_seconds=60)
            await asyncio.sleep(0.5)
    async with AsyncClient(lost.address, retries=0) as client:
        assert (await client.info()).owes_catch_up
    assert await asyncio.to_thread(main, ["status", "--targets", lost.address]) == 0
    name = lost.member.name if lost.member is not None else ""
    assert f"member {name} owes a catch-up" in capsys.readouterr().out
    back = await NodeServer.start(decider.config)
    members.append(back)
    now = await one_decides([late, lost, back], within=3 * TTL_S)
    async with AsyncClient(now.address, retries=0) as client:
        renewed = await client.renew_claim(key, held.fencing_token, lease_seconds=60)
    assert renewed.renewed, "the claim acknowledged before the disk was lost is its holder's"

    async def caught_up() -> bool:
        return not lost.replica.gate.owed

    await eventually(caught_up, "the member on the lost disk catching up", within=5 * TTL_S)


async def test_a_write_a_majority_does_not_hold_is_refused_no_majority_and_kept_here(
    tmp_path: Path, members: list[NodeServer]
) -> None:
    """With two of us's three members stopped, a write at the third is durable there
    but not acknowledged: refused UNAVAILABLE, reason NO_MAJORITY, naming how many
    hold it."""
    us_a, us_b, us_c = members
    async with AsyncClient(us_a.address, retries=0) as a:
        made = (await a.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record
        await stop_within(us_b)
        await stop_within(us_c)
        with pytest.raises(Unavailable) as refused:
            await a.update(made.key, fields={"body": "alone"})
        assert refused.value.reason == "NO_MAJORITY"
        assert "1 of the 2 needed" in str(refused.value)
        found = await us_a.storage.get(made.key)
        assert found is not None and found.record.fields["body"].value == "alone"


async def acknowledged(client: AsyncClient, id_: str) -> str:
    """The key of us item ``id_``, remembered with a majority's acknowledgement. A
    member just gone leaves two of three, and a slow disk under load can miss the
    lease time: ``NO_MAJORITY`` leaves the outcome unknown, and ``Remember`` is an
    upsert, so it is asked again (at most five times)."""
    for _ in range(4):
        try:
            return (await client.remember(REPO, TOPIC, id_, tags=["homeRegion:us"])).record.key
        except Unavailable as refused:
            assert refused.reason == "NO_MAJORITY", refused
    return (await client.remember(REPO, TOPIC, id_, tags=["homeRegion:us"])).record.key


async def test_another_region_replicates_with_any_member_and_moves_on_when_one_is_gone(
    tmp_path: Path, members: list[NodeServer]
) -> None:
    """``--peer us=A,B,C``: any member of a region of several serves its replication.
    eu learns us's writes through the first address; once that member is gone, it
    moves on to the next and goes on learning them."""
    eu = await NodeServer.start(
        NodeConfig(
            region="eu",
            listen="127.0.0.1:0",
            data_dir=tmp_path / "eu",
            enable_writes=True,
            grace_seconds=0.2,
            peers={"us": ",".join(m.address for m in members)},
            replication=shared_loop(),
        )
    )
    try:
        first = members[0]
        async with AsyncClient(eu.address, retries=0) as at_eu:
            async with AsyncClient(first.address, retries=0) as at_us:
                one = (await at_us.remember(REPO, TOPIC, "one", tags=["homeRegion:us"])).record

            async def learnt(key: str) -> bool:
                return await eu.storage.get(key) is not None

            await eventually(lambda: learnt(one.key), "eu learning us's write")
            assert (await at_eu.info()).peers[0].address == first.address
            await stop_within(first)
            async with AsyncClient(members[1].address, retries=0) as at_us:
                two = await acknowledged(at_us, "two")
            await eventually(lambda: learnt(two), "eu learning us's write from another member")
            assert (await at_eu.info()).peers[0].address != first.address
    finally:
        await stop_within(eu)


async def test_with_tls_only_a_registered_member_of_the_region_replicates_as_one(
    tmp_path: Path, etcd: tuple[EtcdServer, Path]
) -> None:
    """Over mutual TLS a member accepts its own region's certificate only from a
    member registered in etcd: us's certificate calling as an unknown member, or as
    the region's only node, is refused ``unknown_member`` and merges nothing, while
    the registered members replicate with each other."""
    server, certs = etcd
    nodes = [
        await member(tmp_path, server, certs, name, tls=TlsFiles.in_dir(certs, "us"))
        for name in ("us-a", "us-b")
    ]
    try:
        us_a, us_b = nodes
        alice = tls_credentials(certs, "alice")
        async with AsyncClient(us_a.address, credentials=alice, retries=0) as a:
            made = (await a.remember(REPO, TOPIC, "over-tls", tags=["homeRegion:us"])).record
        await wait_converged(nodes, within=20)
        assert made.key in await us_b.storage.states([made.key])
        forged = Record(f"repo/{REPO}/mem/{TOPIC}/forged").create(
            "us", Stamp(0, pack(wall_clock_ms()), "probe")
        )
        before = us_b.storage.record_count
        us = TlsFiles.in_dir(certs, "us").channel_credentials()
        for member_name in ("us-x", ""):
            async with grpc.aio.secure_channel(us_b.address, us) as channel:
                stub = replication_pb2_grpc.ReplicationStub(channel)
                origin = replication_pb2.Origin(
                    region="us", member=member_name, node_id="probe", hlc=pack(wall_clock_ms())
                )
                request = replication_pb2.PushRequest(origin=origin, states=[codec.encode(forged)])
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Push(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, member_name
            assert "registered" in (refused.value.details() or ""), member_name
            assert error_info(refused.value).metadata["denial"] == "unknown_member"
        assert us_b.storage.record_count == before
        assert await us_b.storage.get(forged.key) is None
    finally:
        for node in nodes:
            await stop_within(node)


async def test_a_member_with_another_regions_certificate_never_decides(
    tmp_path: Path, etcd: tuple[EtcdServer, Path]
) -> None:
    """A node configured as a member of us that reaches etcd with eu's certificate (a
    misconfiguration, or an eu machine trying to take us's items): etcd refuses it
    us's decider key and its region's member set, so it decides nothing, names no
    decider, acknowledges no write (``NO_MAJORITY``: it knows no member set) and its
    deciding calls are refused NOT_SERVING while us's real member decides."""
    server, certs = etcd
    intruder = await member(tmp_path, server, certs, "us-x", etcd_as="eu")
    try:
        async with AsyncClient(intruder.address, retries=0) as client:
            with pytest.raises(Unavailable) as unacknowledged:
                await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
            assert unacknowledged.value.reason == "NO_MAJORITY"
            key = f"repo/{REPO}/mem/{TOPIC}/item-1"  # durable there all the same
            assert await intruder.storage.get(key) is not None
            for _ in range(3 * TTL_S):
                assert not intruder.replica.gate.deciding
                with pytest.raises(Unavailable) as refused:
                    await client.claim(key, "worker-a", lease_seconds=30)
                assert refused.value.reason == "NOT_SERVING"
                await asyncio.sleep(1)
        real = await member(tmp_path, server, certs, "us-a")
        try:
            await one_decides([real, intruder])
            assert real.replica.gate.deciding and not intruder.replica.gate.deciding
            # It cannot even read the key: it names nobody, so nobody is redirected there.
            assert intruder.member is not None and intruder.member.decider() is None
        finally:
            await stop_within(real)
    finally:
        await stop_within(intruder)


async def test_a_second_process_given_a_members_name_neither_registers_nor_campaigns(
    tmp_path: Path, etcd: tuple[EtcdServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes started with one ``--member`` name (a copied service definition):
    the second finds the name registered, says so, and neither replicates as it nor
    campaigns while the first runs; once the first has stopped, it takes the name."""
    server, certs = etcd
    first = await member(tmp_path, server, certs, "us-a")
    second = await member(tmp_path / "copy", server, certs, "us-a")
    try:
        await one_decides([first])

        async def said() -> bool:
            return "member name us-a is registered by another process" in caplog.text

        await eventually(said, "the second process saying the name is taken")
        for _ in range(2 * TTL_S):
            assert second.member is not None and second.member.campaign is not None
            assert second.member.campaign.term == 0 and not second.replica.gate.deciding
            assert first.replica.gate.deciding
            await asyncio.sleep(0.5)
        await stop_within(first)
        await one_decides([second], within=3 * TTL_S)
    finally:
        await stop_within(first)
        await stop_within(second)


async def test_the_dashboard_names_the_member_and_its_decider(
    tmp_path: Path, etcd: tuple[EtcdServer, Path]
) -> None:
    server, certs = etcd
    node = await member(tmp_path, server, certs, "us-a", dashboard_listen="127.0.0.1:0")
    try:
        await one_decides([node])
        url = f"http://127.0.0.1:{node.dashboard_port}/api/snapshot"

        def snapshot() -> dict[str, object]:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return cast(dict[str, object], json.loads(answer.read()))

        said = await asyncio.to_thread(snapshot)
        assert said["member"] == "us-a" and said["deciding"] is True
        assert said["members"] == ["us-a"]
        assert said["decider"] == {
            "member": "us-a", "address": node.address, "term": node.replica.gate.term
        }  # fmt: skip
    finally:
        await stop_within(node)


@pytest.mark.parametrize(
    ("member", "named"),
    [
        (MemberConfig("us a", ["127.0.0.1:2379"], None), "member: a member's name"),
        (MemberConfig("us-a", [], None), "member.etcd: no endpoint"),
        (MemberConfig("us-a", ["127.0.0.1:2379"], None, ttl_s=0), "member.ttl_s"),
        (MemberConfig("us-a", ["127.0.0.1:2379"], None, ttl_s=61), "member.ttl_s"),
        (MemberConfig("us-a", ["127.0.0.1:2379"], None, initial=("us-a", "b c")), "initial"),
        (MemberConfig("us-a", ["127.0.0.1:2379"], None, initial=("us-b",)), "leaves out"),
    ],
)
async def test_a_bad_member_configuration_is_refused_before_anything_opens(
    tmp_path: Path, member: MemberConfig, named: str
) -> None:
    config = NodeConfig(region="us", listen="127.0.0.1:0", data_dir=tmp_path, member=member)
    with pytest.raises(ValueError, match=named):
        await NodeServer.start(config)
    assert not await asyncio.to_thread(lambda: list(tmp_path.iterdir())), "nothing written"


def name_of(node: NodeServer) -> str:
    return node.member.name if node.member is not None else ""


async def test_another_regions_signed_sighting_reaches_every_member_over_tls(
    tmp_path: Path, etcd: tuple[EtcdServer, Path]
) -> None:
    """A claim of us seen at eu carries eu's signed sighting. Only us-a peers with eu;
    its fellows, which never speak to eu, learn eu's certificate from us-a
    (``Replication.Certificates``, asked as the registered members they are) and
    merge the sighting: every node ends byte-identical."""
    server, certs = etcd
    us, ports = TlsFiles.in_dir(certs, "us"), Ports()
    at_eu = ports.address()
    members = [
        await member(
            tmp_path,
            server,
            certs,
            name,
            tls=us,
            initial=MEMBERS,
            peers={"eu": at_eu} if name == "us-a" else {},
        )
        for name in MEMBERS
    ]
    eu = await NodeServer.start(
        NodeConfig(
            region="eu",
            listen=at_eu,
            data_dir=tmp_path / "eu",
            enable_writes=True,
            grace_seconds=0.2,
            peers={"us": members[0].address},
            replication=shared_loop(),
            tls=TlsFiles.in_dir(certs, "eu"),
        )
    )
    try:
        decider = await one_decides(members)
        alice = tls_credentials(certs, "alice")
        async with AsyncClient(decider.address, credentials=alice, retries=0) as client:
            key = (await client.remember(REPO, TOPIC, "seen", tags=["homeRegion:us"])).record.key
            assert (await client.claim(key, "worker-a", lease_seconds=60)).granted

        async def sighted_everywhere() -> bool:
            for node in [*members, eu]:
                held = await node.storage.get(key)
                if held is None or "eu" not in held.record.seen:
                    return False
            return True

        async def where() -> str:
            found = []
            for node in [*members, eu]:
                held = await node.storage.get(key)
                seen = sorted(held.record.seen) if held is not None else None
                found.append(f"{node.config.region}/{name_of(node)}: {seen}")
            return ", ".join(found)

        await eventually(sighted_everywhere, "eu's sighting on every member", within=20,
                         explain=where)  # fmt: skip
        await wait_converged([*members, eu], within=20)
    finally:
        await stop_within(eu)
        for node in members:
            await stop_within(node)
        ports.close()
