// kvq: AVX-512 (F, BW, VL) codec kernels, kvq::cpu_kernels::avx512.
//
// Compiled when the translation unit is built with AVX-512 F, BW and VL (and AVX2, FMA, F16C,
// which every such CPU has); otherwise this header defines nothing. The kernels are
// simd_codecs.hpp over the 16-lane policy below and reproduce the scalar reference bit for bit.
// VNNI and BF16 bring nothing to encode and decode: AVX512-BF16's VCVTNEPS2BF16 flushes
// subnormal inputs to zero, which the reference (numeric.h) does not, so bf16 stays integer code.
#pragma once

#include "../../detail/config.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)

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

#  define KVQ_CPU_HAS_AVX512 1

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels::avx512 {

/// The name of this instruction set, as reported by simd_level().
inline constexpr std::string_view name = "avx512";

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() (`__m512 __Y = __Y;`) as the unused
// merge source, which -W(maybe-)uninitialized reports wherever they are inlined
// (https://gcc.gnu.org/bugzilla/show_bug.cgi?id=105593, fixed in GCC 13).
#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic push
#    pragma GCC diagnostic ignored "-Wuninitialized"
#    pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#  endif
// Without optimisation (no __OPTIMIZE__), GCC's <avx512fintrin.h> defines the intrinsics that take
// an immediate (_mm512_cvtps_ph, _mm512_i32gather_epi32) as macros passing their all-ones mask with
// the other signedness (-1 to an __mmask16, (__mmask16)0xFFFF to a short), which -Wsign-conversion
// reports where they are used (as in https://github.com/google/highway/issues/163).
// KVQ_AVX512_IMM_BEGIN / KVQ_AVX512_IMM_END silence that around those uses only.
#  if defined(__GNUC__) && !defined(__clang__) && !defined(__OPTIMIZE__)
#    define KVQ_AVX512_IMM_BEGIN _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wsign-conversion\"")
#    define KVQ_AVX512_IMM_END _Pragma("GCC diagnostic pop")
#  else
#    define KVQ_AVX512_IMM_BEGIN
#    define KVQ_AVX512_IMM_END
#  endif

/// The 16-lane AVX-512 vector policy of simd_codecs.
struct ops {
  static constexpr int W = 16;
  using vf = __m512;
  using vi = __m512i;
  using vm = __mmask16;

  // Float lanes.
  static vf load(float const* p) noexcept { return _mm512_loadu_ps(p); }
  static void store(float* p, vf v) noexcept { _mm512_storeu_ps(p, v); }
  static vf set1(float x) noexcept { return _mm512_set1_ps(x); }
  static vf add(vf a, vf b) noexcept { return _mm512_add_ps(a, b); }
  /// lo = a0 b0 a1 b1 ... a7 b7, hi = a8 b8 ... a15 b15.
  static void interleave(vf a, vf b, vf& lo, vf& hi) noexcept {
    lo = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), b);
    hi = _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), b);
  }
  static vf sub(vf a, vf b) noexcept { return _mm512_sub_ps(a, b); }
  /// fl(a * b), never contracted with a later addition into an FMA.
  static vf mul(vf a, vf b) noexcept {
    vf r = _mm512_mul_ps(a, b);
#  if defined(__GNUC__)
    __asm__("" : "+v"(r));
#  endif
    return r;
  }
  static vf div(vf a, vf b) noexcept { return _mm512_div_ps(a, b); }
  static vf min(vf a, vf b) noexcept { return _mm512_min_ps(a, b); }
  static vf max(vf a, vf b) noexcept { return _mm512_max_ps(a, b); }
  static vf abs(vf a) noexcept {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  }
  /// Round to nearest, ties to even (embedded rounding: MXCSR is not consulted).
  static vi cvt_rne(vf a) noexcept {
    return _mm512_cvt_roundps_epi32(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static vi cvtt(vf a) noexcept { return _mm512_cvttps_epi32(a); }
  static vf cvt_f(vi a) noexcept { return _mm512_cvtepi32_ps(a); }
  static vi bits(vf a) noexcept { return _mm512_castps_si512(a); }
  static vf from_bits(vi a) noexcept { return _mm512_castsi512_ps(a); }
  static float reduce_max(vf v) noexcept {
    __m256 const h =
        _mm256_max_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_min(vf v) noexcept {
    __m256 const h =
        _mm256_min_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
  }
  static vm ge_f(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static vm le_f(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
  static vm gt_f(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static vm eq_f(vf a, vf b) noexcept { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static vf select_f(vm m, vf a, vf b) noexcept { return _mm512_mask_blend_ps(m, b, a); }

  // Integer lanes.
  static vi load_i(std::int32_t const* p) noexcept { return _mm512_loadu_si512(p); }
  static void store_i(std::int32_t* p, vi v) noexcept { _mm512_storeu_si512(p, v); }
  static vi set1_i(std::int32_t x) noexcept { return _mm512_set1_epi32(x); }
  static vi and_i(vi a, vi b) noexcept { return _mm512_and_si512(a, b); }
  static vi or_i(vi a, vi b) noexcept { return _mm512_or_si512(a, b); }
  static vi xor_i(vi a, vi b) noexcept { return _mm512_xor_si512(a, b); }
  static vi add_i(vi a, vi b) noexcept { return _mm512_add_epi32(a, b); }
  static vi sub_i(vi a, vi b) noexcept { return _mm512_sub_epi32(a, b); }
  static vi min_i(vi a, vi b) noexcept { return _mm512_min_epi32(a, b); }
  static vi max_i(vi a, vi b) noexcept { return _mm512_max_epi32(a, b); }
  template <int K>
  static vi srli(vi a) noexcept {
    return _mm512_srli_epi32(a, K);
  }
  template <int K>
  static vi slli(vi a) noexcept {
    return _mm512_slli_epi32(a, K);
  }
  static vi srl_n(vi a, int k) noexcept { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(k)); }
  static vi sll_n(vi a, int k) noexcept { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(k)); }
  static vm gt_i(vi a, vi b) noexcept { return _mm512_cmpgt_epi32_mask(a, b); }
  static vm eq_i(vi a, vi b) noexcept { return _mm512_cmpeq_epi32_mask(a, b); }
  static vi select_i(vm m, vi a, vi b) noexcept { return _mm512_mask_blend_epi32(m, b, a); }

  // Masks.
  static vm mask_false() noexcept { return 0; }
  static vm mask_or(vm a, vm b) noexcept { return static_cast<vm>(a | b); }
  static bool any(vm m) noexcept { return m != 0; }
  /// Bit l set when lane l is.
  static unsigned mask_bits(vm m) noexcept { return static_cast<unsigned>(m); }
  static vm lanes_below(int n) noexcept {
    return n >= 16 ? static_cast<vm>(0xffff) : n <= 0 ? static_cast<vm>(0) : static_cast<vm>((1u << n) - 1u);
  }

  // Narrow and wide memory.
  static vi load_u8(std::uint8_t const* p) noexcept {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  }
  static vi load_i8(std::uint8_t const* p) noexcept {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  }
  static void store_u8(std::uint8_t* p, vi v) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  /// Lanes j < 8: p[j] & 15, lanes j >= 8: p[j - 8] >> 4 (FP4 groups of 16 in 8 bytes); reads 8 bytes.
  static vi load_nibble_halves(std::uint8_t const* p) noexcept {
    std::int64_t w;
    std::memcpy(&w, p, 8);
    __m512i const b = _mm512_cvtepu8_epi32(_mm_set1_epi64x(w));
    return _mm512_and_si512(_mm512_srlv_epi32(b, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4)),
                            _mm512_set1_epi32(15));
  }
  /// p[j] = v_j | v_(j + 8) << 4 for j < 8 (lanes hold 4-bit codes); writes 8 bytes.
  static void store_nibble_halves(std::uint8_t* p, vi v) noexcept {
    __m512i const b = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_alignr_epi32(v, v, 8), 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(b));
  }
  static vi load_u16(std::uint16_t const* p) noexcept {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  }
  static void store_u16(std::uint16_t* p, vi v) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  }

  // f16: RNE with NaN quieted, top payload kept — numeric.h's f32_to_f16_bits exactly.
  KVQ_AVX512_IMM_BEGIN
  static void f16_store_hw(std::uint16_t* p, vf v) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static vi f32_to_f16_hw(vf v) noexcept {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  KVQ_AVX512_IMM_END
  /// Exact except that signalling NaNs come back quieted (simd_codecs repairs them).
  static vf f16_load_hw(std::uint16_t const* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  }
  /// The f16 in the low 16 bits of each lane, as f32 (hardware conversion).
  static vf f16_low_hw(vi x) noexcept { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)); }

  // fp8 through the f16 conversion: an E5M2 code is the high byte of the f16 of its value; an E4M3
  // code's magnitude shifted into an f16's exponent and mantissa fields is its value times 2^-8.
  /// The values of the W E5M2 codes at p (exact; NaN payloads aside).
  static vf e5m2_load_hw(std::uint8_t const* p) noexcept {
    __m256i const w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  }
  /// The values times 2^-8 of the W E4M3 codes at p, none of them NaN (exact).
  static vf e4m3_load_hw_scaled(std::uint8_t const* p) noexcept {
    __m256i const w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xbf80))));
  }
  /// True when one of the n bytes at p has a magnitude (low 7 bits) above `limit` (< 0x7f): an
  /// fp8 NaN code for limit 0x7e (E4M3) or 0x7c (E5M2).
  static bool any_magnitude_above(std::uint8_t const* p, std::size_t n, std::uint8_t limit) noexcept {
    __m512i const low7 = _mm512_set1_epi8(0x7f), lim = _mm512_set1_epi8(static_cast<char>(limit));
    __mmask64 hit = 0;
    std::size_t i = 0;
    for (; i + 64 <= n; i += 64) hit |= _mm512_cmpgt_epu8_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), low7), lim);
    bool any = hit != 0;
    for (; i < n; ++i) any = any || (p[i] & 0x7f) > limit;
    return any;
  }

  // Packed b-bit codes, LSB first: 16 codes -> 2 * B bytes (B = 2, 3, 4, 8).
  template <int B>
  static void store_codes(std::uint8_t* p, vi q) noexcept {
    __m128i const b = _mm512_cvtepi32_epi8(q);  // 16 codes as bytes
    if constexpr (B == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
    } else if constexpr (B == 4) {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x1001));  // c0 + 16 c1 per 16 bits
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(pairs, pairs));
    } else if constexpr (B == 3) {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x0801));       // c0 + 8 c1
      __m128i const quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00400001));  // + 64 (c2 + 8 c3): 12 bits
      // Per 64 bits: q0 + 2^12 q1 (24 bits), then the upper 24 bits moved next to the lower.
      __m128i const six = _mm_or_si128(_mm_and_si128(quads, _mm_set1_epi64x(0xfff)), _mm_srli_epi64(quads, 20));
      std::uint64_t const w = static_cast<std::uint64_t>(_mm_cvtsi128_si64(_mm_or_si128(six, _mm_srli_si128(six, 5))));
      std::memcpy(p, &w, 6);
    } else {
      __m128i const pairs = _mm_maddubs_epi16(b, _mm_set1_epi16(0x0401));       // c0 + 4 c1
      __m128i const quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));  // + 16 (c2 + 4 c3)
      __m128i const w16 = _mm_packus_epi32(quads, quads);
      std::uint32_t const w = static_cast<std::uint32_t>(_mm_cvtsi128_si32(_mm_packus_epi16(w16, w16)));
      std::memcpy(p, &w, 4);
    }
  }
  /// 16 codes of B bits from 2 * B bytes at p.
  template <int B>
  static vi load_codes(std::uint8_t const* p) noexcept {
    if constexpr (B == 8) {
      return load_u8(p);
    } else if constexpr (B == 4) {
      __m128i const b = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(p));
      __m128i const lo = _mm_and_si128(b, _mm_set1_epi8(15));
      __m128i const hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
      return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    } else {
      std::uint32_t w;
      std::memcpy(&w, p, 4);
      __m512i const sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(w)), sh), _mm512_set1_epi32(3));
    }
  }
  /// Lane l = the 4 bytes at base + l * stride.
  KVQ_AVX512_IMM_BEGIN
  static vi gather_u32(std::uint8_t const* base, int stride) noexcept {
    __m512i const idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(stride));
    return _mm512_i32gather_epi32(idx, base, 1);
  }
  KVQ_AVX512_IMM_END

  // Rotation (FORMATS.md §6.1): one butterfly stage of stride H < W inside the vector, and signs.
  /// Lane l with (l & H) == 0: v[l] + v[l + H]; other lanes: v[l - H] - v[l] (each one rounding).
  template <int H>
  static vf butterfly(vf v) noexcept {
    vf p;
    if constexpr (H == 1)
      p = _mm512_permute_ps(v, 0xb1);
    else if constexpr (H == 2)
      p = _mm512_permute_ps(v, 0x4e);
    else if constexpr (H == 4)
      p = _mm512_shuffle_f32x4(v, v, 0xb1);
    else
      p = _mm512_shuffle_f32x4(v, v, 0x4e);
    // v * (+-1) is exact, so the fused p + v * (+-1) is the one rounded p + v or p - v.
    constexpr float a = 1.0f, b = -1.0f;  // lanes with (l & H) == 0 add, the others subtract
    vf sign;
    if constexpr (H == 1)
      sign = _mm512_setr_ps(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b);
    else if constexpr (H == 2)
      sign = _mm512_setr_ps(a, a, b, b, a, a, b, b, a, a, b, b, a, a, b, b);
    else if constexpr (H == 4)
      sign = _mm512_setr_ps(a, a, a, a, b, b, b, b, a, a, a, a, b, b, b, b);
    else
      sign = _mm512_setr_ps(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
    return _mm512_fmadd_ps(v, sign, p);
  }
  /// v with the sign of lane l flipped where bit l of `bits` is set.
  static vf flip_signs(vf v, std::uint64_t bits) noexcept {
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(v), static_cast<vm>(bits & 0xffffu),
                                                     _mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
  }

  // Codebooks (tq): a table of 16 floats, looked up by the low 4 bits of each lane.
  using table16 = __m512;
  static table16 make_table16(float const* t) noexcept { return _mm512_loadu_ps(t); }
  /// Lane l = t[idx_l mod 2^B], for a table with t[i] = t[i mod 2^B] (bits of idx above B ignored).
  template <int B>
  static vf lookup(table16 t, vi idx) noexcept {
    return _mm512_permutexvar_ps(idx, t);
  }
  /// lookup for a table symmetric about its middle (t[2^B - 1 - i] = -t[i], as the tq codebooks).
  template <int B>
  static vf lookup_symmetric(table16 t, vi idx) noexcept {
    return _mm512_permutexvar_ps(idx, t);
  }
  /// The table whose lookup_symmetric<B> gives t[i] * g (each product rounded once; NaN signs aside).
  template <int B>
  static table16 scale_symmetric(table16 t, vf g) noexcept {
    return _mm512_mul_ps(t, g);
  }
  /// The B-bit codes of coordinates c .. c + 15 (c a multiple of 16) of an LSB-first bit stream at
  /// `codes`, in the low B bits of the lanes (the bits above are not cleared). Reads only their
  /// 2 B bytes.
  template <int B>
  static vi stream_codes(std::uint8_t const* codes, int c) noexcept {
    std::uint8_t const* p = codes + B * c / 8;
    std::uint32_t lo, hi = 0;
    std::memcpy(&lo, p, 4);
    if constexpr (B == 2) {
      return _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(lo)),
                               _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
    } else if constexpr (B == 3) {  // bytes 0-3 for codes 0-7 (bits 0-23), bytes 2-5 for codes 8-15 (bits 8-31)
      std::memcpy(&hi, p + 2, 4);
      __m512i const w = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(lo)), 0xff00, static_cast<int>(hi));
      return _mm512_srlv_epi32(w, _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 8, 11, 14, 17, 20, 23, 26, 29));
    } else {
      std::memcpy(&hi, p + 4, 4);
      __m512i const w = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(lo)), 0xff00, static_cast<int>(hi));
      return _mm512_srlv_epi32(w, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
    }
  }

  // Attention (attention_kernels.hpp): compared with the reference within a tolerance, so
  // contraction is allowed here.
  static vf fma(vf a, vf b, vf c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static vf mul_c(vf a, vf b) noexcept { return _mm512_mul_ps(a, b); }
  static float reduce_add(vf v) noexcept {
    __m256 const h =
        _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  /// Lane i = the sum of the lanes of v[i] (a transpose-and-add tree: 45 instructions for 16 sums).
  static vf reduce_lanes(vf const* v) noexcept {
    vf t[8], u[4];
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    vf const w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xee));
    vf const w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
  }
  /// Lane i = the largest lane of v[i] (signed; the tree of reduce_lanes with max).
  KVQ_CPU_ALWAYS_INLINE static vi max_lanes_i(vi const* v) noexcept {
    vi t[8], u[4];
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_max_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      u[i] = _mm512_max_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                              _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    vi const w0 = _mm512_max_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44), _mm512_shuffle_i32x4(u[0], u[1], 0xee));
    vi const w1 = _mm512_max_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44), _mm512_shuffle_i32x4(u[2], u[3], 0xee));
    return _mm512_max_epi32(_mm512_shuffle_i32x4(w0, w1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0xdd));
  }
  /// f16 bits to float with F16C (NaN payloads are not preserved exactly).
  static float f16_scalar_hw(std::uint16_t h) noexcept { return _cvtsh_ss(h); }
  /// Lanes l < N: the f16 at p + l * S as f32 (lanes from N on: lane 0's); reads only the bytes
  /// p .. p + (N - 1) S + 1.
  template <int S, int N>
  static vf f16_strided_hw(std::uint8_t const* p) noexcept {
    static_assert(S % 2 == 0 && N >= 1 && (N - 1) * S + 2 <= 64, "f16_strided_hw: the words must lie in 64 bytes");
    constexpr int words = (N - 1) * S / 2 + 1;
    alignas(64) static constexpr std::int16_t idx[32] = {0 * S / 2,           1 * S / 2 * (N > 1), 2 * S / 2 * (N > 2),
                                                         3 * S / 2 * (N > 3), 4 * S / 2 * (N > 4), 5 * S / 2 * (N > 5),
                                                         6 * S / 2 * (N > 6), 7 * S / 2 * (N > 7)};
    static_assert(N <= 8, "f16_strided_hw: at most 8 words");
    __m512i const x = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((std::uint64_t{1} << words) - 1), p);
    __m512i const w = _mm512_permutexvar_epi16(_mm512_load_si512(idx), x);
    return _mm512_cvtph_ps(_mm512_castsi512_si256(w));
  }
  /// Every lane: the f16 at p as f32 (f16_scalar_hw's value, broadcast before the conversion).
  static vf f16_broadcast_hw(std::uint8_t const* p) noexcept {
    std::int16_t h;
    std::memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16(h));
  }
  /// Each lane rounded to f16 and back (RNE).
  KVQ_AVX512_IMM_BEGIN
  static vf round_f16(vf v) noexcept {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  KVQ_AVX512_IMM_END
  /// Exact sum of a[j] * b[j] over 32 signed bytes.
  static std::int32_t dot_s8x32(std::int8_t const* a, std::int8_t const* b) noexcept {
    __m256i const va = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(a));
    __m256i const vb = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(b));
