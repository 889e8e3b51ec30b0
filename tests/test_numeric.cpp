// Tests of kvq/detail/numeric.h and the rounding helpers of kvq/detail/config.h.
#include <kvq/detail/numeric.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::bits;

namespace {

// Independent rule: the value of binary16 bits from the IEEE formula, in double.
double f16_formula(std::uint16_t h) {
  int const s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double const sign = s ? -1.0 : 1.0;
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

// Independent rule: round |x| to a grid of quantum 2^(floor(log2|x|) - mant_bits) (or the subnormal
// quantum), ties to even, in double; values at or past 2^(emax+1) are Inf.
double round_to_format(float x, int mant_bits, int min_normal_exp, int overflow_exp) {
  double const v = std::fabs(static_cast<double>(x));
  if (v == 0.0) return std::copysign(0.0, static_cast<double>(x));
  int e = 0;
  std::frexp(v, &e);  // v = f * 2^e, f in [0.5, 1)
  int const q_exp = std::max(e - 1, min_normal_exp) - mant_bits;
  double const n = std::nearbyint(std::ldexp(v, -q_exp));  // exact scaling, RNE
  double r = std::ldexp(n, q_exp);
  if (r >= std::ldexp(1.0, overflow_exp)) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, static_cast<double>(x));
}

double f16_rule(float x) { return round_to_format(x, 10, -14, 16); }
double bf16_rule(float x) { return round_to_format(x, 7, -126, 128); }

bool same_f64(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

}  // namespace

TEST_CASE("f16: all 65536 patterns decode exactly and round-trip", "[numeric][f16]") {
  long bad_decode = 0, bad_roundtrip = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    float const f = kvq::detail::f16_bits_to_f32(static_cast<std::uint16_t>(h));
    if (!same_f64(static_cast<double>(f), f16_formula(static_cast<std::uint16_t>(h)))) ++bad_decode;
    std::uint16_t const back = kvq::detail::f32_to_f16_bits(f);
    bool const nan = ((h >> 10) & 31) == 31 && (h & 1023) != 0;
    // A NaN comes back quieted with its sign and payload kept.
    std::uint16_t const expect = nan ? static_cast<std::uint16_t>(h | 0x0200u) : static_cast<std::uint16_t>(h);
    if (back != expect) ++bad_roundtrip;
  }
  CHECK(bad_decode == 0);
  CHECK(bad_roundtrip == 0);
}

TEST_CASE("bf16: all 65536 patterns decode exactly and round-trip", "[numeric][bf16]") {
  long bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    float const f = kvq::detail::bf16_bits_to_f32(static_cast<std::uint16_t>(b));
    if (bits(f) != (b << 16)) ++bad;
    bool const nan = ((b >> 7) & 255) == 255 && (b & 127) != 0;
    std::uint16_t const expect = nan ? static_cast<std::uint16_t>(b | 0x0040u) : static_cast<std::uint16_t>(b);
    if (kvq::detail::f32_to_bf16_bits(f) != expect) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("f16 and bf16: dense random f32 inputs follow the independent RNE rule", "[numeric]") {
  std::mt19937 rng(12345);
  long bad_f16 = 0, bad_bf16 = 0;
  auto check = [&](float x) {
    double const want16 = f16_rule(x);
    double const got16 = kvq::detail::f16_bits_to_f32(kvq::detail::f32_to_f16_bits(x));
    if (!same_f64(got16, want16)) ++bad_f16;
    double const wantb = bf16_rule(x);
    double const gotb = kvq::detail::bf16_bits_to_f32(kvq::detail::f32_to_bf16_bits(x));
    if (!same_f64(gotb, wantb)) ++bad_bf16;
  };
  for (int i = 0; i < 4'000'000; ++i) check(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  // Dense around the binary16 range: exponents -30..17 with random mantissas.
  for (int i = 0; i < 4'000'000; ++i) {
    std::uint32_t const e = 97u + static_cast<std::uint32_t>(rng() % 48u);
    auto const sign = static_cast<std::uint32_t>(rng() & 0x80000000u);
    auto const mant = static_cast<std::uint32_t>(rng() & 0x007fffffu);
    check(std::bit_cast<float>(sign | (e << 23) | mant));
  }
  // Every binary16 midpoint and its float neighbours (ties and near-ties).
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    double const lo = f16_formula(static_cast<std::uint16_t>(h));
    double const hi = h == 0x7bff ? 65536.0 : f16_formula(static_cast<std::uint16_t>(h + 1));
    float const mid = static_cast<float>((lo + hi) / 2);  // exact in float
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      check(x);
      check(-x);
    }
  }
  CHECK(bad_f16 == 0);
  CHECK(bad_bf16 == 0);
}

