"""The shape both of the node's server interceptors share (telemetry, authorization).

gRPC's aio interceptor receives a method's handler and returns one; every
fencemark.v1 method is unary, so an interceptor here is a function from a unary
behaviour to another (``wrap``), and this base class does the unwrapping and
re-wrapping around it, keeping the method's (de)serializers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Any, Any]"]]


class UnaryInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def wrap(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> Handler | None:
        """The behaviour that replaces ``handler``'s unary one, or None to leave it."""
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        # None (despite the stubs) for a method no servicer has: gRPC answers UNIMPLEMENTED.
        if handler is None or (wrapped := self.wrap(details, handler)) is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
