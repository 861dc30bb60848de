#!/usr/bin/env bash
# Makes the mutual-TLS material of one sandgate deployment (the node RPC between gateways and
# nodes; docs/scale-out.md, "Secrets"): a private CA, a node certificate and a gateway
# certificate, with openssl.
#
#   deploy/pki.sh DIR [NODE_NAME ...]
#
# NODE_NAME: the host names gateways dial the nodes by (the host of each node's advertise_url),
# default `node` (the compose service). Writes:
#
#   DIR/ca.key                               the CA's key: keep it offline, never mount it
#   DIR/ca.crt                               the CA certificate
#   DIR/node/{tls.crt,tls.key,ca.crt}        what a node mounts (serverAuth, SANs = NODE_NAMEs)
#   DIR/gateway/{tls.crt,tls.key,ca.crt}     what a gateway mounts (clientAuth)
#
# Keys are ed25519, certificates valid 365 days (the CA 3650). Run as root, the files a service
# mounts are made readable by uid/gid 10001 (the sandgate image's user) and no one else; run as
# another user, chown them to 10001 yourself. Refuses to overwrite an existing DIR/ca.key.
set -euo pipefail

die() {
	printf 'pki.sh: %s\n' "$*" >&2
	exit 1
}

(($# >= 1)) || die "usage: deploy/pki.sh DIR [NODE_NAME ...]"
dir=$1
shift
names=("$@")
((${#names[@]})) || names=(node)
command -v openssl >/dev/null || die "openssl is needed (Debian package openssl)"
[[ ! -e $dir/ca.key ]] || die "$dir/ca.key exists: this directory already holds a CA"

mkdir -p "$dir/node" "$dir/gateway"
umask 077
san=""
for name in "${names[@]}"; do
	if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then
		san+="IP:$name,"
	else
		san+="DNS:$name,"
	fi
done
san=${san%,}

openssl req -x509 -new -nodes -newkey ed25519 -keyout "$dir/ca.key" -out "$dir/ca.crt" \
	-days 3650 -subj /CN=sandgate-ca 2>/dev/null
# leaf ROLE CN EXTENSIONS: a key and a certificate signed by the CA into DIR/ROLE.
leaf() {
	local role=$1 cn=$2 ext=$3
	openssl req -new -nodes -newkey ed25519 -keyout "$dir/$role/tls.key" \
		-out "$dir/$role/tls.csr" -subj "/CN=$cn" 2>/dev/null
	openssl x509 -req -in "$dir/$role/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
		-CAcreateserial -days 365 -out "$dir/$role/tls.crt" \
		-extfile <(printf '%s\n' "$ext") 2>/dev/null
	rm -f "$dir/$role/tls.csr"
	cp "$dir/ca.crt" "$dir/$role/ca.crt"
}
leaf node sandgate-node "subjectAltName=$san
extendedKeyUsage=serverAuth"
leaf gateway sandgate-gateway "extendedKeyUsage=clientAuth"
rm -f "$dir/ca.srl"

chmod 0755 "$dir/node" "$dir/gateway"
chmod 0644 "$dir/ca.crt" "$dir"/*/ca.crt "$dir"/*/tls.crt
chmod 0400 "$dir"/*/tls.key
if ((EUID == 0)); then
	chown 10001:10001 "$dir"/*/tls.key
fi
printf '%s\n' "$dir"
