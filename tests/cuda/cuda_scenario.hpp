// The checks of kvq's CUDA cache against the CPU scalar reference, shared by the host test
// (test_cuda_host.cpp: the kernel bodies run on the CPU) and the device test (test_cuda_device.cu:
// the real kernels on a GPU). A harness H<Choice> drives one side:
//
//   H(cache_shape, cpu_options, launch)
//   void append(int l, std::vector<T> const& k, std::vector<T> const& v, std::int64_t n)  // dense host data
//   auto layer_bytes(int l) -> std::vector<std::uint8_t>
//   auto read<T>(bool keys, int l, int h, std::int64_t first, std::int64_t count) -> std::vector<T>
//   void truncate(std::int64_t), shift_left(std::int64_t), reset()
//   auto size(int l) -> std::int64_t;  auto memory() -> kvq::memory_report
//   auto attention(int l, std::vector<float> const& q, int q_heads, kvq::attention_options const&)
//       -> std::vector<float>
//   static auto batched(std::vector<H*> const&, int l, std::vector<float> const& q, int q_heads,
//                       kvq::attention_options const&) -> std::vector<float>
//   auto attention_tokens(int l, std::vector<float> const& q, std::int64_t n_q, int q_heads,
//                         kvq::attention_options const&, std::size_t mask_bytes) -> std::vector<float>
//       (multi-token attention; opt.mask_data holds mask_bytes bytes of host memory, opt.sinks too)
//   auto core() -> the cuda_cache_core (or QuantizedKVCache<Choice, kvq::cuda>) for error checks
#pragma once

#include <kvq/attention.hpp>
#include <kvq/cache.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace kvq_cuda_test {

template <class Choice>
using cpu_cache = kvq::QuantizedKVCache<Choice>;
template <class Choice>
using cpu_options = typename cpu_cache<Choice>::options;

/// Launch settings of the attention kernel under test.
struct launch {
  int threads = 128;
  std::int64_t split_tokens = 0;  ///< > 0: forced tokens per split
};

/// fp32 tolerance of the attention comparison (relative to 1 + the head's largest output).
constexpr double attention_tolerance = 2e-5;
/// Tolerance with f16 probabilities (f16 has 11 significant bits).
constexpr double f16_probability_tolerance = 1e-3;

/// The CPU cache and the cache under test, fed the same data.
template <class Choice, template <class> class H>
struct pair_of_caches {
  cpu_cache<Choice> cpu;
  H<Choice> gpu;
  pair_of_caches(kvq::cache_shape const& s, cpu_options<Choice> const& o, launch const& lo = {})
      : cpu(s, o), gpu(s, o, lo) {}

