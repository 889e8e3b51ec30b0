// Tests of key centering (kvq/codec/centered.hpp): the codec's names and stored codec, the μ
// policy (fixed by the first append into an empty layer, kept by truncate and shift, cleared when
// the layer empties), reads (decode + μ), attention against a float64 reference over the cache's
// own keys (read_keys: dequantized + μ) and values, with soft-cap and sinks (where the q·μ offset
// does not cancel), decode, split, multi-token and paged forms, every SIMD kernel against the
// scalar reference, and saving / loading (μ restored; a mismatching image rejected).
#include <kvq/attention.hpp>
#include <kvq/codec/centered.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch_compat.hpp"

namespace {

using ctr_q4 = kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::q4_0>;
using ctr_rot_q4 = kvq::kv_codecs<kvq::centered<kvq::rotated<kvq::q4_0>>, kvq::rotated<kvq::q4_0>>;
using ctr_kivi4 = kvq::kv_codecs<kvq::centered<kvq::kivi_key<4>>, kvq::kivi_value<4>>;

constexpr int kv = 2, q_heads = 4, d = 40;

/// Keys with a large per-channel offset (what centering removes) and N(0, 1) values, (n, kv, d).
auto keys_and_values(std::int64_t n, std::uint32_t seed) -> std::pair<std::vector<float>, std::vector<float>> {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<std::size_t>(n) * kv * d), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    int const c = static_cast<int>(i % d);
    k[i] = nd(gen) + (c % 5 == 1 ? 12.0f : 0.5f * static_cast<float>(c % 3));
    v[i] = nd(gen);
  }
  return {k, v};
}

/// A cache of 2 layers holding n tokens appended in chunks of `chunk`.
template <class Cache>
void fill(Cache& cache, std::int64_t n, std::int64_t chunk, std::uint32_t seed) {
  auto const [k, v] = keys_and_values(n, seed);
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < n; t += chunk) {
      std::int64_t const m = std::min(chunk, n - t);
      std::size_t const off = static_cast<std::size_t>(t) * kv * d;
      cache.append(l, kvq::token_major(k.data() + off, m, kv, d), kvq::token_major(v.data() + off, m, kv, d));
    }
}

auto queries(int rows, std::uint32_t seed) -> std::vector<float> {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(rows) * q_heads * d);
  for (auto& x : q) x = nd(gen);
  return q;
}

/// Float64 attention of one query token (q_heads, d) over tokens [0, end) of `layer`, the keys and
/// values as the cache reads them back.
template <class Cache>
auto reference(Cache const& cache, int layer, float const* q, std::int64_t end, kvq::attention_options const& o)
    -> std::vector<double> {
  std::vector<double> out(static_cast<std::size_t>(q_heads) * d, 0.0);
  int const group = q_heads / kv;
  double const scale = o.scale > 0.0f ? o.scale : 1.0 / std::sqrt(static_cast<double>(d));
  for (int h = 0; h < q_heads; ++h) {
    std::vector<float> k(static_cast<std::size_t>(std::max<std::int64_t>(end, 1)) * d), v(k.size());
    cache.read_keys(layer, h / group, 0, end, k.data());
    cache.read_values(layer, h / group, 0, end, v.data());
    std::vector<double> s(static_cast<std::size_t>(end));
    double mx = o.sinks != nullptr ? static_cast<double>(o.sinks[h]) : -INFINITY;
    for (std::int64_t t = 0; t < end; ++t) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[h * d + c]) * k[static_cast<std::size_t>(t * d + c)];
      double x = dot * scale;
      if (o.softcap > 0.0f) x = o.softcap * std::tanh(x / o.softcap);
      s[static_cast<std::size_t>(t)] = x;
      mx = std::max(mx, x);
    }
    double sum = o.sinks != nullptr ? std::exp(o.sinks[h] - mx) : 0.0;
    for (std::int64_t t = 0; t < end; ++t) {
      double const p = std::exp(s[static_cast<std::size_t>(t)] - mx);
      sum += p;
      for (int c = 0; c < d; ++c)
        out[static_cast<std::size_t>(h * d + c)] += p * v[static_cast<std::size_t>(t * d + c)];
    }
    for (int c = 0; c < d; ++c) out[static_cast<std::size_t>(h * d + c)] /= sum;
  }
  return out;
}

