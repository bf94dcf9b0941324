"""The three work queues the ``drain`` scenario drains, one recipe per system.

Every system gets the same backlog (M typical items, ``records.py``) and the same
work per item: take the next item under a lease with a fencing token, write one
field under the token (``progress``), finish it as ``done`` with a ``result``
field, atomically with releasing it. ``backlog(agents, tag, items)`` seeds the
backlog outside any timing and yields one ``Take`` per agent, each on its own
connection; a ``Take`` processes one item and returns its id and how long each
call took, or None once the queue has nothing left to hand out.

- **Fencemark**: ``ClaimNext(repo, topic, owner, lease)`` → fenced ``Update`` →
  ``ReleaseClaim(outcome="done", fields)``: three calls, the pick done by the node
  (SPEC §8). The backlog is M ``Remember`` calls, 64 at a time.
- **etcd**, the ``concurrency`` package's recipe applied to the lowest unlocked key
  under a prefix, through ``aetcd`` (and its generated protocol stubs where the
  high-level client has no range limit). Items are ``<base>/queue/<id>`` (ids
  sort in creation order, so key order is FIFO); the lock of an item is
  ``<base>/lock/<id>``, put with the agent's session lease (a dead agent's locks
  vanish with its lease); the lock key's create revision is the fencing token.
  To take an item an agent reads, in one read-only transaction (one revision,
  no log write), the first 64 queue keys (keys only) and every lock key, and
  tries the unlocked ones lowest first with a transaction *if the lock's create
  revision is 0 and the item still exists, put the lock with the lease and read
  the item* (a lost race is a failed compare: next candidate; a page of lost
  races: read again). Agent *i* starts its tries at the *i*-th unlocked key
  (modulo how many it saw) and goes round: agents that read the same page do
  not all race for one key — each lost race is a transaction through the raft
  log — and items are still handed out oldest first to within the number of
  agents. (Strictly lowest first, every agent racing for the same key, drained
  200 items at 64 agents at under a third of one agent's rate.) The
  item-exists compare is what stops an agent that read the queue before another
  finished the item from locking a done item. The
  fenced update is *if the lock's create revision is the token, put the item
  with its new field*; done is *if the lock's create revision is the token, put
  ``<base>/done/<id>`` (the item with outcome and result), delete the item and
  delete the lock*, one transaction, so a finished item is never listed again.
  Nothing unlocked in the queue is ``empty`` (as ``ClaimNext``, which does not
  hand out claimed items either). Four calls per item, the list a cheap read.
- **Redis** (durable: ``appendfsync always``), the reliable-queue pattern through
  redis-py's asyncio client: item ids in the list ``<base>:queue``, fields in the
  hash ``<base>:item:<id>``. Taking is one Lua script: ``LMOVE`` the head of the
  queue to the tail of ``<base>:processing``, ``SET NX PX`` the item's lock
  to the owner, ``INCR`` the item's fence (the token), return id, token and the
  item's fields — one round trip, no moment when an item is in ``processing``
  unlocked. (The script names the item's keys from the id it popped: fine on one
  server, not on Redis Cluster.) The fenced update is a script checking lock
  owner and token before ``HSET``; done is a script checking them, then ``HSET``
  of status, outcome and result, ``LREM`` from ``processing`` and ``DEL`` of the
  lock. An empty queue makes ``LMOVE`` answer nil: ``empty``. The reaper that a
  reliable queue runs beside (moving items whose lock lapsed back to the queue)
  has nothing to do in a drain without failures and is not run. Three calls per
  item.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fencemark.bench.drivers import CycleFailed
from fencemark.bench.load import Calls
from fencemark.bench.records import REPO, record_id, typical_fields, typical_tags
from fencemark.client import AsyncClient

if TYPE_CHECKING:
    from redis.asyncio import Redis

# One agent's next item: (item id, seconds per call), None when nothing is left.
Take = Callable[[], Awaitable[tuple[str, Calls] | None]]
# Told of each grant as it is answered: (item id, fencing token). The ``failover``
# scenario's ledger of tokens; the recipes do the same with or without one.
Granted = Callable[[str, int], None]
LEASE_SECONDS = 60
SEED_CONCURRENCY = 64
PROGRESS, RESULT = {"progress": "step 1 of 1"}, {"result": "ok"}
EMPTY = "empty"


def item_id(index: int) -> str:
    return record_id("d", index)


# -- Fencemark ------------------------------------------------------------------------


async def _seed_fencemark(address: str, topic: str, items: int, home: str) -> None:
    clients = [AsyncClient(address, retries=0) for _ in range(SEED_CONCURRENCY // 8)]
    try:
        indexes = iter(range(items))

        async def seeder(client: AsyncClient) -> None:
            for index in indexes:  # shared: each index taken once, in order
                fields = typical_fields(index)
                await client.remember(REPO, topic, item_id(index), tags=typical_tags(home),
                                      fields=fields)  # fmt: skip

        await asyncio.gather(*(seeder(clients[i % len(clients)]) for i in range(SEED_CONCURRENCY)))
    finally:
        for client in clients:
            await client.close()


@contextlib.asynccontextmanager
async def fencemark_backlog(
    address: str, agents: int, tag: str, items: int, *, region: str = "local"
) -> AsyncIterator[list[Take]]:
    topic = f"drain-{tag}"
    await _seed_fencemark(address, topic, items, region)
    clients = [AsyncClient(address, retries=0) for _ in range(agents)]
    try:
        yield [_fencemark_take(client, topic, f"agent-{i}") for i, client in enumerate(clients)]
    finally:
        for client in clients:
            await client.close()


def _fencemark_take(client: AsyncClient, topic: str, owner: str) -> Take:
    async def take() -> tuple[str, Calls] | None:
        calls = Calls()
        picked = await calls.time(
            "claim", client.claim_next(REPO, topic, owner, lease_seconds=LEASE_SECONDS)
        )
        if not picked.granted:
            if picked.reason == EMPTY:
                return None
            raise CycleFailed(f"ClaimNext refused {owner}: {picked.reason}")
        assert picked.record is not None  # granted: the item comes with it
        key, token = picked.record.key, picked.fencing_token
        await calls.time("update", client.update(key, fields=PROGRESS, fencing_token=token))
        done = await calls.time(
            "done", client.release_claim(key, token, outcome="done", fields=RESULT)
        )
        if not done.released:
            raise CycleFailed(f"release of {key} as done: {done.reason}")
        return key, calls

    return take


# -- etcd -------------------------------------------------------------------------------

ETCD_PAGE = 64  # queue keys read at a time
ETCD_ROUNDS = 1000  # reads of the queue one take may make before it gives up
ETCD_SEED_BATCH = 128  # puts per seeding transaction (etcd's --max-txn-ops default)


def _item_value(index: int) -> bytes:
    return json.dumps({**typical_fields(index), "tags": typical_tags("local")}).encode()


@contextlib.asynccontextmanager
async def etcd_backlog(port: int, agents: int, tag: str, items: int) -> AsyncIterator[list[Take]]:
    import aetcd

    base = f"/drain/{tag}"
    clients = [aetcd.Client(host="127.0.0.1", port=port, timeout=10) for _ in range(agents)]
    try:
        seeder = clients[0]
        await seeder.connect()
        tx = seeder.transactions
        for start in range(0, items, ETCD_SEED_BATCH):
            puts = [tx.put(f"{base}/queue/{item_id(i)}".encode(), _item_value(i))
                    for i in range(start, min(items, start + ETCD_SEED_BATCH))]  # fmt: skip
            await seeder.transaction(compare=[], success=puts, failure=[])
        takes = []
        for index, client in enumerate(clients):
            await client.connect()
            session = await client.lease(LEASE_SECONDS * 5)  # one session lease per agent
            takes.append(_etcd_take(client, session, base, f"agent-{index}", index))
        yield takes
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()


def _etcd_take(
    etcd: Any, session: Any, base: str, owner: str, spread: int, granted: Granted | None = None
) -> Take:
    """One agent's take of the etcd recipe (module docstring). About 90 lines on
    purpose: its steps (list, lock, claim, the fenced update and done) are closures over
    one agent's keys, kept together so the recipe reads as one, as a reviewer checks it."""
    from aetcd import rpc
    from aetcd.utils import prefix_range_end

    tx = etcd.transactions
    queue, locks = f"{base}/queue/".encode(), f"{base}/lock/".encode()
    queue_end, locks_end = prefix_range_end(queue), prefix_range_end(locks)

    async def listing(after: bytes) -> tuple[list[bytes], set[bytes]]:
        """The next page of queue keys from ``after`` and every locked id, at one revision."""
        read = rpc.TxnRequest(
            success=[
                rpc.RequestOp(request_range=rpc.RangeRequest(
                    key=after, range_end=queue_end, limit=ETCD_PAGE, keys_only=True)),
                rpc.RequestOp(request_range=rpc.RangeRequest(
                    key=locks, range_end=locks_end, keys_only=True)),
            ]
        )  # fmt: skip
        answer = await etcd.kvstub.Txn(read, timeout=10, metadata=etcd.metadata)
        page, held = answer.responses
        locked = {kv.key[len(locks) :] for kv in held.response_range.kvs}
        return [kv.key for kv in page.response_range.kvs], locked

    async def lock(key: bytes) -> tuple[int, bytes] | None:
        mine = locks + key[len(queue) :]
        won, answers = await etcd.transaction(
            compare=[tx.create(mine) == 0, tx.version(key) > 0],
            success=[tx.put(mine, owner.encode(), lease=session), tx.get(key)],
            failure=[],
        )
        if not won:
            return None
        return answers[0].response_put.header.revision, answers[1][0][0]

    async def claim() -> tuple[bytes, int, bytes] | None:
        for _ in range(ETCD_ROUNDS):
            after, tried = queue, 0
            while True:
                page, locked = await listing(after)
                free = [key for key in page if key[len(queue) :] not in locked]
                start = spread % len(free) if free else 0
                for key in free[start:] + free[:start]:  # lowest first, from my own offset
                    tried += 1
                    got = await lock(key)
                    if got is not None:
                        return key, got[0], got[1]
                if len(page) < ETCD_PAGE:
                    break
                after = page[-1] + b"\0"
            if not tried:
                return None  # nothing unlocked left: empty
        raise CycleFailed(f"etcd: {owner} lost {ETCD_ROUNDS} rounds of races in a row")

    async def take() -> tuple[str, Calls] | None:
        calls = Calls()
        got = await calls.time("claim", claim())
        if got is None:
            return None
        key, token, value = got
        if granted is not None:
            granted(key[len(queue) :].decode(), token)
        mine = locks + key[len(queue) :]
        item = json.loads(value)
        item.update(PROGRESS)
        written, _ = await calls.time(
            "update",
            etcd.transaction(
                compare=[tx.create(mine) == token],
                success=[tx.put(key, json.dumps(item).encode())],
                failure=[],
            ),
        )
        if not written:
            raise CycleFailed(f"etcd fenced update of {key!r}")
        item.update(RESULT, status="done", outcome="done")
        finished, _ = await calls.time(
            "done",
            etcd.transaction(
                compare=[tx.create(mine) == token],
                success=[
                    tx.put(f"{base}/done/".encode() + key[len(queue) :], json.dumps(item).encode()),
                    tx.delete(key),
                    tx.delete(mine),
                ],
                failure=[],
            ),
        )
        if not finished:
            raise CycleFailed(f"etcd done of {key!r}")
        return key.decode(), calls

    return take