  template <class T>
  void append(int l, std::vector<T> const& k, std::vector<T> const& v, std::int64_t n) {
    int const kv = cpu.shape().kv_heads, d = cpu.shape().head_dim;
    cpu.append(l, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    gpu.append(l, k, v, n);
  }
  void truncate(std::int64_t n) {
    cpu.truncate(n);
    gpu.truncate(n);
  }
  void shift_left(std::int64_t n) {
    cpu.shift_left(n);
    gpu.shift_left(n);
  }
};

/// Same encoded bytes wherever the CPU cache holds live data: every kv_head's quantized units
/// (rows or tiles) and its live f16 residual rows (KIVI key residual, value window ring slots), at
/// the same offsets of the layer (the layouts are the same); same token counts in the views.
/// Bytes outside live data (stale residual rows, unused capacity) are not part of the contract.
template <class P>
void require_same_bytes(P& c, int l) {
  auto const got = c.gpu.layer_bytes(l);
  auto const& s = c.cpu.shape();
  auto const* base = reinterpret_cast<std::uint8_t const*>(c.cpu.key_storage(l, 0).units);
  std::size_t const row = static_cast<std::size_t>(s.head_dim) * 2;
  auto same = [&](std::uint8_t const* p, std::size_t n, char const* what, int h) {
    std::size_t const off = static_cast<std::size_t>(p - base);
    REQUIRE(off + n <= got.size());
    std::size_t first = 0;
    while (first < n && got[off + first] == p[first]) ++first;
    INFO("layer " << l << " head " << h << " " << what << ": " << n << " bytes at " << off
                  << ", first difference at byte " << first);
    REQUIRE(first == n);
  };
  for (int h = 0; h < s.kv_heads; ++h) {
    for (bool keys : {true, false}) {
      kvq::storage_view const v = keys ? c.cpu.key_storage(l, h) : c.cpu.value_storage(l, h);
      kvq::storage_view const g = c.gpu.view(keys, l, h);
      REQUIRE(g.quantized_tokens == v.quantized_tokens);
      REQUIRE(g.residual_tokens == v.residual_tokens);
      REQUIRE(g.residual_first == v.residual_first);
      REQUIRE(g.unit_bytes == v.unit_bytes);
      REQUIRE(static_cast<std::size_t>(g.units - c.gpu.layer_base(l)) ==
              static_cast<std::size_t>(reinterpret_cast<std::uint8_t const*>(v.units) - base));
      auto const* units = reinterpret_cast<std::uint8_t const*>(v.units);
      same(units, static_cast<std::size_t>(v.quantized_tokens / v.tokens_per_unit) * v.unit_bytes,
           keys ? "key units" : "value units", h);
      for (std::int64_t i = 0; i < v.residual_tokens; ++i) {
        std::int64_t const slot = (v.residual_first + i) % std::max<std::int64_t>(v.residual_capacity, 1);
        same(reinterpret_cast<std::uint8_t const*>(v.residual) + static_cast<std::size_t>(slot) * row, row,
             keys ? "key residual row" : "value window row", h);
      }
    }
  }
  REQUIRE(c.gpu.size(l) == c.cpu.size(l));
}

/// Same decoded values (bit for bit, NaN as NaN) for every token of every head, as f32, and a
/// sub-range as f16 and bf16.
template <class P>
void require_same_reads(P& c, int l) {
  auto const& s = c.cpu.shape();
  std::int64_t const len = c.cpu.size(l);
  std::size_t const d = static_cast<std::size_t>(s.head_dim);
  for (int h = 0; h < s.kv_heads; ++h) {
    for (bool keys : {true, false}) {
      std::vector<float> want(static_cast<std::size_t>(len) * d);
      if (keys) {
        c.cpu.read_keys(l, h, 0, len, want.data());
      } else {
        c.cpu.read_values(l, h, 0, len, want.data());
      }
      auto const got = c.gpu.template read<float>(keys, l, h, 0, len);
      std::size_t bad = 0;
      while (bad < want.size() && kvq_test::same_value(want[bad], got[bad])) ++bad;
      INFO("layer " << l << " head " << h << (keys ? " keys" : " values") << ": first difference at element " << bad);
      REQUIRE(bad == want.size());
    }
  }
  if (len >= 3) {
    std::int64_t const first = len / 3, count = len - len / 3;
    std::vector<kvq::f16> wh(static_cast<std::size_t>(count) * d);
    std::vector<kvq::bf16> wb(wh.size());
    c.cpu.read_values(l, 0, first, count, wh.data());
    c.cpu.read_keys(l, s.kv_heads - 1, first, count, wb.data());
    auto const gh = c.gpu.template read<kvq::f16>(false, l, 0, first, count);
    auto const gb = c.gpu.template read<kvq::bf16>(true, l, s.kv_heads - 1, first, count);
    bool same = true;
    for (std::size_t i = 0; i < wh.size(); ++i)
      same = same && kvq_test::same_value(wh[i], gh[i]) && kvq_test::same_value(wb[i], gb[i]);
    CHECK(same);
  }
}

/// max |want - got| / (1 + max |want|) per head, worst over heads (NaN in one but not the other: inf).
inline auto attention_error(std::vector<float> const& want, std::vector<float> const& got, int q_heads, int d)
    -> double {
  double worst = 0;
  for (int h = 0; h < q_heads; ++h) {
    double scale = 1;
    for (int c = 0; c < d; ++c)
      scale = std::max(scale, 1.0 + std::fabs(static_cast<double>(want[static_cast<std::size_t>(h * d + c)])));
    for (int c = 0; c < d; ++c) {
      std::size_t const i = static_cast<std::size_t>(h * d + c);
      if (std::isnan(want[i]) != std::isnan(got[i])) return 1e30;
      if (std::isnan(want[i])) continue;
      worst = std::max(worst, std::fabs(static_cast<double>(want[i]) - got[i]) / scale);
    }
  }
  return worst;
}

/// Attention of the cache under test vs kvq::decode_attention on the CPU cache, same options.
template <class P>
void require_same_attention(P& c, int l, int q_heads, kvq::attention_options const& opt, std::uint32_t seed,
                            double tolerance = attention_tolerance) {
  int const d = c.cpu.shape().head_dim;
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(q_heads * d), seed, 1.5f);
  std::vector<float> want(q.size());
  kvq::decode_attention(c.cpu, l, q.data(), q_heads, want.data(), opt);
  auto const got = c.gpu.attention(l, q, q_heads, opt);
  INFO("layer " << l << " q_heads " << q_heads << " scale " << opt.scale << " window " << opt.window << " softcap "
                << opt.softcap << " q8_0 query " << (opt.query == kvq::query_precision::q8_0) << " f16 probabilities "
                << (opt.probabilities == kvq::probability_precision::f16));
  double const err = attention_error(want, got, q_heads, d);
  CHECK(err <= tolerance);
}

