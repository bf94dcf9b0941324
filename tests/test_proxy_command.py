"""``fencemark proxy``: fault proxies steered by a control file (the chaos tier's slow link)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fencemark.client import AsyncClient, Unavailable
from fencemark.node.api.server import NodeServer
from fencemark.node.tools import proxy_command
from fencemark.node.tools.proxy_command import Faults, parse_control, parse_link
from tests.ports import free_port


def test_a_link_names_its_listen_and_upstream_addresses() -> None:
    link = parse_link("us-eu=0.0.0.0:7501=eu:7400")
    assert (link.name, link.listen, link.upstream) == ("us-eu", "0.0.0.0:7501", "eu:7400")


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("us-eu=0.0.0.0:7501", "NAME=LISTEN_HOST:PORT=UPSTREAM_HOST:PORT"),
        ("us-eu=0.0.0.0=eu:7400", "LISTEN must be HOST:PORT"),
        ("us-eu=0.0.0.0:7501=eu", "UPSTREAM must be HOST:PORT"),
    ],
)
def test_a_malformed_link_is_refused_naming_the_part(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_link(spec)


def test_the_control_file_names_each_links_faults() -> None:
    text = json.dumps({"a": {"latency_ms": 300, "bandwidth": 4096}, "b": {"mode": "cut"}})
    assert parse_control(text, ["a", "b", "c"]) == {
        "a": Faults(latency_ms=300.0, bandwidth=4096.0),
        "b": Faults(mode="cut"),
    }
    assert parse_control("  ", ["a"]) == {}


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"zz": {}}, "no link named 'zz'"),
        ({"a": {"mode": "slow"}}, "a.mode"),
        ({"a": {"latency_ms": -1}}, "a.latency_ms"),
        ({"a": {"bandwidth": 0}}, "a.bandwidth"),
        ({"a": {"jitter": 1}}, "unknown field 'jitter'"),
        ([1], "expected a JSON object"),
    ],
)
def test_a_bad_control_file_is_refused_naming_the_field(document: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_control(json.dumps(document), ["a"])


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
def test_the_command_refuses_a_bad_link_with_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fencemark.node", "proxy", "--link", "nonsense"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--link" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture
async def proxied(node: NodeServer, tmp_path: Path) -> AsyncIterator[tuple[AsyncClient, Path]]:
    """A client that reaches ``node`` only through a running ``fencemark proxy`` link."""
    control = tmp_path / "faults.json"
    listen = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()
    links = [parse_link(f"l={listen}={node.address}")]
    task = asyncio.create_task(proxy_command.run(links, control, stop))
    async with AsyncClient(listen, timeout=2.0, retries=0) as client:
        yield client, control
    stop.set()
    await task


async def answers(client: AsyncClient) -> bool:
    try:
        await client.info()
    except Unavailable:
        return False
    return True


async def eventually(client: AsyncClient, wanted: bool) -> None:
    """Poll (bounded) until the node answers through the proxy iff ``wanted``."""
    for _ in range(50):
        if await answers(client) == wanted:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the proxied node {'never' if wanted else 'still'} answers")


def write(control: Path, document: object) -> None:
    staged = control.with_suffix(".tmp")
    staged.write_text(json.dumps(document) if not isinstance(document, str) else document)
    staged.replace(control)


@pytest.mark.slow
async def test_the_control_file_cuts_and_heals_a_running_link(
    proxied: tuple[AsyncClient, Path],
) -> None:
    client, control = proxied
    await eventually(client, True)  # no control file yet: healthy
    write(control, {"l": {"mode": "cut"}})
    await eventually(client, False)
    write(control, "{not json")  # ignored: the cut stays
    await asyncio.sleep(3 * proxy_command.CONTROL_POLL_SECONDS)
    assert not await answers(client)
    write(control, {})
    await eventually(client, True)
    with contextlib.suppress(FileNotFoundError):
        control.unlink()
    await eventually(client, True)
