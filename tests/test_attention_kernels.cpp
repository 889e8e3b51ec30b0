// Tests of the SIMD decode-attention kernels (kvq/backend/cpu/attention_kernels.hpp): every kernel
// compiled into this build (avx2 and avx512 on x86 with -march=native, neon on AArch64) against the
// scalar reference of attention.hpp, through detail::attend_range_with<Kernel>, on the same cache:
//   * every codec (and mixed pairs, KIVI with R = 0/32/128 and group sizes that take the
//     channel-scaled and the decoded key paths, tq2/3/4 read in registers or decoded), head_dim
//     8/40/80/128, group sizes 1/2/3/4/8, contexts 1 .. 300, sub-ranges that start and end off the
//     tile grid, window, soft-cap, f16 probabilities, i8 probabilities (integer P·V: with a q8_0
//     query and integer key dots the rounded weights equal the reference's, so fp32 tolerance);
//   * q8_0 query: the q8_0 / q4_0 / int8 key logits equal the reference's bit for bit (the running
//     max of a one-token range is the scaled logit itself);
//   * NaN/Inf: NaN and +Inf logits give the reference's NaN heads, -Inf logits weight 0.
// Tolerance: the kernels reorder fp32 sums (FMA, per-tile softmax, tree reductions) and use a
// polynomial exp (< 3 ulp); over <= 300 tokens of unit-scale data the outputs stay within 2e-5 of
// the reference relative to the output's norm (4e-4 with f16 probabilities, whose rounding points
// differ by the exp's ulps).
#include <kvq/attention.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/passthrough.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/tq.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.hpp"

namespace {

constexpr float inf_f = std::numeric_limits<float>::infinity();

/// Calls f(kernel, name) for every SIMD attention kernel compiled in.
template <class F>
void for_each_kernel(F&& f) {
#if defined(KVQ_CPU_HAS_AVX2)
  f(kvq::cpu_kernels::avx2::attention_kernel{}, "avx2");
#endif
#if defined(KVQ_CPU_HAS_AVX512)
  f(kvq::cpu_kernels::avx512::attention_kernel{}, "avx512");
#endif
#if defined(KVQ_CPU_HAS_NEON)
  f(kvq::cpu_kernels::neon::attention_kernel{}, "neon");
#endif
}

/// How many kernels for_each_kernel visits.
int kernel_count() {
  int n = 0;
  for_each_kernel([&](auto, char const*) { ++n; });
  return n;
}

template <class Choice>
using cache_t = kvq::QuantizedKVCache<Choice>;

/// A cache of 2 layers, kv heads, head_dim d, holding n tokens of N(0, 1) data with a few outlier
/// key channels (x8), appended in chunks of 7 (so KIVI residuals and flushes are exercised).
template <class Choice>
auto make_cache(int kv, int d, std::int64_t n, int residual, std::uint32_t seed) -> cache_t<Choice> {
  typename cache_t<Choice>::options o;
  o.residual = residual;
  cache_t<Choice> cache({2, kv, d, 320}, o);
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(n) * kv * d), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    int const c = static_cast<int>(i % static_cast<std::size_t>(d));
    k[i] = nd(gen) * (c % 17 == 3 ? 8.0f : 1.0f);
    v[i] = nd(gen);
  }
  for (std::int64_t t = 0; t < n; t += 7) {
    std::int64_t const m = std::min<std::int64_t>(7, n - t);
    std::size_t const off = static_cast<std::size_t>(t) * kv * d;
    cache.append(1, kvq::token_major(k.data() + off, m, kv, d), kvq::token_major(v.data() + off, m, kv, d));
  }
  return cache;
}

/// Token-major keys and values (n tokens, kv heads, head_dim d) of N(0, 1) samples times `scale`,
/// the keys drawn first, from `seed`.
struct random_kv {
  std::vector<float> k, v;
};
auto gaussian_kv(std::int64_t n, int kv, int d, std::uint32_t seed, float scale = 1.0f) -> random_kv {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  random_kv r{std::vector<float>(static_cast<std::size_t>(n) * static_cast<std::size_t>(kv * d)), {}};
  r.v.resize(r.k.size());
  for (auto& x : r.k) x = nd(gen) * scale;
  for (auto& x : r.v) x = nd(gen) * scale;
  return r;
}

auto queries(int q_heads, int d, std::uint32_t seed) -> std::vector<float> {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(q_heads) * d);
  for (auto& x : q) x = nd(gen);
  return q;
}

auto output(kvq::attention_partial const& p) -> std::vector<float> {
  std::vector<float> out(p.out.size());
  kvq::finalize(p, out.data());
  return out;
}

/// max over heads of ||a_h - b_h|| / max(||b_h||, 1e-30) over the finite lanes of b; NaN lanes and
/// infinite ones must agree (else +Inf).
auto rel_error(std::vector<float> const& a, std::vector<float> const& b, int q_heads, int d) -> double {
  double worst = 0.0;
  for (int h = 0; h < q_heads; ++h) {
    double diff = 0.0, norm = 0.0;
    for (int c = 0; c < d; ++c) {
      std::size_t const i = static_cast<std::size_t>(h) * d + c;
      if (std::isnan(a[i]) != std::isnan(b[i]) || (std::isinf(b[i]) && a[i] != b[i])) return inf_f;
      if (!std::isfinite(b[i])) continue;
      diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      norm += static_cast<double>(b[i]) * b[i];
    }
    worst = std::max(worst, std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30));
  }
  return worst;
}

