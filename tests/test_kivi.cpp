// Tests of the KIVI codecs: codes and decoded values against an independent reference, the
// round-trip error bound, hand-computed bytes, padding, constant groups, NaN/Inf, ties to even,
// codes from the stored fp16 parameters, geometry and bits per element.
#include <kvq/codec/kivi.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::hex;
using kvq_test::same_value;

namespace {

constexpr int head_dims[] = {1, 8, 64, 80, 96, 128};
constexpr int dataset_count = 5;
constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();

using bytes = std::vector<std::uint8_t>;

auto sz(int n) -> std::size_t { return static_cast<std::size_t>(n); }

/// fp16 rounding computed independently in double: ties to even, subnormals kept, saturating to
/// ±65504 (what f32_to_f16_bits_sat then f16 -> f32 must give).
auto ref_f16(float x) -> float {
  double const v = x;
  if (v == 0.0) return x;
  int e = 0;
  (void)std::frexp(v, &e);                     // |v| = f * 2^e with f in [0.5, 1)
  int const qexp = std::max(e - 1, -14) - 10;    // exponent of the fp16 quantum at |v|
  double const r = std::ldexp(std::nearbyint(std::ldexp(v, -qexp)), qexp);
  return static_cast<float>(std::clamp(r, -65504.0, 65504.0));
}

/// The statistics of one group, computed independently of the library.
struct ref_group {
  bool finite = true;
  float mn = 0.0f;     // min over finite elements, a zero taken as +0
  float mx = 0.0f;     // max over finite elements, a zero taken as +0
  float scale = 0.0f;  // fl32(fl32(mx - mn) / (2^b - 1)): the unrounded scale
  float s = 0.0f;      // stored scale, fp16-rounded
  float m = 0.0f;      // stored minimum, fp16-rounded
};

auto max_code(int bits) -> int { return (1 << bits) - 1; }

auto make_ref(std::vector<float> const& g, int bits) -> ref_group {
  ref_group r;
  r.mn = inf_f;
  r.mx = -inf_f;
  for (float x : g) {
    if (!std::isfinite(x)) {
      r.finite = false;
      continue;
    }
    r.mn = std::min(r.mn, x);
    r.mx = std::max(r.mx, x);
  }
  if (!r.finite) {
    r.s = r.m = nan_f;
    return r;
  }
  if (r.mn == 0.0f) r.mn = 0.0f;
  if (r.mx == 0.0f) r.mx = 0.0f;
  float const d = r.mx - r.mn;
  // A float quotient computed in double and rounded once is the correctly rounded float quotient.
  r.scale = static_cast<float>(static_cast<double>(d) / max_code(bits));
  r.s = ref_f16(r.scale);
  r.m = ref_f16(r.mn);
  return r;
}

/// clamp(rne(fl32(fl32(x - m) / s)), 0, 2^b - 1), or 0 for s == 0 or a poisoned group.
auto ref_code(float x, ref_group const& r, int bits) -> int {
  if (!r.finite || r.s == 0.0f) return 0;
  float const d = x - r.m;
  double const t = static_cast<float>(static_cast<double>(d) / r.s);
  return static_cast<int>(std::nearbyint(std::clamp(t, 0.0, static_cast<double>(max_code(bits)))));
}

/// fl32(q * s + m): q * s and the sum are exact in double (fp16 operands, q < 2^8), so one rounding.
auto ref_value(int q, ref_group const& r) -> float {
  return static_cast<float>(static_cast<double>(q) * r.s + static_cast<double>(r.m));
}

// Round-trip bound for a finite x of a group with |x| <= 65504 (u = 2^-24, maxq = 2^b - 1):
//  * x inside [m, m + maxq*s]: t = (x - m)/s is rounded to the nearest integer, so
//    |q*s - (x - m)| <= s/2 up to the rounding of x - m, of the quotient, of q*s (exact) and of
//    the final + m: at most u*(2|x - m| + |x^|) <= 2u*(|x| + |m| + maxq*s).
//  * x < m (m is mn rounded up): q = 0, x^ = m, |x - x^| <= |mn - m|.
//  * x > m + maxq*s: q = maxq and x - x^ <= (mx - mn) + (mn - m) - maxq*s
//    = [(mx - mn) - maxq*scale] + (mn - m) + maxq*(scale - s); the bracket is the fp32 rounding of
//    scale = fl(fl(mx - mn)/maxq), at most 2u*(mx - mn) in magnitude.
//  * s == 0 (constant group or underflow): x^ = m and |x - m| <= (mx - mn) + |mn - m|
//    = maxq*|scale - s| + |mn - m| up to 2u*(mx - mn).
// Hence |x^ - x| <= s/2 + maxq*|scale - s| + |mn - m| + 8u*(|x| + |m| + maxq*s + (mx - mn)),
// the last term being a generous "few ulps" of every magnitude involved.
auto ref_bound(float x, ref_group const& r, int bits) -> double {
  double const maxq = max_code(bits);
  double const s = r.s;
  double const u = std::ldexp(1.0, -24);
  double const mags = std::abs(static_cast<double>(x)) + std::abs(static_cast<double>(r.m)) + maxq * s +
                      (static_cast<double>(r.mx) - r.mn);
  return s / 2 + maxq * std::abs(static_cast<double>(r.scale) - s) +
         std::abs(static_cast<double>(r.mn) - static_cast<double>(r.m)) + 8 * u * mags;
}

/// Counts failures and keeps the first message.
struct tally {
  int count = 0;
  std::string first;
  template <class F>
  void expect(bool ok, F&& describe) {
    if (ok) return;
    if (count++ == 0) first = describe();
  }
};

/// Test data (rows, dim): 0 N(0,1); 1 outlier channels 5-20x; 2 per-channel offsets; 3 tiny
/// (sigma 1e-6: fp16-subnormal scales); 4 large (sigma 300).
auto dataset(int which, int rows, int dim, std::uint32_t seed) -> std::vector<float> {
  std::size_t const n = sz(rows) * sz(dim);
  switch (which) {
    case 0:
      return kvq_test::normal_data(n, seed);
    case 1:
      return kvq_test::outlier_rows(rows, dim, seed);
    case 2: {
      auto v = kvq_test::normal_data(n, seed);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < dim; ++c) v[sz(r) * sz(dim) + sz(c)] += static_cast<float>((c * 13) % 21 - 10) * 0.75f;
      return v;
    }
    case 3:
      return kvq_test::normal_data(n, seed, 1e-6f);
    default:
      return kvq_test::normal_data(n, seed, 300.0f);
  }
}

