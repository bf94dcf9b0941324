"""Metrics, request ids and logs, read the way operators read them.

The metrics are scraped over HTTP from a real node's endpoint and parsed with
Prometheus' own parser; the JSON logs come from a real ``fencemark node`` process,
the records of callers that left from a node in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fencemark.client import AsyncClient, ClaimConflict
from fencemark.node.api.server import NodeServer
from fencemark.node.api.telemetry import REQUEST_ID_METADATA
from fencemark.v1 import claims_pb2, claims_pb2_grpc, records_pb2, records_pb2_grpc
from tests.cluster import Cluster, eventually
from tests.conftest import StartNode
from tests.ports import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(node: NodeServer) -> Samples:
    """Every sample of the node's /metrics: (name, sorted labels) -> value."""
    url = f"http://127.0.0.1:{node.metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
async def test_requests_refusals_claims_and_commits_are_counted(start_node: StartNode) -> None:
    node = await start_node(region="us", metrics_listen="127.0.0.1:0")
    async with AsyncClient(node.address) as client:
        made = await client.remember("m", "t", "a", title="x", tags=["homeRegion:us"])
        key = made.record.key
        first = await client.claim(key, "alice", lease_seconds=30)
        second = await client.claim(key, "bob")  # contended: a value, not an error
        assert first.granted and not second.granted
        await client.update(key, fields={"p": "1"}, fencing_token=first.fencing_token)
        with pytest.raises(ClaimConflict):
            await client.update(key, fields={"p": "2"}, fencing_token=first.fencing_token + 1)
    # A refused call is counted as its handler unwinds, just after the status went
    # out: the client (in this process) can see the refusal a moment before that.
    samples: Samples = {}

    async def refusal_counted() -> bool:
        nonlocal samples
        samples = await asyncio.to_thread(scrape, node)
        return value(samples, "fencemark_requests_total", method="Update",
                     code="FAILED_PRECONDITION") == 1  # fmt: skip

    await eventually(refusal_counted, "the refused Update counted", within=5)
    assert value(samples, "fencemark_requests_total", method="Remember", code="OK") == 1
    assert value(samples, "fencemark_requests_total", method="Update", code="OK") == 1
    assert value(samples, "fencemark_requests_total", method="Update",
                 code="FAILED_PRECONDITION") == 1  # fmt: skip
    assert value(samples, "fencemark_refusals_total", method="Update", reason="unknown_token") == 1
    assert value(samples, "fencemark_refusals_total", method="Claim", reason="contended") == 1
    assert value(samples, "fencemark_claims_total", outcome="granted") == 1
    assert value(samples, "fencemark_claims_total", outcome="contended") == 1
    assert value(samples, "fencemark_request_seconds_count", method="Claim") == 2
    assert value(samples, "fencemark_commit_batch_writes_count") >= 3  # remember, grant, update
    assert value(samples, "fencemark_commit_seconds_sum") > 0
    assert value(samples, "fencemark_records") == 1
    assert value(samples, "fencemark_claims_serving") == 1
    assert value(samples, "fencemark_node_info", region="us", version=_version()) == 1


@pytest.mark.slow
async def test_waiting_claimers_and_their_clients_are_gauged(start_node: StartNode) -> None:
    """``fencemark_claim_waiters`` counts callers in line, ``fencemark_claim_waiting_clients``
    the clients they come from (one address here), back to 0 when they leave."""
    node = await start_node(metrics_listen="127.0.0.1:0")
    async with AsyncClient(node.address) as client:
        made = await client.remember("m", "t", "waited", title="x")
        key = made.record.key
        assert (await client.claim(key, "holder", lease_seconds=60)).granted
        line = [
            asyncio.create_task(client.claim(key, owner, wait_seconds=60)) for owner in ("w1", "w2")
        ]

        async def waiting(n: int) -> bool:
            return node.claims.waiting == n

        await eventually(lambda: waiting(2), what="two claimers in line")
        samples = await asyncio.to_thread(scrape, node)
        assert value(samples, "fencemark_claim_waiters") == 2
        assert value(samples, "fencemark_claim_waiting_clients") == 1
        for task in line:
            task.cancel()
        await asyncio.gather(*line, return_exceptions=True)
        await eventually(lambda: waiting(0), what="the line empty")
        samples = await asyncio.to_thread(scrape, node)
        assert value(samples, "fencemark_claim_waiting_clients") == 0


def _version() -> str:
    from fencemark.node import __version__

    return __version__


