"""SPEC §2 records and keys, and the Records service (remember, get, update, delete, list)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fencemark.client import AsyncClient, InvalidArgument, NotFound, WrongRegion
from tests.conftest import StartNode

REPO, TOPIC = "lattice", "backlog"


def key_of(id_: str, *, repo: str = REPO, topic: str = TOPIC) -> str:
    return f"repo/{repo}/mem/{topic}/{id_}"


def violated(error: InvalidArgument) -> list[str]:
    return [name for name, _ in error.violations]


# -- remember ------------------------------------------------------------------------------


async def test_remember_creates_the_deterministic_key(client: AsyncClient) -> None:
    """SPEC §2: the key is repo/{repo}/mem/{topic}/{id}."""
    result = await client.remember(
        REPO, TOPIC, "issue-1", kind="Note", author="pm", title="T", body="B"
    )
    assert result.created
    record = result.record
    assert record.key == "repo/lattice/mem/backlog/issue-1"
    assert (record.repo, record.topic, record.id) == (REPO, TOPIC, "issue-1")
    assert (record.kind, record.author, record.title, record.body) == ("Note", "pm", "T", "B")
    assert record.deleted is False
    assert record.fence == 0
    assert record.digest
    got = await client.get(record.key)
    assert got == record


async def test_repeating_remember_merges_in_place_and_never_duplicates(
    client: AsyncClient,
) -> None:
    """SPEC §1 step 1: the same call repeated merges in place."""
    first = await client.remember(REPO, TOPIC, "same", title="one", tags=["a"])
    second = await client.remember(REPO, TOPIC, "same", title="one", tags=["a"])
    third = await client.remember(REPO, TOPIC, "same", body="more", fields={"extra": "x"})
    assert (first.created, second.created, third.created) == (True, False, False)
    assert first.record.key == second.record.key == third.record.key
    page = await client.list(REPO, include_deleted=True)
    assert [r.key for r in page.records] == [first.record.key]
    merged = await client.get(first.record.key)
    assert merged.fields == {"title": "one", "body": "more", "extra": "x"}
    assert (await client.info()).record_count == 1


async def test_remember_adds_tags_and_never_removes_them(client: AsyncClient) -> None:
    """records.proto: remember's ``tags`` are added, never removed."""
    await client.remember(REPO, TOPIC, "tags", tags=["a", "b"])
    result = await client.remember(REPO, TOPIC, "tags", tags=["c"])
    assert set(result.record.tags) == {"a", "b", "c", "homeRegion:local"}
    result = await client.remember(REPO, TOPIC, "tags")
    assert set(result.record.tags) == {"a", "b", "c", "homeRegion:local"}


async def test_the_node_adds_the_home_region_tag_when_absent(client: AsyncClient) -> None:
    """SPEC §2: a record without homeRegion is homed where it was created."""
    result = await client.remember(REPO, TOPIC, "homeless", tags=["backlog"])
    assert result.record.home_region == "local"
    assert [t for t in result.record.tags if t.startswith("homeRegion:")] == ["homeRegion:local"]
    assert "backlog" in result.record.tags


async def test_an_explicit_home_region_tag_of_this_node_is_kept_once(client: AsyncClient) -> None:
    """records.proto: the tag set always contains exactly one homeRegion tag."""
    result = await client.remember(REPO, TOPIC, "homed", tags=["homeRegion:local", "x"])
    assert result.record.home_region == "local"
    assert [t for t in result.record.tags if t.startswith("homeRegion:")] == ["homeRegion:local"]
    assert list(result.record.tags) == sorted(result.record.tags)


async def test_remember_cannot_change_the_home_region(client: AsyncClient) -> None:
    """SPEC §2: homeRegion never changes; the refusal names ``tags`` and changes nothing."""
    made = await client.remember(REPO, TOPIC, "fixed-home", body="b", tags=["homeRegion:local"])
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(REPO, TOPIC, "fixed-home", body="new", tags=["homeRegion:elsewhere"])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "tags" in violated(refused.value)
    after = await client.get(made.record.key)
    assert after.digest == made.record.digest
    assert after.home_region == "local"
    # The same home again is fine: it does not change anything.
    again = await client.remember(REPO, TOPIC, "fixed-home", tags=["homeRegion:local"])
    assert again.record.home_region == "local"


