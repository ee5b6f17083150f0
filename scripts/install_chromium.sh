#!/bin/sh
# Debian's Chromium for the dashboard's browser test (tests/integration/test_dashboard.py) and
# `make dashboard-screenshots`; Playwright drives it (its own browser download is not used).
# Idempotent: returns at once when a chromium is already on PATH (or at $FEDCLINIC_CHROMIUM).
# Installing needs root and Debian's package archive (CI: a fresh Debian machine, as root).
set -eu
if [ -n "${FEDCLINIC_CHROMIUM:-}" ] && [ -x "${FEDCLINIC_CHROMIUM}" ]; then exit 0; fi
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
    echo "Chromium is missing: install Debian's package as root (apt-get install chromium) or set FEDCLINIC_CHROMIUM" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
command -v chromium >/dev/null