#  if defined(__AVX512VNNI__)
    // (a + 128) as unsigned times b, less 128 * sum(b): VPDPBUSD adds four u8 x s8 products per lane
    // into 32 bits without saturation, so the result is exact for every byte value.
    __m256i const zero = _mm256_setzero_si256();
    __m256i const biased = _mm256_dpbusd_epi32(zero, _mm256_xor_si256(va, _mm256_set1_epi8(-128)), vb);
    __m256i const sum_b = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(1), vb);
    __m256i const acc = _mm256_sub_epi32(biased, _mm256_slli_epi32(sum_b, 7));
#  else
    __m256i const lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(va)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(vb)));
    __m256i const hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(va, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(vb, 1)));
    __m256i const acc = _mm256_add_epi32(lo, hi);
#  endif
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  // Batched integer block dots (attention_kernels.hpp integer_logits): lane j of out[h] is one
  // token's dot with query head h's 32 codes q[h], exact.

  /// Per 128-bit lane g, [a, b, c, d] = the sums of the four 32-bit lanes of lane g of a, b, c, d.
  static vi sum_quads(vi a, vi b, vi c, vi d) noexcept {
    vi const ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    vi const cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  }
  /// Sum of u8 x s8 products of a and b, four per 32-bit lane, added to acc (exact).
  static vi dot_u8s8(vi acc, vi a, vi b) noexcept {
#  if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, a, b);
#  else  // a's bytes are nibbles here (a pair of products fits 16 bits)
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
#  endif
  }
  /// Lane j: sum over i < 32 of nibble i * q[h][i], the 32 unsigned nibbles of the 16 bytes at
  /// rows[j] + off (low nibbles are codes 0-15, high nibbles 16-31), for W tokens.
  template <int NH>
  static void nibble_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                          vi* out) noexcept {
    __m512i ql[std::size_t{NH}], qh[std::size_t{NH}], acc[std::size_t{NH}][4];
    for (int h = 0; h < NH; ++h) {
      ql[h] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<__m128i const*>(q[h])));
      qh[h] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<__m128i const*>(q[h] + 16)));
    }
    __m512i const m = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {  // tokens 4k .. 4k + 3, one per 128-bit lane
      auto const at = [&](int j) { return _mm_loadu_si128(reinterpret_cast<__m128i const*>(rows[4 * k + j] + off)); };
      __m512i x = _mm512_castsi128_si512(at(0));
      x = _mm512_inserti32x4(x, at(1), 1);
      x = _mm512_inserti32x4(x, at(2), 2);
      x = _mm512_inserti32x4(x, at(3), 3);
      __m512i const lo = _mm512_and_si512(x, m), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m);
