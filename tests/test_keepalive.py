"""SPEC §9, claim keepalive: ``client.hold(...)`` renews in the background and tells
its holder at once when the claim is lost — superseded by a take-back, or its home
paused past the lease — against real nodes (in-process, and a real process that is
``SIGSTOP``ped). Waits are bounded: leases are 1 to 2 s, every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, ClaimLost, Client
from fencemark.node.api.server import NodeServer
from fencemark.node.tools.process import NodeProcess
from tests.cluster import paused

REPO, TOPIC = "hold", "work"


async def item(client: AsyncClient, id_: str) -> str:
    return (await client.remember(REPO, TOPIC, id_, title=id_)).record.key


@pytest.mark.slow  # waits through many leases
async def test_a_hold_keeps_a_short_lease_alive_for_many_leases(node: NodeServer) -> None:
    async with AsyncClient(node.address) as client:
        key = await item(client, "long-work")
        claim = await client.claim(key, "w", lease_seconds=1)
        async with client.hold(claim, key=key, lease_seconds=1) as hold:
            await asyncio.sleep(3.5)  # three and a half leases of work
            assert hold.held and hold.renewals >= 5
            status = await client.claim_status(key)
            assert status.claim is not None and status.claim.fencing_token == claim.fencing_token
        renewals = hold.renewals
        await asyncio.sleep(0.8)
        assert hold.renewals == renewals  # no keepalive outlives its block


async def test_a_take_back_is_noticed_at_the_next_renewal_and_can_cancel_the_holder(
    node: NodeServer,
) -> None:
    async with AsyncClient(node.address) as client:
        key = await item(client, "taken-back")
        picked = await client.claim_next(REPO, TOPIC, "w", lease_seconds=3)
        started = time.monotonic()
        with pytest.raises(ClaimLost) as lost:
            async with client.hold(picked, lease_seconds=3, cancel_on_loss=True) as hold:
                await client.force_release(key, "stuck worker")
                await asyncio.sleep(30)  # the work, cancelled by the loss
        assert time.monotonic() - started < 3  # within one renewal interval (1 s) or so
        assert (lost.value.reason, hold.reason, hold.held) == ("superseded", "superseded", False)
        assert lost.value.token == picked.fencing_token


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
async def test_a_paused_home_is_reported_unreachable_once_the_lease_is_over(
    tmp_path: Path,
) -> None:
    """The holder cannot tell a paused home from a lost claim: once the lease it last
    renewed has run out, it must assume the claim lapsed (another worker may hold it
    now) and say so — not keep working on."""
    home = await NodeProcess.start(tmp_path / "home")
    try:
        async with AsyncClient(home.address, timeout=1) as client:
            key = await item(client, "paused-home")
            claim = await client.claim(key, "w", lease_seconds=2)
            async with client.hold(claim, key=key, lease_seconds=2) as hold:
                paused_at = time.monotonic()
                with paused(home):
                    async with asyncio.timeout(5):
                        reason = await hold.wait_lost()
                    noticed = time.monotonic() - paused_at
            assert reason == "unreachable"
            assert noticed <= 2.5  # no later than the lease it last renewed (plus scheduling)
            # The home lapses it too: another worker gets the next token.
            rival = await client.claim(key, "rival", lease_seconds=2, wait_seconds=10)
            assert rival.granted and rival.fencing_token > claim.fencing_token
    finally:
        await home.stop()


async def test_holding_needs_a_granted_claim_a_key_and_a_real_lease(node: NodeServer) -> None:
    async with AsyncClient(node.address) as client:
        key = await item(client, "bad")
        claim = await client.claim(key, "w", lease_seconds=5)
        with pytest.raises(ValueError, match="key"):
            client.hold(claim, lease_seconds=5)
        with pytest.raises(ValueError, match="lease_seconds"):
            client.hold(claim, key=key, lease_seconds=0)
        refused = await client.claim(key, "other")
        with pytest.raises(ValueError, match="not granted"):
            client.hold(refused, key=key, lease_seconds=5)


async def test_the_blocking_client_holds_too(node: NodeServer) -> None:
    def hold_a_while() -> tuple[bool, int]:
        with Client(node.address) as client:
            key = client.remember(REPO, TOPIC, "blocking").record.key
            claim = client.claim(key, "w", lease_seconds=1)
            with client.hold(claim, key=key, lease_seconds=1) as hold:
                time.sleep(2.5)
                hold.check()  # raises ClaimLost if it was lost
                return hold.held, hold.renewals

    async with asyncio.timeout(15):
        held, renewals = await asyncio.to_thread(hold_a_while)
    assert held and renewals >= 3


HOLDER = """
import asyncio, sys
from fencemark.client import AsyncClient, ClaimConflict

async def main(address: str, key: str) -> None:
    async with AsyncClient(address, timeout=2) as client:
        claim = await client.claim(key, "stalled-holder", lease_seconds=2)
        async with client.hold(claim, key=key, lease_seconds=2) as hold:
            print("held", claim.fencing_token, flush=True)
            print("lost", await hold.wait_lost(), flush=True)
        try:
            await client.update(key, fields={"by": "stalled"}, fencing_token=claim.fencing_token)
            print("wrote", flush=True)
        except ClaimConflict as refused:
            print("refused", refused.reason, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.slow  # a holder process, paused past its lease
async def test_a_holder_stalled_past_its_lease_hears_at_once_that_a_rival_took_over(
    node: NodeServer,
) -> None:
    """The holder's own process is paused (SIGSTOP) past its lease; the home lapses the
    claim and a rival takes the item. When the holder runs again it hears the loss
    before anything else (``expired``: it never even tried to renew), and its write
    with the old token is refused ``superseded``."""
    async with AsyncClient(node.address) as client:
        key = await item(client, "stalled-holder")
        holder = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLDER, node.address, key, stdout=asyncio.subprocess.PIPE
        )
        assert holder.stdout is not None
        try:
            async with asyncio.timeout(20):
                held = (await holder.stdout.readline()).decode().split()
                assert held[0] == "held", held
                # Longer than its lease: the hold renews it (every third of the lease,
                # so a renewal may come a lease's two thirds late on a busy machine).
                await asyncio.sleep(2.5)
                assert (await client.claim_status(key)).claim is not None
                os.kill(holder.pid, signal.SIGSTOP)
                try:
                    rival = await client.claim(key, "rival", lease_seconds=60, wait_seconds=10)
                finally:
                    os.kill(holder.pid, signal.SIGCONT)
                assert rival.granted and rival.fencing_token == int(held[1]) + 1
                lines = [(await holder.stdout.readline()).decode().split() for _ in range(2)]
                assert await holder.wait() == 0
        finally:
            if holder.returncode is None:
                holder.kill()
                await holder.wait()
    assert lines == [["lost", "expired"], ["refused", "superseded"]]
