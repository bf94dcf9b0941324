#!/usr/bin/env bash
# Build an image of one Debian package on the air-gapped base: the compose stack's
# Prometheus (deploy/prometheus/), a region's etcd (deploy/etcd-server/).
#
#   deploy/build-package-image.sh --package NAME [--base-image IMAGE] [--tag TAG]
#
# 1. the packages, on the host, into a fresh CONTEXT (under build/, removed
#    afterwards): apt resolves NAME (without recommends) against the packages the
#    base image already has (its dpkg status file) and downloads what is missing
#    (debs/), from the Debian mirror this host's apt uses;
# 2. `docker build --network none -f deploy/NAME/Dockerfile CONTEXT`: apt installs
#    the local .deb files inside (deploy/install-debs.sh, put in CONTEXT too); the
#    build can reach nothing.
#
# NAME is the Debian package and the folder of its Dockerfile: prometheus or
# etcd-server (deploy/etcd-server/). --base-image (env BASE_IMAGE) defaults to the
# air-gapped Debian base that deploy/build-base-image.sh makes,
# fencemark/base:bookworm; any Debian bookworm image works. --tag defaults to
# fencemark/NAME:dev. The host must be Debian bookworm on the image's architecture,
# with its package lists fetched (apt-get update). Skips the work when TAG exists,
# was built by this recipe on this base, and --force is not given.
set -euo pipefail
cd "$(dirname "$0")/.."

base=${BASE_IMAGE:-fencemark/base:bookworm}
package=
tag=
force=0
usage() { sed -n '2,22s/^# \{0,1\}//p' "$0"; }
while (($#)); do
  case $1 in
    --package) package=$2; shift 2 ;;
    --base-image) base=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build-package-image: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

started=$(date +%s)
step() { echo "== build-package-image $package [$(($(date +%s) - started))s]: $*"; }
die() { echo "build-package-image: $*" >&2; exit 1; }

[ -n "$package" ] || { usage >&2; die "--package NAME is required"; }
dockerfile=deploy/$package/Dockerfile
[ -f "$dockerfile" ] || die "no $dockerfile: which image is $package?"
tag=${tag:-fencemark/$package:dev}

docker info >/dev/null 2>&1 || die "no Docker engine answers (run deploy/ensure-docker.sh)"
docker image inspect "$base" >/dev/null 2>&1 ||
  die "base image $base is missing (deploy/build-base-image.sh --tag $base)"
command -v apt-get >/dev/null 2>&1 || die "apt-get is missing: the packages come from Debian"
# shellcheck disable=SC1091
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ "$codename" = bookworm ] || die "the host is '$codename', not Debian bookworm: its apt would pick other versions"

# What the image is made of: rebuilt when this script, the Dockerfile or the base change.
recipe=$(cat "$dockerfile" deploy/build-package-image.sh deploy/install-debs.sh | sha256sum | cut -c1-64)
base_id=$(docker image inspect --format '{{.Id}}' "$base")
if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  labels=$(docker image inspect --format \
    '{{index .Config.Labels "fencemark.package.recipe"}} {{index .Config.Labels "fencemark.base.id"}}' "$tag")
  if [ "$labels" = "$recipe $base_id" ]; then
    step "$tag is up to date, nothing to do (--force rebuilds it)"
    exit 0
  fi
fi

mkdir -p build
scratch=$(mktemp -d "build/$package-context.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
scratch=$(cd "$scratch" && pwd)
context=$scratch/context
mkdir -p "$context/debs" "$scratch/archives/partial"

step "resolving Debian's $package against $base"
docker run --rm --network none --entrypoint cat "$base" /var/lib/dpkg/status >"$scratch/status"
# The base's package state instead of the host's, a download directory of our own,
# and no shared package cache or lock touched.
apt=(apt-get -qq --yes --no-install-recommends
  -o "Dir::State::status=$scratch/status" -o "Dir::Cache::archives=$scratch/archives"
  -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Debug::NoLocking=true)
"${apt[@]}" install --download-only "$package" >"$scratch/apt.log" 2>&1 ||
  { cat "$scratch/apt.log" >&2; die "apt could not resolve $package (apt-get update first?)"; }
mv "$scratch"/archives/*.deb "$context/debs/" 2>/dev/null || die "nothing to install: is $package in $base already?"
echo "   $(find "$context/debs" -name '*.deb' | wc -l) packages: $(find "$context/debs" -name '*.deb' -printf '%f\n' | sed 's/_.*//' | sort | tr '\n' ' ')"

cp deploy/install-debs.sh "$context/"

previous=$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
step "docker build $tag on $base"
docker build --network none --file "$dockerfile" --tag "$tag" \
  --build-arg "BASE_IMAGE=$base" \
  --label "fencemark.package.recipe=$recipe" \
  --label "fencemark.base.id=$base_id" \
  --label "org.opencontainers.image.base.name=$base" \
  "$context"

# The image this tag named before, now untagged: drop it unless something still uses it.
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect --format '{{.Id}}' "$tag")" ]; then
  docker image rm "$previous" >/dev/null 2>&1 || true
fi
step "done: $tag ($(docker image inspect --format '{{.Size}}' "$tag" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
