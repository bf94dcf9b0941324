"""SPEC §6: bad input gets INVALID_ARGUMENT naming the offending field; nothing is half-applied.

One table of bad requests, each sent over real gRPC to a real node. Every row is
otherwise a write that *would* change something if the bad part were ignored:
fenced writes present the live claim's token, claims come from the holder (an
idempotent retry would extend the lease), and the good parts of a request
(a fine field beside the bad one) would be written. After each refusal the
record, the listing, the claim status and the node's record count must be
exactly what they were before.

The client's own checks are Python types only ("unknown field types"): a value
of the wrong type raises ``TypeError`` naming the argument before anything is
sent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import pytest
import pytest_asyncio

from fencemark.client import (
    AsyncClient,
    ClaimStatus,
    Client,
    InvalidArgument,
    NotFound,
    Record,
)
from fencemark.node.api.server import NodeConfig, NodeServer
from fencemark.node.crdt import Grant, Stamp, codec
from fencemark.node.crdt import Record as NodeRecord
from fencemark.node.crdt.hlc import pack
from fencemark.node.crdt.record import ATTEMPTS, ENDINGS, NOT_BEFORE, OUTCOME, STATUS, STATUSES
from fencemark.node.rules import validation
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.rules.queue import MAX_AFTER_TAGS, MAX_ATTEMPTS_LIMIT

REPO, TOPIC = "lattice", "backlog"
HOLDER = "worker-a"
MIB = 1 << 20


def key_of(id_: str, *, repo: str = REPO, topic: str = TOPIC) -> str:
    return f"repo/{repo}/mem/{topic}/{id_}"


TARGET = key_of("issue-2101")
NEW_ID = "never-created"


@dataclass(frozen=True)
class Claimed:
    """The record every row aims at, with the token of its live claim (held by HOLDER)."""

    key: str
    token: int


Call = Callable[[Any, Claimed], Awaitable[object]]


@dataclass(frozen=True)
class Shared:
    client: AsyncClient
    target: Claimed


@dataclass(frozen=True)
class Snapshot:
    record: Record
    listing: list[Record]
    status: ClaimStatus
    record_count: int


async def snapshot(client: AsyncClient, target: Claimed) -> Snapshot:
    return Snapshot(
        record=await client.get(target.key),
        listing=[r async for r in client.iter_records(REPO, include_deleted=True)],
        status=await client.claim_status(target.key),
        record_count=(await client.info()).record_count,
    )


async def prepare(client: AsyncClient) -> Claimed:
    made = await client.remember(
        REPO,
        TOPIC,
        "issue-2101",
        kind="Note",
        author="backlog-pm",
        title="Batch WAL fsyncs",
        body="original",
        tags=["backlog", "priority:P1"],
        fields={"phase": "implementation"},
    )
    await client.remember(REPO, "other", "issue-1", title="a neighbour in the listing")
    await client.delete((await client.remember(REPO, TOPIC, "gone", title="x")).record.key)
    claim = await client.claim(made.record.key, HOLDER, lease_seconds=600)
    assert claim.granted
    return Claimed(made.record.key, claim.fencing_token)


@pytest.fixture
async def target(client: AsyncClient) -> Claimed:
    """The claimed record on this test's own node."""
    return await prepare(client)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Shared]:
    """One node for the whole table: every row leaves it as it found it (and checks so)."""
    config = NodeConfig(
        region="local",
        listen="127.0.0.1:0",
        data_dir=tmp_path_factory.mktemp("bad-input"),
        enable_writes=True,
        grace_seconds=0.5,
    )
    node = await NodeServer.start(config)
    try:
        async with AsyncClient(node.address) as client:
            yield Shared(client, await prepare(client))
    finally:
        await node.stop()


def names(field: str, wanted: tuple[str, ...]) -> bool:
    """``field`` is one of ``wanted`` or a path inside one (``tags[3]``, ``fields['x']``)."""
    return any(field == w or field.startswith((f"{w}[", f"{w}.")) for w in wanted)


# -- the table --------------------------------------------------------------------------