auto describe(char const* what, int tile, int c, int t, double got, double want) -> std::string {
  std::ostringstream os;
  os.precision(9);
  os << what << " at tile/row " << tile << " channel " << c << " token/lane " << t << ": got " << got << ", want "
     << want;
  return os.str();
}

/// Checks one decoded element of a group: exact code, exact value, and the error bound.
void check_element(tally& tl, float x, int q, float y, ref_group const& r, int bits, int unit, int c, int t) {
  int const want_q = ref_code(x, r, bits);
  tl.expect(q == want_q, [&] { return describe("code", unit, c, t, q, want_q); });
  float const want_y = ref_value(want_q, r);
  tl.expect(same_value(y, want_y), [&] { return describe("decoded value", unit, c, t, y, want_y); });
  if (r.finite) {
    double const err = std::abs(static_cast<double>(y) - x);
    double const bound = ref_bound(x, r, bits);
    tl.expect(err <= bound, [&] { return describe("round-trip error vs bound", unit, c, t, err, bound); });
  }
}

template <class Key>
void check_keys(std::vector<float> const& x, int tokens, int head_dim) {
  constexpr int G = Key::group;
  constexpr int B = Key::bits;
  auto const geo = Key::geometry(head_dim);
  tally tl;
  for (int tile = 0; tile * G < tokens; ++tile) {
    float const* const xt = x.data() + sz(tile) * G * sz(head_dim);
    bytes buf(geo.bytes() + 8, 0xa5);
    Key::encode_tile(xt, head_dim, head_dim, buf.data());
    for (std::size_t i = geo.bytes(); i < buf.size(); ++i)
      tl.expect(buf[i] == 0xa5, [&] { return std::string("encode_tile wrote past the tile"); });

    // decode_tile into a strided buffer whose gaps must stay untouched.
    std::ptrdiff_t const stride = head_dim + 2;
    std::vector<float> yt(sz(G) * sz(stride), -777.0f);
    Key::decode_tile(buf.data(), head_dim, yt.data(), stride);

    std::vector<std::vector<float>> groups(sz(head_dim), std::vector<float>(sz(G)));
    std::vector<ref_group> refs(sz(head_dim));
    for (int c = 0; c < head_dim; ++c) {
      auto& g = groups[sz(c)];
      for (int t = 0; t < G; ++t) g[sz(t)] = xt[sz(t) * sz(head_dim) + sz(c)];
      ref_group const& r = refs[sz(c)] = make_ref(g, B);
      auto const p = Key::group_params(buf.data(), head_dim, c);
      tl.expect(same_value(p.scale, r.s), [&] { return describe("stored scale", tile, c, -1, p.scale, r.s); });
      tl.expect(same_value(p.min, r.m), [&] { return describe("stored min", tile, c, -1, p.min, r.m); });
    }
    std::vector<float> y(sz(head_dim) + 1);
    for (int t = 0; t < G; ++t) {
      y[sz(head_dim)] = 12345.0f;
      Key::decode_token(buf.data(), head_dim, t, y.data());
      tl.expect(y[sz(head_dim)] == 12345.0f, [&] { return std::string("decode_token wrote past head_dim"); });
      for (int c = 0; c < head_dim; ++c) {
        float const yv = y[sz(c)];
        check_element(tl, groups[sz(c)][sz(t)], Key::code(buf.data(), head_dim, c, t), yv, refs[sz(c)], B, tile, c,
                      t);
        float const ytv = yt[sz(t) * sz(stride) + sz(c)];
        tl.expect(same_value(ytv, yv), [&] { return describe("decode_tile vs decode_token", tile, c, t, ytv, yv); });
      }
      for (int c = head_dim; c < stride; ++c)
        tl.expect(yt[sz(t) * sz(stride) + sz(c)] == -777.0f, [&] { return std::string("decode_tile wrote a gap"); });
    }
  }
  INFO("first failure: " << tl.first);
  CHECK(tl.count == 0);
}

