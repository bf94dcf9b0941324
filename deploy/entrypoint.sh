#!/bin/sh
# The image's entrypoint: `fencemark ARGS`, after one check for `node`.
#
# A node's data directory is usually a bind mount prepared on the host. If this
# user cannot write there, say so in words an operator can act on and exit 78
# (EX_CONFIG), instead of a traceback from SQLite. A node given its certificates
# by FENCEMARK_TLS_DIR and FENCEMARK_TLS_NAME waits for them, up to
# FENCEMARK_TLS_WAIT_S seconds (60): the stack's one-shot certs service may still be
# writing them (compose starts the nodes after it, not after it finished; a swarm
# starts everything at once). Then exec: fencemark replaces this shell as PID 1 and
# receives SIGTERM itself (graceful stop, exit 0).
set -eu

if [ "${1:-}" = node ]; then
  dir=${FENCEMARK_DATA_DIR:-/var/lib/fencemark}
  previous=
  for arg in "$@"; do
    case $previous in --data) dir=$arg ;; esac
    case $arg in --data=*) dir=${arg#--data=} ;; esac
    previous=$arg
  done
  # The node creates a missing directory: then its nearest existing parent counts.
  probe=$dir
  while [ ! -e "$probe" ] && [ "$probe" != / ]; do probe=$(dirname "$probe"); done
  if [ ! -d "$probe" ] || [ ! -w "$probe" ] || [ ! -x "$probe" ]; then
    me="$(id -u):$(id -g)"
    owner=$(stat -c '%u:%g, mode %a' "$probe" 2>/dev/null || echo unknown)
    cat >&2 <<EOF
fencemark: cannot write the data directory $dir as user $me
  ($probe is owned by $owner). On the host, give the directory mounted
  there to that user (chown $me DIR), or run the container as the directory's
  owner (docker run --user UID:GID; compose: FENCEMARK_UID, FENCEMARK_GID). See docs/deploy.md.
EOF
    exit 78
  fi
  if [ -n "${FENCEMARK_TLS_DIR:-}" ] && [ -n "${FENCEMARK_TLS_NAME:-}" ]; then
    tls=$FENCEMARK_TLS_DIR
    left=${FENCEMARK_TLS_WAIT_S:-60}
    said=
    until [ -s "$tls/ca.pem" ] && [ -s "$tls/$FENCEMARK_TLS_NAME.pem" ] \
        && [ -s "$tls/$FENCEMARK_TLS_NAME-key.pem" ]; do
      if [ "$left" -le 0 ]; then
        echo "fencemark: no certificate for $FENCEMARK_TLS_NAME in $tls after ${FENCEMARK_TLS_WAIT_S:-60} s; starting anyway" >&2
        break
      fi
      [ -n "$said" ] || { echo "fencemark: waiting for ca.pem, $FENCEMARK_TLS_NAME.pem and $FENCEMARK_TLS_NAME-key.pem in $tls" >&2; said=1; }
      sleep 1
      left=$((left - 1))
    done
  fi
fi
exec fencemark "$@"
