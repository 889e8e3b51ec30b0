// kvq: element math of ggml's MXFP4 and NVFP4 (C++14 subset; C++, CUDA, Metal).
//
// Byte-exact with ggml's quantize_row_mxfp4_ref / quantize_row_nvfp4_ref and their dequantizers
// (FORMATS.md §7; the rules are written out in testvectors/README.md §3), in integer and
// correctly rounded float32 arithmetic only, so every backend computes the same bytes:
//   * element codes (E2M1, ggml's doubled table K = 0, 1, 2, 3, 4, 6, 8, 12 and negatives):
//     scan the 16 codes in order, keep a code only when |K*h - x| (rounded to float32) is strictly
//     smaller than the best so far (h the half-scale): the lowest code wins a tie;
//   * MXFP4 E8M0 exponent: e = floor(log2f(amax)) - 2 + 127 with log2f rounded to float32 first,
//     which rounds up for the last N(k) floats below 2^k; computed from the bits (no log2);
//   * NVFP4 UE4M3 scale of s = amax / 6: ggml_fp32_to_ue4m3 (saturating at 448, round half up,
//     a subnormal branch through s * 512 + 0.5 capped at code 7).
// kvq's own rules where ggml has none: a block (MXFP4) or sub-block (NVFP4) holding a NaN or ±Inf
// stores the scale byte 0xFF (E8M0 NaN) or 0x7F (E4M3 NaN) and codes 0, and decodes to NaN; an
// MXFP4 amax below 2^-125 (where ggml's exponent is undefined) gets e = 0.
#pragma once

#include "numeric.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// E8M0 scale byte of an MXFP4 block holding a NaN or ±Inf.
KVQ_CONSTEXPR_VAR u8 mxfp4_poisoned_scale = 0xffu;
/// UE4M3 scale byte of an NVFP4 sub-block holding a NaN or ±Inf.
KVQ_CONSTEXPR_VAR u8 nvfp4_poisoned_scale = 0x7fu;

/// The NaN a poisoned block decodes to (kvq's canonical quiet NaN).
KVQ_HOST_DEVICE float fp4_nan() { return f32_from_bits(0x7fc00000u); }

/// ggml's doubled E2M1 value of a 4-bit code: K = 0, 1, 2, 3, 4, 6, 8, 12 for codes 0..7, their
/// negatives for codes 8..15.
KVQ_HOST_DEVICE int fp4_doubled_value(int code) {
  const int i = code & 7;
  const int mag = i < 4 ? i : (i < 6 ? 4 + 2 * (i - 4) : 8 + 4 * (i - 6));
  return (code & 8) != 0 ? -mag : mag;
}

/// The code of x for half-scale h (ggml's best_index_mxfp4): the first code of least float32
/// error |K*h - x|.
KVQ_HOST_DEVICE int fp4_code(float x, float h) {
  int best = 0;
  float best_err = abs_f32(add_rn(0.0f, -x));
  for (int i = 1; i < 16; ++i) {
    const float p = mul_rn(static_cast<float>(fp4_doubled_value(i)), h);
    const float err = abs_f32(add_rn(p, -x));
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

#if !defined(__METAL_VERSION__)  // host code only (a Metal pointer parameter needs an address space)
/// fp4_code(x, h) with the 16 candidate values K[i] * h precomputed in `table` (same code).
KVQ_HOST_DEVICE int fp4_code_table(float x, const float* table) {
  int best = 0;
  float best_err = abs_f32(add_rn(0.0f, -x));
  for (int i = 1; i < 16; ++i) {
    const float err = abs_f32(add_rn(table[i], -x));
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}
#endif

/// The value of code c at half-scale h: K[c] * h (exact).
KVQ_HOST_DEVICE float fp4_value(int code, float h) { return mul_rn(static_cast<float>(fp4_doubled_value(code)), h); }

/// How many floats just below 2^k have log2f(x) rounded up to k (testvectors/README.md §3).
KVQ_HOST_DEVICE int mxfp4_log2_roundup(int k) {
  const int a = k > 0 ? k : 1 - k;
  return a <= 2 ? 0 : a <= 4 ? 1 : a <= 8 ? 2 : a <= 16 ? 5 : a <= 32 ? 11 : a <= 64 ? 22 : 44;
}

/// E8M0 exponent byte of an MXFP4 block of finite amax: floor(log2f(amax)) - 2 + 127, 0 for
/// amax = 0 (and for amax < 2^-125).
KVQ_HOST_DEVICE u8 mxfp4_exponent(float amax) {
  const u32 b = f32_bits(amax);
  const int biased = static_cast<int>(b >> 23);
  if (b == 0u || biased == 0) return 0;
  int e = biased - 127;  // floor(log2(amax)), exactly
  const int k = e + 1;
  const u32 next = k >= 128 ? 0x7f800000u : static_cast<u32>(k + 127) << 23;  // bits of 2^k
  if (b + static_cast<u32>(mxfp4_log2_roundup(k)) >= next) e = k;
  const int byte = e - 2 + 127;
  return static_cast<u8>(byte < 0 ? 0 : byte);
}

/// Half of the E8M0 scale 2^(e - 127) (ggml_e8m0_to_fp32_half): 2^(e - 128).
KVQ_HOST_DEVICE float mxfp4_half_scale(u8 e) {
  const u32 bits = e < 2u ? (0x00200000u << e) : (static_cast<u32>(e) - 1u) << 23;
  return f32_from_bits(bits);
}

/// UE4M3 byte of an NVFP4 sub-block scale s = amax / 6 (ggml_fp32_to_ue4m3).
KVQ_HOST_DEVICE u8 nvfp4_scale_code(float s) {
  if (!(s > 0.0f)) return 0;
  if (s > 448.0f) s = 448.0f;
  if (s < 0.015625f) {  // below 2^-6: subnormal codes m * 2^-9, m = trunc(s * 512 + 0.5) capped at 7
    const int m = static_cast<int>(add_rn(mul_rn(s, 512.0f), 0.5f));
    return static_cast<u8>(m > 7 ? 7 : m);
  }
  const u32 b = f32_bits(s);
  int e = static_cast<int>(b >> 23) - 127;
  if (e >= 8) return 0x7e;
  const u32 f = b & 0x007fffffu;
  int m = static_cast<int>(f >> 20) + static_cast<int>((f >> 19) & 1u);  // round half up
  if (m == 8) {
    m = 0;
    ++e;
    if (e == 8) return 0x7e;
  }
  return static_cast<u8>(((e + 7) << 3) | m);
}

/// Half of the UE4M3 scale of byte b (ggml_ue4m3_to_fp32 halved): 0 for 0x00; bit 7 ignored.
/// The NaN byte 0x7F is the caller's (nvfp4_poisoned_scale).
KVQ_HOST_DEVICE float nvfp4_half_scale(u8 b) {
  const u32 ex = (static_cast<u32>(b) >> 3) & 15u;
  const u32 m = static_cast<u32>(b) & 7u;
  if (ex == 0u) return mul_rn(static_cast<float>(m), 0.0009765625f);  // m * 2^-9 / 2
  return f32_from_bits(((ex - 7u + 126u) << 23) | (m << 20));         // (1 + m/8) * 2^(ex-7) / 2
}

}  // namespace detail
KVQ_NAMESPACE_END