/// Token-major data for n tokens of every kv_head; mostly N(0,1) with outlier channels.
inline auto kv_data(std::int64_t n, int kv_heads, int d, std::uint32_t seed) -> std::vector<float> {
  return kvq_test::outlier_rows(static_cast<int>(n) * kv_heads, d, seed);
}

/// The scenario every codec runs: chunked appends (f32, f16 and bf16 input) across KIVI flushes and
/// window wrap-arounds, bytes and reads compared after each step, truncate into a tile, shift, more
/// appends, then attention with GQA and MHA, several splits, window, soft-cap, q8_0 query and f16
/// probabilities.
template <class Choice, template <class> class H>
void run_scenario(int d, int residual, cpu_options<Choice> opt, launch lo = {}, bool full_attention = true) {
  int const kv = 2;
  int const layers = 2;
  opt.residual = residual;
  lo.split_tokens = 48;
  pair_of_caches<Choice, H> c({layers, kv, d, 320}, opt, lo);
  std::uint32_t seed = static_cast<std::uint32_t>(d * 131 + residual);
  std::vector<std::int64_t> const chunks = {1, 5, 37, 1, 1, 20, 70, 3};
  for (int l = 0; l < layers; ++l) {
    int step = 0;
    for (std::int64_t n : chunks) {
      auto const k = kv_data(n, kv, d, ++seed);
      auto const v = kv_data(n, kv, d, ++seed);
      if (step % 3 == 1) {  // f16 input
        std::vector<kvq::f16> kh(k.size()), vh(v.size());
        for (std::size_t i = 0; i < k.size(); ++i) kh[i] = kvq::to_f16(k[i]), vh[i] = kvq::to_f16(v[i]);
        c.append(l, kh, vh, n);
      } else if (step % 3 == 2) {  // bf16 input
        std::vector<kvq::bf16> kb(k.size()), vb(v.size());
        for (std::size_t i = 0; i < k.size(); ++i) kb[i] = kvq::to_bf16(k[i]), vb[i] = kvq::to_bf16(v[i]);
        c.append(l, kb, vb, n);
      } else {
        c.append(l, k, v, n);
      }
      ++step;
      require_same_bytes(c, l);
    }
    require_same_reads(c, l);
  }
  // Truncate into the middle of a tile (KIVI: a lossy un-tiling), then keep appending.
  c.truncate(100);
  for (int l = 0; l < layers; ++l) {
    require_same_bytes(c, l);
    require_same_reads(c, l);
    auto const k = kv_data(45, kv, d, ++seed);
    auto const v = kv_data(45, kv, d, ++seed);
    c.append(l, k, v, 45);
    require_same_bytes(c, l);
    require_same_reads(c, l);
  }
  // Sliding window: drop 64 tokens (a multiple of G for KIVI), append again.
  c.shift_left(64);
  for (int l = 0; l < layers; ++l) {
    require_same_bytes(c, l);
    require_same_reads(c, l);
    auto const k = kv_data(33, kv, d, ++seed);
    auto const v = kv_data(33, kv, d, ++seed);
    c.append(l, k, v, 33);
    require_same_bytes(c, l);
    require_same_reads(c, l);
  }
  REQUIRE(c.gpu.memory().total_bytes == c.cpu.memory().total_bytes);
  require_same_attention(c, 0, 2 * kv, {}, ++seed);
  if (!full_attention) return;
  kvq::attention_options opt2;
  opt2.scale = 0.2f;
  opt2.window = 70;
  opt2.softcap = 8.0f;
  require_same_attention(c, 1, kv, opt2, ++seed);
  kvq::attention_options opt3;
  opt3.query = kvq::query_precision::q8_0;
  require_same_attention(c, 1, 2 * kv, opt3, ++seed);
  opt3.probabilities = kvq::probability_precision::f16;
  require_same_attention(c, 0, 2 * kv, opt3, ++seed, f16_probability_tolerance);
  // After reset: empty attention gives zeros, and the cache fills again identically.
  c.cpu.reset();
  c.gpu.reset();
  auto const zeros = c.gpu.attention(0, std::vector<float>(static_cast<std::size_t>(2 * kv * d), 1.0f), 2 * kv, {});
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
  auto const k = kv_data(40, kv, d, ++seed);
  auto const v = kv_data(40, kv, d, ++seed);
  c.append(0, k, v, 40);
  require_same_bytes(c, 0);
  require_same_attention(c, 0, 2 * kv, {}, ++seed);
}

