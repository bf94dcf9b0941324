"""A region of three members in containers, its etcd of three, and the faults of
SPEC §10 injected into them: the chaos tier's cluster for a region of several members.

Region ``us`` is served by members ``us-a``, ``us-b`` and ``us-c`` (the node image,
``fencemark node --member``), electing their decider through an etcd cluster of three
containers (Debian's ``etcd-server`` package, ``make etcd-image``) over mutual TLS
with authentication on, restricted as docs/security.md does it (``fencemark etcd
restrict``). Region ``eu`` is one node, peered with every member of ``us``. Every
container is on the run's own bridge network; each member's client port and each
etcd's client port are published on 127.0.0.1 only, and a member advertises that
published address, so that a redirect names an address the test reaches.

Faults, beyond those of :class:`ChaosCluster` (``kill``, ``start_node``, ``wipe``,
``pause``, ``unpause``, iptables rules in a container's own namespace):

- :meth:`cut_from_etcd`: DROP every packet between a member and every etcd container
  (it still reaches its clients and fellow members);
- :meth:`cut_members`: DROP every packet between two members;
- :meth:`kill_etcd` / :meth:`start_etcd`: ``kill -9`` of an etcd container and its
  start on the same data;
- :meth:`etcd_leader`: the etcd member that leads now, asked as etcd's root.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from aetcd import rpc
from testcontainers.core.container import DockerContainer

from fencemark.node.coordination import access
from fencemark.node.coordination.etcd import Etcd, EtcdError
from fencemark.node.security.tls import TlsFiles, init_dir
from fencemark.node.tools.cli import main
from tests.chaos.cluster import (
    ACCESS_FILE,
    ACCESS_MAP,
    DATA_IN_CONTAINER,
    LABEL,
    PEER_PORT,
    TLS_IN_CONTAINER,
    ChaosCluster,
    Region,
    _both_ways,
    _wait_for,
)
from tests.dockerenv import IMAGE_UID
from tests.ports import free_port

REGION = "us"
MEMBERS = ("us-a", "us-b", "us-c")
OTHER = "eu"  # a region of one node, peered with every member of REGION
ETCDS = ("etcd-0", "etcd-1", "etcd-2")
ETCD_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_UID = 10091  # the etcd image's user (deploy/etcd-server/Dockerfile)
ETCD_TLS = "/etc/etcd/tls"
RESTRICT_WAIT_S = 60  # etcd's first election on a busy machine


class MemberCluster(ChaosCluster):
    """Region ``us`` as three member containers with its etcd of three, and ``eu``."""

    def __init__(self, image: str, etcd_image: str, root: Path, *, run_id: str, ttl_s: int) -> None:
        super().__init__(image, (REGION, OTHER), root, run_id=run_id)
        self.names = (*MEMBERS, OTHER)  # every node container, by its alias
        self.etcd_image = etcd_image
        self.ttl_s = ttl_s
        self.etcd: dict[str, Region] = {}

    # -- lifecycle -------------------------------------------------------------------

    def up(self) -> None:
        """The network, etcd (restricted), the members of ``us`` and ``eu``'s node."""
        self.network.create()
        self.control.mkdir(parents=True, exist_ok=True)  # ChaosCluster.heal_all writes there
        init_dir(self.certs, regions=[REGION, OTHER], hosts=MEMBERS)
        for name in ETCDS:
            made = main(["certs", "etcd", "--dir", str(self.certs), "--server", name,
                         "--hosts", "127.0.0.1"])  # fmt: skip
            if made != 0:
                raise RuntimeError(f"fencemark certs etcd --server {name} exited {made}")
        if main(["certs", "etcd", "--dir", str(self.certs), "--root"]) != 0:
            raise RuntimeError("fencemark certs etcd --root failed")
        for name in ETCDS:
            port = free_port()
            container = self._etcd_container(name, port)
            self.etcd[name] = Region(name, container, port, self.root / "etcd" / name)
            container.start()
        restrict = ["etcd", "restrict", "--etcd", ",".join(self.etcd_endpoints),
                    "--tls-dir", str(self.certs), "--regions", f"{REGION},{OTHER}",
                    "--wait", str(RESTRICT_WAIT_S)]  # fmt: skip
        if main(restrict) != 0:
            raise RuntimeError("fencemark etcd restrict failed")
        for name in self.names:
            data, port = self._data_dir(name), free_port()
            container = self._member_node(name, data, port)
            self.regions[name] = Region(name, container, port, data)
            container.start()

    @property
    def etcd_endpoints(self) -> list[str]:
        """etcd's client endpoints as the test reaches them (127.0.0.1)."""
        return [f"127.0.0.1:{box.port}" for box in self.etcd.values()]

    def _etcd_container(self, name: str, port: int) -> DockerContainer:
        certs = self.root / "etcd-certs" / name
        certs.mkdir(parents=True)
        files = TlsFiles.in_dir(self.certs, name)
        for path in (files.ca, files.cert, files.key):
            shutil.copy2(path, certs / path.name)
            if os.geteuid() == 0:
                os.chown(certs / path.name, ETCD_UID, ETCD_UID)
        cluster = ",".join(f"{e}=http://{e}:{ETCD_PEER_PORT}" for e in ETCDS)
        flags = [
            f"--name={name}", "--data-dir=/var/lib/etcd/data", "--log-level=error",
            f"--listen-client-urls=https://0.0.0.0:{ETCD_PORT}",
            f"--advertise-client-urls=https://{name}:{ETCD_PORT}",
            f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls=http://{name}:{ETCD_PEER_PORT}",
            f"--initial-cluster={cluster}", "--initial-cluster-state=new",
            f"--cert-file={ETCD_TLS}/{files.cert.name}",
            f"--key-file={ETCD_TLS}/{files.key.name}",
            f"--trusted-ca-file={ETCD_TLS}/{files.ca.name}", "--client-cert-auth",
        ]  # fmt: skip
        container = DockerContainer(
            self.etcd_image,
            command=flags,  # type: ignore[arg-type]  # a list is passed through to docker
            name=f"fencemark-chaos-{self.run_id}-{name}",
            network=self.network,
            network_aliases=[name],
            volumes=[(str(certs), ETCD_TLS, "ro")],
        )
        container.ports[f"{ETCD_PORT}/tcp"] = ("127.0.0.1", port)  # type: ignore[assignment]
        return container.with_kwargs(labels={LABEL: self.run_id})

    def _member_node(self, name: str, data: Path, port: int) -> DockerContainer:
        """Member ``name`` of ``us`` (or ``eu``'s node), published on ``port``."""
        region = OTHER if name == OTHER else REGION
        env = {
            "FENCEMARK_REGION": region,
            "FENCEMARK_TLS_DIR": TLS_IN_CONTAINER,
            "FENCEMARK_ACCESS": f"{TLS_IN_CONTAINER}/{ACCESS_FILE}",
            "FENCEMARK_ENABLE_WRITES": "1",
            "FENCEMARK_ANTI_ENTROPY_INTERVAL": str(self.anti_entropy_interval),
            "FENCEMARK_LOG_LEVEL": "WARNING",
        }
        if region == OTHER:
            env["FENCEMARK_PEERS"] = f"{REGION}=" + ",".join(f"{m}:{PEER_PORT}" for m in MEMBERS)
        else:
            env |= {
                "FENCEMARK_PEERS": f"{OTHER}={OTHER}:{PEER_PORT}",
                "FENCEMARK_MEMBER": name,
                "FENCEMARK_ETCD": ",".join(f"{e}:{ETCD_PORT}" for e in ETCDS),
                "FENCEMARK_DECIDER_TTL": str(self.ttl_s),
                "FENCEMARK_INITIAL_MEMBERS": ",".join(MEMBERS),
                "FENCEMARK_ADVERTISE": f"127.0.0.1:{port}",  # a redirect names it
                "FENCEMARK_ADVERTISE_PEER": f"{name}:{PEER_PORT}",
            }
        return self._container(
            name,
            command=["node"],
            env=env,
            volumes=[
                (str(data), DATA_IN_CONTAINER, "rw"),
                (str(self._certs_of(name, region)), TLS_IN_CONTAINER, "ro"),
            ],
            port=port,
        )

    def _certs_of(self, name: str, region: str) -> Path:
        """What ``name``'s node reads: the CA, its region's certificate and key, the
        access map (as ``ChaosCluster._node_certs``, per container)."""
        mounted = self.root / "node-certs" / name
        mounted.mkdir(parents=True)
        files = self.node_files(region)
        (mounted / ACCESS_FILE).write_text(ACCESS_MAP)
        for path in (files.ca, files.cert, files.key):
            shutil.copy2(path, mounted / path.name)
        for path in mounted.iterdir():
            if os.geteuid() == 0:
                os.chown(path, IMAGE_UID, IMAGE_UID)
        return mounted

    def containers(self) -> list[tuple[str, DockerContainer]]:
        """Every container of the run, etcd's first, by alias."""
        return [*((name, box.container) for name, box in self.etcd.items()), *super().containers()]

    # -- what the nemesis needs to know ----------------------------------------------

    def address(self, name: str) -> str:
        return self.regions[name].address

    def addresses(self) -> dict[str, str]:
        """Every node's client address, and every etcd's, as the test reaches them."""
        return {name: box.address for name, box in (*self.regions.items(), *self.etcd.items())}

    async def etcd_leader(self) -> str | None:
        """The etcd member leading now (None: none answers, or none leads)."""
        root = Etcd(self.etcd_endpoints, TlsFiles.in_dir(self.certs, access.ROOT), timeout_s=1.0)
        try:
            status = await root.call(rpc.MaintenanceStub, "Status", rpc.StatusRequest())
            if not status.leader:
                return None
            listed = await root.call(rpc.ClusterStub, "MemberList", rpc.MemberListRequest())
            return next((m.name for m in listed.members if status.leader == m.ID), None)
        except EtcdError:
            return None
        finally:
            await root.close()

    # -- faults ----------------------------------------------------------------------

    def _etcd_ips(self) -> list[str]:
        ips = []
        for box in self.etcd.values():
            wrapped = box.container.get_wrapped_container()
            wrapped.reload()
            networks = wrapped.attrs["NetworkSettings"]["Networks"]
            ips.append(str(networks[self.network.name]["IPAddress"]))
        return ips

    def cut_from_etcd(self, member: str) -> None:
        """Drop every packet between ``member`` and etcd (nothing else)."""
        self._rules(member, _both_ways(self._etcd_ips(), "-j DROP"))

    def cut_members(self, a: str, b: str) -> None:
        """Drop every packet between members ``a`` and ``b`` (nothing else)."""
        self._rules(a, _both_ways([self.ip(b)], "-j DROP"))
        self._rules(b, _both_ways([self.ip(a)], "-j DROP"))

    def kill_etcd(self, names: Sequence[str]) -> None:
        """``kill -9`` of each etcd container of ``names``; returns once they exited."""
        for name in names:
            self.etcd[name].container.get_wrapped_container().kill(signal="SIGKILL")
        for name in names:
            _wait_for(self.etcd[name].container, "exited", name)

    def start_etcd(self, names: Sequence[str]) -> None:
        """Start each stopped etcd container of ``names`` again, on its own data."""
        for name in names:
            self.etcd[name].container.get_wrapped_container().start()
        for name in names:
            _wait_for(self.etcd[name].container, "running", name)

    def etcd_status(self, name: str) -> str:
        wrapped = self.etcd[name].container.get_wrapped_container()
        wrapped.reload()
        return str(wrapped.status)

    def heal_all(self) -> None:
        """Every fault undone: etcd and every node running, unpaused, unfiltered."""
        stopped = [name for name in ETCDS if self.etcd_status(name) != "running"]
        if stopped:
            self.start_etcd(stopped)
        super().heal_all()