template <class Value>
void check_values(std::vector<float> const& x, int rows, int head_dim) {
  constexpr int B = Value::bits;
  auto const geo = Value::geometry(head_dim);
  int const gv = geo.block_channels;
  tally tl;
  for (int row = 0; row < rows; ++row) {
    float const* const xr = x.data() + sz(row) * sz(head_dim);
    bytes buf(geo.bytes() + 8, 0xa5);
    Value::encode_row(xr, head_dim, buf.data());
    for (std::size_t i = geo.bytes(); i < buf.size(); ++i)
      tl.expect(buf[i] == 0xa5, [&] { return std::string("encode_row wrote past the row"); });
    std::vector<float> y(sz(head_dim) + 1, 12345.0f);
    Value::decode_row(buf.data(), head_dim, y.data());
    tl.expect(y[sz(head_dim)] == 12345.0f, [&] { return std::string("decode_row wrote past head_dim"); });
    for (int k = 0; k * gv < head_dim; ++k) {
      int const n = std::min(gv, head_dim - k * gv);
      std::vector<float> g(xr + k * gv, xr + k * gv + n);
      ref_group const r = make_ref(g, B);
      auto const p = Value::group_params(buf.data(), head_dim, k);
      tl.expect(same_value(p.scale, r.s), [&] { return describe("stored scale", row, k * gv, -1, p.scale, r.s); });
      tl.expect(same_value(p.min, r.m), [&] { return describe("stored min", row, k * gv, -1, p.min, r.m); });
      for (int i = 0; i < n; ++i) {
        int const c = k * gv + i;
        check_element(tl, xr[c], Value::code(buf.data(), head_dim, c), y[sz(c)], r, B, row, c, i);
      }
    }
  }
  INFO("first failure: " << tl.first);
  CHECK(tl.count == 0);
}

template <class Key>
auto encode_tile(std::vector<float> const& x, int head_dim) -> bytes {
  bytes b(Key::geometry(head_dim).bytes());
  Key::encode_tile(x.data(), head_dim, head_dim, b.data());
  return b;
}

template <class Value>
auto encode_row(std::vector<float> const& x) -> bytes {
  int const n = static_cast<int>(x.size());
  bytes b(Value::geometry(n).bytes());
  Value::encode_row(x.data(), n, b.data());
  return b;
}

template <class Value>
auto decode_row(bytes const& b, int n) -> std::vector<float> {
  std::vector<float> y(sz(n));
  Value::decode_row(b.data(), n, y.data());
  return y;
}

template <class Key>
auto decode_token(bytes const& b, int head_dim, int t) -> std::vector<float> {
  std::vector<float> y(sz(head_dim));
  Key::decode_token(b.data(), head_dim, t, y.data());
  return y;
}

auto u16_at(bytes const& b, std::size_t off) -> unsigned { return b[off] | (static_cast<unsigned>(b[off + 1]) << 8); }

using kivi2_g32 = kvq::kivi<2, 32>;
using kivi4_g32 = kvq::kivi<4, 32>;
using kivi8_g32 = kvq::kivi<8, 32>;
using kivi2_g64 = kvq::kivi<2, 64>;
using kivi4_g64 = kvq::kivi<4, 64>;
using kivi8_g64 = kvq::kivi<8, 64>;
using kivi2_g8 = kvq::kivi<2, 8>;
using kivi4_g8 = kvq::kivi<4, 8>;
using kivi8_g8 = kvq::kivi<8, 8>;

}  // namespace

TEMPLATE_TEST_CASE("kivi keys: exact codes and values, round-trip bound", "[kivi][key]", kivi2_g32, kivi4_g32,
                   kivi8_g32, kivi2_g64, kivi4_g64, kivi8_g64, kivi2_g8, kivi4_g8, kivi8_g8) {
  using key = typename TestType::key_codec;
  for (int hd : head_dims) {
    for (int d = 0; d < dataset_count; ++d) {
      INFO("head_dim " << hd << " dataset " << d);
      int const tokens = 2 * key::group;
      check_keys<key>(dataset(d, tokens, hd, static_cast<std::uint32_t>(1000 * d + hd)), tokens, hd);
    }
  }
}

TEMPLATE_TEST_CASE("kivi values: exact codes and values, round-trip bound", "[kivi][value]", kivi2_g32, kivi4_g32,
                   kivi8_g32, kivi2_g64, kivi4_g64, kivi8_g64, kivi2_g8, kivi4_g8, kivi8_g8) {
  using value = typename TestType::value_codec;
  for (int hd : head_dims) {
    for (int d = 0; d < dataset_count; ++d) {
      INFO("head_dim " << hd << " dataset " << d);
      int const rows = 24;
      check_values<value>(dataset(d, rows, hd, static_cast<std::uint32_t>(2000 * d + hd)), rows, hd);
    }
  }
}

TEST_CASE("kivi: the round-trip bound is tight enough to mean something", "[kivi]") {
  // On N(0,1) data the worst error of 4-bit values must come close to s/2 (the bound is not
  // vacuous) and the mean error must sit well below it.
  using value = kvq::kivi_value<4, 32>;
  int const hd = 128;
  int const rows = 64;
  auto const x = kvq_test::normal_data(sz(rows) * hd, 7);
  double worst = 0.0;
  double sum_ratio = 0.0;
  int n = 0;
  for (int r = 0; r < rows; ++r) {
    std::vector<float> const row(x.begin() + r * hd, x.begin() + (r + 1) * hd);
    auto const b = encode_row<value>(row);
    auto const y = decode_row<value>(b, hd);
    for (int c = 0; c < hd; ++c) {
      float const s = value::group_params(b.data(), hd, c / 32).scale;
      double const ratio = std::abs(static_cast<double>(y[sz(c)]) - row[sz(c)]) / s;
      worst = std::max(worst, ratio);
      sum_ratio += ratio;
      ++n;
    }
  }
  CHECK(worst > 0.45);
  CHECK(worst < 0.52);  // s/2 plus the fp16 rounding of scale and min (< 2% of s here)
  CHECK(sum_ratio / n > 0.2);
  CHECK(sum_ratio / n < 0.3);
}