#  if defined(__AVX512VNNI__)
      for (int h = 0; h < NH; ++h) acc[h][k] = dot_u8s8(dot_u8s8(zero, lo, ql[h]), hi, qh[h]);
#  else  // both products in 16 bits (|sum| <= 4 * 15 * 127), then pairs to 32
      for (int h = 0; h < NH; ++h)
        acc[h][k] = _mm512_madd_epi16(
            _mm512_add_epi16(_mm512_maddubs_epi16(lo, ql[h]), _mm512_maddubs_epi16(hi, qh[h])), _mm512_set1_epi16(1));
      (void)zero;
#  endif
    }
    // Lane g's word k of sum_quads is token 4k + g: back to token order.
    __m512i const order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int h = 0; h < NH; ++h)
      out[h] = _mm512_permutexvar_epi32(order, sum_quads(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
  }
  /// Lane j: sum over i < 32 of code i * q[h][i], the 32 signed codes at rows[j] + off (q's codes
  /// in [-127, 127]), for W tokens.
  template <int NH>
  static void byte_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                        vi* out) noexcept {
    __m512i qq[std::size_t{NH}], acc[std::size_t{NH}][8];
    for (int h = 0; h < NH; ++h)
      qq[h] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(q[h])));
#  if defined(__AVX512VNNI__)
    // (code + 128) as unsigned bytes, less 128 times the query's sums (the start of each lane).
    __m512i start[std::size_t{NH}];
    for (int h = 0; h < NH; ++h)
      start[h] = _mm512_sub_epi32(
          _mm512_setzero_si512(),
          _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), qq[h]), 7));
