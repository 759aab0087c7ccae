#!/usr/bin/env bash
# examples/nanogpt.py on NPROC processes of this machine with torchrun, each attached to stepwatch.
# The collector: STEPWATCH_URL (default http://127.0.0.1:8000, e.g. `stepwatch-server demo` or `serve`).
#   bash examples/torchrun.sh                      # 2 processes, 200 steps, run "nanogpt-torchrun"
#   NPROC=8 STEPS=1000 RUN=my-run bash examples/torchrun.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# The run name through the environment (torchrun would take a --run after the script for its own --run-path).
export STEPWATCH_RUN=${RUN:-nanogpt-torchrun}
exec torchrun --standalone --nproc_per_node "${NPROC:-2}" examples/nanogpt.py --steps "${STEPS:-200}"
