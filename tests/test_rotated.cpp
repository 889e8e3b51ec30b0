// Tests of kvq::rotated<C> (kvq/codec/rotated.hpp) in the caches: the stored bytes are C(R x)
// exactly (rows, KIVI tiles and the f16 residual), reads un-rotate, attention matches a float64
// reference over the un-rotated reads (flat, paged, decode and multi-token), NaN poisoning
// follows the rotation block, seeds reach saved fingerprints, the facade names every rotated form,
// and rotation does what it is for: q4_0 on rows with outlier channels loses less.
// (Every cache-level test of tests/test_cache.cpp and tests/test_multi_token_attention.cpp also
// runs rotated choices; this file holds what is specific to the rotation.)
#include <kvq/any_cache.hpp>
#include <kvq/attention.hpp>
#include <kvq/codec/fp4.hpp>
#include <kvq/codec/fp8.hpp>
#include <kvq/codec/int8.hpp>
#include <kvq/codec/kivi.hpp>
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>
#include <kvq/codec/rotated.hpp>
#include <kvq/codec/tq.hpp>
#include <kvq/paged_attention.hpp>
#include <kvq/paged_cache.hpp>
#include <kvq/persist.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

auto sz(std::int64_t n) -> std::size_t { return static_cast<std::size_t>(n); }

/// x rotated by R of `seed` (the tested rotation of tests/test_rotation.cpp).
auto rotate(std::vector<float> x, int d, std::uint64_t seed = kvq::default_rotation_seed) -> std::vector<float> {
  for (std::size_t r = 0; r < x.size() / sz(d); ++r) kvq::detail::rotate_forward(x.data() + r * sz(d), d, seed);
  return x;
}

/// Softmax attention in float64 of one query head over rows k, v: (n, d).
auto reference(std::vector<float> const& q, std::vector<float> const& k, std::vector<float> const& v, int n, int d)
    -> std::vector<double> {
  std::vector<double> logit(sz(n));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(q[sz(c)]) * k[sz(t) * sz(d) + sz(c)];
    logit[sz(t)] = s / std::sqrt(static_cast<double>(d));
    m = std::max(m, logit[sz(t)]);
  }
  std::vector<double> out(sz(d), 0.0);
  double sum = 0;
  for (int t = 0; t < n; ++t) {
    double const p = std::exp(logit[sz(t)] - m);
    sum += p;
    for (int c = 0; c < d; ++c) out[sz(c)] += p * v[sz(t) * sz(d) + sz(c)];
  }
  for (auto& o : out) o /= sum;
  return out;
}

/// Σ (decode(encode(x)) − x)² / Σ x² of codec C over n rows x: (n, d).
template <class C>
auto squared_error(std::vector<float> const& x, int n, int d) -> double {
  std::vector<std::uint8_t> b(C::geometry(d).bytes());
  std::vector<float> y(sz(d));
  double e = 0, s = 0;
  for (int r = 0; r < n; ++r) {
    float const* row = x.data() + sz(r) * d;
    C::encode_row(row, d, b.data());
    C::decode_row(b.data(), d, y.data());
    for (int c = 0; c < d; ++c) {
      e += (static_cast<double>(y[sz(c)]) - row[c]) * (static_cast<double>(y[sz(c)]) - row[c]);
      s += static_cast<double>(row[c]) * row[c];
    }
  }
  return e / s;
}

}  // namespace

