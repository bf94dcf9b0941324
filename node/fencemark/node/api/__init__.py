"""The node as a gRPC server: the servicers (``service``, ``replication``), the
refusal -> status mapping, authorization (``authz``), call budgets (``budgets``),
metrics and logs (``telemetry``), and the server that wires them (``server``).
"""
