// kvq benchmark: batched decode attention over a paged cache against the same sequences in flat
// caches, through the public entries: kvq::paged_decode_attention (one call for the batch) versus
// the sum of per-sequence kvq::decode_attention calls (decode_attention_parallel with 2 threads).
//
// Shape gqa 32 query / 8 KV heads, head_dim 128, one layer; pages of 64 tokens; batches of 1, 8
// and 64 sequences of 1k, 4k or 16k tokens each (64 × 16k left out: 1M tokens); codecs f16, q8_0,
// q4_0, kivi4 (G = 32, R = 128). The paged pool and the flat caches hold the same tokens (N(0,1)
// keys with four outlier channels ×10, N(0,1) values), built once per (codec, batch, context)
// outside the timing. Rows:
//   paged/<codec>/b:<B>/ctx:<C>/paged/threads:<t>   one batched call over B sequences
//   paged/<codec>/b:<B>/ctx:<C>/flat/threads:<t>    B flat-cache calls
// Counters: kv_bytes (K and V bytes attended per call), tokens (B × C). The paging cost is the
// ratio paged / flat at 1 thread; the batch scaling is paged threads:2 / threads:1.
#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using namespace kvq_bench;

constexpr int q_heads = 32;
constexpr int kv_heads = 8;
constexpr int page_tokens = 64;
constexpr int kivi_residual = 128;
constexpr std::int64_t pool_tokens = 1024;

struct batch_base {
  virtual ~batch_base() = default;
};

/// B sequences of C tokens, in one paged pool and in B flat caches.
template <class Choice>
struct batch final : batch_base {
  std::unique_ptr<kvq::PagedKVCache<Choice>> paged;
  std::vector<std::unique_ptr<kvq::QuantizedKVCache<Choice>>> flat;
  std::vector<kvq::sequence_id> ids;
  std::size_t kv_bytes = 0;
};

template <class Choice>
auto build(int sequences, int context) -> std::unique_ptr<batch<Choice>> {
  static std::vector<float> keys, values;
  std::size_t const n = static_cast<std::size_t>(pool_tokens) * kv_heads * head_dim;
  if (keys.empty()) {
    keys.resize(n);
    values.resize(n);
    fill_normal(keys.data(), n, 11);
    add_outlier_channels(keys.data(), n, 10.0f);
    fill_normal(values.data(), n, 23);
  }
  auto b = std::make_unique<batch<Choice>>();
  std::int64_t const pages = static_cast<std::int64_t>(sequences) * ((context + page_tokens - 1) / page_tokens);
  b->paged = std::make_unique<kvq::PagedKVCache<Choice>>(
      kvq::paged_shape{1, kv_heads, head_dim, page_tokens, pages, sequences},
      typename kvq::PagedKVCache<Choice>::options{kivi_residual});
  std::int64_t const stride = static_cast<std::int64_t>(kv_heads) * head_dim;
  for (int s = 0; s < sequences; ++s) {
    auto const id = b->paged->add_sequence();
    b->ids.push_back(id);
    b->flat.push_back(std::make_unique<kvq::QuantizedKVCache<Choice>>(
        kvq::cache_shape{1, kv_heads, head_dim, context},
        typename kvq::QuantizedKVCache<Choice>::options{kivi_residual}));
    std::int64_t offset = (static_cast<std::int64_t>(s) * 389) % pool_tokens, done = 0;
    while (done < context) {
      std::int64_t const m = std::min<std::int64_t>(context - done, pool_tokens - offset);
      auto const k = kvq::token_major(keys.data() + offset * stride, m, kv_heads, head_dim);
      auto const v = kvq::token_major(values.data() + offset * stride, m, kv_heads, head_dim);
      b->paged->append(id, 0, k, v);
      b->flat.back()->append(0, k, v);
      done += m;
      offset = 0;
    }
    for (int h = 0; h < kv_heads; ++h)
      for (kvq::storage_view const& v : {b->flat.back()->key_storage(0, h), b->flat.back()->value_storage(0, h)})
        b->kv_bytes += static_cast<std::size_t>(v.quantized_tokens / v.tokens_per_unit) * v.unit_bytes +
                       static_cast<std::size_t>(v.residual_tokens) * head_dim * 2;
  }
  return b;
}

/// The one live batch: runs of the same (codec, B, C) share it.
template <class Choice>
auto acquire(std::string const& key, int sequences, int context) -> batch<Choice>& {
  static std::string live_key;
  static std::unique_ptr<batch_base> live;
  if (live_key != key) {
    live.reset();
    live_key.clear();
    live = build<Choice>(sequences, context);
    live_key = key;
  }
  return static_cast<batch<Choice>&>(*live);
}

template <class Choice>
void bm(benchmark::State& state, std::string const& key, int sequences, int context, bool paged, int threads) {
  auto& b = acquire<Choice>(key, sequences, context);
  std::size_t const per = static_cast<std::size_t>(q_heads) * head_dim;
  std::vector<float> q(per * static_cast<std::size_t>(sequences)), out(q.size());
  fill_normal(q.data(), q.size(), 99);
  for (auto _ : state) {
    if (paged) {
      kvq::paged_decode_attention(*b.paged, 0, std::span<kvq::sequence_id const>(b.ids), q.data(), q_heads, out.data(),
                                  {}, threads);
    } else {
      for (int s = 0; s < sequences; ++s) {
        std::size_t const o = per * static_cast<std::size_t>(s);
        if (threads == 1)
          kvq::decode_attention(*b.flat[static_cast<std::size_t>(s)], 0, q.data() + o, q_heads, out.data() + o);
        else
          kvq::decode_attention_parallel(*b.flat[static_cast<std::size_t>(s)], 0, q.data() + o, q_heads, out.data() + o,
                                         threads);
      }
    }
    float* result = out.data();
    benchmark::DoNotOptimize(result);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(b.kv_bytes));
  state.counters["kv_bytes"] = static_cast<double>(b.kv_bytes);
  state.counters["tokens"] = static_cast<double>(sequences) * context;
}

template <class Choice>
void register_codec(std::string const& name) {
  for (int sequences : {1, 8, 64})
    for (int context : {1024, 4096, 16384}) {
      if (static_cast<std::int64_t>(sequences) * context > (std::int64_t{1} << 19)) continue;
      std::string const key = name + "/b:" + std::to_string(sequences) + "/ctx:" + std::to_string(context);
      for (bool paged : {true, false})
        for (int threads : {1, 2}) {
          std::string const row = "paged/" + key + (paged ? "/paged" : "/flat") + "/threads:" + std::to_string(threads);
          benchmark::RegisterBenchmark(
              row.c_str(), [=](benchmark::State& s) { bm<Choice>(s, key, sequences, context, paged, threads); })
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
  register_codec<kvq::f16_codec>("f16");
  register_codec<kvq::q8_0>("q8_0");
  register_codec<kvq::q4_0>("q4_0");
  register_codec<kvq::kivi<4>>("kivi4");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvq_bench::add_machine_context();
  benchmark::AddCustomContext("kvq_suite", "paged");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
