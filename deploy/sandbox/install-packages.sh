#!/bin/sh
# Installs the Debian packages named in packages.txt (no recommends) and strips
# what a sandbox never reads: apt caches and lists, documentation, manual
# pages, translations, logs. Runs as root inside the image's root: in the
# online Dockerfile on debian:bookworm-slim, and chrooted into the debootstrap
# root by build.sh's offline recipe. Does nothing when every package is
# already installed (the Dockerfile's run on the offline base image).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
pkgs=$(sed -e 's/#.*//' "$here/packages.txt" | tr -s ' \t' '\n' | sed -e '/^$/d' | tr '\n' ' ')

missing=
for p in $pkgs; do
	status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
	[ "$status" = installed ] || missing="$missing $p"
done
if [ -z "$missing" ]; then
	echo "install-packages: all $(echo "$pkgs" | wc -w) packages already installed"
	exit 0
fi

export DEBIAN_FRONTEND=noninteractive

# debian:bookworm-slim's policy (no docs, manuals, translations), written here
# too so that both recipes leave the same files.
mkdir -p /etc/dpkg/dpkg.cfg.d
cat >/etc/dpkg/dpkg.cfg.d/sandgate-nodoc <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
CFG

apt-get update
# debootstrap's root is the suite's last point release: take its security and
# stable updates too.
apt-get upgrade -y
# shellcheck disable=SC2086 # one word per package
apt-get install -y --no-install-recommends $pkgs

# Not `apt-get clean`: build.sh may point the archive cache at a directory of
# its own (APT_CONFIG), which must survive.
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
	/var/cache/debconf/*-old /var/lib/dpkg/*-old \
	/usr/share/man/* /usr/share/info/* /usr/share/groff/* /usr/share/lintian/* /usr/share/linda/*
# What was installed before the dpkg policy above (debootstrap's base system).
find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
find /var/log -type f -delete
# Python packages' own test suites: a fifth of the image, never imported (the
# testing helpers, numpy.testing, pandas._testing and the like, stay). Deleted
# after installing: a dpkg path-exclude would break the packages' py3compile.
find /usr/lib/python3/dist-packages -depth -type d -name tests -exec rm -rf {} +
echo "install-packages: installed $(echo "$missing" | wc -w) packages of packages.txt and their dependencies"
