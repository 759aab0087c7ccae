#!/usr/bin/env bash
# The test command: sets up (scripts/setup.sh), starts PostgreSQL and Redis when needed, then lint, types
# and the whole test suite. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k ingest`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/services.sh
# The dashboard's browser tests (tests/web) drive Debian's Chromium.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
