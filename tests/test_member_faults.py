"""A region of several members under faults (SPEC §10): etcd's leader killed, etcd's
quorum lost for 20 s and restored, the decider cut from etcd alone, a member cut from
the decider and healed, 20 failovers in a row under load, a new decider whose own
state of an item is newer than a majority's and lacks its grant, and a fellow member
leaving while a write waits for its acknowledgement.

Members us-a, us-b and us-c run in-process on loopback, each reached by its fellow
members through a fault proxy of its own and reaching etcd through proxies of its
own; etcd is three real processes over mutual TLS with authentication on
(tests/etcd_server.py). A watcher samples every member
all along: at no moment do two of them decide. After each fault a member decides,
and a claim granted before it is still its holder's.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from fencemark.client import AsyncClient
from fencemark.client.errors import ClaimConflict, FencemarkError, NotDecider, Unavailable
from fencemark.node.api.server import NodeServer
from fencemark.node.tools.cli import main
from fencemark.node.tools.ports import Ports
from fencemark.node.tools.proxy import FaultProxy
from tests.cluster import eventually, stop_within, wait_converged
from tests.etcd_server import EtcdCluster, member_config, restricted_cluster
from tests.metrics import counters

pytestmark = pytest.mark.slow  # etcd elections, lease times and a 20 s outage

T = TypeVar("T")
TTL_S = 2
FAILOVERS_S = 120  # the 20 failovers' time, at most, once ten are done
MEMBERS = ("us-a", "us-b", "us-c")
REPO, TOPIC = "lattice", "backlog"


class Stopped(Exception):
    """The test is over: a worker stops asking."""


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[tuple[EtcdCluster, Path]]:
    async with restricted_cluster(tmp_path) as running:
        yield running


@pytest.fixture
async def proxies() -> AsyncIterator[dict[str, FaultProxy]]:
    """A fault proxy in front of each member's peer listener (on a held port), by
    member name: the address it registers for its fellow members."""
    ports = Ports()
    made: dict[str, FaultProxy] = {}
    try:
        for name in MEMBERS:
            made[name] = await FaultProxy.start(ports.address(), name=name)
        yield made
    finally:
        for proxy in made.values():
            await proxy.close()
        ports.close()


@pytest.fixture
async def etcd_links(etcd: tuple[EtcdCluster, Path]) -> AsyncIterator[dict[str, list[FaultProxy]]]:
    """Each member's own way to etcd, by member name: a fault proxy in front of each
    etcd endpoint (etcd's certificate names 127.0.0.1, whatever the port)."""
    cluster, _ = etcd
    made: dict[str, list[FaultProxy]] = {}
    try:
        for name in MEMBERS:
            made[name] = [await FaultProxy.start(e, name=f"{name}-etcd") for e in cluster.endpoints]
        yield made
    finally:
        for links in made.values():
            for proxy in links:
                await proxy.close()


@pytest.fixture
async def members(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    etcd: tuple[EtcdCluster, Path],
    proxies: dict[str, FaultProxy],
    etcd_links: dict[str, list[FaultProxy]],
) -> AsyncIterator[list[NodeServer]]:
    """The three members, each behind its proxy; a test's indirect parameter, if
    any, is settings of their configuration (``member_config``'s overrides)."""
    cluster, certs = etcd
    overrides: dict[str, Any] = {"ttl_s": TTL_S, **getattr(request, "param", {})}
    nodes: list[NodeServer] = []
    try:
        for name in MEMBERS:
            proxy = proxies[name]
            config = member_config(
                tmp_path, cluster, certs, name, initial=MEMBERS,
                peer_listen=proxy.upstream, advertise_peer=proxy.address,
                etcd_endpoints=[link.address for link in etcd_links[name]], **overrides,
            )  # fmt: skip
            nodes.append(await NodeServer.start(config))
        yield nodes
    finally:
        for node in nodes:
            await stop_within(node)


def has_peer(node: NodeServer, name: str) -> bool:
    try:
        node.replicator.peer_stats(name)
    except KeyError:
        return False
    return True


def name_of(node: NodeServer) -> str:
    return node.member.name if node.member is not None else ""


@contextmanager
def never_two_deciders(nodes: list[NodeServer]) -> Iterator[list[int]]:
    """Sample ``nodes`` every 50 ms while the block runs; fail if two decided at
    once. Yields the list of samples taken (how many deciders each saw)."""
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(sum(n.replica.gate.deciding for n in nodes))
            assert seen[-1] <= 1, "two members decided at once"
            await asyncio.sleep(0.05)

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise AssertionError("two members decided at once")


@asynccontextmanager
async def bounded(what: str, seconds: float) -> AsyncIterator[None]:
    """Fail naming ``what`` when it takes longer than ``seconds``: a stall says where."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        pytest.fail(f"{what}: still waiting after {seconds} s")


async def one_decides(nodes: list[NodeServer], within: float) -> NodeServer:
    async def exactly_one() -> bool:
        return sum(n.replica.gate.deciding for n in nodes) == 1

    await eventually(exactly_one, "exactly one member deciding", within=within)
    return next(n for n in nodes if n.replica.gate.deciding)


async def claimed(nodes: list[NodeServer]) -> tuple[NodeServer, str, Any]:
    """The member deciding now, and a claim it granted: the item's key, the grant."""
    decider = await one_decides(nodes, within=10)
    async with AsyncClient(decider.address, retries=0) as client:
        key = (await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])).record.key
        held = await client.claim(key, "worker-a", lease_seconds=120)
    assert held.granted
    return decider, key, held


