"""Every decision a nap interrupts is refused, not answered (docs/replication.md, *naps*).

A process that stands still between deciding a change and answering it (paused,
starved of CPU) may have been copied meanwhile, and the copy may have decided the
same record: so the change stays in the file, and the caller is answered
``NOT_SERVING`` ("stood still") instead of with what was decided. Each call that
decides goes through ``Replica.transact(..., decides=True)``; each is pinned here,
by a nap made while its commit is applied: claim, renew, a plain release, a release
with an outcome, ClaimNext's grant and its retry of a lost reply, reopen and
force-release; and the withdrawal of a grant whose waiter left. (Issue 33: a mutation
run turned ``decides=True`` off on six of these paths and no test noticed.)

Each test runs a two-region in-process cluster at the real nap threshold (a node
without peers has no one to settle with, and never takes a stall for a nap).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fencemark.client import AsyncClient
from fencemark.client.errors import Unavailable
from fencemark.node.api.server import NodeServer
from fencemark.node.replication.tuning import Tuning
from fencemark.node.rules.admission import ANYONE
from fencemark.node.rules.errors import NotServing
from tests.cluster import Cluster, all_deciding

REPO, TOPIC = "naps", "backlog"
LEASE_S = 30.0


@dataclass
class Home:
    node: NodeServer
    client: AsyncClient  # retries nothing: the refusal itself is what is asserted

    async def item(self, id_: str) -> str:
        made = await self.client.remember(REPO, TOPIC, id_, title=id_, tags=["homeRegion:us"])
        return made.record.key

    async def claimed(self, id_: str) -> tuple[str, int]:
        key = await self.item(id_)
        claim = await self.client.claim(key, "worker-a", lease_seconds=LEASE_S)
        assert claim.granted
        return key, claim.fencing_token

    def nap_while_committing(self, key: str) -> int:
        """The next change of ``key`` stands the process still, once, past ``nap_s``:
        after the change is decided and applied, before it is answered. Returns the
        naps counted so far: a loaded machine may have stalled the process already."""
        gate = self.node.replica.gate
        naps = gate.naps

        def nap(changed: str) -> None:
            if changed == key and gate.naps == naps:
                time.sleep(gate.nap_s * 1.5)

        self.node.replica.on_change(nap)
        return naps


@pytest.fixture
async def home(tmp_path: Path) -> AsyncIterator[Home]:
    async with Cluster(tmp_path, ["us", "eu"], nap_s=Tuning().nap_s) as cluster:
        us, eu = await cluster.start_all()
        await all_deciding(us, eu)
        async with AsyncClient(us.address, retries=0) as client:
            yield Home(us, client)


Decision = Callable[[Home], Awaitable[tuple[str, Callable[[], Awaitable[object]]]]]


async def claim(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key = await home.item("claim")
    return key, lambda: home.client.claim(key, "worker-a", lease_seconds=LEASE_S)


async def renew(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key, token = await home.claimed("renew")
    return key, lambda: home.client.renew_claim(key, token, lease_seconds=LEASE_S)


async def release(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key, token = await home.claimed("release")
    return key, lambda: home.client.release_claim(key, token)


async def release_done(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key, token = await home.claimed("release-done")
    return key, lambda: home.client.release_claim(
        key, token, outcome="done", fields={"result": "merged"}
    )


async def claim_next(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key = await home.item("next")
    return key, lambda: home.client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LEASE_S)


async def claim_next_retry(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key = await home.item("next-retry")
    first = await home.client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LEASE_S)
    assert first.granted and first.record is not None and first.record.key == key
    # The same owner asks again, as after a lost reply: its own item, extended.
    return key, lambda: home.client.claim_next(REPO, TOPIC, "worker-a", lease_seconds=LEASE_S)


async def reopen(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key = await home.item("reopen")
    return key, lambda: home.client.reopen(key, "an operator looked at it")


async def force_release(home: Home) -> tuple[str, Callable[[], Awaitable[object]]]:
    key, _ = await home.claimed("force-release")
    return key, lambda: home.client.force_release(key, "the worker is gone")


@pytest.mark.parametrize(
    "decision",
    [claim, renew, release, release_done, claim_next, claim_next_retry, reopen, force_release],
    ids=lambda decision: decision.__name__,
)
async def test_a_decision_a_nap_interrupts_is_refused_and_stays_in_the_file(
    home: Home, decision: Decision
) -> None:
    key, call = await decision(home)
    before = await home.node.storage.get(key)
    assert before is not None
    naps = home.nap_while_committing(key)
    with pytest.raises(Unavailable, match="stood still"):
        await call()
    assert home.node.replica.gate.naps > naps
    after = await home.node.storage.get(key)
    assert after is not None and after.digest != before.digest, "decided and kept, not answered"


async def test_a_withdrawal_a_nap_interrupts_is_refused_and_stays_in_the_file(home: Home) -> None:
    """The grant made for a waiter that left is withdrawn in-process, by the node
    itself (``Claims.withdraw``, no call of its own): a nap while that is committed
    refuses it as well, the withdrawal kept."""
    key, token = await home.claimed("withdraw")
    before = await home.node.storage.get(key)
    assert before is not None
    naps = home.nap_while_committing(key)
    with pytest.raises(NotServing, match="stood still"):
        await home.node.claims.withdraw(key, token, caller=ANYONE)
    assert home.node.replica.gate.naps > naps
    after = await home.node.storage.get(key)
    assert after is not None and after.record.fence.ended(token), "withdrawn and kept"