/// max |a − b| / max |b|.
auto rel_err(float const* a, std::vector<double> const& b) -> double {
  double e = 0.0, n = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    e = std::max(e, std::abs(static_cast<double>(a[i]) - b[i]));
    n = std::max(n, std::abs(b[i]));
  }
  return e / n;
}

/// The attention options of the soft-cap and sink cases.
auto option_cases() -> std::vector<std::pair<std::string, kvq::attention_options>> {
  static float const sinks[q_heads] = {0.5f, -1.0f, 2.0f, -INFINITY};
  kvq::attention_options plain, cap, sink, both;
  cap.softcap = 3.0f;
  sink.sinks = sinks;
  both.softcap = 3.0f;
  both.sinks = sinks;
  return {{"plain", plain}, {"softcap", cap}, {"sinks", sink}, {"softcap+sinks", both}};
}

}  // namespace

TEST_CASE("centered: names, stored codec and rotation", "[centered]") {
  using c = kvq::centered<kvq::q4_0>;
  using cr = kvq::centered<kvq::rotated<kvq::q4_0>>;
  STATIC_REQUIRE(kvq::centered_codec<c>);
  STATIC_REQUIRE(!kvq::centered_codec<kvq::q4_0>);
  STATIC_REQUIRE(!kvq::rotated_codec<c>);
  STATIC_REQUIRE(kvq::rotated_codec<cr>);
  STATIC_REQUIRE(std::is_same_v<kvq::stored_codec_t<c>, kvq::q4_0>);
  STATIC_REQUIRE(std::is_same_v<kvq::stored_codec_t<cr>, kvq::q4_0>);
  STATIC_REQUIRE(std::is_same_v<kvq::stored_codec_t<kvq::centered<kvq::kivi_key<4>>>, kvq::kivi_key<4>>);
  STATIC_REQUIRE(kvq::centered<kvq::kivi_key<4>>::group == 32);
  CHECK(c::name == "ctr-q4_0");
  CHECK(cr::name == "ctr-rot-q4_0");
  CHECK(c::geometry(d).bytes() == kvq::q4_0::geometry(d).bytes());
}

TEST_CASE("centered: mu is the first chunk's mean, kept while tokens remain", "[centered]") {
  kvq::QuantizedKVCache<ctr_q4> cache({2, kv, d, 64});
  auto const kv_rows = keys_and_values(20, 3);
  auto const& k = kv_rows.first;
  auto const& v = kv_rows.second;
  auto mean_of = [&](std::int64_t t0, std::int64_t n, int h, int c) {  // f32 sum in token order, f32 divide
    float s = 0.0f;
    for (std::int64_t t = t0; t < t0 + n; ++t) s += k[static_cast<std::size_t>((t * kv + h) * d + c)];
    return s / static_cast<float>(n);
  };
  cache.append(0, kvq::token_major(k.data(), 8, kv, d), kvq::token_major(v.data(), 8, kv, d));
  for (int h = 0; h < kv; ++h)
    for (int c = 0; c < d; ++c) CHECK(cache.key_mean(0, h)[c] == mean_of(0, 8, h, c));
  for (int c = 0; c < d; ++c) CHECK(cache.key_mean(1, 0)[c] == 0.0f);  // layer 1 is empty
  std::vector<float> const first(cache.key_mean(0, 1), cache.key_mean(0, 1) + d);
  cache.append(0, kvq::token_major(k.data() + 8 * kv * d, 12, kv, d),
               kvq::token_major(v.data() + 8 * kv * d, 12, kv, d));
  CHECK(std::vector<float>(cache.key_mean(0, 1), cache.key_mean(0, 1) + d) == first);
  cache.truncate(5);
  CHECK(std::vector<float>(cache.key_mean(0, 1), cache.key_mean(0, 1) + d) == first);
  cache.shift_left(2);
  CHECK(std::vector<float>(cache.key_mean(0, 1), cache.key_mean(0, 1) + d) == first);
  cache.truncate(0);
  for (int c = 0; c < d; ++c) CHECK(cache.key_mean(0, 1)[c] == 0.0f);
  // The next append into the empty layer fixes a new mean: the chunk's.
  cache.append(0, kvq::token_major(k.data() + 4 * kv * d, 3, kv, d), kvq::token_major(v.data(), 3, kv, d));
  CHECK(cache.key_mean(0, 1)[7] == mean_of(4, 3, 1, 7));
  cache.reset();
  CHECK(cache.key_mean(0, 1)[7] == 0.0f);
  cache.append(0, kvq::token_major(k.data(), 4, kv, d), kvq::token_major(v.data(), 4, kv, d));
  cache.shift_left(4);
  CHECK(cache.size(0) == 0);
  CHECK(cache.key_mean(0, 1)[7] == 0.0f);
  // Non-finite keys take no part in the mean (they poison their own blocks only).
  std::vector<float> bad(k.begin(), k.begin() + 3 * kv * d);
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  bad[kv * d + 5] = std::numeric_limits<float>::infinity();
  cache.append(1, kvq::token_major(bad.data(), 3, kv, d), kvq::token_major(v.data(), 3, kv, d));
  CHECK(cache.key_mean(1, 0)[5] == k[static_cast<std::size_t>(2 * kv * d + 5)]);
  CHECK(std::isfinite(cache.key_mean(1, 0)[6]));
  float row[d];
  cache.read_keys(1, 0, 1, 1, row);
  CHECK(std::isnan(row[5]));  // Inf − μ, quantized with the block: NaN as for plain q4_0
}

