#!/usr/bin/env bash
# The Redis tests start their own redis-server processes on free loopback ports; this makes sure
# the binary exists (Debian's package), installing it when missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q redis-server
