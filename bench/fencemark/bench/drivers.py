"""The clients the claim-cycle and write scenarios run, one per system.

Each driver is an async context manager yielding one ``Operation`` per client;
each client has its own connection and its own records (``records_per_client``
of them, used in turn), so clients never contend and only the system is
measured. A cycle is three calls everywhere:

- **Fencemark**: ``Claim`` → fenced ``Update`` → ``ReleaseClaim``.
- **etcd**, the way its ``concurrency`` package does it, through ``aetcd``: one
  session lease per client; the lock is the key ``prefix/<lease>`` created in a
  transaction (if its create revision is 0, put it with the lease and read the
  prefix to see who is first), and its create revision is the fencing token; the
  fenced write and the release are transactions comparing that create revision.
- **Redis** (durable: ``appendfsync always``), through redis-py's asyncio client:
  Lua scripts run atomically — acquire is ``SET NX PX`` then ``INCR`` of the
  record's fence; the fenced write and the release check lock owner and token.

``health`` is the bare gRPC baseline: the standard health check on the same
node, through the same client library.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fencemark.bench.load import Calls, Operation
from fencemark.bench.records import REPO, record_id, typical_tags
from fencemark.client import AsyncClient

if TYPE_CHECKING:
    from redis.asyncio import Redis

LEASE_SECONDS = 60
BODY_UPDATE = "progress: step {i}"


class CycleFailed(AssertionError):
    """A call that must succeed in an uncontended cycle did not: the run is wrong."""


def _expect(ok: object, what: str) -> None:
    if not ok:
        raise CycleFailed(what)


# -- Fencemark ------------------------------------------------------------------------


async def _seed(client: AsyncClient, topic: str, count: int, home: str) -> list[str]:
    keys = []
    for index in range(count):
        made = await client.remember(
            REPO,
            topic,
            record_id("r", index),
            kind="Note",
            author="bench",
            title=f"claim-cycle record {index}",
            tags=typical_tags(home),
        )
        keys.append(made.record.key)
    return keys


@contextlib.asynccontextmanager
async def region_clients(addresses: Mapping[str, str]) -> AsyncIterator[dict[str, AsyncClient]]:
    """One client per region (``region -> address``), without retries: a measurement
    counts what failed rather than hide it behind a retry."""
    async with contextlib.AsyncExitStack() as stack:
        yield {
            region: await stack.enter_async_context(AsyncClient(address, retries=0))
            for region, address in addresses.items()
        }


@contextlib.asynccontextmanager
async def fencemark_clients(
    address: str, count: int, tag: str, records_per_client: int, *, region: str = "local"
) -> AsyncIterator[list[tuple[AsyncClient, list[str]]]]:
    """``count`` clients of the node at ``address``, each with its own fresh records."""
    clients = [AsyncClient(address, retries=0) for _ in range(count)]
    try:
        seeded = await asyncio.gather(
            *(
                _seed(client, f"{tag}-c{index}", records_per_client, region)
                for index, client in enumerate(clients)
            )
        )
        yield list(zip(clients, seeded, strict=True))
    finally:
        for client in clients:
            await client.close()


def fencemark_claim_cycle(client: AsyncClient, keys: list[str], owner: str) -> Operation:
    async def cycle(i: int) -> dict[str, float]:
        key = keys[i % len(keys)]
        calls = Calls()
        claim = await calls.time("claim", client.claim(key, owner, lease_seconds=LEASE_SECONDS))
        _expect(claim.granted, f"claim of {key}: {claim.reason}")
        token = claim.fencing_token
        body = BODY_UPDATE.format(i=i)
        await calls.time("write", client.update(key, fields={"body": body}, fencing_token=token))
        released = await calls.time("release", client.release_claim(key, token))
        _expect(released.released, f"release of {key}")
        return calls

    return cycle


def fencemark_update(client: AsyncClient, keys: list[str]) -> Operation:
    async def update(i: int) -> dict[str, float]:
        calls = Calls()
        body = BODY_UPDATE.format(i=i)
        await calls.time("update", client.update(keys[i % len(keys)], fields={"body": body}))
        return calls

    return update


def fencemark_remember(client: AsyncClient, topic: str, region: str, ids: int) -> Operation:
    """``remember`` of existing ids (merged in place, as an agent re-saving its notes)."""

    async def remember(i: int) -> dict[str, float]:
        calls = Calls()
        await calls.time(
            "remember",
            client.remember(
                REPO,
                topic,
                record_id("r", i % ids),
                body=BODY_UPDATE.format(i=i),
                tags=typical_tags(region),
            ),
        )
        return calls

    return remember


def health_check(client: AsyncClient) -> Operation:
    async def check(_: int) -> dict[str, float]:
        calls = Calls()
        status = await calls.time("health", client.health())
        _expect(status == "SERVING", f"health: {status}")
        return calls

    return check


# -- etcd -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def etcd_claim_cycles(
    port: int, count: int, tag: str, records_per_client: int
) -> AsyncIterator[list[Operation]]:
    import aetcd
    from aetcd.utils import prefix_range_end

    clients = [aetcd.Client(host="127.0.0.1", port=port, timeout=10) for _ in range(count)]
    try:
        operations = []
        for index, client in enumerate(clients):
            await client.connect()
            session = await client.lease(LEASE_SECONDS * 5)  # one session lease per client
            operations.append(
                _etcd_cycle(client, session, f"/bench/{tag}/c{index}", records_per_client,
                            prefix_range_end)
            )  # fmt: skip
        yield operations
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()


def _etcd_cycle(
    etcd: Any, session: Any, base: str, records: int, range_end: Callable[[bytes], bytes]
) -> Operation:
    tx = etcd.transactions
    lease_id = session.id

    async def cycle(i: int) -> dict[str, float]:
        record = i % records
        prefix = f"{base}/lock/{record}/".encode()
        mine = prefix + f"{lease_id:x}".encode()
        data = f"{base}/data/{record}".encode()
        calls = Calls()
        # Mutex.Lock: create my key under the lock prefix if it is not there yet,
        # and read the prefix to see whose key is the oldest.
        created, responses = await calls.time(
            "claim",
            etcd.transaction(
                compare=[tx.create(mine) == 0],
                success=[tx.put(mine, b"", lease=session), tx.get(prefix, range_end(prefix))],
                failure=[tx.get(mine)],
            ),
        )
        _expect(created, f"etcd lock {mine!r} was already held")
        token = responses[0].response_put.header.revision  # my key's create revision
        oldest = min(kv.create_revision for _, kv in responses[1])
        _expect(oldest == token, f"etcd lock {prefix!r} is held by an older key")
        written, _ = await calls.time(
            "write",
            etcd.transaction(
                compare=[tx.create(mine) == token],
                success=[tx.put(data, BODY_UPDATE.format(i=i).encode())],
                failure=[],
            ),
        )
        _expect(written, f"etcd fenced write to {data!r}")
        released, _ = await calls.time(
            "release",
            etcd.transaction(
                compare=[tx.create(mine) == token], success=[tx.delete(mine)], failure=[]
            ),
        )
        _expect(released, f"etcd release of {mine!r}")
        return calls

    return cycle


# -- Redis ------------------------------------------------------------------------------

ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""
FENCED_WRITE = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('HSET', KEYS[3], 'body', ARGV[3])
  return 1
end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@contextlib.asynccontextmanager
async def redis_claim_cycles(
    port: int, count: int, tag: str, records_per_client: int
) -> AsyncIterator[list[Operation]]:
    from redis.asyncio import Redis

    clients = [Redis(host="127.0.0.1", port=port, socket_timeout=10) for _ in range(count)]
    try:
        operations = []
        for index, client in enumerate(clients):
            await client.ping()
            operations.append(
                _redis_cycle(client, f"bench:{tag}:c{index}", f"owner-{index}", records_per_client)
            )
        yield operations
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()


def _redis_cycle(client: Redis, base: str, owner: str, records: int) -> Operation:
    acquire = client.register_script(ACQUIRE)
    fenced_write = client.register_script(FENCED_WRITE)
    release = client.register_script(RELEASE)

    async def cycle(i: int) -> dict[str, float]:
        record = i % records
        lock, fence, data = f"{base}:lock:{record}", f"{base}:fence:{record}", f"{base}:{record}"
        calls = Calls()
        token = await calls.time(
            "claim", acquire(keys=[lock, fence], args=[owner, LEASE_SECONDS * 1000])
        )
        _expect(token, f"redis lock {lock} was already held")
        written = await calls.time(
            "write",
            fenced_write(keys=[lock, fence, data], args=[owner, token, BODY_UPDATE.format(i=i)]),
        )
        _expect(written, f"redis fenced write to {data}")
        released = await calls.time("release", release(keys=[lock, fence], args=[owner, token]))
        _expect(released, f"redis release of {lock}")
        return calls

    return cycle