BAD_KEYS = {
    "no-mem-segment": "repo/lattice/backlog/issue-2101",
    "no-repo-prefix": "lattice/mem/backlog/issue-2101",
    "extra-segment": "repo/lattice/mem/backlog/issue-2101/more",
    "trailing-slash": "repo/lattice/mem/backlog/issue-2101/",
    "empty-key": "",
    "space": "repo/lattice/mem/backlog/issue 2101",
    "hash": "repo/lattice/mem/backlog/issue#2101",
    "non-ascii": "repo/lattice/mem/backlog/issüe-2101",
    "trailing-newline": "repo/lattice/mem/backlog/issue-2101\n",
    "id-129-chars": key_of("i" * 129),
    "repo-129-chars": key_of("issue-2101", repo="r" * 129),
    "empty-repo": "repo//mem/backlog/issue-2101",
    "empty-id": "repo/lattice/mem/backlog/",
}

KEY_OPS: dict[str, Callable[[str], Call]] = {
    "get": lambda k: lambda c, t: c.get(k),
    "update": lambda k: lambda c, t: c.update(k, fields={"body": "x"}, fencing_token=t.token),
    "delete": lambda k: lambda c, t: c.delete(k, fencing_token=t.token),
    "claim": lambda k: lambda c, t: c.claim(k, HOLDER, lease_seconds=600),
    "claim_status": lambda k: lambda c, t: c.claim_status(k),
    "renew_claim": lambda k: lambda c, t: c.renew_claim(k, t.token, lease_seconds=3600),
    "release_claim": lambda k: lambda c, t: c.release_claim(k, t.token),
}


def row(id_: str, wanted: str | tuple[str, ...], call: Call) -> Any:
    return pytest.param(call, (wanted,) if isinstance(wanted, str) else wanted, id=id_)


def fields_of(n: int, value: str = "v") -> dict[str, str]:
    return {f"f{i:03d}": value for i in range(n)}


def tags_of(n: int) -> list[str]:
    return [f"t{i:03d}" for i in range(n)]


def remember(**kwargs: Any) -> Call:
    """Remember into a new id with good content, overridden by ``kwargs``."""
    args: dict[str, Any] = {"repo": REPO, "topic": TOPIC, "id": NEW_ID, "title": "good"}
    args.update(kwargs)
    return lambda c, t: c.remember(**args)


def remember_target(**kwargs: Any) -> Call:
    """Remember into the claimed record, fenced, with good content beside ``kwargs``."""
    return lambda c, t: c.remember(
        REPO, TOPIC, "issue-2101", **{"body": "changed", "fencing_token": t.token, **kwargs}
    )


def update(**kwargs: Any) -> Call:
    """A fenced update of the claimed record with ``kwargs`` (and a good field)."""
    fields = {"body": "changed", **kwargs.pop("fields", {})}
    return lambda c, t: c.update(t.key, fields=fields, fencing_token=t.token, **kwargs)


def claim(**kwargs: Any) -> Call:
    args: dict[str, Any] = {"owner": HOLDER, "lease_seconds": 600.0}
    args.update(kwargs)
    return lambda c, t: c.claim(t.key, **args)


def renew(lease_seconds: float) -> Call:
    return lambda c, t: c.renew_claim(t.key, t.token, lease_seconds=lease_seconds)


def listing(**kwargs: Any) -> Call:
    args: dict[str, Any] = {"repo": REPO}
    args.update(kwargs)
    return lambda c, t: c.list(**args)