async def test_remember_with_two_home_regions_is_invalid(client: AsyncClient) -> None:
    """records.proto: at most one homeRegion tag."""
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(REPO, TOPIC, "two-homes", tags=["homeRegion:local", "homeRegion:b"])
    assert "tags" in violated(refused.value)
    with pytest.raises(NotFound):
        await client.get(key_of("two-homes"))


async def test_remember_of_an_existing_record_merges_at_a_node_of_another_region(
    start_node: StartNode, tmp_path: Path
) -> None:
    """SPEC §2: remember on an existing key merges in place wherever it is sent.

    The ``eu`` node runs on the data the ``us`` node wrote, as a replica would.
    A new key homed in ``us`` is still refused there, with the home named.
    """
    data = tmp_path / "shared"
    home = await start_node("us", data_dir=data)
    async with AsyncClient(home.address) as client:
        made = await client.remember(REPO, TOPIC, "travels", title="t", tags=["a"])
    await home.stop()
    away = await start_node("eu", data_dir=data)
    async with AsyncClient(away.address) as client:
        merged = await client.remember(
            REPO, TOPIC, "travels", body="from eu", tags=["b", "homeRegion:us"]
        )
        assert merged.created is False
        assert merged.record.key == made.record.key
        assert merged.record.home_region == "us"
        assert merged.record.fields == {"title": "t", "body": "from eu"}
        assert set(merged.record.tags) == {"a", "b", "homeRegion:us"}
        with pytest.raises(InvalidArgument) as moved:
            await client.remember(REPO, TOPIC, "travels", tags=["homeRegion:eu"])
        assert "tags" in violated(moved.value)
        with pytest.raises(WrongRegion) as refused:
            await client.remember(REPO, TOPIC, "new-one", tags=["homeRegion:us"])
        assert refused.value.home_region == "us"
        created_here = await client.remember(REPO, TOPIC, "new-two")
        assert created_here.record.home_region == "eu"


@pytest.mark.parametrize("which", ["add_tags", "remove_tags"])
async def test_update_cannot_add_or_remove_home_region_tags(
    client: AsyncClient, which: str
) -> None:
    """SPEC §2: homeRegion never changes; update refuses to touch it."""
    made = await client.remember(REPO, TOPIC, "update-home", body="b")
    for tag in ("homeRegion:local", "homeRegion:elsewhere"):
        with pytest.raises(InvalidArgument) as refused:
            if which == "add_tags":
                await client.update(made.record.key, add_tags=[tag])
            else:
                await client.update(made.record.key, remove_tags=[tag])
        assert which in violated(refused.value)
    after = await client.get(made.record.key)
    assert after.digest == made.record.digest
    assert "homeRegion:local" in after.tags


@pytest.mark.parametrize(
    ("repo", "topic", "id_", "field"),
    [
        ("", TOPIC, "x", "repo"),
        (REPO, "has/slash", "x", "topic"),
        (REPO, TOPIC, "sp ace", "id"),
        (REPO, TOPIC, "x" * 129, "id"),
    ],
)
async def test_remember_refuses_bad_key_segments_naming_them(
    client: AsyncClient, repo: str, topic: str, id_: str, field: str
) -> None:
    """SPEC §2: each segment matches [A-Za-z0-9._:-]{1,128}; bad input names the field."""
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(repo, topic, id_, body="b")
    assert field in violated(refused.value)
    assert (await client.info()).record_count == 0


async def test_remember_accepts_the_whole_segment_alphabet(client: AsyncClient) -> None:
    """SPEC §2: letters, digits and . _ : - are all allowed, up to 128 characters."""
    id_ = "Aa0._:-" + "z" * 121
    result = await client.remember(REPO, TOPIC, id_, body="b")
    assert result.record.key == key_of(id_)
    assert (await client.get(key_of(id_))).body == "b"


# -- get / update -----------------------------------------------------------------------------


async def test_get_of_an_unknown_key_is_not_found(client: AsyncClient) -> None:
    """records.proto: Get answers NOT_FOUND when the key is unknown."""
    with pytest.raises(NotFound) as missing:
        await client.get(key_of("never"))
    assert missing.value.code == grpc.StatusCode.NOT_FOUND


