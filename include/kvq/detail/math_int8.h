// kvq: element math of the int8 symmetric per-(token, head) codec (C++14 subset).
//
// kvq's choices for FORMATS.md §2, identical on every backend:
//   scale = amax / 127 in fp32, stored as fp32 (no fp16 rounding);
//   q = clamp(round_half_even(x / scale), -127, 127): a true division (no reciprocal), ties to
//       even (what SIMD conversions do), so -128 is never produced and the grid is symmetric;
//   amax == 0 -> scale 0 and every code 0;
//   a row holding NaN or ±Inf stores scale = NaN and codes 0, so it decodes entirely to NaN.
#pragma once

#include "config.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Bits of the fp32 quiet NaN stored as the scale of a poisoned int8 row.
KVQ_CONSTEXPR_VAR u32 int8_poisoned_scale_bits = 0x7fc00000u;

/// int8 scale from the row's amax: amax / 127.
KVQ_HOST_DEVICE float int8_scale(float amax) { return div_rn(amax, 127.0f); }

/// int8 code of x for a non-zero finite scale: clamp(rne(x / scale), -127, 127).
KVQ_HOST_DEVICE int int8_code(float x, float scale) {
  float q = div_rn(x, scale);
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int>(round_half_even(q));
}

/// Decoded value of an int8 code: q * scale.
KVQ_HOST_DEVICE float int8_value(int q, float scale) { return static_cast<float>(q) * scale; }

}  // namespace detail
KVQ_NAMESPACE_END
