#!/usr/bin/env bash
# Brings the local stack up and runs `sandgate serve` on it (Ctrl-C stops the gateway; the stack
# keeps running — `scripts/stack.sh down` stops it). Extra arguments go to `sandgate serve`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
# shellcheck source=scripts/env.sh
source "$repo/scripts/env.sh"

"$repo/scripts/stack.sh" up >/dev/null
# shellcheck disable=SC1091
source "$SANDGATE_CACHE/stack.env"

printf '[serve] building sandgate (release)\n' >&2
cargo build --release --locked -p sandgate
exec "$CARGO_TARGET_DIR/release/sandgate" serve "$@"
