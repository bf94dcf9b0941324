"""One load-generator process of ``fencemark bench fleet``: a share of the agents.

``python -m fencemark.bench.fleet_agents SPEC`` (SPEC: the JSON of an
:class:`AgentsSpec`) connects its agents, each an ``AsyncClient`` with a connection
of its own, says ``{"ready": n}`` on stdout and then obeys one command per line on
stdin:

- ``hold``: the holders claim their records and keep them alive (``{"holding": n}``
  once every one holds);
- ``work`` / ``rest``: the working agents start or stop their paced cycle;
- ``report``: one JSON line of what the agents saw since the last report;
- ``stop``: close every agent and exit.

Several such processes share a fleet when one process cannot hold it (the file
descriptors and the event loop of 10,000 agents). Times are ``time.monotonic()``,
which is one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from fencemark.client import AsyncClient, FencemarkError, RenewResult
from fencemark.client.keepalive import holding


@dataclass(frozen=True)
class AgentsSpec:
    """What one generator process runs."""

    target: str
    regions: dict[str, str] | None
    repo: str
    first: int  # index of its first agent in the fleet (owners and record ids)
    waiters: int  # ClaimNext with a wait, in ``idle_topic``
    mcp_waiters: int  # the MCP server's repocontext_wait_for_work, in ``idle_topic``
    holders: int  # a claim each, kept alive by the client's keepalive
    workers: int  # claim next -> fenced update -> release done, in ``work_topic``
    idle_topic: str
    held_topic: str
    work_topic: str
    wait_s: float  # a waiter's wait; its first is spread over [2/3, 1] of it
    lease_s: float  # the holders' lease: a renewal every third of it
    pace_s: float  # a working agent's pause between items


@dataclass
class Seen:
    """What the agents saw: a process's since its last report, or every process's
    reports merged (in ``fencemark.bench.fleet``)."""

    woken: list[float] = field(default_factory=list)  # a waiter answered before its wait ran out
    timeouts: int = 0  # waits that ran out
    granted: list[tuple[float, str]] = field(default_factory=list)  # (time, key) to a waiter
    renewals: list[float] = field(default_factory=list)  # seconds each
    lapsed: list[str] = field(default_factory=list)  # renewals refused: lease ran out
    work_claims: list[float] = field(default_factory=list)  # seconds each
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, report: dict[str, Any]) -> None:
        """Another report of :meth:`take` (of another process), merged into this one."""
        self.woken += report["woken"]
        self.timeouts += report["timeouts"]
        self.granted += [(t, k) for t, k in report["granted"]]
        self.renewals += report["renewals"]
        self.lapsed += report["lapsed"]
        self.work_claims += report["work_claims"]
        self.errors.update(report["errors"])

    def take(self) -> dict[str, Any]:
        taken = asdict(self)
        taken["errors"] = dict(self.errors)
        for name in ("woken", "granted", "renewals", "lapsed", "work_claims"):
            getattr(self, name).clear()
        self.errors.clear()
        self.timeouts = 0
        return taken


@dataclass
class Timed:
    """The client as the keepalive sees it, timing each renewal."""

    client: AsyncClient
    seen: Seen

    async def renew_claim(
        self, key: str, fencing_token: int, *, lease_seconds: float = 0.0
    ) -> RenewResult:
        began = time.perf_counter()
        result = await self.client.renew_claim(key, fencing_token, lease_seconds=lease_seconds)
        self.seen.renewals.append(time.perf_counter() - began)
        if not result.renewed and result.reason == "expired":
            self.seen.lapsed.append(key)
        return result


class Agents:
    def __init__(self, spec: AgentsSpec) -> None:
        self.spec = spec
        self.seen = Seen()
        self.working = asyncio.Event()
        self.hold = asyncio.Event()  # the holders claim once it is set
        self.holding = 0
        self.all_holding = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.clients: list[AsyncClient] = []

    def client(self) -> AsyncClient:
        made = AsyncClient(self.spec.target, regions=self.spec.regions, retries=0,
                           timeout=self.spec.wait_s + 30, own_connection=True)  # fmt: skip
        self.clients.append(made)
        return made

    async def _guarded(self, kind: str, loop: Any) -> None:
        """Run an agent's loop; an error is counted, and the agent goes on after a pause."""
        while True:
            try:
                await loop()
                return
            except FencemarkError as error:
                self.seen.errors[f"{kind}: {error.code.name}: {str(error)[:60]}"] += 1
                await asyncio.sleep(1.0)

    def _wait(self, first: bool) -> float:
        wait = self.spec.wait_s
        return random.uniform(wait * 2 / 3, wait) if first else wait

    def _answered(self, began: float, wait: float, granted: bool) -> None:
        """A wait that ended: woken (granted, or answered before it ran out) or out."""
        now = time.monotonic()
        if granted or now - began < wait - 0.5:
            self.seen.woken.append(now)
        else:
            self.seen.timeouts += 1

    async def waiter(self, client: AsyncClient, index: int) -> None:
        spec, first, owner = self.spec, True, f"waiter-{index}"
        while True:
            wait, first, began = self._wait(first), False, time.monotonic()
            result = await client.claim_next(spec.repo, spec.idle_topic, owner,
                                             wait_seconds=wait, lease_seconds=60)  # fmt: skip
            self._answered(began, wait, result.granted)
            if result.granted and result.record is not None:
                self.seen.granted.append((time.monotonic(), result.record.key))
                await client.release_claim(result.record.key, result.fencing_token, outcome="done")

    async def mcp_waiter(self, client: AsyncClient, index: int) -> None:
        from mcp import Client

        from fencemark.mcp import create_server

        spec, first, owner = self.spec, True, f"mcp-{index}"
        server = create_server(client, writes_enabled=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the in-memory transport's legacy mode
            async with Client(server, mode="legacy") as session:
                while True:
                    wait, first, began = self._wait(first), False, time.monotonic()
                    called = await session.call_tool("repocontext_wait_for_work", {
                        "repoId": spec.repo, "topic": spec.idle_topic, "owner": owner,
                        "leaseSeconds": 60, "timeoutSeconds": wait,
                    })  # fmt: skip
                    out = called.structured_content or {}
                    self._answered(began, wait, bool(out.get("granted")))
                    if called.is_error:
                        self.seen.errors["mcp:" + str(out.get("reason", "error"))] += 1
                        await asyncio.sleep(1.0)
                    elif out.get("granted"):
                        key = out["record"]["key"]
                        self.seen.granted.append((time.monotonic(), key))
                        token = int(out["fencingToken"])
                        await client.release_claim(key, token, outcome="done")

    async def holder(self, client: AsyncClient, index: int) -> None:
        spec = self.spec
        await self.hold.wait()
        made = await client.remember(spec.repo, spec.held_topic, f"held-{index:06d}")
        claim = await client.claim(made.record.key, f"holder-{index}", lease_seconds=spec.lease_s)
        async with holding(Timed(client, self.seen), made.record.key, claim.fencing_token,
                           spec.lease_s):  # fmt: skip
            self.holding += 1
            if self.holding == spec.holders:
                self.all_holding.set()
            await asyncio.Event().wait()  # holds until cancelled

    async def worker(self, client: AsyncClient, index: int) -> None:
        spec, owner = self.spec, f"worker-{index}"
        await self.working.wait()
        await asyncio.sleep(random.uniform(0, spec.pace_s))  # a steady pace, not a burst
        while True:
            await self.working.wait()
            began = time.perf_counter()
            picked = await client.claim_next(spec.repo, spec.work_topic, owner, lease_seconds=30)
            self.seen.work_claims.append(time.perf_counter() - began)
            if picked.granted and picked.record is not None:
                key, token = picked.record.key, picked.fencing_token
                await client.update(key, fields={"progress": "done"}, fencing_token=token)
                await client.release_claim(key, token, outcome="done", fields={"result": "ok"})
            await asyncio.sleep(spec.pace_s)

    async def connect(self) -> None:
        spec = self.spec
        index = spec.first
        plan = [
            ("waiter", spec.waiters, self.waiter),
            ("mcp", spec.mcp_waiters, self.mcp_waiter),
            ("holder", spec.holders, self.holder),
            ("worker", spec.workers, self.worker),
        ]
        for kind, count, agent in plan:
            for _ in range(count):
                client = self.client()
                await client.info()  # its connection is open before the next one
                loop = functools.partial(agent, client, index)
                self.tasks.append(asyncio.create_task(self._guarded(kind, loop)))
                index += 1
                if len(self.clients) % 500 == 0:
                    say({"connected": len(self.clients)})

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main(spec: AgentsSpec) -> None:
    agents = Agents(spec)
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    try:
        await agents.connect()
        say({"ready": len(agents.clients)})
        while line := (await commands.readline()).decode().strip():
            if line == "hold":
                agents.hold.set()
                if spec.holders:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(120):
                            await agents.all_holding.wait()
                say({"holding": agents.holding})
            elif line == "work":
                agents.working.set()
                say({"ok": line})
            elif line == "rest":
                agents.working.clear()
                say({"ok": line})
            elif line == "report":
                say(agents.seen.take())
            elif line == "stop":
                break
    finally:
        with contextlib.suppress(Exception):
            await agents.close()


if __name__ == "__main__":
    asyncio.run(main(AgentsSpec(**json.loads(sys.argv[1]))))
