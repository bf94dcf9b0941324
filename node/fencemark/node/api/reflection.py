"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` and
``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha (grpc/grpc#38576), while current grpcurl and
``buf curl`` ask for v1 first. The two protos are wire-identical: the same messages
with the same field numbers, only the package differs. So the one servicer the
package provides answers both services, its v1alpha messages decoding and encoding
the v1 wire format as they are.

A reflection client also asks for the descriptor of every service it is told of,
the reflection service included; for v1 to be described the default descriptor
pool gets ``grpc/reflection/v1/reflection.proto``, made from v1alpha's by renaming
its package (unless something already put the real one there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from fencemark.node.api.interceptor import Registrar

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1 = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor, renamed to v1's package and file."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.ClearField("deprecated")  # v1alpha is deprecated in favour of v1
    new = f".{V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return proto


def _describe_v1() -> None:
    """Put v1's descriptor in the default pool, once (the servicer reads that pool)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor().SerializeToString())


def enable(server: Registrar, service_names: Iterable[str]) -> None:
    """Serve reflection of ``service_names`` (and of itself) as v1 and as v1alpha."""
    _describe_v1()
    # grpc-stubs knows only the sync servicer; the asyncio one is reflection.aio's.
    aio = reflection.aio  # type: ignore[attr-defined]
    servicer = aio.ReflectionServicer([*service_names, V1ALPHA, V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, cast(Any, server))
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {METHOD: v1}),))
