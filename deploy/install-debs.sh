#!/bin/sh
# Inside `docker build` of an image of build-package-image.sh: install the .deb files
# of /tmp/debs with apt, from those files alone (no package list, no network), and
# start no service; then remove them, this script and what apt leaves behind.
set -eu
policy=/usr/sbin/policy-rc.d
own=
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod +x "$policy"
  own=1
fi
DEBIAN_FRONTEND=noninteractive apt-get install --yes --no-install-recommends \
  -o Dpkg::Use-Pty=0 /tmp/debs/*.deb >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
if [ -n "$own" ]; then rm -f "$policy"; fi
rm -rf /tmp/debs /tmp/install.log /tmp/install-debs.sh /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
