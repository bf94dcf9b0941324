"""What a node tells its operators: Prometheus metrics, request ids, JSON logs.

- :class:`NodeMetrics` owns one registry per node (several nodes may share a
  process in tests and ``fencemark cluster``). Counters and histograms are
  updated as things happen; everything the node already counts (replication
  per peer, records, catch-up) is read at scrape time by a collector, so there
  is one source of truth. ``docs/operations.md`` lists every metric.
- :class:`Telemetry` is a gRPC server interceptor: it gives every call a request
  id (the caller's ``x-request-id`` metadata, else a fresh one), times it, and
  counts it by method and status code, and — when the rules refused it — by
  machine-readable reason. A refusal's reason is noted by the servicer through
  :func:`note_refusal` (the servicer knows it; the status code alone does not).
- :func:`configure_logging`: ``text`` or ``json`` lines; JSON lines carry the
  request id of the call being served, so a refusal in the log can be matched
  to the client that saw it. :func:`say` writes the node's own lines (its
  banner, its start-up errors) in the same format.
- A caller that leaves before the call ends (it cancelled, its deadline passed) is
  one INFO record of the access log naming the method and the request id; gRPC's
  own records of it (an ERROR with a traceback when a reply could not be sent)
  are dropped by :class:`_CallerLeftFilter`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fencemark.node.api.interceptor import Behaviour, Handler, Interceptor, Shape, awaited
from fencemark.node.replication.lives import Lives

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from fencemark.node.coordination.member import Member
    from fencemark.node.core.claims import Claims
    from fencemark.node.core.replica import Replica
    from fencemark.node.replication.peers import PeerStats
    from fencemark.node.security.tls_reload import LiveTls

REQUEST_ID_METADATA = "x-request-id"
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_refusal: contextvars.ContextVar[str] = contextvars.ContextVar("refusal", default="")


def request_id() -> str:
    """The id of the call being served ("" outside a call)."""
    return _request_id.get()


def note_refusal(reason: str) -> None:
    """The call being served was refused for ``reason`` (a SPEC reason, lower case)."""
    if reason:
        _refusal.set(reason)


# -- metrics -------------------------------------------------------------------------

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RecentRefusals:
    """The latest refusals this node answered, newest last (the dashboard lists them)."""

    def __init__(self, size: int = 50) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)

    def add(self, method: str, reason: str) -> None:
        self._items.append({"at_ms": round(time.time() * 1000), "method": method,
                            "reason": reason, "request_id": request_id()})  # fmt: skip

    def items(self) -> list[dict[str, Any]]:
        return list(self._items)


class NodeMetrics:
    """The metrics of one node, in a registry of its own."""

    def __init__(self, region: str) -> None:
        self.region = region
        self.port = 0  # where /metrics is served, once bound (fencemark.node.api.metrics_http)
        self.recent_refusals = RecentRefusals()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fencemark_requests", "RPCs served, by method and gRPC status code",
            ["method", "code"], registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "fencemark_refusals", "RPCs the rules refused, by method and machine-readable reason",
            ["method", "reason"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "fencemark_request_seconds", "RPC service time, by method", ["method"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.commit_batch = Histogram(
            "fencemark_commit_batch_writes", "Writes per group commit (one fsync each)",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.commit_seconds = Histogram(
            "fencemark_commit_seconds", "Time to commit and fsync one group of writes",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.build = Gauge("fencemark_node_info", "This node: region and version (always 1)",
                           ["region", "version"], registry=r)  # fmt: skip
        # Call budgets per class (fencemark.node.api.budgets).
        self.budget = Gauge(
            "fencemark_rpc_budget", "Calls in flight allowed per class of call", ["class"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "fencemark_rpcs_in_flight",
            "Calls in flight per class (claims waiting in line are fencemark_claim_waiters)",
            ["class"], registry=r,
        )  # fmt: skip
        self.budget_refusals = Counter(
            "fencemark_rpc_budget_refusals",
            "Calls refused RESOURCE_EXHAUSTED: their class's budget was full", ["class"],
            registry=r,
        )  # fmt: skip

    def observe_commit(self, writes: int, seconds: float) -> None:
        self.commit_batch.observe(writes)
        self.commit_seconds.observe(seconds)

    def watch(
        self,
        replica: Replica,
        claims: Claims,
        peers: Mapping[str, PeerStats],
        lives: Lives | None = None,
    ) -> None:
        """Read the node's own counters at every scrape."""
        from fencemark.node import __version__

        self.build.labels(self.region, __version__).set(1)
        self.registry.register(_StateCollector(replica, claims, peers, lives or Lives(0)))

    def watch_member(self, member: Member) -> None:
        """Report the region's decider as this member knows it (SPEC §10)."""
        self.registry.register(_MemberCollector(member))

    def watch_tls(self, tls: LiveTls) -> None:
        """Report the TLS reloads and the revocation list (fencemark.node.security.tls_reload)."""
        self.registry.register(_TlsCollector(tls))


