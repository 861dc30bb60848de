#!/usr/bin/env bash
# sandgate's benchmark, side by side with the alternatives, in one run (docs/benchmarks.md):
#
#   scripts/bench.sh [--quick] [--no-peers] [--no-150] [--no-snapshots | --snapshots-only]
#                    [--no-series | --series-only | --exec-only] [--pauses-only]
#
# Brings the local stack up (Docker engine, Postgres, the sandbox image), installs the peers
# (bench/peers/requirements.txt) into $SANDGATE_CACHE/bench-venv, builds the image llm-sandbox
# runs FROM the sandbox image (nothing is pulled), builds sandgate in release mode and runs the
# bench binary (crates/sandgate/benches/mcp/main.rs). It prints the table and writes it as JSON to
# bench/results/<UTC time>.json (and bench/results/latest.json).
#
# Everything talks to loopback and the local Docker engine only. A full run takes about 15-25
# minutes on 2 cores; --quick takes a few. --no-150 skips filling up to 150 live sandboxes.
# --series-only runs the cold-start rows and the SDK series (back to back, open loop at 30-240
# conversations per minute with the CPU by component) alone; --no-series skips the series.
# --exec-only runs only the rows that time one call (execute_code 1+1 through MCP, through a
# node, through the sandbox crate), for before/after comparisons (docs/benchmarks.md).
# --no-snapshots skips the snapshot rows (template restores, checkpoint and restore, the series on
# runsc2024 restored from a template), which run where the engine has runsc2024;
# --snapshots-only runs only those (with --quick: a few of each, to try them), with the
# pause rows (pause_sandbox, the resume, fork_sandbox, the snapshot's size) after them;
# --pauses-only runs only the pause rows.
set -euo pipefail

for arg in "$@"; do
	case $arg in
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
		exit 0
		;;
	esac
done

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

log() { printf '[bench] %s\n' "$*" >&2; }

if [[ -x $repo/scripts/stack.sh ]]; then
	"$repo/scripts/stack.sh" up >/dev/null
fi
[[ -f $SANDGATE_CACHE/stack.env ]] || {
	log "no $SANDGATE_CACHE/stack.env: bring the stack up with scripts/stack.sh up"
	exit 1
}
# shellcheck disable=SC1091
source "$SANDGATE_CACHE/stack.env"
# Older stack.env files name the image SANDGATE_SANDBOX_IMAGE; the configuration's name is
# SANDGATE_SANDBOX__IMAGE (and an unknown SANDGATE_* variable is a configuration error).
if [[ -n ${SANDGATE_SANDBOX_IMAGE:-} ]]; then
	export SANDGATE_SANDBOX__IMAGE=$SANDGATE_SANDBOX_IMAGE
	unset SANDGATE_SANDBOX_IMAGE
fi
[[ -n ${SANDGATE_SANDBOX__IMAGE:-} ]] || {
	log "stack.env names no sandbox image"
	exit 1
}

# ---- the peers' virtualenv ------------------------------------------------------------------
requirements="$repo/bench/peers/requirements.txt"
venv="$SANDGATE_CACHE/bench-venv"
stamp="$venv/.requirements.sha256"
want="$({
	cat "$requirements"
	python3 --version
} | sha256sum | cut -d' ' -f1)"
if [[ ! -x $venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
	log "installing the peers into $venv"
	python3 -m venv "$venv"
	"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
	echo "$want" >"$stamp"
fi
export BENCH_PYTHON=$venv/bin/python
# The official MCP Python SDK for the SDK series (bench/series/sdk_series.py): the test
# suite's virtualenv has it.
BENCH_SDK_PYTHON="$("$repo/scripts/py-venv.sh")"
export BENCH_SDK_PYTHON

# ---- the image llm-sandbox runs: ours plus `python` and `sleep infinity` ----------------------
llm_image="sandgate-bench-llm-sandbox:${SANDGATE_SANDBOX__IMAGE##*:}"
if ! docker image inspect "$llm_image" >/dev/null 2>&1; then
	log "building $llm_image FROM $SANDGATE_SANDBOX__IMAGE"
	DOCKER_BUILDKIT=0 docker build --quiet --build-arg "BASE=$SANDGATE_SANDBOX__IMAGE" \
		-t "$llm_image" - <"$repo/bench/peers/llm-sandbox.Dockerfile" >/dev/null
fi
export BENCH_LLM_SANDBOX_IMAGE=$llm_image

# ---- the engine's whole CPU -----------------------------------------------------------------
# A cgroup v1 cpuacct group holding the engine's dockerd and containerd: everything they start
# from now on outside the containers (shims, runc, runsc's commands) is counted there, and the
# series reports it as one component (containers have cgroups of their own). Accounting only:
# cpuacct sets no limit. Skipped where cgroup v1's cpuacct is not mounted.
engine_cg=/sys/fs/cgroup/cpuacct/sandgate-engine
dockerd_pid="$(cat "$SANDGATE_CACHE/docker/dockerd.pid" 2>/dev/null || true)"
if [[ -n $dockerd_pid && -w /sys/fs/cgroup/cpuacct/cgroup.procs ]]; then
	mkdir -p "$engine_cg"
	for pid in "$dockerd_pid" $(pgrep -P "$dockerd_pid" -x containerd || true); do
		echo "$pid" >"$engine_cg/cgroup.procs"
	done
	export BENCH_ENGINE_CPUACCT=$engine_cg/cpuacct.usage
else
	log "no cgroup v1 cpuacct for the engine: the series counts dockerd, containerd and shims by process"
fi

# ---- build and run --------------------------------------------------------------------------
mkdir -p "$repo/bench/results"
out="$repo/bench/results/$(date -u +%Y%m%dT%H%M%SZ).json"
log "building (release) and running; results go to $out"
cargo bench --locked -p sandgate --bench mcp -- --out "$out" "$@"
cp "$out" "$repo/bench/results/latest.json"
log "done: $out"
