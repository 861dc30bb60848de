#!/usr/bin/env bash
# Builds the sandbox image sandgate-sandbox:<recipe hash> (and :latest) unless
# it already exists, and prints its tag as the last line on stdout. Progress
# goes to stderr.
#
#   deploy/sandbox/build.sh [--offline|--online|--auto] [--force]
#   deploy/sandbox/build.sh --tag        # print the tag only, build nothing
#
# <recipe hash> is the first 12 hex digits of a sha256 over this directory's
# files (names and contents, sorted; *.md left out), so the image is rebuilt
# only when the recipe changes.
#
# --offline (the default; --auto is the same, since our machines reach no
# container registry): debootstrap a Debian minbase root with debootstrap's
# and apt's default mirrors, install packages.txt into it with
# install-packages.sh and requirements.lock with install-wheels.sh (both
# chrooted), `docker import` it as sandgate-sandbox-base:<base hash>, then
# `docker build` the Dockerfile on it. The base hash covers only what goes into
# the root (packages.txt, install-packages.sh, requirements.lock,
# install-wheels.sh, the debootstrap settings below), so a change to the final
# steps rebuilds in seconds.
# --online: `docker build` the Dockerfile on debian:bookworm-slim, with the
# wheels in the build context.
#
# Both recipes first fetch the wheels of requirements.lock on this machine,
# with its python3's pip and pip configuration (index, certificates), for the
# image's interpreter and platform (wheel-target.sh), hashes checked, into
# $SANDGATE_CACHE/sandbox/wheels: a wheel is downloaded once per machine.
#
# Needs root for debootstrap (uses sudo otherwise). Downloaded .debs are kept
# in $SANDGATE_CACHE/sandbox/debs; debootstrap's log in $SANDGATE_CACHE/sandbox.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

SUITE=bookworm
VARIANT=minbase
# Bump to rebuild the base when the offline steps in this file change.
BASE_RECIPE_VERSION=1

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

mode=offline
force=0
tag_only=0
for arg in "$@"; do
	case "$arg" in
	--offline | --auto) mode=offline ;;
	--online) mode=online ;;
	--force) force=1 ;;
	--tag) tag_only=1 ;;
	-h | --help) usage; exit 0 ;;
	*) echo "build.sh: unknown argument: $arg (see --help)" >&2; exit 2 ;;
	esac
done

