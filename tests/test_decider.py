"""One decider per region, elected through a real etcd (fencemark.node.coordination).

Campaigns of a region's members against an etcd process started by the test, over
mutual TLS with authentication on as an operator sets it (``access.restrict``): one
member decides, the others name it; a decider that lets go is followed at once; a
decider that cannot renew stops within two thirds of the TTL of its last renewal's
send time, nobody decides while etcd is away, and a decider is back within a TTL of
etcd's return; and only a region's own certificates may take its decider key.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fencemark.node.coordination.decider import (
    DECIDE_SHARE,
    Campaign,
    LeaseClock,
    decider_key,
)
from fencemark.node.coordination.etcd import Etcd, EtcdError, parse_endpoints
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from fencemark.node.tools.ports import Ports
from tests import components
from tests.cluster import eventually
from tests.docrun import Shell, Substitutions, run_steps, steps_of
from tests.etcd_server import EtcdServer, restricted, serving

TTL_S = 2
SECURITY = Path(__file__).resolve().parent.parent / "docs" / "security.md"


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[tuple[EtcdServer, Path]]:
    """An etcd over mutual TLS with authentication on: regions us and eu."""
    async with restricted(tmp_path) as running:
        yield running


def member(server: EtcdServer, certs: Path, name: str, region: str = "us") -> Campaign:
    etcd = Etcd([server.endpoint], TlsFiles.in_dir(certs, region), timeout_s=1.0)
    return Campaign(etcd, region, name, f"{name}.example:7400", ttl_s=TTL_S)


def campaigning(server: EtcdServer, certs: Path, *names: str) -> list[Campaign]:
    """Members of us named ``names``, each campaigning."""
    campaigns = [member(server, certs, name) for name in names]
    for campaign in campaigns:
        campaign.start()
    return campaigns


async def stop_all(*campaigns: Campaign) -> None:
    for campaign in campaigns:
        await campaign.stop()
        await campaign.etcd.close()


async def one_decides(*campaigns: Campaign, within: float = 10.0) -> Campaign:
    async def exactly_one() -> bool:
        return sum(c.deciding() for c in campaigns) == 1

    await eventually(exactly_one, "exactly one member deciding", within=within)
    return next(c for c in campaigns if c.deciding())


async def test_one_member_decides_and_the_others_name_it(
    etcd: tuple[EtcdServer, Path],
) -> None:
    server, certs = etcd
    campaigns = campaigning(server, certs, "us-a", "us-b", "us-c")
    try:
        decider = await one_decides(*campaigns)
        assert decider.term > 0
        others = [c for c in campaigns if c is not decider]

        async def named() -> bool:
            return all(
                c.decider is not None and c.decider.address == decider.address for c in others
            )

        await eventually(named, "every other member naming the decider")
        assert all(c.decider is not None and c.decider.term == decider.term for c in others)
        await asyncio.sleep(TTL_S)  # renewals keep it, and nobody else decides meanwhile
        assert decider.deciding() and not any(c.deciding() for c in others)
    finally:
        await stop_all(*campaigns)


async def test_a_decider_that_lets_go_is_followed_at_once_on_a_higher_term(
    etcd: tuple[EtcdServer, Path],
) -> None:
    server, certs = etcd
    campaigns = campaigning(server, certs, "us-a", "us-b")
    try:
        first = await one_decides(*campaigns)
        old_term = first.term
        await first.stop()
        (second,) = [c for c in campaigns if c is not first]
        await one_decides(second, within=TTL_S)  # its key went with its lease, at once
        assert second.term > old_term
    finally:
        await stop_all(*campaigns)


async def test_a_member_that_reaches_no_majority_does_not_campaign_and_a_decider_steps_aside(
    etcd: tuple[EtcdServer, Path],
) -> None:
    """``reaches`` (in a node: whether a majority of the region's members answered
    it lately) gates the campaign both ways. A member that reaches none does not
    take the free key, however long, and names nobody; once it does, it is elected.
    A decider that stops reaching a majority lets its key go at its next renewal
    (a quarter of the TTL), though it could renew it: the member that reaches one
    is elected, and the one aside names it."""
    server, certs = etcd
    reached = {"us-a": False, "us-b": False}
    campaigns = [member(server, certs, name) for name in reached]
    for campaign in campaigns:
        campaign.reaches = lambda name=campaign.member: reached[name]  # type: ignore[misc]
        campaign.start()
    a, b = campaigns
    try:
        await asyncio.sleep(TTL_S)
        assert not any(c.deciding() or c.term for c in campaigns)
        assert a.aside and b.aside and a.decider is None and b.decider is None
        assert await a.etcd.get(decider_key("us")) is None, "the key stays free"
        reached["us-a"] = True
        assert await one_decides(*campaigns, within=TTL_S) is a
        term = a.term
        reached["us-b"] = True  # b reaches a majority as well: it follows a
        reached["us-a"] = False  # and a, cut off, steps aside

        async def b_decides() -> bool:  # never, were a kept elected by its renewals
            return b.deciding()

        await eventually(b_decides, "the member that reaches a majority deciding", within=3 * TTL_S)
        assert b.term > term and a.aside and not a.deciding()

        async def a_names_b() -> bool:
            return a.decider is not None and a.decider.member == "us-b"

        await eventually(a_names_b, "the member aside naming the new decider", within=TTL_S)
    finally:
        await stop_all(*campaigns)


@pytest.mark.slow  # waits out a decider's TTL
async def test_a_decider_cut_from_etcd_stops_before_its_lease_lapses_and_one_is_back_in_a_ttl(
    etcd: tuple[EtcdServer, Path],
) -> None:
    """etcd away: the decider stops by its own clock, DECIDE_SHARE of the TTL after
    it sent its last renewal, and nobody decides; etcd back: a decider at once (the
    old decider revokes the lease it let go of as soon as etcd answers; were it gone
    too, the lease would expire within a TTL and etcd's election timeout)."""
    server, certs = etcd
    campaigns = campaigning(server, certs, "us-a", "us-b")
    try:
        decider = await one_decides(*campaigns)
        until = decider.lease_clock.until
        await server.kill()
        killed = time.monotonic()

        async def stopped() -> bool:
            return not any(c.deciding() for c in campaigns)

        await eventually(stopped, "no member deciding", within=TTL_S)
        assert until <= killed + TTL_S * DECIDE_SHARE  # its last renewal's bound
        await asyncio.sleep(TTL_S)
        assert not any(c.deciding() for c in campaigns), "nobody decides without etcd"
        # Nor is anyone named: a redirect to a member that cannot decide helps no one.
        assert all(c.decider is None for c in campaigns)
        await server.run()
        await serving(server, certs)  # etcd has a leader again: the old lease runs anew
        await one_decides(*campaigns, within=TTL_S)
    finally:
        await stop_all(*campaigns)


async def test_only_a_regions_certificates_may_take_its_decider_key(
    etcd: tuple[EtcdServer, Path],
) -> None:
    """A member of eu, a client's certificate, and one of the CA that etcd has no user
    for are refused on us's key (etcd: PERMISSION_DENIED); us's own may."""
    server, certs = etcd
    for name in ("eu", "alice"):
        intruder = Etcd([server.endpoint], TlsFiles.in_dir(certs, name))
        try:
            with pytest.raises(EtcdError) as refused:
                await intruder.put(decider_key("us"), b"{}")
            assert refused.value.code is not None
            assert refused.value.code.name == "PERMISSION_DENIED", name
            with pytest.raises(EtcdError):
                await intruder.get(decider_key("us"))
        finally:
            await intruder.close()
    (us,) = campaigning(server, certs, "us-a")
    try:
        await one_decides(us)
    finally:
        await stop_all(us)


def test_a_lease_clock_decides_for_a_share_of_the_ttl_from_the_renewal_sent() -> None:
    clock = LeaseClock(ttl_s=3.0)
    assert not clock.deciding(0.0)
    clock.renewed(sent_at=10.0, ttl_s=3.0)
    assert clock.deciding(10.0 + 3.0 * DECIDE_SHARE - 0.001)
    assert not clock.deciding(10.0 + 3.0 * DECIDE_SHARE)
    clock.renewed(sent_at=9.0, ttl_s=3.0)  # a late answer to an older renewal
    assert clock.deciding(10.0 + 3.0 * DECIDE_SHARE - 0.001)  # never moves back
    clock.stop()
    assert not clock.deciding(10.5)


def test_etcd_endpoints_are_read_with_the_bad_one_named() -> None:
    assert parse_endpoints("https://e1:2379, e2:2379") == ["e1:2379", "e2:2379"]
    for bad, said in (("http://e1:2379", "over TLS"), ("e1", "HOST:PORT"), ("", "no endpoint")):
        with pytest.raises(ValueError, match=said):
            parse_endpoints(bad)


async def test_a_revoked_member_cannot_take_the_decider_key(
    etcd: tuple[EtcdServer, Path],
) -> None:
    """A member of us whose certificate was revoked (``fencemark certs revoke``, the CRL
    given to etcd as ``--client-crl-file``) no longer completes etcd's handshake."""
    server, certs = etcd
    assert main(["certs", "issue", "--dir", str(certs), "--region", "us"]) != 0  # exists
    (certs / "us.pem").rename(certs / "old-us.pem")
    (certs / "us-key.pem").rename(certs / "old-us-key.pem")
    assert main(["certs", "issue", "--dir", str(certs), "--region", "us"]) == 0
    assert main(["certs", "revoke", "--dir", str(certs), "--cert", str(certs / "old-us.pem")]) == 0
    await server.kill()
    await server.run()  # now with the CRL
    await serving(server, certs)
    revoked = Etcd([server.endpoint], TlsFiles.in_dir(certs, "old-us"), timeout_s=1.0)
    try:
        with pytest.raises(EtcdError):
            await revoked.put(decider_key("us"), b"{}")
    finally:
        await revoked.close()
    (member_now,) = campaigning(server, certs, "us-a")  # the re-issued one may
    try:
        await one_decides(member_now)
    finally:
        await stop_all(member_now)


async def test_the_etcd_commands_wait_for_an_etcd_just_started_and_say_when_none_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fencemark etcd restrict`` run before etcd is up waits for it (``--wait``,
    30 s by default) and succeeds once it answers; with nothing answering it gives up
    after ``--wait`` seconds, saying so, exit 1; a bad ``--wait`` is named, exit 2."""
    components.require("etcd")
    certs = tmp_path / "certs"
    init_dir(certs, regions=["us"], clients=[])
    assert main(["certs", "etcd", "--dir", str(certs), "--root"]) == 0
    server = EtcdServer(tmp_path / "etcd", certs)  # its ports held, not started yet
    tool = ["etcd", "restrict", "--etcd", server.endpoint, "--tls-dir", str(certs),
            "--regions", "us"]  # fmt: skip
    try:
        restricting = asyncio.create_task(asyncio.to_thread(main, tool))
        await asyncio.sleep(1.0)
        assert not restricting.done(), "it waits for etcd to answer"
        await server.run()
        assert await restricting == 0
    finally:
        await server.stop()
    gone = ["etcd", "members", "--etcd", server.endpoint, "--tls-dir", str(certs),
            "--region", "us"]  # fmt: skip
    started = time.monotonic()
    capsys.readouterr()
    assert await asyncio.to_thread(main, [*gone, "--wait", "0.5"]) == 1
    assert time.monotonic() - started >= 0.5
    assert "no etcd endpoint answered" in (said := capsys.readouterr().err), said
    assert "(tried for 0.5 s)" in said
    assert await asyncio.to_thread(main, [*gone, "--wait", "-1"]) == 2
    assert "--wait: 0 to 3600 seconds, got -1" in capsys.readouterr().err


def test_security_md_sets_up_a_regions_etcd_as_written(tmp_path: Path) -> None:
    """docs/security.md's etcd: certificates, etcd itself, then its users and roles,
    typed in a shell as written (on held ports instead of etcd's 2379 and 2380);
    then us's certificate takes us's decider key and eu's is refused it."""
    components.require("etcd")
    ports = Ports()
    client, peer = ports.take(), ports.take()
    bin_dir = str(Path(sys.executable).parent)  # where `fencemark` is installed
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    shell = Shell(tmp_path, env, tmp_path / "transcript")
    steps = [s for s in steps_of([SECURITY]).values() if s.scenario == "etcd"]
    assert [s.name for s in steps] == ["certificates", "serve", "restrict"]

    try:
        subs = Substitutions({"2379": str(client), "2380": str(peer)})
        run_steps(shell, steps, subs)  # restrict waits for the etcd just started

        async def keys() -> None:
            certs = tmp_path / "certs"
            for region, allowed in (("us", True), ("eu", False)):
                etcd = Etcd([f"127.0.0.1:{client}"], TlsFiles.in_dir(certs, region))
                try:
                    if allowed:
                        await etcd.put(decider_key("us"), b"{}")
                    else:
                        with pytest.raises(EtcdError) as refused:
                            await etcd.put(decider_key("us"), b"{}")
                        assert refused.value.code is not None
                        assert refused.value.code.name == "PERMISSION_DENIED"
                finally:
                    await etcd.close()

        asyncio.run(keys())
    finally:
        shell.close()
        ports.close()
