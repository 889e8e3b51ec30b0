#!/usr/bin/env bash
# Fuzzes kvq's loader (fuzz/fuzz_load.cpp): builds the libFuzzer target with clang and
# AddressSanitizer + UndefinedBehaviorSanitizer, runs the seed corpus (fuzz/corpus) and the
# committed images (tests/data/persist) once as a regression, then fuzzes for SECONDS (default 60)
# from them (new inputs go to build/fuzz/corpus, a copy of the seeds). Crashing inputs land in
# build/fuzz/artifacts: add each to fuzz/corpus as regression-<what>.kvq together with its fix.
#   usage: scripts/fuzz.sh [SECONDS] [extra libFuzzer flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift $(($# > 0 ? 1 : 0))
out=build/fuzz
mkdir -p "$out/corpus" "$out/artifacts"
clang++ -std=c++20 -O2 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Iinclude \
  fuzz/fuzz_load.cpp -o "$out/fuzz_load"
cp -f fuzz/corpus/* "$out/corpus/"
echo "=== regression: the corpus once"
"$out/fuzz_load" -runs=0 fuzz/corpus tests/data/persist
echo "=== fuzzing for ${seconds}s"
"$out/fuzz_load" "$out/corpus" tests/data/persist -max_total_time="$seconds" -artifact_prefix="$out/artifacts/" \
  -print_final_stats=1 "$@"
