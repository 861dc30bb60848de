#!/usr/bin/env bash
# The login-flood benchmark (crates/sandgate/benches/login_flood.rs; docs/security.md):
#
#   scripts/bench-login-flood.sh
#
# 500 concurrent wrong-password sign-ins against a running gateway (release build), once from
# one address and once from 250 loopback addresses; prints the gateway's peak RSS and a
# legitimate MCP call's latency during each flood next to its latency without one. Needs the
# local stack (scripts/stack.sh up); talks to loopback and the local Docker engine only.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"
[[ -f $SANDGATE_CACHE/stack.env ]] || {
	echo "no $SANDGATE_CACHE/stack.env: bring the stack up with scripts/stack.sh up" >&2
	exit 1
}
# shellcheck disable=SC1091
source "$SANDGATE_CACHE/stack.env"
SANDGATE_SANDBOX__IMAGE="$("$repo/deploy/sandbox/build.sh" --tag)"
export SANDGATE_SANDBOX__IMAGE
unset SANDGATE_SANDBOX_IMAGE
exec cargo bench -p sandgate --bench login_flood