BAD_INPUT = [
    *(
        row(f"{op}-{name}", "key", make(bad))
        for op, make in KEY_OPS.items()
        for name, bad in BAD_KEYS.items()
    ),
    # remember: the key segments
    *(
        row(f"remember-{seg}-{name}", seg, remember(**{seg: bad}))
        for seg in ("repo", "topic", "id")
        for name, bad in {
            "empty": "",
            "space": "a b",
            "slash": "a/b",
            "129-chars": "s" * 129,
            "non-ascii": "ü",
        }.items()
    ),
    # field values: at most 1 MiB of UTF-8
    row("update-value-1MiB+1", "fields", update(fields={"blob": "x" * (MIB + 1)})),
    row(
        "update-value-1MiB+1-multibyte",
        "fields",
        update(fields={"blob": "é" * (MIB // 2) + "x"}),
    ),
    row("remember-value-1MiB+1", "fields", remember(fields={"blob": "x" * (MIB + 1)})),
    row("remember-body-1MiB+1", "body", remember_target(body="x" * (MIB + 1))),
    row("remember-title-1MiB+1", "title", remember_target(title="x" * (MIB + 1))),
    # field count: at most 256 per record
    row("update-257-fields", "fields", update(fields=fields_of(257))),
    row("remember-257-fields", "fields", remember(fields=fields_of(257))),
    row("remember-257-fields-on-existing", "fields", remember_target(fields=fields_of(257))),
    # field names
    *(
        row(f"update-field-name-{name}", "fields", update(fields={bad: "v"}))
        for name, bad in {
            "empty": "",
            "space": "bad name",
            "slash": "a/b",
            "non-ascii": "naïve",
            "129-chars": "n" * 129,
        }.items()
    ),
    row("remember-field-name-space", "fields", remember(fields={"bad name": "v"})),
    row(
        "remember-field-conflicts-with-body",
        ("fields", "body"),
        remember_target(body="one", fields={"body": "two"}),
    ),
    # the whole record: at most 4 MiB
    row(
        "remember-record-over-4MiB",
        "fields",
        remember(fields={f"blob{i}": "x" * MIB for i in range(5)}),
    ),
    row(
        "update-record-over-4MiB",
        "fields",
        update(fields={f"blob{i}": "x" * MIB for i in range(4)}),
    ),
    # tags
    row("remember-257-tags", "tags", remember(tags=tags_of(257))),
    row("update-257-add-tags", "add_tags", update(add_tags=tags_of(257))),
    row("update-257-remove-tags", "remove_tags", update(remove_tags=tags_of(257))),
    row("remember-tag-257-chars", "tags", remember(tags=["fine", "t" * 257])),
    row("update-add-tag-257-chars", "add_tags", update(add_tags=["fine", "t" * 257])),
    row("remember-empty-tag", "tags", remember(tags=["fine", ""])),
    row("update-add-empty-tag", "add_tags", update(add_tags=["fine", ""])),
    row("update-remove-empty-tag", "remove_tags", update(remove_tags=[""])),
    row(
        "remember-two-home-regions",
        "tags",
        remember(tags=["homeRegion:local", "homeRegion:elsewhere"]),
    ),
    row(
        "remember-existing-two-home-regions",
        "tags",
        remember_target(tags=["homeRegion:local", "homeRegion:elsewhere"]),
    ),
    row("remember-existing-other-home", "tags", remember_target(tags=["homeRegion:elsewhere"])),
    row("remember-home-region-empty", "tags", remember(tags=["homeRegion:"])),
    row("update-add-home-region", "add_tags", update(add_tags=["homeRegion:local"])),
    row("update-remove-home-region", "remove_tags", update(remove_tags=["homeRegion:local"])),
    row(
        "update-tag-in-add-and-remove",
        ("add_tags", "remove_tags"),
        update(add_tags=["fresh", "both"], remove_tags=["both"]),
    ),
    # leases: 1 s - 1 h (0 means the default)
    *(
        row(f"claim-lease-{name}", "lease_seconds", claim(lease_seconds=bad))
        for name, bad in {
            "0.5": 0.5,
            "0.999": 0.999,
            "3600.001": 3600.001,
            "3601": 3601.0,
            "negative": -1.0,
            "nan": math.nan,
            "inf": math.inf,
            "-inf": -math.inf,
        }.items()
    ),
    *(
        row(f"renew-lease-{name}", "lease_seconds", renew(bad))
        for name, bad in {
            "0.5": 0.5,
            "3601": 3601.0,
            "negative": -5.0,
            "nan": math.nan,
            "inf": math.inf,
        }.items()
    ),
    # waits: 0 - 300 s
    *(
        row(f"claim-wait-{name}", "wait_seconds", claim(wait_seconds=bad))
        for name, bad in {
            "300.5": 300.5,
            "301": 301.0,
            "negative": -1.0,
            "nan": math.nan,
            "inf": math.inf,
        }.items()
    ),
    # owners: 1-128 printable characters
    *(
        row(f"claim-owner-{name}", "owner", claim(owner=bad))
        for name, bad in {
            "empty": "",
            "129-chars": "o" * 129,
            "newline": "worker-a\n",
            "nul": "worker\x00a",
            "tab": "\t",
            "escape": "\x1b[31mred",
        }.items()
    ),
    # fencing tokens are positive
    row("renew-token-0", "fencing_token", lambda c, t: c.renew_claim(t.key, 0)),
    row("release-token-0", "fencing_token", lambda c, t: c.release_claim(t.key, 0)),
    # list
    row("list-page-size-1001", "page_size", listing(page_size=1001)),
    row("list-page-size-huge", "page_size", listing(page_size=2**32 - 1)),
    row("list-page-token-garbage", "page_token", listing(page_token="garbage")),
    row(
        "list-page-token-other-repo",
        "page_token",
        listing(page_token=key_of("x", repo="other")),
    ),
    row(
        "list-page-token-other-topic",
        "page_token",
        listing(topic=TOPIC, page_token=key_of("x", topic="zzz")),
    ),
    row("list-repo-empty", "repo", listing(repo="")),
    row("list-repo-space", "repo", listing(repo="a b")),
    row("list-topic-slash", "topic", listing(topic="a/b")),
    row("list-tag-257-chars", "tag", listing(tag="t" * 257)),
]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("call, wanted", BAD_INPUT)
async def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    shared: Shared, call: Call, wanted: tuple[str, ...]
) -> None:
    client, target = shared.client, shared.target
    before = await snapshot(client, target)
    with pytest.raises(InvalidArgument) as refused:
        await call(client, target)
    error = refused.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.violations, f"no google.rpc.BadRequest field violation in {error}"
    fields = [field for field, _ in error.violations]
    assert any(names(field, wanted) for field in fields), (
        f"violations {error.violations} do not name {' or '.join(wanted)}"
    )
    assert all(why for _, why in error.violations), "a violation without a description"
    assert await snapshot(client, target) == before
    with pytest.raises(NotFound):
        await client.get(key_of(NEW_ID))


# -- the limits themselves are accepted ----------------------------------------------------


async def test_a_value_of_exactly_one_mib_is_accepted(client: AsyncClient, target: Claimed) -> None:
    """The 1 MiB limit is inclusive, and counted in bytes of UTF-8."""
    ascii_value, multibyte = "x" * MIB, "é" * (MIB // 2)
    record = await client.update(
        target.key, fields={"ascii": ascii_value}, fencing_token=target.token
    )
    assert record.fields["ascii"] == ascii_value
    record = await client.update(
        target.key, fields={"ascii": "", "utf8": multibyte}, fencing_token=target.token
    )
    assert record.fields["utf8"] == multibyte
    made = await client.remember(REPO, TOPIC, "one-mib-body", body=ascii_value)
    assert (await client.get(made.record.key)).body == ascii_value


async def test_limits_at_their_bounds_are_accepted(client: AsyncClient, target: Claimed) -> None:
    seg = "s" * 128
    made = await client.remember(seg, seg, seg, fields=fields_of(256), tags=["t" * 256])
    assert made.record.key == key_of(seg, repo=seg, topic=seg)
    assert len(made.record.fields) == 256
    assert "t" * 256 in made.record.tags
    tagged = await client.remember(REPO, TOPIC, "many-tags", tags=tags_of(255))
    assert len(tagged.record.tags) == 256  # the node's homeRegion tag makes 256
    owner = "o" * 128
    for lease, wait in ((1.0, 0.0), (3600.0, 300.0)):
        granted = await client.claim(made.record.key, owner, lease_seconds=lease, wait_seconds=wait)
        assert granted.granted
    renewed = await client.renew_claim(target.key, target.token, lease_seconds=3600)
    assert renewed.renewed
    page = await client.list(REPO, page_size=1000)
    assert len(page.records) >= 3


async def test_a_record_just_under_four_mib_is_accepted_and_readable(
    client: AsyncClient, target: Claimed
) -> None:
    near = {f"blob{i}": "x" * (MIB - 4096) for i in range(4)}
    record = await client.update(target.key, fields=near, fencing_token=target.token)
    assert {name: record.fields[name] for name in near} == near
    got = await client.get(target.key)
    assert got.digest == record.digest
    keys = [r.key async for r in client.iter_records(REPO, topic=TOPIC)]
    assert target.key in keys


# -- the client checks Python types ------------------------------------------------------

TYPE_ERRORS = [
    row(
        "update-field-value-int", "fields['body']", lambda c, t: c.update(t.key, fields={"body": 1})
    ),
    row(
        "update-field-value-bytes",
        "fields['body']",
        lambda c, t: c.update(t.key, fields={"body": b"raw"}),
    ),
    row(
        "remember-field-value-none",
        "fields['note']",
        lambda c, t: c.remember(REPO, TOPIC, NEW_ID, fields={"note": None}),
    ),
    row("update-field-name-int", "fields", lambda c, t: c.update(t.key, fields={1: "x"})),
    row("update-fields-not-a-mapping", "fields", lambda c, t: c.update(t.key, fields=["body"])),
    row("remember-title-int", "title", lambda c, t: c.remember(REPO, TOPIC, NEW_ID, title=5)),
    row("remember-id-int", "id", lambda c, t: c.remember(REPO, TOPIC, 2101)),
    row(
        "remember-tag-int",
        "tags[1]",
        lambda c, t: c.remember(REPO, TOPIC, NEW_ID, tags=["fine", 3]),
    ),
    row(
        "remember-tags-a-bare-string",
        "tags",
        lambda c, t: c.remember(REPO, TOPIC, NEW_ID, tags="backlog"),
    ),
    row("update-add-tag-none", "add_tags[0]", lambda c, t: c.update(t.key, add_tags=[None])),
    row("get-key-bytes", "key", lambda c, t: c.get(t.key.encode())),
    row("claim-owner-none", "owner", lambda c, t: c.claim(t.key, None)),
    row(
        "claim-lease-str",
        "lease_seconds",
        lambda c, t: c.claim(t.key, HOLDER, lease_seconds="600"),
    ),
    row("claim-wait-bool", "wait_seconds", lambda c, t: c.claim(t.key, HOLDER, wait_seconds=True)),
    row(
        "update-token-str",
        "fencing_token",
        lambda c, t: c.update(t.key, fields={"body": "x"}, fencing_token=str(t.token)),
    ),
    row("renew-token-float", "fencing_token", lambda c, t: c.renew_claim(t.key, float(t.token))),
    row("release-token-bool", "fencing_token", lambda c, t: c.release_claim(t.key, True)),
    row("list-page-size-str", "page_size", lambda c, t: c.list(REPO, page_size="10")),
]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("call, wanted", TYPE_ERRORS)
async def test_a_value_of_the_wrong_python_type_raises_type_error_naming_it(
    shared: Shared, call: Call, wanted: tuple[str, ...]
) -> None:
    client, target = shared.client, shared.target
    before = await snapshot(client, target)
    with pytest.raises(TypeError) as refused:
        await call(client, target)
    assert any(name in str(refused.value) for name in wanted), str(refused.value)
    assert await snapshot(client, target) == before


async def test_the_blocking_client_raises_the_same_type_error(
    node: NodeServer, client: AsyncClient, target: Claimed
) -> None:
    before = await snapshot(client, target)

    def blocking_update() -> None:
        with Client(node.address) as blocking:
            blocking.update(target.key, fields={"body": 1})  # type: ignore[dict-item]

    with pytest.raises(TypeError, match=r"fields\['body'\]"):
        await asyncio.to_thread(blocking_update)
    assert await snapshot(client, target) == before


# -- every limit at its boundary, as the node's own checks (issue 15) ----------------------


def refused_field(check: Callable[[], object]) -> str:
    """The one field ``check`` refuses, by name."""
    with pytest.raises(InvalidInput) as refused:
        check()
    [(name, _)] = refused.value.violations
    return name


def test_the_limits_are_the_specs() -> None:
    """SPEC §2 and §6: every node and client must agree on them."""
    assert validation.MAX_VALUE_BYTES == 1 << 20
    assert (validation.MAX_FIELDS, validation.MAX_TAGS, validation.MAX_TAG_CHARS) == (256,) * 3
    assert validation.MAX_OWNER_CHARS == 128
    assert (validation.MIN_LEASE_S, validation.MAX_LEASE_S, validation.DEFAULT_LEASE_S) == (
        1.0, 3600.0, 60.0,
    )  # fmt: skip
    assert validation.MAX_WAIT_S == 300.0
    assert validation.MAX_RECORD_BYTES == 4 << 20
    assert (validation.MAX_PAGE_SIZE, validation.DEFAULT_PAGE_SIZE) == (1000, 100)


def test_regions_are_1_to_64_safe_characters() -> None:
    assert validation.region("r" * 64) == "r" * 64
    for bad in ("", "r" * 65, "us east", "us/east"):
        assert refused_field(partial(validation.region, bad, "home")) == "home"


def test_a_request_holds_at_most_256_fields_of_at_most_one_mib_each() -> None:
    many = {f"f{i}": "v" for i in range(256)}
    assert validation.fields(many) is many
    assert refused_field(lambda: validation.fields({**many, "one-more": "v"})) == "fields"
    assert refused_field(lambda: validation.fields({"bad name": "v"})) == "fields['bad name']"
    mib = "é" * (1 << 19)  # two bytes each: exactly one MiB
    assert validation.value_field(mib, "body") == mib
    assert refused_field(lambda: validation.value_field(mib + "x", "body")) == "body"
    assert refused_field(lambda: validation.fields({"big": mib + "x"})) == "fields['big']"


def test_a_request_holds_at_most_256_printable_tags_of_1_to_256_characters() -> None:
    many = [f"t{i}" for i in range(256)]
    assert validation.tags(many) == many
    assert refused_field(lambda: validation.tags([*many, "one-more"])) == "tags"
    assert validation.tags(["t" * 256]) == ["t" * 256]
    for bad in ("", "t" * 257, "tab\there"):
        assert refused_field(partial(validation.tags, ["ok", bad])) == "tags[1]"


def test_one_home_tag_names_the_home() -> None:
    assert validation.home_tag(["x", "homeRegion:eu", "homeRegion:eu"]) == "eu"
    assert validation.home_tag(["x"]) is None
    assert refused_field(lambda: validation.home_tag(["homeRegion:eu", "homeRegion:us"])) == "tags"
    assert refused_field(lambda: validation.home_tag(["homeRegion:e u"])) == "tags"
    assert refused_field(lambda: validation.no_home_tags(["homeRegion:eu"], "add_tags")) == (
        "add_tags"
    )
    validation.no_home_tags(["home:eu"], "add_tags")


def test_a_one_character_tag_and_a_half_second_wait_are_within_the_limits() -> None:
    assert validation.tags(["t"]) == ["t"]
    assert validation.wait(0.5) == 0.5


@pytest.mark.parametrize(
    ("check", "limit"),
    [
        (validation.key, 300),
        (partial(validation.segment, name="topic"), 300),
        (validation.region, 100),
    ],
)
def test_a_refusal_quotes_at_most_the_start_of_a_long_bad_value(
    check: Callable[[str], object], limit: int
) -> None:
    """A refusal echoes what it refused, cut to its first characters: enough to find
    it, never a megabyte back to the caller or into a log."""
    why = refused_message(partial(check, "?" * 1000))
    assert repr("?" * limit) in why and repr("?" * (limit + 1)) not in why


def test_refusals_of_field_names_and_grant_identities_quote_100_characters() -> None:
    name = "?" * 1000
    assert refused_field(partial(validation.fields, {name: "v"})) == f"fields[{'?' * 100!r}]"
    made = NodeRecord("repo/r/mem/t/i").create("us", STAMP)
    grant = Grant(STAMP.hlc, "w", "us", identity="?" * 1000)
    why = refused_message(partial(state_of, made.with_fence(made.fence.grant(1, grant, 0))))
    assert repr("?" * 100) in why and repr("?" * 101) not in why


def test_an_owner_is_1_to_128_printable_characters() -> None:
    assert validation.owner("o" * 128) == "o" * 128
    for bad in ("", "o" * 129, "new\nline"):
        assert refused_field(partial(validation.owner, bad)) == "owner"


def test_seconds_are_finite_and_within_their_bounds_and_0_means_the_default() -> None:
    assert validation.lease(0) == 60.0
    assert (validation.lease(1.0), validation.lease(3600.0)) == (1.0, 3600.0)
    assert (validation.wait(0), validation.wait(300.0)) == (0.0, 300.0)
    for bad in (0.999, 3600.001, -1.0, math.inf, math.nan):
        assert refused_field(partial(validation.lease, bad)) == "lease_seconds"
    assert refused_field(lambda: validation.wait(300.001)) == "wait_seconds"
    with pytest.raises(InvalidInput, match="between 1 and 3600 seconds"):
        validation.lease(0.5)


def test_a_page_is_1_to_1000_records_and_0_means_100() -> None:
    assert (validation.page_size(0), validation.page_size(1), validation.page_size(1000)) == (
        100, 1, 1000,
    )  # fmt: skip
    for bad in (-1, 1001):
        assert refused_field(partial(validation.page_size, bad)) == "page_size"


STAMP = Stamp(0, pack(1_767_225_600_000), "n1")


def state_of(record: NodeRecord) -> NodeRecord:
    """``record``, checked as a replicated state would be; its size as encoded."""
    validation.state(record, len(codec.encode(record)))
    return record


def test_a_replicated_state_obeys_the_limits_of_a_clients_write() -> None:
    """docs/consistency.md, *Limits and merges*: every limit, on the whole state, with
    what was cleared or removed checked by name as when it was written."""
    made = NodeRecord("repo/r/mem/t/i").create("us", STAMP)
    state_of(made)
    assert validation.state_problem(made, 10) is None
    assert refused_field(lambda: validation.state(made, validation.MAX_RECORD_BYTES + 1)) == "state"
    validation.state(made, validation.MAX_RECORD_BYTES)
    assert refused_field(lambda: state_of(NodeRecord("not a key").create("us", STAMP))) == "key"
    assert refused_field(lambda: state_of(NodeRecord("repo/r/mem/t/i").create("u s", STAMP))) == (
        "home_region"
    )
    cleared = made.set_fields({"bad name": ""}, STAMP)
    assert cleared.field_values() == {}
    assert refused_field(lambda: state_of(cleared)) == "fields"
    too_many = made.set_fields({f"f{i}": "v" for i in range(257)}, STAMP)
    assert refused_field(lambda: state_of(too_many)) == "fields"
    later = Stamp(0, STAMP.hlc + 1, "n1")
    removed = made.add_tags(["\x00"], STAMP).remove_tags(["\x00"], later)
    assert removed.tag_values() == ["homeRegion:us"]  # removed: only its name is left
    assert refused_field(lambda: state_of(removed)) == "tags[0]"
    assert refused_field(lambda: state_of(made.add_tags(["homeRegion:eu"], STAMP))) == "tags"
    for grant, name in (
        (Grant(STAMP.hlc, "", "us"), "grants[1].owner"),
        (Grant(STAMP.hlc, "w", "u s"), "grants[1].region"),
        (Grant(STAMP.hlc, "w", "us", identity="alice"), "grants[1].identity"),
    ):
        bad = made.with_fence(made.fence.grant(1, grant, 0))
        assert refused_field(partial(state_of, bad)) == name
        assert validation.state_problem(bad, 10) == f"{name}: " + str(
            refused_message(partial(state_of, bad))
        )
    good = Grant(STAMP.hlc, "w", "us", identity="client/alice")
    state_of(made.with_fence(made.fence.grant(1, good, 0)))


def refused_message(check: Callable[[], object]) -> str:
    with pytest.raises(InvalidInput) as refused:
        check()
    [(_, why)] = refused.value.violations
    return why


def test_a_record_a_write_would_leave_holds_at_most_256_fields_and_256_tags() -> None:
    made = NodeRecord("repo/r/mem/t/i").create("us", STAMP)
    full = made.set_fields({f"f{i}": "v" for i in range(256)}, STAMP)
    full = full.add_tags([f"t{i}" for i in range(256)], STAMP)
    validation.record_size(full, "fields")
    over = full.set_fields({"one-more": "v"}, STAMP)
    assert refused_field(lambda: validation.record_size(over, "fields")) == "fields"
    over = full.add_tags(["one-more"], STAMP)
    assert refused_field(lambda: validation.record_size(over, "fields", "add_tags")) == "add_tags"


def test_a_replicated_states_queue_registers_are_the_four_the_home_writes() -> None:
    """SPEC §8: a record's queue state is ``status`` (a status word), ``outcome`` (an
    ending word), ``attempts`` and ``not_before`` (canonical decimals below 2**64), and
    nothing else; a peer's state with any other is refused naming the register,
    ``queue.<name>``, its name cut to 64 characters."""
    made = NodeRecord("repo/r/mem/t/i").create("us", STAMP)
    top = str((1 << 64) - 1)
    for status, outcome, count in zip(STATUSES, ENDINGS, ("0", "7", top), strict=False):
        good = {STATUS: status, OUTCOME: outcome, ATTEMPTS: count, NOT_BEFORE: count}
        state_of(made.set_queue(good, STAMP))
    for outcome in ENDINGS:
        state_of(made.set_queue({OUTCOME: outcome}, STAMP))
    bad_numbers = ("", "01", "-1", "+1", "1.0", "1e3", str(1 << 64), "9" * 20, "1" * 21)
    for name, values in (
        (STATUS, ("closed", "", "Open", *ENDINGS[1:])),
        (OUTCOME, ("ok", "", "open", "parked")),
        (ATTEMPTS, bad_numbers),
        (NOT_BEFORE, bad_numbers),
    ):
        for value in values:
            bad = made.set_queue({name: value}, STAMP)
            assert refused_field(partial(state_of, bad)) == f"queue.{name}", (name, value)
    for name in ("priority", "Status", "q" * 100):
        bad = made.set_queue({name: "0"}, STAMP)
        assert refused_field(partial(state_of, bad)) == f"queue.{name[:64]}"


def test_queue_tags_name_1_to_1000_attempts_and_wait_on_at_most_16_valid_ids() -> None:
    """SPEC §8, on a client's write: ``maxAttempts:N`` with N from 1 to
    MAX_ATTEMPTS_LIMIT, ``after:<id>`` naming a valid id, at most MAX_AFTER_TAGS of
    them; a refused tag is named by its index, too many ``after:`` tags by the list."""
    assert (MAX_ATTEMPTS_LIMIT, MAX_AFTER_TAGS) == (1000, 16)
    waits = [f"after:item-{i}" for i in range(16)]
    validation.queue_tags(["x", "maxAttempts:1", "maxAttempts:1000", *waits, "priority:P10"])
    assert refused_field(lambda: validation.queue_tags([*waits, "after:one-more"])) == "tags"
    validation.queue_tags(["after:a", "after:a"], "add_tags")  # a repeat still counts once each
    for bad in ("maxAttempts:0", "maxAttempts:1001", "maxAttempts:", "maxAttempts:-1",
                "maxAttempts:x", "after:", "after:a b", "after:a/b"):  # fmt: skip
        refused = partial(validation.queue_tags, ["ok", "after:a", bad])
        assert refused_field(refused) == "tags[2]"
        assert refused_field(partial(validation.queue_tags, [bad], "add_tags")) == "add_tags[0]"


def test_a_key_range_holds_exactly_the_keys_under_its_prefix() -> None:
    """``key_range``: ``[lower, upper)`` holds a key exactly when the key starts with
    ``repo/<repo>/mem/`` (``…/<topic>/`` with a topic), however it goes on."""
    for repo, topic in (("r", ""), ("r", "t")):
        lower, upper = validation.key_range(repo, topic)
        prefix = f"repo/{repo}/mem/" + (f"{topic}/" if topic else "")
        assert lower == prefix
        around = (prefix[:-1] + "0", prefix[:-1] + ".", prefix[:-1], f"repo/{repo}x/mem/")
        for key in (prefix, prefix + "x", prefix + "\U0010ffff" * 3, *around):
            assert (lower <= key < upper) is key.startswith(prefix), key
    assert refused_field(lambda: validation.key_range("a b")) == "repo"
    assert refused_field(lambda: validation.key_range("r", "a/b")) == "topic"