@pytest.mark.slow
async def test_replication_is_reported_per_peer(tmp_path: Path) -> None:
    async with Cluster(tmp_path, ["us", "eu"], metrics_listen="127.0.0.1:0") as cluster:
        us, eu = await cluster.start_all()
        async with AsyncClient(us.address) as client:
            await client.remember("m", "t", "a", title="x", tags=["homeRegion:us"])

        async def sent() -> bool:
            samples = await asyncio.to_thread(scrape, us)
            reachable = value(samples, "fencemark_replication_reachable", peer="eu") == 1
            sent = value(samples, "fencemark_replication_records_sent_total", peer="eu")
            return reachable and sent >= 1

        await eventually(sent, "us reports eu reachable and a record sent to it")
        samples = await asyncio.to_thread(scrape, us)
        assert value(samples, "fencemark_replication_bytes_sent_total", peer="eu") > 0
        assert value(samples, "fencemark_replication_reachable", peer="eu") == 1
        assert ("fencemark_replication_lag_seconds", (("peer", "eu"),)) in samples
        eu_samples = await asyncio.to_thread(scrape, eu)
        assert value(eu_samples, "fencemark_replication_records_received_total", peer="us") >= 1


async def test_no_metrics_endpoint_unless_asked(node: NodeServer) -> None:
    assert node.metrics.port == 0