TEST_CASE("rotated: the codec name, geometry and parameters are the inner codec's", "[rotated]") {
  using r = kvq::rotated<kvq::q4_0>;
  STATIC_REQUIRE(r::name == "rot-q4_0");
  STATIC_REQUIRE(kvq::rotated<kvq::kivi_key<4>>::name == "rot-kivi_key");
  STATIC_REQUIRE(kvq::rotated<kvq::kivi_key<4, 16>>::group == 16);
  STATIC_REQUIRE(kvq::rotated_codec<r>);
  STATIC_REQUIRE(!kvq::rotated_codec<kvq::q4_0>);
  STATIC_REQUIRE(std::is_same_v<kvq::stored_codec_t<r>, kvq::q4_0>);
  STATIC_REQUIRE(std::is_same_v<kvq::rotated<kvq::fp8_e4m3>::params_type, kvq::fp8_params>);
  STATIC_REQUIRE(r::rotation_seed == 0x6B7671);
  CHECK(r::geometry(80) == kvq::q4_0::geometry(80));
  CHECK(kvq::bits_per_element<r>(128) == kvq::bits_per_element<kvq::q4_0>(128));
  CHECK(kvq::plan_memory<r>({2, 4, 128, 1000}).total_bytes ==
        kvq::plan_memory<kvq::q4_0>({2, 4, 128, 1000}).total_bytes);
}

TEST_CASE("rotated: the codec encodes C(R x) and decodes to Rᵀ decode", "[rotated]") {
  for (int d : {8, 40, 80, 128, 200}) {
    auto const x = kvq_test::normal_data(sz(d), 7u + static_cast<std::uint32_t>(d));
    auto const y = rotate(x, d);
    std::vector<std::uint8_t> a(kvq::q4_0::geometry(d).bytes()), b(a.size());
    kvq::rotated<kvq::q4_0>::encode_row(x.data(), d, a.data());
    kvq::q4_0::encode_row(y.data(), d, b.data());
    CHECK(a == b);
    std::vector<float> dec(sz(d)), want(sz(d));
    kvq::rotated<kvq::q4_0>::decode_row(a.data(), d, dec.data());
    kvq::q4_0::decode_row(b.data(), d, want.data());
    kvq::detail::rotate_inverse(want.data(), d, kvq::default_rotation_seed);
    CHECK(std::memcmp(dec.data(), want.data(), sz(d) * sizeof(float)) == 0);
    // Another seed stores other bytes.
    std::vector<std::uint8_t> c(a.size());
    kvq::rotated<kvq::q4_0, 99>::encode_row(x.data(), d, c.data());
    CHECK(c != a);
  }
}