/// GQA 32 query / 8 kv heads (and MHA 8/8) at head_dim d over `tokens` tokens appended as a prefill
/// and decode steps, with the planner's own split (no forced split size).
template <class Choice, template <class> class H>
void run_gqa(int d, std::int64_t tokens, cpu_options<Choice> opt = {}) {
  int const kv = 8;
  pair_of_caches<Choice, H> c({1, kv, d, tokens}, opt);
  std::uint32_t seed = static_cast<std::uint32_t>(d + tokens);
  std::int64_t const prefill = tokens - 3;
  c.append(0, kv_data(prefill, kv, d, seed + 1), kv_data(prefill, kv, d, seed + 2), prefill);
  seed += 2;
  for (int i = 0; i < 3; ++i, seed += 2) c.append(0, kv_data(1, kv, d, seed + 1), kv_data(1, kv, d, seed + 2), 1);
  require_same_bytes(c, 0);
  require_same_attention(c, 0, 32, {}, ++seed);
  require_same_attention(c, 0, 8, {}, ++seed);
}

/// NaN and ±Inf inputs: same bytes, same (NaN) reads, and attention NaN exactly where the CPU's is.
template <class Choice, template <class> class H>
void run_special_values(int d) {
  int const kv = 2;
  cpu_options<Choice> opt;
  opt.residual = 0;
  pair_of_caches<Choice, H> c({1, kv, d, 128}, opt);
  auto k = kv_data(64, kv, d, 7);
  auto v = kv_data(64, kv, d, 8);
  float const inf = std::numeric_limits<float>::infinity();
  k[5] = std::nanf("");
  k[static_cast<std::size_t>(3 * kv * d + 1)] = inf;
  v[static_cast<std::size_t>(10 * kv * d + d + 2)] = -inf;
  v[static_cast<std::size_t>(20 * kv * d)] = 1e30f;
  k[static_cast<std::size_t>(40 * kv * d + 3)] = -3e38f;
  k[static_cast<std::size_t>(41 * kv * d + 3)] = 3e38f;  // with the above: a KIVI group decoding to 65536
  c.append(0, k, v, 64);
  require_same_bytes(c, 0);
  require_same_reads(c, 0);
  require_same_attention(c, 0, 2 * kv, {}, 99);
  // Truncating into that group puts tokens decoded beyond 65504 back into the f16 residual
  // (saturated to ±65504 on every backend).
  c.truncate(45);
  require_same_bytes(c, 0);
  require_same_reads(c, 0);
}

