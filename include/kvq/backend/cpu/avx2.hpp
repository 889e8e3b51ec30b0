// kvq: AVX2 (+FMA, F16C) codec kernels, kvq::cpu_kernels::avx2.
//
// Compiled when the translation unit is built with AVX2, FMA and F16C (-mavx2 -mfma -mf16c, or a
// -march that has them); otherwise this header defines nothing. AVX-512 builds compile it too, so
// both paths are tested there. The kernels are simd_codecs.hpp over the 8-lane policy below; they
// reproduce the scalar reference bit for bit.
#pragma once

#include "../../detail/config.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The intrinsics of clang's headers are plain vector operators: parsed here with precise floating point,
// they keep kvq's results whatever -funsafe-math-optimizations a consumer passes (config.h).
KVQ_FP_PRECISE_BEGIN
#  include <immintrin.h>
KVQ_FP_PRECISE_END

#  include <cstddef>
#  include <cstdint>
#  include <cstring>
#  include <string_view>

#  include "attention_kernels.hpp"
#  include "simd_codecs.hpp"

#  define KVQ_CPU_HAS_AVX2 1

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels::avx2 {

/// The name of this instruction set, as reported by simd_level().
inline constexpr std::string_view name = "avx2";

/// The 8-lane AVX2 vector policy of simd_codecs.
struct ops {
  static constexpr int W = 8;
  using vf = __m256;
  using vi = __m256i;
  using vm = __m256i;  // all-ones lanes

  // Float lanes.
  static vf load(float const* p) noexcept { return _mm256_loadu_ps(p); }
  static void store(float* p, vf v) noexcept { _mm256_storeu_ps(p, v); }
  static vf set1(float x) noexcept { return _mm256_set1_ps(x); }
  static vf add(vf a, vf b) noexcept { return _mm256_add_ps(a, b); }
  /// lo = a0 b0 a1 b1 a2 b2 a3 b3, hi = a4 b4 ... a7 b7.
  static void interleave(vf a, vf b, vf& lo, vf& hi) noexcept {
    __m256 const l = _mm256_unpacklo_ps(a, b), h = _mm256_unpackhi_ps(a, b);
    lo = _mm256_permute2f128_ps(l, h, 0x20);
    hi = _mm256_permute2f128_ps(l, h, 0x31);
  }
  static vf sub(vf a, vf b) noexcept { return _mm256_sub_ps(a, b); }
  /// fl(a * b), never contracted with a later addition into an FMA.
  static vf mul(vf a, vf b) noexcept {
    vf r = _mm256_mul_ps(a, b);
#  if defined(__GNUC__)
    __asm__("" : "+x"(r));
#  endif
    return r;
  }
  static vf div(vf a, vf b) noexcept { return _mm256_div_ps(a, b); }
  static vf min(vf a, vf b) noexcept { return _mm256_min_ps(a, b); }
  static vf max(vf a, vf b) noexcept { return _mm256_max_ps(a, b); }
  static vf abs(vf a) noexcept { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  /// Round to nearest, ties to even, whatever MXCSR says.
  static vi cvt_rne(vf a) noexcept {
    return _mm256_cvttps_epi32(_mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static vi cvtt(vf a) noexcept { return _mm256_cvttps_epi32(a); }
  static vf cvt_f(vi a) noexcept { return _mm256_cvtepi32_ps(a); }
  static vi bits(vf a) noexcept { return _mm256_castps_si256(a); }
  static vf from_bits(vi a) noexcept { return _mm256_castsi256_ps(a); }
  static float reduce_max(vf v) noexcept {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_min(vf v) noexcept {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
  }
  static vm ge_f(vf a, vf b) noexcept { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
  static vm le_f(vf a, vf b) noexcept { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
  static vm gt_f(vf a, vf b) noexcept { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static vm eq_f(vf a, vf b) noexcept { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static vf select_f(vm m, vf a, vf b) noexcept { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }

  // Integer lanes.
  static vi load_i(std::int32_t const* p) noexcept { return _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)); }
  static void store_i(std::int32_t* p, vi v) noexcept { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static vi set1_i(std::int32_t x) noexcept { return _mm256_set1_epi32(x); }
  static vi and_i(vi a, vi b) noexcept { return _mm256_and_si256(a, b); }
  static vi or_i(vi a, vi b) noexcept { return _mm256_or_si256(a, b); }
  static vi xor_i(vi a, vi b) noexcept { return _mm256_xor_si256(a, b); }
  static vi add_i(vi a, vi b) noexcept { return _mm256_add_epi32(a, b); }
  static vi sub_i(vi a, vi b) noexcept { return _mm256_sub_epi32(a, b); }
  static vi min_i(vi a, vi b) noexcept { return _mm256_min_epi32(a, b); }
  static vi max_i(vi a, vi b) noexcept { return _mm256_max_epi32(a, b); }
  template <int K>
  static vi srli(vi a) noexcept {
    return _mm256_srli_epi32(a, K);
  }
  template <int K>
  static vi slli(vi a) noexcept {
    return _mm256_slli_epi32(a, K);
  }
  static vi srl_n(vi a, int k) noexcept { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(k)); }
  static vi sll_n(vi a, int k) noexcept { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(k)); }
  static vm gt_i(vi a, vi b) noexcept { return _mm256_cmpgt_epi32(a, b); }
  static vm eq_i(vi a, vi b) noexcept { return _mm256_cmpeq_epi32(a, b); }
  static vi select_i(vm m, vi a, vi b) noexcept { return _mm256_blendv_epi8(b, a, m); }

  // Masks.
  static vm mask_false() noexcept { return _mm256_setzero_si256(); }
  static vm mask_or(vm a, vm b) noexcept { return _mm256_or_si256(a, b); }
  static bool any(vm m) noexcept { return !_mm256_testz_si256(m, m); }
  /// Bit l set when lane l is.
  static unsigned mask_bits(vm m) noexcept { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(m))); }
  static vm lanes_below(int n) noexcept {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }

  // Narrow and wide memory.
  static vi load_u8(std::uint8_t const* p) noexcept {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
  }
  static vi load_i8(std::uint8_t const* p) noexcept {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
  }
  /// The low byte of each lane, in lane order, as an 8-byte vector (low half of the result).
  static __m128i narrow_u8(vi v) noexcept {
    __m256i const pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i const b = _mm256_shuffle_epi8(v, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  }
  static void store_u8(std::uint8_t* p, vi v) noexcept {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), narrow_u8(v));
  }
  static vi load_u16(std::uint16_t const* p) noexcept {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  }
  static void store_u16(std::uint16_t* p, vi v) noexcept {
    __m256i const pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i const b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(b));
  }

  // f16 (F16C): RNE with NaN quieted, top payload kept — numeric.h's f32_to_f16_bits exactly.
  static void f16_store_hw(std::uint16_t* p, vf v) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static vi f32_to_f16_hw(vf v) noexcept {
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  /// Exact except that signalling NaNs come back quieted (simd_codecs repairs them).
  static vf f16_load_hw(std::uint16_t const* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  }
  /// The f16 in the low 16 bits of each lane, as f32 (hardware conversion).
  static vf f16_low_hw(vi x) noexcept {
    __m256i const p = _mm256_packus_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256());
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
  }

  // fp8 through the f16 conversion: an E5M2 code is the high byte of the f16 of its value; an E4M3
  // code's magnitude shifted into an f16's exponent and mantissa fields is its value times 2^-8.
  /// The values of the W E5M2 codes at p (exact; NaN payloads aside).
  static vf e5m2_load_hw(std::uint8_t const* p) noexcept {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p))), 8));
  }
  /// The values times 2^-8 of the W E4M3 codes at p, none of them NaN (exact).
  static vf e4m3_load_hw_scaled(std::uint8_t const* p) noexcept {
    __m128i const w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xbf80))));
  }
  /// True when one of the n bytes at p has a magnitude (low 7 bits) above `limit` (< 0x7f): an
  /// fp8 NaN code for limit 0x7e (E4M3) or 0x7c (E5M2).
  static bool any_magnitude_above(std::uint8_t const* p, std::size_t n, std::uint8_t limit) noexcept {
    __m256i const low7 = _mm256_set1_epi8(0x7f), lim = _mm256_set1_epi8(static_cast<char>(limit));
    __m256i hit = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {  // magnitudes are 0 .. 127: the signed byte compare is exact
      __m256i const x = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p + i));
      hit = _mm256_or_si256(hit, _mm256_cmpgt_epi8(_mm256_and_si256(x, low7), lim));
    }
    bool any = _mm256_movemask_epi8(hit) != 0;
    for (; i < n; ++i) any = any || (p[i] & 0x7f) > limit;
    return any;
  }

  // Packed b-bit codes, LSB first: 8 codes -> B bytes (B = 2, 3, 4, 8).
  template <int B>
  static void store_codes(std::uint8_t* p, vi q) noexcept {
    __m128i const b = narrow_u8(q);  // 8 codes as bytes
    if constexpr (B == 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
    } else if constexpr (B == 4) {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x1001));  // c0 + 16 c1 per 16 bits
      std::uint32_t const w = static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm_packus_epi16(pairs, pairs)));
      std::memcpy(p, &w, 4);
    } else if constexpr (B == 3) {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x0801));       // c0 + 8 c1
      __m128i const quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00400001));  // + 64 (c2 + 8 c3): 12 bits
      auto const w = static_cast<std::uint64_t>(_mm_cvtsi128_si64(quads));
      std::uint32_t const t = static_cast<std::uint32_t>((w & 0xfffu) | (w >> 20));  // q0 + 2^12 q1: 24 bits
      std::memcpy(p, &t, 3);
    } else {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x0401));       // c0 + 4 c1
      __m128i const quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));  // + 16 (c2 + 4 c3)
      __m128i const w16 = _mm_packus_epi32(quads, quads);
      std::uint16_t const w = static_cast<std::uint16_t>(_mm_cvtsi128_si32(_mm_packus_epi16(w16, w16)));
      std::memcpy(p, &w, 2);
    }
  }
  /// 8 codes of B bits from B bytes at p.
  template <int B>
  static vi load_codes(std::uint8_t const* p) noexcept {
    if constexpr (B == 8) {
      return load_u8(p);
    } else if constexpr (B == 4) {
      std::uint32_t w;
      std::memcpy(&w, p, 4);
      __m256i const sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), _mm256_set1_epi32(15));
    } else {
      std::uint16_t w;
      std::memcpy(&w, p, 2);
      __m256i const sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
      return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(3));
    }
  }
  /// Lane l = the 4 bytes at base + l * stride.
  static vi gather_u32(std::uint8_t const* base, int stride) noexcept {
    __m256i const idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    return _mm256_i32gather_epi32(reinterpret_cast<int const*>(base), idx, 1);
  }

  // Rotation (FORMATS.md §6.1): one butterfly stage of stride H < W inside the vector, and signs.
  /// Lane l with (l & H) == 0: v[l] + v[l + H]; other lanes: v[l - H] - v[l] (each one rounding).
  template <int H>
  static vf butterfly(vf v) noexcept {
    vf p;
    if constexpr (H == 1)
      p = _mm256_permute_ps(v, 0xb1);
    else if constexpr (H == 2)
      p = _mm256_permute_ps(v, 0x4e);
    else
      p = _mm256_permute2f128_ps(v, v, 0x01);
    // v * (+-1) is exact, so the fused p + v * (+-1) is the one rounded p + v or p - v.
    constexpr float a = 1.0f, b = -1.0f;  // lanes with (l & H) == 0 add, the others subtract
    vf sign;
    if constexpr (H == 1)
      sign = _mm256_setr_ps(a, b, a, b, a, b, a, b);
    else if constexpr (H == 2)
      sign = _mm256_setr_ps(a, a, b, b, a, a, b, b);
    else
      sign = _mm256_setr_ps(a, a, a, a, b, b, b, b);
    return _mm256_fmadd_ps(v, sign, p);
  }
  /// v with the sign of lane l flipped where bit l of `bits` is set.
  static vf flip_signs(vf v, std::uint64_t bits) noexcept {
    __m256i const m = _mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(bits & 0xffu)),
                                        _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24));
    return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(INT32_MIN))));
  }

  // Codebooks (tq): a table of 16 floats, looked up by the low 4 bits of each lane.
  struct table16 {
    __m256 lo, hi, mirror;  // t[0 .. 8), t[8 .. 16), t[15 - j] for j < 8
  };
  static table16 make_table16(float const* t) noexcept {
    alignas(32) float m[8];
    for (int j = 0; j < 8; ++j) m[j] = t[15 - j];
    return {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8), _mm256_load_ps(m)};
  }
  /// Lane l = t[idx_l mod 2^B], for a table with t[i] = t[i mod 2^B] (bits of idx above B ignored).
  template <int B>
  static vf lookup(table16 const& t, vi idx) noexcept {
    vf const lo = _mm256_permutevar8x32_ps(t.lo, idx);
    if constexpr (B <= 3) {
      return lo;
    } else {  // bit 3 of the index picks the upper half
      vf const hi = _mm256_permutevar8x32_ps(t.hi, idx);
      return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
  }
  /// lookup for a table symmetric about its middle (t[2^B - 1 - i] = -t[i], as the tq codebooks):
  /// at B = 4 one permute, t[i] = m[(i ^ 15) & 7] for i >= 8 and -m[i & 7] for i < 8 with
  /// m[j] = t[15 - j].
  template <int B>
  static vf lookup_symmetric(table16 const& t, vi idx) noexcept {
    if constexpr (B <= 3) {
      return _mm256_permutevar8x32_ps(t.lo, idx);
    } else {
      __m256i const s = _mm256_slli_epi32(idx, 28);  // bit 3 of the index at bit 31
      __m256 const m = _mm256_permutevar8x32_ps(t.mirror, _mm256_xor_si256(idx, _mm256_srai_epi32(s, 31)));
      return _mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_andnot_si256(s, _mm256_set1_epi32(INT32_MIN))));
    }
  }
  /// Lane l = m[idx_l & 7] with its sign flipped where bit 3 of idx_l is set (FP4 codes: a sign
  /// bit over three magnitude bits); bits of idx above 3 ignored.
  static vf lookup_sign_magnitude(vf m, vi idx) noexcept {
    __m256i const sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(m, idx), _mm256_castsi256_ps(sign));
  }
  /// The table whose lookup_symmetric<B> gives t[i] * g (each product rounded once; NaN signs aside).
  template <int B>
  static table16 scale_symmetric(table16 const& t, vf g) noexcept {
    if constexpr (B <= 3)
      return {_mm256_mul_ps(t.lo, g), t.hi, t.mirror};
    else
      return {t.lo, t.hi, _mm256_mul_ps(t.mirror, g)};
  }
  /// The B-bit codes of coordinates c .. c + 7 (c a multiple of 8) of an LSB-first bit stream at
  /// `codes`, in the low B bits of the lanes (the bits above are not cleared). Reads their B bytes
  /// and, for B < 4, the 4 - B bytes before them (which the caller's buffer must hold).
  template <int B>
  static vi stream_codes(std::uint8_t const* codes, int c) noexcept {
    std::uint8_t const* p = codes + B * c / 8;
    if constexpr (B == 2) {
      std::uint32_t w;
      std::memcpy(&w, p - 2, 4);
      return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                               _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30));
    } else if constexpr (B == 3) {
      std::uint32_t w;
      std::memcpy(&w, p - 1, 4);
      return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)),
                               _mm256_setr_epi32(8, 11, 14, 17, 20, 23, 26, 29));
    } else {
      std::uint32_t w;
      std::memcpy(&w, p, 4);
      return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    }
  }

  // Attention (attention_kernels.hpp): compared with the reference within a tolerance, so
  // contraction is allowed here.
  static vf fma(vf a, vf b, vf c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  static vf mul_c(vf a, vf b) noexcept { return _mm256_mul_ps(a, b); }
  static float reduce_add(vf v) noexcept {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  /// Lane i = the sum of the lanes of v[i] (horizontal-add tree).
  static vf reduce_lanes(vf const* v) noexcept {
    vf const t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    vf const t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    vf const u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  /// Lane i = the largest lane of v[i] (signed): pairs of 32-bit lanes, then of 64-bit lanes,
  /// then the two 128-bit halves.
  KVQ_CPU_ALWAYS_INLINE static vi max_lanes_i(vi const* v) noexcept {
    vi t[4];
    for (int i = 0; i < 4; ++i)
      t[i] = _mm256_max_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                              _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    vi const u0 = _mm256_max_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
    vi const u1 = _mm256_max_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
    return _mm256_max_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  }
  /// f16 bits to float with F16C (NaN payloads are not preserved exactly).
  static float f16_scalar_hw(std::uint16_t h) noexcept { return _cvtsh_ss(h); }
  /// Each lane rounded to f16 and back (RNE).
  static vf round_f16(vf v) noexcept {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  /// Exact sum of a[j] * b[j] over 32 signed bytes (products widened to 16 bits, pairs to 32).
  static std::int32_t dot_s8x32(std::int8_t const* a, std::int8_t const* b) noexcept {
    __m256i const va = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(a));
    __m256i const vb = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(b));
    __m256i const lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(va)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(vb)));
    __m256i const hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(va, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(vb, 1)));
    __m256i const acc = _mm256_add_epi32(lo, hi);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  // Batched integer block dots (attention_kernels.hpp integer_logits): lane j of out[h] is one
  // token's dot with query head h's 32 codes q[h], exact.

  /// Per 128-bit lane g, [a, b, c, d] = the sums of the four 32-bit lanes of lane g of a, b, c, d.
  static vi sum_quads(vi a, vi b, vi c, vi d) noexcept {
    vi const ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    vi const cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  }
  /// Lane j: sum over i < 32 of nibble i * q[h][i], the 32 unsigned nibbles of the 16 bytes at
  /// rows[j] + off (low nibbles are codes 0-15, high nibbles 16-31), for W tokens.
  template <int NH>
  static void nibble_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                          vi* out) noexcept {
    __m256i ql[std::size_t{NH}], qh[std::size_t{NH}], acc[std::size_t{NH}][4];
    for (int h = 0; h < NH; ++h) {
      ql[h] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<__m128i const*>(q[h])));
      qh[h] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<__m128i const*>(q[h] + 16)));
    }
    __m256i const m = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int k = 0; k < 4; ++k) {  // tokens 2k, 2k + 1, one per 128-bit lane
      __m256i const x = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<__m128i const*>(rows[2 * k] + off))),
          _mm_loadu_si128(reinterpret_cast<__m128i const*>(rows[2 * k + 1] + off)), 1);
      __m256i const lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
      // Both products in 16 bits (|sum| <= 4 * 15 * 127), then pairs to 32.
      for (int h = 0; h < NH; ++h)
        acc[h][k] =
            _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ql[h]), _mm256_maddubs_epi16(hi, qh[h])), ones);
    }
    // Lane g's word k of sum_quads is token 2k + g: back to token order.
    __m256i const order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int h = 0; h < NH; ++h)
      out[h] = _mm256_permutevar8x32_epi32(sum_quads(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), order);
  }
  /// Lane j: sum over i < 32 of code i * q[h][i], the 32 signed codes at rows[j] + off (q's codes
  /// in [-127, 127]), for W tokens.
  template <int NH>
  static void byte_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                        vi* out) noexcept {
    __m256i qq[std::size_t{NH}], acc[std::size_t{NH}][8];
    for (int h = 0; h < NH; ++h) qq[h] = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(q[h]));
    __m256i const ones = _mm256_set1_epi16(1);
    for (int k = 0; k < 8; ++k) {  // token k
      __m256i const x = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(rows[k] + off));
      __m256i const a = _mm256_abs_epi8(x);
      // |code| times q with code's sign: |pair sum| <= 2 * 128 * 127 fits 16 bits.
      for (int h = 0; h < NH; ++h)
        acc[h][k] = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(qq[h], x)), ones);
    }
    for (int h = 0; h < NH; ++h) {
      __m256i const r0 = sum_quads(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      __m256i const r1 = sum_quads(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
      out[h] = _mm256_add_epi32(_mm256_permute2x128_si256(r0, r1, 0x20), _mm256_permute2x128_si256(r0, r1, 0x31));
    }
  }

  // Integer P·V (attention_kernels.hpp accumulate_integer, probability_precision::i8): the codes
  // of four tokens and 16 channels, transposed so that 32-bit lane c of vector c / 8 holds channel
  // c's codes of the four tokens in order, times four weight bytes (one per token) in every lane.
  static constexpr bool integer_value_dots = true;
  /// Tokens r[0..3]'s 16 bytes at offset off, transposed: lane c of y[c / 8] holds byte c of each.
  static void transpose_quad(std::uint8_t const* const* r, std::size_t off, vi* y) noexcept {
    auto const at = [&](int j) { return _mm_loadu_si128(reinterpret_cast<__m128i const*>(r[j] + off)); };
    __m256i const a = _mm256_inserti128_si256(_mm256_castsi128_si256(at(0)), at(2), 1);
    __m256i const b = _mm256_inserti128_si256(_mm256_castsi128_si256(at(1)), at(3), 1);
    // unpack: [t0 t1 t0 t1 | t2 t3 t2 t3] words of bytes 4j..4j+3; the 64-bit permute puts the four
    // tokens' word j together per 128-bit lane; then byte 4i + k <- byte 4k + i within each lane.
    __m256i const pat =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    y[0] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpacklo_epi32(a, b), 0xd8), pat);
    y[1] = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(_mm256_unpackhi_epi32(a, b), 0xd8), pat);
  }
  /// Signed codes as |code| and the weight with the code's sign: a pair of products fits 16 bits.
  static constexpr int s8_code_bias = 0;
  struct s8_quad {
    __m256i a[2], s[2];
  };
  static s8_quad s8_codes(std::uint8_t const* const* r, std::size_t off) noexcept {
    s8_quad q;
    transpose_quad(r, off, q.s);
    q.a[0] = _mm256_abs_epi8(q.s[0]);
    q.a[1] = _mm256_abs_epi8(q.s[1]);
    return q;
  }
  /// s8_codes of the bytes [off, off + 16) into a and of [off + 16, off + 32) into b.
  static void s8_codes2(std::uint8_t const* const* r, std::size_t off, s8_quad& a, s8_quad& b) noexcept {
    a = s8_codes(r, off);
    b = s8_codes(r, off + 16);
  }
  /// acc[j] lane c += sum over the four tokens of weight byte k of w4 times code (exact).
  static void dot_s8(vi* acc, s8_quad const& q, std::int32_t w4) noexcept {
    __m256i const w = _mm256_set1_epi32(w4), one = _mm256_set1_epi16(1);
    for (int j = 0; j < 2; ++j)
      acc[j] =
          _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q.a[j], _mm256_sign_epi8(w, q.s[j])), one));
  }
  static void dot_u4(vi* acc, vi const* nib, std::int32_t w4) noexcept {
    __m256i const w = _mm256_set1_epi32(w4), one = _mm256_set1_epi16(1);
    for (int j = 0; j < 2; ++j)
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(nib[j], w), one));
  }
  /// The 32 nibbles of tokens r[0..3]'s 16 bytes at off: lo holds the four tokens' low nibbles
  /// (channels 0-15 of a q4_0 block), hi their high nibbles (channels 16-31).
  struct u4_quad {
    __m256i lo[2], hi[2];
  };
  static u4_quad u4_codes(std::uint8_t const* const* r, std::size_t off) noexcept {
    __m256i x[2];
    transpose_quad(r, off, x);
    __m256i const m = _mm256_set1_epi8(15);
    u4_quad q;
    for (int j = 0; j < 2; ++j) {
      q.lo[j] = _mm256_and_si256(x[j], m);
      q.hi[j] = _mm256_and_si256(_mm256_srli_epi16(x[j], 4), m);
    }
    return q;
  }
};

KVQ_CPU_DEFINE_ENTRY_POINTS(ops)
KVQ_CPU_DEFINE_ATTENTION(ops)

}  // namespace cpu_kernels::avx2
KVQ_NAMESPACE_END

#endif  // AVX2 && FMA && F16C
