// Tests of the q8_0 and q4_0 codecs: ggml golden vectors, padding, NaN/Inf rules, error bounds.
#include <kvq/codec/q4_0.hpp>
#include <kvq/codec/q8_0.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::bits;
using kvq_test::bytes_from_hex;
using kvq_test::f32_from_hex;
using kvq_test::hex;

namespace {

template <class Codec>
std::vector<std::uint8_t> encode(std::vector<float> const& x) {
  int const n = static_cast<int>(x.size());
  std::vector<std::uint8_t> out(Codec::geometry(n).bytes());
  Codec::encode_row(x.data(), n, out.data());
  return out;
}

template <class Codec>
std::vector<float> decode(std::vector<std::uint8_t> const& b, int n) {
  std::vector<float> y(static_cast<std::size_t>(n));
  Codec::decode_row(b.data(), n, y.data());
  return y;
}

template <class Codec>
void check_vector(nlohmann::json const& v, char const* key) {
  std::vector<float> x;
  for (auto const& h : v["input_f32"]) x.push_back(f32_from_hex(h.get<std::string>()));
  int const n = v["n"].get<int>();
  REQUIRE(static_cast<int>(x.size()) == n);
  auto const expected = bytes_from_hex(v[key]["bytes"].get<std::string>());
  auto const got = encode<Codec>(x);
  INFO(v["name"].get<std::string>() << " " << key);
  CHECK(hex(got) == hex(expected));
  // Decode the golden bytes (not ours) so a decode bug is not masked by an encode bug.
  auto const y = decode<Codec>(expected, n);
  auto const& want = v[key]["dequant_f32"];
  int bad = 0;
  for (int i = 0; i < n; ++i)
    if (!kvq_test::same_value(y[static_cast<std::size_t>(i)], f32_from_hex(want[static_cast<std::size_t>(i)])))
      ++bad;
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("q8_0 and q4_0 reproduce every ggml golden vector", "[q8_0][q4_0][golden]") {
  auto const j = kvq_test::load_testvectors("ggml_q4_0_q8_0.json");
  REQUIRE(j["vectors"].size() >= 46);
  for (auto const& v : j["vectors"]) {
    check_vector<kvq::q4_0>(v, "q4_0");
    check_vector<kvq::q8_0>(v, "q8_0");
  }
}

TEST_CASE("q8_0 quantizes the golden query rows exactly as ggml", "[q8_0][golden]") {
  auto const j = kvq_test::load_testvectors("ggml_q4_0_q8_0.json");
  REQUIRE(!j["dots"].empty());
  for (auto const& d : j["dots"]) {
    // Q = lcg(q_seed, amp 2), n = 128, per the vector README's generator.
    std::uint32_t s = d["q_seed"].get<std::uint32_t>();
    float const amp = d["q_amp"].get<float>();
    std::vector<float> q(d["n"].get<std::size_t>());
    for (auto& x : q) {
      s = s * 1664525u + 1013904223u;
      float const u = static_cast<float>(s >> 8) * (1.0f / 16777216.0f);
      x = (2.0f * u - 1.0f) * amp;
    }
    CHECK(hex(encode<kvq::q8_0>(q)) == d["q_q8_0_ref_bytes"].get<std::string>());
  }
}

TEST_CASE("q8_0 and q4_0 geometry", "[q8_0][q4_0]") {
  CHECK(kvq::q8_0::geometry(128).bytes() == 4 * 34);
  CHECK(kvq::q4_0::geometry(128).bytes() == 4 * 18);
  CHECK(kvq::q8_0::geometry(8).bytes() == 34);  // head_dim 8: one padded block
  CHECK(kvq::q4_0::geometry(80).blocks == 3);
  CHECK(kvq::q4_0::geometry(80).padded_channels() == 96);
  CHECK(kvq::bits_per_element<kvq::q8_0>(128) == 8.5);
  CHECK(kvq::bits_per_element<kvq::q4_0>(128) == 4.5);
  CHECK(kvq::bits_per_element<kvq::q4_0>(8) == 18.0);  // 18 bytes for 8 values
  STATIC_REQUIRE(kvq::row_codec<kvq::q8_0>);
  STATIC_REQUIRE(kvq::row_codec<kvq::q4_0>);
  STATIC_REQUIRE(!kvq::token_group_codec<kvq::q4_0>);
}

TEMPLATE_TEST_CASE("padding lanes are zeros outside the scale and are never written back", "[q8_0][q4_0]", kvq::q8_0,
                   kvq::q4_0) {
  for (int n : {1, 8, 40, 80, 100}) {
    auto x = kvq_test::normal_data(static_cast<std::size_t>(n), 99u + static_cast<std::uint32_t>(n));
    // Padded encode equals encoding an explicitly zero-filled row.
    int const padded = TestType::geometry(n).padded_channels();
    std::vector<float> zero_filled(x);
    zero_filled.resize(static_cast<std::size_t>(padded), 0.0f);
    auto const a = encode<TestType>(x);
    auto const b = encode<TestType>(zero_filled);
    CHECK(hex(a) == hex(b));
    // Decode writes exactly n values.
    std::vector<float> y(static_cast<std::size_t>(n) + 4, 12345.0f);
    TestType::decode_row(a.data(), n, y.data());
    for (int i = n; i < n + 4; ++i) CHECK(y[static_cast<std::size_t>(i)] == 12345.0f);
  }
}

TEMPLATE_TEST_CASE("a block holding NaN or Inf decodes entirely to NaN; other blocks are untouched", "[q8_0][q4_0]",
                   kvq::q8_0, kvq::q4_0) {
  float const bad_values[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (float bad : bad_values) {
    auto x = kvq_test::normal_data(64, 5);
    auto const clean = encode<TestType>(x);
    x[40] = bad;
    auto const b = encode<TestType>(x);
    // Block 0 unchanged; block 1 stores the fp16 NaN scale and neutral codes.
    std::size_t const bb = TestType::geometry(64).block_bytes;
    CHECK(std::vector<std::uint8_t>(b.begin(), b.begin() + static_cast<long>(bb)) ==
          std::vector<std::uint8_t>(clean.begin(), clean.begin() + static_cast<long>(bb)));
    CHECK(b[bb] == 0x00);
    CHECK(b[bb + 1] == 0x7e);
    auto const y = decode<TestType>(b, 64);
    for (int i = 0; i < 32; ++i) CHECK(std::isfinite(y[static_cast<std::size_t>(i)]));
    for (int i = 32; i < 64; ++i) CHECK(std::isnan(y[static_cast<std::size_t>(i)]));
  }
}

TEMPLATE_TEST_CASE("tiny blocks whose 1/d overflows decode to zero", "[q8_0][q4_0]", kvq::q8_0, kvq::q4_0) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[static_cast<std::size_t>(i)] = (i % 3 - 1) * 1e-39f;  // f32 subnormals
  auto const y = decode<TestType>(encode<TestType>(x), 32);
  for (float v : y) CHECK(v == 0.0f);
}

TEST_CASE("q8_0 and q4_0 round-trip error stays within the format's bound", "[q8_0][q4_0]") {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    auto const x = kvq_test::outlier_rows(64, 128, seed);
    for (std::size_t r = 0; r < 64; ++r) {
      std::vector<float> row(x.begin() + static_cast<long>(r * 128), x.begin() + static_cast<long>((r + 1) * 128));
      auto const y8 = decode<kvq::q8_0>(encode<kvq::q8_0>(row), 128);
      auto const e4 = encode<kvq::q4_0>(row);
      auto const y4 = decode<kvq::q4_0>(e4, 128);
      for (int blk = 0; blk < 4; ++blk) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(row[static_cast<std::size_t>(blk * 32 + j)]));
        // q8_0: |x - q*dh| <= |x - q*d| + |q|*|d - dh| <= d/2 + 127*|d - dh| (plus float rounding).
        float const d8 = amax / 127.0f;
        float const dh8 = kvq::detail::f16_bits_to_f32(kvq::detail::f32_to_f16_bits(d8));
        float const bound8 = d8 / 2 + 127 * std::fabs(d8 - dh8) + amax * 1e-6f;
        // q4_0: d/2 except the clamped extreme (-max -> 7d), which is off by at most |d|.
        float const d4 = amax / 8.0f;
        float const dh4 = kvq::detail::f16_bits_to_f32(kvq::detail::f32_to_f16_bits(d4));
        float const bound4 = d4 + 8 * std::fabs(d4 - dh4) + amax * 1e-6f;
        for (int j = 0; j < 32; ++j) {
          std::size_t const i = static_cast<std::size_t>(blk * 32 + j);
          CHECK(std::fabs(y8[i] - row[i]) <= bound8);
          CHECK(std::fabs(y4[i] - row[i]) <= bound4);
          if (std::fabs(y4[i] - row[i]) > d4 / 2 + 8 * std::fabs(d4 - dh4) + amax * 1e-6f) {
            // Only the clamped code 15 (value 7d, d signed as stored) may exceed d/2.
            std::uint16_t dbits = static_cast<std::uint16_t>(e4[static_cast<std::size_t>(blk) * 18] |
                                                             (e4[static_cast<std::size_t>(blk) * 18 + 1] << 8));
            CHECK(y4[i] == 7.0f * kvq::detail::f16_bits_to_f32(dbits));
          }
        }
      }
    }
  }
}