/// Several caches of one shape (different lengths, one empty) in one batched attention, each
/// compared with kvq::decode_attention on its CPU twin.
template <class Choice, template <class> class H>
void run_batched(int d, int sequences, cpu_options<Choice> opt = {}) {
  int const kv = 2;
  int const q_heads = 4;
  std::vector<std::unique_ptr<pair_of_caches<Choice, H>>> pairs;
  std::uint32_t seed = 1234;
  for (int i = 0; i < sequences; ++i) {
    pairs.push_back(std::make_unique<pair_of_caches<Choice, H>>(kvq::cache_shape{1, kv, d, 400}, opt));
    std::int64_t const n = i == 1 ? 0 : 17 + (i * 97) % 380;
    if (n > 0) pairs.back()->append(0, kv_data(n, kv, d, seed + 1), kv_data(n, kv, d, seed + 2), n);
    seed += 2;
  }
  std::size_t const qd = static_cast<std::size_t>(q_heads * d);
  auto const q = kvq_test::normal_data(qd * static_cast<std::size_t>(sequences), ++seed, 1.5f);
  for (kvq::attention_options opt2 : {kvq::attention_options{}, kvq::attention_options{0.1f, 50, 0.0f}}) {
    std::vector<H<Choice>*> gpus;
    for (auto& p : pairs) gpus.push_back(&p->gpu);
    auto const got = H<Choice>::batched(gpus, 0, q, q_heads, opt2);
    for (int i = 0; i < sequences; ++i) {
      std::vector<float> want(qd);
      kvq::decode_attention(pairs[static_cast<std::size_t>(i)]->cpu, 0, q.data() + qd * static_cast<std::size_t>(i),
                            q_heads, want.data(), opt2);
      std::vector<float> mine(got.begin() + static_cast<std::ptrdiff_t>(qd * static_cast<std::size_t>(i)),
                              got.begin() + static_cast<std::ptrdiff_t>(qd * static_cast<std::size_t>(i + 1)));
      INFO("sequence " << i << " of " << sequences << " window " << opt2.window);
      CHECK(attention_error(want, mine, q_heads, d) <= attention_tolerance);
    }
  }
}

/// The name of the kvq error type `f` raises ("none" when it returns).
template <class F>
auto error_kind(F&& f) -> std::string {
  try {
    f();
  } catch (kvq::index_error const&) {
    return "index";
  } catch (kvq::shape_error const&) {
    return "shape";
  } catch (kvq::invalid_argument_error const&) {
    return "invalid_argument";
  } catch (kvq::error const&) {
    return "error";
  }
  return "none";
}

/// Multi-token attention of the cache under test vs the CPU kvq::attention on the same data, for
/// n_q query tokens under `opt` (its mask_data, when set, holds mask_bytes bytes).
template <class P>
void require_same_tokens(P& c, int l, std::int64_t n_q, int q_heads, kvq::attention_options const& opt,
                         std::size_t mask_bytes, std::uint32_t seed, double tolerance = attention_tolerance) {
  int const d = c.cpu.shape().head_dim;
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(n_q * q_heads * d), seed, 1.5f);
  std::vector<float> want(q.size(), -5.0f);
  kvq::attention(c.cpu, l, q.data(), n_q, q_heads, want.data(), opt);
  auto const got = c.gpu.attention_tokens(l, q, n_q, q_heads, opt, mask_bytes);
  INFO("layer " << l << " n_q " << n_q << " q_heads " << q_heads << " mask " << static_cast<int>(opt.mask)
                << " first_pos " << opt.first_pos << " window " << opt.window << " sinks " << (opt.sinks != nullptr)
                << " softcap " << opt.softcap << " q8_0 query " << (opt.query == kvq::query_precision::q8_0));
  double const err = attention_error(want, got, static_cast<int>(n_q) * q_heads, d);
  CHECK(err <= tolerance);
}