#  endif
    for (int k = 0; k < 8; ++k) {  // tokens 2k, 2k + 1, one per 256-bit half
      __m512i const x = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(rows[2 * k] + off))),
          _mm256_loadu_si256(reinterpret_cast<__m256i const*>(rows[2 * k + 1] + off)), 1);
#  if defined(__AVX512VNNI__)
      __m512i const u = _mm512_xor_si512(x, _mm512_set1_epi8(-128));
      for (int h = 0; h < NH; ++h) acc[h][k] = _mm512_dpbusd_epi32(start[h], u, qq[h]);
#  else  // |code| times q with code's sign: |pair sum| <= 2 * 128 * 127 fits 16 bits
      __m512i const a = _mm512_abs_epi8(x);
      __mmask64 const neg = _mm512_movepi8_mask(x);
      for (int h = 0; h < NH; ++h)
        acc[h][k] =
            _mm512_madd_epi16(_mm512_maddubs_epi16(a, _mm512_mask_sub_epi8(qq[h], neg, _mm512_setzero_si512(), qq[h])),
                              _mm512_set1_epi16(1));
#  endif
    }
    // After sum_quads, lane g of r0 / r1 holds tokens 2k + (g >= 2) of pairs k = 0..3 / 4..7 per
    // lane half; the halves' sums then hold tokens (0 2 4 6) (1 3 5 7) (8 ..) (9 ..).
    __m512i const order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int h = 0; h < NH; ++h) {
      __m512i const r0 = sum_quads(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      __m512i const r1 = sum_quads(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
      __m512i const s = _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, 0x88), _mm512_shuffle_i32x4(r0, r1, 0xdd));
      out[h] = _mm512_permutexvar_epi32(order, s);
    }
  }

  // Integer P·V (attention_kernels.hpp accumulate_integer, probability_precision::i8): the codes
  // of four tokens and 16 channels, transposed so that 32-bit lane c holds channel c's codes of the
  // four tokens in order, times four weight bytes (one per token) broadcast to every lane.
  static constexpr bool integer_value_dots = true;
  /// Tokens r[0..3]'s 16 bytes at offset off, transposed: lane c holds byte c of each token.
  static __m512i transpose_quad(std::uint8_t const* const* r, std::size_t off) noexcept {
    auto const at = [&](int j) { return _mm_loadu_si128(reinterpret_cast<__m128i const*>(r[j] + off)); };
    __m512i x = _mm512_castsi128_si512(at(0));
    x = _mm512_inserti32x4(x, at(1), 1);
    x = _mm512_inserti32x4(x, at(2), 2);
    x = _mm512_inserti32x4(x, at(3), 3);
    // 32-bit lane 4j + k <- token k's bytes 4j .. 4j + 3; then within each 128-bit lane, byte
    // 4i + k <- byte 4k + i.
    x = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
    return _mm512_shuffle_epi8(
        x, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)));
  }
