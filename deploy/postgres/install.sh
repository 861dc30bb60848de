#!/bin/sh
# Installs Debian's PostgreSQL 15 server into the image's root and strips what the server never
# reads. Runs as root chrooted into the debootstrap root (build.sh).
set -eu
export DEBIAN_FRONTEND=noninteractive

# No cluster at install time: the entrypoint makes one from the container's environment on first
# start, in the data volume.
mkdir -p /etc/postgresql-common
echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.conf
# Nothing starts services inside a chroot.
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d

mkdir -p /etc/dpkg/dpkg.cfg.d
cat >/etc/dpkg/dpkg.cfg.d/sandgate-nodoc <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
CFG

apt-get update
apt-get upgrade -y
# locales-all rather than locales: the C.UTF-8 the entrypoint uses needs neither, but
# postgresql-15 depends on one of them and locales-all runs no locale-gen.
apt-get install -y --no-install-recommends postgresql-15 locales-all
rm -f /usr/sbin/policy-rc.d

# JIT compilation (llvmjit.so and LLVM, about a third of the image) is off in this image
# (postgresql.conf: jit = off), so its files go.
rm -rf /usr/lib/postgresql/15/lib/llvmjit* /usr/lib/postgresql/15/lib/bitcode
rm -f /usr/lib/x86_64-linux-gnu/libLLVM-14.so* /usr/lib/x86_64-linux-gnu/libz3.so*
# Every locale but C.UTF-8 (locales-all ships all of them, ~230 MB).
find /usr/lib/locale -mindepth 1 -maxdepth 1 ! -name C.utf8 -exec rm -rf {} +

rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
	/var/cache/debconf/*-old /var/lib/dpkg/*-old /usr/share/man/* /usr/share/info/*
find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
find /usr/share/doc -mindepth 1 -type d -empty -delete
find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
find /var/log -type f -delete

# The data volume's mount point, the server's own (a named volume takes the ownership of the
# directory it is mounted over).
install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data
echo "install: $(dpkg-query -W -f='${Version}' postgresql-15) installed"
