#!/usr/bin/env bash
# Brings up what sandgate's integration tests and a local gateway need:
# a Docker engine, a Postgres cluster of its own, the sandbox image,
# docker-compose (for the test of deploy/compose.yaml), Debian's docker-registry, nginx and
# Prometheus (their binaries only, for the test of deploy/nginx/ and
# deploy/prometheus/), and a second Docker
# engine on this machine (for the test of two sandbox nodes side by side).
# Idempotent: when everything is up it returns in seconds. CI runs it too.
#
#   scripts/stack.sh [up]    start what is not running, build what is missing
#   scripts/stack.sh down    stop the Postgres cluster and the dockerds that
#                            this script started (nothing else)
#   scripts/stack.sh docker2 start only the second engine if it is not running
#                            (the two-node test restarts it after stopping it)
#
# The engines this script starts run in Docker's experimental mode (its checkpoint API, for
# sandbox snapshots: docs/snapshots.md) with gVisor registered twice, as "runsc" (the gVisor
# profile's runtime) and "runsc2024" (the snapshot route), both runsc 0.0~20240729.0-4~bpo12+2 of
# bookworm-backports on the systrap platform ("runsc" falls back to Debian's package of the
# machine's release where that cannot be installed),
# pinned, unpacked into $SANDGATE_CACHE/gvisor/ with an apt configuration of its own);
# "runsc2024" through scripts/sandgate-runsc (installed as $SANDGATE_CACHE/gvisor/sandgate-runsc),
# which restores images from the engine's plaintext tmpfs without Docker's copies. Their
# plaintext copies of checkpoint images stay on a tmpfs ($SANDGATE_CACHE/docker*/plain). An engine
# of ours that runs without what its daemon.json now says is reloaded (runtimes only) or restarted
# (its containers stop) by `up`; one this script did not start, or one configured by an existing
# /etc/docker/daemon.json, is left as it is.
#
# Afterwards $SANDGATE_CACHE/stack.env holds `export` lines for DATABASE_URL,
# SANDGATE_SANDBOX__IMAGE, SANDGATE_TEST_DOCKER2 (the second engine's socket),
# SANDGATE_TEST_DOCKER2_PIDFILE, SANDGATE_SNAPSHOTS__PLAIN_DIR (where the first engine's plaintext
# tmpfs is mounted), and DOCKER_HOST when set: `source` it. `up`
# also prints them on stdout; progress goes to stderr.
#
# The second engine is a dockerd with its own data-root, exec-root, socket
# (/run/sandgate-docker2.sock), configuration directory, containerd namespace,
# network namespace (`unshare --net`) and /etc/docker (its id), without a bridge
# or iptables rules: it never touches the first engine's network (docker0, NAT
# rules). It runs only sandboxes (network "none"); the sandbox image is copied
# into it with `docker save | load`.
#
# Environment:
#   SANDGATE_CACHE     state directory (default /var/cache/sandgate as root,
#                      else ${XDG_CACHE_HOME:-~/.cache}/sandgate)
#   SANDGATE_PG_PORT   port of the cluster on 127.0.0.1 (default 55432)
#   DATABASE_URL       use this database instead of running a cluster
#   DOCKER_HOST        use this engine; it is only checked, never started
#   SANDGATE_PLAIN_TMPFS_SIZE  size of each engine's tmpfs for plaintext checkpoint
#                      images (default 4g)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n ${SANDGATE_CACHE:-} ]]; then
	cache=$SANDGATE_CACHE
elif ((EUID == 0)); then
	cache=/var/cache/sandgate
else
	cache=${XDG_CACHE_HOME:-$HOME/.cache}/sandgate
fi
pg_port=${SANDGATE_PG_PORT:-55432}
pg_dir="$cache/postgres"
pg_data="$pg_dir/data"
pg_run="$pg_dir/run" # the cluster's unix socket: private, never /tmp or /run/postgresql
docker_dir="$cache/docker"
dockerd_pidfile="$docker_dir/dockerd.pid"

as_root=()
((EUID == 0)) || as_root=(sudo)

