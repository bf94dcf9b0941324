#!/usr/bin/env bash
# Build the Fencemark image from this checkout.
#
#   deploy/build-image.sh [--base-image IMAGE] [--tag TAG]
#
# 1. wheels on the host, into a fresh CONTEXT (under build/image-context.*/,
#    removed afterwards): fencemark's own (dist/) and every dependency's, chosen for
#    CPython 3.11 on manylinux (wheels/), so the host's Python version does not
#    matter; when PYTHON is a virtual environment the dependencies are pinned to
#    the versions installed there;
# 2. `docker build --network none -f deploy/Dockerfile CONTEXT` (the wheels and
#    deploy/entrypoint.sh): the build can reach nothing outside its context;
# 3. the images TAG and TAG-build (the build stage, the next build's cache) named
#    before are removed unless a container uses them: rebuilds leave no dangling image.
#
# --base-image (env BASE_IMAGE) defaults to the air-gapped Debian base that
# deploy/build-base-image.sh makes, fencemark/base:bookworm; with a registry,
# python:3.11-slim works as well. --tag (env FENCEMARK_IMAGE) defaults to
# fencemark:dev. The wheels come from PyPI, or from whatever pip is configured
# with (PIP_INDEX_URL, PIP_FIND_LINKS, ...). PYTHON picks the host interpreter
# (default: the project's .venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

base=${BASE_IMAGE:-fencemark/base:bookworm}
tag=${FENCEMARK_IMAGE:-fencemark:dev}
usage() { sed -n '2,22s/^# \{0,1\}//p' "$0"; }
while (($#)); do
  case $1 in
    --base-image) base=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build-image: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

started=$(date +%s)
step() { echo "== build-image [$(($(date +%s) - started))s]: $*"; }
die() { echo "build-image: $*" >&2; exit 1; }

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (make venv, or set PYTHON)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (run deploy/ensure-docker.sh)"
case $(uname -m) in
  x86_64 | amd64) arch=x86_64 ;;
  aarch64 | arm64) arch=aarch64 ;;
  *) die "no manylinux wheels for $(uname -m)" ;;
esac

# A scratch directory of its own, so that two builds at once share nothing.
mkdir -p build
scratch=$(mktemp -d build/image-context.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
context=$scratch/context
mkdir -p "$context/wheels" "$context/dist" "$scratch/src"
pip=("$PYTHON" -m pip --disable-pip-version-check)

install -m 0755 deploy/entrypoint.sh "$context/entrypoint.sh"

step "fencemark wheel"
# (setuptools' deprecation warnings about pyproject.toml are not ours to show here)
# From a copy of the files git knows (tracked, or new and not ignored): setuptools
# builds in the source tree, and a stale build/lib there would slip deleted
# modules into the wheel.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done |
    tar --null --files-from=- -cf - | tar -C "$scratch/src" -xf -
else
  cp -a pyproject.toml README.md node client proto "$scratch/src/"
fi
"${pip[@]}" wheel --quiet --no-deps --wheel-dir "$context/dist" "$scratch/src" \
  2>"$scratch/wheel.log" || { cat "$scratch/wheel.log" >&2; die "pip wheel failed"; }
wheel=$(ls "$context"/dist/fencemark-*.whl)

step "dependency wheels (CPython 3.11, manylinux $arch)"
# glibc 2.36 is bookworm's: every manylinux wheel up to manylinux_2_36 runs there.
# pip matches --platform tags literally, so each glibc version is listed.
platforms=()
for minor in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
platforms+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch" --platform "manylinux1_$arch")
# From a virtual environment (the project's .venv by default), the image gets
# the very versions installed there: the ones the test suite ran against.
pins=()
if "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  "${pip[@]}" freeze --exclude-editable --exclude fencemark >"$scratch/pins.txt"
  pins=(--constraint "$scratch/pins.txt")
fi
"${pip[@]}" download --quiet --only-binary=:all: --dest "$context/wheels" "${pins[@]}" \
  --implementation cp --python-version 3.11 --abi cp311 "${platforms[@]}" "$wheel"
rm -f "$context"/wheels/fencemark-*.whl
names=$(find "$context/wheels" -name '*.whl' -printf '%f\n' | sed 's/-.*//' | sort)
echo "   $(wc -l <<<"$names") wheels: $(tr '\n' ' ' <<<"$names")"

if ! docker image inspect "$base" >/dev/null 2>&1; then
  case $base in
    fencemark/base:*) die "base image $base is missing (deploy/build-base-image.sh --tag $base)" ;;
    *) step "base image $base is not here: docker will try to pull it" ;;
  esac
fi

# The build stage is tagged too (TAG-build: fencemark:dev-build), the next build's
# cache, so that it is not left behind as an untagged image.
case $tag in
  *:*) stage_tag="$tag-build" ;;
  *) stage_tag="$tag:build" ;;
esac
previous=$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
previous_stage=$(docker image inspect --format '{{.Id}}' "$stage_tag" 2>/dev/null || true)
step "docker build $tag on $base"
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
# --network none: proof that the build needs nothing from outside its context.
docker build --network none --file deploy/Dockerfile --target build --tag "$stage_tag" \
  --build-arg "BASE_IMAGE=$base" "$context"
docker build --network none --file deploy/Dockerfile --tag "$tag" \
  --build-arg "BASE_IMAGE=$base" \
  --label "org.opencontainers.image.revision=$revision" \
  --label "org.opencontainers.image.base.name=$base" \
  "$context"

# What the two tags named before, now untagged: drop it unless something still uses
# it, so that rebuilds leave no dangling image. (Not `docker image prune`: it would
# take the layers of a build running beside this one.)
drop_if_replaced() { # OLD_ID TAG
  if [ -n "$1" ] && [ "$1" != "$(docker image inspect --format '{{.Id}}' "$2")" ]; then
    docker image rm "$1" >/dev/null 2>&1 || true
  fi
}
drop_if_replaced "$previous" "$tag"
drop_if_replaced "$previous_stage" "$stage_tag"
step "done: $tag ($(docker image inspect --format '{{.Size}}' "$tag" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
