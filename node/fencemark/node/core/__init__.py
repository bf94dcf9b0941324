"""The node's state machine over storage: the replica every change goes through
(``replica``), claims and their FIFO lines (``claims``), lapses the home records
(``lapses``), the grant gate that says when a node may decide (``grant_gate``), and
restoring a backup (``restore``). Uses the rules, storage and signatures; knows
nothing of the network.
"""
