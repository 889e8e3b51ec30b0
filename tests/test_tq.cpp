// Tests of the tq codebook codecs in the rotated space (codec/tq.hpp, FORMATS.md §6.2 steps 2-8):
// row sizes, bytes against an independent reimplementation, boundaries, zero blocks, NaN/Inf,
// decoding, the LSB-first bit stream and the distortion of Gaussian rows.
#include <kvq/codec/tq.hpp>
#include <kvq/detail/rotation.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

using kvq_test::bits;
using kvq_test::hex;

namespace {

template <int B>
using codebook = kvq::detail::tq_codebook<B>;

static_assert(kvq::row_codec<codebook<2>> && kvq::row_codec<codebook<3>> && kvq::row_codec<codebook<4>>);

auto f32(std::uint32_t u) -> float { return std::bit_cast<float>(u); }

// ---- An independent reimplementation of steps 2-8: float64 arithmetic rounded to float32 after
// each operation (innocuous double rounding for +, *, / and sqrt: 53 >= 2 * 24 + 2), plain loops.

/// The 2^B centroids, ascending, from the positive halves listed in FORMATS.md §6.2.
auto ref_centroids(int b) -> std::vector<float> {
  std::vector<std::uint32_t> pos;
  if (b == 2) pos = {0x3ee7d567, 0x3fc154ca};
  if (b == 3) pos = {0x3e7afb7f, 0x3f418937, 0x3fac0831, 0x4009ba5e};
  if (b == 4) pos = {0x3e037b4a, 0x3ec6b50b, 0x3f28240b, 0x3f714120, 0x3fa0cb29, 0x3fcf1aa0, 0x40046a7f, 0x402ee2eb};
  std::vector<float> c;
  for (auto it = pos.rbegin(); it != pos.rend(); ++it) c.push_back(-f32(*it));
  for (auto u : pos) c.push_back(f32(u));
  return c;
}

auto rnd(double v) -> float { return static_cast<float>(v); }
auto add(float a, float b) -> float { return rnd(static_cast<double>(a) + static_cast<double>(b)); }
auto mul(float a, float b) -> float { return rnd(static_cast<double>(a) * static_cast<double>(b)); }
auto divide(float a, float b) -> float { return rnd(static_cast<double>(a) / static_cast<double>(b)); }
auto root(float a) -> float { return rnd(std::sqrt(static_cast<double>(a))); }

auto ref_boundaries(int b) -> std::vector<float> {
  auto const c = ref_centroids(b);
  std::vector<float> t;
  for (std::size_t j = 0; j + 1 < c.size(); ++j) t.push_back(mul(add(c[j], c[j + 1]), 0.5f));
  return t;
}

/// f16 bits of a float >= 0 (or +Inf), round to nearest even, via frexp/ldexp.
auto ref_f16(float g) -> std::uint16_t {
  if (std::isinf(g) || g >= 65520.0f) return 0x7c00;
  if (g == 0.0f) return 0;
  int e = 0;
  std::frexp(static_cast<double>(g), &e);  // g = m * 2^e, m in [0.5, 1)
  int const exponent = std::max(e - 1, -14);
  double const q = std::nearbyint(static_cast<double>(g) / std::ldexp(1.0, exponent - 10));
  return static_cast<std::uint16_t>(((exponent + 14) << 10) + static_cast<int>(q));
}

/// The float32 value of f16 bits (finite or NaN), via ldexp.
auto ref_f16_value(std::uint16_t h) -> float {
  int const e = (h >> 10) & 31;
  int const m = h & 1023;
  double const mag = e == 31  ? (m != 0 ? std::numeric_limits<double>::quiet_NaN() : HUGE_VAL)
                     : e == 0 ? std::ldexp(m, -24)
                              : std::ldexp(1024 + m, e - 25);
  return static_cast<float>((h & 0x8000) != 0 ? -mag : mag);
}

auto ref_blocks(int d) -> std::vector<int> {
  std::vector<int> sizes;
  for (int b = 30; b >= 0; --b)
    if ((d >> b) & 1) sizes.push_back(1 << b);
  return sizes;
}

/// Sum of squares of v in the order of step 2: 32 partial sums, then the +16, +8, +4, +2, +1 tree.
auto ref_sum_squares(std::vector<float> const& v) -> float {
  std::vector<float> part(32, 0.0f);
  for (std::size_t i = 0; i < v.size(); ++i) part[i % 32] = add(part[i % 32], mul(v[i], v[i]));
  for (std::size_t w : {16u, 8u, 4u, 2u, 1u})
    for (std::size_t l = 0; l < w; ++l) part[l] = add(part[l], part[l + w]);
  return part[0];
}

struct ref_row {
  std::vector<std::uint16_t> scales;
  std::vector<int> codes;
  std::vector<std::uint8_t> bytes;
};

/// Steps 2-8 on a rotated row y.
auto ref_encode(int b, std::vector<float> const& y) -> ref_row {
  int const d = static_cast<int>(y.size());
  auto const c = ref_centroids(b);
  auto const t = ref_boundaries(b);
  ref_row r;
  r.codes.assign(y.size(), 0);
  bool finite = true;
  for (float v : y) finite = finite && std::isfinite(v);
  int offset = 0;
  for (int n : ref_blocks(d)) {
    std::vector<float> const blk(y.begin() + offset, y.begin() + offset + n);
    float const nu = root(ref_sum_squares(blk));
    if (!finite) {
      r.scales.push_back(0x7e00);
    } else if (nu == 0.0f) {
      r.scales.push_back(0);
    } else {
      float const k = divide(root(static_cast<float>(n)), nu);
      std::vector<float> chosen;
      for (int i = 0; i < n; ++i) {
        float const z = mul(blk[static_cast<std::size_t>(i)], k);
        // The first boundary at or above z; past the last one, the top code.
        int code = static_cast<int>(t.size());
        for (std::size_t j = 0; j < t.size(); ++j)
          if (z <= t[j]) {
            code = static_cast<int>(j);
            break;
          }
        r.codes[static_cast<std::size_t>(offset + i)] = code;
        chosen.push_back(c[static_cast<std::size_t>(code)]);
      }
      float const rho = root(ref_sum_squares(chosen));
      r.scales.push_back(ref_f16(divide(nu, rho)));
    }
    offset += n;
  }
  for (auto s : r.scales) {
    r.bytes.push_back(static_cast<std::uint8_t>(s % 256));
    r.bytes.push_back(static_cast<std::uint8_t>(s / 256));
  }
  std::vector<bool> stream;  // LSB-first: bit k of the stream is bit k % 8 of byte k / 8
  for (int code : r.codes)
    for (int k = 0; k < b; ++k) stream.push_back(((code >> k) & 1) != 0);
  while (stream.size() % 8 != 0) stream.push_back(false);
  for (std::size_t k = 0; k < stream.size(); k += 8) {
    int byte = 0;
    for (int m = 0; m < 8; ++m) byte += stream[k + static_cast<std::size_t>(m)] ? (1 << m) : 0;
    r.bytes.push_back(static_cast<std::uint8_t>(byte));
  }
  return r;
}

// ---- Calling the codec.

template <int B>
auto encode(std::vector<float> const& y) -> std::vector<std::uint8_t> {
  int const d = static_cast<int>(y.size());
  std::size_t const size = codebook<B>::geometry(d).bytes();
  std::vector<std::uint8_t> out(size + 8, 0xcd);
  codebook<B>::encode_row(y.data(), d, out.data());
  for (std::size_t i = size; i < out.size(); ++i) REQUIRE(out[i] == 0xcd);  // nothing written past the row
  out.resize(size);
  return out;
}

template <int B>
auto decode(std::vector<std::uint8_t> const& bytes, int d) -> std::vector<float> {
  std::vector<float> y(static_cast<std::size_t>(d), -7.0f);
  codebook<B>::decode_row(bytes.data(), d, y.data());
  return y;
}

template <int B>
auto code_of(std::vector<std::uint8_t> const& bytes, int d, int i) -> int {
  return kvq::detail::tq_code<B>(bytes.data(), d, i);
}

/// Rows of head_dim d: Gaussian (several scales), outlier-heavy, rotated outlier rows, a zero block.
auto test_rows(int d, std::uint32_t seed) -> std::vector<std::vector<float>> {
  std::vector<std::vector<float>> rows;
  auto const g = kvq_test::normal_data(static_cast<std::size_t>(d) * 4, seed);
  for (int r = 0; r < 4; ++r) rows.emplace_back(g.begin() + r * d, g.begin() + (r + 1) * d);
  for (float s : {1e-3f, 1e3f, 1e-21f, 1e-30f, 3e19f, 1e25f}) {
    std::vector<float> v(g.begin(), g.begin() + d);
    for (auto& x : v) x *= s;
    rows.push_back(v);
  }
  auto const o = kvq_test::outlier_rows(3, d, seed + 1);
  for (int r = 0; r < 3; ++r) {
    std::vector<float> v(o.begin() + r * d, o.begin() + (r + 1) * d);
    rows.push_back(v);
    kvq::detail::rotate_forward(v.data(), d, 0x6B7671);
    rows.push_back(v);
  }
  std::vector<float> z(g.begin(), g.begin() + d);  // the last block zero (the whole row when d is a power of 2)
  int const last = d - kvq::detail::rotation_block_start(d, d - 1);
  for (int i = d - last; i < d; ++i) z[static_cast<std::size_t>(i)] = (i % 2) != 0 ? -0.0f : 0.0f;
  rows.push_back(z);
  std::vector<float> few(static_cast<std::size_t>(d), 0.0f);  // mostly zeros, one spike
  few[static_cast<std::size_t>(d / 2)] = 2.5f;
  rows.push_back(few);
  return rows;
}

constexpr int dims[] = {1, 3, 7, 8, 40, 64, 80, 128, 256, 1000};

template <int B>
void check_against_reference() {
  for (int d : dims) {
    for (std::uint32_t seed : {1u, 2u, 3u, 4u}) {
      int row = 0;
      for (auto const& y : test_rows(d, seed)) {
        INFO("B " << B << " head_dim " << d << " seed " << seed << " row " << row++);
        auto const want = ref_encode(B, y);
        auto const got = encode<B>(y);
        REQUIRE(hex(got) == hex(want.bytes));
        for (int i = 0; i < d; ++i) REQUIRE(code_of<B>(got, d, i) == want.codes[static_cast<std::size_t>(i)]);
      }
    }
  }
}

/// The normalised value z_0 = y_0 * sqrtf(n) / nu of a one-block row, as the reference computes it.
auto ref_z0(std::vector<float> const& y) -> float {
  float const nu = root(ref_sum_squares(y));
  return mul(y[0], divide(root(static_cast<float>(y.size())), nu));
}

}  // namespace

