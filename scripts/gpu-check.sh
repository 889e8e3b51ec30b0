#!/usr/bin/env bash
# Runs kvq's CUDA tests and benchmarks on a machine with an NVIDIA GPU, in one go: configures a fresh
# build (KVQ_ENABLE_CUDA=ON, the GPU's own architecture), builds only the CUDA test and benchmark
# programs, runs `ctest -L cuda`, runs the CUDA benchmarks briefly and prints their summary.
# Exits non-zero when a test fails. Usage: bash scripts/gpu-check.sh [build-dir]
#   KVQ_GPU_CHECK_MIN_TIME  --benchmark_min_time in seconds (default 0.05)
#   KVQ_GPU_CHECK_FILTER    --benchmark_filter (default: every CUDA benchmark)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
dir=${1:-build/gpu-check}
jobs=$(nproc)
min_time=${KVQ_GPU_CHECK_MIN_TIME:-0.05}
filter=${KVQ_GPU_CHECK_FILTER:-cuda/}

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
else
  echo "gpu-check: nvidia-smi not found; the CUDA tests will report themselves as skipped without a GPU"
fi
bash scripts/install-deps.sh || echo "gpu-check: could not install missing packages; trying with what is there"

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
configure() {
  cmake -S . -B "$dir" "${generator[@]}" --fresh -DCMAKE_BUILD_TYPE=Release -DKVQ_ENABLE_CUDA=ON \
    -DKVQ_CUDA_ARCHITECTURES="$1" -DKVQ_BUILD_TESTS=ON -DKVQ_BUILD_BENCHMARKS=ON -DKVQ_BUILD_EXAMPLES=OFF \
    -DKVQ_WERROR=ON
}
echo "=== [configure] CUDA architecture: native (fallback 90)"
configure native || configure 90

echo "=== [build] test_cuda_device kvq_bench_cuda with $jobs jobs"
build_start=$SECONDS
cmake --build "$dir" --target test_cuda_device kvq_bench_cuda -j "$jobs"
build_time=$((SECONDS - build_start))

echo "=== [test] ctest -L cuda"
test_rc=0
ctest --test-dir "$dir" -L cuda --output-on-failure -j 4 || test_rc=$?

echo "=== [bench] kvq_bench_cuda --benchmark_min_time=$min_time"
bench_rc=0
"$dir/bench/cuda/kvq_bench_cuda" --benchmark_min_time="$min_time" --benchmark_filter="$filter" \
  --benchmark_out="$dir/bench_cuda.json" --benchmark_out_format=json || bench_rc=$?

echo
echo "=== gpu-check: build ${build_time}s, total $((SECONDS - start))s; tests $([ $test_rc -eq 0 ] && echo passed || echo FAILED);" \
  "benchmarks $([ $bench_rc -eq 0 ] && echo ran || echo FAILED) (JSON: $dir/bench_cuda.json)"
[ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ]
