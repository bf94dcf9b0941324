"""etcd processes on loopback, from this machine's ``etcd`` (Debian's ``etcd-server``).

``start_etcd``: one plaintext member on held ports (``fencemark.node.tools.ports``),
its data under the directory given — the coordination a local region of several
members elects its decider through (``fencemark demo --members``, ``LocalCluster``)
and the benchmarks' single etcd. ``etcd_args``: the command line of one member of
any cluster (the benchmarks' trios build theirs with it). A deployment runs etcd of
its own, over mutual TLS (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path

from fencemark.node.tools.ports import Ports
from fencemark.node.tools.process import ServerProcess

INSTALL = "apt-get install -y etcd-server"


class EtcdMissing(RuntimeError):
    """No ``etcd`` on this machine: the message says how to install it."""


def etcd_args(
    binary: str,
    *,
    name: str,
    data_dir: Path,
    client_port: int,
    peer_port: int,
    initial_cluster: str = "",
    advertise_peer: str = "",
    token: str = "",
    extra: Sequence[str] = (),
) -> list[str]:
    """One member's command line: plaintext on loopback, its WAL fsynced as shipped;
    ``initial_cluster`` defaults to this member alone, ``advertise_peer`` (HOST:PORT)
    to its own peer port."""
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://{advertise_peer or f'127.0.0.1:{peer_port}'}"
    return [
        binary,
        f"--name={name}",
        f"--data-dir={data_dir / 'data'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={initial_cluster or f'{name}={peer_url}'}",
        "--initial-cluster-state=new",
        *([f"--initial-cluster-token={token}"] if token else []),
        *extra,
        "--log-level=error",
    ]


async def start_etcd(
    data_dir: Path, *, ports: Ports | None = None, name: str = "local"
) -> ServerProcess:
    """A single-member etcd under ``data_dir``, once it accepts connections. Its two
    ports are taken from ``ports`` (held by the caller), or from ports of its own that
    it holds until it stops. ``EtcdMissing`` without ``etcd`` on the PATH."""
    binary = shutil.which("etcd")
    if binary is None:
        raise EtcdMissing(
            f"a region of several members elects its decider through etcd, and this"
            f" machine has none: install it with `{INSTALL}`"
        )
    own = Ports() if ports is None else None
    taking = ports or own
    assert taking is not None
    client, peer = taking.take(), taking.take()
    await asyncio.to_thread(data_dir.mkdir, parents=True, exist_ok=True)
    args = etcd_args(binary, name=name, data_dir=data_dir, client_port=client, peer_port=peer)
    return await ServerProcess.spawn("etcd", args, client, data_dir, own)