TEST_CASE("centered: reads return the stored codec's decode plus mu", "[centered]") {
  auto check_reads = [](auto& cache, bool rotated) {
    fill(cache, 37, 37, 5);
    int const h = 1;
    std::vector<float> got(37 * d);
    cache.read_keys(0, h, 0, 37, got.data());
    kvq::storage_view const sv = cache.key_storage(0, h);
    kvq::detail::row_rotation const rot(d, kvq::default_rotation_seed);
    auto const [k, v] = keys_and_values(37, 5);
    for (int t = 0; t < 37; ++t) {
      float y[d];
      kvq::q4_0::decode_row(
          reinterpret_cast<std::uint8_t const*>(sv.units) + static_cast<std::size_t>(t) * sv.unit_bytes, d, y);
      if (rotated) rot.inverse(y);
      for (int c = 0; c < d; ++c) {
        float const want = y[c] + cache.key_mean(0, h)[c];
        REQUIRE(got[static_cast<std::size_t>(t * d + c)] == want);
        CHECK(std::abs(want - k[static_cast<std::size_t>((t * kv + h) * d + c)]) < 1.0f);
      }
    }
    // f16 reads: the f32 read rounded once.
    std::vector<kvq::f16> half(37 * d);
    cache.read_keys(0, h, 0, 37, half.data());
    for (std::size_t i = 0; i < half.size(); ++i) REQUIRE(half[i].bits == kvq::to_f16(got[i]).bits);
    // Centering cuts the error: the stored rows' scales no longer cover the channel offsets.
    kvq::QuantizedKVCache<kvq::q4_0> plain({2, kv, d, 64});
    fill(plain, 37, 37, 5);
    std::vector<float> p(37 * d);
    plain.read_keys(0, h, 0, 37, p.data());
    double ec = 0.0, ep = 0.0;
    for (int t = 0; t < 37; ++t)
      for (int c = 0; c < d; ++c) {
        double const x = k[static_cast<std::size_t>((t * kv + h) * d + c)];
        ec += std::pow(got[static_cast<std::size_t>(t * d + c)] - x, 2);
        ep += std::pow(p[static_cast<std::size_t>(t * d + c)] - x, 2);
      }
    CHECK(ec < 0.5 * ep);
  };
  SECTION("ctr-q4_0") {
    kvq::QuantizedKVCache<ctr_q4> c({2, kv, d, 64});
    check_reads(c, false);
  }
  SECTION("ctr-rot-q4_0") {
    kvq::QuantizedKVCache<ctr_rot_q4> c({2, kv, d, 64});
    check_reads(c, true);
  }
}