async def still_held(nodes: list[NodeServer], key: str, held: Any, within: float) -> None:
    decider = await one_decides(nodes, within=within)
    async with AsyncClient(decider.address, retries=0) as client:
        renewed = await client.renew_claim(key, held.fencing_token, lease_seconds=120)
    assert renewed.renewed, "the claim granted before the fault is its holder's"


async def test_etcds_leader_killed_leaves_one_decider_and_the_claims_as_they_were(
    members: list[NodeServer], etcd: tuple[EtcdCluster, Path]
) -> None:
    """etcd's leader killed, and later back on its data: another etcd member leads,
    a member decides again (at most one at any moment), and the claim granted
    before is its holder's both times."""
    cluster, _ = etcd
    _, key, held = await claimed(members)
    with never_two_deciders(members) as seen:
        leader = await cluster.leader()
        await leader.kill()
        await asyncio.sleep(2 * TTL_S)  # etcd elects another leader meanwhile
        await still_held(members, key, held, within=10 * TTL_S)
        await leader.run()  # back on its data: it rejoins as a follower
        await asyncio.sleep(TTL_S)
        await still_held(members, key, held, within=10 * TTL_S)
    assert len(seen) > 10


async def test_etcds_quorum_lost_for_20_s_stops_every_decision_and_nothing_else(
    members: list[NodeServer], etcd: tuple[EtcdCluster, Path]
) -> None:
    """With two of etcd's three members killed, no member decides once its lease
    clock has run out (``NOT_SERVING``), while writes go on, acknowledged by a
    majority of the region's members. 20 s later etcd is whole again, a member
    decides, and the claim granted before is its holder's."""
    cluster, _ = etcd
    decider, key, held = await claimed(members)
    with never_two_deciders(members) as seen:
        leader = await cluster.leader()
        lost = [leader, next(s for s in cluster.servers if s is not leader)]
        for server in lost:
            await server.kill()

        async def nobody_decides() -> bool:
            return not any(n.replica.gate.deciding for n in members)

        await eventually(nobody_decides, "every member stopping deciding", within=2 * TTL_S)
        deadline = asyncio.get_running_loop().time() + 20
        n = 0
        async with AsyncClient(decider.address, retries=0) as client:  # the decider until now
            while asyncio.get_running_loop().time() < deadline:
                assert await nobody_decides()
                made = await client.remember(REPO, TOPIC, f"during-{n}", tags=["homeRegion:us"])
                assert made.record.key
                with pytest.raises(Unavailable) as refused:
                    await client.renew_claim(key, held.fencing_token, lease_seconds=120)
                assert refused.value.reason == "NOT_SERVING", refused.value
                n += 1
                await asyncio.sleep(1.0)
        for server in lost:
            await server.run()
        await still_held(members, key, held, within=10 * TTL_S)
    assert n >= 10 and len(seen) > 100


