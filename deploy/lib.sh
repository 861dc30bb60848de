# Shared steps of the offline image recipes deploy/gateway/build.sh, deploy/nginx/build.sh and
# deploy/postgres/build.sh (sourced, not run): logging, content hashes, a Debian root from
# debootstrap or from .debs, and `docker import`. deploy/sandbox/build.sh predates this file and keeps its own copies of these
# steps: moving it here would change the sandbox image's recipe hash (its tag) for no gain in
# the image.
#
# The sourcing script sets IMG_NAME (the log prefix) before sourcing.

# shellcheck shell=bash

img_log() { printf '[%s] %s\n' "$IMG_NAME" "$*" >&2; }
img_die() {
	img_log "error: $*"
	exit 1
}
img_now_ms() { date +%s%3N; }
img_since() {
	local t=$(($(img_now_ms) - $1))
	printf '%d.%ds' $((t / 1000)) $((t % 1000 / 100))
}

# The cache directory the scripts share ($SANDGATE_CACHE, else /var/cache/sandgate as root, else
# ~/.cache/sandgate).
img_cache_root() {
	if [[ -n ${SANDGATE_CACHE:-} ]]; then
		echo "$SANDGATE_CACHE"
	elif ((EUID == 0)); then
		echo /var/cache/sandgate
	else
		echo "${XDG_CACHE_HOME:-$HOME/.cache}/sandgate"
	fi
}

IMG_AS_ROOT=()
((EUID == 0)) || IMG_AS_ROOT=(sudo)

# img_begin WORK TAG FORCE: makes the cache directory WORK, checks that the engine answers, takes
# WORK's build lock (one build per recipe and cache at a time; held until the script ends) and,
# unless FORCE is 1, ends the script printing TAG when that image is already there.
img_begin() {
	local work=$1 tag=$2 force=$3
	mkdir -p "$work"
	docker info >/dev/null 2>&1 || img_die "docker does not answer (scripts/stack.sh up starts it)"
	exec 8>"$work/build.lock"
	if ! flock -n 8; then
		img_log "waiting for another build in $work to finish"
		flock 8
	fi
	if ((!force)) && docker image inspect "$tag" >/dev/null 2>&1; then
		img_log "$tag is there"
		echo "$tag"
		exit 0
	fi
}

