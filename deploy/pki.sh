#!/usr/bin/env bash
# Makes the mutual-TLS material of one sandgate deployment (the node RPC between gateways and
# nodes; docs/scale-out.md, "Secrets"; docs/security.md, "Node identity"), with openssl:
#
#   deploy/pki.sh DIR [NODE_NAME ...]       a new CA, DIR/node (for the NODE_NAMEs, default
#                                           `node`, the compose service) and DIR/gateway
#   deploy/pki.sh add-node DIR NAME [--dns D]... [--ip A]... [--days N]
#                                           one more node certificate from DIR's CA, into
#                                           DIR/nodes/NAME, naming each D and A (default: NAME
#                                           as a DNS name): what that node's advertise_url names
#   deploy/pki.sh add-gateway DIR NAME [--days N]
#                                           one more gateway certificate, into DIR/gateways/NAME
#   deploy/pki.sh add-both DIR NAME [--dns D]... [--ip A]... [--days N]
#                                           both roles (a `sandgate serve` with node.listen that
#                                           is a node and dials others), into DIR/both/NAME
#   deploy/pki.sh add-proxy DIR NAME [--dns D]... [--ip A]... [--days N]
#                                           the TLS reverse proxy's server certificate (the
#                                           public name clients use; ECDSA P-256, which every
#                                           TLS client takes), into DIR/proxies/NAME: for a
#                                           private deployment whose clients trust DIR/ca.crt
#                                           (a proxy for the internet wants a public CA's)
#   deploy/pki.sh revoke DIR CERT           revokes CERT (a tls.crt this CA signed) and writes
#                                           DIR/crl.pem (node.tls_crl: copy it to every process)
#
# The two roles, as sandgate checks them (a certificate of one is refused in the other's place):
#   node     extendedKeyUsage=serverAuth, URI SAN urn:sandgate:role:node, the DNS/IP SANs its
#            advertise_url names (a node refuses to start with a certificate not naming it)
#   gateway  extendedKeyUsage=clientAuth, URI SAN urn:sandgate:role:gateway
# A proxy certificate (serverAuth, no sandgate role URI) is refused in both places.
# Every directory written holds {tls.crt,tls.key,ca.crt}. Keys are ed25519; leaves are valid
# --days (default 90; sandgate reads renewed files at the next connection, so re-issue and
# replace the files well before expiry), the CA 3650 days. Run as root, keys are made readable
# by uid/gid 10001 (the sandgate image's user) only; else chown them yourself. DIR/ca.key stays
# offline: never mount it.
set -euo pipefail

die() {
	printf 'pki.sh: %s\n' "$*" >&2
	exit 1
}
command -v openssl >/dev/null || die "openssl is needed (Debian package openssl)"

NODE_URI=urn:sandgate:role:node
GATEWAY_URI=urn:sandgate:role:gateway
days=90

# san NAME...: a subjectAltName list, IP: for addresses, DNS: for names.
san() {
	local out="" name
	for name in "$@"; do
		if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then
			out+="IP:$name,"
		else
			out+="DNS:$name,"
		fi
	done
	printf '%s' "${out%,}"
}

