#!/bin/sh
# The Postgres image's entrypoint: on first start (no cluster in $PGDATA) makes one from the
# environment, then runs the server in the foreground as this (non-root) user.
#
#   POSTGRES_USER       the superuser's name (default postgres)
#   POSTGRES_PASSWORD   its password (required; at least 16 characters)
#   POSTGRES_DB         a database created for it (default: POSTGRES_USER)
#   PGDATA              the cluster's directory (default /var/lib/postgresql/data)
#   SANDGATE_MIGRATOR_PASSWORD, SANDGATE_GATEWAY_PASSWORD, SANDGATE_NODE_PASSWORD
#                       when all three are set, the first start also makes sandgate's roles per
#                       process kind (roles.sql) in POSTGRES_DB
#   POSTGRES_TLS_NAME   the host name clients verify (default postgres, the compose service)
#
# TLS: the first start makes a private CA and a server certificate for POSTGRES_TLS_NAME in
# $PGDATA/tls, and copies the CA certificate to /var/lib/postgresql/ca/ca.crt (mount that
# directory's volume into the clients: sslmode=verify-full&sslrootcert=…/ca.crt). Every TCP
# connection must use TLS (hostssl); plain ones are refused.
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

# make_tls NAME: a private CA and a server certificate for NAME in $PGDATA/tls (key 0600).
make_tls() {
	tls="$PGDATA/tls"
	mkdir -p "$tls"
	(
		umask 077
		openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
			-subj "/CN=sandgate-postgres CA" -keyout "$tls/ca.key" -out "$tls/ca.crt" 2>/dev/null
		openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
			-keyout "$tls/server.key" -out "$tls/server.csr" 2>/dev/null
		printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$1" \
			>"$tls/ext.cnf"
		openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" \
			-CAcreateserial -days 825 -extfile "$tls/ext.cnf" -out "$tls/server.crt" 2>/dev/null
		rm -f "$tls/server.csr" "$tls/ext.cnf" "$tls/ca.key"
	) || fail "cannot make the server's TLS certificate (openssl)"
	chmod 0644 "$tls/ca.crt"
}

# make_roles SUPERUSER DB: sandgate's roles (roles.sql) when their passwords are set, with the
# server started on its socket only for the moment.
make_roles() {
	[ -n "${SANDGATE_MIGRATOR_PASSWORD:-}" ] && [ -n "${SANDGATE_GATEWAY_PASSWORD:-}" ] &&
		[ -n "${SANDGATE_NODE_PASSWORD:-}" ] || return 0
	pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -c unix_socket_directories=/tmp" start >&2
	PGPASSWORD=$POSTGRES_PASSWORD psql -X -q -h /tmp -U "$1" -d "$2" -v ON_ERROR_STOP=1 \
		-v migrator_password="$SANDGATE_MIGRATOR_PASSWORD" \
		-v gateway_password="$SANDGATE_GATEWAY_PASSWORD" \
		-v node_password="$SANDGATE_NODE_PASSWORD" \
		-f /usr/local/share/sandgate/roles.sql >&2 || {
		pg_ctl -D "$PGDATA" -w stop >&2
		fail "roles.sql failed"
	}
	pg_ctl -D "$PGDATA" -w stop >&2
	echo "sandgate-postgres: made the roles sandgate_migrator, sandgate_gateway, sandgate_node" >&2
}

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
		# Written by sandgate-postgres on first start: passwords everywhere, TLS over TCP.
		local     all all             scram-sha-256
		hostssl   all all 0.0.0.0/0   scram-sha-256
		hostssl   all all ::/0        scram-sha-256
		hostnossl all all 0.0.0.0/0   reject
		hostnossl all all ::/0        reject
	HBA
	make_tls "${POSTGRES_TLS_NAME:-postgres}"
	cat >>"$PGDATA/postgresql.conf" <<-CONF

		# sandgate-postgres
		listen_addresses = '*'
		unix_socket_directories = '/tmp'
		jit = off
		logging_collector = off
		ssl = on
		ssl_cert_file = 'tls/server.crt'
		ssl_key_file = 'tls/server.key'
		ssl_min_protocol_version = 'TLSv1.2'
	CONF
	if [ "$db" != postgres ]; then
		echo "CREATE DATABASE \"$db\" OWNER \"$user\";" |
			postgres --single -D "$PGDATA" postgres >/dev/null
	fi
	make_roles "$user" "$db"
	unset POSTGRES_PASSWORD
fi
unset POSTGRES_PASSWORD SANDGATE_MIGRATOR_PASSWORD SANDGATE_GATEWAY_PASSWORD SANDGATE_NODE_PASSWORD
# The CA certificate for the clients (the volume may be fresh while the cluster is not).
if [ -d /var/lib/postgresql/ca ] && [ -w /var/lib/postgresql/ca ]; then
	cp "$PGDATA/tls/ca.crt" /var/lib/postgresql/ca/ca.crt
	chmod 0644 /var/lib/postgresql/ca/ca.crt
fi
exec postgres -D "$PGDATA" "$@"
