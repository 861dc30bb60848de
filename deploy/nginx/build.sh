#!/usr/bin/env bash
# Builds the TLS reverse proxy image sandgate-nginx:<version>-<hash> — Debian's nginx with this directory's
# nginx.conf (non-root, read-only root) and sandgate.conf (the site in front of the gateways) —
# unless it already exists, and prints its tag as the last line on stdout. Progress goes to
# stderr. Offline: nothing is pulled from a registry.
#
#   deploy/nginx/build.sh [--force]
#   deploy/nginx/build.sh --tag        # print the tag only, build nothing
#
# The root is assembled like the gateway image's: the files of the Debian packages in
# packages.txt (`apt-get download` of this machine's candidate versions, unpacked with dpkg-deb, no
# maintainer scripts), /etc/passwd with user sandgate-proxy (uid/gid 10001, the owner `deploy/pki.sh`
# run as root gives the keys it makes), the two configuration files. No shell, no package manager.
# Before importing, build.sh checks with ldd that every library nginx needs is in the root.
# The certificate and key are not in the image: deploy/compose.yaml mounts them on
# /etc/sandgate/proxy (tls.crt, tls.key).
#
# <hash>: the first 12 hex digits of a sha256 over this directory's files (*.md left out),
# deploy/lib.sh and the package versions. .debs are kept in $SANDGATE_CACHE/images/nginx/debs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMG_NAME=nginx-image
# shellcheck source=deploy/lib.sh
source "$here/../lib.sh"

# The image's user: not root (nginx listens on 8443), and the uid pki.sh gives keys to.
UID_GID=10001

force=0
tag_only=0
for arg in "$@"; do
	case "$arg" in
	--force) force=1 ;;
	--tag) tag_only=1 ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
		exit 0
		;;
	*) img_die "unknown argument: $arg (see --help)" ;;
	esac
done

img_package_versions "$here/packages.txt"
versions=("${IMG_VERSIONS[@]}")
mapfile -t files < <(img_recipe_files "$here")
hash=$(
	{
		sha256sum <"$here/../lib.sh"
		printf '%s\n' "${versions[@]}"
	} | img_hash "$here" "${files[@]}"
)
version=$(img_version)
tag="sandgate-nginx:$version-$hash"
if ((tag_only)); then
	echo "$tag"
	exit 0
fi

work="$(img_cache_root)/images/nginx"
img_begin "$work" "$tag" "$force"

t_all=$(img_now_ms)
img_log "building $tag"
root="$work/rootfs-$hash"
trap 'img_remove_root "$root"' EXIT
img_remove_root "$root"
mkdir -p "$root"

t=$(img_now_ms)
img_log "step 1/3: the packages' files (${versions[*]})"
img_unpack_debs "$work/debs" "$root" "${versions[@]}"
img_log "step 1/3: done in $(img_since "$t")"

t=$(img_now_ms)
img_log "step 2/3: the root (user sandgate-proxy $UID_GID, nginx.conf, sandgate.conf)"
rm -rf "$root/usr/share/doc" "$root/usr/share/man" "$root/usr/share/locale" "$root/usr/share/lintian" \
	"$root/usr/share/info" "$root/usr/lib/x86_64-linux-gnu/gconv" "$root/etc/ld.so.conf.d" \
	"$root/usr/lib/x86_64-linux-gnu/audit" "$root/usr/bin" "$root/sbin" "$root/usr/libexec" \
	"$root/usr/lib/ssl/misc"
find "$root/usr/sbin" -mindepth 1 ! -name nginx -delete
cat >"$root/etc/passwd" <<PASSWD
root:x:0:0:root:/root:/sbin/nologin
sandgate-proxy:x:$UID_GID:$UID_GID:sandgate proxy:/nonexistent:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
PASSWD
cat >"$root/etc/group" <<GROUP
root:x:0:
sandgate-proxy:x:$UID_GID:
nogroup:x:65534:
GROUP
printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
mkdir -p "$root/etc/nginx/conf.d" "$root/etc/sandgate/proxy" "$root/tmp" "$root/proc" "$root/sys" \
	"$root/dev" "$root/run"
chmod 1777 "$root/tmp"
install -m 0644 "$here/nginx.conf" "$root/etc/nginx/nginx.conf"
install -m 0644 "$here/sandgate.conf" "$root/etc/nginx/conf.d/sandgate.conf"
"${IMG_AS_ROOT[@]}" chown -R 0:0 "$root"
missing=$(ldd "$root/usr/sbin/nginx" | awk '$2 == "=>" { print $3 } $1 ~ /^\// { print $1 }' | while read -r lib; do
	[[ -e $root$lib || -e $root/usr$lib || -e $root${lib#/usr} ]] || echo "$lib"
done)
[[ -z $missing ]] || img_die "nginx needs libraries no package in packages.txt provides: $missing"
img_log "step 2/3: done in $(img_since "$t") ($(du -sh "$root" | cut -f1))"

t=$(img_now_ms)
img_log "step 3/3: docker import -> $tag"
labels=()
while IFS= read -r label; do
	labels+=(--change "LABEL ${label%%=*}=\"${label#*=}\"")
done < <(img_oci_labels sandgate-nginx "sandgate's TLS reverse proxy: Debian's nginx with deploy/nginx/sandgate.conf" "$version" "$hash")
img_import "$root" "$tag" "sandgate TLS reverse proxy: Debian's nginx (${versions[*]})" \
	--change "USER $UID_GID:$UID_GID" \
	--change "WORKDIR /tmp" \
	--change "EXPOSE 8443" \
	"${labels[@]}" \
	--change 'ENTRYPOINT ["/usr/sbin/nginx"]'
img_remove_root "$root"
trap - EXIT
img_log "step 3/3: done in $(img_since "$t")"
img_log "built $tag ($(img_size "$tag")) in $(img_since "$t_all")"
echo "$tag"