class _TlsCollector(Collector):
    def __init__(self, tls: LiveTls) -> None:
        self.tls = tls

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "fencemark_tls_reloads", "Times changed TLS files were taken into use",
            value=self.tls.reloads,
        )  # fmt: skip
        yield CounterMetricFamily(
            "fencemark_tls_reload_failures",
            "Times changed TLS files were ignored as unusable (the node logs why)",
            value=self.tls.failures,
        )
        yield GaugeMetricFamily(
            "fencemark_tls_revoked_certificates", "Certificates on the revocation list in use",
            value=len(self.tls.revocations.revoked),
        )  # fmt: skip


class _MemberCollector(Collector):
    """A member of a region of several: the decider it knows, and its term."""

    def __init__(self, member: Member) -> None:
        self.member = member

    def collect(self) -> Iterable[Metric]:
        decider = self.member.decider()
        known = GaugeMetricFamily(
            "fencemark_region_decider",
            "1 with the member this member knows decides for its region; 0 (decider"
            ' "") while it knows none: an election under way, or etcd unreachable',
            labels=["region", "decider"],
        )
        known.add_metric(
            [self.member.region, decider.member if decider else ""], 1 if decider else 0
        )
        yield known
        yield GaugeMetricFamily(
            "fencemark_region_decider_term",
            "The term of the region's decider this member knows (0: none known)",
            value=decider.term if decider else 0,
        )
        yield GaugeMetricFamily(
            "fencemark_member_cut_off",
            "1 while too few of the region's members answer this one to make a majority:"
            " it does not campaign, and a decider steps aside",
            value=1 if self.member.cut_off() else 0,
        )


class _StateCollector(Collector):
    """Gauges and counters read from what the node keeps anyway, at scrape time."""

    def __init__(
        self, replica: Replica, claims: Claims, peers: Mapping[str, PeerStats], lives: Lives
    ) -> None:
        self.replica = replica
        self.claims = claims
        self.peers = peers
        self.lives = lives

    def collect(self) -> Iterable[Metric]:
        yield from self._node()
        yield from self._per_peer()
        yield from self._refusals_per_peer()

    def _node(self) -> Iterable[Metric]:
        """The records held and the claims decided and waiting here."""
        yield GaugeMetricFamily(
            "fencemark_records", "Records held (tombstones included)",
            value=self.replica.record_count,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "fencemark_claims_serving", "1 when this node decides claims (0 while catching up)",
            value=1 if self.claims.deciding else 0,
        )  # fmt: skip
        yield CounterMetricFamily(
            "fencemark_data_rollbacks",
            "Peer states proving this node's data file forgot writes it made"
            " (went back in time: a reverted snapshot, a lost fsync), this life",
            value=self.replica.gate.rollbacks,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "fencemark_twin_nodes",
            "Node ids two live processes call this node with (twins: both refused)",
            value=len(self.lives.twinned(time.monotonic())),
        )  # fmt: skip
        yield CounterMetricFamily(
            "fencemark_twin_refusals",
            "Times a peer refused this node's calls because another live process"
            " calls with its node id (a twin), this life",
            value=self.replica.gate.twins,
        )  # fmt: skip
        yield CounterMetricFamily(
            "fencemark_naps",
            "Times this process found it had stood still (paused, or starved of CPU)"
            " and settled with its peers again before deciding, this life",
            value=self.replica.gate.naps,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "fencemark_claim_waiters", "Callers waiting in claim queues", value=self.claims.waiting
        )
        yield GaugeMetricFamily(
            "fencemark_claim_waiting_clients", "Clients with callers waiting in claim queues",
            value=self.claims.clients_waiting,
        )  # fmt: skip
        outcomes = CounterMetricFamily(
            "fencemark_claims",
            "Claims decided here: granted, or the reason not",
            labels=["outcome"],
        )
        for outcome, count in sorted(self.claims.outcomes.items()):
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield CounterMetricFamily(
            "fencemark_claim_waits", "Claims that queued (wait_seconds) behind a holder",
            value=self.claims.waits,
        )  # fmt: skip

    def _per_peer(self) -> Iterable[Metric]:
        """One series per peer: traffic both ways, lag, divergence, reachability."""
        per_peer: dict[str, tuple[type, str, Callable[[PeerStats], float]]] = {
            "fencemark_replication_records_sent": (
                CounterMetricFamily, "Record states sent to the peer", lambda p: p.records_sent),
            "fencemark_replication_records_received": (
                CounterMetricFamily, "Record states from the peer that changed a record here",
                lambda p: p.records_received),
            "fencemark_replication_bytes_sent": (
                CounterMetricFamily, "Replication bytes sent to the peer", lambda p: p.bytes_sent),
            "fencemark_replication_bytes_received": (
                CounterMetricFamily, "Replication bytes from the peer",
                lambda p: p.bytes_received),
            "fencemark_replication_skew_alarms": (
                CounterMetricFamily, "Exchanges refused: the peer's clock ran ahead",
                lambda p: p.skew_alarms),
            "fencemark_replication_states_too_large": (
                CounterMetricFamily, "This node's states not sent to the peer: over the record"
                " size limit (stored before merges were limited)", lambda p: p.states_too_large),
            "fencemark_replication_lag_seconds": (
                GaugeMetricFamily, "Seconds since the last completed round with the peer",
                lambda p: p.lag_ms() / 1000),
            "fencemark_replication_divergence": (
                GaugeMetricFamily, "Records that differed in the last round with the peer",
                lambda p: p.divergence),
            "fencemark_replication_reachable": (
                GaugeMetricFamily, "1 when the last round with the peer succeeded",
                lambda p: 1 if p.reachable else 0),
        }  # fmt: skip
        for name, (family, help_text, value) in per_peer.items():
            metric = family(name, help_text, labels=["peer"])
            for peer in self.peers.values():
                metric.add_metric([peer.name], value(peer))
            yield metric

    def _refusals_per_peer(self) -> Iterable[Metric]:
        """What each peer sent that was refused, and refusals of its certificate."""
        merges = CounterMetricFamily(
            "fencemark_replication_merges_refused",
            "States from the peer refused, by reason: over_limit, or an integrity rule"
            " (docs/security.md); each is logged once and not fetched again while"
            " neither side's state of the record changes",
            labels=["peer", "reason"],
        )
        for peer in self.peers.values():
            for reason, count in sorted(peer.merge_refusals.items()):
                merges.add_metric([peer.name, reason], count)
        yield merges
        refused = CounterMetricFamily(
            "fencemark_replication_peer_refusals",
            "Checks of the certificate the peer's address presents that refused it"
            " (revoked_certificate, region_mismatch): no round or push is sent to it",
            labels=["peer", "reason"],
        )
        for peer in self.peers.values():
            for reason, count in sorted(peer.certificate_refusals.items()):
                refused.add_metric([peer.name, reason], count)
        yield refused