# -- Redis ------------------------------------------------------------------------------

TAKE = """
local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
if not id then return false end
local item = ARGV[3] .. ':item:' .. id
if not redis.call('SET', item .. ':lock', ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.error_reply('locked: ' .. id)
end
local token = redis.call('INCR', item .. ':fence')
return {id, token, redis.call('HGETALL', item)}
"""
FENCED_UPDATE = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('HSET', KEYS[3], 'progress', ARGV[3])
  return 1
end
return 0
"""
DONE = """
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('HSET', KEYS[3], 'status', 'done', 'outcome', 'done', 'result', ARGV[4])
  redis.call('LREM', KEYS[4], 1, ARGV[3])
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
REDIS_SEED_BATCH = 500


@contextlib.asynccontextmanager
async def redis_backlog(port: int, agents: int, tag: str, items: int) -> AsyncIterator[list[Take]]:
    from redis.asyncio import Redis

    base = f"drain:{tag}"
    clients = [Redis(host="127.0.0.1", port=port, socket_timeout=10) for _ in range(agents)]
    try:
        await seed_redis(clients[0], base, range(items), "local")
        takes = []
        for index, client in enumerate(clients):
            await client.ping()
            takes.append(_redis_take(client, base, f"agent-{index}"))
        yield takes
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()


