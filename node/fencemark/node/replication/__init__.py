"""Replication between region nodes: eager push and digest-tree anti-entropy.

``peers`` holds configuration and per-peer accounting, ``intake`` merges the states
a peer sends (limits, clock check, decode, merge) whoever received them, and
``replicator`` makes this node's own calls; the servicer answering other nodes'
calls is ``fencemark.node.api.replication``. docs/replication.md describes the
protocol and its bounds.
"""
