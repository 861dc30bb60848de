#!/bin/sh
# The Postgres image's entrypoint: on first start (no cluster in $PGDATA) makes one from the
# environment, then runs the server in the foreground as this (non-root) user.
#
#   POSTGRES_USER       the superuser's name (default postgres)
#   POSTGRES_PASSWORD   its password (required; at least 16 characters)
#   POSTGRES_DB         a database created for it (default: POSTGRES_USER)
#   PGDATA              the cluster's directory (default /var/lib/postgresql/data)
#
# Connections: scram-sha-256 passwords over TCP from anywhere the network lets through, and over
# the socket in /tmp (with a read-only root, the only writable place besides $PGDATA); nothing
# is trusted without a password. Arguments are passed to postgres (e.g. `-c max_connections=300`).
set -eu

fail() {
	echo "sandgate-postgres: $*" >&2
	exit 1
}

: "${PGDATA:=/var/lib/postgresql/data}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
# Names go into SQL and initdb's arguments: keep them to plain identifiers.
for name in "$user" "$db"; do
	case "$name" in
	"" | [!a-z_]* | *[!a-z0-9_]*)
		fail "POSTGRES_USER and POSTGRES_DB must be lower-case identifiers ([a-z_][a-z0-9_]*), got '$name'"
		;;
	esac
done

if [ ! -s "$PGDATA/PG_VERSION" ]; then
	[ -n "${POSTGRES_PASSWORD:-}" ] ||
		fail "POSTGRES_PASSWORD is not set: give the superuser a password (e.g. openssl rand -hex 24) to initialise $PGDATA"
	[ "${#POSTGRES_PASSWORD}" -ge 16 ] || fail "POSTGRES_PASSWORD is shorter than 16 characters"
	[ -w "$PGDATA" ] || fail "$PGDATA is not writable by uid $(id -u): mount a volume owned by it"
	echo "sandgate-postgres: initialising $PGDATA (superuser $user, database $db)" >&2
	pwfile=$(mktemp)
	printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
	initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth=scram-sha-256 \
		--encoding=UTF8 --locale=C.UTF-8 >&2
	rm -f "$pwfile"
	cat >"$PGDATA/pg_hba.conf" <<-HBA
		# Written by sandgate-postgres on first start: passwords everywhere.
		local all all                scram-sha-256
		host  all all 0.0.0.0/0      scram-sha-256
		host  all all ::/0           scram-sha-256
	HBA
	cat >>"$PGDATA/postgresql.conf" <<-CONF

		# sandgate-postgres
		listen_addresses = '*'
		unix_socket_directories = '/tmp'
		jit = off
		logging_collector = off
	CONF
	if [ "$db" != postgres ]; then
		echo "CREATE DATABASE \"$db\" OWNER \"$user\";" |
			postgres --single -D "$PGDATA" postgres >/dev/null
	fi
	unset POSTGRES_PASSWORD
fi
unset POSTGRES_PASSWORD
exec postgres -D "$PGDATA" "$@"
