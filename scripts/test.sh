#!/usr/bin/env bash
# Runs kvq's tests: installs missing build dependencies, then configures, builds and tests the release preset
# (-march=native, warnings as errors, slow tests included). Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

# Without a GPU (CI), the CUDA tests and benchmarks are compiled for one architecture only.
cuda_args=()
command -v nvidia-smi >/dev/null 2>&1 || cuda_args=(-DKVQ_CUDA_ARCHITECTURES=80)
cmake --preset release --fresh "${cuda_args[@]}"
cmake --build --preset release
ctest --preset release --output-on-failure -j "${CTEST_PARALLEL_LEVEL:-2}"