#  if defined(__AVX512VNNI__)
  /// Signed codes as code + 128 (unsigned): dot_s8 then sums w · code + 128 · w.
  static constexpr int s8_code_bias = 128;
  struct s8_quad {
    __m512i u;
  };
  static s8_quad s8_codes(std::uint8_t const* const* r, std::size_t off) noexcept {
    return {_mm512_xor_si512(transpose_quad(r, off), _mm512_set1_epi8(-128))};
  }
  /// acc[0] lane c += sum over the four tokens of weight byte k of w4 times code (VPDPBUSD, exact).
  static void dot_s8(vi* acc, s8_quad const& q, std::int32_t w4) noexcept {
    acc[0] = _mm512_dpbusd_epi32(acc[0], q.u, _mm512_set1_epi32(w4));
  }
  static void dot_u4(vi* acc, vi const* nib, std::int32_t w4) noexcept {
    acc[0] = _mm512_dpbusd_epi32(acc[0], nib[0], _mm512_set1_epi32(w4));
  }
#  else
  /// Signed codes as |code| and the weight with the code's sign: a pair of products fits 16 bits.
  static constexpr int s8_code_bias = 0;
  struct s8_quad {
    __m512i a;
    __mmask64 neg;
  };
  static s8_quad s8_codes(std::uint8_t const* const* r, std::size_t off) noexcept {
    __m512i const x = transpose_quad(r, off);
    return {_mm512_abs_epi8(x), _mm512_movepi8_mask(x)};
  }
  static void dot_s8(vi* acc, s8_quad const& q, std::int32_t w4) noexcept {
    __m512i const w = _mm512_set1_epi32(w4);
    acc[0] = _mm512_add_epi32(
        acc[0], _mm512_madd_epi16(_mm512_maddubs_epi16(q.a, _mm512_mask_sub_epi8(w, q.neg, _mm512_setzero_si512(), w)),
                                  _mm512_set1_epi16(1)));
  }
  static void dot_u4(vi* acc, vi const* nib, std::int32_t w4) noexcept {
    acc[0] = _mm512_add_epi32(
        acc[0], _mm512_madd_epi16(_mm512_maddubs_epi16(nib[0], _mm512_set1_epi32(w4)), _mm512_set1_epi16(1)));
  }
