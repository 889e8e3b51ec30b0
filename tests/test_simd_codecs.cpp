// Tests of the CPU kernels (kvq::cpu_kernels): every instruction set compiled into this build — scalar
// always, avx2 and avx512 on x86 when the flags have them, neon on AArch64, and the dispatching
// kvq::cpu_kernels entry points — against the codecs' scalar reference: identical encoded bytes, identical
// decoded bits, for every codec, on rows built to hit ties, subnormals, ±0, NaN/±Inf, values
// beyond the fp16/fp8 range, constant rows, tiny scales and padding; element conversions over all
// f16/bf16 patterns and a large structured sample of f32 patterns.
#include <kvq/backend/cpu/kernels.hpp>
#include <kvq/kvq.hpp>  // with the backend tags, the cache and attention: no name clashes
#include <kvq/simd.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "catch_compat.hpp"
#include "test_support.hpp"

namespace {

using u8 = std::uint8_t;
using u16 = std::uint16_t;
using u32 = std::uint32_t;

// -------------------------------------------------------------------------------------------------
// The instruction sets under test, each as a tag type forwarding to its namespace.

#define KVQ_TEST_ISA(TAG, NS, NAME)                                                                                    \
  struct TAG {                                                                                                         \
    static constexpr std::string_view name = NAME;                                                                     \
    template <class C>                                                                                                 \
    static void encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* d, std::size_t ds,       \
                            typename C::params_type const& p) {                                                        \
      NS::encode_rows<C>(x, xs, rows, hd, d, ds, p);                                                                   \
    }                                                                                                                  \
    template <class C>                                                                                                 \
    static void decode_rows(u8 const* s, std::size_t ss, std::int64_t rows, int hd, float* y, std::ptrdiff_t ys,       \
                            typename C::params_type const& p) {                                                        \
      NS::decode_rows<C>(s, ss, rows, hd, y, ys, p);                                                                   \
    }                                                                                                                  \
    template <class C>                                                                                                 \
    static void encode_tile(float const* x, std::ptrdiff_t ts, int hd, u8* d) {                                        \
      NS::encode_tile<C>(x, ts, hd, d);                                                                                \
    }                                                                                                                  \
    template <class C>                                                                                                 \
    static void decode_tile_tokens(u8 const* t, int hd, int first, int count, float* y, std::ptrdiff_t ys) {           \
      NS::decode_tile_tokens<C>(t, hd, first, count, y, ys);                                                           \
    }                                                                                                                  \
    template <class T>                                                                                                 \
    static void to_f32(T const* s, float* d, std::int64_t n) {                                                         \
      NS::convert_to_f32(s, d, n);                                                                                     \
    }                                                                                                                  \
    template <class T>                                                                                                 \
    static void from_f32(float const* s, T* d, std::int64_t n) {                                                       \
      NS::convert_from_f32(s, d, n);                                                                                   \
    }                                                                                                                  \
    static void to_f16_satfinite(float const* s, kvq::f16* d, std::int64_t n) {                                        \
      NS::convert_to_f16_satfinite(s, d, n);                                                                           \
    }                                                                                                                  \
    static void round_f16_satfinite(float const* s, float* d, std::int64_t n) { NS::round_to_f16_satfinite(s, d, n); } \
    static void rotate_forward(float* x, std::int64_t rows, std::ptrdiff_t stride, int hd,                             \
                               std::uint64_t const* words) {                                                           \
      NS::rotate_forward_rows(x, rows, stride, hd, words);                                                             \
    }                                                                                                                  \
    static void rotate_forward(float const* x, std::ptrdiff_t xs, float* y, std::ptrdiff_t ys, std::int64_t rows,      \
                               int hd, std::uint64_t const* words) {                                                   \
      NS::rotate_forward_rows(x, xs, y, ys, rows, hd, words);                                                          \
    }                                                                                                                  \
    static void rotate_inverse(float* x, std::int64_t rows, std::ptrdiff_t stride, int hd,                             \
                               std::uint64_t const* words) {                                                           \
      NS::rotate_inverse_rows(x, rows, stride, hd, words);                                                             \
    }                                                                                                                  \
  };

KVQ_TEST_ISA(isa_scalar, kvq::cpu_kernels::scalar, "scalar")
KVQ_TEST_ISA(isa_dispatch, kvq::cpu_kernels, "kvq::cpu_kernels (dispatch)")
#if defined(KVQ_CPU_HAS_AVX2)
KVQ_TEST_ISA(isa_avx2, kvq::cpu_kernels::avx2, "avx2")
#endif
#if defined(KVQ_CPU_HAS_AVX512)
KVQ_TEST_ISA(isa_avx512, kvq::cpu_kernels::avx512, "avx512")
#endif
#if defined(KVQ_CPU_HAS_NEON)
KVQ_TEST_ISA(isa_neon, kvq::cpu_kernels::neon, "neon")
#endif

/// Calls f.template operator()<Isa>() for every instruction set compiled in.
template <class F>
void for_each_isa(F&& f) {
  f.template operator()<isa_scalar>();
#if defined(KVQ_CPU_HAS_AVX2)
  f.template operator()<isa_avx2>();
#endif
#if defined(KVQ_CPU_HAS_AVX512)
  f.template operator()<isa_avx512>();
#endif
#if defined(KVQ_CPU_HAS_NEON)
  f.template operator()<isa_neon>();
#endif
  f.template operator()<isa_dispatch>();
}

// -------------------------------------------------------------------------------------------------
// Inputs

// 512 and 1024: rows of several batches of whole blocks each (the encoders' uniform batches).
constexpr int head_dims[] = {1, 8, 32, 64, 80, 96, 100, 128, 256, 512, 1024};

auto from_bits(u32 u) -> float { return std::bit_cast<float>(u); }

/// A value halfway between two neighbouring f16 values (65520 included: the overflow tie).
auto f16_tie(std::mt19937& rng) -> float {
  u32 const h = std::uniform_int_distribution<u32>(0, 0x7bff)(rng);
  float const a = kvq::detail::f16_bits_to_f32(static_cast<u16>(h));
  float const b = h == 0x7bff ? 65536.0f : kvq::detail::f16_bits_to_f32(static_cast<u16>(h + 1));
  return (rng() & 1u ? -0.5f : 0.5f) * (a + b);
}

