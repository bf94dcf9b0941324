"""A region of several members: who decides, elected through etcd (docs/architecture.md).

Between ``core`` (which asks, at each decision, whether this node may decide) and
``replication`` (which finds the region's other members here): ``etcd`` speaks the
few etcd v3 calls the members make, ``decider`` keeps one decider per region and
stops a decider in doubt.
"""
