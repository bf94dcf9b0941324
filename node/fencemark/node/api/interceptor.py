"""The node's server interceptors (telemetry, authorization, budgets), as one.

An interceptor here is a function from a method's behaviour to another (``wrap``,
told the method's ``Shape``), applied once per method: :class:`Chain` does the
unwrapping and re-wrapping for each of gRPC's four shapes, keeping the method's
(de)serializers, as :class:`Registrar` registers each service on the server. The
server itself has no gRPC interceptor: those run on every call.
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


class Chain:
    """``interceptors`` (the first outermost) wrapped around each method once, as the
    method is registered (:class:`Registrar`), not on every call.

    gRPC's aio server runs every server interceptor's ``intercept_service`` on every
    call, a coroutine and a continuation each; a stack of three rebuilt three
    handlers and three closures per call. Wrapped when registered, a call finds its
    method's handler already wrapped, as it finds an unwrapped one
    (docs/performance.md, *Issue 19 levers*)."""

    def __init__(self, interceptors: Sequence[Interceptor]) -> None:
        self.interceptors = tuple(interceptors)
        # method -> (the servicer's handler, the wrapped one)
        self._wrapped: dict[str, tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    def wrapped(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """``handler`` of ``method`` (its full path) with every interceptor around it."""
        kept = self._wrapped.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
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


# Generic in grpc-stubs only: not subscriptable at runtime.
class _Wrapping(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """A generic handler whose methods' handlers come out of ``chain``."""

    def __init__(self, inner: grpc.GenericRpcHandler[Any, Any], chain: Chain) -> None:
        self.inner = inner
        self.chain = chain

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler: grpc.RpcMethodHandler[Any, Any] | None = self.inner.service(details)
        # None for a method this service has not: the next one is asked, or gRPC
        # answers UNIMPLEMENTED.
        return None if handler is None else self.chain.wrapped(details.method, handler)


class Registrar:
    """Registers services on ``server`` as gRPC's generated ``add_*_to_server`` helpers
    do, every method's handler wrapped by ``chain``: what a server interceptor
    did on every call, done once."""

    def __init__(self, server: grpc.aio.Server, chain: Chain) -> None:
        self.server = server
        self.chain = chain

    def add_generic_rpc_handlers(
        self, handlers: Sequence[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self.server.add_generic_rpc_handlers(tuple(_Wrapping(h, self.chain) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        # Not in grpc-stubs yet: the generated helpers of grpcio >= 1.62 call it.
        self.server.add_registered_method_handlers(  # type: ignore[attr-defined]
            service,
            {name: self.chain.wrapped(f"/{service}/{name}", h) for name, h in handlers.items()},
        )