/// A value halfway between two neighbouring fp8 values (E4M3FN or E5M2; the overflow ties included).
auto fp8_tie(std::mt19937& rng) -> float {
  bool const e4m3 = rng() & 1u;
  u32 const c = std::uniform_int_distribution<u32>(0, e4m3 ? 0x7e : 0x7b)(rng);
  auto const value = [&](u32 code) {
    if (e4m3) return code == 0x7f ? 480.0f : kvq::detail::e4m3_to_f32(static_cast<u8>(code));
    return code == 0x7c ? 65536.0f : kvq::detail::e5m2_to_f32(static_cast<u8>(code));
  };
  return (rng() & 1u ? -0.5f : 0.5f) * (value(c) + value(c + 1));
}

/// A float x with fl(x * id) == target while the exact product differs (an FMA would round it
/// elsewhere), or target / id when no neighbour qualifies.
auto inexact_tie(float target, float id) -> float {
  float x = target / id;
  for (int k = 0; k < 4; ++k, x = std::nextafter(x, k % 2 ? -1e30f : 1e30f)) {
    for (float c : {std::nextafter(x, -1e30f), x, std::nextafter(x, 1e30f)})
      if (c * id == target && static_cast<double>(c) * static_cast<double>(id) != static_cast<double>(target)) return c;
  }
  return target / id;
}

constexpr int row_kinds = 21;

/// An fp16 scale that is not a power of two (its reciprocal rounds), for KIVI ties.
auto kivi_odd_scale(std::mt19937& rng) -> float {
  float const scales[] = {0.1f, 0.3f, 0.7f, 1.3f, 2.9f, 0.0123f, 37.3f, 0.37f};
  return kvq::detail::f16_bits_to_f32(kvq::detail::f32_to_f16_bits(scales[rng() % 8]));
}

/// Fills x[0 .. n) with a row of the given kind (kinds 0 .. row_kinds - 1).
void make_row(int kind, float* x, int n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pos(0, n - 1);
  auto const sgn = [&] { return rng() & 1u ? -1.0f : 1.0f; };
  float const inf = std::numeric_limits<float>::infinity();
  switch (kind) {
    case 0:  // N(0, 1)
      for (int i = 0; i < n; ++i) x[i] = normal(rng);
      break;
    case 1:  // outlier channels x5 .. x20
      for (int i = 0; i < n; ++i) x[i] = normal(rng) * (i % 7 == 3 ? 5.0f + static_cast<float>(i % 16) : 1.0f);
      break;
    case 2:  // q8_0 / int8 ties: amax 127 (d = 1) or 63.5 (d = 0.5) in every block, others k + 1/2
    {
      float const unit = rng() & 1u ? 1.0f : 0.5f;
      for (int i = 0; i < n; ++i)
        x[i] = i % 32 == 5 % (n < 32 ? n : 32)
                   ? sgn() * 127.0f * unit
                   : (static_cast<float>(std::uniform_int_distribution<int>(-127, 126)(rng)) + 0.5f) * unit;
      break;
    }
    case 3:  // q4_0 ties: ±8 first (d = ±1), the opposite sign later, multiples of 1/4 elsewhere
    {
      float const s = sgn();
      for (int i = 0; i < n; ++i) x[i] = static_cast<float>(std::uniform_int_distribution<int>(-31, 31)(rng)) * 0.25f;
      for (int b = 0; b < n; b += 32) {
        if (b + 2 < n) x[b + 2] = -8.0f * s;
        if (b + 7 < n) x[b + 7] = 8.0f * s;
        if (b + 20 < n) x[b + 20] = 8.0f * s;
      }
      break;
    }
    case 4:   // KIVI ties: min 0 and max 2^b - 1 per group of 8 (scale 1), others k + 1/2
    case 20:  // the same times a scale s whose reciprocal rounds, so (v - m) / s is a midpoint that
              // v * fl(1 / s) may miss
    {
      int const tops[] = {3, 15, 255};
      int const top = tops[rng() % 3];
      float const unit = kind == 20 ? kivi_odd_scale(rng) : 1.0f;
      for (int i = 0; i < n; ++i)
        x[i] = unit * (i % 8 == 0   ? 0.0f
                       : i % 8 == 1 ? static_cast<float>(top)
                                    : static_cast<float>(std::uniform_int_distribution<int>(0, top - 1)(rng)) + 0.5f);
      break;
    }
    case 5:  // fp8 ties
      for (int i = 0; i < n; ++i) x[i] = fp8_tie(rng);
      break;
    case 6:  // f16 ties
      for (int i = 0; i < n; ++i) x[i] = f16_tie(rng);
      break;
    case 7:  // NaN / ±Inf injected into N(0, 1)
    {
      for (int i = 0; i < n; ++i) x[i] = normal(rng);
      float const specials[] = {std::numeric_limits<float>::quiet_NaN(),
                                inf,
                                -inf,
                                from_bits(0x7f800001u),
                                from_bits(0xffc12345u),
                                from_bits(0x7fbfffffu)};
      int const k = 1 + static_cast<int>(rng() % 3);
      for (int j = 0; j < k; ++j) x[pos(rng)] = specials[rng() % 6];
      break;
    }
    case 8:  // f32 subnormals (and a few zeros)
      for (int i = 0; i < n; ++i) x[i] = from_bits((rng() & 0x807fffffu) | (rng() % 8 == 0 ? 0u : 1u));
      break;
    case 9:  // ±0 only: every 32 values all -0, all +0 or mixed (q4_0's max is +0 in each case)
      for (int b = 0; b < n; b += 32) {
        unsigned const mode = rng() % 3;
        for (int i = b; i < std::min(n, b + 32); ++i) x[i] = (mode == 2 ? sgn() : mode == 1 ? 1.0f : -1.0f) * 0.0f;
      }
      break;
    case 10:  // beyond the fp16 / fp8 ranges
    {
      float const big[] = {1e5f,          65504.0f, 65520.0f, 65519.99f, 7e4f,    1e30f,
                           3.4028235e38f, 448.0f,   464.0f,   57344.0f,  61440.0f};
      for (int i = 0; i < n; ++i) x[i] = rng() % 3 == 0 ? normal(rng) : sgn() * big[rng() % 11];
      break;
    }
    case 11:  // constant rows
    {
      float const values[] = {0.1f, -3.0f, 1.0f, 65504.0f, normal(rng)};
      float const c = values[rng() % 5];
      for (int i = 0; i < n; ++i) x[i] = c;
      break;
    }
    case 12:  // tiny amax: 1/d overflows, d underflows in fp16
    {
      float const scales[] = {1e-36f, 1e-38f, 1e-40f, 1e-42f, 3e-45f, 1e-30f};
      float const scale = scales[rng() % 6];
      for (int i = 0; i < n; ++i) x[i] = normal(rng) * scale;
      break;
    }
    case 13:  // random f32 bit patterns (NaN, Inf and subnormals included)
      for (int i = 0; i < n; ++i) x[i] = from_bits(static_cast<u32>(rng()));
      break;
    case 14:  // magnitudes 2^-30 .. 2^30
      for (int i = 0; i < n; ++i) x[i] = std::ldexp(normal(rng), std::uniform_int_distribution<int>(-30, 30)(rng));
      break;
    case 16:  // q8_0 near-ties: fl(x * id) = k + 1/2 exactly while x * id is not (catches FMA contraction)
    case 17:  // q4_0 near-ties: fl(x * id) + 8.5 is an integer while x * id + 8.5 is not
    {
      for (int b = 0; b < n; b += 32) {
        int const m = n - b < 32 ? n - b : 32;
        float const lead = sgn() * std::uniform_real_distribution<float>(0.3f, 9.0f)(rng);
        float const d = kind == 16 ? kvq::detail::q8_0_scale(std::fabs(lead)) : kvq::detail::q4_0_scale(lead);
        float const id = kvq::detail::ggml_inverse_scale(d);
        x[b] = lead;
        for (int i = 1; i < m; ++i) {
          int const k = kind == 16 ? std::uniform_int_distribution<int>(-126, 125)(rng)
                                   : std::uniform_int_distribution<int>(-8, 6)(rng);
          float const v = inexact_tie(static_cast<float>(k) + 0.5f, id);
          x[b + i] = std::fabs(v) < std::fabs(lead) ? v : 0.0f;
        }
      }
      break;
    }
    case 18:  // fp4 ties: ±6·2^k leads every 16 values (half-scale 2^(k-1)), multiples of 2^(k-2) elsewhere
    {
      float const unit = std::ldexp(1.0f, std::uniform_int_distribution<int>(-3, 3)(rng));
      for (int i = 0; i < n; ++i)
        x[i] = (i % 16 == 0 ? sgn() * 24.0f : static_cast<float>(std::uniform_int_distribution<int>(-24, 24)(rng))) *
               0.25f * unit;
      break;
    }
    case 19:  // fp4 midpoints: ±6·2^k leads every 16 values, the others 0 .. 4 ulps from (K[c] + K[c + 1]) / 2 · h
    {
      float const unit = std::ldexp(1.0f, std::uniform_int_distribution<int>(-130, 100)(rng));
      float const mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 5.5f, 6.0f};  // h = unit / 2
      for (int i = 0; i < n; ++i) {
        float v = i % 16 == 0 ? 6.0f : mids[rng() % 9];
        v *= unit;
        for (int k = static_cast<int>(rng() % 5) - 2; k != 0; k += k > 0 ? -1 : 1)
          v = std::nextafter(v, k > 0 ? std::numeric_limits<float>::infinity() : 0.0f);
        x[i] = sgn() * v;
      }
      break;
    }
    default:  // finite random bits with small exponents, then one large element
      for (int i = 0; i < n; ++i) x[i] = from_bits((static_cast<u32>(rng()) & 0x8fffffffu));
      x[pos(rng)] = sgn() * 2.5f;
      break;
  }
}