TEST_CASE("kivi values: packed bytes of hand-built rows", "[kivi][value][layout]") {
  // head_dim 8, G = 32: one group of 8 channels; block = [scale f16][min f16][8*b/8 code bytes].
  SECTION("2-bit: min -2, scale 1, codes 0 1 2 3 3 2 1 0") {
    // byte0 = 0 | 1<<2 | 2<<4 | 3<<6 = 0xe4; byte1 = 3 | 2<<2 | 1<<4 | 0<<6 = 0x1b.
    auto const b = encode_row<kvq::kivi_value<2>>({-2, -1, 0, 1, 1, 0, -1, -2});
    CHECK(hex(b) == "003c00c0e41b");
  }
  SECTION("4-bit: min -2, scale 1, codes 0 15 1 14 2 13 7 8") {
    // Low nibble first: 0xf0, 0xe1, 0xd2, 0x87.
    auto const b = encode_row<kvq::kivi_value<4>>({-2, 13, -1, 12, 0, 11, 5, 6});
    CHECK(hex(b) == "003c00c0f0e1d287");
  }
  SECTION("8-bit: min 0.5 (0x3800), scale 1, codes 0 255 1 128 127 2 254 3") {
    auto const b = encode_row<kvq::kivi_value<8>>({0.5f, 255.5f, 1.5f, 128.5f, 127.5f, 2.5f, 254.5f, 3.5f});
    CHECK(hex(b) == "003c003800ff01807f02fe03");
  }
  SECTION("2-bit, scale 0.5 (0x3800), min 0, codes 3 2 1 0 0 1 2 3") {
    // byte0 = 3 | 2<<2 | 1<<4 = 0x1b; byte1 = 0 | 1<<2 | 2<<4 | 3<<6 = 0xe4.
    auto const b = encode_row<kvq::kivi_value<2>>({1.5f, 1.0f, 0.5f, 0.0f, 0.0f, 0.5f, 1.0f, 1.5f});
    CHECK(hex(b) == "003800001be4");
  }
  SECTION("head_dim 3, 2-bit: one group of 3 channels, 5-byte block, last byte partly unused") {
    // x = 0, 3, 1.5 -> scale 1; 1.5 is a tie -> 2 (even). byte = 0 | 3<<2 | 2<<4 = 0x2c.
    auto const b = encode_row<kvq::kivi_value<2>>({0.0f, 3.0f, 1.5f});
    CHECK(hex(b) == "003c00002c");
  }
  SECTION("head_dim 64, 4-bit, G 32: two blocks, each with its own header") {
    std::vector<float> x(64);
    for (int c = 0; c < 32; ++c) x[sz(c)] = static_cast<float>(c % 16);           // min 0, scale 1
    for (int c = 32; c < 64; ++c) x[sz(c)] = 4.0f + 2.0f * static_cast<float>(15 - (c % 16));  // min 4, scale 2
    auto const b = encode_row<kvq::kivi_value<4>>(x);
    REQUIRE(b.size() == 2 * (4 + 16));
    // Block 0: codes c%16 -> bytes 0x10, 0x32, 0x54, ... 0xfe, twice.
    std::string want0 = "003c0000";
    std::string want1 = "00400044";  // scale 2 = 0x4000, min 4 = 0x4400
    static char const* const digits = "0123456789abcdef";
    for (int rep = 0; rep < 2; ++rep)
      for (int j = 0; j < 8; ++j) {
        want0 += digits[2 * j + 1];
        want0 += digits[2 * j];
        want1 += digits[15 - (2 * j + 1)];
        want1 += digits[15 - 2 * j];
      }
    CHECK(hex(b) == want0 + want1);
  }
}

TEST_CASE("kivi keys: packed bytes of hand-built tiles", "[kivi][key][layout]") {
  // Tile = [head_dim x scale][head_dim x min][head_dim x G*b/8 codes, channel-major, along tokens].
  SECTION("G 8, 2-bit, head_dim 2") {
    // Channel 0: codes 0 1 2 3 3 2 1 0 (min 0, scale 1) -> e4 1b.
    // Channel 1: codes 3 3 0 0 1 2 1 2 with min -4 (0xc400), scale 2 (0x4000):
    //   byte0 = 3 | 3<<2 = 0x0f; byte1 = 1 | 2<<2 | 1<<4 | 2<<6 = 0x99.
    int const c0[8] = {0, 1, 2, 3, 3, 2, 1, 0};
    int const c1[8] = {3, 3, 0, 0, 1, 2, 1, 2};
    std::vector<float> x(16);
    for (int t = 0; t < 8; ++t) {
      x[sz(2 * t)] = static_cast<float>(c0[t]);
      x[sz(2 * t + 1)] = -4.0f + 2.0f * static_cast<float>(c1[t]);
    }
    using key = kvq::kivi_key<2, 8>;
    auto const b = encode_tile<key>(x, 2);
    CHECK(hex(b) == "003c00400000" "00c4" "e41b0f99");
    for (int t = 0; t < 8; ++t) {
      CHECK(key::code(b.data(), 2, 0, t) == c0[t]);
      CHECK(key::code(b.data(), 2, 1, t) == c1[t]);
    }
  }
  SECTION("G 8, 4-bit, head_dim 2") {
    // Channel 0: min -2, scale 1, codes 0 15 1 14 2 13 7 8 -> f0 e1 d2 87.
    // Channel 1: min 1 (0x3c00), scale 0.5 (0x3800), codes 15 0 3 3 8 8 1 2 -> 0f 33 88 21.
    int const c0[8] = {0, 15, 1, 14, 2, 13, 7, 8};
    int const c1[8] = {15, 0, 3, 3, 8, 8, 1, 2};
    std::vector<float> x(16);
    for (int t = 0; t < 8; ++t) {
      x[sz(2 * t)] = -2.0f + static_cast<float>(c0[t]);
      x[sz(2 * t + 1)] = 1.0f + 0.5f * static_cast<float>(c1[t]);
    }
    auto const b = encode_tile<kvq::kivi_key<4, 8>>(x, 2);
    CHECK(hex(b) == "003c0038" "00c0003c" "f0e1d287" "0f338821");
  }
  SECTION("G 8, 8-bit, head_dim 2, channel 1 constant 3.0") {
    // Channel 0: min 0.5, scale 1, codes 0 255 1 128 127 2 254 3. Channel 1: scale 0, min 3 (0x4200).
    int const c0[8] = {0, 255, 1, 128, 127, 2, 254, 3};
    std::vector<float> x(16);
    for (int t = 0; t < 8; ++t) {
      x[sz(2 * t)] = 0.5f + static_cast<float>(c0[t]);
      x[sz(2 * t + 1)] = 3.0f;
    }
    auto const b = encode_tile<kvq::kivi_key<8, 8>>(x, 2);
    CHECK(hex(b) == "003c0000" "00380042" "00ff01807f02fe03" "0000000000000000");
  }
  SECTION("G 32, 2-bit, head_dim 1: 32 tokens of one channel in 8 bytes") {
    std::vector<float> x(32);
    for (int t = 0; t < 32; ++t) x[sz(t)] = static_cast<float>(t % 4);
    CHECK(hex(encode_tile<kvq::kivi_key<2, 32>>(x, 1)) == "003c0000" "e4e4e4e4e4e4e4e4");
    // Reversed order in the second half: codes 3 2 1 0 -> 0x1b.
    for (int t = 16; t < 32; ++t) x[sz(t)] = static_cast<float>(3 - t % 4);
    CHECK(hex(encode_tile<kvq::kivi_key<2, 32>>(x, 1)) == "003c0000" "e4e4e4e41b1b1b1b");
  }
}

