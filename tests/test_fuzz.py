"""Hostile and malformed input against a real ``fencemark node`` process.

Hypothesis generates request messages for every method of the public services and
of the replication service, from the proto descriptors themselves (so a new field
is fuzzed the day it is added): strings of every shape, out-of-range numbers, NaN
and infinities, odd nesting. Raw bytes that are no message at all, and messages
over the configured size limit, are sent too. Every call must end in a proper
status — never ``UNKNOWN`` or ``INTERNAL`` — and a refused call must change
nothing (the node's digest-tree root and record count are compared before and
after). The process must still be alive and healthy at the end.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencemark.node.api.handlers import SERVICES
from fencemark.node.api.server import MAX_RECEIVE_BYTES
from fencemark.node.api.service import CURSOR_HEADER
from fencemark.v1 import node_pb2, node_pb2_grpc, replication_pb2, replication_pb2_grpc
from tests.ports import free_port

FD = descriptor.FieldDescriptor
# A refusal is one of these; anything else (UNKNOWN, INTERNAL, ...) is a defect.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE,  # NOT_SERVING: never here, the node has no peers
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_DEADLINE_S = 10.0
INTERESTING = [
    "", " ", "\x00", "repo/fuzz/mem/t/i", "repo/fuzz/mem/t/", "repo//mem//", "../../etc",
    "homeRegion:", "homeRegion:us", "ü" * 40, "a" * 300, "\ud7ff\ue000", "%s%n", "repo",
]  # fmt: skip
INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1), FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1), FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}  # fmt: skip


def strings() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(INTERESTING), st.text(max_size=40))


def scalar(field: descriptor.FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_STRING:
        return strings()
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        if field.type == FD.TYPE_FLOAT:
            return st.floats(allow_nan=True, allow_infinity=True, width=32)
        return st.floats(allow_nan=True, allow_infinity=True)
    if field.type == FD.TYPE_ENUM:
        return st.integers(0, 8)  # known values and unknown ones
    low, high = INT_RANGES[field.type]
    edges = st.sampled_from([low, high, 0, 1, 2**20, 2**31 - 1])
    return st.one_of(edges, st.integers(low, high), st.integers(0, 100))


def messages(message: descriptor.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of type ``message``: every field optional, nesting bounded."""
    cls = message_factory.GetMessageClass(message)
    values: dict[str, st.SearchStrategy[Any]] = {}
    for field in message.fields:
        entry = field.message_type
        if field.type == FD.TYPE_MESSAGE and entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            values[field.name] = st.dictionaries(scalar(key), _value(value, depth), max_size=4)
        elif field.is_repeated:
            values[field.name] = st.lists(_value(field, depth), max_size=4)
        else:
            values[field.name] = _value(field, depth)
    return st.fixed_dictionaries({}, optional=values).map(lambda kw: _build(cls, kw))


def _value(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_MESSAGE:
        assert field.message_type is not None
        if depth >= 2:
            return st.just(message_factory.GetMessageClass(field.message_type)())
        return messages(field.message_type, depth + 1)
    return scalar(field)


def _build(cls: type[Message], values: dict[str, Any]) -> Message:
    made = cls()
    for name, value in values.items():
        target = getattr(made, name)
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, Message):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif isinstance(value, list):
            if value and isinstance(value[0], Message):
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif isinstance(value, Message):
            target.CopyFrom(value)
        else:
            setattr(made, name, value)
    if hasattr(made, "wait_seconds") and math.isfinite(made.wait_seconds):
        # A valid wait on a contended record may legitimately outlast the deadline.
        made.wait_seconds = min(made.wait_seconds, 0.5)
    return made


