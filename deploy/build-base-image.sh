#!/usr/bin/env bash
# Build the air-gapped base image (Debian bookworm with python3) from Debian packages.
#
#   deploy/build-base-image.sh [--tag TAG] [--mirror URL] [--force]
#
# No image is pulled from a registry: debootstrap installs a minimal bookworm with
# python3, python3-venv, ca-certificates and iptables into a scratch directory,
# the security updates are applied, and the tree is imported as TAG (default
# fencemark/base:bookworm). Skips the work when TAG exists, unless --force.
#
# Packages come from the Debian mirror this machine's apt already uses (read from
# /etc/apt/sources.list and /etc/apt/sources.list.d/), or from --mirror /
# FENCEMARK_DEBIAN_MIRROR. Runs as root (debootstrap must). About two minutes.
set -euo pipefail

tag=${FENCEMARK_BASE_IMAGE:-fencemark/base:bookworm}
mirror=${FENCEMARK_DEBIAN_MIRROR:-}
security=${FENCEMARK_DEBIAN_SECURITY_MIRROR:-}
force=0
suite=bookworm
packages=python3,python3-venv,ca-certificates,iptables

usage() { sed -n '2,13s/^# \{0,1\}//p' "$0"; }
while (($#)); do
  case $1 in
    --tag) tag=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build-base-image: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

started=$(date +%s)
step() { echo "== build-base-image [$(($(date +%s) - started))s]: $*"; }
die() { echo "build-base-image: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker engine answers (run deploy/ensure-docker.sh)"
if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  step "$tag exists, nothing to do (--force rebuilds it)"
  exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null 2>&1 || die "debootstrap is missing (apt-get install -y debootstrap)"

# Every "URI SUITE" pair of the enabled `deb` entries in apt's configuration,
# one-line (.list) and deb822 (.sources) formats alike.
apt_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    sed -E -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3 }'
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '
      function flush(   n, m, i, j, u, s) {
        if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
          n = split(uris, u); m = split(suites, s)
          for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) print u[i], s[j]
        }
        types = uris = suites = enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      { key = tolower($1); sub(/^[^:]*:[ \t]*/, "") }
      key == "types:" { types = $0 }
      key == "uris:" { uris = $0 }
      key == "suites:" { suites = $0 }
      key == "enabled:" { enabled = tolower($0) }
      END { flush() }
    ' "$f"
  done
}

sources=$(apt_sources)
if [ -z "$mirror" ]; then
  # The mirror serving bookworm itself; else (a host on another release) any
  # non-security Debian mirror, which serves bookworm as well.
  mirror=$(awk -v s="$suite" '$2 == s { print $1; exit }' <<<"$sources")
  [ -n "$mirror" ] || mirror=$(awk '$2 !~ /-security$/ && $1 ~ /debian/ { print $1; exit }' <<<"$sources")
  [ -n "$mirror" ] || die "found no Debian mirror in /etc/apt/sources.list*; pass --mirror URL"
fi
if [ -z "$security" ]; then
  security=$(awk -v s="$suite-security" '$2 == s { print $1; exit }' <<<"$sources")
  [ -n "$security" ] || security=$(awk '$2 ~ /-security$/ { print $1; exit }' <<<"$sources")
fi

scratch=$(mktemp -d "${TMPDIR:-/var/tmp}/fencemark-base.XXXXXX")
root=$scratch/rootfs
cleanup() {
  mountpoint -q "$root/proc" 2>/dev/null && umount "$root/proc"
  rm -rf --one-file-system "$scratch"
}
trap cleanup EXIT

step "debootstrap $suite ($packages) from $mirror into $root"
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror"

step "security and point-release updates"
{
  echo "deb $mirror $suite main"
  echo "deb $mirror $suite-updates main"
  [ -z "$security" ] || echo "deb $security $suite-security main"
} >"$root/etc/apt/sources.list"
[ -n "$security" ] || echo "build-base-image: no $suite-security mirror configured on this host; skipped"
mount -t proc proc "$root/proc"
# dpkg's chatter goes to a log, shown only if the upgrade fails.
if ! {
  chroot "$root" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get -y -qq -o Dpkg::Use-Pty=0 upgrade &&
    chroot "$root" apt-get clean
} >"$scratch/upgrade.log" 2>&1; then
  cat "$scratch/upgrade.log" >&2
  die "the upgrade inside the new tree failed"
fi
grep -o '^Unpacking [^ ]* ([^)]*) over ([^)]*)' "$scratch/upgrade.log" | sed 's/^/  /' || true
umount "$root/proc"
# Caches and the host's resolver settings have no place in an image (docker
# provides /etc/resolv.conf and /etc/hostname to every container).
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log \
  "$root"/tmp/* "$root"/var/tmp/*
: >"$root/etc/resolv.conf"
: >"$root/etc/hostname"

step "docker import as $tag"
tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase --include=$packages $suite ($mirror)" \
  - "$tag" >/dev/null

step "done: $tag ($(docker image inspect --format '{{.Size}}' "$tag" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
