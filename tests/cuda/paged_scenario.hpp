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
//   auto attention_chunks(int l, std::vector<kvq::query_chunk> const&, std::vector<float> const& q, int q_heads,
//                         kvq::attention_options const&, std::vector<std::size_t> const& mask_bytes)
//       -> std::vector<float>
//       (kvq::paged_attention; chunk c's mask_data, when set, holds mask_bytes[c] bytes of host memory)
//   auto pool() -> std::vector<std::uint8_t>;  auto pages() -> kvq::page_report
#pragma once

#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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

/// Batched multi-token attention of `chunks` on both caches (kvq::paged_attention on the CPU)
/// within paged_attention_tolerance; masks[c] holds chunk c's mask bytes (empty: none).
template <class Choice, template <class> class P>
void require_same_chunks(paged_pair<Choice, P>& c, int l, std::vector<kvq::query_chunk> const& chunks, int q_heads,
                         kvq::attention_options const& opt, std::vector<std::size_t> const& mask_bytes,
                         std::uint32_t seed) {
  int const d = c.cpu.shape().head_dim;
  std::int64_t rows = 0;
  for (auto const& ch : chunks) rows += ch.n_q;
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(rows * q_heads * d), seed, 1.5f);
  std::vector<float> want(q.size(), -5.0f);
  kvq::paged_attention(c.cpu, l, std::span<kvq::query_chunk const>(chunks), q.data(), q_heads, want.data(), opt);
  auto const got = c.gpu.attention_chunks(l, chunks, q, q_heads, opt, mask_bytes);
  INFO("layer " << l << " chunks " << chunks.size() << " mask " << static_cast<int>(opt.mask) << " window "
                << opt.window << " sinks " << (opt.sinks != nullptr) << " q8_0 query "
                << (opt.query == kvq::query_precision::q8_0));
  REQUIRE(got.size() == want.size());
  CHECK(attention_error(want, got, static_cast<int>(rows) * q_heads, d) <= paged_attention_tolerance);
}