TEST_CASE("tq codebook row sizes", "[tq]") {
  // 2 bytes of scale + B * 128 / 8 bytes of codes (FORMATS.md lists 66 / 50 / 34 for b = 4 / 3 / 2).
  CHECK(codebook<2>::geometry(128).bytes() == 34);
  CHECK(codebook<3>::geometry(128).bytes() == 50);
  CHECK(codebook<4>::geometry(128).bytes() == 66);
  CHECK(codebook<2>::geometry(128) == kvq::block_geometry{128, 1, 1, 34});
  // 80 = 64 + 16: two scales; 7 = 4 + 2 + 1: three; 1: one.
  CHECK(codebook<2>::geometry(80).bytes() == 4 + 20);
  CHECK(codebook<3>::geometry(80).bytes() == 4 + 30);
  CHECK(codebook<4>::geometry(80).bytes() == 4 + 40);
  CHECK(codebook<2>::geometry(7).bytes() == 6 + 2);
  CHECK(codebook<3>::geometry(7).bytes() == 6 + 3);
  CHECK(codebook<4>::geometry(7).bytes() == 6 + 4);
  CHECK(codebook<2>::geometry(1).bytes() == 3);
  CHECK(codebook<4>::geometry(1).bytes() == 3);
  CHECK(codebook<3>::geometry(1000).bytes() == 12 + 375);
  CHECK(codebook<4>::geometry(96).blocks == 1);
  CHECK(codebook<4>::geometry(96).block_channels == 96);
  CHECK(codebook<4>::geometry(96).tokens == 1);
  static_assert(codebook<3>::geometry(128).bytes() == 50);
  CHECK(kvq::bits_per_element<codebook<2>>(128) == 2.125);
  CHECK(kvq::bits_per_element<codebook<3>>(128) == 3.125);
  CHECK(kvq::bits_per_element<codebook<4>>(128) == 4.125);
  CHECK(codebook<2>::name == "tq2-codebook");
  CHECK(codebook<3>::name == "tq3-codebook");
  CHECK(codebook<4>::name == "tq4-codebook");
}

