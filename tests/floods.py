"""An unauthenticated flood: idle TCP connections that never send a byte, re-opened as
they are closed, for a bounded time.

``python -m tests.floods --target HOST:PORT [--target ...] --sockets 500 --seconds 30``
keeps ``--sockets`` connections open to each target, from the loopback addresses
127.0.0.2 to 127.0.0.9 in turn (so a bound per source address does not stop it
alone), says ``flooding`` once all are open, and opens a new one for each the
target closes. At the end it prints one JSON line per target: connections opened,
seen closed by the target, and connection attempts that failed. It stops by itself
after ``--seconds``.

A never-sent TLS hello is what a node's ports must shrug off (docs/security.md,
*Connection floods*; tests/test_floods.py runs this for 30 s, the soak run of
docs/testing.md for two minutes).
"""

from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import signal
import socket
import time
from dataclasses import asdict, dataclass

SOURCES = [f"127.0.0.{n}" for n in range(2, 10)]


@dataclass
class Tally:
    target: str
    opened: int = 0
    closed: int = 0  # by the target: EOF or reset
    failed: int = 0  # attempts that did not connect


class Flood:
    def __init__(self, targets: list[str], sockets: int) -> None:
        self.selector = selectors.DefaultSelector()
        self.sockets = sockets
        self.tallies = {t: Tally(t) for t in targets}
        self._source = 0

    def _open(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if host.startswith("127."):  # many sources on loopback; elsewhere, the host's own
            sock.bind((SOURCES[self._source % len(SOURCES)], 0))
            self._source += 1
        code = sock.connect_ex((host, int(port)))
        if code not in (0, errno.EINPROGRESS):
            self.tallies[target].failed += 1
            sock.close()
            return
        self.tallies[target].opened += 1
        self.selector.register(sock, selectors.EVENT_READ, target)

    def fill(self) -> None:
        for target in self.tallies:
            for _ in range(self.sockets):
                self._open(target)

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in self.selector.select(timeout=min(left, 0.2)):
                sock, target = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""  # reset, refused
                if data:
                    continue  # the target said something first (not expected): keep it
                self.selector.unregister(sock)
                sock.close()
                self.tallies[target].closed += 1
                self._open(target)  # re-open as it is closed

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--target", action="append", required=True, help="HOST:PORT")
    parser.add_argument("--sockets", type=int, default=500, help="per target")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    wanted = len(args.target) * args.sockets + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted), hard))
    flood = Flood(args.target, args.sockets)

    def stop(*_: object) -> None:
        raise TimeoutError  # SIGTERM: end the flood early, and still report

    signal.signal(signal.SIGTERM, stop)
    try:
        flood.fill()
        print("flooding", flush=True)
        flood.run(args.seconds)
    except TimeoutError:
        pass
    finally:
        flood.close()
    for tally in flood.tallies.values():
        print(json.dumps(asdict(tally)), flush=True)


if __name__ == "__main__":
    main()