/// Batched multi-token attention (kvq::paged_attention) against the CPU's: three sequences of
/// different lengths whose pages interleave (appended in turns), queried as one mixed batch: a
/// prefill chunk of 64 tokens, a draft of 8 and a decode token, each crossing page boundaries;
/// causal, no mask from given positions, a window with soft-cap and a q8_0 query, additive and
/// boolean masks per chunk (rows that attend nothing included), sinks, a repeated sequence and an
/// empty chunk; errors as the CPU's, the caches unchanged.
template <class Choice, template <class> class P>
void run_paged_chunks(int d, int residual, launch const& lo = {}) {
  kvq::paged_shape const s{2, 2, d, 32, 40, 4};
  paged_pair<Choice, P> c(s, residual, lo);
  auto const a = c.add(), b = c.add(), e = c.add();
  // Interleaved appends: the sequences' pages alternate in the pool.
  c.append(a, 90, 45, 1);
  c.append(b, 40, 40, 2);
  c.append(e, 20, 20, 3);
  c.append(a, 64, 64, 4);  // the prefill chunk just appended: a holds 154 tokens
  c.append(b, 35, 9, 5);   // b: 75 (the draft at 67..74 crosses the page boundary at 64)
  c.append(e, 45, 15, 6);  // e: 65 (the decode token at 64 opens a page)
  std::int64_t const la = 154, lb = 75, le = 65;
  REQUIRE(c.cpu.size(a, 0) == la);
  int const kv = s.kv_heads, q_heads = 2 * kv;
  std::uint32_t seed = static_cast<std::uint32_t>(d * 11 + residual);
  std::vector<kvq::query_chunk> mixed{{a, 64}, {b, 8}, {e, 1}};
  std::vector<std::size_t> const no_masks(3, 0);
  for (int l = 0; l < s.layers; ++l) require_same_chunks(c, l, mixed, q_heads, {}, no_masks, ++seed);
  require_same_chunks(c, 0, mixed, kv, {}, no_masks, ++seed);  // MHA
  // No mask from given positions (one off the tile grid, one whose page is not the last).
  kvq::attention_options none;
  none.mask = kvq::mask_kind::none;
  std::vector<kvq::query_chunk> placed{{a, 64, 13}, {b, 8, 30}, {e, 1, 64}};
  require_same_chunks(c, 1, placed, q_heads, none, no_masks, ++seed);
  // A window with soft-cap and a q8_0 query; causal from given positions.
  kvq::attention_options win;
  win.window = 40;
  win.softcap = 15.0f;
  win.query = kvq::query_precision::q8_0;
  require_same_chunks(c, 0, mixed, q_heads, win, no_masks, ++seed);
  require_same_chunks(c, 1, placed, q_heads, win, no_masks, ++seed);
  // Additive masks: each chunk its own rows and stride, -Inf holes, one row all -Inf.
  {
    std::vector<std::int64_t> const lens{la, lb, le}, strides{la + 3, 0, le};
    std::vector<std::vector<float>> bias(3);
    std::vector<kvq::query_chunk> masked = mixed;
    std::vector<std::size_t> bytes(3);
    for (std::size_t i = 0; i < 3; ++i) {
      std::int64_t const stride = strides[i] > 0 ? strides[i] : lens[i];
      bias[i] = kvq_test::normal_data(static_cast<std::size_t>(masked[i].n_q * stride), ++seed, 2.0f);
      for (std::size_t j = 0; j < bias[i].size(); ++j)
        if (j % 5 == 2 ||
            (i == 0 && j >= static_cast<std::size_t>(7 * stride) && j < static_cast<std::size_t>(8 * stride)))
          bias[i][j] = -std::numeric_limits<float>::infinity();
      masked[i].mask_data = bias[i].data();
      masked[i].mask_stride = strides[i];
      bytes[i] = bias[i].size() * sizeof(float);
    }
    kvq::attention_options add;
    add.mask = kvq::mask_kind::additive;
    require_same_chunks(c, 0, masked, q_heads, add, bytes, ++seed);
    add.window = 50;
    require_same_chunks(c, 1, masked, q_heads, add, bytes, ++seed);
  }
  // Boolean masks: a random pattern per chunk, one row that allows nothing.
  {
    std::vector<std::int64_t> const lens{la, lb, le};
    std::vector<std::vector<std::uint8_t>> allow(3);
    std::vector<kvq::query_chunk> masked = placed;
    std::vector<std::size_t> bytes(3);
    for (std::size_t i = 0; i < 3; ++i) {
      allow[i].resize(static_cast<std::size_t>(masked[i].n_q * lens[i]));
      auto const r = kvq_test::normal_data(allow[i].size(), ++seed);
      std::size_t const len = static_cast<std::size_t>(lens[i]);
      for (std::size_t j = 0; j < allow[i].size(); ++j)
        allow[i][j] = static_cast<std::uint8_t>(r[j] > -0.5f && !(i == 0 && j / len == 9) ? 1 + j % 3 : 0);
      masked[i].mask_data = allow[i].data();
      bytes[i] = allow[i].size();
    }
    kvq::attention_options boolean;
    boolean.mask = kvq::mask_kind::boolean;
    require_same_chunks(c, 0, masked, q_heads, boolean, bytes, ++seed);
  }
  // Sinks (one -Inf), causal and with no mask; a repeated sequence, an empty chunk, a decode
  // token in the middle of the batch.
  {
    std::vector<float> sinks = {0.5f, -std::numeric_limits<float>::infinity(), 3.0f, -2.0f};
    kvq::attention_options sk;
    sk.sinks = sinks.data();
    require_same_chunks(c, 0, mixed, q_heads, sk, no_masks, ++seed);
    sk.mask = kvq::mask_kind::none;
    sk.window = 30;
    std::vector<kvq::query_chunk> odd{{b, 8}, {e, 0}, {a, 1}, {a, 64, 20}, {b, 3, 10}};
    require_same_chunks(c, 1, odd, q_heads, sk, std::vector<std::size_t>(5, 0), ++seed);
    // Queries past every window attend nothing: zeros, sink or not.
    sk.window = 4;
    std::vector<kvq::query_chunk> const past{{b, 1}, {e, 2, 100}};
    require_same_chunks(c, 0, past, q_heads, sk, std::vector<std::size_t>(2, 0), ++seed);
    auto const out =
        c.gpu.attention_chunks(0, past, std::vector<float>(static_cast<std::size_t>(3 * q_heads * d), 1.0f), q_heads,
                               sk, std::vector<std::size_t>(2, 0));
    std::size_t const qd = static_cast<std::size_t>(q_heads * d);
    CHECK(std::all_of(out.begin() + static_cast<std::ptrdiff_t>(qd), out.end(), [](float x) { return x == 0.0f; }));
  }
  // An empty batch does nothing.
  {
    std::vector<kvq::query_chunk> const nothing;
    auto const out = c.gpu.attention_chunks(0, nothing, {}, q_heads, {}, {});
    CHECK(out.empty());
  }
  // Errors: the CPU's types, the caches unchanged.
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(80 * q_heads * d), ++seed);
  auto same_error = [&](int l, std::vector<kvq::query_chunk> const& chunks, int qh, kvq::attention_options const& o) {
    std::vector<float> out(q.size());
    std::string const want = error_kind([&] {
      kvq::paged_attention(c.cpu, l, std::span<kvq::query_chunk const>(chunks), q.data(), qh, out.data(), o);
    });
    std::string const got =
        error_kind([&] { c.gpu.attention_chunks(l, chunks, q, qh, o, std::vector<std::size_t>(chunks.size(), 0)); });
    INFO("layer " << l << " q_heads " << qh << " expected " << want);
    CHECK(want != "none");
    CHECK(got == want);
  };
  same_error(0, mixed, 3, {});                       // q_heads not a multiple of kv_heads
  same_error(2, mixed, q_heads, {});                 // a bad layer
  same_error(0, {{a, 8}, {e + 7, 1}}, q_heads, {});  // an unknown sequence
  same_error(0, {{a, -1}}, q_heads, {});             // a negative n_q
  same_error(0, {{b, 8, lb - 4}}, q_heads, {});      // positions past the sequence
  kvq::attention_options own;
  own.first_pos = 3;  // the chunks' own, not the options'
  same_error(0, mixed, q_heads, own);
  kvq::attention_options own_mask;
  std::vector<std::uint8_t> ones(static_cast<std::size_t>(64 * la), 1);
  own_mask.mask = kvq::mask_kind::boolean;
  own_mask.mask_data = ones.data();
  same_error(0, mixed, q_heads, own_mask);
  kvq::attention_options own_stride;
  own_stride.mask_stride = la;
  same_error(0, mixed, q_heads, own_stride);
  kvq::attention_options no_mask;
  no_mask.mask = kvq::mask_kind::boolean;
  same_error(0, mixed, q_heads, no_mask);  // a custom mask without rows
  float const nan_sinks[4] = {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f};
  kvq::attention_options bad_sink;
  bad_sink.sinks = nan_sinks;
  same_error(0, mixed, q_heads, bad_sink);
  kvq::attention_options neg;
  neg.window = -1;
  same_error(0, mixed, q_heads, neg);
  CHECK(c.gpu.pages().used_pages == c.cpu.pages().used_pages);
  REQUIRE(c.cpu.size(a, 0) == la);
  c.require_same({a, b, e}, ++seed);
}

}  // namespace kvq_cuda_test
