"""The Fencemark region node: CRDT core, storage, rules and the gRPC server.

Layers, imports pointing one way (docs/architecture.md):
``crdt`` (pure) <- ``storage`` (SQLite) <- ``replica``/``claims`` (rules) <- ``server`` (gRPC).
"""

__version__ = "0.1.0"