# -- the interceptor ---------------------------------------------------------------------

access_log = logging.getLogger("fencemark.node.access")


@dataclass(slots=True)
class _Call:
    """The call being served, for gRPC's records of it (:class:`_CallerLeftFilter`)."""

    method: str
    context: grpc.aio.ServicerContext[Any, Any]
    left: bool = False  # the caller left before its reply, and the node logged it


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("call", default=None)


# Generic in grpc-stubs only: not subscriptable at runtime.
class Telemetry(Interceptor):
    """Request ids, timing and counts for every unary call, and for server streams
    served by writing to the context (``Records.Watch``): their time is the stream's."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        _CallerLeftFilter.install()

    def wrap(self, path: str, behaviour: Behaviour, shape: Shape) -> Behaviour | None:
        if not awaited(shape, behaviour):
            return None
        method = path.rsplit("/", 1)[-1]
        inner: Handler = behaviour
        metrics = self.metrics
        # This method's series, looked up once: a call only adds to them.
        latency = metrics.latency.labels(method)
        requests: dict[grpc.StatusCode, Any] = {}
        refusals: dict[str, Any] = {}

        async def observed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            _request_id.set(_given_id(context) or os.urandom(8).hex())
            _refusal.set("")
            call = _Call(method, context)
            _call.set(call)
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await inner(request, context)
            except asyncio.CancelledError:  # gRPC cancels the handler of a caller that left
                code, call.left = _gave_up(context), True
                raise
            except BaseException as exc:
                if _reply_failed(exc):  # a stream's write to a caller that left
                    code, call.left = _gave_up(context), True
                else:
                    code = _code(context)
                raise
            finally:
                took = time.perf_counter() - started
                counted = requests.get(code)
                if counted is None:
                    counted = requests[code] = metrics.requests.labels(method, code.name)
                counted.inc()
                latency.observe(took)
                reason = _refusal.get()
                if reason:
                    refused = refusals.get(reason)
                    if refused is None:
                        refused = refusals[reason] = metrics.refusals.labels(method, reason)
                    refused.inc()
                    metrics.recent_refusals.add(method, reason)
                if call.left:
                    _caller_left(method, code, took)
                elif access_log.isEnabledFor(logging.INFO):  # off by default: no cost per call
                    access_log.info(
                        "%s %s in %.1f ms%s", method, code.name, took * 1000,
                        f" ({reason})" if reason else "",
                        extra={"method": method, "code": code.name,
                               "duration_ms": round(took * 1000, 2), "reason": reason},
                    )  # fmt: skip

        return observed


def _caller_left(method: str, code: grpc.StatusCode, took: float | None) -> None:
    """The one record of a caller that left before its reply (``took``: the handler's
    time, None when it had ended and only its reply could not be sent)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    spent = "" if took is None else f" in {took * 1000:.1f} ms"
    sent = "; its reply could not be sent" if took is None else ""
    access_log.info(
        "%s %s%s: the caller left%s", method, code.name, spent, sent,
        extra={"method": method, "code": code.name, "caller_left": True,
               "request_id": request_id(),
               **({} if took is None else {"duration_ms": round(took * 1000, 2)})},
    )  # fmt: skip


