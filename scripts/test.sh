#!/usr/bin/env bash
# Runs kvq's tests: installs missing build dependencies, then configures, builds and tests the release preset
# (-march=native, warnings as errors, slow tests included). Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

cmake --preset release --fresh
cmake --build --preset release
ctest --preset release --output-on-failure -j "${CTEST_PARALLEL_LEVEL:-2}"
