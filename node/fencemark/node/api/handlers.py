"""The write gate: each fencemark service's gRPC handlers, only its reads when writes
are disabled (unregistered: UNIMPLEMENTED), taking raw bytes so a request that does
not parse is INVALID_ARGUMENT naming ``request``; and the class of every method
(read, write, replication) for the call budgets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor, descriptor_pb2, message_factory
from google.protobuf.message import DecodeError, Message

# grpc-stubs predates the asyncio health servicer; it is grpc_health.v1.health.aio.
from fencemark.node.api.service import (
    refuse,
)
from fencemark.node.rules.errors import InvalidInput
from fencemark.node.store.storage import (
    DB_FILE as DB_FILE,  # re-exported: where a node keeps its file
)
from fencemark.v1 import claims_pb2, node_pb2, records_pb2, replication_pb2

SERVICES: tuple[descriptor.ServiceDescriptor, ...] = (
    records_pb2.DESCRIPTOR.services_by_name["Records"],
    claims_pb2.DESCRIPTOR.services_by_name["Claims"],
    node_pb2.DESCRIPTOR.services_by_name["Node"],
    replication_pb2.DESCRIPTOR.services_by_name["Replication"],
)
REPLICATION_SERVICE = "fencemark.v1.Replication"


def is_read(method: descriptor.MethodDescriptor) -> bool:
    level = method.GetOptions().idempotency_level
    return bool(level == descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS)


def call_classes() -> dict[str, str]:
    """Each fencemark.v1 method's class of call budget (fencemark.node.api.budgets)."""
    classes = {}
    for service in SERVICES:
        for method in service.methods:
            kind = "read" if is_read(method) else "write"
            if service.full_name == REPLICATION_SERVICE:
                kind = "replication"
            classes[f"/{service.full_name}/{method.name}"] = kind
    return classes


def gated_handler(
    servicer: object, service: descriptor.ServiceDescriptor, *, writes_enabled: bool
) -> grpc.GenericRpcHandler[Any, Any]:
    """The service's method handlers; only its reads when writes are disabled."""
    handlers = {}
    for method in service.methods:
        if not writes_enabled and not is_read(method):
            continue
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        shape = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = shape(
            decoding(getattr(servicer, method.name), request),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def decoding(
    method: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]],
    request_type: type[Message],
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    """The servicer method, taking the request's raw bytes.

    gRPC would answer bytes that do not parse with UNKNOWN (and log a traceback);
    they are bad input like any other: INVALID_ARGUMENT naming ``request``.
    """

    async def handler(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            name = request_type.DESCRIPTOR.full_name
            await refuse(
                context, InvalidInput.field("request", f"not a valid {name} message ({exc})")
            )
        return await method(request, context)

    return handler
