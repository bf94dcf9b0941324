"""The node's server interceptors (telemetry, authorization, budgets), as one.

gRPC's aio interceptor receives a method's handler and returns one. An
interceptor here is a function from a method's behaviour to another (``wrap``,
told the method's ``Shape``), applied once per method: :class:`Chain`, the one
gRPC interceptor the server has, does the unwrapping and re-wrapping for each of
gRPC's four shapes, keeping the method's (de)serializers, and keeps the result.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
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


class Interceptor:
    """One concern around every method (telemetry, authorization, budgets)."""

    def wrap(self, method: str, behaviour: Behaviour, shape: Shape) -> Behaviour | None:
        """The behaviour that replaces ``method``'s ``behaviour``, or None to leave it.
        Called once per method, not per call: what a call brings (its metadata, its
        peer) the returned behaviour reads from the call's context."""
        raise NotImplementedError


class Chain(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """The node's one gRPC interceptor: ``interceptors`` (the first outermost) wrapped
    around each method once, on its first call, and the result kept.

    gRPC's aio server runs every interceptor's ``intercept_service`` on every call;
    a stack of three rebuilt three handlers and three closures per call. This runs
    one, which on every call but a method's first only looks its handler up."""

    def __init__(self, interceptors: Sequence[Interceptor]) -> None:
        self.interceptors = tuple(interceptors)
        # method -> (the servicer's handler, the wrapped one)
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(details)
        # None (despite the stubs) for a method no servicer has: gRPC answers UNIMPLEMENTED.
        if handler is None:
            return handler  # type: ignore[return-value]
        kept = self._wrapped.get(details.method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(details.method, handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        for shape, make in _HANDLER_OF.items():
            behaviour = getattr(handler, shape.value)
            if behaviour is None:
                continue
            for interceptor in reversed(self.interceptors):
                behaviour = interceptor.wrap(method, behaviour, shape) or behaviour
            return make(
                behaviour,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
