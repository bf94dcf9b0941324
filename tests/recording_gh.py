"""A recording ``gh``: answers ``gh issue view|comment|close|reopen|edit`` as the GitHub
CLI does, against issues kept in a JSON file, and logs every call.

GitHub cannot be reached from the tests, so ``fencemark mirror --push`` meets this
on its ``PATH`` instead (``install`` puts a ``gh`` there that runs it). Environment:

- ``RECORDING_GH_STATE``: the issues, ``{"12": {"state": "OPEN", "comments":
  [...], "labels": [...]}}``, read and written under a lock (runs may overlap);
- ``RECORDING_GH_LOG``: one JSON line per call, ``{"argv": [...], "stdin": "..."}``;
- ``RECORDING_GH_FAIL``: ``auth`` (not logged in) or ``rate`` (rate-limited) for
  every call, or ``N`` to refuse every call about issue N;
- ``RECORDING_GH_SLOW``: seconds every call takes before it answers;
- ``RECORDING_GH_KILL_CALLER_AFTER``: ``comment`` — after a comment is made, the
  process that ran ``gh`` is killed (``SIGKILL``): a crash between the comment and
  whatever its caller meant to do next.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXIT_FAILED, EXIT_AUTH = 1, 4


def install(bin_dir: Path) -> Path:
    """A ``gh`` in ``bin_dir`` that runs this module with this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    gh = bin_dir / "gh"
    gh.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    gh.chmod(0o755)
    return gh


def issue(state: str = "OPEN") -> dict[str, Any]:
    return {"state": state, "comments": [], "labels": []}


@contextlib.contextmanager
def _state() -> Iterator[dict[str, Any]]:
    path = Path(os.environ["RECORDING_GH_STATE"])
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        issues: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        yield issues
        path.write_text(json.dumps(issues, indent=1))


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(message, file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    body = sys.stdin.read() if "--body-file" in argv else ""
    with open(os.environ["RECORDING_GH_LOG"], "a") as log:
        log.write(json.dumps({"argv": argv, "stdin": body}) + "\n")
    args = list(argv)
    if "-R" in args:  # the repository: one, here
        at = args.index("-R")
        del args[at : at + 2]
    if args[:1] != ["issue"] or len(args) < 3:
        return _fail(f"unknown command {' '.join(argv)!r} for the recording gh")
    command, number = args[1], args[2]
    time.sleep(float(os.environ.get("RECORDING_GH_SLOW") or 0))
    fail = os.environ.get("RECORDING_GH_FAIL", "")
    if fail == "auth":
        return _fail("To get started with GitHub CLI, please run:  gh auth login", EXIT_AUTH)
    if fail == "rate":
        return _fail("GraphQL: API rate limit exceeded for user ID 1.")
    if fail == number:
        return _fail(
            f"HTTP 502: Server Error (https://api.github.com/repos/acme/widgets/issues/{number})"
        )
    with _state() as issues:
        found = issues.get(number)
        if found is None:
            return _fail(
                "GraphQL: Could not resolve to an issue or pull request with the number"
                f" of {number}. (repository.issue)"
            )
        if command == "view":
            comments = [
                {"author": {"login": "fencemark-bot"}, "body": c} for c in found["comments"]
            ]
            print(json.dumps({"comments": comments, "state": found["state"]}))
        elif command == "comment":
            found["comments"].append(body)
            print(
                f"https://github.com/acme/widgets/issues/{number}#issuecomment-{len(found['comments'])}"
            )
        elif command in ("close", "reopen"):
            wanted = "CLOSED" if command == "close" else "OPEN"
            if found["state"] == wanted:
                print(f"! Issue #{number} is already {wanted.lower()}", file=sys.stderr)
            found["state"] = wanted
        elif command == "edit":
            for flag, value in zip(args[3::2], args[4::2], strict=False):
                if flag == "--add-label" and value not in found["labels"]:
                    found["labels"].append(value)
                elif flag == "--remove-label" and value in found["labels"]:
                    found["labels"].remove(value)
            print(f"https://github.com/acme/widgets/issues/{number}")
        else:
            return _fail(f"unknown command {command!r} for the recording gh")
    if command == "comment" and os.environ.get("RECORDING_GH_KILL_CALLER_AFTER") == "comment":
        os.kill(os.getppid(), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