log() { printf '[sandbox] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now_ms() { date +%s%3N; }
since() { local t=$(($(now_ms) - $1)); printf '%d.%ds' $((t / 1000)) $((t % 1000 / 100)); }

# sha256 over the named files of $here (names and contents), first 12 hex digits.
hash_files() {
	(cd "$here" && LC_ALL=C sha256sum -- "$@") | sha256sum | cut -c1-12
}

recipe_files() {
	(cd "$here" && LC_ALL=C find . -maxdepth 1 -type f ! -name '*.md' -printf '%f\n' | LC_ALL=C sort)
}

mapfile -t files < <(recipe_files)
recipe_hash=$(hash_files "${files[@]}")
# sandgate's version (Cargo.toml's [workspace.package]) begins the tag and is the image's
# org.opencontainers.image.version label.
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\([^"]*\)".*/\1/p' "$here/../../Cargo.toml" | head -n1)
[[ -n $version ]] || die "no version in Cargo.toml's [workspace.package]"
tag="sandgate-sandbox:$version-$recipe_hash"

if ((tag_only)); then
	echo "$tag"
	exit 0
fi

if [[ -n ${SANDGATE_CACHE:-} ]]; then
	cache=$SANDGATE_CACHE
elif ((EUID == 0)); then
	cache=/var/cache/sandgate
else
	cache=${XDG_CACHE_HOME:-$HOME/.cache}/sandgate
fi
work="$cache/sandbox"
mkdir -p "$work"

as_root=()
((EUID == 0)) || as_root=(sudo)

docker info >/dev/null 2>&1 || die "docker does not answer (scripts/stack.sh up starts it)"

# One build at a time per cache directory.
exec 8>"$work/build.lock"
if ! flock -n 8; then
	log "waiting for another build.sh to finish"
	flock 8
fi

if ((!force)) && docker image inspect "$tag" >/dev/null 2>&1; then
	log "$tag is there"
	docker tag "$tag" sandgate-sandbox:latest
	echo "$tag"
	exit 0
fi

# ---- offline base: debootstrap + install-packages.sh -> docker import ------

rootfs=
# Unmounts whatever is mounted under the root being built (deepest first) and
# removes it without leaving this filesystem, so a failed build never reaches
# into /proc or the .deb cache.
cleanup_rootfs() {
	[[ -n $rootfs && -d $rootfs ]] || return 0
	local m
	while read -r m; do
		"${as_root[@]}" umount -l "$m" || true
	done < <(findmnt -rn -o TARGET | grep -F "$rootfs/" | sort -r)
	"${as_root[@]}" rm -rf --one-file-system "$rootfs"
}
trap cleanup_rootfs EXIT

# run_logged LOGFILE WHAT PATTERN COMMAND...: runs COMMAND with its output
# appended to LOGFILE, echoing the lines that match the extended regex PATTERN
# (its phases, not every package) with the time since the start; on failure
# shows the log's tail and exits.
run_logged() {
	local logfile=$1 what=$2 pattern=$3 t0 line rc
	shift 3
	t0=$(now_ms)
	set +e
	"$@" 2>&1 | while IFS= read -r line; do
		printf '%s\n' "$line" >>"$logfile"
		if [[ $line =~ $pattern ]]; then
			log "  $what [$(since "$t0")] ${line#I: }"
		fi
	done
	rc=${PIPESTATUS[0]}
	set -e
	if ((rc != 0)); then
		log "$what failed (exit $rc); last lines of $logfile:"
		tail -n 25 "$logfile" | sed 's/^/[sandbox]   | /' >&2
		exit 1
	fi
}

debootstrap_phases='^(I: (Retrieving (Release|Packages)|Resolving|Found|Installing core|Unpacking required|Configuring required|Unpacking the base|Configuring the base|Base system)|[EW]: )'
apt_phases='^(install-packages:|install-wheels:|Fetched |[0-9]+ upgraded|Setting up python3 )'
wheel_phases='^(  Downloading|ERROR)'

# Fetches the wheels of requirements.lock into $work/wheels (a wheel already there with the right
# hash is not downloaded again), showing each one as it comes.
fetch_wheels() {
	local t0 logfile=$work/wheels.log
	# shellcheck source=deploy/sandbox/wheel-target.sh
	source "$here/wheel-target.sh"
	python3 -m pip --version >/dev/null 2>&1 ||
		die "python3 -m pip does not run here: the image's wheels are fetched with this machine's pip"
	mkdir -p "$work/wheels"
	t0=$(now_ms)
	log "step 0/4: wheels of requirements.lock ($(grep -c '==' "$here/requirements.lock") packages) into $work/wheels (log: $logfile)"
	: >"$logfile"
	run_logged "$logfile" wheels "$wheel_phases" \
		python3 -m pip download --dest "$work/wheels" --require-hashes --no-deps \
		--progress-bar off --disable-pip-version-check "${WHEEL_TARGET[@]}" -r "$here/requirements.lock"
	log "step 0/4: done in $(since "$t0") ($(du -sh "$work/wheels" | cut -f1) of wheels cached)"
}

build_offline_base() {
	local base_hash base_tag logfile t0 t
	base_hash=$( (
		hash_files packages.txt install-packages.sh requirements.lock install-wheels.sh
		echo "$SUITE $VARIANT $BASE_RECIPE_VERSION"
	) | sha256sum | cut -c1-12)
	base_tag="sandgate-sandbox-base:$base_hash"
	if ((!force)) && docker image inspect "$base_tag" >/dev/null 2>&1; then
		log "base $base_tag is there"
		BASE_TAG=$base_tag
		return
	fi
	fetch_wheels
	command -v debootstrap >/dev/null || {
		log "installing debootstrap"
		"${as_root[@]}" sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap" >&2
	}

	rootfs="$work/rootfs-$base_hash"
	cleanup_rootfs # leftovers of an interrupted build
	mkdir -p "$work/debs"
	logfile="$work/debootstrap-$base_hash.log"

	t0=$(now_ms)
	log "step 1/4: debootstrap --variant=$VARIANT $SUITE (log: $logfile)"
	# No mirror argument: debootstrap's default mirror, whatever this machine's
	# configuration says.
	: >"$logfile"
	run_logged "$logfile" debootstrap "$debootstrap_phases" \
		"${as_root[@]}" debootstrap --variant="$VARIANT" --cache-dir="$work/debs" "$SUITE" "$rootfs"
	log "step 1/4: done in $(since "$t0")"

	t=$(now_ms)
	log "step 2/4: install-packages.sh and install-wheels.sh in the new root (apt-get, pip; log: $logfile)"
	# apt in the root uses the sources debootstrap wrote; take this machine's
	# Debian sources instead when they are for the same suite, so that the image
	# gets -updates and -security too.
	if [[ -f /etc/apt/sources.list.d/debian.sources ]] &&
		grep -q "^Suites:.*\b$SUITE-security\b" /etc/apt/sources.list.d/debian.sources; then
		"${as_root[@]}" cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/debian.sources"
		"${as_root[@]}" rm -f "$rootfs/etc/apt/sources.list"
	fi
	"${as_root[@]}" cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
	"${as_root[@]}" mount -t proc proc "$rootfs/proc"
	"${as_root[@]}" mkdir -p "$rootfs/var/cache/sandgate-debs/partial" "$rootfs/tmp/sandgate/wheels"
	"${as_root[@]}" mount --bind "$work/debs" "$rootfs/var/cache/sandgate-debs"
	"${as_root[@]}" mount --bind -o ro "$work/wheels" "$rootfs/tmp/sandgate/wheels"
	"${as_root[@]}" cp "$here/packages.txt" "$here/install-packages.sh" "$here/requirements.lock" \
		"$here/install-wheels.sh" "$rootfs/tmp/sandgate/"
	printf 'Dir::Cache::archives "/var/cache/sandgate-debs/";\n' |
		"${as_root[@]}" tee "$rootfs/tmp/sandgate/apt.conf" >/dev/null
	run_logged "$logfile" apt "$apt_phases" \
		"${as_root[@]}" chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		APT_CONFIG=/tmp/sandgate/apt.conf LANG=C.UTF-8 \
		/bin/sh /tmp/sandgate/install-packages.sh
	run_logged "$logfile" wheels "$apt_phases" \
		"${as_root[@]}" chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
		/bin/sh /tmp/sandgate/install-wheels.sh /tmp/sandgate/wheels
	"${as_root[@]}" umount "$rootfs/tmp/sandgate/wheels" "$rootfs/var/cache/sandgate-debs" "$rootfs/proc"
	"${as_root[@]}" rm -rf "$rootfs/var/cache/sandgate-debs" "$rootfs/tmp/sandgate"
	# Docker provides these at run time; nothing of this machine goes into the image.
	"${as_root[@]}" sh -c ": >'$rootfs/etc/resolv.conf'; : >'$rootfs/etc/hostname'; : >'$rootfs/etc/machine-id'"
	log "step 2/4: done in $(since "$t")"

	t=$(now_ms)
	log "step 3/4: docker import -> $base_tag ($("${as_root[@]}" du -sh --one-file-system "$rootfs" | cut -f1))"
	"${as_root[@]}" tar -C "$rootfs" --numeric-owner --one-file-system --exclude='./dev/*' -c . |
		docker import --message "sandgate sandbox base: debootstrap $VARIANT $SUITE + packages.txt" - "$base_tag" >/dev/null
	cleanup_rootfs
	rootfs=
	log "step 3/4: done in $(since "$t")"
	BASE_TAG=$base_tag
}

t_all=$(now_ms)
log "building $tag ($mode recipe)"
build_args=(--build-arg "RECIPE=$recipe_hash" --build-arg "VERSION=$version")
if [[ $mode == offline ]]; then
	build_offline_base
	build_args+=(--build-arg "BASE=$BASE_TAG")
fi

t=$(now_ms)
log "step 4/4: docker build (final steps: finalize.sh)"
# The build context: the recipe plus the statx shim compiled here (the image has no compiler; the
# shim needs nothing but syscall(2) from any glibc, so the machine's compiler will do).
context="$work/context-$recipe_hash"
rm -rf "$context"
mkdir -p "$context"
cp "${files[@]/#/$here/}" "$context/"
if [[ $mode == online ]]; then
	fetch_wheels
	# The online recipe installs the wheels in the Dockerfile (the offline one did in the base).
	cp -l "$work/wheels"/*.whl "$context/" 2>/dev/null || cp "$work/wheels"/*.whl "$context/"
fi
command -v cc >/dev/null || {
	log "installing a C compiler (gcc) for the statx shim"
	"${as_root[@]}" sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev" >&2
}
cc -shared -fPIC -O2 -Wall -Werror -o "$context/statx_shim.so" "$here/statx_shim.c"
docker_build_log="$work/docker-build-$recipe_hash.log"
if ! DOCKER_BUILDKIT=0 docker build "${build_args[@]}" -t "$tag" -t sandgate-sandbox:latest "$context" \
	>"$docker_build_log" 2>&1; then
	log "docker build failed; last lines of $docker_build_log:"
	tail -n 25 "$docker_build_log" | sed 's/^/[sandbox]   | /' >&2
	exit 1
fi
grep -E '^Step [0-9]+/' "$docker_build_log" | sed 's/^/[sandbox]   /' >&2 || true
rm -rf "$context"
log "step 4/4: done in $(since "$t")"
size=$(docker image inspect -f '{{.Size}}' "$tag")
log "built $tag ($((size / 1024 / 1024)) MiB) in $(since "$t_all")"
echo "$tag"
