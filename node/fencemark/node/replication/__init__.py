"""Replication between region nodes: eager push and digest-tree anti-entropy.

``peers`` holds configuration and per-peer accounting, ``service`` answers the
``fencemark.v1.Replication`` calls of other nodes, and ``replicator`` makes this
node's own calls. docs/replication.md describes the protocol and its bounds.
"""
