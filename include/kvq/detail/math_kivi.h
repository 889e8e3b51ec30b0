// kvq: element math of the KIVI codecs (C++14 subset; C++, CUDA, Metal).
//
// kvq's KIVI numerics (FORMATS.md §4), identical on every backend; b is the bit width:
//   * Per group: mn = min, mx = max over the group's finite real elements in fp32 (padding lanes
//     take no part); scale = div_rn(mx - mn, 2^b - 1) in fp32; stored scale_h =
//     f32_to_f16_bits_sat(scale), min_h = f32_to_f16_bits_sat(mn) (saturating fp16, so the
//     parameters are never Inf: a group minimum below -65504 is clipped to -65504 and a range
//     wider than (2^b - 1) * 65504 to that width, so values with |x| beyond 65504 are clipped).
//     A zero mn or mx of either sign counts as +0, so the stored bytes never depend on scan order.
//   * Codes use the stored (fp16-rounded) parameters s = f16->f32(scale_h), m = f16->f32(min_h):
//     q = clamp(round_half_even(div_rn(x - m, s)), 0, 2^b - 1): a true division with ties to even
//     (as torch.round); the quotient is clamped to [0, 2^b - 1] before rounding (as KIVI: clamp
//     then round). If s == 0 (constant group or scale underflow) every code is 0, so a constant
//     group decodes to its fp16-rounded value, never NaN.
//   * Decode: x^ = add_rn(mul_rn((float)q, s), m) (explicit rounding, never an FMA).
//   * A group holding a NaN or ±Inf is poisoned: scale_h = min_h = 0x7e00 (fp16 NaN), codes 0, so
//     it decodes to NaN.
//   * Packing: codes LSB-first: element i of a packed run sits at bits [b*i, b*i + b) of the
//     little-endian byte stream (equivalent to KIVI's int32 words, little-endian). With b in
//     {2, 4, 8} a code never straddles two bytes.
#pragma once

#include "numeric.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// fp16 bits stored as both the scale and the minimum of a poisoned (NaN/Inf-holding) KIVI group.
KVQ_CONSTEXPR_VAR u16 kivi_poisoned_param = 0x7e00u;

/// The two stored parameters of one KIVI group, as fp16 bits.
struct kivi_header {
  u16 scale;
  u16 min;
};

/// Running minimum, maximum and finiteness of a group's real elements.
struct kivi_range {
  float mn;
  float mx;
  bool finite;
};

/// Largest code of a b-bit KIVI group: 2^b - 1.
KVQ_HOST_DEVICE int kivi_max_code(int bits) { return (1 << bits) - 1; }

/// The range of an empty group: mn = +Inf, mx = -Inf, finite.
KVQ_HOST_DEVICE kivi_range kivi_range_empty() {
  kivi_range r;
  r.mn = f32_from_bits(0x7f800000u);
  r.mx = f32_from_bits(0xff800000u);
  r.finite = true;
  return r;
}

/// Adds one real element to a group's range; a NaN or ±Inf only clears `finite`.
KVQ_HOST_DEVICE kivi_range kivi_range_add(kivi_range r, float x) {
  if (!is_finite_f32(x)) {
    r.finite = false;
    return r;
  }
  r.mn = x < r.mn ? x : r.mn;
  r.mx = x > r.mx ? x : r.mx;
  return r;
}

/// Returns x, with -0 replaced by +0.
KVQ_HOST_DEVICE float kivi_plus_zero(float x) { return (f32_bits(x) & 0x7fffffffu) == 0u ? 0.0f : x; }

/// Stored parameters of a group with at least one real element: fp16(sat) of (mx - mn)/(2^b - 1) and mn.
KVQ_HOST_DEVICE kivi_header kivi_make_header(kivi_range r, int bits) {
  kivi_header h;
  if (!r.finite) {
    h.scale = kivi_poisoned_param;
    h.min = kivi_poisoned_param;
    return h;
  }
  const float mn = kivi_plus_zero(r.mn);
  const float mx = kivi_plus_zero(r.mx);
  const float scale = div_rn(mx - mn, static_cast<float>(kivi_max_code(bits)));
  h.scale = f32_to_f16_bits_sat(scale);
  h.min = f32_to_f16_bits_sat(mn);
  return h;
}

/// True when the header marks a poisoned group.
KVQ_HOST_DEVICE bool kivi_is_poisoned(kivi_header h) { return is_nan_f32(f16_bits_to_f32(h.scale)); }

/// Code of a finite x for stored parameters s = f16->f32(scale_h) and m = f16->f32(min_h):
/// clamp(round_half_even(div_rn(x - m, s)), 0, 2^b - 1), or 0 when s == 0.
KVQ_HOST_DEVICE int kivi_code(float x, float s, float m, int bits) {
  if (!(s > 0.0f)) return 0;  // s == 0, or a poisoned (NaN) scale
  const float top = static_cast<float>(kivi_max_code(bits));
  float t = div_rn(x - m, s);
  t = t > top ? top : (t < 0.0f ? 0.0f : t);
  return static_cast<int>(round_half_even(t));
}

/// Decoded value of a code: add_rn(mul_rn(q, s), m).
KVQ_HOST_DEVICE float kivi_value(int q, float s, float m) { return add_rn(mul_rn(static_cast<float>(q), s), m); }

/// Index of the byte holding element i of a packed b-bit run.
KVQ_HOST_DEVICE int kivi_code_byte(int i, int bits) { return (i * bits) >> 3; }

/// Bit offset of element i of a packed b-bit run inside its byte.
KVQ_HOST_DEVICE int kivi_code_shift(int i, int bits) { return (i * bits) & 7; }

/// Extracts element i of a packed b-bit run from the byte that holds it.
KVQ_HOST_DEVICE int kivi_unpack(u8 byte, int i, int bits) {
  return (static_cast<int>(byte) >> kivi_code_shift(i, bits)) & kivi_max_code(bits);
}

/// Returns `byte` with element i's code (0 .. 2^b - 1) OR-ed into its bits.
KVQ_HOST_DEVICE u8 kivi_pack(u8 byte, int code, int i, int bits) {
  return static_cast<u8>(static_cast<int>(byte) | (code << kivi_code_shift(i, bits)));
}

}  // namespace detail
KVQ_NAMESPACE_END
