"""SPEC §7: the ``fencemark`` command, run as a real subprocess against a real node subprocess.

The RPC subcommands mirror the gRPC API one to one and print JSON; what they print
must be what the Python client sees of the same node. Every subprocess has a
deadline: a command that hangs fails its test instead of the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from fencemark.client import AsyncClient, RememberResult
from fencemark.node.tools.cli_node import FULL_COLLECTION_EVERY, tune_collector
from fencemark.node.tools.process import NodeProcess

pytestmark = pytest.mark.slow  # every test here spawns subprocesses

REPO, TOPIC = "lattice", "backlog"
KEY = f"repo/{REPO}/mem/{TOPIC}/issue-2101"


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        assert self.code == 0, f"exit {self.code}: {self.stderr}"
        return json.loads(self.stdout)


def clean_env() -> dict[str, str]:
    """This environment without FENCEMARK_* settings that would change a command's defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FENCEMARK_")}


async def fencemark(*args: str, limit_s: float = 30.0) -> Ran:
    """Run ``python -m fencemark.node ARGS`` to completion (killed after ``limit_s``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fencemark.node",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean_env(),
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError:
        proc.kill()
        stdout, stderr = await proc.communicate()
        out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
        raise AssertionError(
            f"fencemark {' '.join(args)} still running after {limit_s} s;"
            f" stdout {out!r} stderr {err!r}"
        ) from None
    assert proc.returncode is not None
    return Ran(proc.returncode, stdout.decode(), stderr.decode())


def as_json(value: object) -> Any:
    """A client result as the CLI shows it: datetimes in ISO 8601, bytes in hex."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[NodeProcess]:
    proc = await NodeProcess.start(tmp_path / "data", region="local")
    try:
        yield proc
    finally:
        await proc.stop()


