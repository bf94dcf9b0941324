"""Twins: two live processes speaking for one node id, told apart by their lives.

Every node process draws a random *life* when it starts and sends it in the
``Origin`` of each replication call, beside its node id and its clock. A restart
is a new life that begins after the old one ended: every call of the old life
carries a clock below the first call of the new one. Two processes started from
copies of one data file (a twin: a copy of a live node's directory started on
another host, a failed-over VM whose original came back) are two lives of one
node id that *overlap*: each keeps calling after the other began. Both would
decide claims for the same region and records, each from its own fence, and
could grant one token twice (docs/replication.md, *Twins*).

A node keeps, per node id that calls it, the lives it heard recently: the first
and last origin clock of each. Two lives of one node id are twins when each was
heard more than ``margin_ms`` (the cluster's ``max_clock_offset``) after the
other began — a restart's old life never is, whatever the two hosts' clocks
say within that offset, and a call of the old life delayed in the network
carries the clock it was sent with. While a node id has twins, this node refuses
every replication call of that node id (``TWIN_NODE``): nothing either twin sends
is merged, and neither can finish the catch-up it owes once it hears the refusal
(``grant_gate.twinned``). A life not heard for ``forget_s`` (``Tuning.twin_forget_s``)
is forgotten, so once the operator stops one twin the other is heard alone again
and catches up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from fencemark.node.crdt import hlc
from fencemark.node.replication.tuning import TWIN_FORGET_S

TWIN_NODE = "TWIN_NODE"  # the ErrorInfo reason of a call refused because it has a twin

MAX_LIVES = 4  # per node id; the least recently heard is forgotten first
MAX_NODE_IDS = 256  # node ids tracked; the one heard least recently is forgotten first


@dataclass
class Life:
    first_ms: int  # physical ms of the first origin clock heard from it
    last_ms: int  # ... of the latest
    heard: float  # this node's monotonic clock when it was last heard


class Lives:
    """The recent lives of each node id that calls this node."""

    def __init__(self, margin_ms: int, forget_s: float = TWIN_FORGET_S) -> None:
        self.margin_ms = margin_ms
        self.forget_s = forget_s
        self._lives: dict[str, dict[int, Life]] = {}
        self.twins_found = 0  # node ids found with overlapping lives (each time anew)
        self._twinned: set[str] = set()  # as of each node id's latest call: found anew?

    def heard(self, node_id: str, life: int, origin_hlc: int, now: float) -> bool:
        """Record a call of ``node_id``'s ``life`` sent at ``origin_hlc``, received at
        monotonic time ``now``; True if ``node_id`` has twins now. A life of 0 (a
        node that sends none) is not tracked."""
        if not life or not node_id:
            return False
        if node_id not in self._lives and len(self._lives) >= MAX_NODE_IDS:
            # A caller making up node ids (no TLS): forget the one heard least recently.
            quiet = min(
                self._lives,
                key=lambda n: max((x.heard for x in self._lives[n].values()), default=0.0),
            )
            del self._lives[quiet]
            self._twinned.discard(quiet)
        lives = self._lives.setdefault(node_id, {})
        for ended in [k for k, seen in lives.items() if now - seen.heard > self.forget_s]:
            del lives[ended]
        sent_ms = hlc.physical_ms(origin_hlc)
        this = lives.get(life)
        if this is None:
            lives[life] = this = Life(sent_ms, sent_ms, now)
            if len(lives) > MAX_LIVES:
                del lives[min(lives, key=lambda k: lives[k].heard)]
        else:
            this.last_ms, this.heard = max(this.last_ms, sent_ms), now
        twin = self._overlapping(list(lives.values()))
        if not twin:
            self._twinned.discard(node_id)
        elif node_id not in self._twinned:
            self._twinned.add(node_id)
            self.twins_found += 1
        return twin

    def overlap(self, a: Life, b: Life) -> bool:
        """Each life heard more than the margin after the other began."""
        return min(a.last_ms, b.last_ms) > max(a.first_ms, b.first_ms) + self.margin_ms

    def _overlapping(self, found: list[Life]) -> bool:
        return any(self.overlap(a, b) for i, a in enumerate(found) for b in found[i + 1 :])

    def twinned(self, now: float) -> list[str]:
        """The node ids with twins among the lives heard within ``forget_s`` of
        monotonic time ``now``: a pair that both stopped calling is over, even if
        that node id never calls again."""
        return sorted(
            node_id
            for node_id, lives in self._lives.items()
            if self._overlapping([x for x in lives.values() if now - x.heard <= self.forget_s])
        )


def status_details(error: grpc.aio.AioRpcError) -> list[any_pb2.Any]:
    """The rich details of a refused call (its ``grpc-status-details-bin``
    trailer): ``ErrorInfo``, ``RetryInfo`` and the like; none if it has none, or
    none that parse."""
    metadata = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    for key, value in metadata:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            try:
                return list(status_pb2.Status.FromString(value).details)
            except DecodeError:
                return []
    return []


def refused_as_twin(error: grpc.aio.AioRpcError) -> bool:
    """Whether a peer refused a call of this node because it has a twin: the
    ``ErrorInfo`` reason ``TWIN_NODE`` of a FAILED_PRECONDITION."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    for detail in status_details(error):
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.reason == TWIN_NODE:
            return True
    return False
