#!/usr/bin/env bash
# Builds the gateway/node image sandgate:<version>-<hash> — one image, the `sandgate` binary; the command
# picks the role (`serve`, `migrate`, `admin …`) — unless it already exists, and prints its tag as
# the last line on stdout. Progress goes to stderr. Offline: nothing is pulled from a registry.
#
#   deploy/gateway/build.sh [--binary PATH] [--force]
#   deploy/gateway/build.sh [--binary PATH] --tag   # print the tag only, build nothing
#
# --binary PATH: put this sandgate binary in the image (stripped). Without it, build.sh runs
# `cargo build --release --locked -p sandgate` and takes target/release/sandgate (under
# $CARGO_TARGET_DIR when set). The tests pass the debug binary they already built.
#
# The root is assembled, not debootstrapped: the files of the Debian packages in packages.txt
# (glibc, libgcc_s, CA certificates; `apt-get download` of this machine's candidate versions,
# unpacked with dpkg-deb, no maintainer scripts), the CA bundle made from them, /etc/passwd with
# user sandgate (uid/gid 10001) and the binary. No shell, no package manager: 33 MiB with a release
# binary. Before importing, build.sh checks with ldd that every library the binary needs is in the
# root.
#
# <hash>: the first 12 hex digits of a sha256 over this directory's files (*.md left out),
# deploy/lib.sh, the binary and the package versions, so the image is rebuilt only when one of them
# changes. .debs are kept in $SANDGATE_CACHE/images/gateway/debs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
IMG_NAME=gateway-image
# shellcheck source=deploy/lib.sh
source "$here/../lib.sh"

# The image's user: not root, and not a uid a host is likely to give a person.
UID_GID=10001

binary=
force=0
tag_only=0
while (($#)); do
	case "$1" in
	--binary)
		(($# >= 2)) || img_die "--binary needs a path"
		binary=$2
		shift
		;;
	--force) force=1 ;;
	--tag) tag_only=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
		exit 0
		;;
	*) img_die "unknown argument: $1 (see --help)" ;;
	esac
	shift
done

if [[ -z $binary ]]; then
	img_log "cargo build --release --locked -p sandgate"
	(cd "$repo" && cargo build --release --locked -p sandgate --bin sandgate >&2)
	binary="${CARGO_TARGET_DIR:-$repo/target}/release/sandgate"
fi
[[ -x $binary ]] || img_die "$binary is not an executable"

img_package_versions "$here/packages.txt"
versions=("${IMG_VERSIONS[@]}")

mapfile -t files < <(img_recipe_files "$here")
hash=$(
	{
		sha256sum <"$here/../lib.sh"
		sha256sum <"$binary"
		printf '%s\n' "${versions[@]}"
	} | img_hash "$here" "${files[@]}"
)
version=$(img_version)
tag="sandgate:$version-$hash"
if ((tag_only)); then
	echo "$tag"
	exit 0
fi

work="$(img_cache_root)/images/gateway"
img_begin "$work" "$tag" "$force"
mkdir -p "$work/debs"

t_all=$(img_now_ms)
img_log "building $tag from $binary"
root="$work/rootfs-$hash"
trap 'img_remove_root "$root"' EXIT
img_remove_root "$root"
mkdir -p "$root"

t=$(img_now_ms)
img_log "step 1/3: the packages' files (${versions[*]})"
img_unpack_debs "$work/debs" "$root" "${versions[@]}"
img_log "step 1/3: done in $(img_since "$t")"

t=$(img_now_ms)
img_log "step 2/3: the root (CA bundle, user sandgate $UID_GID, the binary)"
# What a static server never reads: docs, manuals, locales, gconv (iconv modules), the CA
# package's update script.
rm -rf "$root/usr/share/doc" "$root/usr/share/man" "$root/usr/share/locale" "$root/usr/share/lintian" \
	"$root/usr/share/info" "$root/usr/lib/x86_64-linux-gnu/gconv" "$root/usr/sbin" "$root/etc/ld.so.conf.d" \
	"$root/usr/lib/x86_64-linux-gnu/audit" "$root/usr/bin" "$root/sbin" "$root/usr/libexec"
# update-ca-certificates (a maintainer script) is not run: the bundle is the same concatenation.
mkdir -p "$root/etc/ssl/certs"
find "$root/usr/share/ca-certificates" -name '*.crt' -print0 | LC_ALL=C sort -z | xargs -0 cat \
	>"$root/etc/ssl/certs/ca-certificates.crt"
cat >"$root/etc/passwd" <<PASSWD
root:x:0:0:root:/root:/sbin/nologin
sandgate:x:$UID_GID:$UID_GID:sandgate:/var/lib/sandgate:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
PASSWD
cat >"$root/etc/group" <<GROUP
root:x:0:
sandgate:x:$UID_GID:
nogroup:x:65534:
GROUP
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
mkdir -p "$root/tmp" "$root/usr/local/bin" "$root/var/lib/sandgate" "$root/var/cache/sandgate/packages" \
	"$root/proc" "$root/sys" "$root/dev" "$root/run"
chmod 1777 "$root/tmp"
objcopy --strip-all "$binary" "$root/usr/local/bin/sandgate"
chmod 0755 "$root/usr/local/bin/sandgate"
"${IMG_AS_ROOT[@]}" chown -R 0:0 "$root"
# The package cache and the home: the user's (a named volume mounted on the cache takes this
# ownership).
"${IMG_AS_ROOT[@]}" chown -R "$UID_GID:$UID_GID" "$root/var/lib/sandgate" "$root/var/cache/sandgate"
# Every library the binary needs must be in the root: ask the root's own loader.
missing=$(ldd "$binary" | awk '$2 == "=>" { print $3 } $1 ~ /^\// { print $1 }' | while read -r lib; do
	[[ -e $root$lib || -e $root/usr$lib || -e $root${lib#/usr} ]] || echo "$lib"
done)
[[ -z $missing ]] || img_die "the binary needs libraries no package in packages.txt provides: $missing"
img_log "step 2/3: done in $(img_since "$t") ($(du -sh "$root" | cut -f1))"

t=$(img_now_ms)
img_log "step 3/3: docker import -> $tag"
labels=()
while IFS= read -r label; do
	labels+=(--change "LABEL ${label%%=*}=\"${label#*=}\"")
done < <(img_oci_labels sandgate "sandgate gateway and node: the sandgate binary (serve, node, migrate, admin) on Debian's glibc" "$version" "$hash")
img_import "$root" "$tag" "sandgate gateway/node: the sandgate binary on glibc (${versions[*]})" \
	--change "USER $UID_GID:$UID_GID" \
	--change "WORKDIR /var/lib/sandgate" \
	--change "ENV SANDGATE_LISTEN=0.0.0.0:8080" \
	--change "ENV SANDGATE_LOG__FORMAT=json" \
	--change "ENV SANDGATE_PACKAGES__CACHE_DIR=/var/cache/sandgate/packages" \
	--change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
	--change "EXPOSE 8080" \
	"${labels[@]}" \
	--change 'ENTRYPOINT ["/usr/local/bin/sandgate"]' \
	--change 'CMD ["serve"]'
img_remove_root "$root"
trap - EXIT
img_log "step 3/3: done in $(img_since "$t")"
img_log "built $tag ($(img_size "$tag")) in $(img_since "$t_all")"
echo "$tag"