TEST_CASE("centered: attention equals the float64 reference over the cache's keys", "[centered][attention]") {
  auto run = [](auto& cache) {
    fill(cache, 150, 50, 7);
    auto const q = queries(3, 11);
    for (auto const& [name, o] : option_cases()) {
      INFO(name);
      std::vector<float> out(q_heads * d);
      auto const ref = reference(cache, 1, q.data(), 150, o);
      kvq::decode_attention(cache, 1, q.data(), q_heads, out.data(), o);
      CHECK(rel_err(out.data(), ref) < 2e-5);
      kvq::decode_attention_parallel(cache, 1, q.data(), q_heads, out.data(), 3, o);
      CHECK(rel_err(out.data(), ref) < 2e-5);
      // The scalar reference kernel.
      auto part =
          kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 1, q.data(), q_heads, 0, 150, o);
      kvq::finalize(part, out.data(), o.sinks);
      CHECK(rel_err(out.data(), ref) < 2e-5);
      // Multi-token: three causal queries at positions 147..149 (the last one is decode attention).
      kvq::attention_options m = o;
      std::vector<float> outs(3 * q_heads * d);
      kvq::attention(cache, 1, q.data(), 3, q_heads, outs.data(), m, 2);
      for (int i = 0; i < 3; ++i)
        CHECK(rel_err(outs.data() + i * q_heads * d, reference(cache, 1, q.data() + i * q_heads * d, 148 + i, o)) <
              2e-5);
    }
  };
  SECTION("ctr-q4_0") {
    kvq::QuantizedKVCache<ctr_q4> c({2, kv, d, 160});
    run(c);
  }
  SECTION("ctr-rot-q4_0") {
    kvq::QuantizedKVCache<ctr_rot_q4> c({2, kv, d, 160});
    run(c);
  }
  SECTION("ctr-kivi4 (R = 32: tiles and the f16 residual)") {
    kvq::QuantizedKVCache<ctr_kivi4>::options opt;
    opt.residual = 32;
    kvq::QuantizedKVCache<ctr_kivi4> c({2, kv, d, 160}, opt);
    run(c);
  }
}

TEST_CASE("centered: the logit offset is needed where it does not cancel", "[centered][attention]") {
  // Dropping the offset (row_offset = nullptr) leaves plain softmax unchanged but moves the
  // soft-capped and the sink cases: the test above would fail without it.
  kvq::QuantizedKVCache<ctr_q4> cache({2, kv, d, 160});
  fill(cache, 100, 100, 9);
  auto const q = queries(1, 4);
  for (auto const& [name, o] : option_cases()) {
    INFO(name);
    auto const ref = reference(cache, 0, q.data(), 100, o);
    int const group = q_heads / kv;
    auto const pq = kvq::detail::prepare_query<ctr_q4::key_codec>(q.data(), q_heads, d, o);
    auto const call = kvq::detail::attention_call_of(d, group, o);
    auto part = kvq::attention_partial::empty(q_heads, d);
    kvq::cpu_kernels::attention_scratch scratch;
    for (int kh = 0; kh < kv; ++kh) {
      kvq::cpu_kernels::attention_state st{part.out.data() + kh * group * d, part.max.data() + kh * group,
                                           part.sum.data() + kh * group};
      kvq::detail::reference_attention::attend<kvq::q4_0, kvq::q4_0>(
          kvq::detail::token_source_of(cache.key_storage(0, kh)), {},
          kvq::detail::token_source_of(cache.value_storage(0, kh)), {}, call, pq.query(kh * group), nullptr, 0, 100, st,
          scratch);
    }
    std::vector<float> out(q_heads * d);
    kvq::finalize(part, out.data(), o.sinks);
    if (o.softcap == 0.0f && o.sinks == nullptr) {
      CHECK(rel_err(out.data(), ref) < 2e-5);
    } else {
      CHECK(rel_err(out.data(), ref) > 1e-2);
    }
  }
}