/// Compares every kernel with the reference on one cache, query and range.
template <class Cache>
void compare(Cache const& cache, std::vector<float> const& q, int q_heads, std::int64_t begin, std::int64_t end,
             kvq::attention_options const& opt, double tol, std::string const& what) {
  int const d = cache.shape().head_dim;
  auto const ref =
      kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 1, q.data(), q_heads, begin, end, opt);
  auto const ref_out = output(ref);
  for_each_kernel([&](auto kernel, char const* name) {
    using K = decltype(kernel);
    auto const got = kvq::detail::attend_range_with<K>(cache, 1, q.data(), q_heads, begin, end, opt);
    INFO(what << ", kernel " << name << ", range [" << begin << ", " << end << ")");
    CHECK(rel_error(output(got), ref_out, q_heads, d) <= tol);
    for (int h = 0; h < q_heads; ++h) {
      std::size_t const hh = static_cast<std::size_t>(h);
      bool const empty = ref.sum[hh] == 0.0f;
      CHECK((got.sum[hh] == 0.0f) == empty);
      if (!empty && std::isfinite(ref.sum[hh]))
        CHECK(std::fabs(got.sum[hh] - ref.sum[hh]) <= 1e-5 * std::fabs(ref.sum[hh]) + 1e-30);
    }
  });
}

/// i8 probabilities over f32 logits: the SIMD and reference probabilities differ in the last
/// bits, so a weight whose scaled value lies that close to a rounding midpoint rounds the other
/// way, moving its token's contribution by one step (1/127 of the largest weight of its tile).
constexpr double i8_flip_tolerance = 2e-3;

struct layout {
  int q_heads, kv_heads;
};
constexpr layout layouts[] = {{4, 4}, {8, 2}, {6, 2}, {4, 2}, {8, 1}, {40, 1}};

/// The full matrix for one codec choice.
template <class Choice>
void check_choice(std::string const& name, int residual = 128) {
  REQUIRE(kernel_count() > 0);
  std::uint32_t base_seed = 7, many_seed = 7000;
  for (int d : {128, 80, 40, 8}) {
    for (auto const& lay : layouts) {
      if (d != 128 && lay.q_heads == 6) continue;  // keep the run short: group 3 at head_dim 128 only
      // Group 40: the transposed many-row path (rows padded to whole vectors) at two head dims,
      // with seeds of its own (the other layouts keep their data).
      if (lay.q_heads == 40 && d != 80 && d != 40) continue;
      std::uint32_t& seed = lay.q_heads == 40 ? many_seed : base_seed;
      for (std::int64_t n : {std::int64_t{1}, std::int64_t{33}, std::int64_t{300}}) {
        auto const cache = make_cache<Choice>(lay.kv_heads, d, n, residual, ++seed);
        auto const q = queries(lay.q_heads, d, ++seed);
        std::string const what = name + ", head_dim " + std::to_string(d) + ", " + std::to_string(lay.q_heads) + "/" +
                                 std::to_string(lay.kv_heads) + " heads, " + std::to_string(n) + " tokens";
        compare(cache, q, lay.q_heads, 0, n, {}, 2e-5, what);
        if (n < 300 || d == 8) continue;
        // Sub-ranges off the tile grid, the split form's building block.
        compare(cache, q, lay.q_heads, 5, 171, {}, 2e-5, what);
        compare(cache, q, lay.q_heads, 250, 299, {}, 2e-5, what);
        kvq::attention_options o;
        o.window = 77;
        compare(cache, q, lay.q_heads, 0, n, o, 2e-5, what + ", window 77");
        o = {};
        o.softcap = 5.0f;
        o.scale = 0.3f;
        compare(cache, q, lay.q_heads, 0, n, o, 2e-5, what + ", softcap 5, scale 0.3");
        o = {};
        o.probabilities = kvq::probability_precision::f16;
        compare(cache, q, lay.q_heads, 0, n, o, 4e-4, what + ", f16 probabilities");
        o = {};
        o.query = kvq::query_precision::q8_0;
        compare(cache, q, lay.q_heads, 0, n, o, 2e-5, what + ", q8_0 query");
        // Integer weights: with a q8_0 query and integer key dots the logits, probabilities (kvq's
        // exp) and hence the rounded weights equal the reference's, leaving fp32 rounding; with
        // f32 logits a weight may round the other way (one step, 1/127 of its group's largest).
        using key_stored = kvq::stored_codec_t<typename cache_t<Choice>::key_codec>;
        using value_stored = kvq::stored_codec_t<typename cache_t<Choice>::value_codec>;
        constexpr bool integer_values = kvq::cpu_kernels::integer_value_codec<value_stored>;
        o.probabilities = kvq::probability_precision::i8;
        double const i8_tol = integer_values && !kvq::detail::integer_key_dot<key_stored> ? i8_flip_tolerance : 2e-5;
        compare(cache, q, lay.q_heads, 0, n, o, i8_tol, what + ", q8_0 query, i8 probabilities");
        compare(cache, q, lay.q_heads, 5, 171, o, i8_tol, what + ", q8_0 query, i8 probabilities");
        o.window = 77;
        compare(cache, q, lay.q_heads, 0, n, o, i8_tol, what + ", q8_0 query, i8 probabilities, window 77");
        o = {};
        o.probabilities = kvq::probability_precision::i8;
        compare(cache, q, lay.q_heads, 0, n, o, integer_values ? i8_flip_tolerance : 2e-5, what + ", i8 probabilities");
      }
    }
  }
}

}  // namespace