TEST_CASE("kivi keys: token_stride is honoured and the gaps are never read", "[kivi][key]") {
  using key = kvq::kivi_key<4, 32>;
  int const hd = 24;
  auto const x = kvq_test::normal_data(32 * hd, 11);
  std::ptrdiff_t const stride = hd + 3;
  std::vector<float> strided(32 * sz(stride), nan_f);
  for (int t = 0; t < 32; ++t)
    for (int c = 0; c < hd; ++c) strided[sz(t) * sz(stride) + sz(c)] = x[sz(t) * hd + sz(c)];
  bytes a(key::geometry(hd).bytes());
  bytes b(key::geometry(hd).bytes());
  key::encode_tile(x.data(), hd, hd, a.data());
  key::encode_tile(strided.data(), stride, hd, b.data());
  CHECK(hex(a) == hex(b));
}

TEST_CASE("kivi: constant groups decode to their fp16-rounded value, never NaN", "[kivi]") {
  // 1e-3, 0.1 and -7.77777 are not fp16 values; 70000 clips to 65504; +-1e-9 round to +-0;
  // 3e-6 is an fp16 subnormal.
  std::vector<float> const consts = {0.0f,  -0.0f, 1.0f,     -3.25f, 1e-3f, 0.1f,  -7.77777f,
                                     7e4f,  -7e4f, 1e-9f,    -1e-9f, 3e-6f, 65504.0f, 1234.567f};
  auto check_all = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    INFO("bits " << B);
    using value = kvq::kivi_value<B, 32>;
    using key = kvq::kivi_key<B, 32>;
    for (float c : consts) {
      INFO("constant " << c);
      float const want = ref_f16(c);
      for (int hd : {1, 8, 40}) {
        std::vector<float> row(sz(hd), c);
        auto const b = encode_row<value>(row);
        auto const y = decode_row<value>(b, hd);
        for (float v : y) {
          CHECK_FALSE(std::isnan(v));
          CHECK(v == want);
        }
        CHECK(value::group_params(b.data(), hd, 0).scale == 0.0f);
      }
      // A key tile whose channels are all constant over the 32 tokens.
      int const hd = 3;
      std::vector<float> x(32 * hd);
      for (int t = 0; t < 32; ++t) {
        x[sz(t) * hd] = c;
        x[sz(t) * hd + 1] = -c;
        x[sz(t) * hd + 2] = c;
      }
      auto const b = encode_tile<key>(x, hd);
      for (int t = 0; t < 32; t += 7) {
        auto const y = decode_token<key>(b, hd, t);
        CHECK(y[0] == want);
        CHECK(y[1] == ref_f16(-c));
        CHECK(y[2] == want);
        CHECK_FALSE(std::isnan(y[1]));
      }
    }
  };
  check_all(std::integral_constant<int, 2>{});
  check_all(std::integral_constant<int, 4>{});
  check_all(std::integral_constant<int, 8>{});

  SECTION("a constant group next to a varying one in the same row") {
    using value = kvq::kivi_value<4, 32>;
    auto x = kvq_test::normal_data(64, 3);
    std::fill(x.begin(), x.begin() + 32, 0.3f);
    auto const y = decode_row<value>(encode_row<value>(x), 64);
    for (int c = 0; c < 32; ++c) CHECK(y[sz(c)] == ref_f16(0.3f));
  }
  SECTION("scale underflow: a non-constant group whose fp16 scale is 0 decodes to its min") {
    // mx - mn = 2^-23, scale = 2^-23 / 255 ~ 4.7e-10 < 2^-25: fp16 0.
    using value = kvq::kivi_value<8, 32>;
    std::vector<float> x = {1.0f, 1.0f + std::ldexp(1.0f, -23), 1.0f, 1.0f + std::ldexp(1.0f, -23)};
    auto const b = encode_row<value>(x);
    CHECK(u16_at(b, 0) == 0x0000);
    CHECK(u16_at(b, 2) == 0x3c00);
    for (float v : decode_row<value>(b, 4)) CHECK(v == 1.0f);
  }
  SECTION("zeros of either sign store +0 whatever their order") {
    using value = kvq::kivi_value<2, 32>;
    CHECK(hex(encode_row<value>({-0.0f, -0.0f})) == "0000000000");
    CHECK(hex(encode_row<value>({0.0f, -0.0f, 3.0f})) == hex(encode_row<value>({-0.0f, 0.0f, 3.0f})));
    CHECK(hex(encode_row<value>({-0.0f, 3.0f})) == "003c00000c");
  }
}