def _reply_failed(exc: BaseException) -> bool:
    """gRPC's error for a write or reply the call's transport refused: the call is over,
    its caller gone (cancelled, its deadline passed, its connection lost)."""
    return type(exc).__name__ == "ExecuteBatchError"


class _CallerLeftFilter(logging.Filter):
    """Drops gRPC's records of a caller that left, which the node logs itself.

    gRPC's aio server logs ``ExecuteBatchError raised in core by servicer method
    [...]`` at ERROR, with a traceback, when a unary call's reply cannot be sent
    because its caller left: the handler had ended, so only here can the node
    tell; the record becomes the node's own INFO record of the caller that left.
    ``RPC cancelled for servicer method [...]`` (DEBUG) is dropped when the node
    logged the call already. Every other gRPC record passes.
    """

    REPLY_FAILED = "ExecuteBatchError raised in core by servicer method ["
    CANCELLED = "RPC cancelled for servicer method ["
    LOGGER = "grpc._cython.cygrpc"

    @classmethod
    def install(cls) -> None:
        grpc_log = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in grpc_log.filters):
            grpc_log.addFilter(cls())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        call = _call.get()  # gRPC logs from the call's own task: this call's, if wrapped
        if message.startswith(self.REPLY_FAILED):
            if call is None or not call.left:
                method = call.method if call else _method_in(message, self.REPLY_FAILED)
                code = _gave_up(call.context) if call else grpc.StatusCode.CANCELLED
                if call is not None:
                    call.left = True
                _caller_left(method, code, None)
            return False
        return not (message.startswith(self.CANCELLED) and call is not None and call.left)


# How close to its deadline a cancelled call counts as one whose deadline passed.
DEADLINE_SLACK_S = 0.5


def _method_in(message: str, prefix: str) -> str:
    """The method's name in gRPC's ``... [/package.Service/Method]``."""
    return message[len(prefix) :].rstrip("]").rsplit("/", 1)[-1]


def _given_id(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The caller's request id (``x-request-id``), at most 64 characters; "" if none."""
    for name, value in context.invocation_metadata() or ():
        if name == REQUEST_ID_METADATA:
            return str(value)[:64]
    return ""


def _gave_up(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    """Why a call's handler was cancelled: its caller cancelled it, or its deadline
    passed (gRPC cancels the handler either way, setting no code). A caller's client
    counts the deadline from when it sent the call and cancels the call when it
    passes; the node counts it from when the call arrived. So a caller whose deadline
    passed is seen with up to the call's transit left (a loaded machine: tenths of a
    second): a cancellation within ``DEADLINE_SLACK_S`` of the deadline is taken as
    the deadline's."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _code(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    code: object = context.code()  # a StatusCode, or an int in some grpcio versions
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN


# -- logs --------------------------------------------------------------------------------

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", ""):
            line["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in line and key != "request_id":
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id()
        return True


LOG_FORMATS = ("text", "json")
_format = "text"  # the process's, as configure_logging set it


def configure_logging(level: str, fmt: str = "text") -> None:
    """Root logging for a ``fencemark`` process: ``text`` for people, ``json`` for tools."""
    global _format
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format: expected one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    formatter = (
        _json_formatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _format = fmt


def _json_formatter() -> JsonFormatter:
    formatter = JsonFormatter()
    formatter.converter = time.gmtime
    return formatter


def say(
    who: str,
    message: str,
    *,
    level: int = logging.INFO,
    stream: TextIO | None = None,
    **fields: object,
) -> None:
    """One line of the process's own, whatever ``--log-level``: ``who: message`` under
    the text format, under json the object a log record of logger ``who`` (with
    ``fields``) would be. To ``stream``, stdout by default (a banner), stderr for errors.
    """
    out = stream or sys.stdout
    if _format != "json":
        print(f"{who}: {message}", file=out, flush=True)
        return
    record = logging.LogRecord(who.replace(" ", "."), level, "", 0, message, None, None)
    record.__dict__.update(fields)
    print(_json_formatter().format(record), file=out, flush=True)
