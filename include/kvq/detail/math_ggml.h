// kvq: element math of ggml's q8_0 and q4_0 (C++14 subset; C++, CUDA, Metal).
//
// Byte-exact with ggml's quantize_row_q{8,4}_0_ref for every finite input where the reference is
// defined. kvq's own rules where it is not:
//   * a block holding a NaN or ±Inf is "poisoned": d is stored as the fp16 quiet NaN 0x7e00 and
//     every code is neutral (q8_0: 0, q4_0: 8), so the whole block decodes to NaN;
//   * when 1/d overflows (tiny but non-zero amax, where the fp16 d is 0 anyway) every code is
//     neutral, so the block decodes to ±0 exactly as the stored d says.
#pragma once

#include "numeric.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// fp16 bits stored as d of a poisoned (NaN/Inf-holding) block.
KVQ_CONSTEXPR_VAR u16 poisoned_f16_scale = 0x7e00u;

/// Returns 1/d in float, or 0 when d is 0 or 1/d is not finite.
KVQ_HOST_DEVICE float ggml_inverse_scale(float d) {
  if (d == 0.0f) return 0.0f;
  const float id = div_rn(1.0f, d);
  return is_finite_f32(id) ? id : 0.0f;
}

/// q8_0 scale from the block's amax: d = amax / 127.
KVQ_HOST_DEVICE float q8_0_scale(float amax) { return div_rn(amax, 127.0f); }

/// q8_0 code of x: roundf(x * id), ties away from zero.
KVQ_HOST_DEVICE int q8_0_code(float x, float id) { return static_cast<int>(round_half_away(mul_rn(x, id))); }

/// q4_0 scale from the signed element of largest magnitude: d = max / -8.
KVQ_HOST_DEVICE float q4_0_scale(float signed_max) { return div_rn(signed_max, -8.0f); }

/// q4_0 code of x: min(15, trunc(fl32(x * id) + 8.5)), so code-domain ties round up.
KVQ_HOST_DEVICE int q4_0_code(float x, float id) {
  const float t = add_rn(mul_rn(x, id), 8.5f);
  const int c = static_cast<int>(t);  // t >= 0.5 for every finite x of the block: truncation is floor
  return c < 15 ? c : 15;
}

/// Decoded value of a q8_0 code: code * d.
KVQ_HOST_DEVICE float q8_0_value(int code, float d) { return static_cast<float>(code) * d; }

/// Decoded value of a q4_0 nibble: (nibble - 8) * d.
KVQ_HOST_DEVICE float q4_0_value(int nibble, float d) { return static_cast<float>(nibble - 8) * d; }

}  // namespace detail
KVQ_NAMESPACE_END