TEST_CASE("kivi values: padding lanes of the last group take no part in min/max", "[kivi][value][padding]") {
  auto run = [](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    INFO("bits " << B);
    using value = kvq::kivi_value<B, 32>;
    int const hd = 80;
    auto const geo = value::geometry(hd);
    REQUIRE(geo.block_channels == 32);
    REQUIRE(geo.blocks == 3);
    REQUIRE(geo.block_bytes == sz(4 + 32 * B / 8));
    REQUIRE(geo.padded_channels() == 96);
    double const maxq = max_code(B);
    for (int sign : {1, -1}) {
      // Channels 64..79 (the last group, 16 real lanes) lie in [1, 4] or [-4, -1]: zero padding
      // would pull the min (resp. max) to 0.
      auto x = kvq_test::normal_data(hd, 5);
      float const sgn = static_cast<float>(sign);
      for (int i = 0; i < 16; ++i) x[sz(64 + i)] = sgn * (1.0f + 3.0f * static_cast<float>(i) / 15.0f);
      x[64] = sgn * 1.0f;
      x[65] = sgn * 4.0f;
      auto const b = encode_row<value>(x);
      auto const p = value::group_params(b.data(), hd, 2);
      float const want_scale = ref_f16(static_cast<float>(3.0 / maxq));
      CHECK(p.scale == want_scale);
      CHECK(p.min == (sign > 0 ? 1.0f : -4.0f));
      // Pad lanes 16..31 hold code 0: every byte of the block from lane 16 on is zero.
      std::size_t const block2 = 2 * geo.block_bytes;
      for (std::size_t j = 4 + 16 * B / 8; j < geo.block_bytes; ++j) CHECK(b[block2 + j] == 0);
      // The 16 real lanes decode within s/2 (+ fp16 rounding slack of the parameters).
      auto const y = decode_row<value>(b, hd);
      for (int c = 64; c < 80; ++c)
        CHECK(std::abs(y[sz(c)] - x[sz(c)]) <= p.scale / 2 + maxq * std::abs(3.0 / maxq - p.scale) + 1e-6);
      int const at_min = sign > 0 ? 64 : 65;  // the element equal to the (fp16-exact) minimum decodes exactly
      CHECK(y[sz(at_min)] == x[sz(at_min)]);
    }
  };
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 4>{});
  run(std::integral_constant<int, 8>{});
}

TEST_CASE("kivi: a NaN or Inf poisons its group only", "[kivi][nan]") {
  for (float bad : {nan_f, inf_f, -inf_f}) {
    INFO("poison " << bad);
    SECTION("values") {
      using value = kvq::kivi_value<4, 32>;
      auto x = kvq_test::normal_data(64, 9);
      auto const clean = encode_row<value>(x);
      x[40] = bad;
      auto const b = encode_row<value>(x);
      REQUIRE(b.size() == 2 * 20);
      // Block 0 is unchanged; block 1 is [7e00][7e00][16 zero bytes].
      CHECK(hex(bytes(b.begin(), b.begin() + 20)) == hex(bytes(clean.begin(), clean.begin() + 20)));
      CHECK(hex(bytes(b.begin() + 20, b.end())) == "007e007e" + std::string(32, '0'));
      auto const y = decode_row<value>(b, 64);
      for (int c = 0; c < 32; ++c) CHECK(std::isfinite(y[sz(c)]));
      for (int c = 32; c < 64; ++c) CHECK(std::isnan(y[sz(c)]));
    }
    SECTION("keys") {
      using key = kvq::kivi_key<2, 32>;
      int const hd = 4;
      auto x = kvq_test::normal_data(32 * hd, 10);
      auto const clean = encode_tile<key>(x, hd);
      x[5 * hd + 2] = bad;  // token 5, channel 2
      auto const b = encode_tile<key>(x, hd);
      CHECK(u16_at(b, key::scale_offset(hd, 2)) == 0x7e00);
      CHECK(u16_at(b, key::min_offset(hd, 2)) == 0x7e00);
      for (int j = 0; j < key::code_bytes; ++j) CHECK(b[key::codes_offset(hd, 2) + sz(j)] == 0);
      for (int c : {0, 1, 3}) {
        CHECK(u16_at(b, key::scale_offset(hd, c)) == u16_at(clean, key::scale_offset(hd, c)));
        CHECK(u16_at(b, key::min_offset(hd, c)) == u16_at(clean, key::min_offset(hd, c)));
        for (int j = 0; j < key::code_bytes; ++j)
          CHECK(b[key::codes_offset(hd, c) + sz(j)] == clean[key::codes_offset(hd, c) + sz(j)]);
      }
      for (int t = 0; t < 32; ++t) {
        auto const y = decode_token<key>(b, hd, t);
        CHECK(std::isnan(y[2]));
        CHECK(std::isfinite(y[0]));
        CHECK(std::isfinite(y[3]));
      }
    }
  }
}

