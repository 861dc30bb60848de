#!/usr/bin/env bash
# Creates or updates the virtualenv the Python side of the test suite runs in, from
# tests/python-requirements.txt, under $SANDGATE_CACHE/py-venv, and prints its interpreter's path
# on stdout (progress goes to stderr). Idempotent: a stamp of the requirements file (and of the
# host's python3) makes a second run with nothing changed return at once.
#
#   python="$(scripts/py-venv.sh)"
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

requirements="$repo/tests/python-requirements.txt"
venv="$SANDGATE_CACHE/py-venv"
python="$venv/bin/python"
stamp="$venv/.requirements.sha256"

# What the venv is built from: the requirements and the interpreter it is made with.
want="$(
	{
		cat "$requirements"
		python3 --version
	} | sha256sum | cut -d' ' -f1
)"
up_to_date() { [[ -x $python && "$(cat "$stamp" 2>/dev/null)" == "$want" ]]; }

if ! up_to_date; then
	mkdir -p "$SANDGATE_CACHE"
	# Two runs at once (e.g. parallel CI steps) must not install into the same venv together.
	exec 9>"$SANDGATE_CACHE/py-venv.lock"
	flock 9
	if ! up_to_date; then
		printf '[py-venv] installing %s into %s\n' "${requirements#"$repo"/}" "$venv" >&2
		rm -f "$stamp"
		if [[ -x $python ]] && "$python" -c 'import sys' 2>/dev/null; then
			: # update the existing venv in place: pip installs only what changed
		else
			# No venv yet, or its interpreter no longer runs (the host's python3 changed).
			python3 -m venv --clear "$venv"
		fi
		"$python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
		"$python" -m pip check >&2
		printf '%s' "$want" >"$stamp"
	fi
	exec 9>&-
fi
printf '%s\n' "$python"