async def test_get_of_a_malformed_key_is_invalid_naming_key(client: AsyncClient) -> None:
    """SPEC §6: bad input gets INVALID_ARGUMENT with the field named."""
    with pytest.raises(InvalidArgument) as refused:
        await client.get("not/a/key")
    assert violated(refused.value) == ["key"]


async def test_update_writes_fields_and_clears_one_with_an_empty_value(
    client: AsyncClient,
) -> None:
    """records.proto: Update writes fields; an empty value clears the field."""
    made = await client.remember(REPO, TOPIC, "upd", title="t", body="b", fields={"x": "1"})
    key = made.record.key
    updated = await client.update(key, fields={"body": "new", "y": "2", "x": ""})
    assert updated.fields == {"title": "t", "body": "new", "y": "2"}
    assert (await client.get(key)).fields == updated.fields


async def test_update_adds_and_removes_tags(client: AsyncClient) -> None:
    """records.proto: add_tags and remove_tags; a removed tag can be added back."""
    made = await client.remember(REPO, TOPIC, "upd-tags", tags=["a", "b"])
    key = made.record.key
    updated = await client.update(key, add_tags=["c"], remove_tags=["a"])
    assert set(updated.tags) == {"b", "c", "homeRegion:local"}
    back = await client.update(key, add_tags=["a"])
    assert set(back.tags) == {"a", "b", "c", "homeRegion:local"}


async def test_update_with_a_tag_in_both_lists_is_invalid(client: AsyncClient) -> None:
    """records.proto: a tag in both add_tags and remove_tags is invalid."""
    made = await client.remember(REPO, TOPIC, "both", tags=["a"])
    with pytest.raises(InvalidArgument) as refused:
        await client.update(made.record.key, add_tags=["a"], remove_tags=["a"])
    assert "remove_tags" in violated(refused.value)
    assert (await client.get(made.record.key)).digest == made.record.digest


async def test_update_of_an_unknown_record_is_not_found(client: AsyncClient) -> None:
    """records.proto: Update answers NOT_FOUND when the record does not exist."""
    with pytest.raises(NotFound):
        await client.update(key_of("never"), fields={"body": "x"})
    assert (await client.info()).record_count == 0


# -- delete ---------------------------------------------------------------------------------


async def test_delete_writes_a_tombstone(client: AsyncClient) -> None:
    """SPEC §3: a deleted record is a tombstone: Get NOT_FOUND, List shows it on request."""
    made = await client.remember(REPO, TOPIC, "gone", body="b")
    key = made.record.key
    tombstone = await client.delete(key)
    assert tombstone.deleted and tombstone.key == key
    with pytest.raises(NotFound):
        await client.get(key)
    with pytest.raises(NotFound):
        await client.update(key, fields={"body": "x"})
    assert (await client.list(REPO)).records == ()
    listed = (await client.list(REPO, include_deleted=True)).records
    assert [(r.key, r.deleted) for r in listed] == [(key, True)]
    assert (await client.info()).record_count == 1


async def test_delete_of_a_never_seen_key_still_writes_a_tombstone(client: AsyncClient) -> None:
    """SPEC §3: the tombstone is always written, even for a key this node never saw."""
    key = key_of("never-seen")
    tombstone = await client.delete(key)
    assert tombstone.deleted
    # No home: a blind tombstone homed here could take over a record created
    # meanwhile in another region (test_replication pins that regression).
    assert tombstone.home_region == ""
    listed = (await client.list(REPO, include_deleted=True)).records
    assert [(r.key, r.deleted) for r in listed] == [(key, True)]
    with pytest.raises(NotFound):
        await client.get(key)


async def test_remember_after_delete_recreates_and_keeps_the_fence(client: AsyncClient) -> None:
    """SPEC §3: a tombstone keeps its grants, so a token is never reissued after recreate."""
    made = await client.remember(REPO, TOPIC, "phoenix", body="first life", tags=["old"])
    key = made.record.key
    tokens = []
    for owner in ("a", "b"):
        granted = await client.claim(key, owner)
        assert granted.granted
        tokens.append(granted.fencing_token)
        assert (await client.release_claim(key, granted.fencing_token)).released
    await client.delete(key)
    again = await client.remember(REPO, TOPIC, "phoenix", body="second life")
    assert again.created is True
    assert again.record.deleted is False
    assert again.record.fence == max(tokens)
    assert (await client.get(key)).body == "second life"
    granted = await client.claim(key, "c")
    assert granted.granted
    assert granted.fencing_token > max(tokens)