TEST_CASE("kivi: codes round ties to even", "[kivi][ties]") {
  SECTION("2-bit, min 0, scale 1") {
    using value = kvq::kivi_value<2, 32>;
    std::vector<float> const x = {0.0f, 3.0f, 0.5f, 1.5f, 2.5f};
    int const want[] = {0, 3, 0, 2, 2};  // ties away would give 1, 2, 3 for the last three
    auto const b = encode_row<value>(x);
    CHECK(u16_at(b, 0) == 0x3c00);
    for (int c = 0; c < 5; ++c) CHECK(value::code(b.data(), 5, c) == want[c]);
  }
  SECTION("4-bit, min -8, scale 1") {
    using value = kvq::kivi_value<4, 32>;
    std::vector<float> const x = {-8.0f, 7.0f, -7.5f, -6.5f, -5.5f, -4.5f, 5.5f, 6.5f};
    int const want[] = {0, 15, 0, 2, 2, 4, 14, 14};
    auto const b = encode_row<value>(x);
    CHECK(u16_at(b, 0) == 0x3c00);
    CHECK(u16_at(b, 2) == 0xc800);
    for (int c = 0; c < 8; ++c) CHECK(value::code(b.data(), 8, c) == want[c]);
  }
  SECTION("8-bit keys, min 0, scale 1") {
    using key = kvq::kivi_key<8, 8>;
    std::vector<float> const x = {0.0f, 255.0f, 0.5f, 1.5f, 2.5f, 127.5f, 128.5f, 254.5f};
    int const want[] = {0, 255, 0, 2, 2, 128, 128, 254};
    auto const b = encode_tile<key>(x, 1);
    CHECK(u16_at(b, 0) == 0x3c00);
    for (int t = 0; t < 8; ++t) CHECK(key::code(b.data(), 1, 0, t) == want[t]);
  }
}

TEST_CASE("kivi: codes divide by s, they do not multiply by 1/s", "[kivi]") {
  // Groups {0, 255*s, x...} have scale exactly s (an fp16 value) and min 0. The x are the code-domain
  // ties (k + 0.5)*s and their float neighbours; keep those where rne(fl(x/s)) and rne(fl(x*fl(1/s)))
  // differ, and check that the codes follow the division.
  using value = kvq::kivi_value<8, 32>;
  int distinguishing = 0;
  for (float const target : {0.3f, 0.1f, 0.7f, 1.7f, 3.3f, 0.013f}) {
    float const s = ref_f16(target);
    float const recip = 1.0f / s;
    std::vector<float> x = {0.0f, 255.0f * s};
    for (int k = 0; k < 255 && x.size() < 32; ++k) {
      float const tie = (static_cast<float>(k) + 0.5f) * s;  // exact: 9 + 11 significant bits
      for (float v : {std::nextafter(tie, 0.0f), tie, std::nextafter(tie, 1e9f)}) {
        double const by_div = std::nearbyint(static_cast<float>(static_cast<double>(v) / s));
        double const by_mul = std::nearbyint(static_cast<float>(static_cast<double>(v) * recip));
        if (by_div != by_mul && x.size() < 32) x.push_back(v);
      }
    }
    auto const r = make_ref(x, 8);
    REQUIRE(r.s == s);
    REQUIRE(r.m == 0.0f);
    int const n = static_cast<int>(x.size());
    distinguishing += n - 2;
    auto const b = encode_row<value>(x);
    for (int c = 2; c < n; ++c) CHECK(value::code(b.data(), n, c) == ref_code(x[sz(c)], r, 8));
  }
  REQUIRE(distinguishing >= 10);
}

TEST_CASE("kivi: codes are computed from the stored fp16 scale and min", "[kivi]") {
  SECTION("scale: 255 * 1.0003 / 255 rounds to fp16 1.0") {
    using value = kvq::kivi_value<8, 32>;
    std::vector<float> const x = {0.0f, 200.52f, 255.0f * 1.0003f};
    auto const r = make_ref(x, 8);
    REQUIRE(r.scale != r.s);
    REQUIRE(r.s == 1.0f);
    // Precondition: the unrounded scale would give 200, the stored one gives 201.
    REQUIRE(std::nearbyint(static_cast<double>(x[1]) / r.scale) == 200.0);
    REQUIRE(std::nearbyint(static_cast<double>(x[1]) / r.s) == 201.0);
    auto const b = encode_row<value>(x);
    CHECK(value::code(b.data(), 3, 1) == 201);
    CHECK(value::code(b.data(), 3, 2) == 255);
  }
  SECTION("min: 0.1 is stored as fp16 0.0999755859375") {
    using key = kvq::kivi_key<8, 8>;
    float const mn = 0.1f;
    float const m = ref_f16(mn);
    REQUIRE(m < mn);
    std::vector<float> x(8, mn);
    x[1] = mn + 255.0f;
    x[2] = mn + 2.49999f;  // x - mn is below 2.5, x - m above it
    auto const r = make_ref(x, 8);
    REQUIRE(r.s == 1.0f);
    REQUIRE(std::nearbyint(static_cast<double>(x[2] - mn)) == 2.0);
    REQUIRE(std::nearbyint(static_cast<double>(x[2] - m)) == 3.0);
    auto const b = encode_tile<key>(x, 1);
    CHECK(key::group_params(b.data(), 1, 0).min == m);
    CHECK(key::code(b.data(), 1, 0, 2) == 3);
    CHECK(key::code(b.data(), 1, 0, 0) == 0);  // x = mn > m: quotient 2.4e-5 -> 0
  }
}

