#!/usr/bin/env bash
# Installs the official MCP TypeScript SDK the end-to-end tests drive sandgate with, from
# tests/ts-sdk/package.json and its package-lock.json (npm ci: exactly the locked versions),
# under $SANDGATE_CACHE/ts-sdk, and prints that directory on stdout (progress goes to stderr).
# Idempotent: a stamp of the lock file (and of node's version) makes a second run with nothing
# changed return at once.
#
#   SANDGATE_TEST_TS_SDK="$(scripts/ts-sdk.sh)"
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

source_dir="$repo/tests/ts-sdk"
dir="$SANDGATE_CACHE/ts-sdk"
stamp="$dir/.lock.sha256"

want="$(
	{
		cat "$source_dir/package.json" "$source_dir/package-lock.json"
		node --version
	} | sha256sum | cut -d' ' -f1
)"
up_to_date() { [[ -d $dir/node_modules/@modelcontextprotocol/sdk && "$(cat "$stamp" 2>/dev/null)" == "$want" ]]; }

if ! up_to_date; then
	mkdir -p "$dir"
	# Two runs at once must not install into the same directory together.
	exec 9>"$SANDGATE_CACHE/ts-sdk.lock"
	flock 9
	if ! up_to_date; then
		printf '[ts-sdk] installing tests/ts-sdk/package-lock.json into %s\n' "$dir" >&2
		rm -f "$stamp"
		cp "$source_dir/package.json" "$source_dir/package-lock.json" "$dir/"
		(cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
		printf '%s' "$want" >"$stamp"
	fi
	exec 9>&-
fi
printf '%s\n' "$dir"