TEST_CASE("tq centroids and boundaries", "[tq]") {
  std::vector<double> const listed[] = {{0.4528, 1.5104},
                                        {0.2451, 0.7560, 1.3440, 2.1520},
                                        {0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326}};
  for (int b = 2; b <= 4; ++b) {
    int const levels = 1 << b;
    auto const c = ref_centroids(b);
    for (int code = 0; code < levels; ++code) {
      INFO("b " << b << " code " << code);
      float const v = kvq::detail::tq_centroid(b, code);
      CHECK(bits(v) == bits(c[static_cast<std::size_t>(code)]));
      CHECK(bits(v) == bits(-kvq::detail::tq_centroid(b, levels - 1 - code)));
      if (code >= levels / 2) {
        double const decimal = listed[b - 2][static_cast<std::size_t>(code - levels / 2)];
        CHECK(bits(v) == bits(static_cast<float>(decimal)));
      }
      if (code > 0) CHECK(kvq::detail::tq_centroid(b, code - 1) < v);
    }
    auto const t = ref_boundaries(b);
    for (int j = 0; j + 1 < levels; ++j) {
      INFO("b " << b << " boundary " << j);
      float const tj = kvq::detail::tq_boundary(b, j);
      CHECK(bits(tj) == bits(t[static_cast<std::size_t>(j)]));
      // A value on a boundary takes the lower code; the next float up the higher one.
      CHECK(kvq::detail::tq_code_of(b, tj) == j);
      CHECK(kvq::detail::tq_code_of(b, std::nextafter(tj, 10.0f)) == j + 1);
      CHECK(kvq::detail::tq_code_of(b, std::nextafter(tj, -10.0f)) == j);
    }
    CHECK(bits(kvq::detail::tq_boundary(b, levels / 2 - 1)) == 0u);  // the middle boundary is +0
    CHECK(kvq::detail::tq_code_of(b, 0.0f) == levels / 2 - 1);
    CHECK(kvq::detail::tq_code_of(b, -0.0f) == levels / 2 - 1);
    CHECK(kvq::detail::tq_code_of(b, -1e30f) == 0);
    CHECK(kvq::detail::tq_code_of(b, 1e30f) == levels - 1);
  }
}