/// Rows of every kind: (rows, stride), the gaps between rows filled with NaN (never read).
auto make_rows(int rows, int hd, std::ptrdiff_t stride, std::uint32_t seed) -> std::vector<float> {
  std::mt19937 rng(seed);
  std::vector<float> x(static_cast<std::size_t>(rows) * static_cast<std::size_t>(stride),
                       std::numeric_limits<float>::quiet_NaN());
  for (int r = 0; r < rows; ++r) make_row(r % row_kinds, x.data() + r * stride, hd, rng);
  return x;
}

auto random_bytes(std::size_t n, std::uint32_t seed) -> std::vector<u8> {
  std::mt19937 rng(seed);
  std::vector<u8> b(n);
  for (auto& v : b) v = static_cast<u8>(rng());
  return b;
}

/// Index of the first differing byte, or -1.
auto first_diff(void const* a, void const* b, std::size_t n) -> std::ptrdiff_t {
  auto const* p = static_cast<u8 const*>(a);
  auto const* q = static_cast<u8 const*>(b);
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != q[i]) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

/// Index of the first float that differs (bits, or NaN-ness when nan_any), or -1.
auto first_float_diff(std::vector<float> const& a, std::vector<float> const& b, bool nan_any) -> std::ptrdiff_t {
  for (std::size_t i = 0; i < a.size(); ++i) {
    bool const same = nan_any ? kvq_test::same_value(a[i], b[i]) : kvq_test::bits(a[i]) == kvq_test::bits(b[i]);
    if (!same) return static_cast<std::ptrdiff_t>(i);
  }
  return -1;
}

auto hex32(float f) -> std::string {
  std::ostringstream s;
  s << std::hex << kvq_test::bits(f);
  return s.str();
}

// -------------------------------------------------------------------------------------------------
// Row codecs

template <class C>
auto codec_label() -> std::string {
  std::string s(C::name);
  if constexpr (requires {
                  C::bits;
                  C::group;
                })
    s += "<" + std::to_string(C::bits) + "," + std::to_string(C::group) + ">";
  return s;
}

