#!/usr/bin/env bash
# Builds the Postgres image sandgate-postgres:<version>-<recipe hash> from Debian bookworm's postgresql-15,
# offline (nothing is pulled from a registry), unless it already exists, and prints its tag as the
# last line on stdout. Progress goes to stderr.
#
#   deploy/postgres/build.sh [--force]
#   deploy/postgres/build.sh --tag        # print the tag only, build nothing
#
# <recipe hash>: the first 12 hex digits of a sha256 over this directory's files (names and
# contents, *.md left out) and deploy/lib.sh. Steps: debootstrap a minbase root, install.sh
# chrooted into it (apt: postgresql-15, then strips docs, JIT and locales), `docker import` as
# sandgate-postgres-base:<base hash>, then `docker build` of the Dockerfile on it (the entrypoint,
# user postgres). The base hash covers install.sh only, so a change to the entrypoint rebuilds in
# seconds. Downloaded .debs are kept in $SANDGATE_CACHE/images/postgres/debs.
#
# Needs root for debootstrap (uses sudo otherwise).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IMG_NAME=postgres-image
# shellcheck source=deploy/lib.sh
source "$here/../lib.sh"

# Bump to rebuild the base when its steps in this file change.
BASE_RECIPE_VERSION=1

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

mapfile -t files < <(img_recipe_files "$here")
recipe_hash=$(img_hash "$here" "${files[@]}" <"$here/../lib.sh")
version=$(img_version)
tag="sandgate-postgres:$version-$recipe_hash"
if ((tag_only)); then
	echo "$tag"
	exit 0
fi

work="$(img_cache_root)/images/postgres"
img_begin "$work" "$tag" "$force"

t_all=$(img_now_ms)
img_log "building $tag"
base_hash=$(img_hash "$here" install.sh <<<"bookworm minbase $BASE_RECIPE_VERSION")
base_tag="sandgate-postgres-base:$base_hash"
if ((force)) || ! docker image inspect "$base_tag" >/dev/null 2>&1; then
	root="$work/rootfs-$base_hash"
	trap 'img_remove_root "$root"' EXIT
	img_remove_root "$root" # leftovers of an interrupted build
	logfile="$work/build-$base_hash.log"
	: >"$logfile"
	t=$(img_now_ms)
	img_log "step 1/3: debootstrap --variant=minbase bookworm (log: $logfile)"
	img_debootstrap "$root" "$work/debs" "$logfile"
	img_log "step 1/3: done in $(img_since "$t")"
	t=$(img_now_ms)
	img_log "step 2/3: install.sh in the new root (apt-get install postgresql-15)"
	img_chroot_script "$root" "$work/debs" "$logfile" '^(install:|Fetched |[0-9]+ upgraded|Setting up postgresql-15 )' \
		"$here/install.sh"
	img_log "step 2/3: done in $(img_since "$t"); importing $base_tag ($("${IMG_AS_ROOT[@]}" du -sh --one-file-system "$root" | cut -f1))"
	img_import "$root" "$base_tag" "sandgate Postgres base: debootstrap minbase bookworm + postgresql-15"
	img_remove_root "$root"
	trap - EXIT
else
	img_log "base $base_tag is there"
fi

t=$(img_now_ms)
img_log "step 3/3: docker build (entrypoint, user postgres)"
build_log="$work/docker-build-$recipe_hash.log"
labels=()
while IFS= read -r label; do labels+=(--label "$label"); done < <(img_oci_labels sandgate-postgres \
	"PostgreSQL 15 from Debian bookworm for sandgate: TLS, the roles sandgate_migrator, sandgate_gateway and sandgate_node" \
	"$version" "$recipe_hash")
if ! DOCKER_BUILDKIT=0 docker build --build-arg "BASE=$base_tag" --build-arg "RECIPE=$recipe_hash" \
	"${labels[@]}" -t "$tag" "$here" >"$build_log" 2>&1; then
	img_log "docker build failed; last lines of $build_log:"
	tail -n 25 "$build_log" | sed "s/^/[$IMG_NAME]   | /" >&2
	exit 1
fi
img_log "step 3/3: done in $(img_since "$t")"
img_log "built $tag ($(img_size "$tag")) in $(img_since "$t_all")"
echo "$tag"