TEST_CASE("centered: every SIMD kernel agrees with the scalar reference", "[centered][attention][simd]") {
  kvq::QuantizedKVCache<ctr_rot_q4> cache({2, kv, d, 320});
  fill(cache, 300, 64, 13);
  auto const q = queries(1, 6);
  auto check_kernel = [&](auto kernel, char const* isa) {
    using K = decltype(kernel);
    for (auto const& [name, o] : option_cases()) {
      INFO(isa << " " << name);
      auto const a = kvq::detail::attend_range_with<K>(cache, 0, q.data(), q_heads, 5, 290, o);
      auto const r =
          kvq::detail::attend_range_with<kvq::detail::reference_attention>(cache, 0, q.data(), q_heads, 5, 290, o);
      std::vector<float> oa(q_heads * d), orf(q_heads * d);
      kvq::finalize(a, oa.data(), o.sinks);
      kvq::finalize(r, orf.data(), o.sinks);
      CHECK(rel_err(oa.data(), std::vector<double>(orf.begin(), orf.end())) < 2e-5);
      for (int h = 0; h < q_heads; ++h) CHECK(std::abs(a.max[h] - r.max[h]) <= 1e-4f * std::abs(r.max[h]) + 1e-5f);
    }
  };
  int n = 0;
#if defined(KVQ_CPU_HAS_AVX2)
  check_kernel(kvq::cpu_kernels::avx2::attention_kernel{}, "avx2");
  ++n;
#endif
#if defined(KVQ_CPU_HAS_AVX512)
  check_kernel(kvq::cpu_kernels::avx512::attention_kernel{}, "avx512");
  ++n;
#endif
#if defined(KVQ_CPU_HAS_NEON)
  check_kernel(kvq::cpu_kernels::neon::attention_kernel{}, "neon");
  ++n;
#endif
  check_kernel(kvq::detail::reference_attention{}, "scalar");
  CHECK(n >= 0);
}

TEST_CASE("centered: paged sequences keep their own mu; fork copies it", "[centered][paged]") {
  kvq::PagedKVCache<ctr_q4> paged({2, kv, d, 16, 64, 4});
  kvq::QuantizedKVCache<ctr_q4> flat({2, kv, d, 160});
  auto const [k, v] = keys_and_values(90, 21);
  auto const s = paged.add_sequence();
  for (int l = 0; l < 2; ++l) {
    paged.append(s, l, kvq::token_major(k.data(), 40, kv, d), kvq::token_major(v.data(), 40, kv, d));
    flat.append(l, kvq::token_major(k.data(), 40, kv, d), kvq::token_major(v.data(), 40, kv, d));
  }
  auto const child = paged.fork(s);
  for (int c = 0; c < d; ++c) {
    REQUIRE(paged.key_mean(child, 1, 1)[c] == flat.key_mean(1, 1)[c]);
    REQUIRE(paged.key_mean(s, 1, 1)[c] == flat.key_mean(1, 1)[c]);
  }
  for (int l = 0; l < 2; ++l) {
    paged.append(child, l, kvq::token_major(k.data() + 40 * kv * d, 50, kv, d),
                 kvq::token_major(v.data() + 40 * kv * d, 50, kv, d));
    flat.append(l, kvq::token_major(k.data() + 40 * kv * d, 50, kv, d),
                kvq::token_major(v.data() + 40 * kv * d, 50, kv, d));
  }
  std::vector<float> a(90 * d), b(90 * d);
  paged.read_keys(child, 1, 0, 0, 90, a.data());
  flat.read_keys(1, 0, 0, 90, b.data());
  CHECK(a == b);
  auto const q = queries(1, 8);
  float const sinks[q_heads] = {0.5f, -1.0f, 2.0f, 1.0f};
  kvq::attention_options o;
  o.softcap = 3.0f;
  o.sinks = sinks;
  std::vector<float> pout(q_heads * d), fout(q_heads * d);
  kvq::sequence_id const seqs[] = {child};
  kvq::paged_decode_attention(paged, 1, std::span<kvq::sequence_id const>(seqs), q.data(), q_heads, pout.data(), o);
  kvq::decode_attention(flat, 1, q.data(), q_heads, fout.data(), o);
  CHECK(rel_err(pout.data(), reference(flat, 1, q.data(), 90, o)) < 2e-5);
  CHECK(rel_err(pout.data(), std::vector<double>(fout.begin(), fout.end())) < 2e-5);
  // A new sequence starts without a mean; truncation to 0 clears it.
  auto const other = paged.add_sequence();
  CHECK(paged.key_mean(other, 0, 0)[3] == 0.0f);
  paged.truncate(s, 0);
  CHECK(paged.key_mean(s, 0, 0)[3] == 0.0f);
  CHECK(paged.key_mean(child, 0, 0)[3] == flat.key_mean(0, 0)[3]);
}