# img_version: sandgate's version (Cargo.toml's [workspace.package] version), which every image's
# tag starts with (<version>-<recipe hash>) and its org.opencontainers.image.version label says.
img_version() {
	local v
	v=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\([^"]*\)".*/\1/p' \
		"$(dirname "${BASH_SOURCE[0]}")/../Cargo.toml" | head -n1)
	[[ -n $v ]] || img_die "no version in Cargo.toml's [workspace.package]"
	echo "$v"
}

# img_oci_labels TITLE DESCRIPTION VERSION RECIPE: the OCI annotation labels every image carries
# (https://github.com/opencontainers/image-spec/blob/main/annotations.md), one KEY=VALUE per line.
img_oci_labels() {
	printf '%s\n' \
		"org.opencontainers.image.title=$1" \
		"org.opencontainers.image.description=$2" \
		"org.opencontainers.image.version=$3" \
		"org.opencontainers.image.licenses=Apache-2.0" \
		"org.opencontainers.image.vendor=sandgate" \
		"sandgate.recipe=$4"
}

# img_recipe_files DIR: the recipe's files in DIR (not *.md), sorted, one name per line.
img_recipe_files() {
	(cd "$1" && LC_ALL=C find . -maxdepth 1 -type f ! -name '*.md' -printf '%f\n' | LC_ALL=C sort)
}

# img_hash DIR FILE...: the first 12 hex digits of a sha256 over the named files of DIR (names and
# contents) and whatever comes on stdin after them (extra inputs of the recipe).
img_hash() {
	local dir=$1
	shift
	{
		(cd "$dir" && LC_ALL=C sha256sum -- "$@")
		cat
	} | sha256sum | cut -c1-12
}

# img_run_logged LOGFILE WHAT PATTERN COMMAND...: runs COMMAND with its output appended to
# LOGFILE, echoing the lines that match the extended regex PATTERN with the time since the start;
# on failure shows the log's tail and exits.
img_run_logged() {
	local logfile=$1 what=$2 pattern=$3 t0 line rc
	shift 3
	t0=$(img_now_ms)
	set +e
	"$@" 2>&1 | while IFS= read -r line; do
		printf '%s\n' "$line" >>"$logfile"
		if [[ $line =~ $pattern ]]; then
			img_log "  $what [$(img_since "$t0")] ${line#I: }"
		fi
	done
	rc=${PIPESTATUS[0]}
	set -e
	if ((rc != 0)); then
		img_log "$what failed (exit $rc); last lines of $logfile:"
		tail -n 25 "$logfile" | sed "s/^/[$IMG_NAME]   | /" >&2
		exit 1
	fi
}

# img_remove_root ROOT: unmounts whatever is mounted under ROOT (deepest first) and removes it
# without leaving this filesystem, so a failed build never reaches into /proc or a cache.
img_remove_root() {
	local root=$1 m
	[[ -n $root && -d $root ]] || return 0
	while read -r m; do
		"${IMG_AS_ROOT[@]}" umount -l "$m" || true
	done < <(findmnt -rn -o TARGET | grep -F "$root/" | sort -r)
	"${IMG_AS_ROOT[@]}" rm -rf --one-file-system "$root"
}

IMG_DEBOOTSTRAP_PHASES='^(I: (Retrieving (Release|Packages)|Resolving|Found|Installing core|Unpacking required|Configuring required|Unpacking the base|Configuring the base|Base system)|[EW]: )'

# img_debootstrap ROOT DEBS LOGFILE: a Debian bookworm minbase root in ROOT with debootstrap's
# default mirror (whatever this machine's configuration says); downloaded .debs are kept in DEBS.
img_debootstrap() {
	local root=$1 debs=$2 logfile=$3
	command -v debootstrap >/dev/null || {
		img_log "installing debootstrap"
		"${IMG_AS_ROOT[@]}" sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap" >&2
	}
	mkdir -p "$debs"
	img_run_logged "$logfile" debootstrap "$IMG_DEBOOTSTRAP_PHASES" \
		"${IMG_AS_ROOT[@]}" debootstrap --variant=minbase --cache-dir="$debs" bookworm "$root"
}

# img_chroot_script ROOT DEBS LOGFILE PATTERN SCRIPT [FILE...]: copies SCRIPT and the FILEs into
# ROOT/tmp/sandgate and runs SCRIPT there as root (chrooted, /proc mounted, apt's archive cache on
# DEBS), with this machine's Debian sources when they are bookworm's (so -updates and -security
# come in too). Afterwards the root holds nothing of this machine (resolv.conf, hostname,
# machine-id emptied).
img_chroot_script() {
	local root=$1 debs=$2 logfile=$3 pattern=$4 script=$5
	shift 5
	local r=("${IMG_AS_ROOT[@]}")
	if [[ -f /etc/apt/sources.list.d/debian.sources ]] &&
		grep -q "^Suites:.*\bbookworm-security\b" /etc/apt/sources.list.d/debian.sources; then
		"${r[@]}" cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/debian.sources"
		"${r[@]}" rm -f "$root/etc/apt/sources.list"
	fi
	"${r[@]}" cp -L /etc/resolv.conf "$root/etc/resolv.conf"
	"${r[@]}" mount -t proc proc "$root/proc"
	"${r[@]}" mkdir -p "$root/var/cache/sandgate-debs/partial" "$root/tmp/sandgate"
	"${r[@]}" mount --bind "$debs" "$root/var/cache/sandgate-debs"
	"${r[@]}" cp "$script" "$@" "$root/tmp/sandgate/"
	printf 'Dir::Cache::archives "/var/cache/sandgate-debs/";\n' | "${r[@]}" tee "$root/tmp/sandgate/apt.conf" >/dev/null
	img_run_logged "$logfile" chroot "$pattern" \
		"${r[@]}" chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		APT_CONFIG=/tmp/sandgate/apt.conf LANG=C.UTF-8 /bin/sh "/tmp/sandgate/$(basename "$script")"
	"${r[@]}" umount "$root/var/cache/sandgate-debs" "$root/proc"
	"${r[@]}" rm -rf "$root/var/cache/sandgate-debs" "$root/tmp/sandgate"
	"${r[@]}" sh -c ": >'$root/etc/resolv.conf'; : >'$root/etc/hostname'; : >'$root/etc/machine-id'"
}

# img_package_versions PACKAGES_TXT: sets IMG_VERSIONS to pkg=version of the candidate in this
# machine's apt lists of each package PACKAGES_TXT names (whitespace-separated, # comments),
# running `apt-get update` once when one is unknown (a fresh machine may have no lists yet).
img_package_versions() {
	local packages p v updated=0
	mapfile -t packages < <(sed -e 's/#.*//' "$1" | tr -s ' \t' '\n' | sed -e '/^$/d')
	IMG_VERSIONS=()
	for p in "${packages[@]}"; do
		v=$(img_candidate "$p")
		if [[ -z $v || $v == "(none)" ]] && ((!updated)); then
			img_log "apt knows no candidate for $p: apt-get update"
			"${IMG_AS_ROOT[@]}" apt-get update -qq >&2 || true
			updated=1
			v=$(img_candidate "$p")
		fi
		[[ -n $v && $v != "(none)" ]] || img_die "apt knows no candidate for $p (is it in this machine's apt sources?)"
		IMG_VERSIONS+=("$p=$v")
	done
}
img_candidate() { apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p'; }

# img_unpack_debs DEBS ROOT PKG=VERSION...: the files of each package version (`apt-get download`
# into DEBS unless its .deb is there already, then `dpkg-deb -x`, no maintainer scripts) in ROOT.
img_unpack_debs() {
	local debs=$1 root=$2 pv p v deb sandbox_user
	shift 2
	mkdir -p "$debs"
	for pv in "$@"; do
		p=${pv%%=*}
		v=${pv#*=}
		# apt-get download names files <pkg>_<version with : as %3a>_<arch>.deb.
		deb=$(find "$debs" -maxdepth 1 -name "${p}_${v//:/%3a}_*.deb" | head -n 1)
		if [[ -z $deb ]]; then
			img_log "  apt-get download $pv"
			# As root apt's sandbox user cannot write the cache: download as root, without the warning.
			sandbox_user=()
			((EUID != 0)) || sandbox_user=(-o APT::Sandbox::User=root)
			if ! (cd "$debs" && apt-get download -qq "${sandbox_user[@]}" "$pv" >"$debs/../apt.log" 2>&1); then
				sed "s/^/[$IMG_NAME]   | /" "$debs/../apt.log" >&2
				img_die "apt-get download $pv failed"
			fi
			deb=$(find "$debs" -maxdepth 1 -name "${p}_${v//:/%3a}_*.deb" | head -n 1)
			[[ -n $deb ]] || img_die "apt-get download $pv left no .deb in $debs"
		fi
		dpkg-deb -x "$deb" "$root"
	done
}

# img_import ROOT TAG MESSAGE [--change INSTRUCTION]...: `docker import` of ROOT (numeric owners,
# /dev left empty) as TAG.
img_import() {
	local root=$1 tag=$2 message=$3
	shift 3
	"${IMG_AS_ROOT[@]}" tar -C "$root" --numeric-owner --one-file-system --exclude='./dev/*' -c . |
		docker import --message "$message" "$@" - "$tag" >/dev/null
}

# img_size TAG: the image's size in MiB.
img_size() {
	echo "$(($(docker image inspect -f '{{.Size}}' "$1") / 1024 / 1024)) MiB"
}
