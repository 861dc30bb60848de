#!/usr/bin/env bash
# Brings up what sandgate's integration tests and a local gateway need:
# a Docker engine, a Postgres cluster of its own, the sandbox image,
# docker-compose (for the test of deploy/compose.yaml), and a second Docker
# engine on this machine (for the test of two sandbox nodes side by side).
# Idempotent: when everything is up it returns in seconds. CI runs it too.
#
#   scripts/stack.sh [up]    start what is not running, build what is missing
#   scripts/stack.sh down    stop the Postgres cluster and the dockerds that
#                            this script started (nothing else)
#   scripts/stack.sh docker2 start only the second engine if it is not running
#                            (the two-node test restarts it after stopping it)
#
# Afterwards $SANDGATE_CACHE/stack.env holds `export` lines for DATABASE_URL,
# SANDGATE_SANDBOX__IMAGE, SANDGATE_TEST_DOCKER2 (the second engine's socket),
# SANDGATE_TEST_DOCKER2_PIDFILE (and DOCKER_HOST when set): `source` it. `up`
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

# The daemon configuration used when this script starts dockerd: an existing
# /etc/docker/daemon.json as it is, else ours, which registers gVisor's runsc
# (Debian's package) as runtime "runsc" when it is installed.
daemon_config() {
	if [[ -f /etc/docker/daemon.json ]]; then
		log "docker: using /etc/docker/daemon.json as it is (runsc not registered by this script)"
		echo /etc/docker/daemon.json
		return
	fi
	local runsc
	if ! runsc=$(command -v runsc); then
		if apt_has_candidate runsc; then
			log "docker: installing gVisor (Debian package runsc)"
			apt_install runsc || true
		fi
		runsc=$(command -v runsc || true)
	fi
	if [[ -n $runsc ]]; then
		printf '{\n  "runtimes": {\n    "runsc": {"path": "%s", "runtimeArgs": ["--network=none"]}\n  }\n}\n' \
			"$runsc" >"$docker_dir/daemon.json"
		log "docker: registering runtime runsc ($runsc)"
	else
		echo '{}' >"$docker_dir/daemon.json"
		log "docker: gVisor (runsc) is not available here; only runc"
	fi
	echo "$docker_dir/daemon.json"
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
		"${as_root[@]}" rm -f "$dockerd_pidfile"
		log "docker: starting dockerd (log: $docker_dir/dockerd.log)"
		local group_args=()
		# Let the invoking user reach the socket without sudo.
		((EUID == 0)) || group_args=(--group "$(id -gn)")
		"${as_root[@]}" setsid nohup dockerd --config-file "$config" --pidfile "$dockerd_pidfile" \
			"${group_args[@]}" >>"$docker_dir/dockerd.log" 2>&1 </dev/null 9>&- &
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

# Its daemon.json, in a directory of its own: older engines keep the key their
# id derives from beside the configuration file, and two engines with one id
# would be one node to sandgate's registry. Registers runsc as the first
# engine has it.
docker2_config() {
	local runsc
	if docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"' &&
		runsc=$(command -v runsc); then
		printf '{\n  "runtimes": {\n    "runsc": {"path": "%s", "runtimeArgs": ["--network=none"]}\n  }\n}\n' \
			"$runsc" >"$docker2_dir/daemon.json"
		log "docker2: registering runtime runsc ($runsc), as the first engine has it"
	else
		echo '{}' >"$docker2_dir/daemon.json"
	fi
	echo "$docker2_dir/daemon.json"
}

docker2_up() {
	local t0 pid config
	t0=$(now_ms)
	if "${docker2[@]}" info >/dev/null 2>&1; then
		log "docker2: running ($(since "$t0"))"
		return
	fi
	command -v unshare >/dev/null || die "docker2: unshare (util-linux) is missing"
	mkdir -p "$docker2_dir/data"
	config=$(docker2_config)
	if pid=$(our_dockerd "$docker2_pidfile"); then
		log "docker2: dockerd $pid (ours) is starting"
	else
		"${as_root[@]}" rm -f "$docker2_pidfile"
		log "docker2: starting a second dockerd on $docker2_sock (log: $docker2_dir/dockerd.log)"
		local group_args=()
		((EUID == 0)) || group_args=(--group "$(id -gn)")
		# unshare --net: its own network namespace (only a loopback), so that nothing it
		# does to networks (without one it would delete the first engine's docker0) reaches
		# the host's. --mount with /etc/docker bound to a directory of its own: Docker 20.10
		# derives the engine's id from /etc/docker/key.json, and two engines with one id are
		# one node to sandgate's registry. Propagation "slave": the host's unmounts (the
		# first engine's container mounts) still reach this namespace, its own mounts never
		# leave it. sh and unshare exec dockerd: the pidfile's pid is dockerd's.
		mkdir -p "$docker2_dir/etc-docker"
		"${as_root[@]}" setsid nohup unshare --net --mount --propagation slave -- \
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
} >"$env_file.tmp"
mv "$env_file.tmp" "$env_file"
log "up ($(since "$t_all")); environment in $env_file"
grep '^export ' "$env_file"