TEST_CASE("kivi: magnitudes beyond fp16 are clipped, never Inf or NaN", "[kivi]") {
  using value = kvq::kivi_value<8, 32>;
  SECTION("min below -65504") {
    auto const b = encode_row<value>({-1e5f, 0.0f, 1e5f, 5.0f});
    CHECK(value::group_params(b.data(), 4, 0).min == -65504.0f);
    auto const y = decode_row<value>(b, 4);
    CHECK(y[0] == -65504.0f);
    for (float v : y) CHECK(std::isfinite(v));
    // The top of the range is still reached within one step: scale = 2e5/255, q = 211.
    CHECK(std::abs(y[2] - 1e5f) <= value::group_params(b.data(), 4, 0).scale);
  }
  SECTION("a range that overflows fp32 saturates the scale") {
    auto const b = encode_row<value>({-3e38f, 3e38f, 0.0f});
    CHECK(u16_at(b, 0) == 0x7bff);
    CHECK(u16_at(b, 2) == 0xfbff);
    for (float v : decode_row<value>(b, 3)) CHECK(std::isfinite(v));
  }
}

TEST_CASE("kivi: geometry and bits per element", "[kivi][geometry]") {
  using kvq::bits_per_element;
  using kvq::block_geometry;
  // Keys: per channel, 4 parameter bytes over G tokens + b bits each: b + 32/G bits per element.
  STATIC_REQUIRE(kvq::kivi_key<4, 32>::geometry(128) == block_geometry{128, 1, 32, 128 * (4 + 16)});
  STATIC_REQUIRE(kvq::kivi_key<2, 64>::geometry(80) == block_geometry{80, 1, 64, 80 * (4 + 16)});
  STATIC_REQUIRE(kvq::kivi_key<8, 8>::geometry(1) == block_geometry{1, 1, 8, 1 * (4 + 8)});
  for (int hd : head_dims) {
    CHECK(bits_per_element<kvq::kivi_key<4, 32>>(hd) == 5.0);
    CHECK(bits_per_element<kvq::kivi_key<2, 32>>(hd) == 3.0);
    CHECK(bits_per_element<kvq::kivi_key<8, 64>>(hd) == 8.5);
    CHECK(bits_per_element<kvq::kivi_key<2, 8>>(hd) == 6.0);
  }
  // Values: groups of gv = min(G, head_dim) channels, 4 + ceil(gv*b/8) bytes each.
  STATIC_REQUIRE(kvq::kivi_value<4, 32>::geometry(128) == block_geometry{32, 4, 1, 4 + 16});
  STATIC_REQUIRE(kvq::kivi_value<4, 32>::geometry(80) == block_geometry{32, 3, 1, 4 + 16});
  STATIC_REQUIRE(kvq::kivi_value<2, 32>::geometry(8) == block_geometry{8, 1, 1, 4 + 2});
  STATIC_REQUIRE(kvq::kivi_value<2, 32>::geometry(1) == block_geometry{1, 1, 1, 4 + 1});
  STATIC_REQUIRE(kvq::kivi_value<4, 32>::geometry(3) == block_geometry{3, 1, 1, 4 + 2});
  STATIC_REQUIRE(kvq::kivi_value<8, 64>::geometry(96) == block_geometry{64, 2, 1, 4 + 64});
  CHECK(bits_per_element<kvq::kivi_value<4, 32>>(128) == 5.0);   // (32 + 128) bits per 32 channels
  CHECK(bits_per_element<kvq::kivi_value<2, 32>>(128) == 3.0);   // (32 + 64) / 32
  CHECK(bits_per_element<kvq::kivi_value<4, 32>>(80) == 6.0);    // 3 * (32 + 128) / 80
  CHECK(bits_per_element<kvq::kivi_value<8, 32>>(96) == 9.0);    // 3 * (32 + 256) / 96
  CHECK(bits_per_element<kvq::kivi_value<2, 32>>(8) == 6.0);     // (32 + 16) / 8
  CHECK(bits_per_element<kvq::kivi_value<2, 32>>(1) == 40.0);    // (32 + 8) / 1
  CHECK(bits_per_element<kvq::kivi_value<8, 64>>(96) == 2 * (32.0 + 512.0) / 96);
}

TEST_CASE("kivi: codec concepts, names and pairs", "[kivi]") {
  STATIC_REQUIRE(kvq::token_group_codec<kvq::kivi_key<2>>);
  STATIC_REQUIRE(kvq::token_group_codec<kvq::kivi_key<8, 64>>);
  STATIC_REQUIRE_FALSE(kvq::row_codec<kvq::kivi_key<4>>);
  STATIC_REQUIRE(kvq::row_codec<kvq::kivi_value<4>>);
  STATIC_REQUIRE(kvq::row_codec<kvq::kivi_value<2, 8>>);
  STATIC_REQUIRE_FALSE(kvq::token_group_codec<kvq::kivi_value<4>>);
  STATIC_REQUIRE(kvq::codec_choice<kvq::kivi<4>>);
  STATIC_REQUIRE(std::is_same_v<kvq::codec_pair<kvq::kivi<4>>::key, kvq::kivi_key<4, 32>>);
  STATIC_REQUIRE(std::is_same_v<kvq::codec_pair<kvq::kivi<2, 64>>::value, kvq::kivi_value<2, 64>>);
  STATIC_REQUIRE(kvq::kivi<2>::name == "kivi2");
  STATIC_REQUIRE(kvq::kivi<4>::name == "kivi4");
  STATIC_REQUIRE(kvq::kivi<8, 64>::name == "kivi8");
  STATIC_REQUIRE(kvq::kivi<8, 64>::bits == 8);
  STATIC_REQUIRE(kvq::kivi<8, 64>::group == 64);
  STATIC_REQUIRE(kvq::kivi<4>::group == 32);
  STATIC_REQUIRE(kvq::kivi_key<4, 16>::code_bytes == 8);
}