# leaf DEST CN EXTENSIONS [OPENSSL_KEY_ARGS...]: a key (ed25519 unless OPENSSL_KEY_ARGS say
# otherwise) and a certificate signed by DIR's CA into DEST.
leaf() {
	local dest=$1 cn=$2 ext=$3
	shift 3
	local key_args=("$@")
	((${#key_args[@]})) || key_args=(-newkey ed25519)
	[[ ! -e $dest/tls.crt ]] || die "$dest/tls.crt exists: remove it first to re-issue"
	mkdir -p "$dest"
	(
		umask 077
		openssl req -new -nodes "${key_args[@]}" -keyout "$dest/tls.key" \
			-out "$dest/tls.csr" -subj "/CN=$cn" 2>/dev/null
	)
	openssl x509 -req -in "$dest/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
		-CAcreateserial -CAserial "$dir/ca.srl" -days "$days" -out "$dest/tls.crt" \
		-extfile <(printf '%s\n' "$ext") 2>/dev/null
	rm -f "$dest/tls.csr"
	cp "$dir/ca.crt" "$dest/ca.crt"
	chmod 0755 "$dest"
	chmod 0644 "$dest/ca.crt" "$dest/tls.crt"
	chmod 0400 "$dest/tls.key"
	if ((EUID == 0)); then
		chown 10001:10001 "$dest/tls.key"
	fi
	printf '%s\n' "$dest"
}

node_ext() {
	printf 'subjectAltName=URI:%s,%s\nextendedKeyUsage=serverAuth\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature' \
		"$NODE_URI" "$(san "$@")"
}
gateway_ext() {
	printf 'subjectAltName=URI:%s\nextendedKeyUsage=clientAuth\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature' \
		"$GATEWAY_URI"
}
proxy_ext() {
	printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature' \
		"$(san "$@")"
}
both_ext() {
	printf 'subjectAltName=URI:%s,URI:%s,%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature' \
		"$NODE_URI" "$GATEWAY_URI" "$(san "$@")"
}

need_ca() {
	[[ -f $dir/ca.key && -f $dir/ca.crt ]] || die "$dir holds no CA (ca.key, ca.crt): make one with deploy/pki.sh $dir"
}

# parse_names NAME ARGS...: sets `names` from --dns/--ip (default NAME) and `days` from --days.
parse_names() {
	local default=$1
	shift
	names=()
	while (($#)); do
		case $1 in
		--dns | --ip)
			(($# >= 2)) || die "$1 needs a value"
			names+=("$2")
			shift 2
			;;
		--days)
			(($# >= 2)) && [[ $2 =~ ^[0-9]+$ ]] || die "--days needs a number"
			days=$2
			shift 2
			;;
		*) die "unknown argument $1" ;;
		esac
	done
	((${#names[@]})) || names=("$default")
}

check_name() {
	[[ $1 =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "NAME must be letters, digits, . _ - (got '$1')"
}

revoke() {
	local cert=$1 conf
	[[ -f $cert ]] || die "$cert is not a file"
	openssl verify -CAfile "$dir/ca.crt" "$cert" >/dev/null 2>&1 || die "$cert is not signed by $dir/ca.crt"
	touch "$dir/index.txt"
	[[ -f $dir/crlnumber ]] || echo 1000 >"$dir/crlnumber"
	conf=$(mktemp)
	trap 'rm -f "$conf"' RETURN
	cat >"$conf" <<EOF
[ca]
default_ca = sandgate
[sandgate]
database = $dir/index.txt
crlnumber = $dir/crlnumber
certificate = $dir/ca.crt
private_key = $dir/ca.key
default_md = default
default_crl_days = 30
EOF
	openssl ca -config "$conf" -revoke "$cert" 2>/dev/null || die "openssl could not revoke $cert"
	openssl ca -config "$conf" -gencrl -out "$dir/crl.pem" 2>/dev/null || die "openssl could not write the CRL"
	chmod 0644 "$dir/crl.pem"
	printf '%s\n' "$dir/crl.pem"
}

case ${1:-} in
add-node | add-gateway | add-both | add-proxy)
	cmd=$1
	(($# >= 3)) || die "usage: deploy/pki.sh $cmd DIR NAME [--dns D]... [--ip A]... [--days N]"
	dir=$2 name=$3
	shift 3
	check_name "$name"
	need_ca
	parse_names "$name" "$@"
	case $cmd in
	add-node) leaf "$dir/nodes/$name" "sandgate-node-$name" "$(node_ext "${names[@]}")" ;;
	add-gateway) leaf "$dir/gateways/$name" "sandgate-gateway-$name" "$(gateway_ext)" ;;
	add-both) leaf "$dir/both/$name" "sandgate-$name" "$(both_ext "${names[@]}")" ;;
	add-proxy)
		leaf "$dir/proxies/$name" "${names[0]}" "$(proxy_ext "${names[@]}")" \
			-newkey ec -pkeyopt ec_paramgen_curve:P-256
		;;
	esac
	;;
revoke)
	(($# == 3)) || die "usage: deploy/pki.sh revoke DIR CERT"
	dir=$2
	need_ca
	revoke "$3"
	;;
"" | -h | --help)
	die "usage: deploy/pki.sh DIR [NODE_NAME ...] | add-node DIR NAME [--dns D]... [--ip A]... | add-gateway DIR NAME | add-both DIR NAME ... | add-proxy DIR NAME [--dns D]... | revoke DIR CERT"
	;;
*)
	# The first form: a new CA, DIR/node and DIR/gateway.
	dir=$1
	shift
	names=("$@")
	((${#names[@]})) || names=(node)
	[[ ! -e $dir/ca.key ]] || die "$dir/ca.key exists: this directory already holds a CA (add certificates with add-node, add-gateway)"
	mkdir -p "$dir"
	(
		umask 077
		openssl req -x509 -new -nodes -newkey ed25519 -keyout "$dir/ca.key" -out "$dir/ca.crt" \
			-days 3650 -subj /CN=sandgate-ca \
			-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
	)
	chmod 0644 "$dir/ca.crt"
	leaf "$dir/node" sandgate-node "$(node_ext "${names[@]}")" >/dev/null
	leaf "$dir/gateway" sandgate-gateway "$(gateway_ext)" >/dev/null
	printf '%s\n' "$dir"
	;;
esac