TEST_CASE("centered: saving and loading restores mu; other codecs' images are rejected", "[centered][persist]") {
  kvq::QuantizedKVCache<ctr_rot_q4> cache({2, kv, d, 96});
  fill(cache, 45, 45, 17);
  cache.truncate(30);
  std::vector<std::byte> image;
  kvq::save(cache, kvq::vector_writer(image));
  CHECK(image.size() == kvq::saved_bytes(cache));
  auto const loaded = kvq::load<kvq::QuantizedKVCache<ctr_rot_q4>>(kvq::span_reader(image));
  std::vector<float> a(30 * d), b(30 * d);
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < kv; ++h) {
      cache.read_keys(l, h, 0, 30, a.data());
      loaded.read_keys(l, h, 0, 30, b.data());
      REQUIRE(a == b);
      REQUIRE(std::vector<float>(loaded.key_mean(l, h), loaded.key_mean(l, h) + d) ==
              std::vector<float>(cache.key_mean(l, h), cache.key_mean(l, h) + d));
    }
  // load_into an emptied cache, then into a plain rotated cache and a plain centered one (refused).
  kvq::QuantizedKVCache<ctr_rot_q4> dst({2, kv, d, 96});
  kvq::load_into(dst, kvq::span_reader(image));
  CHECK(dst.key_mean(1, 1)[3] == cache.key_mean(1, 1)[3]);
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::rotated<kvq::q4_0>, kvq::rotated<kvq::q4_0>>> plain({2, kv, d, 96});
  REQUIRE_THROWS_AS(kvq::load_into(plain, kvq::span_reader(image)), kvq::format_error);
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::centered<kvq::q4_0>, kvq::rotated<kvq::q4_0>>> other({2, kv, d, 96});
  REQUIRE_THROWS_AS(kvq::load_into(other, kvq::span_reader(image)), kvq::format_error);
  // A non-finite mean is refused (before any checksum), the destination unchanged.
  std::vector<std::byte> bad = image;
  std::uint32_t const nan_bits = 0x7fc00000u;
  std::memcpy(bad.data() + 256 + 64 + 4 * 3, &nan_bits, 4);
  REQUIRE_THROWS_AS(kvq::load_into(dst, kvq::span_reader(bad)), kvq::format_error);
  CHECK(dst.size(0) == 30);
  CHECK(dst.key_mean(0, 0)[3] == cache.key_mean(0, 0)[3]);
  // Paged: an export imports as a new sequence with the same μ.
  kvq::PagedKVCache<ctr_rot_q4> paged({2, kv, d, 16, 16, 4});
  auto const s = kvq::import_sequence(paged, kvq::span_reader(image));
  paged.read_keys(s, 1, 0, 0, 30, b.data());
  cache.read_keys(1, 0, 0, 30, a.data());
  CHECK(a == b);
  std::vector<std::byte> exported;
  kvq::export_sequence(paged, s, kvq::vector_writer(exported));
  kvq::QuantizedKVCache<ctr_rot_q4> back({2, kv, d, 96});
  kvq::load_into(back, kvq::span_reader(exported));
  CHECK(back.key_mean(0, 1)[5] == cache.key_mean(0, 1)[5]);
}
