// Tests of the int8 symmetric codec: pinned choices (division, ties to even, clamp), bounds, NaN/Inf.
#include <kvq/codec/int8.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

std::vector<std::uint8_t> encode(std::vector<float> const& x) {
  int const n = static_cast<int>(x.size());
  std::vector<std::uint8_t> out(kvq::int8_sym::geometry(n).bytes());
  kvq::int8_sym::encode_row(x.data(), n, out.data());
  return out;
}

float scale_of(std::vector<std::uint8_t> const& b) {
  float s;
  std::memcpy(&s, b.data(), 4);
  return s;
}

int code_of(std::vector<std::uint8_t> const& b, int i) {
  return static_cast<signed char>(b[4 + static_cast<std::size_t>(i)]);
}

}  // namespace

TEST_CASE("int8: layout, geometry and bits per element", "[int8]") {
  CHECK(kvq::int8_sym::geometry(128).bytes() == 132);
  CHECK(kvq::int8_sym::geometry(8).bytes() == 12);
  CHECK(kvq::bits_per_element<kvq::int8_sym>(128) == 8.25);
  CHECK(kvq::bits_per_element<kvq::int8_sym>(64) == 8.5);
  CHECK(kvq::int8_sym::name == "int8");
  STATIC_REQUIRE(kvq::row_codec<kvq::int8_sym>);
}

TEST_CASE("int8: scale = amax/127 in fp32, codes = clamp(rne(x/scale)) by true division", "[int8]") {
  for (std::uint32_t seed = 1; seed <= 50; ++seed) {
    for (int n : {1, 8, 64, 80, 128, 256}) {
      auto const x = kvq_test::normal_data(static_cast<std::size_t>(n), seed * 1000u + static_cast<std::uint32_t>(n));
      auto const b = encode(x);
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      float const scale = amax / 127.0f;
      REQUIRE(kvq_test::bits(scale_of(b)) == kvq_test::bits(scale));
      for (int i = 0; i < n; ++i) {
        // Independent rule: the double quotient rounded once to float equals the correctly rounded
        // float quotient; nearbyint rounds ties to even in the default mode.
        float const q = static_cast<float>(static_cast<double>(x[static_cast<std::size_t>(i)]) / scale);
        int const want = static_cast<int>(std::clamp(std::nearbyint(q), -127.0f, 127.0f));
        CHECK(code_of(b, i) == want);
      }
      std::vector<float> y(static_cast<std::size_t>(n));
      kvq::int8_sym::decode_row(b.data(), n, y.data());
      for (int i = 0; i < n; ++i) {
        CHECK(kvq_test::bits(y[static_cast<std::size_t>(i)]) == kvq_test::bits(static_cast<float>(code_of(b, i)) * scale));
        // Round-trip bound: |x - q*scale| <= scale/2 (plus one rounding of the product).
        CHECK(std::fabs(y[static_cast<std::size_t>(i)] - x[static_cast<std::size_t>(i)]) <= scale * 0.5f * (1 + 1e-5f));
      }
    }
  }
}

TEST_CASE("int8: ties go to even and -128 is never produced", "[int8]") {
  // amax = 127 gives scale = 1 exactly, so x/scale = x.
  std::vector<float> x = {127.0f, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f, -127.0f};
  auto const b = encode(x);
  CHECK(scale_of(b) == 1.0f);
  std::vector<int> const want = {127, 2, 4, -2, -4, 0, 0, -127};
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(code_of(b, static_cast<int>(i)) == want[i]);
  for (std::uint32_t seed = 0; seed < 200; ++seed) {
    auto const r = encode(kvq_test::normal_data(128, seed));
    for (int i = 0; i < 128; ++i) CHECK(code_of(r, i) >= -127);
  }
}

TEST_CASE("int8: all-zero rows, tiny rows, NaN and Inf", "[int8]") {
  auto const z = encode(std::vector<float>(16, 0.0f));
  CHECK(scale_of(z) == 0.0f);
  for (int i = 0; i < 16; ++i) CHECK(code_of(z, i) == 0);

  // Subnormal amax: the division keeps the codes meaningful where a reciprocal would overflow.
  std::vector<float> tiny = {127e-45f, -63e-45f, 1e-45f};
  auto const t = encode(tiny);
  std::vector<float> y(3);
  kvq::int8_sym::decode_row(t.data(), 3, y.data());
  for (int i = 0; i < 3; ++i) CHECK(std::fabs(y[static_cast<std::size_t>(i)] - tiny[static_cast<std::size_t>(i)]) <= 1e-45f);

  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto x = kvq_test::normal_data(32, 3);
    x[7] = bad;
    auto const b = encode(x);
    CHECK(kvq_test::bits(scale_of(b)) == 0x7fc00000u);
    for (int i = 0; i < 32; ++i) CHECK(code_of(b, i) == 0);
    std::vector<float> out(32);
    kvq::int8_sym::decode_row(b.data(), 32, out.data());
    for (float v : out) CHECK(std::isnan(v));
  }
}
