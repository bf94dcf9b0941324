"""Region containers on a test network, and the faults a nemesis injects into them.

Everything here is real: one container per region from the locally built image
(testcontainers, with the docker SDK underneath), a bridge network created for
this run, each node's data in a host directory bind-mounted as its volume, and
a ``fencemark proxy`` container on the link between the first two regions.

Every connection is mutual TLS, as in a real deployment (deploy/docker-compose.yml):
the run makes its own development CA (``fencemark.node.security.tls.init_dir``), with a node
certificate per region that also names ``proxy`` (the us<->eu link reaches its peer
through the proxy container's alias, so the peer's certificate must name it), and
each node gets a read-only directory holding only the CA, its own certificate and
its key (``FENCEMARK_TLS_DIR``), and the run's access map (``FENCEMARK_ACCESS``,
:data:`ACCESS_MAP`). The test's own clients get client certificates of the same CA,
one per identity, issued when first asked for (:meth:`ChaosCluster.client_credentials`);
the map lets each of them read, write and claim, as without one, and only
:data:`OPERATOR` operate (``Claims.Reopen``, ``Claims.ForceRelease``; docs/security.md).

Traffic stays where the chaos tier may send it. Nodes talk to each other on the
run's own network (by their region name, a network alias). The test reaches
each node through the port it publishes on 127.0.0.1, and node-to-node faults
are iptables rules inside the node's own network namespace (``docker exec
--user 0`` with ``NET_ADMIN``), matching only the peers' addresses on that
network, so the test's own connections are never cut.

Faults:

- :meth:`partition` / :meth:`cut`: DROP every packet between regions of different
  groups, or of given pairs
  (a lost packet, not a refusal, as across a real WAN partition);
- :meth:`lose_packets`: drop a random fraction of node-to-node packets
  (iptables ``statistic``);
- :meth:`slow_link`: latency and a bandwidth cap on the proxied link;
- :meth:`kill` / :meth:`start_node`: ``kill -9`` (SIGKILL to PID 1; or SIGTERM, a
  graceful stop) and a restart on the same volume;
- :meth:`wipe`: the volume's contents removed while the node is down (disk loss);
- :meth:`copy_data` / :meth:`restore_data`: a copy of a frozen (or stopped) node's
  volume, every file as it is (the SQLite file with its ``-wal`` and ``-shm``: what a
  disk snapshot holds), and that copy put back in place of a stopped node's volume
  later (its disk went back in time);
- :meth:`start_twin` / :meth:`stop_twin`: a second container of a region's node,
  started from a copy of its volume (:meth:`copy_data`) while the original runs, with
  the same node certificate and peers under an alias and a port of its own, and its
  ``kill -9`` and removal (a twin: docs/replication.md);
- :meth:`pause` / :meth:`unpause`: the cgroup freezer (``docker pause``).

Ryuk cannot be pulled here, so testcontainers runs with it disabled
(``TESTCONTAINERS_RYUK_DISABLED=true``) and :meth:`close` removes every
container and the network itself; every object carries the label
``fencemark.chaos=<run id>`` so that a crashed run's leftovers can be found.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from fencemark.client import tls_credentials
from fencemark.node.security.tls import Identity, TlsFiles, init_dir, issue_into
from tests.dockerenv import IMAGE_UID
from tests.ports import free_port

# Read when the first container starts, not at import.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

NODE_PORT = 7400  # clients: the test, published on 127.0.0.1
PEER_PORT = 7500  # peers: the image's peer listener (FENCEMARK_PEER_LISTEN), as deployed
PROXY_PORTS = (7501, 7502)
DATA_IN_CONTAINER = "/var/lib/fencemark"
CONTROL_IN_CONTAINER = "/control"
TLS_IN_CONTAINER = "/etc/fencemark/tls"
PROXY_ALIAS = "proxy"
LABEL = "fencemark.chaos"
STOP_LIMIT_S = 30.0
OPERATOR = "operator"  # the one client identity with the operator's right
# The change feed (watchers.py): every change of a run kept, so that no watcher's
# cursor expires but with a lost disk. And a record cache far smaller than the
# records, so that most reads go to the data file, as in a large store: reads of the
# file racing commits are what once made watchers skip changes.
FEED_WINDOW = 500_000
CACHE_SIZE = 64
ACCESS_FILE = "access.toml"
# What a deployment's map would say: agents read, write and claim; the operator may
# also reopen parked items and take claims back.
ACCESS_MAP = f"""[clients]
"*" = ["read", "write", "claim"]
{OPERATOR} = ["read", "write", "claim", "operate"]
"""


class Boxed(Protocol):
    """A container of the run as the faults reach it, the docker SDK's container
    inside: testcontainers' ``DockerContainer`` (this module's), or a compose
    service's (members.py's ``Service``)."""

    def get_wrapped_container(self) -> Any: ...


@dataclass
class Region:
    name: str
    container: Boxed
    port: int  # published on 127.0.0.1
    data: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class ChaosCluster:
    """Region nodes in containers: start them, break them, heal them, remove them."""

    def __init__(
        self,
        image: str,
        regions: Sequence[str],
        root: Path,
        *,
        run_id: str,
        anti_entropy_interval: float = 1.0,
    ) -> None:
        if len(regions) < 2:
            raise ValueError("a chaos cluster needs at least two regions")
        self.image = image
        self.names = tuple(regions)
        self.root = root
        self.run_id = run_id
        self.anti_entropy_interval = anti_entropy_interval
        self.proxied = (self.names[0], self.names[1])  # the link the proxy carries
        self.network = Network(docker_network_kw={"labels": {LABEL: run_id}, "driver": "bridge"})
        self.regions: dict[str, Region] = {}
        self.proxy: DockerContainer | None = None
        self.twins: list[Region] = []  # second processes started from copies, while they run
        self._twin_logs: dict[str, bytes] = {}  # the output of each twin stopped, by alias
        self.control = root / "control"
        self.certs = root / "certs"  # the run's CA, node and client certificates (host only)
        self._credentials: dict[str, grpc.ChannelCredentials] = {}
        # Who the nodes run as: the image's user, unless the data directories
        # (made here) must stay writable by an unprivileged test runner.
        as_root = os.geteuid() == 0
        self.user = f"{IMAGE_UID}:{IMAGE_UID}" if as_root else f"{os.getuid()}:{os.getgid()}"

    # -- lifecycle -------------------------------------------------------------------

    def up(self) -> None:
        """Create the network, the proxy and every region's node (not yet serving)."""
        self.network.create()
        init_dir(self.certs, regions=self.names, hosts=[PROXY_ALIAS])
        self.control.mkdir(parents=True, exist_ok=True)
        self.control.chmod(0o755)
        self.set_link_faults({})
        a, b = self.proxied
        self.proxy = self._container(
            PROXY_ALIAS,
            command=[
                "proxy",
                "--link", f"{a}-{b}=0.0.0.0:{PROXY_PORTS[0]}={b}:{PEER_PORT}",
                "--link", f"{b}-{a}=0.0.0.0:{PROXY_PORTS[1]}={a}:{PEER_PORT}",
                "--control", f"{CONTROL_IN_CONTAINER}/faults.json",
            ],
            volumes=[(str(self.control), CONTROL_IN_CONTAINER, "ro")],
        )  # fmt: skip
        self.proxy.start()
        for name in self.names:
            data, port = self._data_dir(name), free_port()
            container = self._node_container(name, name, data, self._node_certs(name), port)
            self.regions[name] = Region(name, container, port, data)
            container.start()

    def _data_dir(self, name: str) -> Path:
        """A new data directory for ``name``'s node, the image's user its owner."""
        data = self.root / "data" / name
        data.mkdir(parents=True)
        if os.geteuid() == 0:
            os.chown(data, IMAGE_UID, IMAGE_UID)
        return data

    def _node_container(
        self, alias: str, region: str, data: Path, certs: Path, port: int
    ) -> DockerContainer:
        """A node of ``region`` on ``data``, known on the run's network as ``alias``,
        with ``region``'s peers and node certificate, published on ``port``."""
        return self._container(
            alias,
            command=["node"],
            env={
                "FENCEMARK_REGION": region,
                # Mutual TLS, signed grants, births and writes: the proxy relays
                # the TLS bytes as they are, and verifies nothing itself.
                "FENCEMARK_TLS_DIR": TLS_IN_CONTAINER,
                "FENCEMARK_ACCESS": f"{TLS_IN_CONTAINER}/{ACCESS_FILE}",
                "FENCEMARK_ENABLE_WRITES": "1",
                "FENCEMARK_PEERS": ",".join(
                    f"{peer}={self.peer_address(region, peer)}"
                    for peer in self.names
                    if peer != region
                ),
                "FENCEMARK_ANTI_ENTROPY_INTERVAL": str(self.anti_entropy_interval),
                "FENCEMARK_FEED_WINDOW": str(FEED_WINDOW),
                "FENCEMARK_CACHE_SIZE": str(CACHE_SIZE),
                "FENCEMARK_LOG_LEVEL": "WARNING",
            },
            volumes=[
                (str(data), DATA_IN_CONTAINER, "rw"),
                (str(certs), TLS_IN_CONTAINER, "ro"),
            ],
            port=port,
        )

    def _node_certs(self, name: str) -> Path:
        """A directory with what ``name``'s node reads, and nothing else: the CA
        certificate, its own certificate and its key (owned by the node's user), and
        the access map."""
        mounted = self.root / "node-certs" / name
        mounted.mkdir(parents=True)
        files = self.node_files(name)
        (mounted / ACCESS_FILE).write_text(ACCESS_MAP)
        for path in (files.ca, files.cert, files.key):
            shutil.copy2(path, mounted / path.name)  # the key keeps its mode, 0600
        for path in mounted.iterdir():
            if os.geteuid() == 0:
                os.chown(path, IMAGE_UID, IMAGE_UID)
        return mounted

    def _container(
        self,
        alias: str,
        *,
        command: list[str],
        volumes: Iterable[tuple[str, str, str]],
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> DockerContainer:
        container = DockerContainer(
            self.image,
            command=command,  # type: ignore[arg-type]  # a list is passed through to docker
            env=env or {},
            name=f"fencemark-chaos-{self.run_id}-{alias}",
            network=self.network,
            network_aliases=[alias],
            volumes=list(volumes),
        )
        if port is not None:
            # Published on loopback only (with_bind_ports binds every interface).
            container.ports[f"{NODE_PORT}/tcp"] = ("127.0.0.1", port)  # type: ignore[assignment]
        return container.with_kwargs(
            user=self.user,
            cap_add=["NET_ADMIN"],
            labels={LABEL: self.run_id},
            # The image's HEALTHCHECK probes a node; the proxy is none, and the
            # test watches the nodes itself.
            healthcheck={"test": ["NONE"]},
        )

    def peer_address(self, src: str, dst: str) -> str:
        """How ``src``'s node reaches ``dst``'s: directly, or through the proxy (whose
        alias ``dst``'s certificate names, so that the handshake verifies)."""
        if (src, dst) == self.proxied:
            return f"{PROXY_ALIAS}:{PROXY_PORTS[0]}"
        if (dst, src) == self.proxied:
            return f"{PROXY_ALIAS}:{PROXY_PORTS[1]}"
        return f"{dst}:{PEER_PORT}"

    # -- certificates ----------------------------------------------------------------

    def node_files(self, region: str) -> TlsFiles:
        """``region``'s node certificate and key, as the run's CA issued them (the
        forger of ``forger.py`` holds them too: a peer's node, or its stolen key)."""
        return TlsFiles.in_dir(self.certs, region)

    def client_credentials(self, name: str) -> grpc.ChannelCredentials:
        """Mutual TLS credentials of the client identity ``name`` (``client/NAME``),
        its certificate issued by the run's CA the first time it is asked for."""
        if name in self.names:
            raise ValueError(f"{name!r} is a region: a client identity needs another name")
        if name not in self._credentials:
            if not TlsFiles.in_dir(self.certs, name).cert.exists():
                issue_into(self.certs, Identity("client", name))
            self._credentials[name] = tls_credentials(self.certs, name)
        return self._credentials[name]

    def containers(self) -> list[tuple[str, Boxed]]:
        """Every container of the run, by alias."""
        containers: list[tuple[str, Boxed]] = [
            (r.name, r.container) for r in (*self.regions.values(), *self.twins)
        ]
        if self.proxy is not None:
            containers.append((PROXY_ALIAS, self.proxy))
        return containers

    def close(self, logs_to: Path | None = None) -> None:
        """Save every container's log under ``logs_to``, then remove containers and network."""
        containers = self.containers()
        if logs_to is not None:
            logs_to.mkdir(parents=True, exist_ok=True)
            for alias, output in self._twin_logs.items():
                (logs_to / f"{alias}.log").write_bytes(output)
        for name, container in containers:
            assert isinstance(container, DockerContainer)  # this module made each
            wrapped = container._container  # None when it never started
            if wrapped is None:
                continue
            if logs_to is not None:
                logs_to.mkdir(parents=True, exist_ok=True)
                try:
                    (logs_to / f"{name}.log").write_bytes(wrapped.logs())
                except Exception as exc:  # a log is a nicety, the cleanup is not
                    (logs_to / f"{name}.log").write_text(f"no log: {exc}\n")
            container.stop(force=True, delete_volume=True)
        if self.network._network is not None:
            self.network.remove()

    # -- what the test needs to know -------------------------------------------------

    @property
    def network_name(self) -> str:
        """The network the nodes reach each other on: the run's own."""
        return self.network.name

    def ip(self, name: str) -> str:
        """``name``'s address on the run's network (it may change across restarts)."""
        container = self.proxy if name == PROXY_ALIAS else self.regions[name].container
        assert container is not None
        wrapped = container.get_wrapped_container()
        wrapped.reload()
        networks: dict[str, Any] = wrapped.attrs["NetworkSettings"]["Networks"]
        return str(networks[self.network_name]["IPAddress"])

    def status(self, name: str) -> str:
        wrapped = self.regions[name].container.get_wrapped_container()
        wrapped.reload()
        return str(wrapped.status)

    # -- network faults --------------------------------------------------------------

    def _rules(self, name: str, rules: Sequence[str]) -> None:
        """Replace ``name``'s INPUT/OUTPUT rules by ``rules`` (iptables argument strings)."""
        script = "iptables -F INPUT && iptables -F OUTPUT"
        for rule in rules:
            script += f" && iptables {rule}"
        container = self.regions[name].container.get_wrapped_container()
        code, output = container.exec_run(["sh", "-c", script], user="0")
        if code != 0:
            raise RuntimeError(f"iptables in {name} exited {code}: {output.decode()[-500:]}")

    def _peer_ips(self, name: str, others: Iterable[str]) -> list[str]:
        """The addresses ``name`` exchanges traffic with when it talks to ``others``."""
        ips = []
        for other in others:
            ips.append(self.ip(other))
            if {name, other} == set(self.proxied):
                ips.append(self.ip(PROXY_ALIAS))
        return ips

    def partition(self, groups: Sequence[set[str]]) -> None:
        """Drop every packet between regions in different groups; groups cover each once."""
        group_of = {name: i for i, group in enumerate(groups) for name in group}
        if sorted(group_of) != sorted(self.names) or sum(map(len, groups)) != len(self.names):
            raise ValueError(f"groups {groups} must cover {self.names} once each")
        self.cut([(a, b) for a in self.names for b in self.names if group_of[a] < group_of[b]])

    def cut(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Drop every packet between the two regions of each pair (and only those)."""
        apart: dict[str, set[str]] = {name: set() for name in self.names}
        for a, b in pairs:
            apart[a].add(b)
            apart[b].add(a)
        for name in self.names:
            self._rules(name, _both_ways(self._peer_ips(name, sorted(apart[name])), "-j DROP"))

    def lose_packets(self, probability: float) -> None:
        """Drop each node-to-node packet with ``probability``, in both directions."""
        for name in self.names:
            ips = self._peer_ips(name, [o for o in self.names if o != name])
            match = f"-m statistic --mode random --probability {probability:.3f} -j DROP"
            self._rules(name, _both_ways(ips, match))

    def heal_network(self) -> None:
        """Remove every iptables fault from every running node."""
        for name in self.names:
            if self.status(name) == "running":
                self._rules(name, [])

    def set_link_faults(self, faults: dict[str, dict[str, object]]) -> None:
        """Write the proxy's control file (``fencemark proxy``), atomically."""
        staged = self.control / "faults.json.tmp"
        staged.write_text(json.dumps(faults))
        staged.chmod(0o644)
        staged.replace(self.control / "faults.json")

    def slow_link(self, latency_ms: float, bandwidth: float | None) -> None:
        a, b = self.proxied
        faults: dict[str, object] = {"latency_ms": latency_ms, "bandwidth": bandwidth}
        self.set_link_faults({f"{a}-{b}": faults, f"{b}-{a}": faults})

    # -- process faults --------------------------------------------------------------

    def kill(self, name: str, signal: str = "SIGKILL") -> None:
        """``kill -9`` the node (PID 1): no shutdown handler runs. With ``SIGTERM``
        it shuts down gracefully; either way this returns once it has exited."""
        container = self.regions[name].container.get_wrapped_container()
        container.kill(signal=signal)
        self._wait_status(name, "exited")

    def start_node(self, name: str) -> None:
        """Start a stopped node again, on the same volume and published port."""
        self.regions[name].container.get_wrapped_container().start()
        self._wait_status(name, "running")

    def wipe(self, name: str) -> None:
        """Disk loss: remove everything in a stopped node's volume."""
        if self.status(name) == "running":
            raise RuntimeError(f"wipe {name}: stop it first")
        for entry in self.regions[name].data.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def copy_data(self, name: str, to: Path) -> int:
        """A crash-consistent copy of ``name``'s volume into ``to`` (made anew): every
        file as it is, the database with its ``-wal`` and ``-shm``, owners and modes
        kept. The node must be frozen (``pause``) or stopped, so that no commit is half
        in the copy: what a disk snapshot of a running machine holds, as the node would
        find it after a power cut. How many files it holds."""
        status = self.status(name)
        if status not in ("paused", "exited"):
            raise RuntimeError(f"copy {name}'s data: it is {status}; pause or stop it first")
        if to.exists():
            shutil.rmtree(to)
        return _copy_tree(self.regions[name].data, to)

    def restore_data(self, name: str, copy: Path) -> None:
        """Put ``copy`` (:meth:`copy_data`'s) back in place of a stopped node's volume:
        everything written since the copy was taken is gone from its disk, and nothing
        on the disk says so (an old snapshot reverted, an old backup put back by hand)."""
        self.wipe(name)  # refuses a running node
        data = self.regions[name].data
        for entry in copy.iterdir():
            target = data / entry.name
            if entry.is_dir():
                _copy_tree(entry, target)
            else:
                shutil.copy2(entry, target)
                _same_owner(entry, target)

    def start_twin(self, name: str, copy: Path) -> Region:
        """A second process of ``name``'s node, started from ``copy`` (:meth:`copy_data`'s,
        taken while it ran) beside the original, which goes on running: the same region,
        node certificate and access map, the same peers, on the run's network under an
        alias of its own (``<name>-twin-<n>``: peers go on calling the original by its
        region's alias; the twin calls them) and its own port on 127.0.0.1. What an
        operator who starts a replacement host while the old one still runs makes, or
        an attacker with a copy of the disk and the node's key (docs/replication.md,
        *Twins*). Returns once the container runs; :meth:`stop_twin` removes it."""
        alias = f"{name}-twin-{len(self.twins) + len(self._twin_logs)}"
        certs = self.root / "node-certs" / name  # the original's, as _node_certs made them
        port = free_port()
        container = self._node_container(alias, name, copy, certs, port)
        twin = Region(alias, container, port, copy)
        self.twins.append(twin)
        container.start()
        _wait_for(container, "running", alias)
        return twin

    def stop_twin(self, twin: Region) -> bytes:
        """``kill -9`` a twin and remove its container; its output, which is kept for
        :meth:`close`'s logs too."""
        wrapped = twin.container.get_wrapped_container()
        wrapped.kill(signal="SIGKILL")
        _wait_for(twin.container, "exited", twin.name)
        try:
            output = bytes(wrapped.logs())
        except Exception as exc:  # a log is a nicety, the removal is not
            output = f"no log: {exc}\n".encode()
        self._twin_logs[twin.name] = output
        assert isinstance(twin.container, DockerContainer)  # start_twin made it
        twin.container.stop(force=True, delete_volume=True)
        self.twins.remove(twin)
        return output

    def pause(self, name: str) -> None:
        self.regions[name].container.get_wrapped_container().pause()

    def unpause(self, name: str) -> None:
        self.regions[name].container.get_wrapped_container().unpause()

    def heal_all(self) -> None:
        """Every fault undone: twins stopped, nodes running and unpaused, network and
        link clean."""
        for twin in list(self.twins):
            self.stop_twin(twin)
        for name in self.names:
            status = self.status(name)
            if status == "paused":
                self.unpause(name)
            elif status != "running":
                self.start_node(name)
        self.heal_network()
        self.set_link_faults({})

    def _wait_status(self, name: str, wanted: str) -> None:
        _wait_for(self.regions[name].container, wanted, name)


def _wait_for(container: Boxed, wanted: str, name: str) -> None:
    """Until ``container`` is ``wanted`` (its docker status), at most STOP_LIMIT_S."""
    wrapped = container.get_wrapped_container()
    deadline = time.monotonic() + STOP_LIMIT_S
    while True:
        wrapped.reload()
        if (status := str(wrapped.status)) == wanted:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} is {status}, not {wanted}, after {STOP_LIMIT_S} s")
        time.sleep(0.05)


def _same_owner(source: Path, target: Path) -> None:
    """``target`` owned as ``source`` is (a node runs as the image's user; a copy made
    by root would be root's, and unwritable to it)."""
    if os.geteuid() == 0:
        stat = source.lstat()
        os.lchown(target, stat.st_uid, stat.st_gid)


def _copy_tree(source: Path, target: Path) -> int:
    """``source`` copied to ``target`` (which must not exist), with every file's
    contents, mode, times and owner; how many files."""
    shutil.copytree(source, target, symlinks=True)
    files = 0
    for path in (source, *sorted(source.rglob("*"))):
        _same_owner(path, target / path.relative_to(source))
        files += path.is_file()
    return files


def _both_ways(ips: Iterable[str], action: str) -> list[str]:
    """iptables rules applying ``action`` to packets from and to each of ``ips``."""
    return [rule for ip in ips for rule in (f"-A INPUT -s {ip} {action}",
                                            f"-A OUTPUT -d {ip} {action}")]  # fmt: skip
