// kvq benchmark: decode attention of one query token per codec through the public entries
// (kvq::decode_attention for 1 thread, kvq::decode_attention_parallel for 2), and the machine
// figures of its roofline measured in the same binary: read-only bandwidth and the f32 FMA and
// int8 dot-product peaks, each with 1 and 2 threads.
//
// Shapes: gqa = 32 query / 8 KV heads, mha = 32 / 32; head_dim 128; contexts 512, 4k, 16k, 32k;
// KIVI at G = 32, R = 128. Every codec runs with the default options (f32 query); q8_0, q4_0 and
// int8 also run with query_precision::q8_0 (integer q·K), named <codec>+q8q, with
// probability_precision::i8 (integer P·V), named <codec>+i8p, and with both, <codec>+q8q+i8p. The FP4 codecs
// mxfp4 and nvfp4 (FORMATS.md §7) and the rotated codecs rot-q4_0, tq4, tq3 and tq2 (§6) run one
// cell each, gqa at 4k on 1 and 2 threads, to set against f16 and q4_0 there.
//
// Working set: each (codec, shape, context) builds one cache of L layers holding N(0,1) keys (four
// outlier channels ×10) and values, L chosen so the K and V bytes attended over all layers are at
// least twice the last-level cache (--kvq_working_set_mib=N overrides that floor, for smoke tests);
// iteration i attends layer i mod L, so no result comes from cache. The cache is built once outside
// the timing, shared by the runs of that (codec, shape, context), and freed before the next is built.
//
// Counters per call: kv_bytes (K and V bytes stored for the attended tokens: codec bytes with their
// scales, KIVI's f16 residual rows as f16), qk_macs and pv_macs (q_heads × context × head_dim
// multiply-adds each), qk_int8 (present, = 1, when q·K may run as int8 dot products: integer keys
// with a q8_0 query), pv_int8 (likewise, when P·V runs on integers), layers and working_set_bytes. Machine rows, run
// first and again last
// (".../again"): machine/read (bytes_per_second over a buffer far beyond the caches), machine/fma
// and machine/int8dot (macs_per_second).
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <span>
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
constexpr int contexts[] = {512, 4096, 16384, 32768};
constexpr int thread_counts[] = {1, 2};

/// The data of this suite's layers (attention_layers.hpp).
constexpr layer_data suite_data = {11, 23, 389};

template <class Choice>
void bm_attention(benchmark::State& state, std::string const& key, shape_spec s, int context, int threads,
                  kvq::attention_options opt, bool int8_keys) {
  auto& set = acquire_layers<Choice>(key, s, context, suite_data);
  int const layers = set.cache.shape().layers;
  std::vector<float> q(static_cast<std::size_t>(s.q_heads) * head_dim);
  std::vector<float> out(q.size());
  fill_normal(q.data(), q.size(), 99);
  int layer = 0;
  for (auto _ : state) {
    if (threads == 1) {
      kvq::decode_attention(set.cache, layer, q.data(), s.q_heads, out.data(), opt);
    } else {
      kvq::decode_attention_parallel(set.cache, layer, q.data(), s.q_heads, out.data(), threads, opt);
    }
    float* result = out.data();
    benchmark::DoNotOptimize(result);
    benchmark::ClobberMemory();
    if (++layer == layers) layer = 0;
  }
  double const macs = static_cast<double>(s.q_heads) * context * head_dim;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(set.kv_bytes));
  state.counters["kv_bytes"] = static_cast<double>(set.kv_bytes);
  state.counters["qk_macs"] = macs;
  state.counters["pv_macs"] = macs;
  // Set only when true: Google Benchmark writes the variation of an all-zero counter as a bare NaN.
  if (int8_keys && opt.query == kvq::query_precision::q8_0) state.counters["qk_int8"] = 1.0;
  if (int8_keys && opt.probabilities == kvq::probability_precision::i8) state.counters["pv_int8"] = 1.0;
  state.counters["layers"] = layers;
  state.counters["working_set_bytes"] = static_cast<double>(set.kv_bytes) * layers;
}

