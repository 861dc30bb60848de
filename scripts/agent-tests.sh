#!/usr/bin/env bash
# Runs the sandbox agent's protocol tests (crates/sandgate-sandbox/agent/test_agent.py) on the host,
# in a virtualenv under the cache that has pytest and the data stack the image ships.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

venv="$SANDGATE_CACHE/agent-venv"
requirements="pytest ipython numpy pandas matplotlib"
stamp="$venv/.requirements"
if [[ ! -x $venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]]; then
	printf '[agent-tests] creating %s with: %s\n' "$venv" "$requirements" >&2
	python3 -m venv "$venv"
	# shellcheck disable=SC2086
	"$venv/bin/pip" install --quiet --disable-pip-version-check $requirements
	printf '%s' "$requirements" >"$stamp"
fi
cd "$repo/crates/sandgate-sandbox/agent"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider test_agent.py
