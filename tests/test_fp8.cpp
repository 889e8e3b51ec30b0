// Tests of the FP8 codecs (E4M3FN, E5M2) against the golden vectors in fp8.json and the format's own bounds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "catch_compat.hpp"
#include "kvq/codec/fp8.hpp"

namespace {

using json = nlohmann::json;

constexpr kvq::fp8_params sat{1.0f, kvq::fp8_overflow::saturate};
constexpr kvq::fp8_params nosat{1.0f, kvq::fp8_overflow::no_saturate};

auto bits_of(float x) -> std::uint32_t {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

auto float_of(std::uint32_t u) -> float {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

auto hex(json const& j) -> std::uint32_t {
  return static_cast<std::uint32_t>(std::stoul(j.get<std::string>(), nullptr, 16));
}

auto hex_f32(json const& j) -> float { return float_of(hex(j)); }

auto hex_code(json const& j) -> std::uint8_t { return static_cast<std::uint8_t>(hex(j)); }

auto vectors() -> json const& {
  static json const doc = [] {
    std::string const path = std::string(KVQ_TESTVECTORS_DIR) + "/fp8.json";
    std::ifstream in(path);
    if (!in) FAIL("golden vector file missing or unreadable: " << path);
    return json::parse(in);
  }();
  return doc;
}

/// Per-format pieces the table-driven tests need.
template <class C>
struct format_of;
template <>
struct format_of<kvq::fp8_e4m3> {
  static constexpr char const* key = "e4m3fn";
  static constexpr std::size_t encode_cases = 1649;
  static constexpr std::uint8_t max_code = 0x7e;
  static constexpr std::uint8_t nosat_overflow = 0x7f;  // NaN
  static constexpr int mbits = 3;
  static constexpr int min_exp = -6;  // exponent of the smallest normal
  static constexpr float max_finite = 448.0f;
  static auto is_nan_code(std::uint8_t c) -> bool { return (c & 0x7f) == 0x7f; }
  static auto raw_encode(float x, bool saturate) -> std::uint8_t { return kvq::detail::f32_to_e4m3(x, saturate); }
  static auto raw_decode(std::uint8_t c) -> float { return kvq::detail::e4m3_to_f32(c); }
};
template <>
struct format_of<kvq::fp8_e5m2> {
  static constexpr char const* key = "e5m2";
  static constexpr std::size_t encode_cases = 1623;
  static constexpr std::uint8_t max_code = 0x7b;
  static constexpr std::uint8_t nosat_overflow = 0x7c;  // Inf
  static constexpr int mbits = 2;
  static constexpr int min_exp = -14;
  static constexpr float max_finite = 57344.0f;
  static auto is_nan_code(std::uint8_t c) -> bool { return (c & 0x7f) > 0x7c; }
  static auto raw_encode(float x, bool saturate) -> std::uint8_t { return kvq::detail::f32_to_e5m2(x, saturate); }
  static auto raw_decode(std::uint8_t c) -> float { return kvq::detail::e5m2_to_f32(c); }
};

/// LCG of the golden-vector generators: uniform in [-amp, amp).
struct lcg {
  std::uint32_t s;
  auto next(float amp) -> float {
    s = s * 1664525u + 1013904223u;
    float const u = static_cast<float>(s >> 8) * (1.0f / 16777216.0f);
    return (2.0f * u - 1.0f) * amp;
  }
};

}  // namespace

static_assert(kvq::row_codec<kvq::fp8_e4m3>);
static_assert(kvq::row_codec<kvq::fp8_e5m2>);
static_assert(kvq::fp8_params_valid(kvq::fp8_params{}));
static_assert(kvq::fp8_params{} == sat);
static_assert(!(sat == nosat));

TEST_CASE("fp8 codecs: names, geometry and bits per element", "[fp8]") {
  CHECK(kvq::fp8_e4m3::name == "fp8_e4m3");
  CHECK(kvq::fp8_e5m2::name == "fp8_e5m2");
  for (int const d : {1, 3, 64, 80, 96, 128, 256}) {
    INFO("head_dim " << d);
    kvq::block_geometry const expected{1, d, 1, 1};
    CHECK(kvq::fp8_e4m3::geometry(d) == expected);
    CHECK(kvq::fp8_e5m2::geometry(d) == expected);
    CHECK(kvq::fp8_e4m3::geometry(d).bytes() == static_cast<std::size_t>(d));
    CHECK(kvq::fp8_e4m3::geometry(d).padded_channels() == d);
    CHECK(kvq::bits_per_element<kvq::fp8_e4m3>(d) == 8.0);
    CHECK(kvq::bits_per_element<kvq::fp8_e5m2>(d) == 8.0);
  }
}

TEST_CASE("fp8 params: validity and equality", "[fp8]") {
  float const inf = std::numeric_limits<float>::infinity();
  float const nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvq::fp8_params_valid({1.0f}));
  CHECK(kvq::fp8_params_valid({0.0123f, kvq::fp8_overflow::no_saturate}));
  CHECK(kvq::fp8_params_valid({std::numeric_limits<float>::denorm_min()}));
  CHECK(kvq::fp8_params_valid({std::numeric_limits<float>::max()}));
  CHECK_FALSE(kvq::fp8_params_valid({0.0f}));
  CHECK_FALSE(kvq::fp8_params_valid({-0.0f}));
  CHECK_FALSE(kvq::fp8_params_valid({-1.0f}));
  CHECK_FALSE(kvq::fp8_params_valid({inf}));
  CHECK_FALSE(kvq::fp8_params_valid({-inf}));
  CHECK_FALSE(kvq::fp8_params_valid({nan}));
  CHECK(kvq::fp8_params{2.0f} == kvq::fp8_params{2.0f, kvq::fp8_overflow::saturate});
  CHECK_FALSE(kvq::fp8_params{2.0f} == kvq::fp8_params{0.5f});
  CHECK_FALSE(kvq::fp8_params{2.0f} == kvq::fp8_params{2.0f, kvq::fp8_overflow::no_saturate});
}

TEMPLATE_TEST_CASE("fp8: every decode_table entry", "[fp8][vectors]", kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  json const& table = vectors().at(F::key).at("decode_table");
  REQUIRE(table.size() == 256);
  std::vector<bool> seen(256, false);
  int nans = 0;
  for (json const& e : table) {
    std::uint8_t const code = hex_code(e.at("code"));
    std::string const kind = e.at("kind").get<std::string>();
    INFO(F::key << " code " << int(code) << " kind " << kind);
    seen[code] = true;
    float const raw = F::raw_decode(code);
    float const via_codec = TestType::decode(code);
    CHECK(F::is_nan_code(code) == (kind == "nan"));
    if (kind == "nan") {
      ++nans;
      CHECK(std::isnan(raw));
      CHECK(std::isnan(via_codec));
    } else {
      std::uint32_t const expected = hex(e.at("f32"));
      CHECK(bits_of(raw) == expected);
      CHECK(bits_of(via_codec) == expected);
    }
  }
  for (int c = 0; c < 256; ++c) CHECK(seen[static_cast<std::size_t>(c)]);
  CHECK(nans == (std::string(F::key) == "e4m3fn" ? 2 : 6));
}

TEMPLATE_TEST_CASE("fp8: every encode_case in both overflow modes", "[fp8][vectors]", kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  json const& cases = vectors().at(F::key).at("encode_cases");
  REQUIRE(cases.size() == F::encode_cases);
  std::size_t nan_inputs = 0;
  std::size_t nan_expectations = 0;
  for (json const& c : cases) {
    float const x = hex_f32(c.at(0));
    std::uint8_t const want_sat = hex_code(c.at(1));
    std::uint8_t const want_nosat = hex_code(c.at(2));
    INFO(F::key << " input " << c.at(0).get<std::string>() << " tag " << c.at(3).get<std::string>());
    std::uint8_t const got_sat = TestType::encode(x, sat);
    std::uint8_t const got_nosat = TestType::encode(x, nosat);
    CHECK(F::raw_encode(x, true) == got_sat);
    CHECK(F::raw_encode(x, false) == got_nosat);
    CHECK(TestType::encode(x) == got_sat);  // saturate is the default
    if (std::isnan(x)) {
      // Expected codes are NaN codes ("any NaN"); kvq matches CUDA exactly: 0x7f whatever the sign.
      ++nan_inputs;
      CHECK(F::is_nan_code(want_sat));
      CHECK(F::is_nan_code(want_nosat));
      CHECK(int(got_sat) == 0x7f);
      CHECK(int(got_nosat) == 0x7f);
      continue;
    }
    // A NaN code expected for a non-NaN input is the E4M3FN no-saturate overflow, 0x7f|sign, pinned exactly.
    if (F::is_nan_code(want_nosat)) ++nan_expectations;
    CHECK(int(got_sat) == int(want_sat));
    CHECK(int(got_nosat) == int(want_nosat));
  }
  CHECK(nan_inputs == 5);
  if (std::string(F::key) == "e4m3fn") CHECK(nan_expectations > 0);
}

TEMPLATE_TEST_CASE("fp8: every scaled case (vLLM convention)", "[fp8][vectors]", kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  json const& cases = vectors().at(F::key).at("scaled_cases");
  REQUIRE(cases.size() == 48);
  for (json const& c : cases) {
    float const x = hex_f32(c.at(0));
    float const scale = hex_f32(c.at(1));
    std::uint8_t const want_code = hex_code(c.at(2));
    std::uint32_t const want_value = hex(c.at(3));
    INFO(F::key << " x " << c.at(0).get<std::string>() << " scale " << c.at(1).get<std::string>());
    kvq::fp8_params const p{scale};
    REQUIRE(kvq::fp8_params_valid(p));
    std::uint8_t const code = TestType::encode(x, p);
    CHECK(int(code) == int(want_code));
    CHECK(bits_of(TestType::decode(want_code, p)) == want_value);
    CHECK(bits_of(TestType::decode(code, p)) == want_value);
  }
}

TEMPLATE_TEST_CASE("fp8: encode_row and decode_row agree with the golden element codes", "[fp8][vectors]",
                   kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  json const& cases = vectors().at(F::key).at("encode_cases");
  std::vector<float> xs;
  std::vector<std::uint8_t> want_sat, want_nosat;
  for (json const& c : cases) {
    float const x = hex_f32(c.at(0));
    if (std::isnan(x)) continue;
    xs.push_back(x);
    want_sat.push_back(hex_code(c.at(1)));
    want_nosat.push_back(hex_code(c.at(2)));
  }
  REQUIRE(xs.size() >= 1024);
  constexpr std::uint8_t canary = 0xa5;
  for (int const head_dim : {1, 3, 64, 96, 128, 256}) {
    for (std::size_t base = 0; base + static_cast<std::size_t>(head_dim) <= xs.size(); base += 97) {
      INFO(F::key << " head_dim " << head_dim << " base " << base);
      std::size_t const n = static_cast<std::size_t>(head_dim);
      std::vector<std::uint8_t> row(n + 1, canary);
      TestType::encode_row(xs.data() + base, head_dim, row.data());
      CHECK(row[n] == canary);
      bool same = true;
      for (std::size_t i = 0; i < n; ++i) same = same && row[i] == want_sat[base + i];
      CHECK(same);
      TestType::encode_row(xs.data() + base, head_dim, row.data(), nosat);
      same = true;
      for (std::size_t i = 0; i < n; ++i) same = same && row[i] == want_nosat[base + i];
      CHECK(same);
      // decode_row equals the element decode, bit for bit, at scale 1 and at a non-trivial scale.
      for (float const scale : {1.0f, 0.0123f}) {
        kvq::fp8_params const p{scale};
        std::vector<float> y(n + 1, -7.0f);
        TestType::decode_row(row.data(), head_dim, y.data(), p);
        CHECK(y[n] == -7.0f);
        same = true;
        for (std::size_t i = 0; i < n; ++i) {
          float const e = TestType::decode(row[i], p);
          same = same && (bits_of(y[i]) == bits_of(e) || (std::isnan(y[i]) && std::isnan(e)));
        }
        CHECK(same);
      }
    }
  }
}

TEMPLATE_TEST_CASE("fp8: scaled encode_row is the element encode of x / scale", "[fp8]", kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  constexpr int head_dim = 128;
  lcg g{0x1234u};
  for (float const scale : {1.0f, 0.5f, 3.0f, 0.0123f, 1e-3f, 200.0f}) {
    for (auto const mode : {kvq::fp8_overflow::saturate, kvq::fp8_overflow::no_saturate}) {
      INFO(F::key << " scale " << scale << " mode " << int(mode));
      kvq::fp8_params const p{scale, mode};
      std::vector<float> x(head_dim);
      for (float& v : x) v = g.next(F::max_finite * scale * 1.25f);
      std::vector<std::uint8_t> row(head_dim);
      TestType::encode_row(x.data(), head_dim, row.data(), p);
      std::vector<float> y(head_dim);
      TestType::decode_row(row.data(), head_dim, y.data(), p);
      bool same = true;
      for (int i = 0; i < head_dim; ++i) {
        auto const k = static_cast<std::size_t>(i);
        float const q = x[k] / scale;
        same = same && row[k] == F::raw_encode(q, mode == kvq::fp8_overflow::saturate);
        same = same && bits_of(y[k]) == bits_of(F::raw_decode(row[k]) * scale);
      }
      CHECK(same);
    }
  }
}

TEMPLATE_TEST_CASE("fp8: NaN and Inf are pinned in both modes, with and without scale", "[fp8]", kvq::fp8_e4m3,
                   kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  float const inf = std::numeric_limits<float>::infinity();
  float const nans[] = {float_of(0x7fc00000u), float_of(0xffc00000u), float_of(0x7f800001u), float_of(0xffffffffu)};
  for (float const scale : {1.0f, 0.5f, 2.0f, 0.0123f}) {
    INFO(F::key << " scale " << scale);
    kvq::fp8_params const ps{scale, kvq::fp8_overflow::saturate};
    kvq::fp8_params const pn{scale, kvq::fp8_overflow::no_saturate};
    CHECK(int(TestType::encode(inf, ps)) == F::max_code);
    CHECK(int(TestType::encode(-inf, ps)) == (0x80 | F::max_code));
    CHECK(int(TestType::encode(inf, pn)) == F::nosat_overflow);
    CHECK(int(TestType::encode(-inf, pn)) == (0x80 | F::nosat_overflow));
    for (float const n : nans) {
      CHECK(int(TestType::encode(n, ps)) == 0x7f);
      CHECK(int(TestType::encode(n, pn)) == 0x7f);
    }
    // A finite input overflowing only through the scale follows the same rule.
    float const big = F::max_finite * scale * 4.0f;
    CHECK(int(TestType::encode(big, ps)) == F::max_code);
    CHECK(int(TestType::encode(-big, ps)) == (0x80 | F::max_code));
    CHECK(int(TestType::encode(big, pn)) == F::nosat_overflow);
    CHECK(int(TestType::encode(-big, pn)) == (0x80 | F::nosat_overflow));
    // Decoding: NaN codes give kvq's quiet NaN with the code's sign; E5M2 infinities stay infinite.
    CHECK(bits_of(TestType::decode(0x7f, ps)) == 0x7fc00000u);
    CHECK(bits_of(TestType::decode(0xff, ps)) == 0xffc00000u);
    if constexpr (F::mbits == 2) {
      CHECK(TestType::decode(0x7c, ps) == inf);
      CHECK(TestType::decode(0xfc, ps) == -inf);
      for (std::uint8_t const c : {0x7d, 0x7e, 0xfd, 0xfe}) CHECK(std::isnan(TestType::decode(c, ps)));
    } else {
      CHECK(TestType::decode(0x7e, ps) == 448.0f * scale);
      CHECK(TestType::decode(0xfe, ps) == -448.0f * scale);
    }
  }
  // x / scale overflowing f32 itself is still an overflow, and an f32 subnormal quotient underflows with its sign.
  kvq::fp8_params const tiny{1e-3f};
  CHECK(int(TestType::encode(3e38f, tiny)) == F::max_code);
  CHECK(int(TestType::encode(-3e38f, {1e-3f, kvq::fp8_overflow::no_saturate})) == (0x80 | F::nosat_overflow));
  CHECK(int(TestType::encode(1e-30f, kvq::fp8_params{1e9f})) == 0x00);
  CHECK(int(TestType::encode(-1e-30f, kvq::fp8_params{1e9f})) == 0x80);
}

TEMPLATE_TEST_CASE("fp8: every non-NaN code round-trips through decode and encode", "[fp8]", kvq::fp8_e4m3,
                   kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  int checked = 0;
  for (int c = 0; c < 256; ++c) {
    auto const code = static_cast<std::uint8_t>(c);
    if (F::is_nan_code(code)) continue;
    bool const is_inf = F::mbits == 2 && (c & 0x7f) == 0x7c;
    // Power-of-two scales keep code * scale exact inside f32's normal range.
    for (float const scale : {1.0f, 0.5f, 2.0f, 256.0f, 0.0009765625f}) {
      INFO(F::key << " code " << c << " scale " << scale);
      kvq::fp8_params const pn{scale, kvq::fp8_overflow::no_saturate};
      kvq::fp8_params const ps{scale, kvq::fp8_overflow::saturate};
      float const v = TestType::decode(code, ps);
      CHECK(int(TestType::encode(v, pn)) == c);
      CHECK(int(TestType::encode(v, ps)) == (is_inf ? ((c & 0x80) | F::max_code) : c));
      ++checked;
    }
  }
  CHECK(checked == 5 * (F::mbits == 3 ? 254 : 250));
}

TEMPLATE_TEST_CASE("fp8: rounding error is within half a step of the format", "[fp8]", kvq::fp8_e4m3, kvq::fp8_e5m2) {
  using F = format_of<TestType>;
  // Step of the fp8 grid at magnitude a: 2^(e - mbits) for a in [2^e, 2^(e+1)), clamped below at the subnormal quantum.
  auto const half_step = [](double a) {
    int e = a > 0 ? static_cast<int>(std::floor(std::log2(a))) : F::min_exp;
    if (e < F::min_exp) e = F::min_exp;
    return std::ldexp(1.0, e - F::mbits - 1);
  };
  lcg g{0xbeefu};
  std::size_t within_bound = 0;
  for (int i = 0; i < 200000; ++i) {
    // Log-uniform magnitudes from far below the subnormal quantum up to the max finite value.
    float const t = 0.5f * (g.next(1.0f) + 1.0f);
    float const mag = std::ldexp(1.0f, F::min_exp - F::mbits - 4) *
                      std::pow(F::max_finite / std::ldexp(1.0f, F::min_exp - F::mbits - 4), t);
    float const x = (i & 1) ? -std::min(mag, F::max_finite) : std::min(mag, F::max_finite);
    std::uint8_t const code = TestType::encode(x, kvq::fp8_params{1.0f, kvq::fp8_overflow::no_saturate});
    float const y = TestType::decode(code);
    double const err = std::fabs(static_cast<double>(y) - static_cast<double>(x));
    double const bound = half_step(std::fabs(static_cast<double>(x)));
    if (!(err <= bound)) {
      INFO(F::key << " x " << x << " code " << int(code) << " y " << y);
      CHECK(err <= bound);
    } else {
      ++within_bound;
    }
    // The sign is always kept, zeros included.
    CHECK(std::signbit(y) == std::signbit(x));
  }
  CHECK(within_bound == 200000);
}