async def test_a_member_cut_from_the_decider_holds_up_nothing_and_converges_once_healed(
    members: list[NodeServer], proxies: dict[str, FaultProxy]
) -> None:
    """The decider and another member cut from each other both ways (their peer
    listeners refuse every connection; the third member reaches neither, while
    both reach it): the decider goes on deciding, its grants acknowledged by the
    third member; the cut member's writes are acknowledged there too. Once healed,
    all three converge and the claims granted meanwhile are their holders'."""
    decider, key, held = await claimed(members)
    cut = next(n for n in members if n is not decider)
    with never_two_deciders(members):
        proxies[name_of(decider)].cut()
        proxies[name_of(cut)].cut()
        async with AsyncClient(decider.address, retries=0) as at_decider:
            made = await at_decider.remember(REPO, TOPIC, "item-2", tags=["homeRegion:us"])
            during = await at_decider.claim(made.record.key, "worker-b", lease_seconds=120)
            assert during.granted
            renewed = await at_decider.renew_claim(key, held.fencing_token, lease_seconds=120)
            assert renewed.renewed
        async with AsyncClient(cut.address, retries=0) as at_cut:
            mine = await at_cut.remember(REPO, TOPIC, "from-the-cut", tags=["homeRegion:us"])
        assert decider.replica.gate.deciding
        for proxy in proxies.values():
            proxy.heal()
        await wait_converged(members, within=30)
        for node in members:
            found = await node.storage.get(mine.record.key)
            assert found is not None
        await still_held(members, made.record.key, during, within=2 * TTL_S)
        await still_held(members, key, held, within=2 * TTL_S)


def fetches(node: NodeServer) -> float:
    """``Replication.Fetch`` calls ``node`` answered."""
    calls = counters(node, "fencemark_requests", "method", "code")
    return sum(n for (method, _), n in calls.items() if method.endswith("Fetch"))


async def test_a_claim_sent_on_right_after_a_write_the_decider_has_not_got_is_granted(
    members: list[NodeServer], proxies: dict[str, FaultProxy]
) -> None:
    """Nothing reaches the decider (its peer listener refuses every connection):
    a write at another member is acknowledged by the other two alone, and the
    claim on it, sent on to the decider at once, finds a record the decider does
    not hold. The decider looks it up at its fellow members before it answers, and
    grants. A record nobody holds is answered ``missing`` (a burst of claims on it
    costs each fellow one ``Fetch``); with every member's
    listener cut, the decider cannot know, and says ``NOT_SERVING``, granting nothing."""
    decider = await one_decides(members, within=10)
    other = next(n for n in members if n is not decider)

    async def other_knows_it() -> bool:
        assert other.member is not None
        named = other.member.decider()
        return named is not None and named.member == name_of(decider)

    await eventually(other_knows_it, "the other member names the decider", within=10)
    proxies[name_of(decider)].cut()
    async with AsyncClient(other.address, retries=0) as client:
        for i in range(5):
            made = await client.remember(REPO, TOPIC, f"sent-on-{i}", tags=["homeRegion:us"])
            held = await client.claim(made.record.key, "worker-a", lease_seconds=120)
            assert held.granted, f"claim {i}: {held.reason}"
        nobody = await client.claim("repo/lattice/mem/backlog/nobodys", "worker-a")
        assert (nobody.granted, nobody.reason) == (False, "missing")
    fellows = [n for n in members if n is not decider]
    before = [fetches(n) for n in fellows]
    for fellow in fellows:  # a lookup under way while the whole burst arrives
        proxies[name_of(fellow)].set_latency(0.3)
    async with AsyncClient(decider.address, retries=0) as client:
        burst = [client.claim("repo/lattice/mem/backlog/no-one", f"w-{i}") for i in range(20)]
        answers = await asyncio.gather(*burst)
        assert {a.reason for a in answers} == {"missing"}
    assert [fetches(n) - b for n, b in zip(fellows, before, strict=True)] == [1, 1]
    for fellow in fellows:
        proxies[name_of(fellow)].set_latency(0)
    async with AsyncClient(other.address, retries=0) as client:
        for proxy in proxies.values():
            proxy.cut()
        with pytest.raises(Unavailable) as refused:
            await client.claim("repo/lattice/mem/backlog/nobodys", "worker-a")
        assert refused.value.reason == "NOT_SERVING"
    assert await decider.storage.get("repo/lattice/mem/backlog/nobodys") is None


