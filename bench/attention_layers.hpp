// kvq benchmarks: the layers the attention suites attend — synthetic keys (N(0, 1), outlier
// channels ×10) and values (N(0, 1)) appended to enough layers that their K and V bytes span the
// working set, so an iteration attending layer i mod L never reads from cache.
#pragma once

#include <kvq/cache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"

namespace kvq_bench {

/// A head layout of the benchmarks.
struct shape_spec {
  char const* name;
  int q_heads;
  int kv_heads;
};

/// The KIVI residual of the benchmarked caches.
inline constexpr int kivi_residual = 128;

/// Bytes the K and V of all layers must at least span (twice the last-level cache by default).
inline std::size_t g_working_set = 0;

/// Tokens in the pool of synthetic keys and values that layers are filled from.
inline constexpr std::int64_t pool_tokens = 1024;

/// Where a suite's data comes from: the pool's seeds and the step between the layers' offsets.
struct layer_data {
  std::uint64_t key_seed;
  std::uint64_t value_seed;
  std::int64_t offset_step;
};

/// Token-major (pool_tokens, kv_heads, head_dim) keys and values of one head count.
struct kv_pool {
  std::vector<float> keys, values;
};

/// The pool of `kv_heads` heads (one per head count and process; `data` seeds it).
inline auto pool_for(int kv_heads, layer_data const& data) -> kv_pool const& {
  static std::map<int, kv_pool> pools;
  auto& p = pools[kv_heads];
  if (p.keys.empty()) {
    std::size_t const n = static_cast<std::size_t>(pool_tokens) * static_cast<std::size_t>(kv_heads) * head_dim;
    p.keys.resize(n);
    p.values.resize(n);
    fill_normal(p.keys.data(), n, data.key_seed + static_cast<std::uint64_t>(kv_heads));
    add_outlier_channels(p.keys.data(), n, 10.0f);
    fill_normal(p.values.data(), n, data.value_seed + static_cast<std::uint64_t>(kv_heads));
  }
  return p;
}

/// K and V bytes stored for all tokens of `layer`: encoded units with their scales, plus KIVI's
/// f16 residual rows.
template <class Cache>
auto layer_bytes(Cache const& cache, int layer) -> std::size_t {
  std::size_t total = 0;
  for (int h = 0; h < cache.shape().kv_heads; ++h) {
    for (kvq::storage_view const& v : {cache.key_storage(layer, h), cache.value_storage(layer, h)}) {
      total += static_cast<std::size_t>(v.quantized_tokens / v.tokens_per_unit) * v.unit_bytes;
      total += static_cast<std::size_t>(v.residual_tokens) * head_dim * 2;
    }
  }
  return total;
}

/// The layers of one (codec, shape, context), type-erased so that one slot can hold any codec.
struct layer_set_base {
  virtual ~layer_set_base() = default;
};

template <class Choice>
struct layer_set final : layer_set_base {
  using cache_type = kvq::QuantizedKVCache<Choice>;
  layer_set(kvq::cache_shape const& shape, typename cache_type::options const& opt) : cache(shape, opt) {}
  cache_type cache;
  std::size_t kv_bytes = 0;  // K and V bytes of one full layer
};

/// Builds the layers of (Choice, shape, context): enough for the working set, each filled with
/// `context` tokens of the pool from its own offset, the layers appended on up to 4 threads.
template <class Choice>
auto build_layers(shape_spec const& s, int context, layer_data const& data) -> std::unique_ptr<layer_set<Choice>> {
  // Quantized bytes of a full layer; the attended bytes are at least this (residual rows are f16).
  auto const plan = kvq::plan_memory<Choice>({1, s.kv_heads, head_dim, context}, kivi_residual);
  std::size_t const per_layer = std::max<std::size_t>(plan.key_bytes + plan.value_bytes, 1);
  int const layers = static_cast<int>(std::max<std::size_t>(1, (g_working_set + per_layer - 1) / per_layer));
  typename layer_set<Choice>::cache_type::options opt;
  opt.residual = kivi_residual;
  auto set = std::make_unique<layer_set<Choice>>(kvq::cache_shape{layers, s.kv_heads, head_dim, context}, opt);

  auto const& pool = pool_for(s.kv_heads, data);
  std::int64_t const stride = static_cast<std::int64_t>(s.kv_heads) * head_dim;
  int const workers = std::min(static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u)), layers);
  run_threads(workers, [&](int w) {
    for (int l = w; l < layers; l += workers) {
      std::int64_t offset = (static_cast<std::int64_t>(l) * data.offset_step) % pool_tokens, done = 0;
      while (done < context) {
        std::int64_t const n = std::min<std::int64_t>(context - done, pool_tokens - offset);
        set->cache.append(l, kvq::token_major(pool.keys.data() + offset * stride, n, s.kv_heads, head_dim),
                          kvq::token_major(pool.values.data() + offset * stride, n, s.kv_heads, head_dim));
        done += n;
        offset = 0;
      }
    }
  });
  set->kv_bytes = layer_bytes(set->cache, 0);
  return set;
}

/// The one live layer set: the runs of one (codec, shape, context) share it; another key frees it
/// before the next is built, so only one working set is in memory at a time.
template <class Choice>
auto acquire_layers(std::string const& key, shape_spec const& s, int context, layer_data const& data)
    -> layer_set<Choice>& {
  static std::string live_key;
  static std::unique_ptr<layer_set_base> live;
  if (live_key != key) {
    live.reset();
    live_key.clear();
    live = build_layers<Choice>(s, context, data);
    live_key = key;
  }
  return static_cast<layer_set<Choice>&>(*live);
}

}  // namespace kvq_bench