@pytest.fixture
async def client(node: NodeProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(node.address) as c:
        yield c


# -- the RPC subcommands -----------------------------------------------------------


async def test_rpc_subcommands_print_what_the_client_sees(
    node: NodeProcess, client: AsyncClient
) -> None:
    target = ("--target", node.address)

    remember = [
        "remember", *target, "--repo", REPO, "--topic", TOPIC, "--id", "issue-2101",
        "--kind", "Note", "--author", "backlog-pm", "--title", "Batch WAL fsyncs",
        "--body", "Group commits.", "--tag", "backlog", "--tag", "priority:P1",
        "--tag", "homeRegion:local", "--field", "baseBranch=feat/epic/wal-batching",
    ]  # fmt: skip
    remembered = (await fencemark(*remember)).json()
    record = await client.get(KEY)
    assert remembered == as_json(RememberResult(record, created=True))
    assert record.fields["baseBranch"] == "feat/epic/wal-batching"
    assert set(record.tags) == {"backlog", "priority:P1", "homeRegion:local"}

    assert (await fencemark("get", *target, KEY)).json() == as_json(await client.get(KEY))

    update = [
        "update", *target, KEY, "--field", "body=started", "--field", "phase=a=b",
        "--add-tag", "phase:implementation", "--remove-tag", "priority:P1",
    ]  # fmt: skip
    updated = (await fencemark(*update)).json()
    record = await client.get(KEY)
    assert updated == as_json(record)
    assert (record.body, record.fields["phase"]) == ("started", "a=b")
    assert "priority:P1" not in record.tags and "phase:implementation" in record.tags

    claimed = (
        await fencemark("claim", *target, KEY, "--owner", "worker-a", "--lease-seconds", "30")
    ).json()
    status = await client.claim_status(KEY)
    assert status.claim is not None
    assert claimed == as_json(
        {
            "granted": True,
            "fencing_token": status.claim.fencing_token,
            "lease_expires_at": status.claim.lease_expires_at,
            "reason": "",
            "home_region": "local",
        }
    )
    token = status.claim.fencing_token
    assert (await fencemark("claim-status", *target, KEY)).json() == as_json(status)

    renewed = (
        await fencemark(
            "renew-claim", *target, KEY, "--fencing-token", str(token), "--lease-seconds", "60"
        )
    ).json()
    status = await client.claim_status(KEY)
    assert status.claim is not None
    assert renewed == as_json(
        {
            "renewed": True,
            "fencing_token": token,
            "lease_expires_at": status.claim.lease_expires_at,
            "reason": "",
            "home_region": "local",
        }
    )

    fenced = (
        await fencemark(
            "update", *target, KEY, "--field", "body=fenced", "--fencing-token", str(token)
        )
    ).json()
    assert fenced == as_json(await client.get(KEY))
    assert fenced["fields"]["body"] == "fenced"

    released = (
        await fencemark("release-claim", *target, KEY, "--fencing-token", str(token))
    ).json()
    assert released == as_json(await client.release_claim(KEY, token))  # idempotent: same answer
    assert released["released"] is True

    await client.remember(REPO, TOPIC, "issue-1", title="another")
    await client.remember(REPO, "other", "issue-3", title="elsewhere")
    listed = (await fencemark("list", *target, "--repo", REPO, "--topic", TOPIC)).json()
    assert listed == as_json(await client.list(REPO, topic=TOPIC))
    assert [r["key"] for r in listed["records"]] == [f"repo/{REPO}/mem/{TOPIC}/issue-1", KEY]
    paged = (await fencemark("list", *target, "--repo", REPO, "--page-size", "1")).json()
    assert paged == as_json(await client.list(REPO, page_size=1))
    rest = (
        await fencemark("list", *target, "--repo", REPO, "--page-token", paged["next_page_token"])
    ).json()
    assert rest == as_json(await client.list(REPO, page_token=paged["next_page_token"]))

    gone = f"repo/{REPO}/mem/{TOPIC}/issue-1"
    deleted = (await fencemark("delete", *target, gone)).json()
    assert deleted["deleted"] is True
    with_tombstones = await client.list(REPO, topic=TOPIC, include_deleted=True)
    assert deleted == as_json(next(r for r in with_tombstones.records if r.key == gone))
    listed = (
        await fencemark("list", *target, "--repo", REPO, "--topic", TOPIC, "--include-deleted")
    ).json()
    assert listed == as_json(with_tombstones)

    info = (await fencemark("info", *target)).json()
    expected = as_json(await client.info())
    assert info["now"] is not None
    assert {k: v for k, v in info.items() if k != "now"} == {
        k: v for k, v in expected.items() if k != "now"
    }
    assert (info["region"], info["writes_enabled"], info["record_count"]) == ("local", True, 3)


async def test_a_missing_record_exits_1_with_the_reason(node: NodeProcess) -> None:
    ran = await fencemark("get", "--target", node.address, f"repo/{REPO}/mem/{TOPIC}/nope")
    assert ran.code == 1
    assert ran.stderr.startswith("fencemark: NOT_FOUND: ")
    assert ran.stdout == ""


async def test_bad_input_exits_1_naming_the_field(node: NodeProcess) -> None:
    ran = await fencemark("get", "--target", node.address, "not/a/key")
    assert ran.code == 1
    assert ran.stderr.startswith("fencemark: INVALID_ARGUMENT: key: "), ran.stderr


# -- exit codes (docs/api.md, Exit codes) ----------------------------------------------

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def documented_after(command: str) -> str:
    """The line docs/api.md shows right after ``$ COMMAND``: what it prints."""
    lines = API_DOC.read_text(encoding="utf-8").splitlines()
    return lines[lines.index(f"$ {command}") + 1]


def closed_port() -> str:
    """An address nothing listens on."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{closed.getsockname()[1]}"


async def test_a_granted_claim_exits_0_and_one_refused_as_a_value_3_with_its_answer(
    node: NodeProcess, client: AsyncClient
) -> None:
    """A refusal the API answers as a value exits 3, its JSON on stdout for scripts."""
    await client.remember(REPO, TOPIC, "issue-2101", title="x")
    target = ("--target", node.address)
    granted = await fencemark("claim", *target, KEY, "--owner", "worker-a")
    assert granted.code == 0 and json.loads(granted.stdout)["granted"] is True
    contended = await fencemark("claim", *target, KEY, "--owner", "worker-b")
    assert contended.code == 3, contended.stderr
    answer = json.loads(contended.stdout)
    assert (answer["granted"], answer["reason"]) == (False, "contended")
    assert contended.stderr == ""
    missing = await fencemark("claim", *target, f"repo/{REPO}/mem/{TOPIC}/nope", "--owner", "b")
    assert missing.code == 3 and json.loads(missing.stdout)["reason"] == "missing"
    token = str(json.loads(granted.stdout)["fencing_token"])
    wrong = str(int(token) + 5)
    renewed = await fencemark("renew-claim", *target, KEY, "--fencing-token", wrong)
    assert renewed.code == 3 and json.loads(renewed.stdout)["renewed"] is False
    released = await fencemark("release-claim", *target, KEY, "--fencing-token", token)
    assert released.code == 0 and json.loads(released.stdout)["released"] is True


async def test_claim_next_of_an_empty_topic_exits_3(node: NodeProcess) -> None:
    ran = await fencemark(
        "claim-next", "--target", node.address, "--repo", REPO, "--topic", "empty",
        "--owner", "worker-a",
    )  # fmt: skip
    assert ran.code == 3, ran.stderr
    answer = json.loads(ran.stdout)
    assert (answer["granted"], answer["reason"]) == (False, "empty")


async def test_a_refused_update_exits_1_saying_why_as_documented(
    node: NodeProcess, client: AsyncClient
) -> None:
    """docs/api.md's refused write, on the same record in the same state, word for word."""
    command = (
        "fencemark update repo/docs/mem/cli/item-1 --field body=sneaky --target 127.0.0.1:7400"
    )
    documented = documented_after(command)
    made = await client.remember("docs", "cli", "item-1", title="Try the CLI", tags=["backlog"])
    assert (await client.claim(made.record.key, "worker-a", lease_seconds=60)).fencing_token == 1
    args = command.split()[1:]
    ran = await fencemark(*args[: args.index("--target") + 1], node.address)
    assert ran.code == 1
    assert ran.stdout == ""
    assert ran.stderr == documented + "\n"


async def test_an_unreachable_node_exits_4_saying_nothing_listens() -> None:
    dead = closed_port()
    ran = await fencemark("list", "--repo", REPO, "--target", dead, "--timeout", "2")
    assert ran.code == 4
    assert ran.stdout == ""
    [line] = ran.stderr.splitlines()
    assert line.startswith(("fencemark: UNAVAILABLE: ", "fencemark: DEADLINE_EXCEEDED: "))
    assert line.endswith(f"; nothing listens at {dead}: is the node running, and --target right?")


async def test_health_keeps_docker_s_0_and_1(node: NodeProcess) -> None:
    """Docker's HEALTHCHECK reads 0 healthy, 1 unhealthy, and reserves 2: an unreachable
    node is 1 there, not the 4 of the RPC commands."""
    serving = await fencemark("health", "--target", node.address)
    assert serving.code == 0, serving.stderr
    dead = closed_port()
    down = await fencemark("health", "--target", dead, "--timeout", "1")
    assert down.code == 1
    assert f"nothing listens at {dead}" in down.stderr


# -- refused fenced writes -------------------------------------------------------------


async def refusal_setup(client: AsyncClient, reason: str) -> list[str]:
    """Put the record in a state that refuses a write; the CLI flags of that write."""
    first = await client.claim(KEY, "worker-a", lease_seconds=1 if reason == "expired" else 60)
    assert first.granted
    token = first.fencing_token
    if reason == "claimed":
        return []
    if reason == "superseded":
        assert (await client.release_claim(KEY, token)).released
        assert (await client.claim(KEY, "worker-b", lease_seconds=60)).granted
    elif reason == "released":
        assert (await client.release_claim(KEY, token)).released
    elif reason == "unknown_token":
        token += 5
    elif reason == "expired":
        assert first.lease_expires_at is not None
        now = (await client.info()).now  # the node's clock decides the lapse
        assert now is not None
        await asyncio.sleep((first.lease_expires_at - now).total_seconds() + 0.2)
    return ["--fencing-token", str(token)]


@pytest.mark.parametrize(
    "reason", ["claimed", "superseded", "released", "unknown_token", "expired"]
)
async def test_a_refused_fenced_write_exits_non_zero_with_the_conflict_reason(
    node: NodeProcess, client: AsyncClient, reason: str
) -> None:
    """The machine word (records.proto's conflict reasons) is what a script can act on."""
    await client.remember(REPO, TOPIC, "issue-2101", body="before")
    token_flags = await refusal_setup(client, reason)
    before = await client.get(KEY)
    ran = await fencemark(
        "update", "--target", node.address, KEY, "--field", "body=refused", *token_flags
    )
    assert ran.code == 1
    assert ran.stdout == ""
    assert ran.stderr.startswith(f"fencemark: FAILED_PRECONDITION {reason}: "), ran.stderr
    assert len(ran.stderr.splitlines()) == 1 and "Traceback" not in ran.stderr
    assert await client.get(KEY) == before


# -- operator commands ---------------------------------------------------------------


async def test_walkthrough_passes_and_prints_every_step(node: NodeProcess) -> None:
    ran = await fencemark("walkthrough", "--target", node.address, "--lease-seconds", "1")
    assert ran.code == 0, ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    for step in range(1, 8):
        assert any(f"step {step}:" in line for line in lines), f"no line for step {step}"
    assert not any(line.startswith("✗") for line in lines), ran.stdout


async def test_status_shows_each_target_with_its_region(
    node: NodeProcess, client: AsyncClient
) -> None:
    info = await client.info()
    dead = closed_port()
    ran = await fencemark("status", "--targets", node.address, dead, "--timeout", "1")
    assert ran.code == 0, ran.stderr  # a report: the node it cannot reach is a row of it
    lines = ran.stdout.splitlines()
    line = next(line for line in lines if line.startswith(node.address))
    assert line.split()[:3] == [node.address, "local", info.node_id]
    assert "SERVING" in line
    down = next(line for line in lines if line.startswith(dead))
    assert "unreachable" in down
    # A region of one node has no decider to name: --decider says so, exit 1.
    ran = await fencemark("status", "--targets", node.address, dead, "--decider", "--timeout", "1")
    assert (ran.code, ran.stdout) == (1, ""), ran.stderr
    assert "no target is a member of a region of several" in ran.stderr


async def second_node(listen: str, data: Path) -> Ran:
    """Start ``fencemark node --listen LISTEN``; it must fail, so it is stopped if it serves."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencemark.node", "node",
        "--listen", listen, "--data", str(data), "--region", "local", "--insecure",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        first_line = await asyncio.wait_for(proc.stdout.readline(), 15)
    except TimeoutError:
        first_line = b"(no output in 15 s)"
    if proc.returncode is None and b"listening on" in first_line:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)
    if proc.returncode is None:
        proc.kill()
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode is not None
    return Ran(proc.returncode, (first_line + stdout).decode(), stderr.decode())


def assert_refused_to_listen(ran: Ran, listen: str) -> None:
    assert "listening on" not in ran.stdout, (
        f"a second node started serving on {listen}, a port already in use: {ran.stdout!r}"
    )
    assert ran.code != 0
    assert listen in ran.stderr, f"the message does not name {listen}: {ran.stderr!r}"
    assert "Traceback" not in ran.stderr, ran.stderr


async def test_node_on_a_port_taken_by_another_program_fails_clearly(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        ran = await second_node(listen, tmp_path / "second")
    assert_refused_to_listen(ran, listen)


async def test_node_on_a_port_taken_by_another_node_fails_clearly(
    node: NodeProcess, tmp_path: Path
) -> None:
    """Two nodes must never share one address: clients would reach either at random."""
    ran = await second_node(node.address, tmp_path / "second")
    assert_refused_to_listen(ran, node.address)


async def test_a_node_refuses_a_cache_of_no_records(tmp_path: Path) -> None:
    ran = await fencemark("node", "--insecure", "--data", str(tmp_path), "--cache-size", "0")
    assert ran.code != 0
    assert "--cache-size" in ran.stderr


def test_a_node_process_runs_full_collections_a_hundred_times_less_often() -> None:
    """``fencemark node`` raises the collector's full-collection threshold (a full
    collection scans every cached record state: it took half of a repair's CPU)
    and leaves the young generations as Python sets them."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        tune_collector()
        assert gc.get_threshold() == (700, 10, FULL_COLLECTION_EVERY) == (700, 10, 1000)
    finally:
        gc.set_threshold(*before)