# Rounds a minute apart: the decider pulls no record in its own rounds while a test
# runs, and holds only what it is pushed (or looks up). A lease of 5 s: the decider
# steps aside when no majority answered it for two of them, longer than a member's
# restart on a new file.
RARE_ROUNDS = {"anti_entropy_interval": 60.0, "ttl_s": 5}


@pytest.mark.parametrize("members", [RARE_ROUNDS], indirect=True, ids=["rare-rounds"])
async def test_a_fellow_back_on_a_lost_disk_does_not_answer_a_lookup_with_none(
    members: list[NodeServer], proxies: dict[str, FaultProxy]
) -> None:
    """A write at another member is acknowledged by the two that are not the
    decider; then that member's listener is cut and the other comes back on a lost
    disk. The decider, asked to claim the record, looks it up: the member on the
    lost disk holds none, but it may lack what it acknowledged (its ``Fetch`` answer
    says ``owed``), so its answer counts for nothing, and with the writer out of
    reach the decider cannot tell: ``NOT_SERVING``, not ``missing``, and nothing
    written. Healed, the writer answers the next lookup, and the claim is granted.
    (The decider reaches a majority throughout — itself and the member back — so
    it decides on.)"""
    decider = await one_decides(members, within=10)
    writer, lost = [n for n in members if n is not decider]
    proxies[name_of(decider)].cut()  # nothing pushed reaches the decider
    async with AsyncClient(writer.address, retries=0) as client:
        made = await client.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
    key = made.record.key
    proxies[name_of(writer)].cut()  # nobody reaches the writer: the one back pulls nothing
    await stop_within(lost)
    assert lost.config.data_dir is not None
    await asyncio.to_thread(shutil.rmtree, lost.config.data_dir)  # its disk lost
    lost = await NodeServer.start(lost.config)
    members.append(lost)  # the fixture stops it
    assert lost.replica.gate.owed
    assert await decider.storage.get(key) is None, "the decider got it after all"
    async with AsyncClient(decider.address, retries=0) as client:

        async def refused_for_the_lost_disk() -> bool:
            with pytest.raises(Unavailable) as refused:  # never "missing"
                await client.claim(key, "worker-a", lease_seconds=60)
            assert refused.value.reason == "NOT_SERVING", refused.value
            # Until the decider's calls reach the member back, it does not answer.
            return "may lack what they acknowledged" in str(refused.value)

        await eventually(refused_for_the_lost_disk, "the lost disk's answer", within=10)
        assert decider.replica.gate.deciding and lost.replica.gate.owed
        assert await decider.storage.get(key) is None
        proxies[name_of(writer)].heal()

        async def granted() -> bool:
            try:
                claim = await client.claim(key, "worker-a", lease_seconds=60)
            except Unavailable:  # the writer's link coming back
                return False
            assert claim.granted, claim.reason
            return True

        await eventually(granted, "the claim granted once the writer is reached", within=20)


@pytest.mark.parametrize("outcome", ["done", ""], ids=["done", "plain"])
async def test_a_retried_release_is_not_answered_from_a_state_no_majority_holds(
    members: list[NodeServer], proxies: dict[str, FaultProxy], outcome: str
) -> None:
    """The decider commits a release its fellow members never get (every listener
    cut): ``NO_MAJORITY``, the outcome unknown. Its holder asks again, as told to;
    the release is already in the decider's file, so the rule answers the retry
    from the state as it is — and that state no majority holds. A decider elected
    without it would still see the claim live and hand the token out again (the
    member chaos tier found it so: the same token granted twice, an item done
    twice). So the retry is acknowledged again first: ``NO_MAJORITY`` while the
    fellows are out of reach, ``released`` once a majority holds it."""
    decider, key, held = await claimed(members)
    for proxy in proxies.values():
        proxy.cut()  # the decider's pushes fail at once; nobody pulls from it either
    async with AsyncClient(decider.address, retries=0) as client:
        for attempt in ("first", "retry"):
            with pytest.raises(Unavailable) as refused:
                await client.release_claim(key, held.fencing_token, outcome=outcome)
            assert refused.value.reason == "NO_MAJORITY", f"{attempt}: {refused.value}"
        stored = await decider.storage.get(key)
        assert stored is not None and stored.record.fence.ended(held.fencing_token)
        for proxy in proxies.values():
            proxy.heal()

        async def released() -> bool:
            try:
                answer = await client.release_claim(key, held.fencing_token, outcome=outcome)
            except Unavailable as exc:  # the decider's links coming back
                assert exc.reason == "NO_MAJORITY", exc
                return False
            assert answer.released
            return True

        await eventually(released, "the retried release acknowledged", within=10)