TEST_CASE("rotated: the cache stores C(R x) rows and KIVI tiles and residual rows of R x", "[rotated][cache]") {
  int const kv = 2, d = 96, n = 70;
  auto const k = kvq_test::normal_data(sz(n) * kv * d, 1);
  auto const v = kvq_test::normal_data(sz(n) * kv * d, 2);

  SECTION("row codecs") {
    kvq::QuantizedKVCache<kvq::kv_codecs<kvq::rotated<kvq::q8_0>, kvq::rotated<kvq::int8_sym, 5>>> cache(
        {1, kv, d, 128});
    cache.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    for (int h = 0; h < kv; ++h) {
      auto const ks = cache.key_storage(0, h);
      auto const vs = cache.value_storage(0, h);
      for (int t = 0; t < n; ++t) {
        std::vector<float> kr(k.begin() + (t * kv + h) * d, k.begin() + (t * kv + h + 1) * d);
        std::vector<float> vr(v.begin() + (t * kv + h) * d, v.begin() + (t * kv + h + 1) * d);
        auto const ky = rotate(kr, d), vy = rotate(vr, d, 5);
        std::vector<std::uint8_t> kb(ks.unit_bytes), vb(vs.unit_bytes);
        kvq::q8_0::encode_row(ky.data(), d, kb.data());
        kvq::int8_sym::encode_row(vy.data(), d, vb.data());
        CHECK(std::memcmp(ks.units + sz(t) * ks.unit_bytes, kb.data(), kb.size()) == 0);
        CHECK(std::memcmp(vs.units + sz(t) * vs.unit_bytes, vb.data(), vb.size()) == 0);
      }
    }
  }

  SECTION("KIVI keys: tiles of the rotated f16 rows, the residual in the rotated space; reads un-rotate") {
    using K = kvq::kivi_key<4>;
    kvq::QuantizedKVCache<kvq::kv_codecs<kvq::rotated<K>, kvq::q8_0>> cache({1, kv, d, 128}, {32});
    cache.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
    REQUIRE(cache.key_storage(0, 0).quantized_tokens == 64);
    for (int h = 0; h < kv; ++h) {
      std::vector<float> rows(sz(n) * d);
      for (int t = 0; t < n; ++t) {
        std::vector<float> kr(k.begin() + (t * kv + h) * d, k.begin() + (t * kv + h + 1) * d);
        auto const y = rotate(kr, d);
        for (int c = 0; c < d; ++c) rows[sz(t) * d + sz(c)] = kvq::to_f32(kvq::to_f16(y[sz(c)]));
      }
      auto const ks = cache.key_storage(0, h);
      for (int tile = 0; tile < 2; ++tile) {
        std::vector<std::uint8_t> b(ks.unit_bytes);
        K::encode_tile(rows.data() + sz(tile) * 32 * d, d, d, b.data());
        CHECK(std::memcmp(ks.units + sz(tile) * ks.unit_bytes, b.data(), b.size()) == 0);
      }
      for (int t = 64; t < n; ++t)
        for (int c = 0; c < d; ++c) CHECK(kvq::to_f32(ks.residual[sz(t - 64) * d + sz(c)]) == rows[sz(t) * d + sz(c)]);
      // A residual token reads back as Rᵀ f16(R x): within f16 rounding of the input.
      std::vector<float> back(sz(d));
      cache.read_keys(0, h, 66, 1, back.data());
      std::vector<float> want(rows.begin() + 66 * d, rows.begin() + 67 * d);
      kvq::detail::rotate_inverse(want.data(), d, kvq::default_rotation_seed);
      CHECK(std::memcmp(back.data(), want.data(), sz(d) * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("rotated: q4_0 on rows with outlier channels loses less than plain q4_0", "[rotated][quality]") {
  int const d = 128, n = 256;
  auto const x = kvq_test::outlier_rows(n, d, 3);
  double const plain = squared_error<kvq::q4_0>(x, n, d);
  double const rot = squared_error<kvq::rotated<kvq::q4_0>>(x, n, d);
  INFO("relative squared error: q4_0 " << plain << ", rot-q4_0 " << rot);
  CHECK(rot < 0.5 * plain);
}

TEST_CASE("rotated: attention matches the float64 reference on the un-rotated reads, flat and paged",
          "[rotated][attention]") {
  int const kv = 2, group = 3, qh = kv * group, d = 80, n = 150;
  auto const k = kvq_test::outlier_rows(n * kv, d, 11);
  auto const v = kvq_test::normal_data(sz(n) * kv * d, 12);
  auto const q = kvq_test::normal_data(sz(qh) * d, 13, 0.3f);
  using choice = kvq::kv_codecs<kvq::rotated<kvq::q4_0>, kvq::rotated<kvq::kivi_value<4>, 77>>;
  kvq::QuantizedKVCache<choice> flat({1, kv, d, 256}, {32});
  flat.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(v.data(), n, kv, d));
  kvq::PagedKVCache<choice> paged({1, kv, d, 32, 16}, {32});
  auto const seq = paged.add_sequence();
  for (int t = 0; t < n; t += 37) {
    int const m = std::min(37, n - t);
    paged.append(seq, 0, kvq::token_major(k.data() + sz(t) * kv * d, m, kv, d),
                 kvq::token_major(v.data() + sz(t) * kv * d, m, kv, d));
  }
  std::vector<float> out(sz(qh) * d), pout(out.size());
  kvq::decode_attention(flat, 0, q.data(), qh, out.data());
  kvq::paged_decode_attention(paged, 0, std::span<kvq::sequence_id const>(&seq, 1), q.data(), qh, pout.data());
  for (int h = 0; h < qh; ++h) {
    int const kh = h / group;
    std::vector<float> kr(sz(n) * d), vr(sz(n) * d), pk(kr.size()), pv(vr.size());
    flat.read_keys(0, kh, 0, n, kr.data());
    flat.read_values(0, kh, 0, n, vr.data());
    paged.read_keys(seq, 0, kh, 0, n, pk.data());
    paged.read_values(seq, 0, kh, 0, n, pv.data());
    CHECK(std::memcmp(kr.data(), pk.data(), kr.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(vr.data(), pv.data(), vr.size() * sizeof(float)) == 0);
    std::vector<float> qr(q.begin() + h * d, q.begin() + (h + 1) * d);
    auto const want = reference(qr, kr, vr, n, d);
    for (int c = 0; c < d; ++c) {
      CHECK(std::abs(out[sz(h) * d + sz(c)] - want[sz(c)]) < 2e-5);
      CHECK(std::abs(pout[sz(h) * d + sz(c)] - want[sz(c)]) < 2e-5);
    }
  }
}

TEST_CASE("rotated: a NaN input poisons the blocks its rotation block reaches", "[rotated][nan]") {
  int const d = 80;  // rotation blocks [0, 64) and [64, 80); q8_0 blocks of 32
  auto x = kvq_test::normal_data(sz(d), 21);
  SECTION("NaN in the first rotation block: q8_0 blocks 0 and 1") {
    x[10] = std::numeric_limits<float>::quiet_NaN();
    kvq::QuantizedKVCache<kvq::rotated<kvq::q8_0>> cache({1, 1, d, 8});
    cache.append(0, kvq::token_major(x.data(), 1, 1, d), kvq::token_major(x.data(), 1, 1, d));
    CHECK(cache.nonfinite_blocks().key_blocks == 2);
    std::vector<float> back(sz(d));
    cache.read_keys(0, 0, 0, 1, back.data());
    for (int c = 0; c < 64; ++c) CHECK(std::isnan(back[sz(c)]));  // Rᵀ mixes the NaN over its block
    for (int c = 64; c < d; ++c) CHECK(std::isfinite(back[sz(c)]));
  }
  SECTION("Inf in the last rotation block: q8_0 block 2 only") {
    x[70] = std::numeric_limits<float>::infinity();
    kvq::QuantizedKVCache<kvq::rotated<kvq::q8_0>> cache({1, 1, d, 8});
    cache.append(0, kvq::token_major(x.data(), 1, 1, d), kvq::token_major(x.data(), 1, 1, d));
    CHECK(cache.nonfinite_blocks().key_blocks == 1);
    std::vector<float> back(sz(d));
    cache.read_keys(0, 0, 0, 1, back.data());
    for (int c = 0; c < 64; ++c) CHECK(std::isfinite(back[sz(c)]));
    for (int c = 64; c < d; ++c) CHECK(!std::isfinite(back[sz(c)]));
  }
}

TEST_CASE("rotated: saved images record the seed; another seed or the plain codec refuses them", "[rotated][persist]") {
  int const kv = 1, d = 64, n = 40;
  auto const k = kvq_test::normal_data(sz(n) * kv * d, 31);
  kvq::QuantizedKVCache<kvq::rotated<kvq::q4_0>> src({1, kv, d, 64});
  src.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(k.data(), n, kv, d));
  std::vector<std::byte> image(kvq::saved_bytes(src));
  kvq::save(src, kvq::span_writer(image));

  kvq::QuantizedKVCache<kvq::rotated<kvq::q4_0>> same({1, kv, d, 64});
  kvq::load_into(same, kvq::span_reader(image));
  std::vector<float> a(sz(n) * d), b(a.size());
  src.read_keys(0, 0, 0, n, a.data());
  same.read_keys(0, 0, 0, n, b.data());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);

  kvq::QuantizedKVCache<kvq::rotated<kvq::q4_0, 1234>> other_seed({1, kv, d, 64});
  CHECK_THROWS_AS(kvq::load_into(other_seed, kvq::span_reader(image)), kvq::format_error);
  CHECK(other_seed.size(0) == 0);
  kvq::QuantizedKVCache<kvq::q4_0> plain({1, kv, d, 64});
  CHECK_THROWS_AS(kvq::load_into(plain, kvq::span_reader(image)), kvq::format_error);
  CHECK(plain.size(0) == 0);
}

TEST_CASE("rotated: the facade names every rotated form", "[rotated][any_cache]") {
  auto const pairs = kvq::supported_codec_pairs();
  for (char const* name : {"rot-f32", "rot-f16", "rot-q4_0", "rot-q8_0", "rot-int8", "rot-fp8_e4m3", "rot-fp8_e5m2",
                           "rot-mxfp4", "rot-nvfp4", "rot-kivi2", "rot-kivi4", "rot-kivi8"}) {
    INFO(name);
    CHECK(std::find(pairs.begin(), pairs.end(), std::pair<std::string_view, std::string_view>(name, name)) !=
          pairs.end());
  }
  int const kv = 2, d = 64, n = 64;
  auto const k = kvq_test::normal_data(sz(n) * kv * d, 41);
  auto const q = kvq_test::normal_data(sz(kv) * d, 42, 0.3f);
  auto any = kvq::make_any_cache({1, kv, d, 128}, "rot-kivi4", "kivi4");
  CHECK(any->key_codec_name(0) == "rot-kivi4");
  any->append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(k.data(), n, kv, d));
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::rotated<kvq::kivi_key<4>>, kvq::kivi_value<4>>> typed({1, kv, d, 128});
  typed.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(k.data(), n, kv, d));
  std::vector<float> a(sz(kv) * d), b(a.size());
  any->attention(0, q.data(), kv, a.data(), {});
  kvq::decode_attention(typed, 0, q.data(), kv, b.data());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  // Rotated KIVI keys shift by whole groups, as plain ones.
  auto layered = kvq::make_any_cache({2, kv, d, 128}, {{"rot-kivi4", "rot-kivi4"}, {"q8_0", "q8_0"}});
  layered->append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(k.data(), n, kv, d));
  CHECK_THROWS_AS(layered->shift_left(5), kvq::unsupported_error);
}

