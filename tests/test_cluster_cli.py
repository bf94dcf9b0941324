"""``fencemark cluster`` and the ways a node learns its peers (flags, env, config file)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from fencemark.client import AsyncClient
from fencemark.node.replication.peers import parse_peers
from fencemark.node.tools.cli import build_parser
from fencemark.node.tools.cli_node import load_config
from tests.cluster import eventually
from tests.ports import free_ports
from tests.test_cli import clean_env

pytestmark = pytest.mark.slow


async def test_fencemark_cluster_runs_peered_regions_until_interrupted(tmp_path: Path) -> None:
    base, _ = free_ports(2, consecutive=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencemark.node", "cluster", "--regions", "us,eu",
        "--base-port", str(base), "--data", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    seen: dict[str, str] = {}
    try:
        async with asyncio.timeout(60):
            while len(seen) < 2:
                line = (await proc.stdout.readline()).decode()
                assert line, "fencemark cluster exited early"
                if match := re.search(r"region (\w+)\s+listening on (\S+)", line):
                    seen[match.group(1)] = match.group(2)
        assert seen == {"us": f"127.0.0.1:{base}", "eu": f"127.0.0.1:{base + 1}"}
        async with AsyncClient(seen["us"]) as us, AsyncClient(seen["eu"]) as eu:
            made = await us.remember("c", "t", "x", title="from us")

            async def replicated() -> bool:
                return [r.key for r in (await eu.list("c")).records] == [made.record.key]

            await eventually(replicated, "a write at us visible at eu", within=20)
            assert [p.region for p in (await us.info()).peers] == ["eu"]
        assert (tmp_path / "us" / "fencemark.sqlite3").is_file()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0


def test_peers_come_from_flags_env_or_config_in_that_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "node.toml"
    config_file.write_text(
        'region = "us"\nenable_writes = true\nanti_entropy_interval = 0.5\n'
        '[peers]\neu = "eu.example:7400"\nap = "ap.example:7400"\n'
    )
    for name in [n for n in os.environ if n.startswith("FENCEMARK_")]:
        monkeypatch.delenv(name)
    config = load_config(str(config_file))

    args = build_parser(config).parse_args(["node"])
    assert (args.region, args.enable_writes, args.anti_entropy_interval) == ("us", True, 0.5)
    assert parse_peers(args.peer or args.configured_peers, own_region=args.region) == {
        "eu": "eu.example:7400",
        "ap": "ap.example:7400",
    }

    monkeypatch.setenv("FENCEMARK_PEERS", "eu=env.example:1")
    monkeypatch.setenv("FENCEMARK_REGION", "ap")
    args = build_parser(config).parse_args(["node"])
    assert args.region == "ap"
    assert parse_peers(args.peer or args.configured_peers, own_region=args.region) == {
        "eu": "env.example:1"
    }

    args = build_parser(config).parse_args(["node", "--peer", "us=flag.example:2"])
    assert parse_peers(args.peer or args.configured_peers, own_region=args.region) == {
        "us": "flag.example:2"
    }


@pytest.mark.parametrize(
    "spec, why",
    [
        ("eu", "REGION=HOST:PORT"),
        ("eu=nowhere", "REGION=HOST:PORT"),
        ("us=h:1", "own region"),
        ("bad region!=h:1", "region must match"),
        ("eu=h:1,nowhere", "REGION=HOST:PORT"),
        ("h:1,eu=h:2", "REGION=HOST:PORT"),
    ],
)
def test_a_bad_peer_is_refused_with_a_reason(spec: str, why: str) -> None:
    from fencemark.node.rules.errors import InvalidInput

    with pytest.raises(InvalidInput) as refused:
        parse_peers([spec], own_region="us")
    assert why in str(refused.value)


def test_a_region_of_several_members_is_given_every_address_that_serves_it() -> None:
    """``--peer eu=A,B`` (or ``--peer eu=A,B --peer ap=C``): each address after a
    region's adds to it; the first is tried first (``PeerStats.next_address``)."""
    assert parse_peers(["eu=a:1,b:2,ap=c:3", "jp=d:4"], own_region="us") == {
        "eu": "a:1,b:2", "ap": "c:3", "jp": "d:4",
    }  # fmt: skip
    assert parse_peers(["eu=a:1,b:2", "eu=a:1,b:2"], own_region="us") == {"eu": "a:1,b:2"}
    from fencemark.node.rules.errors import InvalidInput

    with pytest.raises(InvalidInput, match="given twice"):
        parse_peers(["eu=a:1", "eu=b:2"], own_region="us")
    from fencemark.node.replication.peers import PeerStats

    stats = PeerStats("eu", "a:1,b:2")
    assert (stats.address, stats.addresses) == ("a:1", ("a:1", "b:2"))
    assert stats.next_address() and stats.address == "b:2"
    assert stats.next_address() and stats.address == "a:1"
    assert not PeerStats("ap", "c:3").next_address()