TEST_CASE("SIMD attention matches the reference: f32 and f16 caches", "[attention_kernels]") {
  check_choice<kvq::f32_codec>("f32");
  check_choice<kvq::f16_codec>("f16");
}

TEST_CASE("SIMD attention matches the reference: q8_0, q4_0, int8", "[attention_kernels]") {
  check_choice<kvq::q8_0>("q8_0");
  check_choice<kvq::q4_0>("q4_0");
  check_choice<kvq::int8_sym>("int8");
  check_choice<kvq::kv_codecs<kvq::q8_0, kvq::q4_0>>("q8_0/q4_0");
}

TEST_CASE("SIMD attention matches the reference: fp8", "[attention_kernels]") {
  check_choice<kvq::fp8_e4m3>("fp8_e4m3");
  check_choice<kvq::fp8_e5m2>("fp8_e5m2");
}

TEST_CASE("SIMD attention matches the reference: tq2, tq3, tq4", "[attention_kernels][tq]") {
  // Head dims 128 and 80 (blocks 64 + 16) read the rows in registers on every ISA; 40 (32 + 8) and
  // 8 too on AVX2 and NEON, and through decoded rows on AVX-512 (a block smaller than 16 lanes).
  check_choice<kvq::tq4>("tq4");
  check_choice<kvq::tq3>("tq3");
  check_choice<kvq::tq2>("tq2");
  check_choice<kvq::kv_codecs<kvq::tq4, kvq::q8_0>>("tq4 keys / q8_0 values");
  check_choice<kvq::kv_codecs<kvq::f16_codec, kvq::tq3>>("f16 keys / tq3 values");
  check_choice<kvq::kv_codecs<kvq::tq<2, 12345>, kvq::tq<4, 7>>>("tq2 seed 12345 keys / tq4 seed 7 values");
}

TEST_CASE("SIMD attention: tq rows of three or more rotation blocks", "[attention_kernels][tq]") {
  // 112 = 64 + 32 + 16 and 224 = 128 + 64 + 32: the loader's block scales are looked up at every
  // prepare (rows of one block multiply the logits and the probabilities by them instead).
  std::uint32_t seed = 501;
  for (int d : {112, 224}) {
    for (auto const& lay : layouts) {
      auto check = [&](auto tag, char const* name) {
        using C = decltype(tag);
        auto const cache = make_cache<C>(lay.kv_heads, d, 300, 128, ++seed);
        auto const q = queries(lay.q_heads, d, ++seed);
        std::string const what = std::string(name) + ", head_dim " + std::to_string(d) + ", " +
                                 std::to_string(lay.q_heads) + "/" + std::to_string(lay.kv_heads) + " heads";
        compare(cache, q, lay.q_heads, 0, 300, {}, 2e-5, what);
        compare(cache, q, lay.q_heads, 5, 171, {}, 2e-5, what);
      };
      check(kvq::tq4{}, "tq4");
      check(kvq::tq3{}, "tq3");
    }
  }
}

