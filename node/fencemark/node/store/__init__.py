"""Durable state: the SQLite file of record states (``storage``) and the digest
tree over it that anti-entropy compares (``digest_tree``). Imports the lattices only.
"""