TEST_CASE("tq encode matches the independent reimplementation byte for byte", "[tq]") {
  check_against_reference<2>();
  check_against_reference<3>();
  check_against_reference<4>();
}

TEST_CASE("tq: a coordinate exactly on a boundary takes the lower code", "[tq]") {
  auto run = [](auto tag) {
    constexpr int B = decltype(tag)::value;
    auto const t = ref_boundaries(B);
    int found = 0;
    for (std::size_t j = 0; j < t.size(); ++j) {
      if (t[j] == 0.0f) continue;  // z = 0 below
      bool hit = false;
      // A row of 64 whose other coordinates hold k = sqrt(64) / nu below 1; search y_0 so that
      // z_0 = t_j exactly, moving the other coordinates when no float lands on it.
      for (int attempt = 0; attempt < 64 && !hit; ++attempt) {
        std::vector<float> y(64);
        for (std::size_t i = 1; i < y.size(); ++i)
          y[i] = ((i % 2) != 0 ? 1.0f : -1.0f) *
                 (1.25f + 0.0078125f * static_cast<float>(attempt + static_cast<int>(i % 5)));
        y[0] = t[j];
        for (int step = 0; step < 400; ++step) {
          y[0] = divide(t[j], divide(ref_z0(y), y[0]));  // y_0 = t_j / k at the current k
          float const z = ref_z0(y);
          if (z == t[j]) {
            hit = true;
            break;
          }
        }
        for (int walk = 0; walk < 64 && !hit; ++walk) {  // a few floats either way
          float const z = ref_z0(y);
          if (z == t[j]) {
            hit = true;
          } else {
            y[0] = std::nextafter(y[0], z < t[j] ? 1e30f : -1e30f);
          }
        }
        if (!hit) continue;
        INFO("B " << B << " boundary " << j << " y_0 " << y[0]);
        auto const bytes = encode<B>(y);
        CHECK(code_of<B>(bytes, 64, 0) == static_cast<int>(j));
        CHECK(hex(bytes) == hex(ref_encode(B, y).bytes));
        ++found;
      }
    }
    CHECK(found == static_cast<int>(t.size()) - 1);
    // z = +0 and -0 (y_0 = ±0) sit on the middle boundary t = 0: the lower of the middle codes.
    std::vector<float> y(16, 1.0f);
    y[0] = 0.0f;
    y[1] = -0.0f;
    auto const bytes = encode<B>(y);
    CHECK(code_of<B>(bytes, 16, 0) == (1 << (B - 1)) - 1);
    CHECK(code_of<B>(bytes, 16, 1) == (1 << (B - 1)) - 1);
  };
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 3>{});
  run(std::integral_constant<int, 4>{});
}