TEST_CASE("SIMD attention: tq rows holding NaN or Inf as the reference", "[attention_kernels][tq]") {
  int const kv = 2, qh = 8;
  std::int64_t const n = 100;
  for (int d : {128, 96, 40}) {
    auto const q = queries(qh, d, 13);
    auto kvd = gaussian_kv(n, kv, d, 17);
    auto& k = kvd.k;
    auto& v = kvd.v;
    k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = inf_f;  // a poisoned key row: NaN logits
    v[static_cast<std::size_t>(70 * kv) * d + 9] = std::numeric_limits<float>::quiet_NaN();
    kvq::QuantizedKVCache<kvq::tq4> cache({2, kv, d, n});
    cache.append(1, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    compare(cache, q, qh, 0, n, {}, 2e-5, "tq4 with NaN/Inf rows, head_dim " + std::to_string(d));
    compare(cache, q, qh, 0, 40, {}, 2e-5, "tq4 before the poisoned key, head_dim " + std::to_string(d));
  }
}

TEST_CASE("SIMD attention: tq rows whose scale overflows f16 as the reference", "[attention_kernels][tq]") {
  // A row 1e6 times larger stores the scale +Inf (its norm over the centroids' is far above
  // 65504), so every decoded value is +-Inf: the logit of a key row is NaN (products of both signs),
  // and a value row's Inf or NaN channels reach the output, as the reference's per-element decode.
  int const kv = 2;
  std::int64_t const n = 100;
  for (int d : {128, 64, 96}) {
    for (int qh : {2, 8}) {
      auto const q = queries(qh, d, 19);
      auto kvd = gaussian_kv(n, kv, d, 23);
      for (int c = 0; c < d; ++c) {
        kvd.k[static_cast<std::size_t>(40 * kv + 1) * d + static_cast<std::size_t>(c)] *= 1e6f;
        kvd.v[static_cast<std::size_t>(70 * kv) * d + static_cast<std::size_t>(c)] *= 1e6f;
      }
      kvq::QuantizedKVCache<kvq::tq4> cache({2, kv, d, n});
      cache.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
      std::string const what = "tq4 with an overflowing scale, head_dim " + std::to_string(d) + ", " +
                               std::to_string(qh) + "/" + std::to_string(kv) + " heads";
      compare(cache, q, qh, 0, n, {}, 2e-5, what);
      compare(cache, q, qh, 50, n, {}, 2e-5, what + ", after the key");
    }
  }
}

TEST_CASE("SIMD attention matches the reference: KIVI", "[attention_kernels]") {
  for (int r : {0, 32, 128}) {
    check_choice<kvq::kivi<2>>("kivi2, R " + std::to_string(r), r);
    check_choice<kvq::kivi<4>>("kivi4, R " + std::to_string(r), r);
    check_choice<kvq::kivi<8>>("kivi8, R " + std::to_string(r), r);
  }
  // Group sizes: 16 and 64 take the channel-scaled key path, 8 and 24 (not a multiple of every
  // lane count) the decoded one on AVX-512.
  check_choice<kvq::kivi<4, 16>>("kivi4 G16", 32);
  check_choice<kvq::kivi<4, 64>>("kivi4 G64", 128);
  check_choice<kvq::kivi<4, 8>>("kivi4 G8", 16);
  check_choice<kvq::kivi<2, 24>>("kivi2 G24", 48);
  check_choice<kvq::kv_codecs<kvq::kivi_key<4>, kvq::f16_codec>>("kivi4 keys / f16 values", 32);
  check_choice<kvq::kv_codecs<kvq::f16_codec, kvq::kivi_value<2>>>("f16 keys / kivi2 values", 32);
}

TEST_CASE("SIMD attention: q8_0-query logits of integer-dot keys equal the reference bit for bit",
          "[attention_kernels]") {
  auto check = [](auto tag, char const* name) {
    using C = decltype(tag);
    for (int d : {128, 80, 40}) {
      auto const cache = make_cache<C>(2, d, 70, 128, 99);
      auto const q = queries(8, d, 5);
      kvq::attention_options o;
      o.query = kvq::query_precision::q8_0;
      for (std::int64_t t : {0, 1, 31, 32, 69}) {
        auto const ref =
            kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 1, q.data(), 8, t, t + 1, o);
        for_each_kernel([&](auto kernel, char const* kname) {
          auto const got = kvq::detail::attend_range_with<decltype(kernel)>(cache, 1, q.data(), 8, t, t + 1, o);
          INFO(name << ", head_dim " << d << ", token " << t << ", kernel " << kname);
          for (std::size_t h = 0; h < 8; ++h)
            CHECK(std::bit_cast<std::uint32_t>(got.max[h]) == std::bit_cast<std::uint32_t>(ref.max[h]));
        });
      }
    }
  };
  check(kvq::q8_0{}, "q8_0");
  check(kvq::q4_0{}, "q4_0");
  check(kvq::int8_sym{}, "int8");
}

TEST_CASE("SIMD attention: batched integer key dots equal integer_dot_row bit for bit", "[attention_kernels]") {
  // Random key rows (every nibble and byte value, -128 included; f16 scales over a wide range)
  // against random q8_0 query blocks: every logit of every tile position, head count and kernel.
  std::mt19937 gen(2024);
  auto f16_scale = [&] {  // finite, normal or subnormal, either sign
    std::uint16_t const exponent = static_cast<std::uint16_t>(gen() % 28u);
    return static_cast<std::uint16_t>((gen() & 0x8000u) | (exponent << 10) | (gen() & 0x3ffu));
  };
  auto check = [&](auto tag, char const* name, int d) {
    using C = decltype(tag);
    constexpr int T = kvq::cpu_kernels::attention_kernel_tile;
    int const nb = (d + 31) / 32;
    std::size_t const row_bytes = C::geometry(d).bytes();
    for (int group : {1, 2, 3, 4, 5, 8}) {
      std::vector<std::uint8_t> rows(row_bytes * T);
      for (auto& x : rows) x = static_cast<std::uint8_t>(gen());
      for (int t = 0; t < T; ++t) {
        std::uint8_t* row = rows.data() + row_bytes * static_cast<std::size_t>(t);
        if constexpr (std::is_same_v<C, kvq::int8_sym>) {
          float const scale = std::ldexp(static_cast<float>(gen() % 1000u + 1u), -static_cast<int>(gen() % 20u));
          std::memcpy(row, &scale, 4);
        } else {
          std::size_t const bb = std::is_same_v<C, kvq::q4_0> ? 18 : 34;
          for (int b = 0; b < nb; ++b) {
            std::uint16_t const sc = f16_scale();
            std::memcpy(row + bb * static_cast<std::size_t>(b), &sc, 2);
          }
        }
      }
      std::vector<kvq::detail::block_q8_0> qb(static_cast<std::size_t>(group * nb));
      for (auto& blk : qb) {
        blk.d = f16_scale();
        for (auto& c : blk.qs) c = static_cast<std::int8_t>(static_cast<int>(gen() % 255u) - 127);
      }
      std::vector<float> q_scale(qb.size());
      std::vector<std::int32_t> q_sum(qb.size());
      for (int m : {1, 5, 16, 17, 31, 32}) {
        std::uint8_t const* ptrs[T];
        for (int t = 0; t < T; ++t) ptrs[t] = rows.data() + row_bytes * static_cast<std::size_t>(t);
        for_each_kernel([&](auto kernel, char const* kname) {
          using K = decltype(kernel);
          std::vector<float> logits(static_cast<std::size_t>(group * T), -1.0f);
          K::query_block_terms(qb.data(), qb.size(), q_scale.data(), q_sum.data());
          K::template integer_logits<C>(rows.data(), row_bytes, m, qb.data(), q_scale.data(), q_sum.data(), nb, group,
                                        logits.data());
          for (int h = 0; h < group; ++h)
            for (int t = 0; t < m; ++t) {
              float const ref = kvq::detail::integer_dot_row<C>(ptrs[t], d, qb.data() + h * nb, nb);
              float const got = logits[static_cast<std::size_t>(h * T + t)];
              INFO(name << ", head_dim " << d << ", group " << group << ", m " << m << ", head " << h << ", token " << t
                        << ", kernel " << kname << ": " << got << " vs " << ref);
              CHECK(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(ref));
            }
        });
      }
    }
  };
  for (int d : {32, 64, 128, 80}) {
    check(kvq::q4_0{}, "q4_0", d);
    check(kvq::q8_0{}, "q8_0", d);
    if (d % 32 == 0) check(kvq::int8_sym{}, "int8", d);
  }
}