/// Encodes and decodes rows of every kind with Isa and compares with C::encode_row / decode_row.
template <class Isa, class C>
void check_row_codec(typename C::params_type const& p, std::string const& what, std::span<int const> dims = head_dims) {
  std::uint32_t seed = 1234;
  for (int hd : dims) {
    for (int packed = 0; packed < 2; ++packed) {
      int const rows = 2 * row_kinds + 3;
      std::ptrdiff_t const xs = packed ? hd : hd + 5;
      std::size_t const bytes = C::geometry(hd).bytes();
      std::size_t const ds = packed ? bytes : bytes + 3;
      std::ptrdiff_t const ys = packed ? hd : hd + 2;
      INFO(Isa::name << " " << what << " head_dim " << hd << (packed ? " packed rows" : " strided rows"));
      auto const x = make_rows(rows, hd, xs, seed++);
      std::size_t const nbytes = static_cast<std::size_t>(rows) * ds + 16;

      // Encode: the same bytes everywhere, gaps and the guard included (0xab = never written).
      std::vector<u8> want(nbytes, 0xab), got(nbytes, 0xab);
      for (int r = 0; r < rows; ++r) C::encode_row(x.data() + r * xs, hd, want.data() + r * ds, p);
      Isa::template encode_rows<C>(x.data(), xs, rows, hd, got.data(), ds, p);
      auto const d = first_diff(want.data(), got.data(), nbytes);
      if (d >= 0) {
        auto const r = static_cast<int>(static_cast<std::size_t>(d) / ds);
        UNSCOPED_INFO("first difference: row " << r << " (kind " << r % row_kinds << ") byte "
                                               << static_cast<std::size_t>(d) % ds << ": reference "
                                               << int{want[static_cast<std::size_t>(d)]} << ", got "
                                               << int{got[static_cast<std::size_t>(d)]});
      }
      CHECK(d == -1);

      // Decode the reference bytes: identical bits (NaN payloads included), nothing else written.
      std::size_t const ny = static_cast<std::size_t>(rows) * static_cast<std::size_t>(ys) + 8;
      std::vector<float> yw(ny, -7.25f), yg(ny, -7.25f);
      for (int r = 0; r < rows; ++r) C::decode_row(want.data() + r * ds, hd, yw.data() + r * ys, p);
      Isa::template decode_rows<C>(want.data(), ds, rows, hd, yg.data(), ys, p);
      auto const e = first_float_diff(yw, yg, false);
      if (e >= 0)
        UNSCOPED_INFO("decode: first difference at row " << e / ys << " channel " << e % ys << ": reference "
                                                         << hex32(yw[static_cast<std::size_t>(e)]) << ", got "
                                                         << hex32(yg[static_cast<std::size_t>(e)]));
      CHECK(e == -1);

      // Decode arbitrary bytes. KIVI computes q * s + m with two stored fp16 operands that may both
      // be NaN, where the payload that survives depends on operand order: compare NaN-ness there.
      auto const junk = random_bytes(nbytes, seed++);
      std::vector<float> jw(ny, -7.25f), jg(ny, -7.25f);
      for (int r = 0; r < rows; ++r) C::decode_row(junk.data() + r * ds, hd, jw.data() + r * ys, p);
      Isa::template decode_rows<C>(junk.data(), ds, rows, hd, jg.data(), ys, p);
      bool const nan_any = requires { C::bits; };
      auto const f = first_float_diff(jw, jg, nan_any);
      if (f >= 0)
        UNSCOPED_INFO("decode of random bytes: first difference at row "
                      << f / ys << " channel " << f % ys << ": reference " << hex32(jw[static_cast<std::size_t>(f)])
                      << ", got " << hex32(jg[static_cast<std::size_t>(f)]));
      CHECK(f == -1);
    }
  }
}

template <class C>
void check_row_codec_all_isas(typename C::params_type const& p = {}, std::string const& extra = {},
                              std::span<int const> dims = head_dims) {
  for_each_isa([&]<class Isa>() { check_row_codec<Isa, C>(p, codec_label<C>() + extra, dims); });
}

// -------------------------------------------------------------------------------------------------
// KIVI key tiles

constexpr int tile_kinds = 7;

/// One tile x: (G, hd), rows ts apart.
void make_tile(int kind, int bits, int G, int hd, std::ptrdiff_t ts, float* x, std::mt19937& rng) {
  switch (kind) {
    case 0:  // each token a row of some kind
      for (int t = 0; t < G; ++t) make_row(static_cast<int>(rng() % row_kinds), x + t * ts, hd, rng);
      break;
    case 1:  // constant channels
      make_row(static_cast<int>(rng() % row_kinds), x, hd, rng);
      for (int t = 1; t < G; ++t) std::memcpy(x + t * ts, x, static_cast<std::size_t>(hd) * sizeof(float));
      break;
    case 2:  // ties per channel: token 0 holds 0, token 1 holds 2^b - 1 (scale 1), others k + 1/2
    case 6:  // the same times a scale whose reciprocal rounds
    {
      int const top = (1 << bits) - 1;
      float const unit = kind == 6 ? kivi_odd_scale(rng) : 1.0f;
      for (int t = 0; t < G; ++t)
        for (int c = 0; c < hd; ++c)
          x[t * ts + c] =
              unit * (t == 0   ? 0.0f
                      : t == 1 ? static_cast<float>(top)
                               : static_cast<float>(std::uniform_int_distribution<int>(0, top - 1)(rng)) + 0.5f);
      break;
    }
    case 3:  // N(0, 1) tokens with a few NaN / Inf (poisoning their channels only)
      for (int t = 0; t < G; ++t) make_row(0, x + t * ts, hd, rng);
      for (int k = 0; k < 3; ++k)
        x[static_cast<int>(rng() % static_cast<unsigned>(G)) * ts +
          static_cast<int>(rng() % static_cast<unsigned>(hd))] =
            k == 0 ? std::numeric_limits<float>::quiet_NaN()
                   : (k == 1 ? 1.0f : -1.0f) * std::numeric_limits<float>::infinity();
      break;
    case 4:  // ±0, subnormals and tiny values
      for (int t = 0; t < G; ++t) make_row(t % 2 ? 9 : (t % 3 ? 8 : 12), x + t * ts, hd, rng);
      break;
    default:  // wide ranges: huge and random-bit tokens
      for (int t = 0; t < G; ++t) make_row(t % 2 ? 10 : 14, x + t * ts, hd, rng);
      break;
  }
}

template <class Isa, class C>
void check_key_codec() {
  constexpr int G = C::group;
  std::uint32_t seed = 99;
  for (int hd : head_dims) {
    INFO(Isa::name << " " << codec_label<C>() << " head_dim " << hd);
    std::ptrdiff_t const ts = hd + 7;
    std::size_t const bytes = C::geometry(hd).bytes();
    for (int kind = 0; kind < tile_kinds; ++kind) {
      INFO("tile kind " << kind);
      std::mt19937 rng(seed++);
      std::vector<float> x(static_cast<std::size_t>(G) * static_cast<std::size_t>(ts),
                           std::numeric_limits<float>::quiet_NaN());
      make_tile(kind, C::bits, G, hd, ts, x.data(), rng);
      std::vector<u8> want(bytes + 16, 0xab), got(bytes + 16, 0xab);
      C::encode_tile(x.data(), ts, hd, want.data());
      Isa::template encode_tile<C>(x.data(), ts, hd, got.data());
      auto const d = first_diff(want.data(), got.data(), want.size());
      if (d >= 0)
        UNSCOPED_INFO("first difference at tile byte " << d << ": reference " << int{want[static_cast<std::size_t>(d)]}
                                                       << ", got " << int{got[static_cast<std::size_t>(d)]});
      CHECK(d == -1);

      auto const junk = random_bytes(bytes, seed++);
      int const ranges[][2] = {{0, G}, {0, 1}, {G - 1, 1}, {3, G - 5}, {G / 2, G / 2}, {5, 3}};
      for (auto const& rg : ranges) {
        int const first = rg[0], count = rg[1];
        INFO("tokens " << first << " + " << count);
        std::ptrdiff_t const ys = hd + 3;
        for (int src = 0; src < 2; ++src) {
          u8 const* tile = src == 0 ? want.data() : junk.data();
          std::vector<float> yw(static_cast<std::size_t>(count) * static_cast<std::size_t>(ys) + 4, -7.25f);
          std::vector<float> yg = yw;
          for (int t = 0; t < count; ++t) C::decode_token(tile, hd, first + t, yw.data() + t * ys);
          Isa::template decode_tile_tokens<C>(tile, hd, first, count, yg.data(), ys);
          auto const e = first_float_diff(yw, yg, src == 1);
          if (e >= 0)
            UNSCOPED_INFO((src ? "random tile" : "encoded tile")
                          << ": first difference at token " << first + e / ys << " channel " << e % ys << ": reference "
                          << hex32(yw[static_cast<std::size_t>(e)]) << ", got "
                          << hex32(yg[static_cast<std::size_t>(e)]));
          CHECK(e == -1);
        }
      }
    }
  }
}

