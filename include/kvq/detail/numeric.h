// kvq: f16 and bf16 storage types with bit-exact conversions (C++14 subset; C++, CUDA, Metal).
//
// Conversions from f32 round to nearest, ties to even, using integer operations only, so the
// result never depends on the floating-point environment or on compiler `_Float16` support.
//   f32 -> f16 : subnormals kept, |x| >= 65520 -> ±Inf, NaN -> quiet NaN (sign and top payload
//                bits kept, as x86 F16C and AArch64 FCVT do).
//   f32 -> bf16: subnormals kept, overflow -> ±Inf, NaN -> quiet NaN (sign and top payload kept).
//   f16/bf16 -> f32: exact.
#pragma once

#include "config.h"

KVQ_NAMESPACE_BEGIN

/// IEEE-754 binary16 storage: a value type holding the 16 raw bits.
struct f16 {
  detail::u16 bits;
};

/// bfloat16 storage (the top half of a binary32): a value type holding the 16 raw bits.
struct bf16 {
  detail::u16 bits;
};

namespace detail {

/// Converts a float to binary16 bits, round to nearest even.
KVQ_HOST_DEVICE u16 f32_to_f16_bits(float x) {
  const u32 u = f32_bits(x);
  const u32 sign = (u >> 16) & 0x8000u;
  const u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<u16>(sign | 0x7e00u | ((a >> 13) & 0x03ffu));  // NaN, quieted
  if (a >= 0x477ff000u) return static_cast<u16>(sign | 0x7c00u);                         // >= 65520 (incl. Inf) -> Inf
  if (a >= 0x38800000u) {           // normal binary16 range (>= 2^-14)
    const u32 r = a - 0x38000000u;  // rebias exponent 127 -> 15
    return static_cast<u16>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  if (a < 0x33000000u) return static_cast<u16>(sign);  // <= 2^-25 (half the min subnormal, a tie to 0)
  // binary16 subnormal: value = m * 2^(e - 150), quantum 2^-24 -> shift right by 126 - e.
  const u32 e = a >> 23;
  const u32 m = (a & 0x007fffffu) | 0x00800000u;
  const u32 shift = 126u - e;  // 14 .. 24
  u32 q = m >> shift;
  const u32 rem = m & ((1u << shift) - 1u);
  const u32 half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<u16>(sign | q);
}

/// Converts binary16 bits to the exactly equal float.
KVQ_HOST_DEVICE float f16_bits_to_f32(u16 h) {
  const u32 sign = (static_cast<u32>(h) & 0x8000u) << 16;
  const u32 e = (static_cast<u32>(h) >> 10) & 0x1fu;
  u32 m = static_cast<u32>(h) & 0x03ffu;
  if (e == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (m << 13));  // Inf / NaN
  if (e != 0u) return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0u) return f32_from_bits(sign);
  // Subnormal: normalise the significand.
  u32 exp = 113u;
  while ((m & 0x0400u) == 0u) {
    m <<= 1;
    --exp;
  }
  return f32_from_bits(sign | (exp << 23) | ((m & 0x03ffu) << 13));
}

/// Converts a float to bfloat16 bits, round to nearest even.
KVQ_HOST_DEVICE u16 f32_to_bf16_bits(float x) {
  const u32 u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x0040u);  // NaN, quieted
  return static_cast<u16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/// Converts bfloat16 bits to the exactly equal float.
KVQ_HOST_DEVICE float bf16_bits_to_f32(u16 b) { return f32_from_bits(static_cast<u32>(b) << 16); }

/// Converts a float to binary16 bits, round to nearest even, saturating to ±65504 instead of
/// overflowing to Inf (NaN stays NaN).
KVQ_HOST_DEVICE u16 f32_to_f16_bits_sat(float x) {
  const u16 h = f32_to_f16_bits(x);
  if ((h & 0x7fffu) == 0x7c00u) return static_cast<u16>((h & 0x8000u) | 0x7bffu);
  return h;
}

/// Converts a float to binary16 bits, round to nearest even, finite values saturating to ±65504
/// (±Inf and NaN are kept): how every cache stores values in the KIVI f16 residual and window.
KVQ_HOST_DEVICE u16 f32_to_f16_bits_satfinite(float x) {
  return is_finite_f32(x) ? f32_to_f16_bits_sat(x) : f32_to_f16_bits(x);
}

}  // namespace detail

/// Rounds a float to the nearest f16 (ties to even).
KVQ_HOST_DEVICE f16 to_f16(float x) {
  f16 r;
  r.bits = detail::f32_to_f16_bits(x);
  return r;
}

/// Rounds a float to the nearest bf16 (ties to even).
KVQ_HOST_DEVICE bf16 to_bf16(float x) {
  bf16 r;
  r.bits = detail::f32_to_bf16_bits(x);
  return r;
}

/// Widens an f16 to float (exact).
KVQ_HOST_DEVICE float to_f32(f16 h) { return detail::f16_bits_to_f32(h.bits); }

/// Widens a bf16 to float (exact).
KVQ_HOST_DEVICE float to_f32(bf16 b) { return detail::bf16_bits_to_f32(b.bits); }

/// Returns the float unchanged (lets generic code call `to_f32` on every element type).
KVQ_HOST_DEVICE float to_f32(float x) { return x; }

KVQ_NAMESPACE_END
