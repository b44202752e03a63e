#!/bin/sh
# System packages beyond Python: bubblewrap, the code sandbox's jail
# (jax_routeweaver/rewards/sandbox/jail.py). Pinned per release in requirements/apt.lock;
# a release without a pin there gets its distribution's current package.
set -eu
cd "$(dirname "$0")"
command -v bwrap >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: bubblewrap (bwrap) is not installed, and installing it needs root and apt-get;" >&2
    echo "      the code sandbox refuses to run programs without it (docs/sandbox.md)" >&2
    exit 0
fi
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
pins=$(awk -v c="$codename" '$1 == c { print $2 }' apt.lock)
apt-get update -qq
# shellcheck disable=SC2086  # one word per package
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${pins:-bubblewrap}
