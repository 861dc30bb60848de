#!/usr/bin/env bash
# Runs the sandbox agent's protocol tests (crates/sandgate-sandbox/agent/test_agent.py) on the host,
# in the test suite's virtualenv (scripts/py-venv.sh: pytest and the data stack the image ships).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$("$repo/scripts/py-venv.sh")"
cd "$repo/crates/sandgate-sandbox/agent"
exec "$python" -m pytest -q -p no:cacheprovider test_agent.py