template <class C>
void check_key_codec_all_isas() {
  for_each_isa([&]<class Isa>() { check_key_codec<Isa, C>(); });
}

// -------------------------------------------------------------------------------------------------
// Element conversions

template <class Isa>
void check_widen_all_patterns() {
  INFO(Isa::name);
  std::vector<kvq::f16> h(65536);
  std::vector<kvq::bf16> b(65536);
  for (u32 i = 0; i < 65536; ++i) {
    h[i].bits = static_cast<u16>(i);
    b[i].bits = static_cast<u16>(i);
  }
  for (int offset : {0, 1, 7}) {  // odd starts and lengths exercise the tails
    std::size_t const n = 65536 - static_cast<std::size_t>(offset) * 3;
    std::vector<float> got(n + 1, -7.25f), want(n + 1, -7.25f);
    Isa::to_f32(h.data() + offset, got.data(), static_cast<std::int64_t>(n));
    for (std::size_t i = 0; i < n; ++i) want[i] = kvq::to_f32(h[i + static_cast<std::size_t>(offset)]);
    auto const e = first_float_diff(want, got, false);
    if (e >= 0)
      UNSCOPED_INFO("f16 " << std::hex << h[static_cast<std::size_t>(e + offset)].bits << ": reference "
                           << hex32(want[static_cast<std::size_t>(e)]) << ", got "
                           << hex32(got[static_cast<std::size_t>(e)]));
    CHECK(e == -1);
    Isa::to_f32(b.data() + offset, got.data(), static_cast<std::int64_t>(n));
    for (std::size_t i = 0; i < n; ++i) want[i] = kvq::to_f32(b[i + static_cast<std::size_t>(offset)]);
    CHECK(first_float_diff(want, got, false) == -1);
  }
}

/// f32 patterns: every sign/exponent/top-mantissa combination (the high 16 bits) with low bits at
/// and around each rounding boundary, then random bits.
auto f32_patterns(std::uint32_t seed) -> std::vector<float> {
  u32 const lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xffff};
  std::vector<float> v;
  v.reserve(65536 * 13 + (1u << 20));
  std::mt19937 rng(seed);
  for (u32 hi = 0; hi < 65536; ++hi) {
    for (u32 lo : lows) v.push_back(from_bits(hi << 16 | lo));
    v.push_back(from_bits(hi << 16 | (static_cast<u32>(rng()) & 0xffffu)));
  }
  for (int i = 0; i < (1 << 20); ++i) v.push_back(from_bits(static_cast<u32>(rng())));
  return v;
}

template <class Isa>
void check_narrow(std::vector<float> const& x) {
  INFO(Isa::name);
  for (int offset : {0, 3}) {
    std::size_t const n = x.size() - static_cast<std::size_t>(offset) * 5;
    std::vector<kvq::f16> h(n + 1, kvq::f16{0x1234});
    Isa::from_f32(x.data() + offset, h.data(), static_cast<std::int64_t>(n));
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (h[i].bits != kvq::to_f16(x[i + static_cast<std::size_t>(offset)]).bits && bad++ == 0) first = i;
    if (bad)
      UNSCOPED_INFO("f32 -> f16: " << bad << " differ, first " << hex32(x[first + static_cast<std::size_t>(offset)])
                                   << ": reference " << std::hex
                                   << kvq::to_f16(x[first + static_cast<std::size_t>(offset)]).bits << ", got "
                                   << h[first].bits);
    CHECK(bad == 0);
    CHECK(h[n].bits == 0x1234);
    std::vector<kvq::bf16> b(n + 1, kvq::bf16{0x1234});
    Isa::from_f32(x.data() + offset, b.data(), static_cast<std::int64_t>(n));
    bad = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (b[i].bits != kvq::to_bf16(x[i + static_cast<std::size_t>(offset)]).bits && bad++ == 0) first = i;
    if (bad)
      UNSCOPED_INFO("f32 -> bf16: " << bad << " differ, first " << hex32(x[first + static_cast<std::size_t>(offset)]));
    CHECK(bad == 0);
    CHECK(b[n].bits == 0x1234);
    std::vector<float> f(n + 1, -7.25f);
    Isa::from_f32(x.data() + offset, f.data(), static_cast<std::int64_t>(n));
    CHECK(first_diff(f.data(), x.data() + offset, n * sizeof(float)) == -1);
    CHECK(f[n] == -7.25f);
  }
}

