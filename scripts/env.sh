# Shared by the scripts: where the cache lives and where cargo builds.
# Sourced, not run.
if [[ -z ${SANDGATE_CACHE:-} ]]; then
	if ((EUID == 0)); then
		SANDGATE_CACHE=/var/cache/sandgate
	else
		SANDGATE_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/sandgate
	fi
fi
export SANDGATE_CACHE
# Builds live outside the clone so a fresh clone (CI) reuses earlier builds on the same machine.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$SANDGATE_CACHE/target}
