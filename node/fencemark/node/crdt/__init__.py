"""Pure state-based CRDTs: no I/O, no clocks read, no gRPC.

One module per lattice, each with the same small interface (riak_dt style):
``hlc`` (hybrid logical clock and stamps), ``lww`` (last-writer-wins registers and
maps of them), ``tagset`` (LWW-element set), ``fence`` (grants, lease expiries,
released tokens), ``record`` (their product) and ``codec`` (canonical bytes).
"""

from fencemark.node.crdt.codec import DecodeError, decode, digest, encode
from fencemark.node.crdt.fence import FenceState, Grant
from fencemark.node.crdt.hlc import ClockSkew, HybridClock, Stamp
from fencemark.node.crdt.lww import LWW
from fencemark.node.crdt.record import Birth, Record

__all__ = [
    "LWW",
    "Birth",
    "ClockSkew",
    "DecodeError",
    "FenceState",
    "Grant",
    "HybridClock",
    "Record",
    "Stamp",
    "decode",
    "digest",
    "encode",
]
