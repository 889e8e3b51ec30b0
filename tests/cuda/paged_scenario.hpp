// The checks of a GPU paged cache against the CPU PagedKVCache, shared by the CUDA host test
// (test_cuda_host.cpp), the CUDA device test (test_cuda_device.cu) and the Metal shim test
// (test_metal_kernels.cpp). A harness P<Choice> drives the GPU side with host data:
//
//   P(kvq::paged_shape, int residual, launch)
//   auto add_sequence() -> kvq::sequence_id;  auto fork(kvq::sequence_id) -> kvq::sequence_id
//   void release(kvq::sequence_id);  void truncate(kvq::sequence_id, std::int64_t)
//   void append(kvq::sequence_id, int l, std::vector<float> const& k, std::vector<float> const& v, std::int64_t n)
//   auto read(bool keys, kvq::sequence_id, int l, int h, std::int64_t first, std::int64_t count)
//       -> std::vector<float>
//   auto attention(int l, std::vector<kvq::sequence_id> const&, std::vector<float> const& q, int q_heads,
//                  kvq::attention_options const&) -> std::vector<float>
//   auto pool() -> std::vector<std::uint8_t>;  auto pages() -> kvq::page_report
#pragma once

#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "catch_compat.hpp"
#include "cuda/cuda_scenario.hpp"
#include "test_support.hpp"

namespace kvq_cuda_test {

/// Attention tolerance of the paged checks: they are about the paged plumbing (page tables,
/// residual slots, batching), whose mistakes give O(1) errors; the kernels' fp32 agreement is
/// checked by the flat scenarios. The CPU side is the SIMD kernel and the GPU side the kernel
/// bodies (another summation order and exp), and these logits reach about 40, so the two differ
/// by up to about 3e-5 of the output scale.
constexpr double paged_attention_tolerance = 5e-5;

/// The CPU paged cache and the paged cache under test, fed the same operations.
template <class Choice, template <class> class P>
struct paged_pair {
  kvq::PagedKVCache<Choice> cpu;
  P<Choice> gpu;
  paged_pair(kvq::paged_shape const& s, int residual, launch const& lo)
      : cpu(s, typename kvq::PagedKVCache<Choice>::options{residual}), gpu(s, residual, lo) {}

  auto add() -> kvq::sequence_id {
    auto const a = cpu.add_sequence();
    REQUIRE(gpu.add_sequence() == a);
    return a;
  }
  auto fork(kvq::sequence_id s) -> kvq::sequence_id {
    auto const a = cpu.fork(s);
    REQUIRE(gpu.fork(s) == a);
    return a;
  }
  void release(kvq::sequence_id s) {
    cpu.release(s);
    gpu.release(s);
  }
  void truncate(kvq::sequence_id s, std::int64_t n) {
    cpu.truncate(s, n);
    gpu.truncate(s, n);
  }
  /// Appends n tokens (seeded) to every layer of s, in chunks of `chunk`.
  void append(kvq::sequence_id s, std::int64_t n, std::int64_t chunk, std::uint32_t seed) {
    int const kv = cpu.shape().kv_heads, d = cpu.shape().head_dim;
    for (int l = 0; l < cpu.shape().layers; ++l)
      for (std::int64_t t = 0; t < n; t += chunk) {
        std::int64_t const m = std::min(chunk, n - t);
        auto const k = kv_data(m, kv, d, seed + static_cast<std::uint32_t>(97 * l + t));
        auto const v = kv_data(m, kv, d, seed + 5000u + static_cast<std::uint32_t>(97 * l + t));
        cpu.append(s, l, kvq::token_major(k.data(), m, kv, d), kvq::token_major(v.data(), m, kv, d));
        gpu.append(s, l, k, v, m);
      }
  }

  /// Pool bytes, page use and every read equal; attention within fp32 rounding.
  void require_same(std::vector<kvq::sequence_id> const& live, std::uint32_t seed) {
    auto const& s = cpu.shape();
    auto const cp = cpu.pages(), gp = gpu.pages();
    REQUIRE(cp.used_pages == gp.used_pages);
    REQUIRE(cp.shared_pages == gp.shared_pages);
    REQUIRE(cp.page_refs == gp.page_refs);
    auto const pool = gpu.pool();
    REQUIRE(pool.size() == cpu.memory().total_bytes);
    auto const* mine = reinterpret_cast<std::uint8_t const*>(cpu.key_storage(live.front(), 0, 0).pool);
    REQUIRE(std::memcmp(mine, pool.data(), pool.size()) == 0);
    for (auto id : live)
      for (int l = 0; l < s.layers; ++l)
        for (int h = 0; h < s.kv_heads; ++h)
          for (bool keys : {true, false}) {
            std::int64_t const n = cpu.size(id, l);
            std::vector<float> want(static_cast<std::size_t>(n) * static_cast<std::size_t>(s.head_dim));
            if (keys)
              cpu.read_keys(id, l, h, 0, n, want.data());
            else
              cpu.read_values(id, l, h, 0, n, want.data());
            auto const got = gpu.read(keys, id, l, h, 0, n);
            INFO("sequence " << id << " layer " << l << " head " << h << (keys ? " keys" : " values"));
            REQUIRE(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
          }
    int const q_heads = 2 * s.kv_heads;
    std::size_t const per = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(s.head_dim);
    auto const q = kvq_test::normal_data(live.size() * per, seed, 1.5f);
    kvq::attention_options opts[3];
    opts[1].window = 37;
    opts[1].softcap = 20.0f;
    opts[2].query = kvq::query_precision::q8_0;
    for (auto const& opt : opts)
      for (int l = 0; l < s.layers; ++l) {
        std::vector<float> want(live.size() * per);
        kvq::paged_decode_attention(cpu, l, std::span<kvq::sequence_id const>(live), q.data(), q_heads, want.data(),
                                    opt);
        auto const got = gpu.attention(l, live, q, q_heads, opt);
        INFO("layer " << l << " window " << opt.window);
        REQUIRE(attention_error(want, got, q_heads * static_cast<int>(live.size()), s.head_dim) <=
                paged_attention_tolerance);
      }
  }
};

/// A continuous-batching story on both caches: a prompt forked to children that diverge, a
/// rollback, a release, a fresh sequence and a fork of a fork, compared after each phase; at the
/// end every page is back in the pool.
template <class Choice, template <class> class P>
void run_paged(int d, int residual, launch const& lo = {}) {
  kvq::paged_shape const s{2, 2, d, 32, 48, 8};
  paged_pair<Choice, P> c(s, residual, lo);
  auto const root = c.add();
  c.append(root, 70, 23, 1);
  std::vector<kvq::sequence_id> live{root};
  for (int i = 0; i < 3; ++i) live.push_back(c.fork(root));
  c.require_same(live, 10);
  for (int i = 1; i < 4; ++i) c.append(live[static_cast<std::size_t>(i)], 5 + 29 * (i - 1), 7 + i, 100u * i);
  c.append(root, 3, 1, 77);
  c.require_same(live, 11);
  c.truncate(live[2], 72);
  c.release(live[1]);
  live.erase(live.begin() + 1);
  auto const fresh = c.add();
  c.append(fresh, 40, 40, 500);
  live.push_back(fresh);
  live.push_back(c.fork(live[2]));
  c.append(live.back(), 3, 2, 600);
  c.append(live[1], 1, 1, 700);
  c.require_same(live, 12);
  for (auto id : live) c.release(id);
  REQUIRE(c.gpu.pages().free_pages == s.pages);
  REQUIRE(c.cpu.pages().free_pages == s.pages);
}

}  // namespace kvq_cuda_test
