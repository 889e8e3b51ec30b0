// kvq: element math of the FP8 codecs E4M3FN and E5M2 (C++14 subset; C++, CUDA, Metal).
//
// Formats (OCP OFP8):
//   E4M3FN  S.EEEE.MMM, bias 7,  max finite 448   (0x7e), no infinities, NaN only S.1111.111;
//   E5M2    S.EEEEE.MM, bias 15, max finite 57344 (0x7b), ±Inf 0x7c|s, NaN 0x7d..0x7f|s.
// f32 -> fp8 rounds to nearest, ties to even code, with integer operations only (the result never
// depends on the floating-point environment), and matches CUDA's __nv_cvt_float_to_fp8 bit for bit:
//   * NaN -> 0x7f in both modes (the input sign is dropped, as CUDA does);
//   * |x| rounding past the max finite value (E4M3FN: |x| > 464, E5M2: |x| >= 61440) and ±Inf
//     overflow: saturate -> ±max finite (0x7e|s, 0x7b|s); no saturate -> 0x7f|s (E4M3FN, a NaN)
//     or ±Inf 0x7c|s (E5M2);
//   * underflow keeps the sign (±0); subnormals round at the fixed quantum 2^-9 (E4M3FN) or
//     2^-16 (E5M2).
// fp8 -> f32 is exact; every NaN code decodes to the quiet NaN 0x7fc00000 carrying the code's sign.
// The scaled forms follow vLLM: code = fp8(x / scale) with a true division, value = fp8 * scale.
#pragma once

#include "config.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Largest finite E4M3FN magnitude code (448).
KVQ_CONSTEXPR_VAR u8 e4m3_max_code = 0x7eu;
/// Largest finite E5M2 magnitude code (57344).
KVQ_CONSTEXPR_VAR u8 e5m2_max_code = 0x7bu;
/// The fp8 code every NaN input encodes to, in both formats and both modes.
KVQ_CONSTEXPR_VAR u8 fp8_nan_code = 0x7fu;

/// Rounds the f32 bits `u` to an fp8 format with `mbits` mantissa bits and exponent bias `bias`.
///
/// Magnitude codes above `max_mag` are an overflow, which gives `max_mag` when `saturate` and
/// `overflow_mag` otherwise; the sign bit is kept on every non-NaN result.
KVQ_HOST_DEVICE u8 fp8_from_f32_bits(u32 u, u32 mbits, u32 bias, u32 max_mag, u32 overflow_mag, bool saturate) {
  const u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp8_nan_code;
  const u32 sign = (u >> 24) & 0x80u;
  u32 mag = 0u;
  if (a >= ((128u - bias) << 23)) {
    // |x| >= 2^(1 - bias), the fp8 normal range: rebias the exponent from 127 to `bias`, then drop
    // 23 - mbits mantissa bits with RNE. A carry moves into the exponent; Inf lands far above max_mag.
    const u32 r = a - ((127u - bias) << 23);
    const u32 shift = 23u - mbits;
    mag = (r + ((1u << (shift - 1u)) - 1u) + ((r >> shift) & 1u)) >> shift;
  } else {
    // fp8 subnormal range: count quanta of 2^(1 - bias - mbits). With e the biased f32 exponent,
    // |x| = m * 2^(e - 150), so the quanta are m >> (151 - bias - mbits - e), rounded to even.
    const u32 e = a >> 23;
    const u32 shift = 151u - bias - mbits - e;  // >= 24 - mbits
    if (e != 0u && shift <= 24u) {              // shift > 24: |x| < half a quantum -> 0
      const u32 m = (a & 0x007fffffu) | 0x00800000u;
      mag = m >> shift;
      const u32 rem = m & ((1u << shift) - 1u);
      const u32 half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (mag & 1u))) ++mag;
    }
  }
  if (mag > max_mag) mag = saturate ? max_mag : overflow_mag;
  return static_cast<u8>(sign | mag);
}

/// Converts a float to E4M3FN, RNE; overflow and ±Inf give ±448 (saturate) or 0x7f|sign; NaN gives 0x7f.
KVQ_HOST_DEVICE u8 f32_to_e4m3(float x, bool saturate) {
  return fp8_from_f32_bits(f32_bits(x), 3u, 7u, e4m3_max_code, 0x7fu, saturate);
}

/// Converts a float to E5M2, RNE; overflow and ±Inf give ±57344 (saturate) or ±Inf; NaN gives 0x7f.
KVQ_HOST_DEVICE u8 f32_to_e5m2(float x, bool saturate) {
  return fp8_from_f32_bits(f32_bits(x), 2u, 15u, e5m2_max_code, 0x7cu, saturate);
}

/// f32 bits of the fp8 subnormal m * 2^(1 - bias - mbits), m in 1 .. 2^mbits - 1.
KVQ_HOST_DEVICE u32 fp8_subnormal_f32_bits(u32 m, u32 mbits, u32 bias) {
  u32 p = 0u;  // position of the leading one of m
  while ((m >> (p + 1u)) != 0u) ++p;
  return ((128u + p - bias - mbits) << 23) | ((m ^ (1u << p)) << (23u - p));
}

/// Returns the exact value of an E4M3FN code (0x7f and 0xff are NaN).
KVQ_HOST_DEVICE float e4m3_to_f32(u8 code) {
  const u32 c = static_cast<u32>(code);
  const u32 sign = (c & 0x80u) << 24;
  const u32 e = (c >> 3) & 0x0fu;
  const u32 m = c & 0x07u;
  if (e == 0x0fu && m == 0x07u) return f32_from_bits(sign | 0x7fc00000u);
  if (e != 0u) return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
  if (m == 0u) return f32_from_bits(sign);
  return f32_from_bits(sign | fp8_subnormal_f32_bits(m, 3u, 7u));
}

/// Returns the exact value of an E5M2 code (0x7c is +Inf, 0xfc is -Inf, 0x7d..0x7f and 0xfd..0xff are NaN).
KVQ_HOST_DEVICE float e5m2_to_f32(u8 code) {
  const u32 c = static_cast<u32>(code);
  const u32 sign = (c & 0x80u) << 24;
  const u32 e = (c >> 2) & 0x1fu;
  const u32 m = c & 0x03u;
  if (e == 0x1fu) return f32_from_bits(sign | (m == 0u ? 0x7f800000u : 0x7fc00000u));
  if (e != 0u) return f32_from_bits(sign | ((e + 112u) << 23) | (m << 21));
  if (m == 0u) return f32_from_bits(sign);
  return f32_from_bits(sign | fp8_subnormal_f32_bits(m, 2u, 15u));
}

/// E4M3FN code of x / scale (a correctly rounded f32 division first, as vLLM).
KVQ_HOST_DEVICE u8 f32_to_e4m3_scaled(float x, float scale, bool saturate) {
  return f32_to_e4m3(div_rn(x, scale), saturate);
}

/// E5M2 code of x / scale (a correctly rounded f32 division first, as vLLM).
KVQ_HOST_DEVICE u8 f32_to_e5m2_scaled(float x, float scale, bool saturate) {
  return f32_to_e5m2(div_rn(x, scale), saturate);
}

/// Value of an E4M3FN code times scale, rounded once to f32.
KVQ_HOST_DEVICE float e4m3_to_f32_scaled(u8 code, float scale) { return mul_rn(e4m3_to_f32(code), scale); }

/// Value of an E5M2 code times scale, rounded once to f32.
KVQ_HOST_DEVICE float e5m2_to_f32_scaled(u8 code, float scale) { return mul_rn(e5m2_to_f32(code), scale); }

}  // namespace detail
KVQ_NAMESPACE_END
