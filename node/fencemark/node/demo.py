"""``fencemark demo``: the main job, for now one region.

Starts a node with writes enabled on the embedded SQLite default (a fresh data
directory), runs the SPEC §1 walkthrough against it over gRPC, stops the node
gracefully and exits non-zero if any expectation failed. The multi-region demo
(issue 3) replaces this.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fencemark.client.walkthrough import run_walkthrough
from fencemark.node.process import NodeProcess


async def run_demo(*, lease_seconds: float = 2.0, data_dir: str | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="fencemark-demo-") as scratch:
        data = Path(data_dir) if data_dir else Path(scratch) / "local"
        print(f"starting a node of region 'local' (data in {data}) ...", flush=True)
        node = await NodeProcess.start(data, region="local")
        print(f"node listening on {node.address}; running the walkthrough\n", flush=True)
        try:
            ok = await run_walkthrough(node.address, lease_seconds=lease_seconds)
        finally:
            code = await node.stop()
        print(f"\nnode stopped (exit code {code})")
        print("walkthrough: PASSED" if ok else "walkthrough: FAILED")
        return 0 if ok and code == 0 else 1
