"""``fencemark proxy``: fault proxies as a process, steered through a control file.

For drills against a real deployment (the chaos tier runs one as a container on a
link between two regions): each ``--link NAME=LISTEN=UPSTREAM`` is a
:class:`~fencemark.node.tools.proxy.FaultProxy`. The control file is JSON, re-read
whenever it changes; it names the faults each link has now::

    {"us-eu": {"latency_ms": 300, "bandwidth": 65536}, "eu-us": {"mode": "cut"}}

``mode`` is ``forward`` (default), ``cut`` or ``blackhole``; ``latency_ms``
(default 0) delays each direction; ``bandwidth`` (bytes/s, default none) caps
it. A link the file does not name, and a missing or empty file, mean healthy.
A file that does not parse is reported on stderr and ignored: the faults in
force stay until a valid file replaces it (write a temporary file and rename it
over the old one, so the proxy never reads half a file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fencemark.node.tools.proxy import FaultProxy

log = logging.getLogger(__name__)

CONTROL_POLL_SECONDS = 0.1
MODES = ("forward", "cut", "blackhole")


@dataclass(frozen=True)
class Link:
    name: str
    listen: str
    upstream: str


@dataclass(frozen=True)
class Faults:
    mode: str = "forward"
    latency_ms: float = 0.0
    bandwidth: float | None = None


def parse_link(spec: str) -> Link:
    """``NAME=LISTEN=UPSTREAM``, e.g. ``us-eu=0.0.0.0:7501=eu:7400``."""
    parts = spec.split("=")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--link: expected NAME=LISTEN_HOST:PORT=UPSTREAM_HOST:PORT, got {spec!r}")
    name, listen, upstream = parts
    for flag, address in (("LISTEN", listen), ("UPSTREAM", upstream)):
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--link {name}: {flag} must be HOST:PORT, got {address!r}")
    return Link(name, listen, upstream)


def parse_control(text: str, links: Sequence[str]) -> dict[str, Faults]:
    """The faults per link that a control file's ``text`` names; ValueError names the field."""
    if not text.strip():
        return {}
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ValueError("control file: expected a JSON object of link name -> faults")
    faults = {}
    for name, settings in document.items():
        if name not in links:
            raise ValueError(f"control file: no link named {name!r} (links: {', '.join(links)})")
        if not isinstance(settings, dict):
            raise ValueError(f"control file: {name}: expected an object")
        unknown = set(settings) - {"mode", "latency_ms", "bandwidth"}
        if unknown:
            raise ValueError(f"control file: {name}: unknown field {sorted(unknown)[0]!r}")
        mode = settings.get("mode", "forward")
        if mode not in MODES:
            raise ValueError(f"control file: {name}.mode: expected one of {MODES}, got {mode!r}")
        latency = settings.get("latency_ms", 0)
        if not isinstance(latency, int | float) or latency < 0:
            raise ValueError(f"control file: {name}.latency_ms: expected a number >= 0")
        bandwidth = settings.get("bandwidth")
        if bandwidth is not None and (not isinstance(bandwidth, int | float) or bandwidth <= 0):
            raise ValueError(f"control file: {name}.bandwidth: expected a number > 0 or null")
        faults[name] = Faults(mode, float(latency), None if bandwidth is None else float(bandwidth))
    return faults


def apply(proxy: FaultProxy, faults: Faults) -> None:
    proxy.set_latency(faults.latency_ms / 1000)
    proxy.set_bandwidth(faults.bandwidth)
    if faults.mode == "cut":
        proxy.cut()
    elif faults.mode == "blackhole":
        proxy.blackhole()
    else:
        proxy.heal()


async def run(links: Sequence[Link], control: Path | None, stop: asyncio.Event) -> None:
    """Serve ``links`` until ``stop`` is set, following ``control`` as it changes."""
    proxies: dict[str, FaultProxy] = {}
    try:
        for link in links:
            proxies[link.name] = await FaultProxy.start(link.upstream, link.listen, link.name)
            print(f"fencemark proxy: {link.name} {proxies[link.name].address} -> {link.upstream}",
                  flush=True)  # fmt: skip
        seen: tuple[float, int] | None = None
        current: Mapping[str, Faults] = {}
        while not stop.is_set():
            if control is not None:
                seen, current = _follow(control, proxies, seen, current)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CONTROL_POLL_SECONDS):
                    await stop.wait()
    finally:
        for proxy in proxies.values():
            await proxy.close()


def _follow(
    control: Path,
    proxies: Mapping[str, FaultProxy],
    seen: tuple[float, int] | None,
    current: Mapping[str, Faults],
) -> tuple[tuple[float, int] | None, Mapping[str, Faults]]:
    try:
        stat = control.stat()
        version: tuple[float, int] | None = (stat.st_mtime, stat.st_ino)
    except FileNotFoundError:
        version = None
    if version == seen:
        return seen, current
    try:
        wanted = parse_control(control.read_text() if version else "", list(proxies))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"fencemark proxy: ignoring {control}: {exc}", file=sys.stderr, flush=True)
        return version, current
    for name, proxy in proxies.items():
        faults = wanted.get(name, Faults())
        if faults != current.get(name, Faults()):
            apply(proxy, faults)
            print(f"fencemark proxy: {name}: {faults}", flush=True)
    return version, wanted


def cmd_proxy(args: argparse.Namespace) -> int:
    try:
        links = [parse_link(spec) for spec in args.link]
    except ValueError as exc:
        print(f"fencemark proxy: {exc}", file=sys.stderr)
        return 2
    names = [link.name for link in links]
    if len(set(names)) != len(names):
        print("fencemark proxy: --link: every link needs its own NAME", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(links, Path(args.control) if args.control else None, stop)

    asyncio.run(main())
    return 0


def add_proxy_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    proxy = sub.add_parser(
        "proxy",
        help="fault-injecting TCP proxies between nodes, steered by a control file (drills)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy.add_argument(
        "--link",
        action="append",
        required=True,
        metavar="NAME=LISTEN=UPSTREAM",
        help="forward connections at LISTEN (HOST:PORT) to UPSTREAM (HOST:PORT); repeat",
    )
    proxy.add_argument("--control", default=None, help="JSON file naming each link's faults")
    proxy.set_defaults(func=cmd_proxy)
