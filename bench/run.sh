#!/usr/bin/env bash
# Runs kvq's CPU benchmarks and prints the summary: encode/decode GB/s as % of memcpy, for decode
# attention the time, this machine's roofline (measured in the same run), % of roofline and speed-up
# over the f16 cache, for multi-token attention GB/s as % of memcpy, GFLOP/s as % of the f32 peak
# and the time against f16 and n_q = 1, and save/load GB/s as % of memcpy, with the target checks.
# Rewrites bench/README.md with the results.
#
# Usage: bash bench/run.sh [--json FILE] [--quick]
#   --json FILE  also write the summary as JSON (schema in bench/README.md)
#   --quick      a short check of the script: contexts up to 4k, one short repetition, a small save/load
#                working set; README untouched
# Build directory: $KVQ_BUILD_DIR, default build/bench (configured Release, KVQ_SIMD=native). The
# benchmarks take about 11 minutes on 2 cores (the rotated-codec cells add about 40 s, the append suite about 2 minutes);
# building them comes on top.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

json_out=""
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --json)
      [ $# -ge 2 ] || { echo "run.sh: --json needs a file name" >&2; exit 2; }
      json_out="$2"
      shift 2
      ;;
    --quick)
      quick=1
      shift
      ;;
    -h | --help)
      sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "run.sh: unknown argument '$1' (usage: bash bench/run.sh [--json FILE] [--quick])" >&2
      exit 2
      ;;
  esac
done
if [ -n "$json_out" ]; then
  case "$json_out" in /*) ;; *) json_out="$PWD/$json_out" ;; esac
fi

build_dir="${KVQ_BUILD_DIR:-$root/build/bench}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  echo "run.sh: configuring $build_dir"
  cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVQ_SIMD=native \
    -DKVQ_BUILD_BENCHMARKS=ON -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_EXAMPLES=OFF -DKVQ_INSTALL=OFF >/dev/null
fi
build_start=$SECONDS
cmake --build "$build_dir" --target kvq_bench_codecs kvq_bench_attention kvq_bench_persist kvq_bench_multi_query \
  kvq_bench_append kvq_bench_summary >/dev/null
echo "run.sh: built in $((SECONDS - build_start)) s ($build_dir)"

bin="$build_dir/bench"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Medians of 3 repetitions; --benchmark_min_time is plain seconds (Google Benchmark 1.7 rejects "0.2s").
common=(--benchmark_repetitions=3 --benchmark_report_aggregates_only=true)
codecs_args=(--benchmark_min_time=0.1)
attention_args=(--benchmark_min_time=0.2)
persist_args=(--benchmark_min_time=0.2)
append_args=(--benchmark_min_time=0.1)
# The multi-token suite runs its default grid once (about 3 minutes): its cells of 16 GFLOP and more
# are one call of 0.5-20 s, the others average the calls of 0.1 s.
multi_query_args=(--benchmark_min_time=0.1 --benchmark_repetitions=1)
if [ "$quick" -eq 1 ]; then
  common=(--benchmark_repetitions=1)
  codecs_args=(--benchmark_min_time=0.01)
  attention_args=(--benchmark_min_time=0.01 "--benchmark_filter=machine/|/ctx:(512|4096)/")
  persist_args=(--benchmark_min_time=0.01 --kvq_working_set_mib=1)
  multi_query_args=(--benchmark_min_time=0.01 --kvq_working_set_mib=1 "--benchmark_filter=machine/|/ctx:4096/nq:(1|8)/")
  append_args=(--benchmark_min_time=0.01 "--benchmark_filter=/(f16|q4_0|kivi4)/f32/")
fi

# run_suite NAME ARGS...: one suite, its console output in a log (shown when it fails), JSON in $tmp.
run_suite() {
  local name=$1
  shift
  local start=$SECONDS
  echo "run.sh: running the $name suite ..."
  if ! "$bin/kvq_bench_$name" "${common[@]}" "$@" --benchmark_out="$tmp/$name.json" \
    --benchmark_out_format=json >"$tmp/$name.log" 2>&1; then
    cat "$tmp/$name.log" >&2
    echo "run.sh: the $name suite failed" >&2
    exit 1
  fi
  echo "run.sh: $name suite done in $((SECONDS - start)) s"
}

start=$SECONDS
run_suite codecs "${codecs_args[@]}"
run_suite attention "${attention_args[@]}"
run_suite multi_query "${multi_query_args[@]}"
run_suite persist "${persist_args[@]}"
run_suite append "${append_args[@]}"

summary=("$bin/kvq_bench_summary" --codecs "$tmp/codecs.json" --attention "$tmp/attention.json"
         --persist "$tmp/persist.json" --multi-query "$tmp/multi_query.json" --append "$tmp/append.json"
         --wall-seconds "$((SECONDS - start))")
[ -n "$json_out" ] && summary+=(--json "$json_out")
[ "$quick" -eq 0 ] && summary+=(--readme "$root/bench/README.md")
echo
"${summary[@]}"
echo
echo "run.sh: benchmarks and summary took $((SECONDS - start)) s (build excluded)"
[ -n "$json_out" ] && echo "run.sh: wrote $json_out"
[ "$quick" -eq 0 ] && echo "run.sh: rewrote bench/README.md"
exit 0
