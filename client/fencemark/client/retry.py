"""Which calls the client retries, derived from the wire contract itself.

A method is retried only when its ``.proto`` declares it safe to repeat:
``idempotency_level`` ``NO_SIDE_EFFECTS`` or ``IDEMPOTENT``. ``Update`` and
``Delete`` declare neither (a repeated update could overwrite a later write),
so a failure there reaches the caller, who decides. Retries are gRPC's own
(``grpc.service_config`` retryPolicy, on ``UNAVAILABLE`` only), not a loop of
ours, and they all happen inside the call's single deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache

from google.protobuf.descriptor import FileDescriptor, MethodDescriptor
from google.protobuf.descriptor_pb2 import MethodOptions

from fencemark.v1 import claims_pb2, node_pb2, records_pb2

__all__ = ["MAX_RETRIES", "channel_options", "retry_safe_methods", "service_config"]

# gRPC caps maxAttempts at 5 (one call and four retries) whatever is configured.
MAX_RETRIES = 4

_CONTRACT_FILES: tuple[FileDescriptor, ...] = (
    records_pb2.DESCRIPTOR,
    claims_pb2.DESCRIPTOR,
    node_pb2.DESCRIPTOR,
)
_SAFE_LEVELS = frozenset({MethodOptions.NO_SIDE_EFFECTS, MethodOptions.IDEMPOTENT})


def _contract_methods() -> Iterator[MethodDescriptor]:
    for file in _CONTRACT_FILES:
        for service in file.services_by_name.values():
            yield from service.methods


@cache
def retry_safe_methods() -> frozenset[str]:
    """Full names (``fencemark.v1.Records.Get``) of the methods the client retries."""
    return frozenset(
        method.full_name
        for method in _contract_methods()
        if method.GetOptions().idempotency_level in _SAFE_LEVELS
    )


def service_config(retries: int) -> dict[str, object]:
    """The gRPC service config retrying each retry-safe method up to ``retries`` times."""
    if not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be between 0 and {MAX_RETRIES}, got {retries}")
    if retries == 0:
        return {}  # gRPC rejects a retryPolicy with maxAttempts < 2
    names = []
    for full_name in sorted(retry_safe_methods()):
        service, _, method = full_name.rpartition(".")
        names.append({"service": service, "method": method})
    retry_policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return {"methodConfig": [{"name": names, "retryPolicy": retry_policy}]}


# A channel whose node went away tries to connect again after a back-off that gRPC
# grows to 120 s by default: a node back after a restart of a few seconds would
# be refused UNAVAILABLE for seconds more (calls fail fast meanwhile). Capped, the
# client is served again within about a second of its node's return, at the cost
# of one connection attempt a second to a node that stays down.
MAX_RECONNECT_BACKOFF_MS = 1_000


def channel_options(retries: int) -> list[tuple[str, str | int]]:
    """Channel options that install the retry policy (or switch retries off) and
    cap the reconnect back-off."""
    reconnect: list[tuple[str, str | int]] = [
        ("grpc.initial_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
    config = service_config(retries)
    if not config:
        return [*reconnect, ("grpc.enable_retries", 0)]
    return [*reconnect, ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]
