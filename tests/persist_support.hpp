// kvq tests: helpers of the persistence tests and the loader's fuzz target, and saving and loading
// through a GPU backend's cache (the CUDA host stand-in runtime, the Metal shim) against the CPU
// cache, written once for both test programs.
#pragma once

#include <kvq/cache.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvq_test {

/// Deterministic (tokens, kv_heads, head_dim) values.
inline auto persist_tokens(std::uint32_t seed, std::int64_t n, int kv_heads, int head_dim) -> std::vector<float> {
  std::vector<float> x(static_cast<std::size_t>(n) * static_cast<std::size_t>(kv_heads * head_dim));
  std::uint32_t s = seed * 2654435761u + 3u;
  for (auto& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<std::int32_t>(s >> 8) - (1 << 23)) / static_cast<float>(1 << 21);
  }
  return x;
}

/// True when `a` and `b` hold the same floats, bit for bit.
inline auto same_floats(std::vector<float> const& a, std::vector<float> const& b) -> bool {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// Every token of every (layer, kv_head) of a CPU flat cache, keys then values, as f32.
template <class Cache>
auto flat_contents(Cache const& c) -> std::vector<float> {
  auto const& s = c.shape();
  std::vector<float> all;
  for (int l = 0; l < s.layers; ++l)
    for (int h = 0; h < s.kv_heads; ++h) {
      std::vector<float> k(static_cast<std::size_t>(c.size(l) * s.head_dim)), v(k.size());
      c.read_keys(l, h, 0, c.size(l), k.data());
      c.read_values(l, h, 0, c.size(l), v.data());
      all.insert(all.end(), k.begin(), k.end());
      all.insert(all.end(), v.begin(), v.end());
    }
  return all;
}

/// The failures (empty: none) of saving and loading flat caches `gpu` and `gpu_loaded` and paged
/// caches `gpu_paged` and `gpu_paged_loaded` of a GPU backend, all empty and shaped like
/// (layers, kv_heads, head_dim, capacity 256; pages of 32 tokens) with KIVI residual `residual`:
/// fed the tokens the CPU caches get, they save the CPU's image; the CPU's image loads into them
/// to the CPU's reads and saves back to the same bytes. `append(cache, layer, k, v, n)`,
/// `read(cache, keys, layer, head, n, out)`, `append_seq(cache, seq, layer, k, v, n)` and
/// `read_seq(cache, seq, keys, layer, head, n, out)` reach the GPU caches.
template <class Choice, class Gpu, class GpuPaged, class Append, class Read, class AppendSeq, class ReadSeq>
auto persist_failures(int layers, int kv_heads, int head_dim, int residual, Gpu& gpu, Gpu& gpu_loaded,
                      GpuPaged& gpu_paged, GpuPaged& gpu_paged_loaded, Append&& append, Read&& read,
                      AppendSeq&& append_seq, ReadSeq&& read_seq) -> std::vector<std::string> {
  using bytes = std::vector<std::byte>;
  std::vector<std::string> failures;
  auto expect = [&](bool ok, std::string const& what) {
    if (!ok) failures.push_back(what);
  };
  typename kvq::QuantizedKVCache<Choice>::options o;
  o.residual = residual;
  kvq::QuantizedKVCache<Choice> cpu({layers, kv_heads, head_dim, 256}, o);
  typename kvq::PagedKVCache<Choice>::options po;
  po.residual = residual;
  kvq::PagedKVCache<Choice> cpu_paged({layers, kv_heads, head_dim, 32, 16, 4}, po);
  kvq::sequence_id const s = cpu_paged.add_sequence();
  kvq::sequence_id const gs = gpu_paged.add_sequence();
  for (int l = 0; l < layers; ++l) {
    std::int64_t const n = 37 + 40 * l;
    auto const k = persist_tokens(1 + static_cast<std::uint32_t>(l), n, kv_heads, head_dim);
    auto const v = persist_tokens(50 + static_cast<std::uint32_t>(l), n, kv_heads, head_dim);
    cpu.append(l, kvq::token_major(k.data(), n, kv_heads, head_dim), kvq::token_major(v.data(), n, kv_heads, head_dim));
    append(gpu, l, k.data(), v.data(), n);
    cpu_paged.append(s, l, kvq::token_major(k.data(), n, kv_heads, head_dim),
                     kvq::token_major(v.data(), n, kv_heads, head_dim));
    append_seq(gpu_paged, gs, l, k.data(), v.data(), n);
  }
  auto save = [](auto const& c) {
    bytes b;
    kvq::vector_writer w(b);
    kvq::save(c, w);
    return b;
  };
  auto ship = [](auto& c, kvq::sequence_id seq, std::int64_t count) {
    bytes b;
    kvq::vector_writer w(b);
    kvq::export_sequence(c, seq, 0, count, w);
    return b;
  };
  bytes const image = save(cpu);
  expect(save(gpu) == image, "the GPU cache saves other bytes than the CPU cache");
  kvq::load_into(gpu_loaded, kvq::span_reader(image));
  expect(save(gpu_loaded) == image, "a loaded GPU cache saves other bytes");
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      for (bool keys : {true, false}) {
        std::int64_t const n = cpu.size(l);
        std::vector<float> want(static_cast<std::size_t>(n * head_dim)), got(want.size());
        if (keys) {
          cpu.read_keys(l, h, 0, n, want.data());
        } else {
          cpu.read_values(l, h, 0, n, want.data());
        }
        read(gpu_loaded, keys, l, h, n, got.data());
        expect(same_floats(want, got), "a loaded GPU cache reads differently");
      }
  for (std::int64_t count : {std::int64_t{77}, std::int64_t{45}}) {
    bytes const shipped = ship(cpu_paged, s, count);
    expect(ship(gpu_paged, gs, count) == shipped, "the GPU paged cache exports other bytes");
    kvq::sequence_id const t = kvq::import_sequence(gpu_paged_loaded, kvq::span_reader(shipped));
    expect(ship(gpu_paged_loaded, t, count) == shipped, "an imported GPU sequence exports other bytes");
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        std::int64_t const n = std::min(count, cpu_paged.size(s, l));
        std::vector<float> want(static_cast<std::size_t>(n * head_dim)), got(want.size());
        read_seq(gpu_paged_loaded, t, false, l, h, n, got.data());
        cpu_paged.read_values(s, l, h, 0, n, want.data());
        expect(same_floats(want, got), "an imported GPU sequence reads differently");
      }
    gpu_paged_loaded.release(t);
  }
  return failures;
}

}  // namespace kvq_test