TEST_CASE("tq: the codebook codecs store tq_codebook(R x) and read back Rᵀ ŷ through the cache", "[rotated][tq]") {
  STATIC_REQUIRE(kvq::tq4::name == "tq4");
  STATIC_REQUIRE(kvq::rotated_codec<kvq::tq3>);
  STATIC_REQUIRE(std::is_same_v<kvq::stored_codec_t<kvq::tq2>, kvq::detail::tq_codebook<2>>);
  CHECK(kvq::tq2::geometry(128).bytes() == 34);
  CHECK(kvq::tq3::geometry(128).bytes() == 50);
  CHECK(kvq::tq4::geometry(128).bytes() == 66);
  int const kv = 2, d = 80, n = 20;
  auto const k = kvq_test::outlier_rows(n * kv, d, 51);
  kvq::QuantizedKVCache<kvq::kv_codecs<kvq::tq4, kvq::tq<3, 8>>> cache({1, kv, d, 32});
  cache.append(0, kvq::token_major(k.data(), n, kv, d), kvq::token_major(k.data(), n, kv, d));
  for (int h = 0; h < kv; ++h) {
    auto const ks = cache.key_storage(0, h);
    auto const vs = cache.value_storage(0, h);
    std::vector<float> back(sz(n) * d);
    cache.read_values(0, h, 0, n, back.data());
    for (int t = 0; t < n; ++t) {
      std::vector<float> x(k.begin() + (t * kv + h) * d, k.begin() + (t * kv + h + 1) * d);
      auto const y4 = rotate(x, d), y3 = rotate(x, d, 8);
      std::vector<std::uint8_t> b4(ks.unit_bytes), b3(vs.unit_bytes);
      kvq::detail::tq_codebook<4>::encode_row(y4.data(), d, b4.data());
      kvq::detail::tq_codebook<3>::encode_row(y3.data(), d, b3.data());
      CHECK(std::memcmp(ks.units + sz(t) * ks.unit_bytes, b4.data(), b4.size()) == 0);
      CHECK(std::memcmp(vs.units + sz(t) * vs.unit_bytes, b3.data(), b3.size()) == 0);
      std::vector<float> want(sz(d));
      kvq::detail::tq_codebook<3>::decode_row(b3.data(), d, want.data());
      kvq::detail::rotate_inverse(want.data(), d, 8);
      CHECK(std::memcmp(back.data() + sz(t) * d, want.data(), sz(d) * sizeof(float)) == 0);
    }
  }
  auto any = kvq::make_any_cache({1, kv, d, 32}, "tq4", "tq3");
  CHECK(any->value_codec_name(0) == "tq3");
}

