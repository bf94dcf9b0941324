"""The stack of deploy/docker-compose.yml, and the faults of SPEC §10 injected into it:
the chaos tier's cluster for a region of several members.

The cluster is the deployment's own: one compose project of deploy/docker-compose.yml
(``tests/compose.py``'s :class:`Stack`, Debian's docker-compose 1.29) with the overlay
``compose.chaos.yml`` beside this module. The stack makes the run's development CA
and certificates (its one-shot ``certs`` service), starts region ``us``'s etcd of
three (``etcd-0..2``, Debian's ``etcd-server`` package, ``make etcd-image``) and
restricts it (``etcd-access``: authentication on, ``us``'s keys its members' alone),
region ``us`` as three members (``us-a``, ``us-b``, ``us-c``) electing their decider
through that etcd, and regions ``eu`` and ``ap`` as one node each. Each node's data
and the certificates are directories under the run's own
``REPOCONTEXT_MEMORY_ARCHIVE_PATH``; each node's ports are free ones on 127.0.0.1,
and a member advertises its published address, so that a redirect names an address
the test reaches. The overlay adds only what the tier needs and a deployment does
not: ``NET_ADMIN`` for the iptables faults, the run's access map
(``FENCEMARK_ACCESS``, written into the certs directory before ``up``), each etcd's
client port on 127.0.0.1 (to ask who leads), and the label ``fencemark.chaos=<run
id>`` on every container and the network. The decider's TTL and the anti-entropy
interval are the stack's own settings (``FENCEMARK_DECIDER_TTL``,
``FENCEMARK_ANTI_ENTROPY_INTERVAL``).

The faults reach each service's container through the docker SDK (found by the
project's label), as those of :class:`ChaosCluster` reach its own (``kill``,
``start_node``, ``wipe``, ``pause``, ``unpause``, iptables rules in a node's own
namespace); the stack's restart policy (``unless-stopped``) leaves a container the
nemesis killed stopped, as Docker restarts none it was told to kill. Beyond them:

- :meth:`cut_from_etcd`: DROP every packet between a member and every etcd container
  (it still reaches its clients and fellow members);
- :meth:`cut_members`: DROP every packet between two members;
- :meth:`kill_etcd` / :meth:`start_etcd`: ``kill -9`` of an etcd container and its
  start on the same data;
- :meth:`etcd_leader`: the etcd member that leads now, asked as etcd's root.

:meth:`close` keeps every container's log, kills them, then ``docker-compose down
--volumes --remove-orphans`` of the run's project.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker
import grpc
from aetcd import rpc

from fencemark.node.coordination import access
from fencemark.node.security.tls import TlsFiles
from tests.chaos.cluster import (
    ACCESS_FILE,
    ACCESS_MAP,
    ChaosCluster,
    Region,
    _both_ways,
    _wait_for,
)
from tests.compose import (
    COMPOSE_FILE,
    DATA_VARIABLE,
    ETCDS,
    NODES,
    Stack,
    data_root,
    port_variable,
    published_ports,
)
from tests.dockerenv import IMAGE_UID
from tests.ports import free_port

OVERLAY = Path(__file__).with_name("compose.chaos.yml")
REGION = "us"  # the region of several members (tests/compose.py's MEMBERS)
OTHERS = ("eu", "ap")  # regions of one node each, peered with every member of REGION
ETCD_CALL_S = 1.0
UP_LIMIT_S = 180.0  # `up` of a stack whose images are here: seconds
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


class Service:
    """A compose service's container (the docker SDK's), as the faults reach it
    (``Boxed``)."""

    def __init__(self, container: Any) -> None:
        self._container = container

    def get_wrapped_container(self) -> Any:
        return self._container


class MemberCluster(ChaosCluster):
    """The stack of deploy/docker-compose.yml, with the chaos overlay: region ``us`` as
    three members with its etcd of three, and ``eu`` and ``ap``."""

    def __init__(
        self,
        compose: list[str],
        image: str,
        etcd_image: str,
        root: Path,
        *,
        run_id: str,
        ttl_s: int,
    ) -> None:
        # (REGION, OTHERS[0]): ChaosCluster's proxied link, a pair of no two nodes here.
        super().__init__(image, (REGION, OTHERS[0]), root, run_id=run_id)
        self.names = NODES  # every node's service
        self.compose = compose
        self.etcd_image = etcd_image
        self.ttl_s = ttl_s
        self.certs = root / "archive" / "certs"  # the stack's (data_root's layout)
        self.etcd: dict[str, Region] = {}
        self.stack: Stack | None = None
        self._docker = docker.from_env()

    # -- lifecycle -------------------------------------------------------------------

    def up(self) -> None:
        """The stack with the overlay, up: once it returns every container was started
        (none need serve yet)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.control.mkdir(parents=True, exist_ok=True)  # ChaosCluster.heal_all writes there
        archive, user = data_root(self.root)
        assert archive / "certs" == self.certs
        access_map = self.certs / ACCESS_FILE  # the certs service keeps what it does not make
        access_map.write_text(ACCESS_MAP)
        access_map.chmod(0o644)
        if os.geteuid() == 0:
            os.chown(access_map, IMAGE_UID, IMAGE_UID)
        ports, _, port_settings = published_ports()
        etcd_ports = {name: free_port() for name in ETCDS}
        settings = {
            DATA_VARIABLE: str(archive),
            **port_settings,
            **user,
            "FENCEMARK_DECIDER_TTL": str(self.ttl_s),
            "FENCEMARK_ANTI_ENTROPY_INTERVAL": str(self.anti_entropy_interval),
            # The overlay's own.
            "FENCEMARK_CHAOS_RUN": self.run_id,
            **{port_variable(name): str(port) for name, port in etcd_ports.items()},
        }
        self.stack = Stack(self.compose, self.root, settings, files=(COMPOSE_FILE, OVERLAY))
        self.stack.env |= {"FENCEMARK_IMAGE": self.image, "FENCEMARK_ETCD_IMAGE": self.etcd_image}
        self.stack("up", "--detach", limit_s=UP_LIMIT_S)
        services = self._services()
        for name in NODES:
            self.regions[name] = Region(name, services[name], ports[name], archive / name)
        for name in ETCDS:
            self.etcd[name] = Region(name, services[name], etcd_ports[name], archive / name)

    def _services(self) -> dict[str, Service]:
        """Every container of the run's project, by its service."""
        assert self.stack is not None
        found = self._docker.containers.list(
            all=True, filters={"label": f"{PROJECT_LABEL}={self.stack.project}"}
        )
        return {box.labels[SERVICE_LABEL]: Service(box) for box in found}

    def close(self, logs_to: Path | None = None) -> None:
        """Save every container's log under ``logs_to`` (``<service>.log``), then take
        the project down: its containers, network and volumes."""
        try:
            if self.stack is None:
                return
            if logs_to is not None:
                logs_to.mkdir(parents=True, exist_ok=True)
                for name, service in self._services().items():
                    try:
                        log = service.get_wrapped_container().logs()
                        (logs_to / f"{name}.log").write_bytes(log)
                    except Exception as exc:  # a log is a nicety, the cleanup is not
                        (logs_to / f"{name}.log").write_text(f"no log: {exc}\n")
            # Killed first: a graceful stop of every node (down's SIGTERM) tells the
            # run nothing more and costs seconds.
            self.stack("kill", check=False)
            self.stack.down()
        finally:
            self._docker.close()

    # -- what the nemesis needs to know ----------------------------------------------

    @property
    def network_name(self) -> str:
        """The project's network, where nodes and etcd reach each other."""
        assert self.stack is not None
        return f"{self.stack.project}_default"

    def address(self, name: str) -> str:
        return self.regions[name].address

    def addresses(self) -> dict[str, str]:
        """Every node's client address, and every etcd's, as the test reaches them."""
        return {name: box.address for name, box in (*self.regions.items(), *self.etcd.items())}

    async def etcd_leader(self) -> str | None:
        """The etcd member leading now (None: none answers, or none leads), asked as
        etcd's root at each published client port in turn. etcd's certificates name
        only etcd-N, its name on the project's network: the handshake checks that."""
        credentials = TlsFiles.in_dir(self.certs, access.ROOT).channel_credentials()
        for name, box in self.etcd.items():
            options = [("grpc.ssl_target_name_override", name)]
            async with grpc.aio.secure_channel(box.address, credentials, options) as channel:
                try:
                    status = await rpc.MaintenanceStub(channel).Status(
                        rpc.StatusRequest(), timeout=ETCD_CALL_S
                    )
                    if not status.leader:
                        return None
                    listed = await rpc.ClusterStub(channel).MemberList(
                        rpc.MemberListRequest(), timeout=ETCD_CALL_S
                    )
                except grpc.aio.AioRpcError:
                    continue  # this one is down: the next
                return next((m.name for m in listed.members if status.leader == m.ID), None)
        return None

    # -- faults ----------------------------------------------------------------------

    def _etcd_ips(self) -> list[str]:
        ips = []
        for box in self.etcd.values():
            wrapped = box.container.get_wrapped_container()
            wrapped.reload()
            networks = wrapped.attrs["NetworkSettings"]["Networks"]
            ips.append(str(networks[self.network_name]["IPAddress"]))
        return ips

    def cut_from_etcd(self, member: str) -> None:
        """Drop every packet between ``member`` and etcd (nothing else)."""
        self._rules(member, _both_ways(self._etcd_ips(), "-j DROP"))

    def cut_from_members(self, member: str, others: Sequence[str]) -> None:
        """Drop every packet between ``member`` and each of ``others`` (etcd, the
        other regions and the clients still reach it)."""
        self._rules(member, _both_ways([self.ip(o) for o in others], "-j DROP"))
        for other in others:
            self._rules(other, _both_ways([self.ip(member)], "-j DROP"))

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
