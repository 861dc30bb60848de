#!/bin/sh
# The final steps shared by both recipes (run by the Dockerfile as root, after
# install-packages.sh): the sandbox user, its home, a `python` command, and
# matplotlib's font cache built once here instead of at every sandbox's first
# import.
set -eu

here=$(cd "$(dirname "$0")" && pwd)

# uid/gid 1000, the ids the gateway runs sandboxes as (USER 1000:1000).
getent group 1000 >/dev/null || groupadd --gid 1000 user
getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --home-dir /home/user \
	--create-home --shell /bin/bash --comment "sandbox user" user
install -d -o 1000 -g 1000 -m 0755 /home/user /home/user/outputs

ln -sf /usr/bin/python3 /usr/local/bin/python

# Packages on demand (README.md, "Packages on demand"): pip talks only to the agent's loopback
# index and installs for the user into PYTHONUSERBASE=/opt/packages, the mount point of a tmpfs
# the gateway sizes per profile. `pip` is a wrapper that adds the index's reasons when pip fails.
install -m 0644 "$here/pip.conf" /etc/pip.conf
install -d -m 0755 /opt/packages /usr/local/lib/sandgate
install -m 0644 "$here/sandgate_pip.py" /usr/local/lib/sandgate/sandgate_pip.py
for name in pip pip3 "pip$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; do
	printf '#!/bin/sh\nexec /usr/bin/python3 /usr/local/lib/sandgate/sandgate_pip.py "$@"\n' >"/usr/local/bin/$name"
	chmod 0755 "/usr/local/bin/$name"
done

# gVisor: the statx shim (statx_shim.c says why), preloaded into every dynamically linked program.
if [ -f "$here/statx_shim.so" ]; then
	install -d -m 0755 /usr/local/lib/sandgate
	install -m 0644 "$here/statx_shim.so" /usr/local/lib/sandgate/statx_shim.so
	echo /usr/local/lib/sandgate/statx_shim.so >/etc/ld.so.preload
	ls -l / >/dev/null # the preload loads and works
else
	echo "finalize: statx_shim.so missing (build with deploy/sandbox/build.sh): ls -l will fail under runsc" >&2
fi

# matplotlib reads its font list from MPLCONFIGDIR, which must be writable (a
# read-only one makes it warn and fall back to a fresh temporary directory), so
# at run time it is /tmp/matplotlib (tmpfs, empty when the sandbox starts).
# Building the list scans every font file; do it once here and let
# sandgate_mplcache.py, imported from a .pth file at interpreter start-up, copy
# it into MPLCONFIGDIR when it is missing there.
baked=/usr/local/share/sandgate/matplotlib
install -d -m 0755 "$baked"
MPLCONFIGDIR="$baked" MPLBACKEND=Agg python3 -c 'import matplotlib.font_manager'
ls "$baked"/fontlist-*.json >/dev/null
chmod -R a+rX "$baked"

site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
install -d -m 0755 "$site"
install -m 0644 "$here/sandgate_mplcache.py" "$site/sandgate_mplcache.py"
echo 'import sandgate_mplcache' >"$site/sandgate_mplcache.pth"
python3 -m py_compile "$site/sandgate_mplcache.py"

# Check what the sandbox relies on, as the sandbox user: everything imports,
# the backend is Agg, the font cache is seeded, and nothing is printed (no
# warning about cache directories or font scans).
out=$(MPLCONFIGDIR=/tmp/sandgate-mplcheck HOME=/home/user runuser -u user -- python3 -c '
import os, IPython, numpy, pandas, openpyxl, matplotlib
import matplotlib.pyplot as plt
assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()
assert os.listdir("/tmp/sandgate-mplcheck"), "font cache was not seeded"
' 2>&1)
rm -rf /tmp/sandgate-mplcheck
if [ -n "$out" ]; then
	echo "finalize: the import check printed output:" >&2
	echo "$out" >&2
	exit 1
fi
