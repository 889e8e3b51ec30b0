// kvq benchmark: multi-token attention through the public entry kvq::attention: n_q query tokens,
// causal over the last n_q tokens of a layer (a prefill chunk, a speculative verification), per
// codec, shape, context, n_q and thread count; and the machine figures of its roofline measured in
// the same binary: memcpy and read-only bandwidth and the f32 FMA and int8 dot-product peaks, each
// with 1 and 2 threads.
//
// Grid: n_q 1, 4, 8, 16, 512; contexts 4k and 16k; gqa = 32 query / 8 KV heads and mha = 32 / 32;
// head_dim 128; codecs f32 and f16 (the baselines), q4_0, q8_0, int8, fp8_e4m3, kivi2, kivi4 (KIVI
// at G = 32, R = 128); default options (f32 query, causal mask, first_pos = size − n_q); 1 and 2
// threads. The default run leaves out n_q = 512 at 16k except gqa on 1 thread (2-3 minutes of
// CPU time on this project's 2-core machine); --kvq_full runs the whole grid (the 16k n_q = 512
// cells are about 135 GFLOP each) and adds q4_0, q8_0 and int8 with query_precision::q8_0 as
// <codec>+q8q (integer q·K).
// A cell of at least 16 GFLOP runs one call per repetition (Iterations(1)); the others run for
// --benchmark_min_time, 0.1 s unless given.
//
// Working set: as kvq_bench_attention: each (codec, shape, context) builds one cache of L layers of
// `context` tokens (keys N(0,1) with four outlier channels ×10, values N(0,1)), L chosen so the K
// and V bytes of all layers are at least twice the last-level cache (--kvq_working_set_mib=N
// overrides that floor); iteration i attends layer i mod L. The cache is built once outside the
// timing, shared by the runs of that (codec, shape, context), freed before the next is built.
//
// Counters per call: kv_bytes (K and V bytes stored for the attended range, which the causal
// queries over the last n_q tokens make the whole layer: codec bytes with their scales, KIVI's f16
// residual rows as f16; read once, as in kvq_bench_attention), attended (query-token × token pairs:
// n_q · context − n_q (n_q − 1) / 2, summed exactly over the causal rows), flops (4 · q_heads ·
// head_dim · attended: a multiply and an add per element of q·K and of p·V), qk_macs and pv_macs
// (q_heads · head_dim · attended each), n_q, qk_int8 (present, = 1, for the +q8q rows of integer
// keys), layers and working_set_bytes; bytes_per_second (kv_bytes per second) and flops_per_second.
// Machine rows, run first and again last (".../again"): machine/read (bytes_per_second of a
// read-only pass) and machine/memcpy (bytes_per_second of bytes read + written, as kvq_bench_codecs
// counts them), both over a buffer of at least 4× the last-level cache, and machine/fma and
// machine/int8dot (macs_per_second).
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "attention_layers.hpp"
#include "bench_common.hpp"
#include "machine_peaks.hpp"

