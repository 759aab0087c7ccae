#!/usr/bin/env bash
# The test command: sets up (scripts/setup.sh), starts PostgreSQL and Redis when needed, then lint, types
# and the whole test suite. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k ingest`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
# Prometheus and promtool for tests/metrics (Debian's package). The tests start their own server on a
# free loopback port; the package's own service is kept from starting (policy-rc.d) or stopped.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  policy_added=""
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; policy_added=1; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  [ -z "$policy_added" ] || rm -f /usr/sbin/policy-rc.d
  service prometheus stop >/dev/null 2>&1 || true
fi
# The dashboard's browser tests (tests/web) drive Debian's Chromium.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
