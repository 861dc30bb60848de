#!/usr/bin/env bash
# Makes sure Debian's Chromium and its WebDriver are installed: the OAuth end-to-end test drives
# a real headless browser through login and consent. Idempotent; needs root (CI runs as root).
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-chromium: chromium/chromedriver missing; run as root: apt-get install -y chromium chromium-driver" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
command -v chromium >/dev/null && command -v chromedriver >/dev/null
echo "ensure-chromium: installed $(chromium --version 2>/dev/null | head -1)" >&2
