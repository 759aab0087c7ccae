#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv holding torch (CPU), the agent (`stepwatch`),
# the collector (`stepwatch-server`) and the test tools, all at pinned versions. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "stepwatch setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# torch first and pinned: an unpinned torch (or one pulled in by another package) downloads a multi-GB CUDA
# build; torch==2.13.0 is the CPU wheel this project is tested with.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "stepwatch setup: installing torch==2.13.0"
  .venv/bin/pip install -q torch==2.13.0
fi
echo "stepwatch setup: installing stepwatch (agent), stepwatch-server (collector) and test tools"
.venv/bin/pip install -q -r requirements/dev.txt -e agent -e service
# The built-in dashboard: web/ (pinned by package-lock.json) built into the collector's package.
if command -v npm >/dev/null 2>&1; then
  echo "stepwatch setup: building the dashboard (web/: npm ci, npm run build)"
  (cd web && npm ci --no-audit --no-fund --loglevel=error && npm run build --silent)
else
  echo "stepwatch setup: npm not found: the dashboard is not built (install Node.js 20.19+ and run setup again)" >&2
fi
echo "stepwatch setup: done (.venv/bin/stepwatch-server)"