/// The residual's narrowing (f32_to_f16_bits_satfinite), to bits and rounded back to f32, in place
/// too, against numeric.h over `x` and the neighbourhood of the saturation boundaries.
template <class Isa>
void check_narrow_satfinite(std::vector<float> x) {
  INFO(Isa::name);
  for (float edge : {65504.0f, 65520.0f, 65536.0f, std::numeric_limits<float>::max()})
    for (float v = edge, k = 0; k < 8; ++k, v = std::nextafter(v, 0.0f))
      for (float w : {v, std::nextafter(edge, std::numeric_limits<float>::infinity()), -v}) x.push_back(w);
  x.push_back(from_bits(0x7f800001u));  // signalling NaNs: quieted as to_f16 quiets them
  x.push_back(from_bits(0xff800100u));
  for (int offset : {0, 3}) {
    std::size_t const n = x.size() - static_cast<std::size_t>(offset) * 5;
    float const* in = x.data() + offset;
    std::vector<kvq::f16> h(n + 1, kvq::f16{0x1234});
    Isa::to_f16_satfinite(in, h.data(), static_cast<std::int64_t>(n));
    std::vector<float> want(n + 1, -7.25f), got(n + 1, -7.25f);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < n; ++i) {
      u16 const ref = kvq::detail::f32_to_f16_bits_satfinite(in[i]);
      want[i] = kvq::detail::f16_bits_to_f32(ref);
      if (h[i].bits != ref && bad++ == 0) first = i;
    }
    if (bad)
      UNSCOPED_INFO("f32 -> f16 satfinite: " << bad << " differ, first " << hex32(in[first]) << ": reference "
                                             << std::hex << kvq::detail::f32_to_f16_bits_satfinite(in[first])
                                             << ", got " << h[first].bits);
    CHECK(bad == 0);
    CHECK(h[n].bits == 0x1234);
    Isa::round_f16_satfinite(in, got.data(), static_cast<std::int64_t>(n));
    auto e = first_float_diff(want, got, false);
    if (e >= 0)
      UNSCOPED_INFO("rounded " << hex32(in[static_cast<std::size_t>(e)]) << ": reference "
                               << hex32(want[static_cast<std::size_t>(e)]) << ", got "
                               << hex32(got[static_cast<std::size_t>(e)]));
    CHECK(e == -1);
    std::vector<float> same(in, in + n);  // in place
    same.push_back(-7.25f);
    Isa::round_f16_satfinite(same.data(), same.data(), static_cast<std::int64_t>(n));
    CHECK(first_float_diff(want, same, false) == -1);
  }
}

}  // namespace

TEST_CASE("simd_level names the instruction set compiled in", "[simd]") {
  constexpr std::string_view level = kvq::simd_level();
  STATIC_REQUIRE(level == kvq::cpu_kernels::simd_level());
#if defined(KVQ_CPU_HAS_AVX512)
  CHECK(level.substr(0, 6) == "avx512");
#elif defined(KVQ_CPU_HAS_AVX2)
  CHECK(level == "avx2");
#elif defined(KVQ_CPU_HAS_NEON)
  CHECK(level == "neon");
#else
  CHECK(level == "scalar");
#endif
  std::string names;
  for_each_isa([&]<class Isa>() { names += std::string(Isa::name) + " "; });
  WARN("kvq::simd_level() = " << level << "; instruction sets under test: " << names);
}

TEST_CASE("f32 and f16 pass-through rows are bit-exact on every ISA", "[simd][f16]") {
  check_row_codec_all_isas<kvq::f32_codec>();
  check_row_codec_all_isas<kvq::f16_codec>();
}

TEST_CASE("q8_0 and q4_0 rows are bit-exact on every ISA", "[simd][q8_0][q4_0]") {
  check_row_codec_all_isas<kvq::q8_0>();
  check_row_codec_all_isas<kvq::q4_0>();
}

TEST_CASE("int8 rows are bit-exact on every ISA", "[simd][int8]") { check_row_codec_all_isas<kvq::int8_sym>(); }

TEST_CASE("fp8 rows are bit-exact on every ISA, both formats, modes and several scales", "[simd][fp8]") {
  for (float scale : {1.0f, 0.5f, 3.7f, 1e-3f, 1e4f, 1e-40f}) {
    for (auto mode : {kvq::fp8_overflow::saturate, kvq::fp8_overflow::no_saturate}) {
      kvq::fp8_params const p{scale, mode};
      std::string const what =
          " scale " + std::to_string(scale) + (mode == kvq::fp8_overflow::saturate ? " saturate" : " no_saturate");
      check_row_codec_all_isas<kvq::fp8_e4m3>(p, what);
      check_row_codec_all_isas<kvq::fp8_e5m2>(p, what);
    }
  }
}

TEST_CASE("KIVI value rows are bit-exact on every ISA", "[simd][kivi]") {
  check_row_codec_all_isas<kvq::kivi_value<2>>();
  check_row_codec_all_isas<kvq::kivi_value<4>>();
  check_row_codec_all_isas<kvq::kivi_value<8>>();
  check_row_codec_all_isas<kvq::kivi_value<2, 8>>();
  check_row_codec_all_isas<kvq::kivi_value<4, 16>>();
  check_row_codec_all_isas<kvq::kivi_value<8, 24>>();
}

TEST_CASE("mxfp4 and nvfp4 rows are bit-exact on every ISA, several scales", "[simd][fp4]") {
  for (float scale : {1.0f, 0.5f, 3.7f, 1e-3f, 1e4f}) {
    kvq::fp4_params const p{scale};
    std::string const what = " scale " + std::to_string(scale);
    check_row_codec_all_isas<kvq::mxfp4>(p, what);
    check_row_codec_all_isas<kvq::nvfp4>(p, what);
  }
}

/// Block magnitudes at every boundary of the FP4 scales: the mxfp4 exponent's log2f round-up (the
/// last 50 floats below each power of two), every nvfp4 UE4M3 rounding point of amax / 6 (normal
/// and subnormal branches, and saturation) with neighbours a few ulps apart.
auto fp4_scale_boundaries() -> std::vector<float> {
  std::vector<float> v;
  for (u32 e = 1; e < 255; ++e)
    for (u32 j = 0; j < 50; ++j) v.push_back(from_bits((e << 23) - j));
  auto const around = [&](float c) {
    for (int k = -3; k <= 3; ++k)
      v.push_back(from_bits(static_cast<u32>(static_cast<std::int64_t>(kvq_test::bits(c)) + k)));
  };
  for (u32 e = 100; e < 140; ++e)
    for (u32 top = 0; top < 16; ++top) around(from_bits(e << 23 | top << 19) * 6.0f);
  for (int m = 0; m < 8; ++m) around((static_cast<float>(m) + 0.5f) / 512.0f * 6.0f);
  for (float c : {0.015625f * 6.0f, 256.0f * 6.0f, 448.0f * 6.0f, 480.0f * 6.0f}) around(c);
  return v;
}

