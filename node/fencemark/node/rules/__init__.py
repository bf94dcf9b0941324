"""The rules, as pure functions of states: what input is valid (``validation``),
what a node admits and decides for claims (``admission``, SPEC §4), what it refuses
to merge (``integrity``), and the errors they raise (``errors``). No I/O, no clock
read, no gRPC: every rule can be tested and mutation-tested alone.
"""