async def test_a_decider_its_members_do_not_answer_steps_aside_and_another_decides(
    members: list[NodeServer], proxies: dict[str, FaultProxy], capsys: pytest.CaptureFixture[str]
) -> None:
    """The decider's calls to both fellow members fail (their listeners cut; their
    calls to it get through): it could get nothing acknowledged, yet etcd, which it
    still reaches, would keep it elected. Within two lease times it steps aside, and
    it does not campaign while it reaches no majority. One of the others — each
    reaching a majority with it — is elected, catches up with it and decides: the
    claim granted before is its holder's, and a new one is granted. Never two
    deciders at once; healed, the old decider names the new one."""
    decider, key, held = await claimed(members)
    rest = [n for n in members if n is not decider]
    campaign = decider.member.campaign if decider.member is not None else None
    assert campaign is not None
    with never_two_deciders(members):
        for fellow in rest:
            proxies[name_of(fellow)].cut()
        new = await one_decides(rest, within=10 * TTL_S)
        assert campaign.aside and campaign.term == 0
        async with AsyncClient(decider.address) as client:  # sent on to the new decider
            assert (await client.info()).cut_off
            assert await asyncio.to_thread(main, ["status", "--targets", decider.address]) == 0
            said = capsys.readouterr().out
            assert f"member {name_of(decider)} reaches no majority of its members" in said, said
            renewed = await client.renew_claim(key, held.fencing_token, lease_seconds=120)
            assert renewed.renewed, "the claim granted before is its holder's"
            made = await client.remember(REPO, TOPIC, "item-2", tags=["homeRegion:us"])
            granted = await client.claim(made.record.key, "worker-b", lease_seconds=120)
            assert granted.granted and granted.fencing_token > held.fencing_token
        for fellow in rest:
            proxies[name_of(fellow)].heal()

        async def names_the_new_one() -> bool:
            known = decider.member.decider() if decider.member is not None else None
            return not campaign.aside and known is not None and known.member == name_of(new)

        await eventually(names_the_new_one, "the old decider naming the new one", within=20)
        assert new.replica.gate.deciding
        async with AsyncClient(decider.address) as client:
            assert not (await client.info()).cut_off


async def test_a_decider_cut_from_etcd_alone_stops_and_another_decides(
    members: list[NodeServer], etcd_links: dict[str, list[FaultProxy]]
) -> None:
    """The decider cut from etcd, and from nothing else (its clients and fellow
    members reach it): it stops deciding before its lease can have expired
    (``NOT_SERVING``, its lease in doubt), another member decides once etcd let
    the lease go, never both at once, and the claim granted before is its holder's
    there. Healed, the old decider decides nothing and sends deciding calls on to
    the new one."""
    decider, key, held = await claimed(members)
    with never_two_deciders(members):
        for link in etcd_links[name_of(decider)]:
            link.blackhole()  # its calls to etcd go unanswered, as across a lost route
        rest = [n for n in members if n is not decider]
        async with AsyncClient(decider.address, retries=0) as at_old:
            await still_held(rest, key, held, within=10 * TTL_S)
            with pytest.raises(Unavailable) as refused:
                await at_old.renew_claim(key, held.fencing_token, lease_seconds=120)
            assert refused.value.reason == "NOT_SERVING", refused.value
            for link in etcd_links[name_of(decider)]:
                link.heal()

            async def names_the_new_one() -> bool:
                known = decider.member.decider() if decider.member is not None else None
                return known is not None and known.member != name_of(decider)

            await eventually(names_the_new_one, "the old decider naming the new one", within=20)
            assert not decider.replica.gate.deciding
            renewed = await at_old.renew_claim(key, held.fencing_token, lease_seconds=120)
            assert renewed.renewed, "sent on to the new decider"


