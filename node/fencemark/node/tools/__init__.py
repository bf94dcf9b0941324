"""What runs around nodes: the CLI (``cli``, ``cli_rpc``), the demo and its workload,
a local cluster of node processes, the fault proxy. Nothing in the node imports these.
"""
