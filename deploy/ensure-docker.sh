#!/usr/bin/env bash
# Make sure a Docker engine answers, and that the tools the deployment needs are here.
#
# Idempotent: installs Debian's docker.io, docker-compose (v1.29) and debootstrap
# only if one is missing, starts dockerd only if no engine answers, then waits (at
# most FENCEMARK_DOCKER_WAIT seconds, 60 by default) for `docker info`. Needs root
# for the install and for starting dockerd; does neither when they are not needed.
# CI calls it before building images (docs/deploy.md).
set -euo pipefail

wait_seconds=${FENCEMARK_DOCKER_WAIT:-60}
log=${FENCEMARK_DOCKERD_LOG:-/var/log/dockerd.log}

say() { echo "ensure-docker: $*"; }
die() { echo "ensure-docker: $*" >&2; exit 1; }

engine_answers() { docker info >/dev/null 2>&1; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if ((${#missing[@]})); then
  # shellcheck disable=SC2207  # package names have no spaces
  missing=($(printf '%s\n' "${missing[@]}" | sort -u))
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; run as root, or: apt-get install -y ${missing[*]}"
  say "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if engine_answers; then
  say "engine up ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
  exit 0
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || die "no Docker engine answers and only root can start dockerd"
  # A pid file left by a dockerd that died with its machine stops a new one from starting.
  for pidfile in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
    if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; then
      rm -f "$pidfile"
    fi
  done
  say "starting dockerd (log: $log)"
  mkdir -p "$(dirname "$log")"
  # setsid + nohup: the engine outlives this script and the shell that ran it.
  setsid nohup dockerd >>"$log" 2>&1 </dev/null &
fi

deadline=$(($(date +%s) + wait_seconds))
until engine_answers; do
  if (($(date +%s) >= deadline)); then
    echo "ensure-docker: no engine after ${wait_seconds}s; the end of $log:" >&2
    tail -n 20 "$log" >&2 2>/dev/null || true
    exit 1
  fi
  sleep 1
done
say "engine up ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))"