async def test_twenty_failovers_under_load_grant_no_token_twice_and_lose_nothing(
    tmp_path: Path, etcd: tuple[EtcdCluster, Path]
) -> None:
    """20 failovers in a row while workers drain a queue and a writer adds to it:
    each time the decider stops (its key let go at once: the fastest handover, the
    most overlap of an old term's last calls with a new term's first) and starts
    again on its own file. Workers reach any member and follow its redirect; a call
    refused during a handover (``NOT_SERVING``, ``NO_MAJORITY``, a member gone) is
    asked again. No item's token is granted twice, no item is done twice, and every
    write a member acknowledged is on every member at the end. On a machine too
    loaded for 20 in ``FAILOVERS_S`` the run ends after ten: each phase is bounded,
    and the pace is a benchmark's to measure, not this test's."""
    cluster, certs = etcd
    ports = Ports()
    configs = {
        name: member_config(
            tmp_path, cluster, certs, name, ttl_s=TTL_S, initial=MEMBERS, listen=ports.address()
        )
        for name in MEMBERS
    }
    nodes = {name: await NodeServer.start(config) for name, config in configs.items()}
    addresses = [config.listen for config in configs.values()]
    grants: list[tuple[str, int]] = []
    done: list[str] = []
    acked: list[str] = []
    stop = asyncio.Event()

    async def again(call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``call(...)`` until it is answered (a handover's refusals change nothing),
        or until the test stops (``Stopped``)."""
        while not stop.is_set():
            try:
                return await call(*args, **kwargs)
            except (Unavailable, NotDecider):  # a handover: redirects that chase it
                await asyncio.sleep(0.05)
            except FencemarkError as error:  # a member stopped in the middle of the call
                if error.code != grpc.StatusCode.CANCELLED:
                    raise
                await asyncio.sleep(0.05)
        raise Stopped

    async def worker(owner: str) -> None:
        clients = [AsyncClient(a, retries=0, timeout=5) for a in addresses]
        try:
            while True:
                c = random.choice(clients)
                picked = await again(c.claim_next, REPO, "queue", owner, lease_seconds=60)
                if not picked.granted or picked.record is None:
                    await asyncio.sleep(0.05)
                    continue
                key, token = picked.record.key, picked.fencing_token
                grants.append((key, token))
                await again(c.update, key, fields={"by": owner}, fencing_token=token)
                # A release whose reply was lost is refused when asked again (the
                # claim is over): the item is done all the same, counted once here.
                if (await again(c.release_claim, key, token, outcome="done")).released:
                    done.append(key)
        except Stopped:
            return
        finally:
            for client in clients:
                await client.close()

    async def writer() -> None:
        async with AsyncClient(addresses[0], retries=0, timeout=5) as c:
            n = 0
            try:
                while True:
                    try:
                        made = await again(c.remember, REPO, "queue", f"item-{n}",
                                           tags=["homeRegion:us"])  # fmt: skip
                        acked.append(made.record.key)
                    except ClaimConflict:
                        # Asked again after a reply was lost: the first ask made the
                        # item, and a worker claimed it meanwhile. Made, unacknowledged.
                        pass
                    n += 1
                    await asyncio.sleep(0.02)
            except Stopped:
                return

    tasks = [asyncio.create_task(worker(f"worker-{i}")) for i in range(3)]
    tasks.append(asyncio.create_task(writer()))
    try:
        # Safety is the subject, not speed (benchmarks measure that): on a machine
        # too loaded for 20 in FAILOVERS_S, the run stops after the tenth.
        ends = asyncio.get_running_loop().time() + FAILOVERS_S
        for failover in range(20):
            if failover >= 10 and asyncio.get_running_loop().time() > ends:
                break
            decider = await one_decides(list(nodes.values()), within=10 * TTL_S)
            await asyncio.sleep(0.5)  # work goes on in each term before it ends
            name = name_of(decider)
            async with bounded(f"failover {failover}: {name} stopping", 30):
                await decider.stop(0)
            async with bounded(f"failover {failover}: {name} starting again", 30):
                nodes[name] = await NodeServer.start(configs[name])
        await one_decides(list(nodes.values()), within=10 * TTL_S)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        async with bounded("the workers and the writer stopping", 30):
            results = await asyncio.gather(*tasks, return_exceptions=True)
        members = list(nodes.values())
        try:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            await wait_converged(members, within=30)
            # A done item is never eligible again, and a grant whose reply was lost
            # is withdrawn unseen: each item is granted to a worker at most once.
            granted_twice = [k for k, count in Counter(k for k, _ in grants).items() if count > 1]
            assert not granted_twice, f"items granted twice: {granted_twice}"
            twice = [key for key, count in Counter(done).items() if count > 1]
            assert not twice, f"items done twice: {twice}"
            assert len(done) >= 5 and len(acked) >= 20, (len(done), len(acked))  # it ran
            for node in members:
                held = await node.storage.states(acked)
                assert set(held) == set(acked), "an acknowledged write lost"
        finally:
            for node in members:
                await stop_within(node)
            ports.close()


async def test_a_new_decider_takes_an_acknowledged_grant_from_a_state_older_than_its_own(
    members: list[NodeServer], proxies: dict[str, FaultProxy]
) -> None:
    """A grant acknowledged by the decider and a second member while nobody reached
    the third; then the third takes an unfenced write of the same item, later by
    the clock, acknowledged by the decider alone (the second cut off too). Its state
    of the item is newer than the second member's and lacks the grant. The decider
    stops and the third is elected (the second does not campaign): its catch-up
    with the second merges every state that differs, older or not, so the item
    stays its holder's — refused to another worker, renewed for the holder."""
    decider = await one_decides(members, within=10)
    second, third = (n for n in members if n is not decider)
    async with AsyncClient(decider.address, retries=0) as at_decider:
        made = await at_decider.remember(REPO, TOPIC, "item-1", tags=["homeRegion:us"])
        key = made.record.key
        await wait_converged(members, within=10)
        proxies[name_of(third)].cut()
        held = await at_decider.claim(key, "worker-a", lease_seconds=120)
    assert held.granted
    proxies[name_of(second)].cut()
    async with AsyncClient(third.address, retries=0) as at_third:
        await at_third.update(key, fields={"seen": "by the third member"})
    assert second.member is not None and second.member.campaign is not None
    await second.member.campaign.stop()  # the third is the only candidate left
    await stop_within(decider)
    proxies[name_of(second)].heal()  # the third reaches it; nobody reaches the third
    elected = await one_decides([second, third], within=10 * TTL_S)
    assert elected is third
    async with AsyncClient(third.address, retries=0) as at_third:
        taken = await at_third.claim(key, "worker-b", lease_seconds=120)
        assert not taken.granted, f"granted again: token {taken.fencing_token}"
        renewed = await at_third.renew_claim(key, held.fencing_token, lease_seconds=120)
        assert renewed.renewed


async def test_a_write_outlives_a_fellow_member_that_leaves_while_it_is_acknowledged(
    members: list[NodeServer], proxies: dict[str, FaultProxy]
) -> None:
    """A write at the decider waits for its majority: one fellow member answers
    slowly, the other slower still, and leaves the decider's peers meanwhile (its
    registration gone: the channel its calls were on is closed under them). Its
    unanswered push is a fellow that did not acknowledge, not a cancellation of
    the write: the write is answered once the slow member acknowledges, and once
    healed, the decider's anti-entropy rounds go on."""
    decider = await one_decides(members, within=10)
    slow, gone = (n for n in members if n is not decider)

    async def both_are_its_peers() -> bool:
        return all(has_peer(decider, f"us/{name_of(n)}") for n in (slow, gone))

    await eventually(both_are_its_peers, "the decider replicating with both fellows", within=10)
    proxies[name_of(slow)].set_latency(0.4)
    proxies[name_of(gone)].set_latency(5.0)
    async with AsyncClient(decider.address, retries=0, timeout=10) as client:
        write = asyncio.create_task(client.remember(REPO, TOPIC, "item-1"))
        await asyncio.sleep(0.2)  # its pushes are under way
        assert not write.done()
        await decider.replicator.set_members({name_of(slow): proxies[name_of(slow)].address})
        made = await write
    assert made.record.key
    for proxy in proxies.values():
        proxy.set_latency(0)
    rounds = decider.replicator.rounds

    async def rounds_go_on() -> bool:
        return decider.replicator.rounds > rounds + 2

    await eventually(rounds_go_on, "the decider's anti-entropy rounds", within=10)