TEST_CASE("tq: a zero block stores scale +0 and codes 0 and decodes to zeros", "[tq]") {
  auto run = [](auto tag) {
    constexpr int B = decltype(tag)::value;
    // d = 80: block [0,64) Gaussian, block [64,80) zeros of both signs.
    auto y = kvq_test::normal_data(80, 9);
    for (int i = 64; i < 80; ++i) y[static_cast<std::size_t>(i)] = (i % 3) == 0 ? -0.0f : 0.0f;
    auto const bytes = encode<B>(y);
    CHECK(kvq::detail::tq_scale_bits(bytes.data(), 1) == 0u);
    CHECK(kvq::detail::tq_scale_bits(bytes.data(), 0) != 0u);
    for (int i = 64; i < 80; ++i) CHECK(code_of<B>(bytes, 80, i) == 0);
    auto const out = decode<B>(bytes, 80);
    for (int i = 64; i < 80; ++i) CHECK(out[static_cast<std::size_t>(i)] == 0.0f);
    // A row of zeros, and one whose squares all underflow to 0 (nu = 0 as well).
    for (float v : {0.0f, 1e-30f}) {
      std::vector<float> const z(128, v);
      auto const zb = encode<B>(z);
      CHECK(hex(zb) == std::string(2 * zb.size(), '0'));
      for (float o : decode<B>(zb, 128)) CHECK(o == 0.0f);
    }
  };
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 3>{});
  run(std::integral_constant<int, 4>{});
}

TEST_CASE("tq: NaN or Inf anywhere poisons the row", "[tq]") {
  auto run = [](auto tag) {
    constexpr int B = decltype(tag)::value;
    float const specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
    for (int d : {1, 7, 80, 128}) {
      for (float s : specials) {
        for (int at : {0, d - 1, d / 2}) {
          auto y = kvq_test::normal_data(static_cast<std::size_t>(d), 3);
          y[static_cast<std::size_t>(at)] = s;
          INFO("B " << B << " head_dim " << d << " at " << at << " value " << s);
          auto const bytes = encode<B>(y);
          int const blocks = kvq::detail::rotation_block_count(d);
          for (int b = 0; b < blocks; ++b) {
            CHECK(bytes[static_cast<std::size_t>(2 * b)] == 0x00);
            CHECK(bytes[static_cast<std::size_t>(2 * b + 1)] == 0x7e);
          }
          for (std::size_t k = static_cast<std::size_t>(2 * blocks); k < bytes.size(); ++k) CHECK(bytes[k] == 0);
          CHECK(hex(bytes) == hex(ref_encode(B, y).bytes));
          for (float o : decode<B>(bytes, d)) CHECK(std::isnan(o));
        }
      }
    }
  };
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 3>{});
  run(std::integral_constant<int, 4>{});
}

TEST_CASE("tq decode is c[code] * g of the row's bytes", "[tq]") {
  auto run = [](auto tag) {
    constexpr int B = decltype(tag)::value;
    auto const c = ref_centroids(B);
    for (int d : dims) {
      for (auto const& y : test_rows(d, 11)) {
        auto const bytes = encode<B>(y);
        auto const out = decode<B>(bytes, d);
        int const scale_bytes = 2 * static_cast<int>(ref_blocks(d).size());
        int bad = 0;
        int offset = 0;
        int block = 0;
        for (int n : ref_blocks(d)) {
          auto const h = static_cast<std::uint16_t>(bytes[static_cast<std::size_t>(2 * block)] |
                                                    (bytes[static_cast<std::size_t>(2 * block + 1)] << 8));
          float const g = ref_f16_value(h);
          CHECK(bits(kvq::detail::tq_block_scale(bytes.data(), block)) == bits(g));
          CHECK(bits(codebook<B>::scale(bytes.data(), block)) == bits(g));
          for (int i = offset; i < offset + n; ++i) {
            int code = 0;  // bit by bit from the stream
            for (int k = 0; k < B; ++k) {
              int const bit = B * i + k;
              code |= ((bytes[static_cast<std::size_t>(scale_bytes + bit / 8)] >> (bit % 8)) & 1) << k;
            }
            float const want = mul(c[static_cast<std::size_t>(code)], g);
            float const got = out[static_cast<std::size_t>(i)];
            bad += kvq_test::same_value(got, want) ? 0 : 1;
            bad += codebook<B>::code(bytes.data(), d, i) == code ? 0 : 1;
            bad += kvq_test::same_value(kvq::detail::tq_decode_element(B, bytes.data(), d, i), want) ? 0 : 1;
          }
          offset += n;
          ++block;
        }
        INFO("B " << B << " head_dim " << d);
        CHECK(bad == 0);
      }
    }
  };
  run(std::integral_constant<int, 2>{});
  run(std::integral_constant<int, 3>{});
  run(std::integral_constant<int, 4>{});
}

