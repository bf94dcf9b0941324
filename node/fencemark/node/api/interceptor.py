"""The one base of the node's server interceptors (telemetry, authorization, budgets).

gRPC's aio interceptor receives a method's handler and returns one. An
interceptor here is a function from a method's behaviour to another (``wrap``,
told the method's ``Shape``); this base does the unwrapping and re-wrapping
around it for each of gRPC's four shapes, keeping the method's (de)serializers.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

import grpc

# A unary method's behaviour; a streaming one is an async generator of the same arguments.
Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
Behaviour = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable["grpc.RpcMethodHandler[Any, Any]"]]


class Shape(StrEnum):
    """A method's shape: the name of its behaviour's attribute on the handler."""

    UNARY = "unary_unary"
    SERVER_STREAMING = "unary_stream"
    CLIENT_STREAMING = "stream_unary"
    BIDI_STREAMING = "stream_stream"


_HANDLER_OF = {
    Shape.UNARY: grpc.unary_unary_rpc_method_handler,
    Shape.SERVER_STREAMING: grpc.unary_stream_rpc_method_handler,
    Shape.CLIENT_STREAMING: grpc.stream_unary_rpc_method_handler,
    Shape.BIDI_STREAMING: grpc.stream_stream_rpc_method_handler,
}


def awaited(shape: Shape, behaviour: Behaviour) -> bool:
    """Whether ``behaviour`` is one coroutine to await: a unary method's, or a server
    stream that writes its responses to the context (``Records.Watch``) rather than
    yielding them."""
    if shape is Shape.UNARY:
        return True
    return shape is Shape.SERVER_STREAMING and not inspect.isasyncgenfunction(behaviour)


class Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def wrap(
        self, details: grpc.HandlerCallDetails, behaviour: Behaviour, shape: Shape
    ) -> Behaviour | None:
        """The behaviour that replaces the method's ``behaviour``, or None to leave it."""
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(details)
        # None (despite the stubs) for a method no servicer has: gRPC answers UNIMPLEMENTED.
        if handler is None:
            return handler  # type: ignore[return-value]
        for shape, make in _HANDLER_OF.items():
            behaviour = getattr(handler, shape.value)
            if behaviour is None:
                continue
            wrapped = self.wrap(details, behaviour, shape)
            if wrapped is None:
                return handler
            return make(
                wrapped,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
