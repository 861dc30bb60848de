#!/bin/sh
# Installs requirements.lock (every package pinned with its sha256) from the wheels in the
# directory given (default: this script's own), with no index: the wheels were fetched on the
# building machine by build.sh, the image never reaches a package index. pip itself is one of
# the locked wheels and installs them all, itself included, with the image's own interpreter,
# into /usr/local (Debian's scheme for locally installed packages). Runs as root inside the
# image's root: chrooted into the debootstrap root by the offline recipe, in the Dockerfile by
# the online one. Does nothing when this exact lock is installed already (the Dockerfile's run
# on the offline base image).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
wheels=${1:-$here}
stamp=/usr/local/share/sandgate/requirements.lock

if cmp -s "$here/requirements.lock" "$stamp"; then
	echo "install-wheels: requirements.lock already installed"
	exit 0
fi

pip_wheel=$(ls "$wheels"/pip-*-py3-none-any.whl 2>/dev/null | head -n 1)
[ -n "$pip_wheel" ] || {
	echo "install-wheels: no pip wheel in $wheels (build the image with deploy/sandbox/build.sh)" >&2
	exit 1
}

# Debian marks its interpreter as externally managed (PEP 668) so that pip leaves apt's
# packages alone. This image has no Python packages from apt: the lock is the image's package
# set, and a sandbox's own installs go to its own site directory (pip.conf).
rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED

PIP_CONFIG_FILE=/dev/null python3 "$pip_wheel/pip" install --no-index --find-links "$wheels" \
	--require-hashes --no-deps --no-cache-dir --disable-pip-version-check --progress-bar off \
	-r "$here/requirements.lock"

# Packages' own test suites: a fifth of the image, never imported (the testing helpers,
# numpy.testing, pandas._testing and the like, stay). bottleneck imports its tests package at
# import time, so it keeps it.
find /usr/local/lib/python3*/dist-packages -depth -type d -name tests ! -path '*/bottleneck/*' \
	-exec rm -rf {} +
install -d -m 0755 "$(dirname "$stamp")"
install -m 0644 "$here/requirements.lock" "$stamp"
echo "install-wheels: installed $(grep -c '==' "$here/requirements.lock") packages of requirements.lock"