namespace kvq_bench {
namespace {

constexpr shape_spec shapes[] = {{"gqa", 32, 8}, {"mha", 32, 32}};
constexpr int contexts[] = {4096, 16384};
constexpr int query_counts[] = {1, 4, 8, 16, 512};
constexpr int thread_counts[] = {1, 2};

/// FLOPs from which a cell runs a single call per repetition.
constexpr double one_call_flops = 16e9;

/// Whether --kvq_full asked for the whole grid.
bool g_full = false;

/// Whether the default run (not only --kvq_full) measures this cell: all but n_q = 512 at 16k,
/// which only gqa on 1 thread keeps.
auto in_default_grid(shape_spec const& s, int context, int n_q, int threads) -> bool {
  if (n_q < 512 || context < 16384) return true;
  return std::string_view(s.name) == "gqa" && threads == 1;
}

/// Query-token × token pairs of n_q causal queries over the last n_q of `context` tokens: query i
/// (position context − n_q + i) attends context − n_q + i + 1 tokens.
auto causal_pairs(std::int64_t n_q, std::int64_t context) -> double {
  return static_cast<double>(n_q * context - n_q * (n_q - 1) / 2);
}

/// The data of this suite's layers (attention_layers.hpp).
constexpr layer_data suite_data = {31, 47, 433};

/// One cell: kvq::attention of n_q query tokens, (n_q, q_heads, head_dim), over the last n_q
/// tokens of layer i mod L.
template <class Choice>
void bm_multi_query(benchmark::State& state, std::string const& key, shape_spec s, int context, int n_q, int threads,
                    kvq::query_precision precision, bool int8_keys) {
  auto& set = acquire_layers<Choice>(key, s, context, suite_data);
  int const layers = set.cache.shape().layers;
  std::vector<float> q(static_cast<std::size_t>(n_q) * static_cast<std::size_t>(s.q_heads) * head_dim);
  std::vector<float> out(q.size());
  fill_normal(q.data(), q.size(), 101 + static_cast<std::uint64_t>(n_q));
  kvq::attention_options opt;
  opt.query = precision;
  int layer = 0;
  for (auto _ : state) {
    kvq::attention(set.cache, layer, q.data(), n_q, s.q_heads, out.data(), opt, threads);
    float* result = out.data();
    benchmark::DoNotOptimize(result);
    benchmark::ClobberMemory();
    if (++layer == layers) layer = 0;
  }
  double const pairs = causal_pairs(n_q, context);
  double const macs = static_cast<double>(s.q_heads) * head_dim * pairs;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(set.kv_bytes));
  state.counters["kv_bytes"] = static_cast<double>(set.kv_bytes);
  state.counters["attended"] = pairs;
  state.counters["flops"] = 4.0 * macs;
  state.counters["flops_per_second"] = benchmark::Counter(4.0 * macs, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["qk_macs"] = macs;
  state.counters["pv_macs"] = macs;
  state.counters["n_q"] = n_q;
  // Set only when true: Google Benchmark writes the variation of an all-zero counter as a bare NaN.
  if (int8_keys && precision == kvq::query_precision::q8_0) state.counters["qk_int8"] = 1.0;
  state.counters["layers"] = layers;
  state.counters["working_set_bytes"] = static_cast<double>(set.kv_bytes) * layers;
}

/// Registers multi_query/<name>[+q8q]/<shape>/ctx:<context>/nq:<n_q>/threads:<t> for the cells of
/// the grid; the runs sharing one cache are registered next to each other.
template <class Choice>
void register_codec(std::string const& name, bool int8_keys) {
  for (auto const& s : shapes) {
    for (int context : contexts) {
      std::string const key = name + "/" + s.name + "/" + std::to_string(context);
      for (auto precision : {kvq::query_precision::f32, kvq::query_precision::q8_0}) {
        if (precision == kvq::query_precision::q8_0 && !(int8_keys && g_full)) continue;
        std::string const label = precision == kvq::query_precision::q8_0 ? name + "+q8q" : name;
        for (int n_q : query_counts) {
          for (int threads : thread_counts) {
            if (!g_full && !in_default_grid(s, context, n_q, threads)) continue;
            std::string const bench = "multi_query/" + label + "/" + s.name + "/ctx:" + std::to_string(context) +
                                      "/nq:" + std::to_string(n_q) + "/threads:" + std::to_string(threads);
            auto* b = benchmark::RegisterBenchmark(bench.c_str(), [=](benchmark::State& st) {
              bm_multi_query<Choice>(st, key, s, context, n_q, threads, precision, int8_keys);
            });
            b->UseRealTime()->Unit(benchmark::kMillisecond);
            if (4.0 * s.q_heads * head_dim * causal_pairs(n_q, context) >= one_call_flops) b->Iterations(1);
          }
        }
      }
    }
  }
}

/// The buffer of the machine bandwidths: at least four times the last-level cache, so that its
/// read-only pass and the copy of its first half into its second are far beyond the caches.
auto machine_buffer() -> buffer& {
  static buffer b(std::max<std::size_t>(512 * mib, 4 * llc_bytes()) / 8192 * 8192);
  return b;
}

/// Each thread reads its 1/threads of the buffer once.
void bm_read(benchmark::State& state, int threads) {
  auto& b = machine_buffer();
  std::size_t const chunk = b.size() / static_cast<std::size_t>(threads) / 4096 * 4096;
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads));
  for (auto _ : state) {
    run_threads(threads, [&](int t) {
      sums[static_cast<std::size_t>(t)] = read_pass(b.data() + static_cast<std::size_t>(t) * chunk, chunk);
    });
    benchmark::DoNotOptimize(sums.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(chunk * static_cast<std::size_t>(threads)));
}

/// Each thread copies its 1/threads of the buffer's first half into its second half; the bytes
/// counted are those read and written (twice the bytes copied).
void bm_memcpy(benchmark::State& state, int threads) {
  auto& b = machine_buffer();
  std::size_t const half = b.size() / 2;
  std::size_t const chunk = half / static_cast<std::size_t>(threads) / 4096 * 4096;
  for (auto _ : state) {
    run_threads(threads, [&](int t) {
      std::size_t const at = static_cast<std::size_t>(t) * chunk;
      std::memcpy(b.data() + half + at, b.data() + at, chunk);
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(2 * chunk * static_cast<std::size_t>(threads)));
}

template <peak_result (*Loop)(std::int64_t)>
void bm_peak(benchmark::State& state, int threads) {
  constexpr std::int64_t rounds = std::int64_t{1} << 20;
  std::vector<peak_result> results(static_cast<std::size_t>(threads));
  double macs = 0;
  for (auto _ : state) {
    run_threads(threads, [&](int t) { results[static_cast<std::size_t>(t)] = Loop(rounds); });
    for (auto const& r : results) macs += r.macs;
    benchmark::DoNotOptimize(results.data());
    benchmark::ClobberMemory();
  }
  state.counters["macs_per_second"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
}

/// Registers machine/read, machine/memcpy, machine/fma and machine/int8dot for 1 and 2 threads,
/// names ending in `suffix`.
void register_machine(std::string const& suffix) {
  using fn = void (*)(benchmark::State&, int);
  struct figure {
    char const* name;
    fn run;
  };
  constexpr figure figures[] = {
      {"read", bm_read}, {"memcpy", bm_memcpy}, {"fma", bm_peak<fma_peak_loop>}, {"int8dot", bm_peak<int8_peak_loop>}};
  for (int threads : thread_counts) {
    for (auto const& f : figures) {
      std::string const name = std::string("machine/") + f.name + "/threads:" + std::to_string(threads) + suffix;
      benchmark::RegisterBenchmark(name.c_str(), [run = f.run, threads](benchmark::State& s) { run(s, threads); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

/// The machine figures first and again last (the summary keeps the better of the two, as other
/// load on the machine can only lower them), the attention cells in between.
void register_all() {
  register_machine("");
  register_codec<kvq::f32_codec>("f32", false);
  register_codec<kvq::f16_codec>("f16", false);
  register_codec<kvq::q4_0>("q4_0", true);
  register_codec<kvq::q8_0>("q8_0", true);
  register_codec<kvq::int8_sym>("int8", true);
  register_codec<kvq::fp8_e4m3>("fp8_e4m3", false);
  register_codec<kvq::kivi<2, 32>>("kivi2", false);
  register_codec<kvq::kivi<4, 32>>("kivi4", false);
  register_machine("/again");
}

/// Copies argv[0, argc) into `args` without --kvq_full (Google Benchmark rejects flags it does not
/// know), adding --benchmark_min_time=0.1 when no minimum time is given, and a null at the end;
/// returns whether --kvq_full was there.
auto take_grid_flags(int argc, char** argv, std::vector<char*>& args) -> bool {
  static char min_time[] = "--benchmark_min_time=0.1";
  bool full = false, has_min_time = false;
  args.assign(argv, argv + 1);
  for (int i = 1; i < argc; ++i) {
    std::string_view const arg = argv[i];
    if (arg == "--kvq_full") {
      full = true;
      continue;
    }
    has_min_time = has_min_time || arg.starts_with("--benchmark_min_time");
    args.push_back(argv[i]);
  }
  if (!has_min_time) args.push_back(min_time);
  args.push_back(nullptr);
  return full;
}

}  // namespace
}  // namespace kvq_bench

int main(int argc, char** argv) {
  kvq_bench::g_working_set = kvq_bench::take_working_set_flag(argc, argv);
  std::vector<char*> args;  // argv without --kvq_full, with a minimum time, null-terminated
  kvq_bench::g_full = kvq_bench::take_grid_flags(argc, argv, args);
  argc = static_cast<int>(args.size()) - 1;
  benchmark::Initialize(&argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(argc, args.data())) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "multi_query");
  benchmark::AddCustomContext("grid", kvq_bench::g_full ? "full" : "default");
  benchmark::AddCustomContext("working_set_min_bytes", std::to_string(kvq_bench::g_working_set));
  benchmark::AddCustomContext("fma_kind", kvq_bench::fma_peak_kind());
  benchmark::AddCustomContext("int8_kind", kvq_bench::int8_peak_kind());
  kvq_bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