/// Rows whose FP4 groups (Per values) each have one of the boundary magnitudes as their amax.
template <class Isa, class C, int Per>
void check_fp4_scales() {
  INFO(Isa::name << " " << C::name);
  auto const amax = fp4_scale_boundaries();
  int const hd = 64;
  int const rows = static_cast<int>((amax.size() * Per + hd - 1) / hd);
  std::vector<float> x(static_cast<std::size_t>(rows) * hd, 0.0f);
  for (std::size_t g = 0; g < amax.size(); ++g)
    for (int j = 0; j < Per; ++j)
      x[g * Per + static_cast<std::size_t>(j)] =
          (j % 2 ? -1.0f : 1.0f) * amax[g] * (j == 3 ? 1.0f : static_cast<float>(j) / Per);
  std::size_t const ds = C::geometry(hd).bytes();
  std::vector<u8> want(static_cast<std::size_t>(rows) * ds), got(want.size());
  for (int r = 0; r < rows; ++r) C::encode_row(x.data() + r * hd, hd, want.data() + r * ds, kvq::fp4_params{});
  Isa::template encode_rows<C>(x.data(), hd, rows, hd, got.data(), ds, kvq::fp4_params{});
  auto const d = first_diff(want.data(), got.data(), want.size());
  if (d >= 0)
    UNSCOPED_INFO("first difference at row " << static_cast<std::size_t>(d) / ds << " byte "
                                             << static_cast<std::size_t>(d) % ds);
  CHECK(d == -1);
}

TEST_CASE("mxfp4 and nvfp4 scales are bit-exact on every ISA at every rounding boundary", "[simd][fp4]") {
  for_each_isa([&]<class Isa>() {
    check_fp4_scales<Isa, kvq::mxfp4, 32>();
    check_fp4_scales<Isa, kvq::nvfp4, 16>();
  });
}

// -------------------------------------------------------------------------------------------------
// The rotation R and the tq codebooks

/// Head dims of the rotation and tq tests: blocks below, at and above every lane count, and
/// blocks beyond 16 vectors (the in-memory stages).
constexpr int rotation_head_dims[] = {1, 7, 8, 16, 40, 64, 80, 96, 128, 256, 1000, 2048};