TEST_CASE("SIMD attention: NaN and infinite logits as the reference", "[attention_kernels]") {
  int const d = 64, kv = 2;
  std::int64_t const n = 100;
  for (int qh : {4, 68})  // group 2, and group 34 (the transposed many-row path)
    for (float poison : {std::numeric_limits<float>::quiet_NaN(), inf_f, -inf_f}) {
      INFO(qh << " query heads");
      auto q = queries(qh, d, 3);
      for (auto& x : q) x = std::fabs(x);  // positive channels: the sign of an infinite key decides the logit
      auto kvd = gaussian_kv(n, kv, d, 11);
      auto& k = kvd.k;
      auto& v = kvd.v;
      k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = poison;  // token 40, kv head 1
      kvq::QuantizedKVCache<kvq::f32_codec> cache({2, kv, d, n});
      cache.append(1, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
      compare(cache, q, qh, 0, n, {}, 2e-5, "f32 keys poisoned with " + std::to_string(poison));
      // NaN in a value row reaches every head of that kv head through the weighted sum.
      std::vector<float> v2 = v;
      v2[static_cast<std::size_t>(70 * kv) * d + 9] = std::numeric_limits<float>::quiet_NaN();
      kvq::QuantizedKVCache<kvq::f16_codec> c2({2, kv, d, n});
      c2.append(1, kvq::token_major(v.data(), n, kv, d), kvq::token_major(v2.data(), n, kv, d));
      compare(c2, q, qh, 0, n, {}, 2e-5, "NaN value");
    }
}

/// Every head_dim from 32 to 256 in steps of 32 with one query head per kv head.
template <class Choice>
void check_one_head_per_group(std::string const& name, int residual, std::uint32_t seed) {
  for (int d : {32, 64, 96, 128, 160, 224, 256})
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{17}, std::int64_t{300}}) {
      auto const cache = make_cache<Choice>(2, d, n, residual, ++seed);
      auto const q = queries(2, d, ++seed);
      std::string const what =
          name + ", head_dim " + std::to_string(d) + ", 2/2 heads, " + std::to_string(n) + " tokens";
      compare(cache, q, 2, 0, n, {}, 2e-5, what);
      if (n == 300) compare(cache, q, 2, 5, 171, {}, 2e-5, what);
    }
}

TEST_CASE("SIMD attention: q4_0 with one query head per kv head, every block count", "[attention_kernels]") {
  // One head per group takes the q4_0 kernels that apply each block's scale once per block
  // (AVX-512: the scale after the block's dot, and folded into the probability); head_dim 32 to
  // 256 covers the unrolled block counts, the general one and every remainder of four blocks.
  check_one_head_per_group<kvq::q4_0>("q4_0", 128, 900);
}

TEST_CASE("SIMD attention: KIVI values with one query head per kv head, every group count", "[attention_kernels]") {
  // One head per group takes the KIVI value kernel that folds each group's scale into the
  // probability and sums its minimum apart (AVX-512), in passes of four groups and a remainder of
  // one to three; residual 0 puts every row in codes.
  check_one_head_per_group<kvq::kivi<4>>("kivi4", 0, 950);
  check_one_head_per_group<kvq::kivi<2>>("kivi2", 0, 990);
  check_one_head_per_group<kvq::kv_codecs<kvq::f16_codec, kvq::kivi_value<4>>>("f16 keys / kivi4 values", 32, 1030);
}

TEST_CASE("SIMD attention: KIVI value groups whose scale or minimum overflows to infinity, as the reference",
          "[attention_kernels]") {
  // 1e6 in a value row makes its group's f16 scale +Inf (and -1e6 its minimum -Inf as well), +Inf
  // the scale NaN: the reference's q s + m is then +-Inf or NaN lane by lane, and the output lanes
  // of that group must show the same NaN / Inf pattern whatever the kernel's order of products.
  int const kv = 2;
  std::int64_t const n = 100;
  for (int d : {64, 128})
    for (float poison : {1e6f, -1e6f, inf_f, -inf_f})
      for (int layer_heads : {2, 8}) {  // one head per kv head, and four
        INFO("head_dim " << d << ", poison " << poison << ", " << layer_heads << " query heads");
        auto const q = queries(layer_heads, d, 51);
        auto kvd = gaussian_kv(n, kv, d, 53);
        kvd.v[static_cast<std::size_t>(70 * kv) * d + 9] = poison;  // token 70, kv head 0
        kvq::QuantizedKVCache<kvq::kivi<4>>::options o;
        o.residual = 0;
        kvq::QuantizedKVCache<kvq::kivi<4>> c4({2, kv, d, n}, o);
        c4.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        compare(c4, q, layer_heads, 0, n, {}, 2e-5, "kivi4 value poisoned");
        kvq::QuantizedKVCache<kvq::kivi<2>>::options o2;
        o2.residual = 0;
        kvq::QuantizedKVCache<kvq::kivi<2>> c2({2, kv, d, n}, o2);
        c2.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        compare(c2, q, layer_heads, 0, n, {}, 2e-5, "kivi2 value poisoned");
      }
}

