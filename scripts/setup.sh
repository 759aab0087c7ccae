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
echo "stepwatch setup: done (.venv/bin/stepwatch-server)"
