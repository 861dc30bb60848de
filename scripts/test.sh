#!/usr/bin/env bash
# Brings the local stack up (Docker engine, Postgres, sandbox image) and runs the whole test
# suite: lints, the Rust unit, integration and end-to-end tests, and the agent's Python tests.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p sandgate-sandbox`).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

step() { printf '\n[test] %s\n' "$*" >&2; }

step "bringing the stack up"
"$repo/scripts/stack.sh" up >/dev/null
# shellcheck disable=SC1091
source "$SANDGATE_CACHE/stack.env"

# Each end-to-end test makes its own database (sandgate_e2e_<uuid>); drop earlier runs' ones.
stale=$(psql "$DATABASE_URL" -XtAc "select datname from pg_database where datname like 'sandgate\_e2e\_%'")
if [[ -n $stale ]]; then
	step "dropping $(wc -l <<<"$stale") databases of earlier test runs"
	while read -r db; do
		psql "$DATABASE_URL" -Xq -c "drop database if exists \"$db\" with (force)"
	done <<<"$stale"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "docs: links and paths (scripts/check-docs.py)"
python3 "$repo/scripts/check-docs.py"

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "Python test venv (scripts/py-venv.sh)"
# The e2e test python_sdk runs the official MCP Python SDK with this interpreter.
SANDGATE_TEST_PYTHON="$("$repo/scripts/py-venv.sh")"
export SANDGATE_TEST_PYTHON

step "TypeScript MCP SDK (scripts/ts-sdk.sh)"
# The e2e test ts_sdk runs the official MCP TypeScript SDK (tests/ts-sdk/package-lock.json).
SANDGATE_TEST_TS_SDK="$("$repo/scripts/ts-sdk.sh")"
export SANDGATE_TEST_TS_SDK

step "Chromium for the browser test (scripts/ensure-chromium.sh)"
"$repo/scripts/ensure-chromium.sh"

step "agent tests (pytest)"
"$repo/scripts/agent-tests.sh"

step "the lean engine's library (cargo build -p sandgate-lean)"
# libsandgate_lean.so, which each zygote loads, lands next to the test binaries and sandgate.
cargo build -p sandgate-lean --locked

step "cargo test (against the real stack)"
cargo test --workspace --locked "$@"

# The MCP conversations again with the sandbox profile on the lean engine (runtime "lean": sandboxes
# forked from a warmed zygote, docs/architecture.md): the official Python SDK's and rmcp's
# conversations, resources, packages, pausing, the README's example. The lean engine's own
# isolation and fault tests run in the sandbox crate's suite above.
if (($# == 0)); then
	step "MCP conversations on the lean engine"
	SANDGATE_TEST_RUNTIME=lean cargo test -p sandgate --test e2e --locked -- python_sdk:: support_analyst cli::readyz_names_postgres
fi

# The sandbox suite again under gVisor: a profile may name the runsc runtime and everything must
# hold there too. stack.sh registers runsc when Debian's package is installable.
if (($# == 0)); then
	if docker info --format '{{json .Runtimes}}' | grep -q '"runsc"'; then
		step "sandbox integration tests under gVisor (runsc)"
		SANDGATE_TEST_RUNTIME=runsc cargo test -p sandgate-sandbox --test it --locked
		# The MCP conversations too (the analyst's, with a long-form listing, through both the
		# official Python SDK and rmcp's client) and egress (the relay, secrets by placeholder):
		# a few minutes, not the whole e2e suite again.
		step "MCP conversations and egress under gVisor (runsc)"
		SANDGATE_TEST_RUNTIME=runsc cargo test -p sandgate --test e2e --locked -- python_sdk:: support_analyst egress
	else
		step "warning: the Docker engine has no runsc runtime; gVisor tests not run"
	fi
fi
