"""Docker helpers shared by the deployment tests and the chaos tier.

The engine and the image are session fixtures in ``tests/conftest.py``
(``docker_engine``, ``image``); a missing engine is decided like every other
missing component (``tests/components.py``: skipped locally, a failure under CI). The image is
the one ``make image`` built (found by tag), or is built by the same scripts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
IMAGE = os.environ.get("FENCEMARK_IMAGE") or "fencemark:dev"
BASE_IMAGE = os.environ.get("FENCEMARK_BASE_IMAGE") or "fencemark/base:bookworm"
PROMETHEUS_IMAGE = os.environ.get("FENCEMARK_PROMETHEUS_IMAGE") or "fencemark/prometheus:dev"
ETCD_IMAGE = os.environ.get("FENCEMARK_ETCD_IMAGE") or "fencemark/etcd-server:dev"
IMAGE_UID = 10001
REVISION_LABEL = "org.opencontainers.image.revision"
# Bounds, in seconds. A base image takes about 1.5 min, the image about 1 min.
BUILD_LIMIT_S = 600.0


# -- running commands ----------------------------------------------------------------


def run(
    args: Sequence[str],
    *,
    limit_s: float = 60.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion within ``limit_s``; ``check`` asserts exit 0."""
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=limit_s, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(args)} still running after {limit_s} s") from exc
    if check:
        assert done.returncode == 0, (
            f"{' '.join(args)} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
        )
    return done


def wait_until(what: str, limit_s: float, probe: Callable[[], bool]) -> None:
    """Poll ``probe()`` every half second until it holds, for at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(0.5)


# -- the engine and the image --------------------------------------------------------


def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], check=False).returncode == 0


def image_is_stale(tag: str) -> bool:
    """Whether ``tag`` was built from another commit than this clean checkout's.

    Images outlive a checkout on the same machine; in a tree with uncommitted
    changes the label cannot tell, and the tag is trusted (``make image`` rebuilds).
    """
    git = ["git", "-C", str(ROOT)]
    head = run([*git, "rev-parse", "HEAD"], check=False).stdout.strip()
    if not head or run([*git, "diff", "--quiet", "HEAD"], check=False).returncode != 0:
        return False
    labels = inspect("image", tag)["Config"]["Labels"] or {}  # type: ignore[index]
    return bool(labels.get(REVISION_LABEL) != head)


def ensure_image() -> str:
    """``IMAGE`` as ``make image`` built it, else built here by the same scripts."""
    if not image_exists(IMAGE) or image_is_stale(IMAGE):
        run([str(DEPLOY / "build-base-image.sh"), "--tag", BASE_IMAGE], limit_s=BUILD_LIMIT_S)
        run(
            [str(DEPLOY / "build-image.sh"), "--base-image", BASE_IMAGE, "--tag", IMAGE],
            limit_s=BUILD_LIMIT_S,
            env={**os.environ, "PYTHON": sys.executable},
        )
    return IMAGE


def ensure_prometheus_image() -> str:
    """``PROMETHEUS_IMAGE`` on the air-gapped base (``ensure_package_image``)."""
    return ensure_package_image("prometheus", PROMETHEUS_IMAGE)


def ensure_etcd_image() -> str:
    """``ETCD_IMAGE``, a region's etcd, on the air-gapped base (``ensure_package_image``)."""
    return ensure_package_image("etcd-server", ETCD_IMAGE)


def ensure_package_image(package: str, tag: str) -> str:
    """``tag``: Debian's ``package`` on the air-gapped base; its script rebuilds it only
    when it is missing or was made by another recipe or base (a second's look
    otherwise)."""
    run([str(DEPLOY / "build-base-image.sh"), "--tag", BASE_IMAGE], limit_s=BUILD_LIMIT_S)
    run(
        [str(DEPLOY / "build-package-image.sh"), "--package", package,
         "--base-image", BASE_IMAGE, "--tag", tag],
        limit_s=BUILD_LIMIT_S,
    )  # fmt: skip
    return tag


def inspect(kind: str, name: str) -> dict[str, object]:
    found: list[dict[str, object]] = json.loads(run(["docker", kind, "inspect", name]).stdout)
    return found[0]