/// Registers attention/<name>[+q8q]/<shape>/ctx:<context>/threads:<t> for the given shapes and
/// contexts (default: every one) and every thread count; the runs sharing one cache are registered
/// next to each other.
template <class Choice>
void register_codec(std::string const& name, bool int8_keys, std::span<shape_spec const> shape_list = shapes,
                    std::span<int const> context_list = contexts) {
  for (auto const& s : shape_list) {
    for (int context : context_list) {
      std::string const key = name + "/" + s.name + "/" + std::to_string(context);
      for (int variant = 0; variant < (int8_keys ? 4 : 1); ++variant) {
        kvq::attention_options opt;
        if (variant & 1) opt.query = kvq::query_precision::q8_0;
        if (variant & 2) opt.probabilities = kvq::probability_precision::i8;
        std::string const label = name + ((variant & 1) != 0 ? "+q8q" : "") + ((variant & 2) != 0 ? "+i8p" : "");
        for (int threads : thread_counts) {
          std::string const bench = "attention/" + label + "/" + s.name + "/ctx:" + std::to_string(context) +
                                    "/threads:" + std::to_string(threads);
          benchmark::RegisterBenchmark(
              bench.c_str(),
              [=](benchmark::State& st) { bm_attention<Choice>(st, key, s, context, threads, opt, int8_keys); })
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

/// A buffer far beyond the last-level cache for the read-only bandwidth.
auto read_buffer() -> buffer& {
  static buffer b(std::max<std::size_t>(256 * mib, 8 * llc_bytes()));
  return b;
}

void bm_read(benchmark::State& state, int threads) {
  auto& b = read_buffer();
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

/// Registers machine/read, machine/fma and machine/int8dot for 1 and 2 threads, names ending in
/// `suffix`.
void register_machine(std::string const& suffix) {
  for (int threads : thread_counts) {
    std::string const t = "/threads:" + std::to_string(threads) + suffix;
    benchmark::RegisterBenchmark(("machine/read" + t).c_str(), [threads](benchmark::State& s) { bm_read(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("machine/fma" + t).c_str(),
                                 [threads](benchmark::State& s) { bm_peak<fma_peak_loop>(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("machine/int8dot" + t).c_str(),
                                 [threads](benchmark::State& s) { bm_peak<int8_peak_loop>(s, threads); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
}

/// The machine figures first and again last (the summary keeps the better of the two, as other
/// load on the machine can only lower them), the attention runs in between.
void register_all() {
  register_machine("");
  register_codec<kvq::f32_codec>("f32", false);
  register_codec<kvq::f16_codec>("f16", false);
  register_codec<kvq::q4_0>("q4_0", true);
  register_codec<kvq::q8_0>("q8_0", true);
  register_codec<kvq::int8_sym>("int8", true);
  register_codec<kvq::fp8_e4m3>("fp8_e4m3", false);
  register_codec<kvq::fp8_e5m2>("fp8_e5m2", false);
  register_codec<kvq::kivi<2, 32>>("kivi2", false);
  register_codec<kvq::kivi<4, 32>>("kivi4", false);
  register_codec<kvq::kivi<8, 32>>("kivi8", false);
  // The FP4 and rotated codecs: gqa at 4k only (against f16 and q4_0 there).
  constexpr shape_spec gqa[] = {shapes[0]};
  constexpr int at_4k[] = {4096};
  register_codec<kvq::mxfp4>("mxfp4", false, gqa, at_4k);
  register_codec<kvq::nvfp4>("nvfp4", false, gqa, at_4k);
  register_codec<kvq::rotated<kvq::q4_0>>("rot-q4_0", false, gqa, at_4k);
  register_codec<kvq::tq4>("tq4", false, gqa, at_4k);
  register_codec<kvq::tq3>("tq3", false, gqa, at_4k);
  register_codec<kvq::tq2>("tq2", false, gqa, at_4k);
  register_machine("/again");
}

}  // namespace
}  // namespace kvq_bench

int main(int argc, char** argv) {
  kvq_bench::g_working_set = kvq_bench::take_working_set_flag(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "attention");
  benchmark::AddCustomContext("working_set_min_bytes", std::to_string(kvq_bench::g_working_set));
  benchmark::AddCustomContext("fma_kind", kvq_bench::fma_peak_kind());
  benchmark::AddCustomContext("int8_kind", kvq_bench::int8_peak_kind());
  kvq_bench::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
