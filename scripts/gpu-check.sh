#!/usr/bin/env bash
# Runs kvq's CUDA tests and benchmarks on a machine with an NVIDIA GPU, in one go: configures a fresh
# build (KVQ_ENABLE_CUDA=ON, the GPU's own architecture), builds only the CUDA test and benchmark
# programs, runs every `cuda` test tag, runs the CUDA benchmarks briefly and prints their summary.
# Exits non-zero when a test fails. Usage: bash scripts/gpu-check.sh [build-dir]
#   KVQ_GPU_CHECK_PREBUILT  a build dir whose test_cuda_device and kvq_bench_cuda were built elsewhere
#                           (e.g. `cmake --preset ... -DKVQ_CUDA_ARCHITECTURES=90` on a machine with nvcc
#                           but no GPU): nothing is configured, installed or built; shared libraries in
#                           <dir>/lib are found first (libbenchmark, libcudart where the GPU machine lacks them)
#   KVQ_GPU_CHECK_SANITIZE  compute-sanitizer tools to run over the tests afterwards, e.g. "memcheck racecheck"
#                           (each over KVQ_GPU_CHECK_SANITIZE_TAGS, default "[codecs],[multi_token]")
#   KVQ_GPU_CHECK_MIN_TIME  --benchmark_min_time in seconds (default 0.05)
#   KVQ_GPU_CHECK_FILTER    --benchmark_filter (default: every CUDA benchmark)
#   KVQ_GPU_CHECK_OUT       folder for the logs and the benchmark JSON (default: the build dir)
#   KVQ_GPU_CHECK_TEST_TIMEOUT  seconds for each test tag (default 300)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
prebuilt=${KVQ_GPU_CHECK_PREBUILT:-}
dir=${prebuilt:-${1:-build/gpu-check}}
out=${KVQ_GPU_CHECK_OUT:-$dir}
mkdir -p "$out"
jobs=$(nproc)
min_time=${KVQ_GPU_CHECK_MIN_TIME:-0.05}
filter=${KVQ_GPU_CHECK_FILTER:-cuda/}
tags=(codecs kivi fp8 gqa special batched paged persist errors multi_token rotated centered)

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
else
  echo "gpu-check: nvidia-smi not found; the CUDA tests will report themselves as skipped without a GPU"
fi

build_time=0
if [ -n "$prebuilt" ]; then
  echo "=== [prebuilt] $dir (no configure, no build)"
  [ -d "$dir/lib" ] && export LD_LIBRARY_PATH="$(cd "$dir/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
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
fi
test_bin=$dir/tests/cuda/test_cuda_device
bench_bin=$dir/bench/cuda/kvq_bench_cuda

# Each tag as its own process, as ctest registers them (exit 4: no CUDA device, reported as skipped).
echo "=== [test] test_cuda_device, one process per tag (log: $out/tests.log)"
: >"$out/tests.log"
test_rc=0
failed=()
for tag in "${tags[@]}"; do
  t0=$SECONDS
  rc=0
  log=$(mktemp)
  timeout "${KVQ_GPU_CHECK_TEST_TIMEOUT:-300}" "$test_bin" "[$tag]" --durations yes >"$log" 2>&1 || rc=$?
  { echo "=== [$tag] rc=$rc"; cat "$log"; } >>"$out/tests.log"
  summary=$(grep -E "test cases|All tests passed" "$log" | tail -1 || true)
  echo "  [$tag] rc=$rc $((SECONDS - t0))s ${summary}"
  if [ $rc -ne 0 ]; then
    test_rc=1
    failed+=("$tag")
    tail -40 "$log"
  fi
  rm -f "$log"
done

echo "=== [bench] kvq_bench_cuda --benchmark_min_time=$min_time --benchmark_filter=$filter"
bench_rc=0
"$bench_bin" --benchmark_min_time="$min_time" --benchmark_filter="$filter" \
  --benchmark_out="$out/bench_cuda.json" --benchmark_out_format=json 2>&1 | tee "$out/bench_cuda.log" ||
  bench_rc=$?

san_rc=0
for tool in ${KVQ_GPU_CHECK_SANITIZE:-}; do
  echo "=== [compute-sanitizer --tool $tool] ${KVQ_GPU_CHECK_SANITIZE_TAGS:-[codecs],[multi_token]}"
  rc=0
  timeout "${KVQ_GPU_CHECK_TEST_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$test_bin" "${KVQ_GPU_CHECK_SANITIZE_TAGS:-[codecs],[multi_token]}" \
    >"$out/sanitize_$tool.log" 2>&1 || rc=$?
  grep -E "ERROR SUMMARY|test cases|All tests passed" "$out/sanitize_$tool.log" | tail -3 || true
  [ $rc -ne 0 ] && { san_rc=1; tail -30 "$out/sanitize_$tool.log"; }
done

echo
echo "=== gpu-check: build ${build_time}s, total $((SECONDS - start))s; tests $([ $test_rc -eq 0 ] && echo passed || echo "FAILED (${failed[*]})");" \
  "benchmarks $([ $bench_rc -eq 0 ] && echo ran || echo FAILED) (JSON: $out/bench_cuda.json)" \
  "${KVQ_GPU_CHECK_SANITIZE:+; sanitizer $([ $san_rc -eq 0 ] && echo clean || echo FOUND ERRORS)}"
[ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [ $san_rc -eq 0 ]
