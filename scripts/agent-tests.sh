#!/usr/bin/env bash
# Runs the sandbox agent's protocol tests (crates/sandgate-sandbox/agent/tests/, one file per agent
# module) on the host, in the test suite's virtualenv (scripts/py-venv.sh: pytest and the data stack
# the image ships). Arguments go to pytest (a file, -k, -x ...).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$("$repo/scripts/py-venv.sh")"
cd "$repo/crates/sandgate-sandbox/agent"
exec "$python" -m pytest -q -p no:cacheprovider tests "$@"
