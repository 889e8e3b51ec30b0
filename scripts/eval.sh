#!/usr/bin/env bash
# Runs kvq's main job: builds kvq-eval (installing missing Debian packages first) and runs it on its built-in
# synthetic workload, or with the arguments given (e.g. --model/--tokenizer/--text, --json FILE, --svg FILE).
# Usage: bash scripts/eval.sh [kvq-eval arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

if [ ! -f build/release/CMakeCache.txt ]; then
  cmake --preset release >/dev/null
fi
cmake --build --preset release --target kvq-eval >/dev/null
exec build/release/tools/kvq_eval/kvq-eval "$@"