/// Rotates rows of every kind with Isa (forward and inverse, packed and strided) and compares with
/// detail::rotate_forward_signs / rotate_inverse_signs: identical bits, NaN-ness for NaN
/// (whose payload and sign the reference's own compilation leaves open: a - b or a + (-b)), the
/// gaps between rows untouched.
template <class Isa>
void check_rotation() {
  std::uint32_t data_seed = 77;
  for (std::uint64_t seed : {std::uint64_t{0x6B7671}, std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{0xffffffffu},
                             std::uint64_t{0x12345678u}}) {
    for (int hd : rotation_head_dims) {
      std::vector<std::uint64_t> words(static_cast<std::size_t>(kvq::detail::rotation_word_count(hd)));
      kvq::detail::rotation_sign_words(seed, hd, words.data());
      for (int packed = 0; packed < 2; ++packed) {
        int const rows = row_kinds + 3;
        std::ptrdiff_t const xs = packed ? hd : hd + 3;
        auto const x = make_rows(rows, hd, xs, data_seed++);
        // forward in place, inverse in place, forward from x into rows ys apart
        for (int form = 0; form < 3; ++form) {
          bool const inverse = form == 1;
          INFO(Isa::name << " rotation seed " << seed << " head_dim " << hd << (packed ? " packed" : " strided")
                         << (inverse     ? " inverse"
                             : form == 2 ? " forward into other rows"
                                         : " forward"));
          std::vector<float> want = x, got = x;
          for (int r = 0; r < rows; ++r) {
            float* row = want.data() + r * xs;
            if (inverse)
              kvq::detail::rotate_inverse_signs(row, hd, words.data());
            else
              kvq::detail::rotate_forward_signs(row, hd, words.data());
          }
          if (form == 0) {
            Isa::rotate_forward(got.data(), rows, xs, hd, words.data());
          } else if (form == 1) {
            Isa::rotate_inverse(got.data(), rows, xs, hd, words.data());
          } else {  // rows of y hd + 5 (strided x) or hd (packed x) apart, copied back to x's layout
            std::ptrdiff_t const ys = packed ? hd : hd + 5;
            std::vector<float> y(static_cast<std::size_t>(rows * ys), -1.0f);
            Isa::rotate_forward(x.data(), xs, y.data(), ys, rows, hd, words.data());
            for (int r = 0; r < rows; ++r) std::copy_n(y.data() + r * ys, hd, got.data() + r * xs);
          }
          auto const e = first_float_diff(want, got, true);
          if (e >= 0)
            UNSCOPED_INFO("first difference at row " << e / xs << " (kind " << (e / xs) % row_kinds << ") channel "
                                                     << e % xs << ": reference "
                                                     << hex32(want[static_cast<std::size_t>(e)]) << ", got "
                                                     << hex32(got[static_cast<std::size_t>(e)]));
          CHECK(e == -1);
          // Rows without NaN or Inf (every kind but 7 and 13, and 10 can overflow): bits, strictly.
          for (int r = 0; r < rows; ++r) {
            bool finite = true;
            for (int c = 0; c < hd; ++c) finite = finite && std::isfinite(want[static_cast<std::size_t>(r * xs + c)]);
            if (!finite) continue;
            for (int c = 0; c < hd; ++c) {
              auto const i = static_cast<std::size_t>(r * xs + c);
              if (kvq_test::bits(want[i]) != kvq_test::bits(got[i])) {
                UNSCOPED_INFO("row " << r << " channel " << c << ": reference " << hex32(want[i]) << ", got "
                                     << hex32(got[i]));
                CHECK(false);
                break;
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("the rotation R is bit-identical to the reference on every ISA", "[simd][rotation]") {
  for_each_isa([&]<class Isa>() { check_rotation<Isa>(); });
}

TEST_CASE("row_rotation (the dispatching kernels) is bit-identical to the reference", "[simd][rotation]") {
  for (int hd : rotation_head_dims) {
    kvq::detail::row_rotation const rot(hd, kvq::default_rotation_seed);
    std::vector<std::uint64_t> words(static_cast<std::size_t>(kvq::detail::rotation_word_count(hd)));
    kvq::detail::rotation_sign_words(kvq::default_rotation_seed, hd, words.data());
    auto const x = make_rows(4, hd, hd, 5u + static_cast<std::uint32_t>(hd));
    std::vector<float> a = x, b = x;
    for (int r = 0; r < 4; ++r) kvq::detail::rotate_forward(a.data() + r * hd, hd, kvq::default_rotation_seed);
    rot.forward_rows(b.data(), 4, hd);
    INFO("head_dim " << hd);
    CHECK(first_float_diff(a, b, true) == -1);
    for (int r = 0; r < 4; ++r) kvq::detail::rotate_inverse(a.data() + r * hd, hd, kvq::default_rotation_seed);
    for (int r = 0; r < 4; ++r) rot.inverse(b.data() + r * hd);
    CHECK(first_float_diff(a, b, true) == -1);
  }
}

TEST_CASE("tq codebook rows are bit-exact on every ISA", "[simd][tq]") {
  check_row_codec_all_isas<kvq::detail::tq_codebook<2>>({}, {}, rotation_head_dims);
  check_row_codec_all_isas<kvq::detail::tq_codebook<3>>({}, {}, rotation_head_dims);
  check_row_codec_all_isas<kvq::detail::tq_codebook<4>>({}, {}, rotation_head_dims);
}

TEST_CASE("tq codebook rows of rotated data are bit-exact on every ISA", "[simd][tq]") {
  // The codec's real inputs: rotated rows (Gaussian-like coordinates), zero blocks, huge and tiny
  // norms (sums of squares overflowing to Inf, underflowing to 0).
  auto check = [&]<class Isa, int B>() {
    using C = kvq::detail::tq_codebook<B>;
    std::uint32_t seed = 99;
    for (int hd : rotation_head_dims) {
      kvq::detail::row_rotation const rot(hd, kvq::default_rotation_seed);
      int const rows = 40;
      auto x = make_rows(rows, hd, hd, seed++);
      std::mt19937 rng(seed);
      for (int r = 0; r < rows; ++r) {
        float* row = x.data() + r * hd;
        if (r % 5 == 1)
          for (int c = 0; c < hd / 2; ++c) row[c] = 0.0f;  // zero blocks (of the first blocks)
        if (r % 5 == 2)
          for (int c = 0; c < hd; ++c) row[c] *= r % 2 ? 3e19f : 1e-21f;
      }
      rot.forward_rows(x.data(), rows, hd);
      std::size_t const bytes = C::geometry(hd).bytes();
      std::vector<u8> want(rows * bytes), got(rows * bytes, 0xab);
      for (int r = 0; r < rows; ++r) C::encode_row(x.data() + r * hd, hd, want.data() + r * bytes);
      Isa::template encode_rows<C>(x.data(), hd, rows, hd, got.data(), bytes, {});
      INFO(Isa::name << " tq" << B << " head_dim " << hd);
      CHECK(first_diff(want.data(), got.data(), want.size()) == -1);
    }
  };
  for_each_isa([&]<class Isa>() {
    check.template operator()<Isa, 2>();
    check.template operator()<Isa, 3>();
    check.template operator()<Isa, 4>();
  });
}

TEST_CASE("KIVI key tiles are bit-exact on every ISA", "[simd][kivi]") {
  check_key_codec_all_isas<kvq::kivi_key<2>>();
  check_key_codec_all_isas<kvq::kivi_key<4>>();
  check_key_codec_all_isas<kvq::kivi_key<8>>();
  check_key_codec_all_isas<kvq::kivi_key<2, 8>>();
  check_key_codec_all_isas<kvq::kivi_key<2, 24>>();
  check_key_codec_all_isas<kvq::kivi_key<4, 16>>();
  check_key_codec_all_isas<kvq::kivi_key<8, 8>>();
}

TEST_CASE("f16 and bf16 widen exactly on every ISA: all 65536 patterns", "[simd][convert]") {
  for_each_isa([&]<class Isa>() { check_widen_all_patterns<Isa>(); });
}

TEST_CASE("f16 input is stored as widening and narrowing would: all 65536 patterns", "[simd][convert]") {
  // The append path copies f16 input into f16 rows with copy_f16_quieted instead of widening it to
  // f32 and narrowing it back: the bits must be those of both narrowings (NaNs quieted).
  std::vector<kvq::f16> h(65536), got(65537);
  for (u32 i = 0; i < 65536; ++i) h[i].bits = static_cast<u16>(i);
  for (int offset : {0, 3}) {  // an odd start and length: the vector loop's tail
    std::size_t const n = 65536 - static_cast<std::size_t>(offset);
    got.assign(got.size(), kvq::f16{0x1234});
    kvq::cpu_kernels::copy_f16_quieted(h.data() + offset, got.data(), static_cast<std::int64_t>(n));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float const x = kvq::detail::f16_bits_to_f32(h[i + static_cast<std::size_t>(offset)].bits);
      u16 const want = kvq::detail::f32_to_f16_bits(x);
      REQUIRE(want == kvq::detail::f32_to_f16_bits_satfinite(x));  // f16 values never saturate
      if (got[i].bits != want && bad++ == 0)
        UNSCOPED_INFO("f16 " << std::hex << h[i + static_cast<std::size_t>(offset)].bits << ": want " << want
                             << ", got " << got[i].bits);
    }
    CHECK(bad == 0);
    CHECK(got[n].bits == 0x1234);  // nothing written past n
  }
}

TEST_CASE("f32 narrows to f16 and bf16 as numeric.h on every ISA", "[simd][convert]") {
  auto const x = f32_patterns(7);
  for_each_isa([&]<class Isa>() { check_narrow<Isa>(x); });
}

TEST_CASE("f32 narrows to the f16 residual (finite values saturating) as numeric.h on every ISA", "[simd][convert]") {
  auto const x = f32_patterns(11);
  for_each_isa([&]<class Isa>() { check_narrow_satfinite<Isa>(x); });
}

TEST_CASE("exhaustive: every f32 narrows to f16 and bf16 as numeric.h", "[.][exhaustive]") {
  // Hidden (run by name): 2^32 inputs per instruction set.
  for_each_isa([&]<class Isa>() {
    INFO(Isa::name);
    constexpr std::size_t chunk = std::size_t{1} << 20;
    std::vector<float> x(chunk);
    std::vector<kvq::f16> h(chunk);
    std::vector<kvq::bf16> b(chunk);
    std::uint64_t bad = 0;
    for (std::uint64_t base = 0; base < (std::uint64_t{1} << 32); base += chunk) {
      for (std::size_t i = 0; i < chunk; ++i) x[i] = from_bits(static_cast<u32>(base + i));
      Isa::from_f32(x.data(), h.data(), static_cast<std::int64_t>(chunk));
      Isa::from_f32(x.data(), b.data(), static_cast<std::int64_t>(chunk));
      for (std::size_t i = 0; i < chunk; ++i)
        bad += (h[i].bits != kvq::detail::f32_to_f16_bits(x[i])) + (b[i].bits != kvq::detail::f32_to_bf16_bits(x[i]));
    }
    CHECK(bad == 0);
  });
}
