// kvq: AArch64 NEON codec kernels, kvq::cpu_kernels::neon.
//
// Compiled on AArch64 with NEON (always there); otherwise this header defines nothing. The kernels
// are simd_codecs.hpp over the 4-lane policy below and reproduce the scalar reference bit for bit,
// given the default FPCR (round to nearest, no flush-to-zero, no default-NaN mode), which the f16
// conversions FCVTN/FCVTL and the float arithmetic use.
#pragma once

#include "../../detail/config.h"

#if defined(__aarch64__) && defined(__ARM_NEON)

// The intrinsics of clang's headers are plain vector operators: parsed here with precise floating point,
// they keep kvq's results whatever -funsafe-math-optimizations a consumer passes (config.h).
KVQ_FP_PRECISE_BEGIN
#  include <arm_neon.h>
KVQ_FP_PRECISE_END

#  include <cstddef>
#  include <cstdint>
#  include <cstring>
#  include <string_view>

#  include "attention_kernels.hpp"
#  include "simd_codecs.hpp"

#  define KVQ_CPU_HAS_NEON 1

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels::neon {

/// The name of this instruction set, as reported by simd_level().
inline constexpr std::string_view name = "neon";

/// The 4-lane NEON vector policy of simd_codecs.
struct ops {
  static constexpr int W = 4;
  using vf = float32x4_t;
  using vi = int32x4_t;
  using vm = uint32x4_t;  // all-ones lanes

  // Float lanes.
  static vf load(float const* p) noexcept { return vld1q_f32(p); }
  static void store(float* p, vf v) noexcept { vst1q_f32(p, v); }
  static vf set1(float x) noexcept { return vdupq_n_f32(x); }
  static vf add(vf a, vf b) noexcept { return vaddq_f32(a, b); }
  /// lo = a0 b0 a1 b1, hi = a2 b2 a3 b3.
  static void interleave(vf a, vf b, vf& lo, vf& hi) noexcept {
    lo = vzip1q_f32(a, b);
    hi = vzip2q_f32(a, b);
  }
  static vf sub(vf a, vf b) noexcept { return vsubq_f32(a, b); }
  /// fl(a * b), never contracted with a later addition into an FMLA.
  static vf mul(vf a, vf b) noexcept {
    vf r = vmulq_f32(a, b);
#  if defined(__GNUC__)
    __asm__("" : "+w"(r));
#  endif
    return r;
  }
  static vf div(vf a, vf b) noexcept { return vdivq_f32(a, b); }
  static vf min(vf a, vf b) noexcept { return vminq_f32(a, b); }
  static vf max(vf a, vf b) noexcept { return vmaxq_f32(a, b); }
  static vf abs(vf a) noexcept { return vabsq_f32(a); }
  /// Round to nearest, ties to even (FCVTNS: FPCR.RMode is not consulted).
  static vi cvt_rne(vf a) noexcept { return vcvtnq_s32_f32(a); }
  static vi cvtt(vf a) noexcept { return vcvtq_s32_f32(a); }
  static vf cvt_f(vi a) noexcept { return vcvtq_f32_s32(a); }
  static vi bits(vf a) noexcept { return vreinterpretq_s32_f32(a); }
  static vf from_bits(vi a) noexcept { return vreinterpretq_f32_s32(a); }
  static float reduce_max(vf v) noexcept { return vmaxvq_f32(v); }
  static float reduce_min(vf v) noexcept { return vminvq_f32(v); }
  static vm ge_f(vf a, vf b) noexcept { return vcgeq_f32(a, b); }
  static vm le_f(vf a, vf b) noexcept { return vcleq_f32(a, b); }
  static vm gt_f(vf a, vf b) noexcept { return vcgtq_f32(a, b); }
  static vm eq_f(vf a, vf b) noexcept { return vceqq_f32(a, b); }
  static vf select_f(vm m, vf a, vf b) noexcept { return vbslq_f32(m, a, b); }

  // Integer lanes.
  static vi load_i(std::int32_t const* p) noexcept { return vld1q_s32(p); }
  static void store_i(std::int32_t* p, vi v) noexcept { vst1q_s32(p, v); }
  static vi set1_i(std::int32_t x) noexcept { return vdupq_n_s32(x); }
  static vi and_i(vi a, vi b) noexcept { return vandq_s32(a, b); }
  static vi or_i(vi a, vi b) noexcept { return vorrq_s32(a, b); }
  static vi xor_i(vi a, vi b) noexcept { return veorq_s32(a, b); }
  static vi add_i(vi a, vi b) noexcept { return vaddq_s32(a, b); }
  static vi sub_i(vi a, vi b) noexcept { return vsubq_s32(a, b); }
  static vi min_i(vi a, vi b) noexcept { return vminq_s32(a, b); }
  static vi max_i(vi a, vi b) noexcept { return vmaxq_s32(a, b); }
  template <int K>
  static vi srli(vi a) noexcept {
    return vreinterpretq_s32_u32(vshrq_n_u32(vreinterpretq_u32_s32(a), K));
  }
  template <int K>
  static vi slli(vi a) noexcept {
    return vshlq_n_s32(a, K);
  }
  static vi srl_n(vi a, int k) noexcept {
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-k)));
  }
  static vi sll_n(vi a, int k) noexcept {
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(k)));
  }
  static vm gt_i(vi a, vi b) noexcept { return vcgtq_s32(a, b); }
  static vm eq_i(vi a, vi b) noexcept { return vceqq_s32(a, b); }
  static vi select_i(vm m, vi a, vi b) noexcept { return vbslq_s32(m, a, b); }

  // Masks.
  static vm mask_false() noexcept { return vdupq_n_u32(0); }
  static vm mask_or(vm a, vm b) noexcept { return vorrq_u32(a, b); }
  static bool any(vm m) noexcept { return vmaxvq_u32(m) != 0; }
  /// Bit l set when lane l is.
  static unsigned mask_bits(vm m) noexcept {
    static constexpr std::uint32_t bit[4] = {1, 2, 4, 8};
    return vaddvq_u32(vandq_u32(m, vld1q_u32(bit)));
  }
  static vm lanes_below(int n) noexcept {
    static constexpr std::int32_t lane[4] = {0, 1, 2, 3};
    return vcgtq_s32(vdupq_n_s32(n), vld1q_s32(lane));
  }

  // Narrow and wide memory.
  static uint8x8_t load_4_bytes(std::uint8_t const* p) noexcept {
    std::uint32_t w;
    std::memcpy(&w, p, 4);
    return vreinterpret_u8_u32(vdup_n_u32(w));
  }
  static vi load_u8(std::uint8_t const* p) noexcept {
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(load_4_bytes(p)))));
  }
  static vi load_i8(std::uint8_t const* p) noexcept {
    return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(load_4_bytes(p)))));
  }
  static void store_u8(std::uint8_t* p, vi v) noexcept {
    uint16x4_t const h = vmovn_u32(vreinterpretq_u32_s32(v));
    uint8x8_t const b = vmovn_u16(vcombine_u16(h, h));
    std::uint32_t const w = vget_lane_u32(vreinterpret_u32_u8(b), 0);
    std::memcpy(p, &w, 4);
  }
  static vi load_u16(std::uint16_t const* p) noexcept { return vreinterpretq_s32_u32(vmovl_u16(vld1_u16(p))); }
  static void store_u16(std::uint16_t* p, vi v) noexcept { vst1_u16(p, vmovn_u32(vreinterpretq_u32_s32(v))); }

  // f16 (FCVTN/FCVTL): RNE with NaN quieted, top payload kept — numeric.h's f32_to_f16_bits.
  static void f16_store_hw(std::uint16_t* p, vf v) noexcept { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v))); }
  static vi f32_to_f16_hw(vf v) noexcept {
    return vreinterpretq_s32_u32(vmovl_u16(vreinterpret_u16_f16(vcvt_f16_f32(v))));
  }
  /// Exact except that signalling NaNs come back quieted (simd_codecs repairs them).
  static vf f16_load_hw(std::uint16_t const* p) noexcept { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  /// The f16 in the low 16 bits of each lane, as f32 (hardware conversion).
  static vf f16_low_hw(vi x) noexcept {
    return vcvt_f32_f16(vreinterpret_f16_u16(vmovn_u32(vreinterpretq_u32_s32(x))));
  }

  // fp8 through the f16 conversion: an E5M2 code is the high byte of the f16 of its value; an E4M3
  // code's magnitude shifted into an f16's exponent and mantissa fields is its value times 2^-8.
  /// The values of the W E5M2 codes at p (exact; NaN payloads aside).
  static vf e5m2_load_hw(std::uint8_t const* p) noexcept {
    return vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(vshll_n_u8(load_4_bytes(p), 8))));
  }
  /// The values times 2^-8 of the W E4M3 codes at p, none of them NaN (exact).
  static vf e4m3_load_hw_scaled(std::uint8_t const* p) noexcept {
    int16x4_t const w = vget_low_s16(vmovl_s8(vreinterpret_s8_u8(load_4_bytes(p))));
    uint16x4_t const h = vand_u16(vreinterpret_u16_s16(vshl_n_s16(w, 7)), vdup_n_u16(0xbf80));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
  }
  /// True when one of the n bytes at p has a magnitude (low 7 bits) above `limit` (< 0x7f): an
  /// fp8 NaN code for limit 0x7e (E4M3) or 0x7c (E5M2).
  static bool any_magnitude_above(std::uint8_t const* p, std::size_t n, std::uint8_t limit) noexcept {
    uint8x16_t hit = vdupq_n_u8(0);
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16)
      hit = vorrq_u8(hit, vcgtq_u8(vandq_u8(vld1q_u8(p + i), vdupq_n_u8(0x7f)), vdupq_n_u8(limit)));
    bool any = vmaxvq_u8(hit) != 0;
    for (; i < n; ++i) any = any || (p[i] & 0x7f) > limit;
    return any;
  }

  // Packed b-bit codes, LSB first: 4 codes -> B / 2 bytes.
  template <int B>
  static void store_codes(std::uint8_t* p, vi q) noexcept {
    if constexpr (B == 8) {
      store_u8(p, q);
    } else {
      static constexpr std::int32_t shift[4] = {0, B, 2 * B, 3 * B};
      std::uint32_t const w = vaddvq_u32(vshlq_u32(vreinterpretq_u32_s32(q), vld1q_s32(shift)));
      if constexpr (B == 4) {
        std::uint16_t const h = static_cast<std::uint16_t>(w);
        std::memcpy(p, &h, 2);
      } else {
        *p = static_cast<std::uint8_t>(w);
      }
    }
  }
  /// 4 codes of B bits from B / 2 bytes at p.
  template <int B>
  static vi load_codes(std::uint8_t const* p) noexcept {
    if constexpr (B == 8) {
      return load_u8(p);
    } else {
      std::uint32_t w = 0;
      std::memcpy(&w, p, B / 2);
      static constexpr std::int32_t shift[4] = {0, -B, -2 * B, -3 * B};
      uint32x4_t const v = vshlq_u32(vdupq_n_u32(w), vld1q_s32(shift));
      return vreinterpretq_s32_u32(vandq_u32(v, vdupq_n_u32((1u << B) - 1u)));
    }
  }
  /// Lane l = the 4 bytes at base + l * stride.
  static vi gather_u32(std::uint8_t const* base, int stride) noexcept {
    std::int32_t w[4];
    for (int l = 0; l < 4; ++l) std::memcpy(&w[l], base + l * stride, 4);
    return vld1q_s32(w);
  }

  // Rotation (FORMATS.md §6.1): one butterfly stage of stride H < W inside the vector, and signs.
  /// Lane l with (l & H) == 0: v[l] + v[l + H]; other lanes: v[l - H] - v[l] (each one rounding).
  template <int H>
  static vf butterfly(vf v) noexcept {
    if constexpr (H == 1) {
      vf const p = vrev64q_f32(v);
      return vtrn1q_f32(vaddq_f32(v, p), vsubq_f32(v, p));
    } else {
      float32x2_t const lo = vget_low_f32(v), hi = vget_high_f32(v);
      return vcombine_f32(vadd_f32(lo, hi), vsub_f32(lo, hi));
    }
  }
  /// v with the sign of lane l flipped where bit l of `bits` is set.
  static vf flip_signs(vf v, std::uint64_t bits) noexcept {
    static constexpr std::uint32_t lane_bit[4] = {1, 2, 4, 8};
    uint32x4_t const m = vtstq_u32(vdupq_n_u32(static_cast<std::uint32_t>(bits & 0xfu)), vld1q_u32(lane_bit));
    return vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(v), vandq_u32(m, vdupq_n_u32(0x80000000u))));
  }

  // Codebooks (tq): a table of 16 floats as 64 bytes, looked up by byte (TBL).
  using table16 = uint8x16x4_t;
  static table16 make_table16(float const* t) noexcept { return vld1q_u8_x4(reinterpret_cast<std::uint8_t const*>(t)); }
  /// Lane l = t[idx_l mod 2^B], for a table with t[i] = t[i mod 2^B] (bits of idx above B ignored).
  template <int B>
  static vf lookup(table16 const& t, vi idx) noexcept {
    uint32x4_t const code = vandq_u32(vreinterpretq_u32_s32(idx), vdupq_n_u32((1u << B) - 1u));
    // Byte k of lane l: 4 code + k.
    uint8x16_t const at = vreinterpretq_u8_u32(vmlaq_u32(vdupq_n_u32(0x03020100u), code, vdupq_n_u32(0x04040404u)));
    uint8x16_t r;
    if constexpr (B == 2) {
      r = vqtbl1q_u8(t.val[0], at);
    } else if constexpr (B == 3) {
      uint8x16x2_t const t2 = {{t.val[0], t.val[1]}};
      r = vqtbl2q_u8(t2, at);
    } else {
      r = vqtbl4q_u8(t, at);
    }
    return vreinterpretq_f32_u8(r);
  }
  /// lookup for a table symmetric about its middle (t[2^B - 1 - i] = -t[i], as the tq codebooks).
  template <int B>
  static vf lookup_symmetric(table16 const& t, vi idx) noexcept {
    return lookup<B>(t, idx);
  }
  /// The table whose lookup_symmetric<B> gives t[i] * g (each product rounded once; NaN signs aside).
  template <int B>
  static table16 scale_symmetric(table16 const& t, vf g) noexcept {
    table16 r = t;
    for (int k = 0; k < (1 << B) / 4; ++k)
      r.val[k] = vreinterpretq_u8_f32(vmulq_f32(vreinterpretq_f32_u8(t.val[k]), g));
    return r;
  }
  /// The B-bit codes of coordinates c .. c + 3 (c a multiple of 4) of an LSB-first bit stream at
  /// `codes`, in the low B bits of the lanes (the bits above are not cleared). Reads only the bytes
  /// holding them.
  template <int B>
  static vi stream_codes(std::uint8_t const* codes, int c) noexcept {
    int const bit = B * c;
    std::uint32_t w = 0;
    std::memcpy(&w, codes + bit / 8, static_cast<std::size_t>((B * 4 + bit % 8 + 7) / 8));
    static constexpr std::int32_t shift[4] = {0, -B, -2 * B, -3 * B};
    return vreinterpretq_s32_u32(vshlq_u32(vdupq_n_u32(w >> (bit % 8)), vld1q_s32(shift)));
  }

  // Attention (attention_kernels.hpp): compared with the reference within a tolerance, so
  // contraction is allowed here.
  static vf fma(vf a, vf b, vf c) noexcept { return vfmaq_f32(c, a, b); }
  static vf mul_c(vf a, vf b) noexcept { return vmulq_f32(a, b); }
  static float reduce_add(vf v) noexcept { return vaddvq_f32(v); }
  /// Lane i = the sum of the lanes of v[i] (pairwise adds).
  static vf reduce_lanes(vf const* v) noexcept { return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])); }
  /// Lane i = the largest lane of v[i] (signed; pairwise maxima).
  static vi max_lanes_i(vi const* v) noexcept { return vpmaxq_s32(vpmaxq_s32(v[0], v[1]), vpmaxq_s32(v[2], v[3])); }
  /// f16 bits to float (FCVT; NaN payloads are not preserved exactly).
  static float f16_scalar_hw(std::uint16_t h) noexcept {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
  }
  /// Each lane rounded to f16 and back (RNE).
  static vf round_f16(vf v) noexcept { return vcvt_f32_f16(vcvt_f16_f32(v)); }
  /// Exact sum of a[j] * b[j] over 32 signed bytes (16-bit products, pairwise-added into 32 bits).
  static std::int32_t dot_s8x32(std::int8_t const* a, std::int8_t const* b) noexcept {
    int32x4_t acc = vdupq_n_s32(0);
    for (int h = 0; h < 32; h += 16) {
      int8x16_t const va = vld1q_s8(a + h), vb = vld1q_s8(b + h);
      acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(va), vget_low_s8(vb)));
      acc = vpadalq_s16(acc, vmull_high_s8(va, vb));
    }
    return vaddvq_s32(acc);
  }
  // Batched integer block dots (attention_kernels.hpp integer_logits): lane j of out[h] is one
  // token's dot with query head h's 32 codes q[h], exact.

  /// Four 32-bit partial sums of a . b over 16 signed bytes, added to acc.
  static int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) noexcept {
#  if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#  else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#  endif
  }
  /// Lane j: sum over i < 32 of nibble i * q[h][i], the 32 unsigned nibbles of the 16 bytes at
  /// rows[j] + off (low nibbles are codes 0-15, high nibbles 16-31), for W tokens.
  template <int NH>
  static void nibble_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                          vi* out) noexcept {
    int32x4_t acc[std::size_t{NH}][4];
    for (int j = 0; j < 4; ++j) {
      uint8x16_t const x = vld1q_u8(rows[j] + off);
      int8x16_t const lo = vreinterpretq_s8_u8(vandq_u8(x, vdupq_n_u8(15)));
      int8x16_t const hi = vreinterpretq_s8_u8(vshrq_n_u8(x, 4));
      for (int h = 0; h < NH; ++h)
        acc[h][j] = dot16(dot16(vdupq_n_s32(0), lo, vld1q_s8(q[h])), hi, vld1q_s8(q[h] + 16));
    }
    for (int h = 0; h < NH; ++h)
      out[h] = vpaddq_s32(vpaddq_s32(acc[h][0], acc[h][1]), vpaddq_s32(acc[h][2], acc[h][3]));
  }
  /// Lane j: sum over i < 32 of code i * q[h][i], the 32 signed codes at rows[j] + off, for W
  /// tokens.
  template <int NH>
  static void byte_dots(std::uint8_t const* const* rows, std::size_t off, std::int8_t const* const* q,
                        vi* out) noexcept {
    int32x4_t acc[std::size_t{NH}][4];
    for (int j = 0; j < 4; ++j) {
      int8x16_t const a0 = vld1q_s8(reinterpret_cast<std::int8_t const*>(rows[j] + off));
      int8x16_t const a1 = vld1q_s8(reinterpret_cast<std::int8_t const*>(rows[j] + off + 16));
      for (int h = 0; h < NH; ++h)
        acc[h][j] = dot16(dot16(vdupq_n_s32(0), a0, vld1q_s8(q[h])), a1, vld1q_s8(q[h] + 16));
    }
    for (int h = 0; h < NH; ++h)
      out[h] = vpaddq_s32(vpaddq_s32(acc[h][0], acc[h][1]), vpaddq_s32(acc[h][2], acc[h][3]));
  }
  /// No byte-dot kernels for integer P·V here: attention_kernels.hpp sums the codes in scalar code.
  static constexpr bool integer_value_dots = false;
};

KVQ_CPU_DEFINE_ENTRY_POINTS(ops)
KVQ_CPU_DEFINE_ATTENTION(ops)

}  // namespace cpu_kernels::neon
KVQ_NAMESPACE_END

#endif  // AArch64 NEON