METHODS = [(service, method) for service in SERVICES for method in service.methods]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``fencemark node`` process with writes enabled, and its address."""
    address = f"127.0.0.1:{free_port()}"
    data = tmp_path_factory.mktemp("fuzz")
    process = subprocess.Popen(
        [sys.executable, "-m", "fencemark.node", "node", "--region", "us", "--listen", address,
         "--enable-writes", "--insecure", "--data", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    process.stdout.readline()
    yield address
    alive = process.poll() is None
    process.terminate()
    output, _ = process.communicate(timeout=30)
    assert alive, f"the node died during fuzzing:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]


@pytest.fixture(scope="module")
def channel(target: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        target, options=[("grpc.max_send_message_length", 2 * MAX_RECEIVE_BYTES)]
    ) as made:
        yield made


def fingerprint(channel: grpc.Channel) -> tuple[bytes, int]:
    """The node's whole state in two numbers: its digest-tree root and record count."""
    tree = replication_pb2_grpc.ReplicationStub(channel).Tree(
        replication_pb2.TreeRequest(origin=replication_pb2.Origin(region="fuzz"), level=0),
        timeout=CALL_DEADLINE_S)  # fmt: skip
    info = node_pb2_grpc.NodeStub(channel).Info(node_pb2.InfoRequest(), timeout=CALL_DEADLINE_S)
    return tree.hashes, info.record_count


def call(channel: grpc.Channel, service: Any, method: Any, request: bytes) -> grpc.StatusCode:
    response = message_factory.GetMessageClass(method.output_type)
    if method.server_streaming:  # Records.Watch: accepted once the stream starts
        stream = channel.unary_stream(
            f"/{service.full_name}/{method.name}",
            request_serializer=lambda raw: raw,
            response_deserializer=response.FromString,
        )(request, timeout=CALL_DEADLINE_S)
        started = dict(stream.initial_metadata() or ())
        if CURSOR_HEADER in started:
            stream.cancel()  # type: ignore[no-untyped-call]
            return grpc.StatusCode.OK
        return stream.code()
    stub = channel.unary_unary(
        f"/{service.full_name}/{method.name}",
        request_serializer=lambda raw: raw,
        response_deserializer=response.FromString,
    )
    try:
        stub(request, timeout=CALL_DEADLINE_S)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.slow
@pytest.mark.parametrize(("service", "method"), METHODS, ids=lambda m: getattr(m, "name", ""))
def test_every_request_gets_a_proper_status_and_a_refusal_changes_nothing(
    channel: grpc.Channel, service: Any, method: Any
) -> None:
    @settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
              deadline=None)  # fmt: skip
    @given(request=messages(method.input_type))
    def property_holds(request: Message) -> None:
        before = fingerprint(channel)
        code = call(channel, service, method, request.SerializeToString())
        assert code == grpc.StatusCode.OK or code in REFUSALS, f"{method.name}: {code}"
        if code != grpc.StatusCode.OK:
            assert fingerprint(channel) == before, f"{method.name} refused ({code}) yet wrote"

    property_holds()


@pytest.mark.slow
@pytest.mark.parametrize(("service", "method"), METHODS, ids=lambda m: getattr(m, "name", ""))
def test_bytes_that_are_no_message_are_refused_as_invalid(
    channel: grpc.Channel, service: Any, method: Any
) -> None:
    @settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None,
              max_examples=25)  # fmt: skip
    @given(raw=st.binary(min_size=1, max_size=64))
    def property_holds(raw: bytes) -> None:
        cls = message_factory.GetMessageClass(method.input_type)
        try:
            cls.FromString(raw)
        except Exception:
            pass
        else:
            return  # these bytes happen to parse: the first test covers messages
        before = fingerprint(channel)
        code = call(channel, service, method, raw)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method.name}: {code}"
        assert fingerprint(channel) == before

    property_holds()


@pytest.mark.slow
def test_a_message_over_the_size_limit_is_refused_by_grpc(channel: grpc.Channel) -> None:
    records = next((s, m) for s, m in METHODS if m.name == "Remember")
    big = message_factory.GetMessageClass(records[1].input_type)(
        repo="fuzz", topic="t", id="big", body="x" * (MAX_RECEIVE_BYTES + 1)
    )
    before = fingerprint(channel)
    assert call(channel, *records, big.SerializeToString()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fingerprint(channel) == before


@pytest.mark.slow
def test_the_node_is_still_healthy_after_the_fuzzing(channel: grpc.Channel, target: str) -> None:
    started = time.monotonic()
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=CALL_DEADLINE_S)  # fmt: skip
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert time.monotonic() - started < CALL_DEADLINE_S
    # The ``target`` fixture's teardown then checks the process never died.
