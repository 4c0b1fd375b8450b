#!/usr/bin/env bash
# Install Debian's chromium for the Playwright browser tests (Playwright's own browser
# download cannot work here; the tests pass executable_path=/usr/bin/chromium).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
chromium --version