TEST_CASE("tq: tq4 loses less than q4_0 at fewer bits on head_dim 128 rows with outlier channels", "[rotated][tq]") {
  int const d = 128, n = 512;
  auto const x = kvq_test::outlier_rows(n, d, 61);
  double const q4 = squared_error<kvq::q4_0>(x, n, d), t4 = squared_error<kvq::tq4>(x, n, d),
               t3 = squared_error<kvq::tq3>(x, n, d), t2 = squared_error<kvq::tq2>(x, n, d);
  INFO("relative squared error: q4_0 " << q4 << ", tq4 " << t4 << ", tq3 " << t3 << ", tq2 " << t2);
  CHECK(kvq::bits_per_element<kvq::tq4>(d) < kvq::bits_per_element<kvq::q4_0>(d));
  CHECK(t4 < q4);
  CHECK(t4 < t3);
  CHECK(t3 < t2);
  // The Lloyd-Max distortion of a unit Gaussian is what a rotated row's coordinates see.
  CHECK(t4 < 1.3 * 0.009497);
}

TEST_CASE("fp4 codecs in the facade and the cache options", "[fp4][any_cache]") {
  kvq::any_cache_options o;
  o.residual = 0;
  o.key_fp4.scale = 0.5f;
  auto c = kvq::make_any_cache({2, 2, 64, 16}, "mxfp4", "mxfp4", o);
  auto n = kvq::make_any_cache({2, 2, 64, 16}, "nvfp4", "nvfp4", o);
  std::vector<float> x(4 * 2 * 64);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.1f * static_cast<float>(i));
  for (auto* cache : {c.get(), n.get()}) {
    cache->append(1, kvq::token_major(x.data(), 4, 2, 64), kvq::token_major(x.data(), 4, 2, 64));
    std::vector<float> k(4 * 64), v(4 * 64);
    cache->read_keys(1, 1, 0, 4, k.data());
    cache->read_values(1, 1, 0, 4, v.data());
    double err = 0;
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 64; ++i)
        err = std::max(err, std::fabs(static_cast<double>(k[static_cast<std::size_t>(t * 64 + i)]) -
                                      x[static_cast<std::size_t>((t * 2 + 1) * 64 + i)]));
    CHECK(err <= 0.25);  // E2M1 steps: at most half a step of the largest magnitude (1) above 1
  }
  kvq::QuantizedKVCache<kvq::nvfp4>::options bad;
  bad.key.scale = 0.0f;
  CHECK_THROWS_AS(kvq::QuantizedKVCache<kvq::nvfp4>({1, 1, 64, 4}, bad), kvq::invalid_argument_error);
  bad.key.scale = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(kvq::QuantizedKVCache<kvq::nvfp4>({1, 1, 64, 4}, bad), kvq::invalid_argument_error);
}