TEST_CASE("tq codes are one LSB-first bit stream", "[tq]") {
  // b = 2, d = 4: nu = sqrt(18.5), k = 2 / nu ~ 0.465, z ~ (-1.395, -0.232, 0.232, 1.395): codes
  // 0, 1, 2, 3 (boundaries -0.98, 0, 0.98) packed as 0b11'10'01'00.
  {
    std::vector<float> const y = {-3.0f, -0.5f, 0.5f, 3.0f};
    auto const bytes = encode<2>(y);
    REQUIRE(bytes.size() == 3);
    CHECK(bytes[2] == 0xe4);
    CHECK(hex(bytes) == hex(ref_encode(2, y).bytes));
  }
  // b = 3, d = 16: k = 4 / sqrt(14.85) ~ 1.038, z ~ ±(2.28, 1.45, 0.78, 0.26): codes 0..7 (boundaries
  // ±1.748, ±1.05, ±0.5006, 0), then eight zeros on the middle boundary: code 3. 3-bit codes straddle
  // bytes: octal 76543210 = 0xfac688 and 33333333 = 0x6db6db, little-endian.
  {
    std::vector<float> y = {-2.2f, -1.4f, -0.75f, -0.25f, 0.25f, 0.75f, 1.4f, 2.2f};
    y.resize(16, 0.0f);
    auto const bytes = encode<3>(y);
    REQUIRE(bytes.size() == 8);
    CHECK(hex(std::vector<std::uint8_t>(bytes.begin() + 2, bytes.end())) == "88c6fadbb66d");
    CHECK(hex(bytes) == hex(ref_encode(3, y).bytes));
  }
  // b = 4, d = 32: k = sqrt(32) / sqrt(36.29) ~ 0.939, z ~ ±(0.12, 0.37, 0.62, 0.89, 1.19, 1.54, 1.99,
  // 2.63), one per interval of the boundaries: codes 0..15, then sixteen zeros: code 7.
  {
    std::vector<float> y = {-2.8f, -2.12f, -1.64f, -1.27f, -0.95f, -0.66f, -0.39f, -0.13f,
                            0.13f, 0.39f,  0.66f,  0.95f,  1.27f,  1.64f,  2.12f,  2.8f};
    y.resize(32, 0.0f);
    auto const bytes = encode<4>(y);
    REQUIRE(bytes.size() == 18);
    CHECK(hex(std::vector<std::uint8_t>(bytes.begin() + 2, bytes.end())) == "1032547698badcfe7777777777777777");
    CHECK(hex(bytes) == hex(ref_encode(4, y).bytes));
  }
}

TEST_CASE("tq round-trip error of Gaussian rows is the Lloyd-Max distortion", "[tq]") {
  // MSE per coordinate of the Lloyd-Max quantizer of a unit Gaussian (Max 1960). The norm correction
  // scales by 1/sqrt(1 - D), so the expected relative error is about D (1 + D/4).
  auto run = [](auto tag, double distortion) {
    constexpr int B = decltype(tag)::value;
    int const d = 128;
    int const rows = 2000;
    kvq_test::rng r(2024 + B);
    double sum = 0.0;
    std::vector<float> y(d);
    for (int row = 0; row < rows; ++row) {
      for (auto& v : y) v = static_cast<float>(r.normal() * 0.37);
      auto const out = decode<B>(encode<B>(y), d);
      double err = 0.0;
      double norm = 0.0;
      for (std::size_t i = 0; i < y.size(); ++i) {
        double const e = static_cast<double>(out[i]) - static_cast<double>(y[i]);
        err += e * e;
        norm += static_cast<double>(y[i]) * static_cast<double>(y[i]);
      }
      sum += err / norm;
    }
    double const mean = sum / rows;
    INFO("B " << B << " mean relative squared error " << mean << " Lloyd-Max " << distortion);
    CHECK(mean < 1.3 * distortion);
    CHECK(mean > 0.7 * distortion);
  };
  run(std::integral_constant<int, 2>{}, 0.1175);
  run(std::integral_constant<int, 3>{}, 0.03454);
  run(std::integral_constant<int, 4>{}, 0.009497);
}