TEST_CASE("f16: pinned boundary values", "[numeric][f16]") {
  using kvq::detail::f32_to_f16_bits;
  CHECK(f32_to_f16_bits(65504.0f) == 0x7bff);
  CHECK(f32_to_f16_bits(65519.99f) == 0x7bff);
  CHECK(f32_to_f16_bits(65520.0f) == 0x7c00);  // the tie above max goes to even: Inf
  CHECK(f32_to_f16_bits(-65520.0f) == 0xfc00);
  CHECK(f32_to_f16_bits(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(f32_to_f16_bits(std::ldexp(1.0f, -24)) == 0x0001);  // min subnormal
  CHECK(f32_to_f16_bits(std::ldexp(1.0f, -25)) == 0x0000);  // half of it: tie to even 0
  CHECK(f32_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(f32_to_f16_bits(-std::ldexp(1.0f, -26)) == 0x8000);  // sign of zero kept
  CHECK(f32_to_f16_bits(std::ldexp(3.0f, -25)) == 0x0002);   // 1.5 quanta: tie to even 2
  CHECK(f32_to_f16_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7e00);
  CHECK(kvq::detail::f32_to_f16_bits_sat(1e9f) == 0x7bff);
  CHECK(kvq::detail::f32_to_f16_bits_sat(-std::numeric_limits<float>::infinity()) == 0xfbff);
  CHECK((kvq::detail::f32_to_f16_bits_sat(std::numeric_limits<float>::quiet_NaN()) & 0x7fffu) > 0x7c00u);
}

TEST_CASE("bf16: pinned boundary values", "[numeric][bf16]") {
  using kvq::detail::f32_to_bf16_bits;
  CHECK(f32_to_bf16_bits(1.0f) == 0x3f80);
  CHECK(f32_to_bf16_bits(std::bit_cast<float>(0x3f808000u)) == 0x3f80);  // tie to even (down)
  CHECK(f32_to_bf16_bits(std::bit_cast<float>(0x3f818000u)) == 0x3f82);  // tie to even (up)
  CHECK(f32_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // overflow to Inf
  CHECK(f32_to_bf16_bits(std::bit_cast<float>(0x00008000u)) == 0x0000);  // subnormal tie to even
  CHECK(f32_to_bf16_bits(std::bit_cast<float>(0x00018000u)) == 0x0002);
  CHECK(f32_to_bf16_bits(std::bit_cast<float>(0xff800001u)) == 0xffc0);  // signalling NaN quieted
}

TEST_CASE("round_half_even and round_half_away against the C library", "[numeric]") {
  std::mt19937 rng(7);
  long bad = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    float const x = std::ldexp(static_cast<float>(static_cast<std::int32_t>(rng())) / 2147483648.0f,
                               static_cast<int>(rng() % 30));
    if (bits(kvq::detail::round_half_even(x)) != bits(std::nearbyint(x))) ++bad;
    if (bits(kvq::detail::round_half_away(x)) != bits(std::round(x))) ++bad;
  }
  for (float x = -40.0f; x <= 40.0f; x += 0.25f) {
    if (bits(kvq::detail::round_half_even(x)) != bits(std::nearbyint(x))) ++bad;
    if (bits(kvq::detail::round_half_away(x)) != bits(std::round(x))) ++bad;
  }
  CHECK(bad == 0);
  CHECK(kvq::detail::round_half_even(2.5f) == 2.0f);
  CHECK(kvq::detail::round_half_away(2.5f) == 3.0f);
  CHECK(kvq::detail::round_half_away(-0.5f) == -1.0f);
  CHECK(std::signbit(kvq::detail::round_half_even(-0.25f)));
}

TEST_CASE("mul_rn is never fused with a following add", "[numeric]") {
  // x*x = 1 + 2^-12 + 2^-26 exactly; rounded to float it is 1 + 2^-12. A fused multiply-add would
  // return 2^-12 + 2^-26 for x*x - 1, the rounded product returns 2^-12. Inputs are volatile so the
  // compiler cannot fold the expression at compile time.
  volatile float vx = 1.0f + std::ldexp(1.0f, -13);
  volatile float vc = -1.0f;
  float const x = vx, c = vc;
  CHECK(kvq::detail::add_rn(kvq::detail::mul_rn(x, x), c) == std::ldexp(1.0f, -12));
}