async def seed_redis(client: Redis, base: str, indexes: range, home: str) -> None:
    """Items ``indexes`` at the tail of ``base``'s queue, their fields in hashes."""
    for start in range(indexes.start, indexes.stop, REDIS_SEED_BATCH):
        batch = range(start, min(indexes.stop, start + REDIS_SEED_BATCH))
        pipe = client.pipeline(transaction=True)
        for index in batch:
            fields = {**typical_fields(index), "tags": " ".join(typical_tags(home))}
            pairs = [part for pair in fields.items() for part in pair]
            pipe.hset(f"{base}:item:{item_id(index)}", items=pairs)
        pipe.rpush(f"{base}:queue", *(item_id(i) for i in batch))
        await pipe.execute()


def _redis_take(client: Redis, base: str, owner: str, granted: Granted | None = None) -> Take:
    claim = client.register_script(TAKE)
    update = client.register_script(FENCED_UPDATE)
    done = client.register_script(DONE)
    queue, processing = f"{base}:queue", f"{base}:processing"

    async def take() -> tuple[str, Calls] | None:
        calls = Calls()
        got = await calls.time(
            "claim",
            claim(keys=[queue, processing], args=[owner, LEASE_SECONDS * 1000, base]),
        )
        if not got:
            return None
        raw_id, token, _fields = got
        ident = raw_id.decode()
        if granted is not None:
            granted(ident, int(token))
        item = f"{base}:item:{ident}"
        keys = [f"{item}:lock", f"{item}:fence", item]
        written = await calls.time(
            "update", update(keys=keys, args=[owner, token, PROGRESS["progress"]])
        )
        if not written:
            raise CycleFailed(f"redis fenced update of {item}")
        finished = await calls.time(
            "done", done(keys=[*keys, processing], args=[owner, token, ident, RESULT["result"]])
        )
        if not finished:
            raise CycleFailed(f"redis done of {item}")
        return ident, calls

    return take
