"""The watchers of the ``feed`` scenario's write-path part, in a process of their own.

``python -m fencemark.bench.feed_watchers TARGET REPO TOPIC MARKER COUNT`` opens
COUNT ``Records.Watch`` streams of REPO/TOPIC at TARGET, all through one client, and
counts the events each stream receives between two kinds of write of the record
MARKER: once every stream has seen MARKER with ``phase=ready`` it prints ``ready``;
once every stream has seen it with ``phase=end`` it prints one JSON line
(``{"events": [count per stream], "cpu_s": ...}``) and exits. The feed is in commit
order, so a stream that saw the ``end`` write (made after every timed write was
acknowledged) has seen every timed write, or lost some.

A process of their own, so that taking the events does not take turns on the event
loop of the writers being timed; the machine's cores are still shared
(docs/performance.md says how that shows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from fencemark.client import AsyncClient

READY, END = "ready", "end"  # the MARKER's ``phase`` field
LIMIT_S = 600.0  # a run that never sees its end stops anyway


class Streams:
    """COUNT watchers of one topic and what each has received."""

    def __init__(self, client: AsyncClient, repo: str, topic: str, marker: str, count: int):
        self.client = client
        self.repo = repo
        self.topic = topic
        self.marker = marker
        self.events = [0] * count
        self.ready = [False] * count
        self.all_ready = asyncio.Event()

    async def one(self, index: int) -> None:
        """Watch until the ``end`` write; count what comes between ``ready`` and it."""
        async for event in self.client.watch(self.repo, topic=self.topic):
            if event.key != self.marker:
                if self.ready[index]:
                    self.events[index] += 1
                continue
            phase = event.record.fields.get("phase")
            if phase == END and self.ready[index]:
                return
            if phase == READY and not self.ready[index]:
                self.ready[index] = True
                if all(self.ready):
                    self.all_ready.set()

    async def announce_ready(self) -> None:
        await self.all_ready.wait()
        print(READY, flush=True)


async def watch(target: str, repo: str, topic: str, marker: str, count: int) -> dict[str, Any]:
    async with AsyncClient(target, retries=0) as client:
        streams = Streams(client, repo, topic, marker, count)
        async with asyncio.timeout(LIMIT_S), asyncio.TaskGroup() as group:
            group.create_task(streams.announce_ready())
            for index in range(count):
                group.create_task(streams.one(index))
    return {"events": streams.events, "cpu_s": time.process_time()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fencemark.bench.feed_watchers")
    parser.add_argument("target")
    parser.add_argument("repo")
    parser.add_argument("topic")
    parser.add_argument("marker", help="the key of the record whose writes mark the run")
    parser.add_argument("count", type=int)
    args = parser.parse_args(argv)
    counts = asyncio.run(watch(args.target, args.repo, args.topic, args.marker, args.count))
    print(json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