# -- list ------------------------------------------------------------------------------------


async def test_list_filters_by_repo_topic_and_tag(client: AsyncClient) -> None:
    """SPEC §7: List filters by repo/topic/tag, in key order."""
    await client.remember("r1", "t1", "a", tags=["hot"])
    await client.remember("r1", "t1", "b")
    await client.remember("r1", "t2", "c", tags=["hot"])
    await client.remember("r2", "t1", "d", tags=["hot"])
    await client.remember("r10", "t1", "e", tags=["hot"])  # "r1" must not match "r10"

    async def keys(repo: str, topic: str = "", tag: str = "") -> list[str]:
        return [r.key for r in (await client.list(repo, topic=topic, tag=tag)).records]

    assert await keys("r1") == [
        key_of("a", repo="r1", topic="t1"),
        key_of("b", repo="r1", topic="t1"),
        key_of("c", repo="r1", topic="t2"),
    ]
    assert await keys("r1", topic="t1") == [
        key_of("a", repo="r1", topic="t1"),
        key_of("b", repo="r1", topic="t1"),
    ]
    assert await keys("r1", tag="hot") == [
        key_of("a", repo="r1", topic="t1"),
        key_of("c", repo="r1", topic="t2"),
    ]
    assert await keys("r1", topic="t2", tag="hot") == [key_of("c", repo="r1", topic="t2")]
    assert await keys("r1", tag="homeRegion:local") == await keys("r1")
    assert await keys("r2") == [key_of("d", repo="r2", topic="t1")]
    assert await keys("nothing") == []


async def test_list_pages_until_exhausted_without_duplicates(client: AsyncClient) -> None:
    """records.proto: pages of page_size in key order; next_page_token empty on the last."""
    expected = sorted(key_of(f"item-{i:02d}") for i in range(25))
    for i in range(25):
        await client.remember(REPO, TOPIC, f"item-{i:02d}")
    sizes: list[int] = []
    seen: list[str] = []
    token = ""
    for _ in range(10):
        page = await client.list(REPO, page_size=10, page_token=token)
        sizes.append(len(page.records))
        seen += [r.key for r in page.records]
        token = page.next_page_token
        if not token:
            break
    assert sizes == [10, 10, 5]
    assert seen == expected


async def test_list_pages_with_a_tag_filter_find_every_match(client: AsyncClient) -> None:
    """records.proto: filtering and paging together miss and repeat nothing."""
    for i in range(30):
        await client.remember(REPO, TOPIC, f"t-{i:02d}", tags=["even"] if i % 2 == 0 else [])
    expected = [key_of(f"t-{i:02d}") for i in range(0, 30, 2)]
    seen = [r.key async for r in client.iter_records(REPO, tag="even", page_size=4)]
    assert seen == expected


async def test_list_refuses_a_foreign_page_token(client: AsyncClient) -> None:
    """records.proto: page_token must come from the same listing."""
    for i in range(3):
        await client.remember("mine", TOPIC, f"k{i}")
        await client.remember("theirs", TOPIC, f"k{i}")
    page = await client.list("theirs", page_size=1)
    assert page.next_page_token
    with pytest.raises(InvalidArgument) as refused:
        await client.list("mine", page_token=page.next_page_token)
    assert "page_token" in violated(refused.value)
    with pytest.raises(InvalidArgument) as garbage:
        await client.list("mine", page_token="garbage")
    assert "page_token" in violated(garbage.value)


async def test_list_refuses_bad_filters_naming_them(client: AsyncClient) -> None:
    """SPEC §6: INVALID_ARGUMENT names the field (repo is required; page_size 1-1000)."""
    with pytest.raises(InvalidArgument) as no_repo:
        await client.list("")
    assert "repo" in violated(no_repo.value)
    with pytest.raises(InvalidArgument) as bad_topic:
        await client.list(REPO, topic="a/b")
    assert "topic" in violated(bad_topic.value)
    with pytest.raises(InvalidArgument) as too_big:
        await client.list(REPO, page_size=1001)
    assert "page_size" in violated(too_big.value)