/// Multi-token attention (kvq::attention on the GPU cache) against the CPU's: a prefix, then a
/// chunk of 100 tokens appended (for KIVI, partly still in the residual), queried with n_q in
/// {1, 2, 7, 16, 100} causally, with no mask from a position off the tile grid, a window, an
/// additive and a boolean mask (rows that attend nothing included), sinks (also in decode
/// attention), soft-cap and a q8_0 query; n_q = 1 equals decode attention bit for bit; errors as
/// the CPU's.
template <class Choice, template <class> class H>
void run_multi_token(int d, int residual, launch lo = {}) {
  int const kv = 2;
  cpu_options<Choice> opt;
  opt.residual = residual;
  pair_of_caches<Choice, H> c({1, kv, d, 400}, opt, lo);
  std::uint32_t seed = static_cast<std::uint32_t>(d * 7 + residual);
  std::int64_t const prefix = 157;
  c.append(0, kv_data(prefix, kv, d, seed + 1), kv_data(prefix, kv, d, seed + 2), prefix);
  c.append(0, kv_data(100, kv, d, seed + 3), kv_data(100, kv, d, seed + 4), 100);
  seed += 4;
  std::int64_t const len = prefix + 100;
  for (int q_heads : {2 * kv, kv}) {
    for (std::int64_t n_q : {1, 2, 7, 16, 100}) require_same_tokens(c, 0, n_q, q_heads, {}, 0, ++seed);
  }
  int const q_heads = 2 * kv;
  // n_q = 1 with the defaults is decode attention, bit for bit.
  {
    auto const q = kvq_test::normal_data(static_cast<std::size_t>(q_heads * d), ++seed, 1.5f);
    auto const one = c.gpu.attention_tokens(0, q, 1, q_heads, {}, 0);
    auto const dec = c.gpu.attention(0, q, q_heads, {});
    CHECK(std::memcmp(one.data(), dec.data(), one.size() * 4) == 0);
  }
  // No mask, from a position off the tile grid; a window; soft-cap with a q8_0 query.
  kvq::attention_options none;
  none.mask = kvq::mask_kind::none;
  none.first_pos = 13;
  require_same_tokens(c, 0, 16, q_heads, none, 0, ++seed);
  kvq::attention_options win;
  win.window = 40;
  win.first_pos = len - 100 - 9;
  require_same_tokens(c, 0, 100, q_heads, win, 0, ++seed);
  win.mask = kvq::mask_kind::none;
  win.first_pos = 3;
  require_same_tokens(c, 0, 7, q_heads, win, 0, ++seed);
  kvq::attention_options capped;
  capped.softcap = 8.0f;
  capped.scale = 0.3f;
  capped.query = kvq::query_precision::q8_0;
  require_same_tokens(c, 0, 7, q_heads, capped, 0, ++seed);
  // Additive mask: rows (n_q, len + 5) with -Inf holes, one row all -Inf.
  {
    std::int64_t const n_q = 16, stride = len + 5;
    auto bias = kvq_test::normal_data(static_cast<std::size_t>(n_q * stride), ++seed, 2.0f);
    for (std::size_t i = 0; i < bias.size(); ++i)
      if (i % 7 == 3 || (i >= static_cast<std::size_t>(5 * stride) && i < static_cast<std::size_t>(6 * stride)))
        bias[i] = -std::numeric_limits<float>::infinity();
    kvq::attention_options add;
    add.mask = kvq::mask_kind::additive;
    add.mask_data = bias.data();
    add.mask_stride = stride;
    require_same_tokens(c, 0, n_q, q_heads, add, bias.size() * 4, ++seed);
    add.first_pos = 50;
    add.window = 64;
    require_same_tokens(c, 0, n_q, q_heads, add, bias.size() * 4, ++seed);
  }
  // Boolean mask: rows (n_q, len), a random pattern, one row that allows nothing.
  {
    std::int64_t const n_q = 100;
    std::vector<std::uint8_t> allow(static_cast<std::size_t>(n_q * len));
    auto const r = kvq_test::normal_data(allow.size(), ++seed);
    for (std::size_t i = 0; i < allow.size(); ++i)
      allow[i] = static_cast<std::uint8_t>(r[i] > -0.5f && (i / static_cast<std::size_t>(len)) != 9 ? 1 + i % 3 : 0);
    kvq::attention_options boolean;
    boolean.mask = kvq::mask_kind::boolean;
    boolean.mask_data = allow.data();
    require_same_tokens(c, 0, n_q, q_heads, boolean, allow.size(), ++seed);
  }
  // Sinks: one per query head (one -Inf), in multi-token and decode attention.
  {
    std::vector<float> sinks = {0.5f, -std::numeric_limits<float>::infinity(), 3.0f, -2.0f};
    kvq::attention_options sk;
    sk.sinks = sinks.data();
    for (std::int64_t n_q : {1, 7, 100}) require_same_tokens(c, 0, n_q, q_heads, sk, 0, ++seed);
    sk.mask = kvq::mask_kind::none;
    sk.window = 30;
    sk.first_pos = 200;
    require_same_tokens(c, 0, 16, q_heads, sk, 0, ++seed);
    kvq::attention_options dec;
    dec.sinks = sinks.data();
    dec.window = 50;
    require_same_attention(c, 0, q_heads, dec, ++seed);
    // A query attending nothing outputs zeros, sink or not.
    kvq::attention_options empty = sk;
    empty.first_pos = len + 40;
    auto const zeros = c.gpu.attention_tokens(0, std::vector<float>(static_cast<std::size_t>(2 * q_heads * d), 1.0f), 2,
                                              q_heads, empty, 0);
    CHECK(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
  }
  // Errors: the CPU's types, the cache unchanged.
  auto const q = kvq_test::normal_data(static_cast<std::size_t>(4 * q_heads * d), ++seed);
  auto same_error = [&](std::int64_t n_q, int qh, kvq::attention_options const& o) {
    std::vector<float> out(q.size());
    std::string const want = error_kind([&] { kvq::attention(c.cpu, 0, q.data(), n_q, qh, out.data(), o); });
    std::string const got = error_kind([&] { c.gpu.attention_tokens(0, q, n_q, qh, o, 0); });
    INFO("n_q " << n_q << " q_heads " << qh << " expected " << want);
    CHECK(want != "none");
    CHECK(got == want);
  };
  same_error(-1, q_heads, {});
  same_error(2, 3, {});
  kvq::attention_options past;
  past.first_pos = len - 1;
  same_error(2, q_heads, past);
  kvq::attention_options no_mask;
  no_mask.mask = kvq::mask_kind::boolean;
  same_error(2, q_heads, no_mask);
  float const nan_sinks[4] = {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f};
  kvq::attention_options bad_sink;
  bad_sink.sinks = nan_sinks;
  same_error(2, q_heads, bad_sink);
  kvq::attention_options neg;
  neg.window = -1;
  same_error(2, q_heads, neg);
  CHECK(c.gpu.size(0) == len);
}

/// Bad arguments raise the CPU cache's typed errors and leave the cache unchanged (bytes and sizes).
template <class Choice, template <class> class H>
void run_errors(int d) {
  int const kv = 2;
  cpu_options<Choice> opt;
  opt.residual = 32;
  H<Choice> g({2, kv, d, 96}, opt, launch{});
  auto const k = kv_data(40, kv, d, 3);
  g.append(0, k, k, 40);
  auto const before = g.layer_bytes(0);
  auto& core = g.core();
  using T = float;
  auto const dense = [&](std::int64_t n) { return kvq::token_major<T>(nullptr, n, kv, d); };
  kvq::kv_tensor<T> good = dense(2);
  good.data = reinterpret_cast<T const*>(&good);  // never read: every call below fails its checks
  auto bad_heads = good;
  bad_heads.kv_heads = kv + 1;
  auto overlap = good;
  overlap.token_stride = 1;
  auto null_data = good;
  null_data.data = nullptr;
  auto big = good;
  big.tokens = 57;  // 40 + 57 > 96
  auto const stream = g.stream();
  CHECK_THROWS_AS(core.append(0, bad_heads, good, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.append(0, overlap, good, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.append(0, good, null_data, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.append(0, big, big, stream), kvq::capacity_error);
  auto three = good;
  three.tokens = 3;
  CHECK_THROWS_AS(core.append(0, good, three, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.append(2, good, good, stream), kvq::index_error);
  CHECK_THROWS_AS(core.append(-1, good, good, stream), kvq::index_error);
  float* out = reinterpret_cast<float*>(&good);
  CHECK_THROWS_AS(core.read_keys(0, 0, 30, 11, out, 0, stream), kvq::index_error);
  CHECK_THROWS_AS(core.read_values(0, kv, 0, 1, out, 0, stream), kvq::index_error);
  CHECK_THROWS_AS(core.read_values(0, 0, 0, 1, out, d - 1, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.read_values(0, 0, 0, 1, static_cast<float*>(nullptr), 0, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.truncate(-1, stream), kvq::invalid_argument_error);
  CHECK_THROWS_AS(core.shift_left(64, stream), kvq::index_error);
  CHECK_THROWS_AS(core.shift_left(-2, stream), kvq::invalid_argument_error);
  if constexpr (requires { cpu_cache<Choice>::key_codec::group; })
    CHECK_THROWS_AS(core.shift_left(5, stream), kvq::unsupported_error);
  kvq::attention_options neg;
  neg.scale = -1.0f;
  CHECK_THROWS_AS(core.attention(0, out, 3, out, {}, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.attention(0, nullptr, 2, out, {}, stream), kvq::shape_error);
  CHECK_THROWS_AS(core.attention(0, out, 2, out, neg, stream), kvq::invalid_argument_error);
  CHECK_THROWS_AS(core.attention(5, out, 2, out, {}, stream), kvq::index_error);
  CHECK(g.size(0) == 40);
  CHECK(g.size(1) == 0);
  CHECK(g.layer_bytes(0) == before);
  CHECK(core.usable());
  // Invalid construction: the CPU cache's parameter checks, plus the CUDA limits.
  auto bad = [](kvq::cache_shape s, cpu_options<Choice> o, launch lo = {}) { H<Choice> h(s, o, lo); };
  CHECK_THROWS_AS(bad({0, kv, d, 64}, opt), kvq::invalid_argument_error);
  CHECK_THROWS_AS(bad({1, kv, d, std::int64_t{1} << 31}, opt), kvq::invalid_argument_error);
  CHECK_THROWS_AS(bad({1, kv, d, 64}, opt, launch{48, 0}), kvq::invalid_argument_error);
  if constexpr (requires { cpu_cache<Choice>::key_codec::group; }) {
    auto o = opt;
    o.residual = 16;
    CHECK_THROWS_AS(bad({1, kv, d, 64}, o), kvq::invalid_argument_error);
  }
  if constexpr (std::is_same_v<typename cpu_cache<Choice>::key_params, kvq::fp8_params>) {
    auto o = opt;
    o.key.scale = 0.0f;
    CHECK_THROWS_AS(bad({1, kv, d, 64}, o), kvq::invalid_argument_error);
  }
}

}  // namespace kvq_cuda_test
