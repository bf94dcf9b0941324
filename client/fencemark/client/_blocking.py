"""The blocking client: a thin face over ``AsyncClient``, not a second copy.

It owns a private event loop running in a background thread and submits the
async client's coroutines to it, so every rule (deadlines, retries, error
mapping, conversions) lives in one place. Calls from several threads are safe:
they all funnel into that one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from types import TracebackType
from typing import Any, Concatenate, Literal, ParamSpec, Self, TypeVar, overload

import grpc

from fencemark.client._aio import AsyncClient
from fencemark.client.keepalive import Hold
from fencemark.client.types import (
    ClaimNextResult,
    ClaimResult,
    Record,
    WatchEvent,
    WatchProgress,
)

__all__ = ["Client"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _blocking(
    method: Callable[Concatenate[AsyncClient, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[Client, _P], _T]:
    """The blocking twin of an ``AsyncClient`` method: same signature, same docs."""

    @functools.wraps(method)
    def call(self: Client, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self._run(method(self._async_client, *args, **kwargs))

    return call


async def _in_loop(factory: Callable[[], _T]) -> _T:
    return factory()


async def _next(iterator: AsyncIterator[_T]) -> _T:
    return await anext(iterator)


class Client:
    """A client of a Fencemark cluster through one node, for blocking code.

    The same constructor and methods as ``AsyncClient`` (``regions`` routes
    home-only calls the same way), returning results instead of coroutines.
    Use it as a context manager or call ``close()``.
    """

    def __init__(
        self,
        target: str,
        *,
        regions: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        retries: int = 4,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        # Daemon: a client that was never closed must not keep the process alive.
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fencemark-client", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            # Made in the loop's thread: a grpc.aio channel belongs to its loop.
            self._async_client = self._run(
                _in_loop(
                    functools.partial(
                        AsyncClient,
                        target,
                        regions=regions,
                        timeout=timeout,
                        retries=retries,
                        credentials=credentials,
                    )
                )
            )
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: do not leave the call running
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel and stop the background loop; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._async_client.close())
        finally:
            self._stop_loop()

    @property
    def target(self) -> str:
        return self._async_client.target

    @property
    def timeout(self) -> float:
        return self._async_client.timeout

    @property
    def regions(self) -> dict[str, str]:
        """A copy of the region name -> address map home-only calls are routed by."""
        return self._async_client.regions

    @property
    def home_regions(self) -> dict[str, str]:
        """A copy of the cache of record homes learnt from answers: key -> region."""
        # Copied in the loop's thread, which is the only one that changes it.
        return self._run(_in_loop(lambda: self._async_client.home_regions))

    remember = _blocking(AsyncClient.remember)
    get = _blocking(AsyncClient.get)
    update = _blocking(AsyncClient.update)
    delete = _blocking(AsyncClient.delete)
    list = _blocking(AsyncClient.list)
    history = _blocking(AsyncClient.history)
    claim = _blocking(AsyncClient.claim)
    renew_claim = _blocking(AsyncClient.renew_claim)
    release_claim = _blocking(AsyncClient.release_claim)
    claim_next = _blocking(AsyncClient.claim_next)
    reopen = _blocking(AsyncClient.reopen)
    force_release = _blocking(AsyncClient.force_release)
    claim_status = _blocking(AsyncClient.claim_status)
    info = _blocking(AsyncClient.info)
    health = _blocking(AsyncClient.health)

    @overload
    def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: Literal[False] = False,
        on_start: Callable[[str], object] | None = None,
    ) -> Generator[WatchEvent, None, None]: ...

    @overload
    def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: Literal[True],
        on_start: Callable[[str], object] | None = None,
    ) -> Generator[WatchEvent | WatchProgress, None, None]: ...

    def watch(
        self,
        repo: str,
        *,
        topic: str = "",
        tags: Iterable[str] = (),
        cursor: str = "",
        reconnect_seconds: float = 0.5,
        progress: bool = False,
        on_start: Callable[[str], object] | None = None,
    ) -> Generator[WatchEvent | WatchProgress, None, None]:
        """``AsyncClient.watch`` as a blocking iterator: each event when it comes
        (with ``progress=True``, each :class:`WatchProgress` too; ``on_start`` is
        called in the client's own thread)."""
        watch, again = self._async_client.watch, reconnect_seconds
        if progress:
            yield from self._iterate(watch(repo, topic=topic, tags=tags, cursor=cursor,
                                           reconnect_seconds=again, progress=True,
                                           on_start=on_start))  # fmt: skip
        else:
            yield from self._iterate(watch(repo, topic=topic, tags=tags, cursor=cursor,
                                           reconnect_seconds=again, on_start=on_start))  # fmt: skip

    def _iterate(self, items: AsyncGenerator[_T, None]) -> Iterator[_T]:
        try:
            while True:
                try:
                    yield self._run(_next(items))
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:  # after close() the loop is gone, and the channel too
                self._run(items.aclose())

    @contextlib.contextmanager
    def hold(
        self, claim: ClaimResult | ClaimNextResult, *, key: str = "", lease_seconds: float
    ) -> Iterator[Hold]:
        """``AsyncClient.hold`` for blocking code: the renewals run in the client's
        loop; check ``hold.held`` (or call ``hold.check()``) between steps of work."""
        manager = self._async_client.hold(claim, key=key, lease_seconds=lease_seconds)
        held = self._run(manager.__aenter__())
        try:
            yield held
        finally:
            if not self._closed:
                self._run(manager.__aexit__(None, None, None))

    def iter_records(
        self,
        repo: str,
        *,
        topic: str = "",
        tag: str = "",
        page_size: int = 0,
        include_deleted: bool = False,
    ) -> Iterator[Record]:
        """Every matching record, fetching the next page only when it is needed."""
        records = self._async_client.iter_records(
            repo, topic=topic, tag=tag, page_size=page_size, include_deleted=include_deleted
        )
        yield from self._iterate(records)