log() { printf '[stack] %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
now_ms() { date +%s%3N; }
since() {
	local t=$(($(now_ms) - $1))
	printf '%d.%ds' $((t / 1000)) $((t % 1000 / 100))
}
# Polls "$@" every 0.2 s until it succeeds or $1 seconds have passed.
wait_for() {
	local deadline=$(($(date +%s) + $1))
	shift
	until "$@" >/dev/null 2>&1; do
		(($(date +%s) < deadline)) || return 1
		sleep 0.2
	done
}
apt_updated=0
# apt-get install, its output in $cache/apt.log (shown when it fails).
apt_install() {
	local aptenv=(env DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1)
	if ((!apt_updated)); then
		"${as_root[@]}" "${aptenv[@]}" apt-get update >>"$cache/apt.log" 2>&1 || true
		apt_updated=1
	fi
	if ! "${as_root[@]}" "${aptenv[@]}" apt-get install -y --no-install-recommends "$@" >>"$cache/apt.log" 2>&1; then
		log "apt-get install $* failed; last lines of $cache/apt.log:"
		tail -n 15 "$cache/apt.log" | sed 's/^/[stack]   | /' >&2
		return 1
	fi
}
apt_has_candidate() {
	local c
	c=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p')
	[[ -n $c && $c != "(none)" ]]
}

# ---- Docker ----------------------------------------------------------------

# Pid of the dockerd this script started (its pidfile: $1, default the first
# engine's), if it is still running.
our_dockerd() {
	local pid pidfile=${1:-$dockerd_pidfile}
	[[ -f $pidfile ]] || return 1
	pid=$(<"$pidfile")
	[[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == dockerd ]] || return 1
	echo "$pid"
}

# ---- snapshots: the runtime and the engine's options they need ----------------
#
# Sandbox snapshots (docs/snapshots.md) use gVisor's checkpoint and restore through Docker's
# checkpoint API: runsc of Debian bookworm-backports, pinned, installed into a private directory
# (Debian's `runsc` of the machine's own release stays what the runtime "runsc" names) and
# registered as runtime "runsc2024"; the engine in experimental mode (the checkpoint API needs it);
# and the engine's plaintext copies of checkpoint images on a tmpfs.

snap_runsc_version=0.0~20240729.0-4~bpo12+2
snap_suite=bookworm-backports
snap_runtime=runsc2024
snap_runtime_args='"--network=none", "--platform=systrap"'
snap_dir="$cache/gvisor/${snap_runsc_version//[~+]/_}"
snap_runsc="$snap_dir/usr/bin/runsc"
snap_apt="$cache/apt-$snap_suite"
# runsc2024's path: scripts/sandgate-runsc, which restores a container from an image directory
# of the engine's plaintext tmpfs without Docker's copies (docs/snapshots.md).
snap_wrapper="$cache/gvisor/sandgate-runsc"
# Size of each engine's plaintext tmpfs (containerd's copies of images being checkpointed or
# restored; containerd leaves each restore's copy behind, docs/snapshots.md).
plain_size=${SANDGATE_PLAIN_TMPFS_SIZE:-4g}

# The Debian mirror of this machine's own apt sources (the private configuration uses it too).
debian_mirror() {
	apt-get indextargets --format '$(ORIGIN) $(RELEASE) $(REPO_URI)' 2>/dev/null |
		awk '$1 == "Debian" && $2 !~ /-security$/ { print $3; exit }'
}

snap_runsc_ok() {
	[[ -x $snap_runsc ]] &&
		[[ $("$snap_runsc" --version 2>/dev/null | head -n 1) == "runsc version ${snap_runsc_version%%-*}" ]]
}

# Downloads the pinned package with an apt configuration of its own (its own sources, lists, state
# and cache: the machine's suites and lists are left alone; apt checks the package against the
# suite's signed index) and unpacks it into $snap_dir. Fails softly: without it, no snapshots.
snap_runsc_install() {
	snap_runsc_ok && return 0
	local mirror keyring signed="" deb
	mirror=$(debian_mirror || true)
	if [[ -z $mirror ]] || ! command -v dpkg-deb >/dev/null; then
		log "snapshots: no Debian mirror in this machine's apt sources (or no dpkg-deb); $snap_runtime not installed"
		return 1
	fi
	keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	[[ ! -f $keyring ]] || signed=" signed-by=$keyring"
	"${as_root[@]}" mkdir -p "$snap_apt"/{lists/partial,archives/partial,sources.list.d,preferences.d}
	printf 'deb [arch=%s%s] %s %s main\n' "$(dpkg --print-architecture)" "$signed" "$mirror" "$snap_suite" |
		"${as_root[@]}" tee "$snap_apt/sources.list" >/dev/null
	"${as_root[@]}" touch "$snap_apt/status"
	local apt=("${as_root[@]}" apt-get -o "Dir::State=$snap_apt" -o "Dir::State::Lists=$snap_apt/lists"
		-o "Dir::State::status=$snap_apt/status" -o "Dir::Cache=$snap_apt"
		-o "Dir::Cache::archives=$snap_apt/archives" -o "Dir::Etc::sourcelist=$snap_apt/sources.list"
		-o "Dir::Etc::sourceparts=$snap_apt/sources.list.d"
		-o "Dir::Etc::preferencesparts=$snap_apt/preferences.d" -o "Acquire::Languages=none")
	log "snapshots: installing runsc $snap_runsc_version ($snap_suite) into $snap_dir"
	"${as_root[@]}" rm -f "$snap_apt"/archives/runsc_*.deb
	if ! "${apt[@]}" update >>"$cache/apt.log" 2>&1 ||
		! (cd "$snap_apt/archives" && "${apt[@]}" download "runsc=$snap_runsc_version") >>"$cache/apt.log" 2>&1; then
		log "snapshots: runsc $snap_runsc_version could not be downloaded (see $cache/apt.log); $snap_runtime not installed"
		return 1
	fi
	deb=$(printf '%s\n' "$snap_apt"/archives/runsc_*.deb | head -n 1)
	"${as_root[@]}" rm -rf "$snap_dir.tmp"
	"${as_root[@]}" mkdir -p "$snap_dir.tmp"
	"${as_root[@]}" dpkg-deb -x "$deb" "$snap_dir.tmp"
	"${as_root[@]}" rm -rf "$snap_dir"
	"${as_root[@]}" mv "$snap_dir.tmp" "$snap_dir"
	snap_runsc_ok || {
		log "snapshots: $snap_runsc does not say version ${snap_runsc_version%%-*}; $snap_runtime not registered"
		return 1
	}
}

# Installs scripts/sandgate-runsc as $snap_wrapper when it is missing or differs (atomically: a
# running engine may call it at any moment).
snap_wrapper_install() {
	cmp -s "$repo/scripts/sandgate-runsc" "$snap_wrapper" && return 0
	"${as_root[@]}" mkdir -p "$(dirname "$snap_wrapper")" &&
		"${as_root[@]}" install -m 0755 "$repo/scripts/sandgate-runsc" "$snap_wrapper.tmp" &&
		"${as_root[@]}" mv "$snap_wrapper.tmp" "$snap_wrapper" || {
		log "snapshots: $snap_wrapper could not be installed; $snap_runtime is runsc itself"
		return 1
	}
	log "snapshots: installed $snap_wrapper"
}

# One runtime of daemon.json: name, path, arguments (JSON strings, comma-separated).
runtime_json() {
	printf '    "%s": {"path": "%s", "runtimeArgs": [%s]}' "$1" "$2" "$3"
}

# The daemon.json this script writes for an engine it starts, whose plaintext tmpfs is $1:
# experimental mode and the gVisor runtimes that are installed: "runsc" (runsc2024's binary where
# it is installed, else Debian's package, `command -v runsc`) and "runsc2024" (sandgate-runsc
# around that binary, restoring from $1/sandgate/images, where the sandbox manager keeps images).
# With an engine command as further arguments, only the runtimes that engine has (the second
# engine registers what the first has).
daemon_json() {
	local runsc e entries=() sep="" plain=$1
	shift
	# "runsc" (the gVisor profile's runtime) is the 2024 release where it is installed: Debian
	# bookworm's 2022 release no longer starts containers on an engine with this configuration
	# ("cannot read client sync file"), and the 2024 one needs no statx shim (docs/snapshots.md).
	if snap_runsc_ok && { (($# == 0)) || engine_lists_runtime runsc "$@"; }; then
		entries+=("$(runtime_json runsc "$snap_runsc" "$snap_runtime_args")")
	elif runsc=$(command -v runsc) && { (($# == 0)) || engine_lists_runtime runsc "$@"; }; then
		entries+=("$(runtime_json runsc "$runsc" '"--network=none"')")
	fi
	if snap_runsc_ok && { (($# == 0)) || engine_lists_runtime "$snap_runtime" "$@"; }; then
		if snap_wrapper_install; then
			entries+=("$(runtime_json "$snap_runtime" "$snap_wrapper" "\"--sandgate-runsc=$snap_runsc\", \"--sandgate-images=$plain/sandgate/images\", $snap_runtime_args")")
		else
			entries+=("$(runtime_json "$snap_runtime" "$snap_runsc" "$snap_runtime_args")")
		fi
	fi
	printf '{\n  "experimental": true,\n  "runtimes": {'
	for e in "${entries[@]}"; do
		printf '%s\n%s' "$sep" "$e"
		sep=,
	done
	printf '\n  }\n}\n'
}

# Whether the engine "$2..." (a docker command) lists runtime $1.
engine_lists_runtime() {
	local name=$1
	shift
	"$@" info --format '{{json .Runtimes}}' 2>/dev/null | grep -q "\"$name\":"
}

# What a running engine ("$@", a docker command) lacks of the daemon.json file $config says, given
# the pid of its dockerd ($pid, for its environment) and its plaintext tmpfs ($plain): "" when
# nothing, "reload" when only runtimes (dockerd rereads them on SIGHUP), else "restart".
engine_lacks() {
	local config=$1 pid=$2 plain=$3 info name path args
	shift 3
	info=$("$@" info --format '{{.ExperimentalBuild}} {{json .Runtimes}}' 2>/dev/null) || {
		echo restart
		return
	}
	if [[ $info != true\ * ]] || ! plain_in_use "$pid" "$plain"; then
		echo restart
		return
	fi
	# Each runtime of the file, as `docker info` prints it: "name":{"path":"…","runtimeArgs":[…]
	while IFS='|' read -r name path args; do
		[[ -n $name ]] || continue
		if [[ $info != *"\"$name\":{\"path\":\"$path\",\"runtimeArgs\":[$args]"* ]]; then
			echo reload
			return
		fi
	done < <(sed -n 's/^ *"\([^"]*\)": {"path": "\([^"]*\)", "runtimeArgs": \[\(.*\)\]}.*$/\1|\2|\3/p' "$config" |
		sed 's/, /,/g')
}

# Whether the running engine lacks nothing (engine_lacks' arguments).
engine_has() {
	[[ -z $(engine_lacks "$@") ]]
}

# Checkpoint images in plaintext only on a tmpfs (docs/snapshots.md, "Plaintext on disk"):
# containerd's temporary copies go to its TMPDIR (inherited from dockerd: $plain/tmp), and its
# content store ($data_root/containerd/daemon/io.containerd.content.v1.content) is bound to
# $plain/content. Docker keeps images in its graph driver and uses that store only for
# checkpoints, except with its containerd image store (the default of new installs from Docker
# 29 on): there the store is left on disk. Run before the engine starts.
plain_up() {
	local data_root=$1 plain=$2 content="$1/containerd/daemon/io.containerd.content.v1.content" major
	"${as_root[@]}" mkdir -p "$plain"
	if ! mountpoint -q "$plain"; then
		"${as_root[@]}" mount -t tmpfs -o "size=$plain_size,mode=0700" sandgate-plain "$plain"
	fi
	"${as_root[@]}" mkdir -p "$plain/tmp" "$plain/content"
	major=$(dockerd --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
	if ((${major:-0} >= 29)); then
		log "docker: dockerd ≥ 29 may keep images in containerd's content store: it stays on disk"
		return
	fi
	"${as_root[@]}" mkdir -p "$content"
	mountpoint -q "$content" || "${as_root[@]}" mount --bind "$plain/content" "$content"
}

# Whether dockerd $1 runs with its TMPDIR on the plaintext tmpfs $2.
plain_in_use() {
	mountpoint -q "$2" && "${as_root[@]}" cat "/proc/$1/environ" 2>/dev/null | tr '\0' '\n' |
		grep -qx "TMPDIR=$2/tmp"
}

plain_down() {
	local data_root=$1 plain=$2 content="$1/containerd/daemon/io.containerd.content.v1.content"
	! mountpoint -q "$content" || "${as_root[@]}" umount "$content" || true
	! mountpoint -q "$plain" || "${as_root[@]}" umount "$plain" || true
}

# ---- Docker ----------------------------------------------------------------

docker_data_root=/var/lib/docker
docker_plain="$docker_dir/plain"

# The daemon configuration used when this script starts dockerd: an existing
# /etc/docker/daemon.json as it is, else ours (daemon_json: experimental mode, the gVisor runtimes;
# Debian's runsc is installed first when the machine's suites have it).
daemon_config() {
	if [[ -f /etc/docker/daemon.json ]]; then
		log "docker: using /etc/docker/daemon.json as it is (no runtimes or experimental mode set by this script)"
		echo /etc/docker/daemon.json
		return
	fi
	if ! command -v runsc >/dev/null && apt_has_candidate runsc; then
		log "docker: installing gVisor (Debian package runsc)"
		apt_install runsc || true
	fi
	snap_runsc_install || true
	daemon_json "$docker_plain" >"$docker_dir/daemon.json.tmp"
	mv "$docker_dir/daemon.json.tmp" "$docker_dir/daemon.json"
	log "docker: daemon.json: experimental, runtimes: $(grep -o '^    "[^"]*"' "$docker_dir/daemon.json" | tr -d ' "' | paste -sd ' ' -)"
	echo "$docker_dir/daemon.json"
}

# Starts the first engine's dockerd with configuration $1 (its plaintext tmpfs first, when the
# configuration is ours).
docker_start() {
	local config=$1 env_args=()
	"${as_root[@]}" rm -f "$dockerd_pidfile"
	if [[ $config == "$docker_dir/daemon.json" ]]; then
		plain_up "$docker_data_root" "$docker_plain"
		env_args=(env "TMPDIR=$docker_plain/tmp")
	fi
	log "docker: starting dockerd (log: $docker_dir/dockerd.log)"
	local group_args=()
	# Let the invoking user reach the socket without sudo.
	((EUID == 0)) || group_args=(--group "$(id -gn)")
	"${as_root[@]}" "${env_args[@]}" setsid nohup dockerd --config-file "$config" --pidfile "$dockerd_pidfile" \
		"${group_args[@]}" >>"$docker_dir/dockerd.log" 2>&1 </dev/null 9>&- &
}

# A running first engine: when this script started it with its own daemon.json, brings it to what
# that file says now (docs/snapshots.md): rewrites the file, then reloads dockerd (SIGHUP) when only
# runtimes changed, or restarts it when its experimental mode or plaintext tmpfs is missing (its
# containers stop). Any other engine is left as it is.
docker_reconcile() {
	local pid config="$docker_dir/daemon.json" lacks
	if [[ -f /etc/docker/daemon.json ]] || ! pid=$(our_dockerd) ||
		! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--config-file $config "; then
		docker info --format '{{.ExperimentalBuild}}' 2>/dev/null | grep -qx true ||
			log "docker: not in experimental mode (not started by this script with its daemon.json): no snapshots on it"
		return 0
	fi
	config=$(daemon_config)
	lacks=$(engine_lacks "$config" "$pid" "$docker_plain" docker)
	case $lacks in
	"") ;;
	reload)
		log "docker: reloading dockerd $pid (its runtimes changed)"
		"${as_root[@]}" kill -HUP "$pid"
		wait_for 30 engine_has "$config" "$pid" "$docker_plain" docker ||
			log "docker: dockerd $pid did not take the new runtimes (see $docker_dir/dockerd.log)"
		;;
	restart)
		log "docker: restarting dockerd $pid for $config (experimental mode, plaintext tmpfs); its containers stop"
		docker_down
		docker_start "$config"
		;;
	esac
}

docker_up() {
	local t0 pid config
	t0=$(now_ms)
	if [[ -n ${DOCKER_HOST:-} ]]; then
		docker info >/dev/null 2>&1 || die "DOCKER_HOST=$DOCKER_HOST does not answer"
		log "docker: $DOCKER_HOST answers ($(since "$t0"))"
		return
	fi
	if docker info >/dev/null 2>&1; then
		docker_reconcile
		if ! wait_for 60 docker info; then
			log "docker: dockerd did not answer within 60 s; last lines of $docker_dir/dockerd.log:"
			tail -n 20 "$docker_dir/dockerd.log" | sed 's/^/[stack]   | /' >&2
			exit 1
		fi
		log "docker: running ($(since "$t0"))"
		return
	fi
	if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
		log "docker: installing docker.io"
		apt_install docker.io
		# Where the package's service starts the daemon, that is the one to use.
		if docker info >/dev/null 2>&1; then
			log "docker: running after install ($(since "$t0"))"
			return
		fi
	fi
	mkdir -p "$docker_dir"
	config=$(daemon_config)
	if pid=$(our_dockerd); then
		log "docker: dockerd $pid (ours) is starting"
	else
		# A pidfile left by a dockerd that was killed (a stopped session, a
		# reboot) names a pid another process may have now, and dockerd refuses
		# to start over a pidfile whose pid is alive.
		docker_start "$config"
	fi
	if ! wait_for 60 docker info; then
		log "docker: dockerd did not answer within 60 s; last lines of $docker_dir/dockerd.log:"
		tail -n 20 "$docker_dir/dockerd.log" | sed 's/^/[stack]   | /' >&2
		exit 1
	fi
	log "docker: dockerd $(our_dockerd || echo '?') is up ($(since "$t0"))"
}

docker_down() {
	local pid
	if ! pid=$(our_dockerd); then
		log "docker: no dockerd started by this script is running"
		return
	fi
	log "docker: stopping dockerd $pid"
	"${as_root[@]}" kill -TERM "$pid"
	wait_for 60 sh -c "! test -e /proc/$pid" || die "dockerd $pid did not stop within 60 s"
	log "docker: stopped"
}

# ---- the second Docker engine -----------------------------------------------

docker2_dir="$cache/docker2"
docker2_pidfile="$docker2_dir/dockerd.pid"
docker2_sock=/run/sandgate-docker2.sock
docker2_exec=/run/sandgate-docker2
docker2=(docker -H "unix://$docker2_sock")

docker2_plain="$docker2_dir/plain"

# Its daemon.json, in a directory of its own: older engines keep the key their
# id derives from beside the configuration file, and two engines with one id
# would be one node to sandgate's registry. Experimental mode, and the gVisor
# runtimes the first engine has (daemon_json).
docker2_config() {
	mkdir -p "$docker2_dir"
	daemon_json "$docker2_plain" docker >"$docker2_dir/daemon.json.tmp"
	mv "$docker2_dir/daemon.json.tmp" "$docker2_dir/daemon.json"
	echo "$docker2_dir/daemon.json"
}

docker2_start() {
	local config=$1 group_args=()
	"${as_root[@]}" rm -f "$docker2_pidfile"
	plain_up "$docker2_dir/data" "$docker2_plain"
	log "docker2: starting a second dockerd on $docker2_sock (log: $docker2_dir/dockerd.log)"
	((EUID == 0)) || group_args=(--group "$(id -gn)")
	# unshare --net: its own network namespace (only a loopback), so that nothing it
	# does to networks (without one it would delete the first engine's docker0) reaches
	# the host's. --mount with /etc/docker bound to a directory of its own: Docker 20.10
	# derives the engine's id from /etc/docker/key.json, and two engines with one id are
	# one node to sandgate's registry. Propagation "slave": the host's unmounts (the
	# first engine's container mounts) still reach this namespace, its own mounts never
	# leave it (the plaintext tmpfs is mounted before, so it is there too). sh and
	# unshare exec dockerd: the pidfile's pid is dockerd's.
	mkdir -p "$docker2_dir/etc-docker"
	"${as_root[@]}" env "TMPDIR=$docker2_plain/tmp" setsid nohup unshare --net --mount --propagation slave -- \
		sh -c 'mkdir -p /etc/docker && mount --bind "$1" /etc/docker && shift && exec dockerd "$@"' \
		sh "$docker2_dir/etc-docker" \
		--config-file "$config" \
		--data-root "$docker2_dir/data" \
		--exec-root "$docker2_exec" \
		--pidfile "$docker2_pidfile" \
		-H "unix://$docker2_sock" \
		--bridge=none --iptables=false --ip-masq=false \
		--containerd-namespace sandgate-docker2 \
		--containerd-plugins-namespace sandgate-docker2-plugins \
		"${group_args[@]}" >>"$docker2_dir/dockerd.log" 2>&1 </dev/null 9>&- &
}

# A running second engine of ours that lacks what its daemon.json now says: reloaded (runtimes
# only) or restarted, as the first (docker_reconcile).
docker2_reconcile() {
	local pid config lacks
	pid=$(our_dockerd "$docker2_pidfile") || return 0
	config=$(docker2_config)
	lacks=$(engine_lacks "$config" "$pid" "$docker2_plain" "${docker2[@]}")
	case $lacks in
	"") ;;
	reload)
		log "docker2: reloading dockerd $pid (its runtimes changed)"
		"${as_root[@]}" kill -HUP "$pid"
		wait_for 30 engine_has "$config" "$pid" "$docker2_plain" "${docker2[@]}" ||
			log "docker2: dockerd $pid did not take the new runtimes (see $docker2_dir/dockerd.log)"
		;;
	restart)
		log "docker2: restarting dockerd $pid for $config (experimental mode, plaintext tmpfs); its containers stop"
		docker2_down
		docker2_start "$config"
		;;
	esac
}

docker2_up() {
	local t0 pid config
	t0=$(now_ms)
	if "${docker2[@]}" info >/dev/null 2>&1; then
		docker2_reconcile
	else
		command -v unshare >/dev/null || die "docker2: unshare (util-linux) is missing"
		mkdir -p "$docker2_dir/data"
		config=$(docker2_config)
		if pid=$(our_dockerd "$docker2_pidfile"); then
			log "docker2: dockerd $pid (ours) is starting"
		else
			docker2_start "$config"
		fi
	fi
	if ! wait_for 60 "${docker2[@]}" info; then
		log "docker2: dockerd did not answer within 60 s; last lines of $docker2_dir/dockerd.log:"
		tail -n 20 "$docker2_dir/dockerd.log" | sed 's/^/[stack]   | /' >&2
		exit 1
	fi
	log "docker2: dockerd $(our_dockerd "$docker2_pidfile" || echo '?') is up ($(since "$t0"))"
}

# The sandbox image on the second engine: copied from the first, once per tag.
image2_up() {
	local t0
	t0=$(now_ms)
	if "${docker2[@]}" image inspect "$sandbox_image" >/dev/null 2>&1; then
		log "docker2: $sandbox_image is there ($(since "$t0"))"
		return
	fi
	log "docker2: copying $sandbox_image from the first engine"
	docker save "$sandbox_image" | "${docker2[@]}" load >/dev/null
	log "docker2: $sandbox_image loaded ($(since "$t0"))"
}

docker2_down() {
	local pid
	if ! pid=$(our_dockerd "$docker2_pidfile"); then
		log "docker2: not running"
		return
	fi
	log "docker2: stopping dockerd $pid"
	"${as_root[@]}" kill -TERM "$pid"
	wait_for 60 sh -c "! test -e /proc/$pid" || die "dockerd $pid did not stop within 60 s"
	log "docker2: stopped"
}

# ---- Postgres --------------------------------------------------------------

pg_bindir() {
	local d
	if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
		dirname "$(command -v pg_ctl)"
		return
	fi
	for d in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r); do
		[[ -x $d/initdb && -x $d/pg_ctl ]] && {
			echo "$d"
			return
		}
	done
	return 1
}

# Postgres refuses to run as root: as root, the cluster belongs to the Debian
# `postgres` system user (created here, as postgresql-common would, if absent).
pg_user=
as_pg() {
	# From / so that the server never starts in a directory it cannot read.
	if [[ -n $pg_user ]]; then
		(cd / && runuser -u "$pg_user" -- "$@")
	else
		(cd / && "$@")
	fi
}

# A postmaster.pid left by a server that was killed names a pid that another
# process may have now; pg_ctl would take the cluster for running and the
# server would refuse to start. Remove it (and the socket's lock) when that pid
# is not a postgres process.
pg_clear_stale_pid() {
	local pid
	[[ -f $pg_data/postmaster.pid ]] || return 0
	pid=$(head -n 1 "$pg_data/postmaster.pid")
	if [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == postgres ]]; then
		return 0
	fi
	log "postgres: removing the stale postmaster.pid of pid $pid"
	rm -f "$pg_data/postmaster.pid" "$pg_run"/.s.PGSQL.*
}

pg_up() {
	local t0 bin
	t0=$(now_ms)
	if [[ -n ${DATABASE_URL:-} ]]; then
		log "postgres: using DATABASE_URL from the environment"
		database_url=$DATABASE_URL
		return
	fi
	if ! bin=$(pg_bindir); then
		log "postgres: installing postgresql (server binaries)"
		apt_install postgresql
		bin=$(pg_bindir) || die "no initdb/pg_ctl after installing postgresql"
	fi
	command -v psql >/dev/null || apt_install postgresql-client
	if ((EUID == 0)); then
		pg_user=postgres
		if ! id -u "$pg_user" >/dev/null 2>&1; then
			log "postgres: creating system user $pg_user"
			getent group "$pg_user" >/dev/null || groupadd --system "$pg_user"
			useradd --system --gid "$pg_user" --home-dir /var/lib/postgresql --no-create-home \
				--shell /bin/bash --comment "PostgreSQL administrator" "$pg_user"
		fi
	fi

	if [[ ! -f $pg_data/PG_VERSION ]]; then
		log "postgres: initdb $pg_data (superuser sandgate, trust on 127.0.0.1 only)"
		rm -rf "$pg_data"
		mkdir -p "$pg_data" "$pg_run"
		[[ -z $pg_user ]] || chown "$pg_user:" "$pg_dir" "$pg_data" "$pg_run"
		chmod 0700 "$pg_dir" "$pg_data" "$pg_run"
		as_pg "$bin/initdb" -D "$pg_data" -U sandgate --encoding=UTF8 --locale=C.UTF-8 \
			--auth=reject >"$pg_dir/initdb.log" 2>&1 || {
			tail -n 20 "$pg_dir/initdb.log" | sed 's/^/[stack]   | /' >&2
			die "initdb failed"
		}
		# The socket sits in a 0700 directory, so "local" reaches only its owner.
		as_pg tee "$pg_data/pg_hba.conf" >/dev/null <<-EOF
			# Written by scripts/stack.sh: a local test cluster.
			local all all              trust
			host  all all 127.0.0.1/32 trust
		EOF
		as_pg tee -a "$pg_data/postgresql.conf" >/dev/null <<-EOF

			# scripts/stack.sh (port and socket directory are given at start)
			listen_addresses = '127.0.0.1'
			max_connections = 300
			logging_collector = off
		EOF
	fi

	pg_clear_stale_pid
	if as_pg "$bin/pg_ctl" -D "$pg_data" status >/dev/null 2>&1; then
		log "postgres: running"
	else
		log "postgres: starting on 127.0.0.1:$pg_port (log: $pg_dir/postgres.log)"
		mkdir -p "$pg_run"
		[[ -z $pg_user ]] || chown "$pg_user:" "$pg_run" "$pg_dir"
		if ! as_pg "$bin/pg_ctl" -D "$pg_data" -l "$pg_dir/postgres.log" -w -t 60 \
			-o "-p $pg_port -k $pg_run" start >/dev/null 9>&-; then
			tail -n 20 "$pg_dir/postgres.log" | sed 's/^/[stack]   | /' >&2
			die "postgres did not start"
		fi
	fi
	wait_for 30 pg_isready -q -h 127.0.0.1 -p "$pg_port" -d postgres ||
		die "postgres on 127.0.0.1:$pg_port does not accept connections (is it another server? see $pg_dir/postgres.log)"
	local psql=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$pg_port" -U sandgate -d postgres)
	if [[ $("${psql[@]}" -tAc "select 1 from pg_database where datname = 'sandgate'") != 1 ]]; then
		log "postgres: creating database sandgate"
		"${psql[@]}" -c 'create database sandgate'
	fi
	database_url="postgres://sandgate@127.0.0.1:$pg_port/sandgate"
	log "postgres: $database_url ($(since "$t0"))"
}

pg_down() {
	local bin
	[[ -z ${DATABASE_URL:-} ]] || log "postgres: DATABASE_URL is set; stopping the cluster in $pg_data all the same"
	if [[ ! -f $pg_data/PG_VERSION ]] || ! bin=$(pg_bindir); then
		log "postgres: no cluster in $pg_data"
		return
	fi
	((EUID != 0)) || pg_user=postgres
	pg_clear_stale_pid
	if as_pg "$bin/pg_ctl" -D "$pg_data" status >/dev/null 2>&1; then
		log "postgres: stopping"
		as_pg "$bin/pg_ctl" -D "$pg_data" -m fast -w -t 60 stop >/dev/null
		log "postgres: stopped"
	else
		log "postgres: not running"
	fi
}

# ---- sandbox image ---------------------------------------------------------

image_up() {
	local t0
	t0=$(now_ms)
	sandbox_image=$("$repo/deploy/sandbox/build.sh" --tag)
	if docker image inspect "$sandbox_image" >/dev/null 2>&1; then
		log "image: $sandbox_image is there ($(since "$t0"))"
		return
	fi
	log "image: building $sandbox_image (the first time takes minutes)"
	sandbox_image=$("$repo/deploy/sandbox/build.sh" --offline | tail -n 1)
	log "image: $sandbox_image built ($(since "$t0"))"
}

# ---- tools the test suite needs --------------------------------------------

# docker-compose (Debian's 1.29): the end-to-end test of deploy/compose.yaml runs it.
compose_up() {
	if command -v docker-compose >/dev/null; then
		return
	fi
	log "docker-compose: installing (Debian package docker-compose)"
	apt_install docker-compose || die "docker-compose could not be installed; the deploy tests need it"
}

# nginx and Prometheus (Debian's): the e2e test `front` runs deploy/nginx/sandgate.conf and
# deploy/prometheus/ with their binaries, each on a loopback port of its own; Debian's
# docker-registry: the e2e test `image_pull` serves the sandbox image to the second engine from
# a registry on that engine's loopback. The packages'
# services are not wanted: while installing, a policy-rc.d (when the machine has none) keeps them
# from starting, and on a systemd host they are disabled afterwards (nginx would otherwise listen
# on port 80 of every interface, Prometheus on 9090).
front_tools_up() {
	local missing=() policy=/usr/sbin/policy-rc.d ours=0 ok=0
	[[ -x /usr/sbin/nginx ]] || missing+=(nginx)
	command -v promtool >/dev/null || missing+=(prometheus)
	command -v docker-registry >/dev/null || missing+=(docker-registry)
	((${#missing[@]})) || return 0
	log "front: installing ${missing[*]} (Debian packages; their services stay off)"
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
		"${as_root[@]}" chmod 755 "$policy"
		ours=1
	fi
	apt_install "${missing[@]}" && ok=1
	((!ours)) || "${as_root[@]}" rm -f "$policy"
	((ok)) || die "${missing[*]} could not be installed; the e2e test front needs them"
	if [[ -d /run/systemd/system ]]; then
		"${as_root[@]}" systemctl disable --now nginx prometheus docker-registry >/dev/null 2>&1 || true
	fi
}

# ---- main ------------------------------------------------------------------

cmd=${1:-up}
case "$cmd" in
up | down | docker2) ;;
-h | --help)
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown command: $cmd (up, down or docker2)" ;;
esac

mkdir -p "$cache"
# One stack.sh at a time per cache directory. The daemons started below get
# the descriptor closed (9>&-), or they would hold the lock for their lifetime.
exec 9>"$cache/stack.lock"
if ! flock -n 9; then
	log "waiting for another stack.sh to finish"
	flock 9
fi

t_all=$(now_ms)
if [[ $cmd == down ]]; then
	pg_down
	docker2_down
	docker_down
	plain_down "$docker2_dir/data" "$docker2_plain"
	plain_down "$docker_data_root" "$docker_plain"
	log "down ($(since "$t_all"))"
	exit 0
fi
if [[ $cmd == docker2 ]]; then
	docker2_up
	exit 0
fi

docker_up
pg_up
image_up
compose_up
front_tools_up
docker2_up
image2_up

env_file="$cache/stack.env"
{
	echo "# Written by scripts/stack.sh up; source it."
	printf 'export DATABASE_URL=%q\n' "$database_url"
	# The gateway's configuration key sandbox.image, as an environment override.
	printf 'export SANDGATE_SANDBOX__IMAGE=%q\n' "$sandbox_image"
	# The second engine, for the e2e test of two nodes (tests only: SANDGATE_TEST_*).
	printf 'export SANDGATE_TEST_DOCKER2=%q\n' "unix://$docker2_sock"
	printf 'export SANDGATE_TEST_DOCKER2_PIDFILE=%q\n' "$docker2_pidfile"
	[[ -z ${DOCKER_HOST:-} ]] || printf 'export DOCKER_HOST=%q\n' "$DOCKER_HOST"
	# The first engine's plaintext tmpfs (snapshots.plain_dir): where it is mounted, a node on that
	# engine can checkpoint and restore sandboxes (docs/snapshots.md).
	if mountpoint -q "$docker_plain"; then
		printf 'export SANDGATE_SNAPSHOTS__PLAIN_DIR=%q\n' "$docker_plain"
	fi
} >"$env_file.tmp"
mv "$env_file.tmp" "$env_file"
log "up ($(since "$t_all")); environment in $env_file"
grep '^export ' "$env_file"