#  endif
  /// s8_codes of the bytes [off, off + 16) into a and of [off + 16, off + 32) into b.
  static void s8_codes2(std::uint8_t const* const* r, std::size_t off, s8_quad& a, s8_quad& b) noexcept {
#  if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    // Two tokens' 32 bytes per register; one two-source byte permute per 16 channels.
    auto const at = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<__m256i const*>(r[j] + off)); };
    __m512i const x0 = _mm512_inserti64x4(_mm512_castsi256_si512(at(0)), at(1), 1);
    __m512i const x1 = _mm512_inserti64x4(_mm512_castsi256_si512(at(2)), at(3), 1);
    alignas(64) static constexpr std::uint8_t order[64] = {
        0,  32,  64, 96,  1,  33,  65, 97,  2,  34,  66, 98,  3,  35,  67, 99,  4,  36,  68, 100, 5,  37,
        69, 101, 6,  38,  70, 102, 7,  39,  71, 103, 8,  40,  72, 104, 9,  41,  73, 105, 10, 42,  74, 106,
        11, 43,  75, 107, 12, 44,  76, 108, 13, 45,  77, 109, 14, 46,  78, 110, 15, 47,  79, 111};
    __m512i const lo = _mm512_load_si512(order), hi = _mm512_add_epi8(lo, _mm512_set1_epi8(16));
    __m512i const flip = _mm512_set1_epi8(-128);
    a.u = _mm512_xor_si512(_mm512_permutex2var_epi8(x0, lo, x1), flip);
    b.u = _mm512_xor_si512(_mm512_permutex2var_epi8(x0, hi, x1), flip);
#  else
    a = s8_codes(r, off);
    b = s8_codes(r, off + 16);
#  endif
  }
  /// The 32 nibbles of tokens r[0..3]'s 16 bytes at off: lo[0] lane c holds the four tokens' low
  /// nibbles of byte c (channel c of a q4_0 block), hi[0] their high nibbles (channel 16 + c).
  struct u4_quad {
    __m512i lo[1], hi[1];
  };
  static u4_quad u4_codes(std::uint8_t const* const* r, std::size_t off) noexcept {
    __m512i const x = transpose_quad(r, off), m = _mm512_set1_epi8(15);
    return {{_mm512_and_si512(x, m)}, {_mm512_and_si512(_mm512_srli_epi16(x, 4), m)}};
  }
};

#  if defined(__GNUC__) && !defined(__clang__)
#    pragma GCC diagnostic pop
#  endif
#  undef KVQ_AVX512_IMM_BEGIN
#  undef KVQ_AVX512_IMM_END

KVQ_CPU_DEFINE_ENTRY_POINTS(ops)
KVQ_CPU_DEFINE_ATTENTION(ops)

}  // namespace cpu_kernels::avx512
KVQ_NAMESPACE_END

#endif  // AVX-512 F + BW + VL