async def test_a_recreated_record_does_not_resurrect_what_was_deleted(
    client: AsyncClient,
) -> None:
    """SPEC §3 tombstones: delete then remember gives a new record, not the old one's content.

    What a careful etcd/Riak user expects: after a delete, the fields and tags of
    the previous life are gone; only what the recreating call wrote is there.
    """
    made = await client.remember(REPO, TOPIC, "reborn", title="old title", tags=["old-tag"])
    await client.delete(made.record.key)
    again = await client.remember(REPO, TOPIC, "reborn", body="new body", tags=["new-tag"])
    assert again.created
    assert again.record.fields == {"body": "new body"}
    assert set(again.record.tags) == {"new-tag", "homeRegion:local"}


# -- limits (SPEC §2: refused as invalid input, never truncated) ----------------------------

MIB = 1 << 20


async def test_a_value_of_one_mib_is_accepted_and_one_byte_more_refused(
    client: AsyncClient,
) -> None:
    """SPEC §2: value <= 1 MiB; the refusal names the request field that carried it."""
    made = await client.remember(REPO, TOPIC, "big", body="x" * MIB)
    assert len(made.record.body) == MIB
    with pytest.raises(InvalidArgument) as as_body:
        await client.remember(REPO, TOPIC, "too-big", body="x" * (MIB + 1))
    assert violated(as_body.value) == ["body"]
    with pytest.raises(InvalidArgument) as as_field:
        await client.remember(REPO, TOPIC, "too-big", fields={"blob": "x" * (MIB + 1)})
    assert [name for name in violated(as_field.value) if name.startswith("fields")]
    with pytest.raises(InvalidArgument) as as_update:
        await client.update(made.record.key, fields={"body": "y" * (MIB + 1)})
    assert [name for name in violated(as_update.value) if name.startswith("fields")]
    assert (await client.get(made.record.key)).digest == made.record.digest
    with pytest.raises(NotFound):
        await client.get(key_of("too-big"))


async def test_256_fields_are_accepted_and_257_refused_in_one_call(client: AsyncClient) -> None:
    """SPEC §2: at most 256 fields."""
    fields = {f"f{i:03d}": "v" for i in range(256)}
    made = await client.remember(REPO, TOPIC, "wide", fields=fields)
    assert len(made.record.fields) == 256
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(REPO, TOPIC, "wider", fields={**fields, "f256": "v"})
    assert "fields" in violated(refused.value)
    with pytest.raises(NotFound):
        await client.get(key_of("wider"))


async def test_a_record_never_grows_past_256_fields_across_calls(client: AsyncClient) -> None:
    """SPEC §2 / records.proto: "at most 256 fields per record in all"."""
    made = await client.remember(
        REPO, TOPIC, "growing", fields={f"a{i:03d}": "v" for i in range(200)}
    )
    with pytest.raises(InvalidArgument) as refused:
        await client.update(made.record.key, fields={f"b{i:03d}": "v" for i in range(100)})
    assert "fields" in violated(refused.value)
    after = await client.get(made.record.key)
    assert len(after.fields) == 200
    assert after.digest == made.record.digest


async def test_a_record_never_grows_past_256_tags_across_calls(client: AsyncClient) -> None:
    """SPEC §2: at most 256 tags (per record, as for fields)."""
    made = await client.remember(REPO, TOPIC, "tagged", tags=[f"a{i:03d}" for i in range(200)])
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(REPO, TOPIC, "tagged", tags=[f"b{i:03d}" for i in range(100)])
    assert "tags" in violated(refused.value)
    after = await client.get(made.record.key)
    assert after.digest == made.record.digest


async def test_tags_longer_than_256_characters_are_refused(client: AsyncClient) -> None:
    """SPEC §2: tags of at most 256 characters, never truncated."""
    ok = await client.remember(REPO, TOPIC, "long-tag", tags=["t" * 256])
    assert "t" * 256 in ok.record.tags
    with pytest.raises(InvalidArgument) as refused:
        await client.remember(REPO, TOPIC, "longer-tag", tags=["fine", "t" * 257])
    assert [name for name in violated(refused.value) if name.startswith("tags")]
    with pytest.raises(NotFound):
        await client.get(key_of("longer-tag"))
