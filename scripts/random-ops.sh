#!/usr/bin/env bash
# A long run of the random-operation test (tests/test_random_ops.cpp: every codec choice against a
# shadow model; typed errors, strong guarantee, chunk independence, attention against float64).
# CI runs it short (its default iteration count); this builds it alone and runs it long, over
# several seeds. A failure prints the seed and iteration and how to rerun that iteration alone.
#
# Usage: bash scripts/random-ops.sh [--asan] [--iterations N] [--seed S] [--runs R] [--build-dir DIR]
#   --asan         Debug build with AddressSanitizer and UndefinedBehaviorSanitizer (default: Release)
#   --iterations   iterations per run (default 20000: 2-3 minutes in Release, about 40 in ASan)
#   --seed         first seed (default: the current time); run i uses seed + i
#   --runs         number of seeds to run (default 1)
#   --build-dir    build directory (default build/random-ops or build/random-ops-asan)
set -euo pipefail
cd "$(dirname "$0")/.."

asan=0
iterations=20000
seed=$(date +%s)
runs=1
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --asan) asan=1 ;;
    --iterations) iterations=$2; shift ;;
    --seed) seed=$2; shift ;;
    --runs) runs=$2; shift ;;
    --build-dir) dir=$2; shift ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "random-ops: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

bash scripts/install-deps.sh
if [ "$asan" = 1 ]; then
  dir=${dir:-build/random-ops-asan}
  flags=(-DCMAKE_BUILD_TYPE=Debug
         "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer")
else
  dir=${dir:-build/random-ops}
  flags=(-DCMAKE_BUILD_TYPE=Release)
fi
cmake -S . -B "$dir" -G Ninja -DKVQ_BUILD_EXAMPLES=OFF -DKVQ_BUILD_BENCHMARKS=OFF -DKVQ_ENABLE_CUDA=OFF \
  "${flags[@]}" >/dev/null
cmake --build "$dir" --target test_random_ops

failed=0
for ((i = 0; i < runs; ++i)); do
  s=$((seed + i))
  echo "random-ops: seed $s, $iterations iterations"
  if ! KVQ_RANDOM_OPS_SEED=$s KVQ_RANDOM_OPS_ITERATIONS=$iterations "$dir/tests/test_random_ops"; then
    failed=$((failed + 1))
  fi
done
if [ "$failed" -ne 0 ]; then
  echo "random-ops: $failed of $runs runs failed" >&2
  exit 1
fi
echo "random-ops: $runs runs passed"
