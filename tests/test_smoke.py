from fencemark.client import AsyncClient


async def test_a_remembered_record_can_be_read_back(client: AsyncClient) -> None:
    made = await client.remember("lattice", "backlog", "issue-1", title="hello")
    got = await client.get(made.record.key)
    assert got.title == "hello"
    assert got.home_region == "local"