@pytest.fixture
def json_node(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A ``fencemark node`` process logging JSON at INFO, and its address."""
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "fencemark.node", "--log-format", "json", "--log-level", "INFO",
         "node", "--listen", address, "--enable-writes", "--insecure", "--data", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    process.stdout.readline()  # its banner: "region ... listening on ..."
    yield process, address
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.slow
def test_json_logs_carry_the_callers_request_id(
    json_node: tuple[subprocess.Popen[str], str],
) -> None:
    process, address = json_node
    with grpc.insecure_channel(address) as channel:
        stub = records_pb2_grpc.RecordsStub(channel)
        for given in ("req-1234", "req-5678"):  # each call its own id, not its method's
            stub.Remember(records_pb2.RememberRequest(repo="m", topic="t", id="a", title="x"),
                          metadata=((REQUEST_ID_METADATA, given),), timeout=10)  # fmt: skip
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                stub.Get(records_pb2.GetRequest(key="repo/m/mem/t/nope"), timeout=10)
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "fencemark.node.access"]
    remembered = [line for line in access if line["method"] == "Remember"]
    assert [line["request_id"] for line in remembered] == ["req-1234", "req-5678"]
    assert remembered[0]["code"] == "OK" and remembered[0]["level"] == "INFO"
    missing = [line for line in access if line["method"] == "Get"]
    assert missing[0]["code"] == "NOT_FOUND" and missing[0]["reason"] == "not_found"
    made_up = {line["request_id"] for line in missing}  # none given: one made up per call
    assert len(made_up) == 2 and all(len(id_) == 16 for id_ in made_up)
    assert all(line["time"].endswith("Z") for line in lines)


@pytest.mark.slow
async def test_status_shows_every_peer_of_every_node_at_a_glance(tmp_path: Path) -> None:
    async with Cluster(tmp_path, ["us", "eu", "ap"]) as cluster:
        await cluster.start_all(["us", "eu"])  # ap's node is down: its peers say so
        targets = [cluster.addresses["us"], cluster.addresses["eu"], cluster.addresses["ap"]]

        async def status() -> str:
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "fencemark.node", "status", "--timeout", "2",
                 "--targets", *targets],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            return done.stdout

        async def settled() -> bool:
            shown = await status()
            return "peer eu       reachable" in shown and "peer us       reachable" in shown

        await eventually(settled, "us and eu see each other", within=20)
        lines = (await status()).splitlines()
    us_row = lines.index(next(line for line in lines if line.startswith(targets[0])))
    assert lines[us_row].split()[1] == "us" and "SERVING" in lines[us_row]
    peers = {line.split()[1]: line for line in lines[us_row + 1 : us_row + 3]}
    assert "reachable" in peers["eu"] and "divergence" in peers["eu"]
    assert "UNREACHABLE" in peers["ap"] and "last error:" in peers["ap"]
    assert any(line.startswith(targets[2]) and "unreachable" in line for line in lines)
    assert lines[-1].startswith("2 of 3 nodes serving")


# -- one line of every kind a node writes, in JSON -------------------------------------

JSON_KEYS = {"time", "level", "logger", "message"}


@pytest.mark.slow
def test_every_line_a_json_logging_node_writes_is_json(tmp_path: Path) -> None:
    """From its start-up banner to its last line after SIGTERM, on stdout and stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fencemark.node", "--log-format", "json", "--log-level", "INFO",
         "node", "--listen", "127.0.0.1:0", "--enable-writes", "--insecure",
         "--data", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        banner = json.loads(process.stdout.readline())  # the node serves from here on
        with grpc.insecure_channel(banner["address"]) as channel:
            records_pb2_grpc.RecordsStub(channel).Remember(
                records_pb2.RememberRequest(repo="m", topic="t", id="a", title="x"), timeout=10
            )
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert process.returncode == 0, stderr
    assert banner["level"] == "INFO" and "listening on 127.0.0.1:" in banner["message"]
    lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
    assert len(lines) >= 3  # the server's start, the Remember, the stop
    for line in lines:
        assert json.loads(line).keys() >= JSON_KEYS, line


@pytest.mark.slow  # spawns a process (the CLI, a node or a browser)
def test_a_node_that_cannot_start_says_why_in_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fencemark.node", "--log-format", "json", "node", "--insecure",
         "--data", str(tmp_path), "--cache-size", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    said = json.loads(line)
    assert said.keys() >= JSON_KEYS and said["level"] == "ERROR"
    assert "--cache-size" in said["message"]


# -- callers that leave ------------------------------------------------------------------


def left_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "caller_left", False)]


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Records an operator would be paged on: errors, and tracebacks of any level."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_caller_that_leaves_is_one_info_record_naming_its_call(
    node: NodeServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim that waits past its caller's deadline, and a watch its caller cancels.
    The claim's deadline (2 s) is long beside ``DEADLINE_SLACK_S``: its client cancels
    it as the deadline passes, which the node, counting from the call's arrival, sees
    a little before its own (a loaded machine once named it ``CANCELLED`` at 0.3 s)."""
    caplog.set_level(logging.DEBUG)
    async with grpc.aio.insecure_channel(node.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as gave_up:
            await claims_pb2_grpc.ClaimsStub(channel).ClaimNext(
                claims_pb2.ClaimNextRequest(repo="m", topic="t", owner="w", wait_seconds=30),
                timeout=2.0, metadata=((REQUEST_ID_METADATA, "left-waiting"),),
            )  # fmt: skip
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        watch = records_pb2_grpc.RecordsStub(channel).Watch(
            records_pb2.WatchRequest(repo="m"), metadata=((REQUEST_ID_METADATA, "left-watching"),)
        )
        await watch.initial_metadata()
        watch.cancel()

    async def both_logged() -> bool:
        return len(left_records(caplog)) >= 2

    await eventually(both_logged, "both callers that left logged", within=5)
    await asyncio.sleep(0.2)  # and nothing more of them
    left = left_records(caplog)
    assert sorted((r.method, r.code, r.request_id) for r in left) == [  # type: ignore[attr-defined]
        ("ClaimNext", "DEADLINE_EXCEEDED", "left-waiting"),
        ("Watch", "CANCELLED", "left-watching"),
    ]
    assert all(r.levelno == logging.INFO and r.name == "fencemark.node.access" for r in left)
    assert all("the caller left" in r.getMessage() for r in left)
    assert errors(caplog) == []
    said_by_grpc = [r for r in caplog.records if "RPC cancelled for servicer" in r.getMessage()]
    assert said_by_grpc == []  # said once, by the node


@pytest.mark.slow
async def test_replies_to_callers_that_left_are_never_logged_as_errors(
    node: NodeServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Claims whose wait ends as their deadline passes: now and then a reply goes to a
    call that just ended, which gRPC logs at ERROR with a traceback (ExecuteBatchError)
    unless the node says it, once, as a caller that left."""
    caplog.set_level(logging.INFO)
    wait, calls = 0.03, 300
    async with grpc.aio.insecure_channel(node.address) as channel:
        claims = claims_pb2_grpc.ClaimsStub(channel)

        async def call(n: int) -> None:
            early_or_late = -0.002 + 0.004 * (n % 20) / 19  # around the end of the wait
            with contextlib.suppress(grpc.aio.AioRpcError):
                await claims.ClaimNext(
                    claims_pb2.ClaimNextRequest(repo="m", topic="t", owner=f"w{n % 5}",
                                                wait_seconds=wait),
                    timeout=wait + early_or_late, metadata=((REQUEST_ID_METADATA, f"race-{n}"),),
                )  # fmt: skip

        for first in range(0, calls, 5):
            await asyncio.gather(*(call(n) for n in range(first, first + 5)))
    await asyncio.sleep(0.2)  # the last handlers end
    assert errors(caplog) == []
    left = left_records(caplog)
    ids = [r.request_id for r in left]  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids)), "a caller that left was logged more than once"
    assert set(ids) <= {f"race-{n}" for n in range(calls)}
    assert {r.method for r in left} <= {"ClaimNext"}  # type: ignore[attr-defined]