TEST_CASE("SIMD attention: crafted KIVI value groups with an infinite scale or minimum, as the reference",
          "[attention_kernels]") {
  // Bytes a loaded image may hold: a group whose scale is +Inf (code 0 gives NaN, every other
  // code +Inf) or whose minimum is -Inf (every value -Inf), in a row every head attends.
  int const kv = 2;
  std::int64_t const n = 100;
  auto const craft = [&](auto& cache, int d, std::uint16_t scale, std::uint16_t min, int group) {
    auto const st = cache.value_storage(1, 0);
    std::size_t const block = st.unit_bytes / static_cast<std::size_t>(d / 32);  // 32 channels per group
    auto* blk = const_cast<std::byte*>(st.units) + 40 * st.unit_bytes + block * static_cast<std::size_t>(group);
    std::memcpy(blk, &scale, 2);
    std::memcpy(blk + 2, &min, 2);
  };
  for (int d : {64, 160})
    for (int layer_heads : {2, 8})
      for (int which = 0; which < 2; ++which) {
        INFO("head_dim " << d << ", " << layer_heads << " query heads, " << (which == 0 ? "scale +Inf" : "min -Inf"));
        auto const q = queries(layer_heads, d, 61);
        auto const kvd = gaussian_kv(n, kv, d, 63);
        std::uint16_t const scale = which == 0 ? std::uint16_t{0x7c00} : std::uint16_t{0x3c00};  // +Inf or 1
        std::uint16_t const min = which == 0 ? std::uint16_t{0xbc00} : std::uint16_t{0xfc00};    // -1 or -Inf
        kvq::QuantizedKVCache<kvq::kivi<4>>::options o;
        o.residual = 0;
        kvq::QuantizedKVCache<kvq::kivi<4>> c4({2, kv, d, n}, o);
        c4.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        craft(c4, d, scale, min, d / 32 - 1);
        compare(c4, q, layer_heads, 0, n, {}, 2e-5, "kivi4 crafted value group");
        kvq::QuantizedKVCache<kvq::kivi<2>>::options o2;
        o2.residual = 0;
        kvq::QuantizedKVCache<kvq::kivi<2>> c2({2, kv, d, n}, o2);
        c2.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        craft(c2, d, scale, min, 0);
        compare(c2, q, layer_heads, 0, n, {}, 2e-5, "kivi2 crafted value group");
      }
}

TEST_CASE("SIMD attention: q4_0 blocks whose scale overflows to infinity, as the reference", "[attention_kernels]") {
  // An element of 1e6 makes its block's f16 scale -Inf while the other codes stay spread, so the
  // reference's (n - 8) d holds +-Inf and NaN (n = 8): keys give infinite or NaN logits, values
  // infinite or NaN output lanes, and the kernels must give the same NaN pattern; +Inf input too.
  // The query and its negation: a logit taken as -Inf (weight 0) where the reference's is NaN
  // would show in one of them.
  for (int d : {64, 128})
    for (float poison : {1e6f, -1e6f, inf_f})
      for (float sign : {1.0f, -1.0f}) {
        INFO("head_dim " << d << ", poison " << poison << ", query sign " << sign);
        int const kv = 2;
        std::int64_t const n = 100;
        auto q = queries(kv, d, 31);
        for (auto& x : q) x *= sign;
        auto kvd = gaussian_kv(n, kv, d, 17);
        std::vector<float> k = kvd.k;
        k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = poison;  // token 40, kv head 1
        kvq::QuantizedKVCache<kvq::q4_0> keys({2, kv, d, n});
        keys.append(1, kvq::token_major(k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        compare(keys, q, kv, 0, n, {}, 2e-5, "q4_0 key poisoned");
        std::vector<float> v = kvd.v;
        v[static_cast<std::size_t>(70 * kv) * d + 9] = poison;  // token 70, kv head 0
        kvq::QuantizedKVCache<kvq::q4_0> values({2, kv, d, n});
        values.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
        compare(values, q, kv, 0, n, {}, 2e-5, "q4_0 value poisoned");
      }
}

TEST_CASE("SIMD attention: a crafted q4_0 key block with an infinite scale, as the reference", "[attention_kernels]") {
  // Bytes a loaded image may hold: scale +Inf, channel 0's code 8 (the reference's 0 * Inf makes
  // the logit NaN) and every other code one step against its query channel's sign, so each lane
  // of a block's scaled dot is -Inf: a kernel keeping that logit would weigh the token 0 instead.
  int const kv = 2;
  std::int64_t const n = 100;
  for (int d : {64, 128}) {
    INFO("head_dim " << d);
    auto const q = queries(kv, d, 41);
    auto const kvd = gaussian_kv(n, kv, d, 43);
    kvq::QuantizedKVCache<kvq::q4_0> cache({2, kv, d, n});
    cache.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
    auto const st = cache.key_storage(1, 1);
    auto* row = const_cast<std::byte*>(st.units) + 40 * st.unit_bytes;  // token 40, kv head 1, block 0
    std::uint16_t const inf_scale = 0x7c00;
    std::memcpy(row, &inf_scale, 2);
    float const* qh = q.data() + d;  // query head 1
    auto const code = [&](int c) { return c == 0 ? 8 : qh[c] > 0.0f ? 7 : 9; };
    for (int i = 0; i < 16; ++i) row[2 + i] = static_cast<std::byte>(code(i) | code(i + 16) << 4);
    compare(cache, q, kv, 0, n, {}, 2e-5, "q4_0 key block with an infinite scale");
  }
}

TEST_CASE("SIMD attention: fp8 with a scale, and E5M2 infinities", "[attention_kernels]") {
  int const d = 128, kv = 2, qh = 8;
  std::int64_t const n = 90;
  auto const q = queries(qh, d, 21);
  auto kvd = gaussian_kv(n, kv, d, 5, 3.0f);
  auto& k = kvd.k;
  auto& v = kvd.v;
  auto run = [&](auto tag, float scale, kvq::fp8_overflow overflow, std::string const& what) {
    using C = decltype(tag);
    typename kvq::QuantizedKVCache<C>::options o;
    o.key = o.value = kvq::fp8_params{scale, overflow};
    kvq::QuantizedKVCache<C> cache({2, kv, d, n}, o);
    cache.append(1, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    compare(cache, q, qh, 0, n, {}, 2e-5, what);
  };
  run(kvq::fp8_e4m3{}, 0.37f, kvq::fp8_overflow::saturate, "e4m3, scale 0.37");
  run(kvq::fp8_e5m2{}, 3.0e-3f, kvq::fp8_overflow::saturate, "e5m2, scale 3e-3 (saturated codes)");
  run(kvq::fp8_e4m3{}, 1e-4f, kvq::fp8_overflow::saturate, "e4m3, scale 1e-4 (saturated codes)");
  // E5M2 without saturation: values beyond the range become +-Inf codes; a value row holding one
  // gives NaN/Inf outputs exactly where the reference does.
  v[static_cast<std::size_t>(30 * kv + 1) * d + 3] = 1e30f;
  run(kvq::fp8_e5m2{}, 1.0f, kvq::fp8_overflow::no_saturate, "e5m2, an infinite value");
  // E4M3 NaN codes (0x7f, 0xff) in one key tile and one value tile: those tiles take the exact
  // decode, the others the f16 conversion; a scale whose 2^8 multiple overflows takes it everywhere.
  v[static_cast<std::size_t>(30 * kv + 1) * d + 3] = 1.0f;
  k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = std::numeric_limits<float>::quiet_NaN();
  v[static_cast<std::size_t>(70 * kv) * d + 9] = -std::numeric_limits<float>::quiet_NaN();
  run(kvq::fp8_e4m3{}, 0.37f, kvq::fp8_overflow::saturate, "e4m3, NaN codes in a key and a value tile");
  k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = 1.0f;
  v[static_cast<std::size_t>(70 * kv) * d + 9] = 1.0f;
  run(kvq::fp8_e4m3{}, 3.0e37f, kvq::fp8_overflow::saturate, "e4m3, scale 3e37 (its 2^8 multiple overflows)");
}

TEST_CASE("SIMD attention: fp8 rows whose largest code times the scale overflows, as the reference",
          "[attention_kernels]") {
  // Kernels may fold an fp8 scale into the query or the probabilities, which moves where a product
  // overflows: with a scale this large, a crafted largest code (E4M3 448, E5M2 57344) decodes to
  // +Inf in the reference (code times scale), in a key row and in a value row, and the logits and
  // output lanes must be infinite or NaN exactly where the reference's are.
  int const kv = 2;
  std::int64_t const n = 90;
  auto run = [&](auto tag, float scale, std::uint8_t largest, char const* what) {
    using C = decltype(tag);
    for (int d : {64, 128})
      for (int qh : {2, 8}) {
        INFO(what << ", head_dim " << d << ", " << qh << " query heads");
        auto const q = queries(qh, d, 71);
        auto const kvd = gaussian_kv(n, kv, d, 73, scale);
        typename kvq::QuantizedKVCache<C>::options o;
        o.key = o.value = kvq::fp8_params{scale, kvq::fp8_overflow::saturate};
        kvq::QuantizedKVCache<C> cache({2, kv, d, n}, o);
        cache.append(1, kvq::token_major(kvd.k.data(), n, kv, d), kvq::token_major(kvd.v.data(), n, kv, d));
        compare(cache, q, qh, 0, n, {}, 2e-5, std::string(what) + ", every code finite once scaled");
        auto const vs = cache.value_storage(1, 0);
        const_cast<std::byte*>(vs.units)[30 * vs.unit_bytes + 3] = static_cast<std::byte>(largest);
        compare(cache, q, qh, 0, n, {}, 2e-5, std::string(what) + ", a value code of +Inf once scaled");
        auto const ks = cache.key_storage(1, 1);
        const_cast<std::byte*>(ks.units)[40 * ks.unit_bytes + 5] = static_cast<std::byte>(largest | 0x80);
        compare(cache, q, qh, 0, n, {}, 2e-5, std::string(what) + ", and a key code of -Inf once scaled");
      }
  };
  run(kvq::fp8_e4m3{}, 1e36f, 0x7e, "e4m3, scale 1e36");
  run(kvq::fp8_e5m2{}, 1e35f, 0x7b, "e5m2, scale 1e35");
}

TEST_CASE("SIMD attention: FP4 rows with a scale, NaN and Inf as the reference", "[attention_kernels][fp4]") {
  int const kv = 2, qh = 8;
  std::int64_t const n = 100;
  for (int d : {128, 96, 40}) {
    auto const q = queries(qh, d, 23);
    auto kvd = gaussian_kv(n, kv, d, 29);
    auto& k = kvd.k;
    auto& v = kvd.v;
    auto run = [&](auto tag, float scale, std::string const& what) {
      using C = decltype(tag);
      typename kvq::QuantizedKVCache<C>::options o;
      o.key = o.value = kvq::fp4_params{scale};
      kvq::QuantizedKVCache<C> cache({2, kv, d, n}, o);
      cache.append(1, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
      std::string const label = what + ", scale " + std::to_string(scale) + ", head_dim " + std::to_string(d);
      compare(cache, q, qh, 0, n, {}, 2e-5, label);
      compare(cache, q, qh, 0, 40, {}, 2e-5, label + ", before token 40");
    };
    for (float scale : {1.0f, 0.37f}) {
      run(kvq::mxfp4{}, scale, "mxfp4");
      run(kvq::nvfp4{}, scale, "nvfp4");
    }
    // A poisoned key block (NaN logits from token 40 on one kv head) and a poisoned value block.
    k[static_cast<std::size_t>(40 * kv + 1) * d + 5] = inf_f;
    v[static_cast<std::size_t>(70 * kv) * d + 9] = std::numeric_limits<float>::quiet_NaN();
    run(kvq::mxfp4{}, 1.0f, "mxfp4 with NaN/Inf blocks");
    run(kvq::nvfp4{}, 1.0f, "nvfp4 with NaN/Inf sub-blocks");
  }
}

namespace {

/// Every kernel against the reference through the multi-token driver (attention_with<Kernel>):
/// n_q query tokens of `layouts` heads over the cache's layer 1, with masks, window and sinks.
template <class Choice>
void check_multi_token(std::string const& name) {
  REQUIRE(kernel_count() > 0);
  std::uint32_t seed = 91;
  for (auto const& lay : layouts) {
    int const d = 64;
    std::int64_t const n = 300;
    auto const cache = make_cache<Choice>(lay.kv_heads, d, n, 32, ++seed);
    for (std::int64_t n_q : {2, 7, 40}) {
      std::vector<float> q;
      for (std::int64_t i = 0; i < n_q; ++i) {
        auto const qi = queries(lay.q_heads, d, ++seed);
        q.insert(q.end(), qi.begin(), qi.end());
      }
      std::vector<std::uint8_t> allow(static_cast<std::size_t>(n_q * n));
      for (std::size_t i = 0; i < allow.size(); ++i) allow[i] = (i * 7919u) % 5u != 0u;
      std::vector<float> sinks(static_cast<std::size_t>(lay.q_heads), 0.5f);
      for (int variant = 0; variant < 4; ++variant) {
        kvq::attention_options o;
        if (variant == 1) {
          o.window = 45;
          o.sinks = sinks.data();
        }
        if (variant == 2) {
          o.mask = kvq::mask_kind::boolean;
          o.mask_data = allow.data();
        }
        if (variant == 3) {
          o.mask = kvq::mask_kind::none;
          o.first_pos = 101;
          o.query = kvq::query_precision::q8_0;
        }
        std::vector<float> ref(q.size()), got(q.size());
        kvq::detail::attention_with<kvq::detail::reference_attention>(cache, 1, q.data(), n_q, lay.q_heads, ref.data(),
                                                                      o, 1);
        for_each_kernel([&](auto kernel, char const* kname) {
          using K = decltype(kernel);
          kvq::detail::attention_with<K>(cache, 1, q.data(), n_q, lay.q_heads, got.data(), o, 1);
          INFO(name << ", kernel " << kname << ", " << lay.q_heads << "/" << lay.kv_heads << " heads, n_q " << n_q
                    << ", variant " << variant);
          CHECK(rel_error(got, ref, static_cast<int>(n_q) * lay.q_heads, d) <= 2e-5);
        });
      }
    }
  }
}

}  // namespace

TEST_CASE("SIMD multi-token attention matches the reference for every codec", "[attention_kernels][multi]") {
  check_multi_token<kvq::f32_codec>("f32");
  check_multi_token<kvq::f16_codec>("f16");
  check_multi_token<kvq::q8_0>("q8_0");
  check_multi_token<kvq::q4_0>("q4_0");
  check_multi_token<kvq::int8_sym>("int8");
  check_multi_token<kvq::fp8_e4m3>("fp8_e4m3");
  check_multi_token<kvq::kivi<2>>("kivi2");
  check_multi_token<kvq::kivi<4, 16>>("kivi4 G16");
  check_multi_token<kvq::kv_codecs<kvq::mxfp4, kvq::nvfp4>>("mxfp4/nvfp4");
  check_multi_token<kvq::tq4>("tq4");
  check_multi_token<kvq::kv_codecs<kvq::tq2, kvq::tq3>>("tq2/tq3");
}
