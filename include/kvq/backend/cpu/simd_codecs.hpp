// kvq: the CPU codec kernels, written once over a vector-operations policy `V` (one per ISA).
//
// avx2.hpp, avx512.hpp and neon.hpp each define a policy (`ops`: lane count W, float/int/mask
// vector types and a few dozen static functions) and instantiate `simd_codecs<ops>` in their own
// namespace. Every kernel here reproduces the scalar reference bit for bit:
//   * the element math is the one of detail/math_*.h, step by step, with the same rounding steps:
//     every product that feeds an addition goes through V::mul, which is opaque to the compiler,
//     so no FMA contraction can happen whatever -ffp-contract says;
//   * float -> int conversions use explicit rounding (V::cvt_rne: ties to even, V::cvtt: toward
//     zero), never the current rounding mode; q8_0's roundf (ties away) is built from cvtt;
//   * block scales and fp16 headers are computed for W blocks at a time, one block per lane, with
//     the reference's operations (correctly rounded division, RNE fp16 conversion); the
//     remaining scalar steps call the reference functions themselves;
//   * partial vectors (head_dim not a multiple of W, padding of blocks) go through zero-padded or
//     duplicate-padded temporaries, so no load or store ever leaves the caller's buffers.
// The policy's f32 -> f16 conversion must be RNE with NaN quieted keeping the top payload bits
// (F16C and AArch64 FCVTN are: checked over all 2^32 inputs by the exhaustive test); its
// f16 -> f32 conversion may quiet signalling NaNs, which f16_fix_nan repairs (numeric.h keeps
// them).
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "../../codec/fp4.hpp"
#include "../../codec/fp8.hpp"
#include "../../codec/int8.hpp"
#include "../../codec/kivi.hpp"
#include "../../codec/passthrough.hpp"
#include "../../codec/q4_0.hpp"
#include "../../codec/q8_0.hpp"
#include "../../codec/tq_codebook.hpp"
#include "../../detail/rotation.h"
#include "scalar.hpp"

// A kernel step kept out of line where inlining it measured slower.
#if !defined(KVQ_CPU_NOINLINE)
#  if defined(__GNUC__)
#    define KVQ_CPU_NOINLINE __attribute__((noinline))
#  else
#    define KVQ_CPU_NOINLINE
#  endif
#endif

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels {
namespace simd {

/// Calls f.template operator()<I>() for I = 0, 1, ..., N - 1 in that order, unrolled at compile
/// time whatever the optimisation level (so that arrays of vectors indexed by I stay in registers).
template <int N, class F>
KVQ_CPU_ALWAYS_INLINE inline void static_for(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) KVQ_CPU_ALWAYS_INLINE { (f.template operator()<I>(), ...); }
  (std::make_integer_sequence<int, N>{});
}

/// Prefetches, for reading, the cache line `bytes` bytes from p; the address may lie outside any
/// object (no pointer is formed and a prefetch never faults).
KVQ_CPU_ALWAYS_INLINE inline void prefetch_at(void const* p, std::ptrdiff_t bytes) noexcept {
#if defined(__GNUC__)
  __builtin_prefetch(
      reinterpret_cast<void const*>(reinterpret_cast<std::uintptr_t>(p) + static_cast<std::uintptr_t>(bytes)), 0, 3);
#else
  (void)p;
  (void)bytes;
#endif
}

/// The rows an encode streams ahead of the one it codes: prefetch_ahead(p, n, xs) fetches the
/// lines of the n floats at p, rows_ahead rows of stride xs further on.
inline constexpr std::int64_t rows_ahead = 8;
KVQ_CPU_ALWAYS_INLINE inline void prefetch_ahead(float const* p, int n, std::ptrdiff_t xs) noexcept {
  std::ptrdiff_t const ahead = rows_ahead * xs * std::ptrdiff_t{sizeof(float)};
  for (int i = 0; i < n; i += 16) prefetch_at(p + i, ahead);
}

/// Recognises kivi_value<Bits, G>.
template <class C>
struct kivi_value_traits : std::false_type {};
template <int Bits, int G>
struct kivi_value_traits<kivi_value<Bits, G>> : std::true_type {};

/// Recognises kivi_key<Bits, G>.
template <class C>
struct kivi_key_traits : std::false_type {};
template <int Bits, int G>
struct kivi_key_traits<kivi_key<Bits, G>> : std::true_type {};

/// Recognises detail::tq_codebook<B>.
template <class C>
struct tq_codebook_traits : std::false_type {};
template <int B>
struct tq_codebook_traits<detail::tq_codebook<B>> : std::true_type {};

/// Codec kernels over the vector policy V.
template <class V>
struct simd_codecs {
  using vf = typename V::vf;
  using vi = typename V::vi;
  using vm = typename V::vm;
  using u8 = std::uint8_t;
  using u16 = std::uint16_t;
  static constexpr int W = V::W;

  // ---------------------------------------------------------------------------------------------
  // Helpers

  /// Loads n (may be <= 0) floats of p into the low lanes; the other lanes hold `fill`.
  static vf load_pad(float const* p, int n, float fill) noexcept {
    alignas(64) float t[std::size_t{W}];
    for (int i = 0; i < W; ++i) t[i] = i < n ? p[i] : fill;
    return V::load(t);
  }

  /// Stores the low n (1 .. W) lanes of v to p.
  static void store_part(float* p, vf v, int n) noexcept {
    alignas(64) float t[std::size_t{W}];
    V::store(t, v);
    // Clamped so that the copy is visibly within t whatever the compiler can prove about n.
    int const m = n < W ? n : W;
    for (int i = 0; i < m; ++i) p[i] = t[i];
  }

  /// Codes rows x + r * xs (hd floats each; units of `per` floats, each coded into `bytes` bytes at
  /// dst + r * ds + unit * bytes) in batches of W consecutive units, batch(bx, bd) coding unit j of a
  /// batch from bx[j] into bd[j], when a row holds a power of two of whole units (so that a batch,
  /// W being one too, covers whole rows or lies inside one); then advances x, dst and rows past the
  /// rows done, leaving the rest (all rows when the layout does not fit) to the caller's general
  /// loop. Its pointers come from offsets fixed for the call, without the general loops' per-unit
  /// pointer work and branches (q4_0 / q8_0 encode in cache measured 1.2-1.4x faster with AVX-512,
  /// 1.15x with AVX2), and it divides nothing: a call may hold one token's rows only.
  template <class Batch>
  KVQ_CPU_ALWAYS_INLINE static void uniform_batches(float const*& x, std::ptrdiff_t xs, std::int64_t& rows, int hd,
                                                    int per, u8*& dst, std::size_t ds, std::size_t bytes,
                                                    Batch&& batch) noexcept {
    int const nu = hd / per;  // units in a row
    if (hd % per != 0 || nu <= 0 || !std::has_single_bit(static_cast<unsigned>(nu))) return;
    int const shift = std::countr_zero(static_cast<unsigned>(nu < W ? nu : W));
    int const step = 1 << shift;  // units of a row in a batch
    int const span = W >> shift;  // rows a batch covers
    std::ptrdiff_t x_off[std::size_t{W}];
    std::size_t d_off[std::size_t{W}];
    for (int j = 0; j < W; ++j) {
      int const row = j >> shift, unit = j & (step - 1);
      x_off[j] = row * xs + unit * per;
      d_off[j] = static_cast<std::size_t>(row) * ds + static_cast<std::size_t>(unit) * bytes;
    }
    float const* bx[std::size_t{W}];
    u8* bd[std::size_t{W}];
    std::int64_t r = 0;
    for (; r + span <= rows; r += span)
      for (int u0 = 0; u0 < nu; u0 += step) {
        float const* const x0 = x + r * xs + u0 * per;
        u8* const d0 = dst + static_cast<std::size_t>(r) * ds + static_cast<std::size_t>(u0) * bytes;
        for (int j = 0; j < W; ++j) {
          bx[j] = x0 + x_off[j];
          bd[j] = d0 + d_off[j];
        }
        for (int k = 0; k < span; ++k)
          if (r + k + rows_ahead < rows) prefetch_ahead(x0 + k * xs, step * per, xs);
        batch(bx, bd);
      }
    x += r * xs;
    dst += static_cast<std::size_t>(r) * ds;
    rows -= r;
  }

  /// Lanes holding a NaN or an infinity (exponent all ones).
  static vm nonfinite(vf v) noexcept {
    vi const e = V::set1_i(0x7f800000);
    return V::eq_i(V::and_i(V::bits(v), e), e);
  }

  /// Exact f16 -> f32 of the f16 bits in the low 16 bits of each lane of h (numeric.h: NaN kept
  /// as is, signalling ones included); `hw` is the policy's hardware conversion of the same bits.
  static vf f16_fix_nan(vi h, vf hw) noexcept {
    vi const e = V::set1_i(0x7c00);
    vm const special = V::eq_i(V::and_i(h, e), e);
    vi const exact = V::or_i(V::template slli<16>(V::and_i(h, V::set1_i(0x8000))),
                             V::or_i(V::set1_i(0x7f800000), V::template slli<13>(V::and_i(h, V::set1_i(0x3ff)))));
    return V::select_f(special, V::from_bits(exact), hw);
  }

  /// Exact f16 -> f32 of W halves at p.
  static vf f16_load(u16 const* p) noexcept { return f16_fix_nan(V::load_u16(p), V::f16_load_hw(p)); }

  /// bf16 bits (low 16 bits of each lane) of v, round to nearest even, NaN quieted (numeric.h).
  static vi bf16_bits(vf v) noexcept {
    vi const u = V::bits(v);
    vi const hi = V::template srli<16>(u);
    vi const r = V::template srli<16>(V::add_i(V::add_i(u, V::set1_i(0x7fff)), V::and_i(hi, V::set1_i(1))));
    vm const nan = V::gt_i(V::and_i(u, V::set1_i(0x7fffffff)), V::set1_i(0x7f800000));
    return V::select_i(nan, V::or_i(hi, V::set1_i(0x40)), r);
  }

  /// Saturating f16 of the hardware f16 bits h: ±Inf becomes ±65504 (numeric.h f32_to_f16_bits_sat).
  static vi f16_saturate(vi h) noexcept {
    vm const inf = V::eq_i(V::and_i(h, V::set1_i(0x7fff)), V::set1_i(0x7c00));
    return V::select_i(inf, V::or_i(V::and_i(h, V::set1_i(0x8000)), V::set1_i(0x7bff)), h);
  }

  // ---------------------------------------------------------------------------------------------
  // Element conversions

  /// f32 -> f16, n elements.
  static void to_f16(float const* x, u16* h, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::f16_store_hw(h + i, V::load(x + i));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u16 t[std::size_t{W}];
      V::f16_store_hw(t, load_pad(x + i, r, 0.0f));
      std::memcpy(h + i, t, static_cast<std::size_t>(r) * 2);
    }
  }

  /// f16 -> f32, n elements (exact).
  static void from_f16(u16 const* h, float* y, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store(y + i, f16_load(h + i));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u16 t[std::size_t{W}] = {};
      std::memcpy(t, h + i, static_cast<std::size_t>(r) * 2);
      store_part(y + i, f16_load(t), r);
    }
  }

  /// v with its finite lanes beyond ±65504 set to ±65504 (NaN and ±Inf kept): rounding it to f16
  /// then saturates instead of overflowing, numeric.h's f32_to_f16_bits_satfinite.
  static vf clamp_to_f16_range(vf v) noexcept {
    vf const a = V::abs(v);
    vf const m = V::select_f(V::le_f(a, V::set1(std::numeric_limits<float>::max())), V::min(a, V::set1(65504.0f)), a);
    return V::from_bits(V::or_i(V::bits(m), V::and_i(V::bits(v), V::set1_i(static_cast<std::int32_t>(0x80000000u)))));
  }

  /// f32 -> f16 with finite values saturating (f32_to_f16_bits_satfinite), n elements.
  static void to_f16_satfinite(float const* x, u16* h, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::f16_store_hw(h + i, clamp_to_f16_range(V::load(x + i)));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u16 t[std::size_t{W}];
      V::f16_store_hw(t, clamp_to_f16_range(load_pad(x + i, r, 0.0f)));
      std::memcpy(h + i, t, static_cast<std::size_t>(r) * 2);
    }
  }

  /// y = f32 of to_f16_satfinite(x), n elements (y may be x). The f16 of a NaN is quiet, so the
  /// hardware widening is exact here.
  static void round_f16_satfinite(float const* x, float* y, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store(y + i, V::round_f16(clamp_to_f16_range(V::load(x + i))));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      store_part(y + i, V::round_f16(clamp_to_f16_range(load_pad(x + i, r, 0.0f))), r);
    }
  }

  /// f32 -> bf16, n elements.
  static void to_bf16(float const* x, u16* h, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store_u16(h + i, bf16_bits(V::load(x + i)));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u16 t[std::size_t{W}];
      V::store_u16(t, bf16_bits(load_pad(x + i, r, 0.0f)));
      std::memcpy(h + i, t, static_cast<std::size_t>(r) * 2);
    }
  }

  /// bf16 -> f32, n elements (exact).
  static void from_bf16(u16 const* h, float* y, std::int64_t n) noexcept {
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store(y + i, V::from_bits(V::template slli<16>(V::load_u16(h + i))));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u16 t[std::size_t{W}] = {};
      std::memcpy(t, h + i, static_cast<std::size_t>(r) * 2);
      store_part(y + i, V::from_bits(V::template slli<16>(V::load_u16(t))), r);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // q8_0 and q4_0 (blocks of 32)

  static constexpr int kq = detail::qk_ggml / W;  // vectors per block

  // Encoding runs over batches of W blocks (across rows). A block's largest magnitude is the
  // integer maximum of its |x| bits: ordered like the magnitudes for finite values, and above every
  // finite value for Inf and NaN, so the same maximum says whether the block is poisoned. The W
  // blocks' maxima are reduced across lanes together (lane i: block i), the scales of the batch
  // are computed in one vector — the same divisions and fp16 rounding as the reference, lane by
  // lane — and finally each block's codes are written with its scale broadcast. q4_0 also needs
  // the sign of its largest element: the largest positive and negative magnitudes are reduced
  // apart, and only a block where both reach amax looks for the first of them.

  /// Lane i: the largest |x| bits of block x[i] of K vectors (i < n; 0 for the other lanes).
  template <int K>
  KVQ_CPU_ALWAYS_INLINE static vi block_magnitudes(float const* const* x, int n) noexcept {
    vi const magnitude = V::set1_i(0x7fffffff);
    vi m[std::size_t{W}];
    for (int i = 0; i < W; ++i) {
      m[i] = V::set1_i(0);
      if (i < n)
        for (int k = 0; k < K; ++k) m[i] = V::max_i(m[i], V::and_i(V::bits(V::load(x[i] + k * W)), magnitude));
    }
    return V::max_lanes_i(m);
  }

  /// Lanes i < n, over the elements of block x[i] of K vectors: `pos` the largest bits of a
  /// non-negative one, `neg` the largest |x| bits of a negative one (each below 0 when there is
  /// none). As integers, the bits of non-negative floats order like their values, and flipping the
  /// sign bit turns a negative float's bits into its magnitude's (a non-negative one's into a
  /// negative integer).
  template <int K>
  KVQ_CPU_ALWAYS_INLINE static void block_signed_magnitudes(float const* const* x, int n, vi& pos, vi& neg) noexcept {
    vi const sign = V::set1_i(std::numeric_limits<std::int32_t>::min());
    vi p[std::size_t{W}], q[std::size_t{W}];
    for (int i = 0; i < W; ++i) {
      p[i] = q[i] = V::set1_i(0);
      if (i < n)
        for (int k = 0; k < K; ++k) {
          vi const b = V::bits(V::load(x[i] + k * W));
          p[i] = k == 0 ? b : V::max_i(p[i], b);
          q[i] = k == 0 ? V::xor_i(b, sign) : V::max_i(q[i], V::xor_i(b, sign));
        }
    }
    pos = V::max_lanes_i(p);
    neg = V::max_lanes_i(q);
  }

  /// The lanes whose largest |x| bits are those of an Inf or a NaN.
  static auto poisoned_lanes(vi amax_bits) noexcept { return V::gt_i(amax_bits, V::set1_i(0x7f7fffff)); }

  /// The first element of block x whose magnitude is amax (> 0, finite), sign kept: q4_0's signed max.
  static float ggml_signed_max(float const* x, float amax) noexcept {
    vf const a = V::set1(amax);
    std::uint32_t hits = 0;
    for (int k = 0; k < kq; ++k)
      hits |= static_cast<std::uint32_t>(V::mask_bits(V::eq_f(V::abs(V::load(x + k * W)), a))) << (k * W);
    return x[std::countr_zero(hits)];
  }

  /// Encodes a batch of n (1 .. W) full blocks x[i] (32 floats each) into dst[i]: d = amax / 127
  /// (q8_0) or max / -8 (q4_0), its inverse ggml_inverse_scale(d), its fp16 bits (0x7e00 and
  /// neutral codes for a block holding NaN or Inf).
  template <bool Q4>
  KVQ_CPU_ALWAYS_INLINE static void ggml_batch(float const* const* x, u8* const* dst, int n) noexcept {
    vi amax_bits;
    vf d;
    if constexpr (Q4) {
      // max: the first element of largest magnitude, +0 when every element is ±0 (the reference
      // never replaces its initial +0 then). Its sign comes from which of the block's largest
      // positive and negative magnitudes reach amax; only a block where both do (and amax > 0)
      // needs the first of them, found element by element.
      vi pos, neg;
      block_signed_magnitudes<kq>(x, n, pos, neg);
      amax_bits = V::max_i(pos, neg);
      vi const zero_i = V::set1_i(0);
      vi const sign = V::select_i(
          V::gt_i(amax_bits, zero_i),
          V::select_i(V::eq_i(pos, amax_bits), zero_i, V::set1_i(std::numeric_limits<std::int32_t>::min())), zero_i);
      unsigned const tied = V::mask_bits(V::eq_i(pos, amax_bits)) & V::mask_bits(V::eq_i(neg, amax_bits)) &
                            V::mask_bits(V::gt_i(amax_bits, zero_i)) & ~V::mask_bits(poisoned_lanes(amax_bits));
      vf max = V::from_bits(V::or_i(amax_bits, sign));
      if (tied != 0) {
        alignas(64) float m[std::size_t{W}];
        V::store(m, max);
        for (unsigned t = tied; t != 0; t &= t - 1) {
          int const i = std::countr_zero(t);
          m[i] = ggml_signed_max(x[i], std::fabs(m[i]));
        }
        max = V::load(m);
      }
      d = V::div(max, V::set1(-8.0f));
    } else {
      amax_bits = block_magnitudes<kq>(x, n);
      d = V::div(V::from_bits(amax_bits), V::set1(127.0f));
    }
    unsigned const poisoned = V::mask_bits(poisoned_lanes(amax_bits));
    vf const zero = V::set1(0.0f);
    vf const inv = V::div(V::set1(1.0f), d);
    alignas(64) float id[std::size_t{W}];
    alignas(64) u16 dh[std::size_t{W}];
    V::store(id, V::select_f(V::mask_or(V::eq_f(d, zero), nonfinite(inv)), zero, inv));
    V::store_u16(dh, V::f32_to_f16_hw(d));
    for (int i = 0; i < n; ++i) {
      u8* const qs = dst[i] + 2;
      if ((poisoned >> i) & 1u) {
        u16 const scale = detail::poisoned_f16_scale;
        std::memcpy(dst[i], &scale, 2);
        std::memset(qs, Q4 ? 0x88 : 0, Q4 ? detail::qk_ggml / 2 : detail::qk_ggml);  // neutral codes
        continue;
      }
      std::memcpy(dst[i], &dh[i], 2);
      if constexpr (Q4)
        q4_0_codes(x[i], id[i], qs);
      else
        q8_0_codes(x[i], id[i], qs);
    }
  }

  /// Writes the 32 codes of a finite q8_0 block: roundf(x * id).
  ///
  /// roundf(p) == trunc(p + copysign(0.49999997f, p)) for every |p| < 2^31 (checked exhaustively
  /// over all floats): the largest float below 1/2 pushes exact halves across, nothing else.
  static void q8_0_codes(float const* x, float id, u8* qs) noexcept {
    vf const idv = V::set1(id);
    vi const sign = V::set1_i(static_cast<std::int32_t>(0x80000000u));
    vi const below_half = V::set1_i(0x3effffff);  // 0.49999997f
    for (int k = 0; k < kq; ++k) {
      vf const p = V::mul(V::load(x + k * W), idv);
      vf const nudge = V::from_bits(V::or_i(V::and_i(V::bits(p), sign), below_half));
      V::store_u8(qs + k * W, V::cvtt(V::add(p, nudge)));  // low byte, as the reference's cast to signed char
    }
  }

  /// Writes the 16 nibble bytes of a finite q4_0 block: min(15, trunc(fl(x * id) + 8.5)).
  static void q4_0_codes(float const* x, float id, u8* qs) noexcept {
    vf const idv = V::set1(id);
    vf const bias = V::set1(8.5f);
    vi const top = V::set1_i(15);
    vi c[std::size_t{kq}];
    for (int k = 0; k < kq; ++k) c[k] = V::min_i(V::cvtt(V::add(V::mul(V::load(x + k * W), idv), bias)), top);
    for (int k = 0; k < kq / 2; ++k) V::store_u8(qs + k * W, V::or_i(c[k], V::template slli<4>(c[k + kq / 2])));
  }

  /// ggml_batch of W blocks, out of line for uniform batches: the batch inlined into their loop
  /// measured slower, and left to the compiler it may not inline the batch's own steps.
  template <bool Q4>
  KVQ_CPU_NOINLINE static void ggml_batch_full(float const* const* x, u8* const* dst) noexcept {
    ggml_batch<Q4>(x, dst, W);
  }

  template <bool Q4>
  static void ggml_encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* dst,
                               std::size_t ds) noexcept {
    constexpr int qk = detail::qk_ggml;
    constexpr std::size_t bytes = Q4 ? sizeof(detail::block_q4_0) : sizeof(detail::block_q8_0);
    alignas(64) float pad[std::size_t{W}][qk];  // zero-padded copies of partial blocks (zeros take no part in amax/max)
    float const* bx[std::size_t{W}];
    u8* bd[std::size_t{W}];
    uniform_batches(x, xs, rows, hd, qk, dst, ds, bytes,
                    [](float const* const* px, u8* const* pd) { ggml_batch_full<Q4>(px, pd); });
    int n = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < hd; c += qk) {
        float const* const src = x + r * xs + c;
        if (hd - c >= qk) {
          bx[n] = src;
          // The same block rows_ahead rows on, when the call has that row: rows are streamed while
          // the batch computes (a prefetch past the last row measured slower on small scratch inputs).
          if (r + rows_ahead < rows) prefetch_ahead(src, qk, xs);
        } else {
          std::memset(pad[n], 0, sizeof pad[n]);
          std::memcpy(pad[n], src, static_cast<std::size_t>(hd - c) * sizeof(float));
          bx[n] = pad[n];
        }
        bd[n] = dst + static_cast<std::size_t>(r) * ds + static_cast<std::size_t>(c / qk) * bytes;
        if (++n == W) {
          ggml_batch<Q4>(bx, bd, n);
          n = 0;
        }
      }
    }
    if (n) ggml_batch<Q4>(bx, bd, n);
  }

  /// Decodes the first n (1 .. 32) values of a q8_0 block.
  static void q8_0_decode_block(u8 const* src, int n, float* y) noexcept {
    u16 dh;
    std::memcpy(&dh, src, 2);
    vf const d = V::set1(detail::f16_bits_to_f32(dh));
    u8 const* const qs = src + 2;
    for (int k = 0; k < kq && k * W < n; ++k) {
      vf const r = V::mul(V::cvt_f(V::load_i8(qs + k * W)), d);
      if ((k + 1) * W <= n)
        V::store(y + k * W, r);
      else
        store_part(y + k * W, r, n - k * W);
    }
  }

  /// Decodes the first n (1 .. 32) values of a q4_0 block.
  static void q4_0_decode_block(u8 const* src, int n, float* y) noexcept {
    u16 dh;
    std::memcpy(&dh, src, 2);
    vf const d = V::set1(detail::f16_bits_to_f32(dh));
    u8 const* const qs = src + 2;
    vi const eight = V::set1_i(8);
    for (int k = 0; k < kq && k * W < n; ++k) {
      vi const b = V::load_u8(qs + (k % (kq / 2)) * W);
      vi const nib = k < kq / 2 ? V::and_i(b, V::set1_i(15)) : V::template srli<4>(b);
      vf const r = V::mul(V::cvt_f(V::sub_i(nib, eight)), d);
      if ((k + 1) * W <= n)
        V::store(y + k * W, r);
      else
        store_part(y + k * W, r, n - k * W);
    }
  }

  template <bool Q4>
  static void ggml_decode_row(u8 const* src, int head_dim, float* y) noexcept {
    constexpr std::size_t bytes = Q4 ? sizeof(detail::block_q4_0) : sizeof(detail::block_q8_0);
    for (int c = 0; c < head_dim; c += detail::qk_ggml, src += bytes) {
      int const n = head_dim - c < detail::qk_ggml ? head_dim - c : detail::qk_ggml;
      if constexpr (Q4)
        q4_0_decode_block(src, n, y + c);
      else
        q8_0_decode_block(src, n, y + c);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // int8 symmetric (one fp32 scale per row)

  static void int8_encode_row(float const* x, int head_dim, u8* dst) noexcept {
    int const full = head_dim / W * W;
    int const rest = head_dim - full;
    vf amaxv = V::set1(0.0f);
    vm bad = V::mask_false();
    for (int i = 0; i < full; i += W) {
      vf const v = V::load(x + i);
      amaxv = V::max(amaxv, V::abs(v));
      bad = V::mask_or(bad, nonfinite(v));
    }
    vf const tail = rest ? load_pad(x + full, rest, 0.0f) : V::set1(0.0f);
    amaxv = V::max(amaxv, V::abs(tail));
    bad = V::mask_or(bad, nonfinite(tail));
    bool const finite = !V::any(bad);
    float const scale =
        finite ? detail::int8_scale(V::reduce_max(amaxv)) : detail::f32_from_bits(detail::int8_poisoned_scale_bits);
    std::memcpy(dst, &scale, 4);
    u8* const q = dst + detail::int8_row_header_bytes;
    if (!finite || scale == 0.0f) {
      std::memset(q, 0, static_cast<std::size_t>(head_dim));
      return;
    }
    vf const s = V::set1(scale);
    vf const lo = V::set1(-127.0f);
    vf const hi = V::set1(127.0f);
    for (int i = 0; i < full; i += W) V::store_u8(q + i, V::cvt_rne(V::min(V::max(V::div(V::load(x + i), s), lo), hi)));
    if (rest) {
      alignas(64) u8 t[std::size_t{W}];
      V::store_u8(t, V::cvt_rne(V::min(V::max(V::div(tail, s), lo), hi)));
      std::memcpy(q + full, t, static_cast<std::size_t>(rest));
    }
  }

  static void int8_decode_row(u8 const* src, int head_dim, float* y) noexcept {
    float scale;
    std::memcpy(&scale, src, 4);
    vf const s = V::set1(scale);
    u8 const* const q = src + detail::int8_row_header_bytes;
    int i = 0;
    for (; i + W <= head_dim; i += W) V::store(y + i, V::mul(V::cvt_f(V::load_i8(q + i)), s));
    if (i < head_dim) {
      alignas(64) u8 t[std::size_t{W}] = {};
      std::memcpy(t, q + i, static_cast<std::size_t>(head_dim - i));
      store_part(y + i, V::mul(V::cvt_f(V::load_i8(t)), s), head_dim - i);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // mxfp4 / nvfp4 (math_fp4.h)
  //
  // The reference scans all 16 codes of ggml's table for the first of least error |K*h - x|. The
  // table is symmetric (K[c + 8] = -K[c]) and rounding to nearest is too, so that code is the
  // first of least error |K*h - |x|| among codes 0..7, plus 8 when x < 0 and the code is not 0
  // (the negative half never wins a tie, being scanned later).
  //
  // When h > 0 and |x| <= 24 h (with 24 h finite), that code is the number of midpoints
  // (K[k] + K[k+1]) / 2 * h = 0.5, 1.5, 2.5, 3.5, 5, 7, 10 times h strictly below |x|: K[k+1] <= 2 K[k]
  // for k >= 1, so for |x| between two neighbours both errors are exact (Sterbenz), and the tie at a
  // midpoint goes to the lower code as in the reference; below h / 2 code 0's error |x| is exact and
  // code 1's rounds to at least h / 2; codes further away trail by at least h / 2, far beyond any
  // rounding. The midpoints are exact (h has at most 4 significant bits). Otherwise (nvfp4's scale
  // saturated at 448 or flushed to 0, mxfp4 near FLT_MAX) the lanes run the reference's scan.
  //
  // Encoding runs over batches of W scale groups (an mxfp4 block, an nvfp4 sub-block) across
  // blocks and rows, like q8_0's: their magnitudes reduced across lanes together.

  /// FP4 codes (one per lane) of finite values by the reference's scan of the 7 candidates.
  struct fp4_candidates {
    vf t[8];
    explicit fp4_candidates(float h) noexcept {
      float table[16];
      detail::fp4_encode_table(h, table);
      for (int k = 0; k < 8; ++k) t[k] = V::set1(table[k]);
    }
    /// The codes of finite v: the first candidate of least error |K h - |v||, plus 8 for negative
    /// v (-0 included) unless it is 0.
    vi codes(vf v) const noexcept {
      vf const a = V::abs(v);
      vf best_err = a;  // code 0: |0 - |x|| = |x|
      vi mag = V::set1_i(0);
      for (int k = 1; k < 8; ++k) {
        vf const err = V::abs(V::sub(t[k], a));
        vm const better = V::gt_f(best_err, err);
        best_err = V::select_f(better, err, best_err);
        mag = V::select_i(better, V::set1_i(k), mag);
      }
      vi const sign = V::template slli<3>(V::template srli<31>(V::bits(v)));
      return V::select_i(V::eq_i(mag, V::set1_i(0)), mag, V::or_i(mag, sign));
    }
  };

  /// The midpoints of a batch of W groups, (K[k] + K[k + 1]) / 2 * h_i for k < 7, counted by a
  /// binary search over a register table of them (the products are exact: h has at most four
  /// significant bits), and -h_i / 2 at neg_half[i].
  struct fp4_midpoints {
    alignas(64) float half[std::size_t{W}];      // h_i
    alignas(64) float neg_half[std::size_t{W}];  // -h_i / 2
    typename V::table16 above;                   // t[c] = the c-th midpoint of h = 1 (c = 1 .. 7), repeated
    explicit fp4_midpoints(vf h) noexcept {
      V::store(half, h);
      V::store(neg_half, V::mul(h, V::set1(-0.5f)));
      alignas(64) static constexpr float unit[16] = {0.0f, 0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f,
                                                     0.0f, 0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f};
      above = V::make_table16(unit);
    }
    /// The codes of finite v of group i (|v| <= 24 h_i, h_i > 0): the midpoints below |v|, plus 8
    /// for v < -h_i / 2 (negative with a code other than 0).
    KVQ_CPU_ALWAYS_INLINE vi codes(vf v, int i) const noexcept {
      vf const a = V::abs(v);
      // (lookup<3> reads the entries that scale_symmetric<3> scales on every policy)
      auto const t = V::template scale_symmetric<3>(above, V::set1(half[i]));
      vi c = V::set1_i(0);
      for (int step = 4; step > 0; step /= 2) {
        vi const cand = V::add_i(c, V::set1_i(step));
        c = V::select_i(V::gt_f(a, V::template lookup<3>(t, cand)), cand, c);
      }
      return V::select_i(V::gt_f(V::set1(neg_half[i]), v), V::or_i(c, V::set1_i(8)), c);
    }
  };

  /// The mxfp4 codes of finite v of a group whose half-scale is h = 2^k >= 2^-126 (|v| <= 24 h),
  /// given inv = 2^-k and neg_half = -h / 2: fp4_midpoints::codes without its seven comparisons.
  /// s = |v| inv is exact, so s is compared with the midpoints 0.5 1.5 2.5 3.5 5 7 10 themselves:
  /// from 2 on they are the ties of E2M1's one mantissa bit, which adding 2^21 - 1 below that bit
  /// rounds down (codes 2-7 read off s's bits); below 2, two comparisons.
  KVQ_CPU_ALWAYS_INLINE static vi mxfp4_exact_codes(vf v, vf inv, vf neg_half) noexcept {
    vf const s = V::mul(V::abs(v), inv);
    constexpr std::int32_t round_down_from_two = 0x1fffff - (254 << 22);  // the bits of 2 become code 2
    vi c = V::template srli<22>(V::add_i(V::bits(V::max(s, V::set1(2.0f))), V::set1_i(round_down_from_two)));
    c = V::min_i(c, V::set1_i(7));
    vi const one = V::set1_i(1);
    c = V::select_i(V::le_f(s, V::set1(1.5f)), V::sub_i(c, one), c);
    c = V::select_i(V::le_f(s, V::set1(0.5f)), V::sub_i(c, one), c);
    return V::select_i(V::gt_f(neg_half, v), V::or_i(c, V::set1_i(8)), c);
  }

  /// Writes the Per / 2 nibble bytes of the codes c of a group: value j in the low nibble of byte
  /// j, value j + Per / 2 in the high nibble.
  template <int Per>
  KVQ_CPU_ALWAYS_INLINE static void fp4_store_codes(vi const* c, u8* qs) noexcept {
    constexpr int nv = Per / W;
    if constexpr (2 * W <= Per) {
      for (int k = 0; k < nv / 2; ++k) V::store_u8(qs + k * W, V::or_i(c[k], V::template slli<4>(c[k + nv / 2])));
    } else {  // one vector holds both halves
      static_assert(W == Per, "an FP4 scale group spans whole vectors");
      V::store_nibble_halves(qs, c[0]);
    }
  }

  /// Lane-wise detail::mxfp4_exponent of finite magnitudes (their bits b).
  static vi mxfp4_exponents(vi b) noexcept {
    vi const biased = V::template srli<23>(b);
    vi const k = V::sub_i(biased, V::set1_i(126));  // floor(log2(amax)) + 1
    vi const a = V::max_i(k, V::sub_i(V::set1_i(1), k));
    // detail::mxfp4_log2_roundup(k): how many floats below 2^k have log2f rounded up to k
    constexpr int bound[6] = {2, 4, 8, 16, 32, 64}, count[6] = {1, 2, 5, 11, 22, 44};
    vi roundup = V::set1_i(0);
    for (int j = 0; j < 6; ++j) roundup = V::select_i(V::gt_i(a, V::set1_i(bound[j])), V::set1_i(count[j]), roundup);
    vi const next = V::template slli<23>(V::add_i(biased, V::set1_i(1)));  // bits of 2^k (Inf for k = 128)
    vm const up = V::gt_i(V::add_i(b, roundup), V::sub_i(next, V::set1_i(1)));
    vi const e =
        V::max_i(V::add_i(V::sub_i(biased, V::set1_i(2)), V::select_i(up, V::set1_i(1), V::set1_i(0))), V::set1_i(0));
    return V::select_i(V::eq_i(biased, V::set1_i(0)), V::set1_i(0), e);
  }

  /// Lane-wise detail::mxfp4_half_scale.
  static vf mxfp4_half_scales(vi e) noexcept {
    vi const low = V::select_i(V::eq_i(e, V::set1_i(0)), V::set1_i(0x00200000), V::set1_i(0x00400000));
    vi const normal = V::template slli<23>(V::sub_i(e, V::set1_i(1)));
    return V::from_bits(V::select_i(V::gt_i(e, V::set1_i(1)), normal, low));
  }

  /// Lane-wise detail::nvfp4_scale_code of s >= 0.
  static vi nvfp4_scale_codes(vf s) noexcept {
    s = V::min(s, V::set1(448.0f));
    vi const sub = V::min_i(V::cvtt(V::add(V::mul(s, V::set1(512.0f)), V::set1(0.5f))), V::set1_i(7));
    vi const b = V::bits(s);
    vi const e7 = V::sub_i(V::template srli<23>(b), V::set1_i(120));  // exponent + 7
    vi const f = V::and_i(b, V::set1_i(0x007fffff));
    vi const m = V::add_i(V::template srli<20>(f), V::and_i(V::template srli<19>(f), V::set1_i(1)));  // half up
    vi const code = V::add_i(V::template slli<3>(e7), m);  // m = 8 carries into the exponent
    vi const normal = V::select_i(V::gt_i(code, V::set1_i(0x77)), V::set1_i(0x7e), code);
    return V::select_i(V::gt_f(V::set1(0.015625f), s), sub, normal);
  }

  /// Lane-wise detail::nvfp4_half_scale of codes other than 0x7F.
  static vf nvfp4_half_scales(vi code) noexcept {
    vi const ex = V::and_i(V::template srli<3>(code), V::set1_i(15));
    vi const m = V::and_i(code, V::set1_i(7));
    vf const sub = V::mul(V::cvt_f(m), V::set1(0.0009765625f));
    vf const normal =
        V::from_bits(V::or_i(V::template slli<23>(V::add_i(ex, V::set1_i(119))), V::template slli<20>(m)));
    return V::select_f(V::eq_i(ex, V::set1_i(0)), sub, normal);
  }

  /// Encodes a batch of n (1 .. W) groups of Per values x[i] (divided by the codec scale): the
  /// scale byte to scale[i], the codes to qs[i]. The scales and midpoints of the batch are computed
  /// lane-wise.
  template <bool Mx, int Per>
  KVQ_CPU_ALWAYS_INLINE static void fp4_batch(float const* const* x, u8* const* scale, u8* const* qs, int n) noexcept {
    constexpr int nv = Per / W;
    vi const amax_bits = block_magnitudes<nv>(x, n);
    unsigned const poisoned = V::mask_bits(poisoned_lanes(amax_bits));
    vi code;
    vf h;
    if constexpr (Mx) {
      code = mxfp4_exponents(amax_bits);
      h = mxfp4_half_scales(code);
    } else {
      code = nvfp4_scale_codes(V::div(V::from_bits(amax_bits), V::set1(6.0f)));
      h = nvfp4_half_scales(code);
    }
    // Groups coded by midpoints: h > 0 and amax <= 24 h finite (false for NaN and Inf amax).
    vf const top = V::mul(h, V::set1(24.0f));
    unsigned const by_midpoints = V::mask_bits(V::gt_f(h, V::set1(0.0f))) &
                                  V::mask_bits(V::le_f(V::from_bits(amax_bits), top)) &
                                  V::mask_bits(V::le_f(top, V::set1(std::numeric_limits<float>::max())));
    fp4_midpoints const mid(h);
    alignas(64) u8 byte[std::size_t{W}];
    V::store_u8(byte, code);
    alignas(64) float half_scale[std::size_t{W}];
    V::store(half_scale, h);
    // mxfp4 groups with h >= 2^-126 (scale byte >= 2): mxfp4_exact_codes with inv = 1 / h.
    unsigned exact = 0;
    alignas(64) float inverse[std::size_t{W}];
    if constexpr (Mx) {
      exact = by_midpoints & V::mask_bits(V::gt_i(code, V::set1_i(1)));
      V::store(inverse, V::from_bits(V::template slli<23>(V::sub_i(V::set1_i(255), code))));
    }
    for (int i = 0; i < n; ++i) {
      if ((poisoned >> i) & 1u) {  // (never coded by midpoints: amax is not finite)
        *scale[i] = Mx ? detail::mxfp4_poisoned_scale : detail::nvfp4_poisoned_scale;
        std::memset(qs[i], 0, Per / 2);
        continue;
      }
      *scale[i] = byte[i];
      vi c[std::size_t{nv}];
      if ((exact >> i) & 1u) {
        vf const inv = V::set1(inverse[i]), neg_half = V::set1(mid.neg_half[i]);
        for (int k = 0; k < nv; ++k) c[k] = mxfp4_exact_codes(V::load(x[i] + k * W), inv, neg_half);
      } else if ((by_midpoints >> i) & 1u) {
        for (int k = 0; k < nv; ++k) c[k] = mid.codes(V::load(x[i] + k * W), i);
      } else {
        fp4_candidates const cand(half_scale[i]);
        for (int k = 0; k < nv; ++k) c[k] = cand.codes(V::load(x[i] + k * W));
      }
      fp4_store_codes<Per>(c, qs[i]);
    }
  }

  /// fp4_batch of W groups, out of line for uniform batches (see ggml_batch_full).
  template <bool Mx, int Per>
  KVQ_CPU_NOINLINE static void fp4_batch_full(float const* const* x, u8* const* scale, u8* const* qs) noexcept {
    fp4_batch<Mx, Per>(x, scale, qs, W);
  }

  template <bool Mx>
  static void fp4_encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* dst, std::size_t ds,
                              fp4_params const& p) noexcept {
    constexpr int qk = Mx ? detail::qk_mxfp4 : detail::qk_nvfp4;
    constexpr int per = Mx ? detail::qk_mxfp4 : detail::qk_nvfp4_sub;  // values per scale
    constexpr int groups = qk / per;
    constexpr std::size_t bytes = Mx ? sizeof(detail::block_mxfp4) : sizeof(detail::block_nvfp4);
    bool const divide = p.scale != 1.0f;  // x / 1 == x (a NaN stays a NaN, which poisons either way)
    vf const sv = V::set1(p.scale);
    alignas(
        64) float pad[std::size_t{W}][std::size_t{per}];  // groups divided by the scale or zero-padded past head_dim
    float const* gx[std::size_t{W}];
    u8* gs[std::size_t{W}];
    u8* gq[std::size_t{W}];
    // Uniform batches for mxfp4 (a group is a block: scale byte, then codes); nvfp4 measured slower
    // that way in f32 prefill appends, so its groups take the general loop.
    if constexpr (Mx)
      if (!divide)
        uniform_batches(x, xs, rows, hd, qk, dst, ds, bytes, [](float const* const* px, u8* const* pd) {
          u8* codes[std::size_t{W}];
          for (int j = 0; j < W; ++j) codes[j] = pd[j] + 1;
          fp4_batch_full<Mx, per>(px, pd, codes);
        });
    int n = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < hd; c += qk) {
        u8* const block = dst + static_cast<std::size_t>(r) * ds + static_cast<std::size_t>(c / qk) * bytes;
        for (int g = 0; g < groups; ++g) {
          int const at = c + g * per, have = hd - at;  // the group's values in the row (<= 0: none)
          if (have > 0 && r + rows_ahead < rows) prefetch_ahead(x + r * xs + at, have < per ? have : per, xs);
          if (!divide && have >= per) {
            gx[n] = x + r * xs + at;
          } else {
            for (int k = 0; k < per; k += W) {
              vf const raw = k + W <= have ? V::load(x + r * xs + at + k)
                             : k < have    ? load_pad(x + r * xs + at + k, have - k, 0.0f)
                                           : V::set1(0.0f);
              V::store(pad[n] + k, divide ? V::div(raw, sv) : raw);
            }
            gx[n] = pad[n];
          }
          gs[n] = block + g;
          gq[n] = block + groups + g * (per / 2);
          if (++n == W) {
            fp4_batch<Mx, per>(gx, gs, gq, n);
            n = 0;
          }
        }
      }
    }
    if (n) fp4_batch<Mx, per>(gx, gs, gq, n);
  }

  /// Decodes the first n values of one mxfp4 (n <= 32) or nvfp4 (n <= 64) block
  /// (mxfp4::decode_block / nvfp4::decode_block, bit for bit): each scale's 16 values by table.
  template <bool Mx>
  static void fp4_decode_block(u8 const* src, int n, float* y, fp4_params const& p) noexcept {
    constexpr int groups = Mx ? 1 : 4;                                 // scales per block
    constexpr int per = Mx ? detail::qk_mxfp4 : detail::qk_nvfp4_sub;  // values per scale
    constexpr int half = per / 2;  // value j < half in the low nibble of byte j, j >= half in the high one of j - half
    u8 const* const qs = src + groups;
    // fp4_decode_table's values K[c] * h * scale: K[c] * h is exact (at most 8 significant bits),
    // so the lanes multiply the fixed table of K by h, then by the scale (its one rounding).
    float doubled[16];
    for (int c = 0; c < 16; ++c) doubled[c] = static_cast<float>(detail::fp4_doubled_value(c));
    auto const t = V::make_table16(doubled);
    bool const scaled = p.scale != 1.0f;
    vf const sv = V::set1(p.scale);
    for (int g = 0; g < groups && g * per < n; ++g) {
      u8 const e = src[g];
      bool const nan = e == (Mx ? detail::mxfp4_poisoned_scale : detail::nvfp4_poisoned_scale);
      vf const hv = V::set1(Mx ? detail::mxfp4_half_scale(e) : detail::nvfp4_half_scale(e));
      u8 const* const gq = qs + g * half;
      for (int j = 0; j < per && g * per + j < n; j += W) {
        vi nib;
        if constexpr (W <= half) {
          vi const b = V::load_u8(gq + (j % half));
          nib = j < half ? V::and_i(b, V::set1_i(15)) : V::template srli<4>(b);
        } else {  // one vector holds both halves
          static_assert(W == per, "an FP4 scale group spans whole vectors");
          nib = V::load_nibble_halves(gq);
        }
        vf r = V::mul(V::template lookup<4>(t, nib), hv);
        if (scaled) r = V::mul(r, sv);
        if (nan) r = V::set1(detail::fp4_nan());
        int const at = g * per + j;
        if (at + W <= n)
          V::store(y + at, r);
        else
          store_part(y + at, r, n - at);
      }
    }
  }

  template <bool Mx>
  static void fp4_decode_rows(u8 const* src, std::size_t ss, std::int64_t rows, int hd, float* y, std::ptrdiff_t ys,
                              fp4_params const& p) noexcept {
    constexpr int qk = Mx ? detail::qk_mxfp4 : detail::qk_nvfp4;
    constexpr std::size_t bytes = Mx ? sizeof(detail::block_mxfp4) : sizeof(detail::block_nvfp4);
    for (std::int64_t r = 0; r < rows; ++r) {
      u8 const* in = src + static_cast<std::size_t>(r) * ss;
      float* const row = y + r * ys;
      for (int c = 0; c < hd; c += qk, in += bytes) fp4_decode_block<Mx>(in, hd - c < qk ? hd - c : qk, row + c, p);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // fp8 E4M3FN / E5M2 (math_fp8.h with integer lanes)

  /// fp8 codes (low 8 bits of each lane) of v: MB mantissa bits, exponent bias Bias.
  template <int MB, int Bias, int MaxMag, int OverflowMag>
  static vi fp8_codes(vf v, bool saturate) noexcept {
    vi const u = V::bits(v);
    vi const a = V::and_i(u, V::set1_i(0x7fffffff));
    vi const sign = V::and_i(V::template srli<24>(u), V::set1_i(0x80));
    // Normal range: rebias, then drop 23 - MB mantissa bits with RNE (integer, as the reference).
    constexpr int sh = 23 - MB;
    vi const r = V::sub_i(a, V::set1_i((127 - Bias) << 23));
    vi const odd = V::and_i(V::template srli<sh>(r), V::set1_i(1));
    vi const normal = V::template srli<sh>(V::add_i(V::add_i(r, V::set1_i((1 << (sh - 1)) - 1)), odd));
    // Subnormal range: |x| * 2^(Bias + MB - 1) is exact and < 2^MB; RNE to an integer counts quanta.
    constexpr float quanta = static_cast<float>(1u << (Bias + MB - 1));
    vi const sub = V::cvt_rne(V::mul(V::from_bits(a), V::set1(quanta)));
    vi mag = V::select_i(V::gt_i(a, V::set1_i(((128 - Bias) << 23) - 1)), normal, sub);
    mag = V::select_i(V::gt_i(mag, V::set1_i(MaxMag)), V::set1_i(saturate ? MaxMag : OverflowMag), mag);
    vi const code = V::or_i(sign, mag);
    return V::select_i(V::gt_i(a, V::set1_i(0x7f800000)), V::set1_i(detail::fp8_nan_code), code);
  }

  template <bool E4M3>
  static vi fp8_encode_vec(vf v, vf scale, bool divide, bool saturate) noexcept {
    if (divide) v = V::div(v, scale);
    if constexpr (E4M3)
      return fp8_codes<3, 7, detail::e4m3_max_code, 0x7f>(v, saturate);
    else
      return fp8_codes<2, 15, detail::e5m2_max_code, 0x7c>(v, saturate);
  }

  template <bool E4M3>
  static void fp8_encode(float const* x, u8* dst, std::int64_t n, fp8_params const& p) noexcept {
    bool const divide = p.scale != 1.0f;  // x / 1 == x exactly (NaN encodes to 0x7f either way)
    bool const sat = p.overflow == fp8_overflow::saturate;
    vf const s = V::set1(p.scale);
    std::int64_t i = 0;
    for (; i + W <= n; i += W) V::store_u8(dst + i, fp8_encode_vec<E4M3>(V::load(x + i), s, divide, sat));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u8 t[std::size_t{W}];
      V::store_u8(t, fp8_encode_vec<E4M3>(load_pad(x + i, r, 0.0f), s, divide, sat));
      std::memcpy(dst + i, t, static_cast<std::size_t>(r));
    }
  }

  /// Exact values of the fp8 codes c (0 .. 255 per lane), as e4m3_to_f32 / e5m2_to_f32.
  template <bool E4M3>
  static vf fp8_values(vi c) noexcept {
    constexpr int mb = E4M3 ? 3 : 2;
    constexpr int bias = E4M3 ? 7 : 15;
    vi const cm = V::and_i(c, V::set1_i(0x7f));
    vi const sign = V::template slli<24>(V::and_i(c, V::set1_i(0x80)));
    vi const m = V::and_i(cm, V::set1_i((1 << mb) - 1));
    vi const normal = V::add_i(V::template slli<23 - mb>(cm), V::set1_i((127 - bias) << 23));
    constexpr float quantum = 1.0f / static_cast<float>(1u << (bias + mb - 1));
    vi const sub = V::bits(V::mul(V::cvt_f(m), V::set1(quantum)));  // m * 2^(1 - bias - mb), exact
    vi val = V::select_i(V::gt_i(V::set1_i(1 << mb), cm), sub, normal);
    if constexpr (E4M3) {
      val = V::select_i(V::eq_i(cm, V::set1_i(0x7f)), V::set1_i(0x7fc00000), val);
    } else {
      val = V::select_i(V::gt_i(cm, V::set1_i(0x7b)),
                        V::select_i(V::eq_i(cm, V::set1_i(0x7c)), V::set1_i(0x7f800000), V::set1_i(0x7fc00000)), val);
    }
    return V::from_bits(V::or_i(sign, val));
  }

  /// Decodes n codes, in chunks: through the f16 conversion (the policy's e5m2_load_hw /
  /// e4m3_load_hw_scaled, E4M3 with the scale times 2^8, exact) where the chunk holds no NaN code
  /// (whose bits that conversion would not give as the reference does) and the scale allows; by
  /// fp8_values elsewhere.
  template <bool E4M3>
  static void fp8_decode(u8 const* src, float* y, std::int64_t n, fp8_params const& p) noexcept {
    constexpr std::int64_t chunk = 512;
    vf const s = V::set1(p.scale);
    bool const scale_ok = !E4M3 || std::isfinite(p.scale * 256.0f);
    std::int64_t i = 0;
    for (; i + W <= n && scale_ok;) {
      std::int64_t const e = i + std::min<std::int64_t>(chunk, (n - i) / W * W);
      if (V::any_magnitude_above(src + i, static_cast<std::size_t>(e - i), E4M3 ? 0x7e : 0x7c)) {
        for (; i < e; i += W) V::store(y + i, V::mul(fp8_values<E4M3>(V::load_u8(src + i)), s));
      } else if constexpr (E4M3) {
        vf const s256 = V::set1(p.scale * 256.0f);
        for (; i < e; i += W) V::store(y + i, V::mul(V::e4m3_load_hw_scaled(src + i), s256));
      } else {
        for (; i < e; i += W) V::store(y + i, V::mul(V::e5m2_load_hw(src + i), s));
      }
    }
    for (; i + W <= n; i += W) V::store(y + i, V::mul(fp8_values<E4M3>(V::load_u8(src + i)), s));
    if (i < n) {
      int const r = static_cast<int>(n - i);
      alignas(64) u8 t[std::size_t{W}] = {};
      std::memcpy(t, src + i, static_cast<std::size_t>(r));
      store_part(y + i, V::mul(fp8_values<E4M3>(V::load_u8(t)), s), r);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // KIVI values: per token, groups of gv = min(G, head_dim) channels

  /// Codes of v for the stored parameters (s > 0): clamp(rne((v - m) / s), 0, 2^B - 1).
  static vi kivi_codes(vf v, vf s, vf m, vf top) noexcept {
    vf const t = V::div(V::sub(v, m), s);
    return V::cvt_rne(V::min(V::max(t, V::set1(0.0f)), top));
  }

  /// Decoded values of codes q: fl(fl(q * s) + m).
  static vf kivi_values(vi q, vf s, vf m) noexcept { return V::add(V::mul(V::cvt_f(q), s), m); }

  // Encoding runs over batches of W groups (across rows), like q8_0: each group's range is scanned,
  // the fp16 parameters of the whole batch are computed in the W lanes of one vector (exactly
  // kivi_make_header and f16_bits_to_f32, lane by lane), then each group's codes are written.

  /// Loads chunk ch of a group of n real elements; padding lanes repeat x[0], which changes
  /// neither the minimum, the maximum nor finiteness.
  static vf kivi_chunk(float const* x, int n, int ch) noexcept {
    int const real = n - ch * W;
    return real >= W ? V::load(x + ch * W) : load_pad(x + ch * W, real, x[0]);
  }

  /// Encodes a batch of m (1 .. W) groups: group i has n(i) real elements at x[i] and its block
  /// (header, `lanes` packed codes) at dst[i]. Full > 0: every group has Full = lanes elements, a
  /// multiple of W (the loops then have constant trip counts and no padding).
  template <int B, int Full = 0>
  KVQ_CPU_ALWAYS_INLINE static void kivi_value_batch(float const* const* x, int const* n_, u8* const* dst, int m,
                                                     int lanes_) noexcept {
    static_assert(Full % W == 0, "full groups are whole vectors");
    int const lanes = Full > 0 ? Full : lanes_;
    auto const n = [&](int i) { return Full > 0 ? Full : n_[i]; };
    constexpr int chunk_bytes = W * B / 8;
    int const chunks = (lanes + W - 1) / W;
    int const code_bytes = (lanes * B + 7) / 8;
    // Each group's range, the batch's W groups at once: as integers, the keys b ^ 0x7fffffff of
    // negative floats' bits b (b of the others) order like the floats (-0 below +0, NaNs beyond the
    // infinities), so one max_lanes_i tree gives every group's largest key, and one over the
    // complemented keys its smallest. A group is poisoned when either key lies beyond an infinity's.
    vi const flip = V::set1_i(0x7fffffff), ones = V::set1_i(-1), zero_key = V::set1_i(0);
    auto const key = [&](vi b)
                         KVQ_CPU_ALWAYS_INLINE { return V::select_i(V::gt_i(zero_key, b), V::xor_i(b, flip), b); };
    vi top_key[std::size_t{W}], low_key[std::size_t{W}];  // low_key: complemented (~smallest)
    for (int i = 0; i < W; ++i) {
      top_key[i] = low_key[i] = zero_key;
      if (i < m) {
        vi hi = key(V::bits(kivi_chunk(x[i], n(i), 0))), lo = hi;
        for (int ch = 1; ch < chunks; ++ch) {
          vi const k = key(V::bits(kivi_chunk(x[i], n(i), ch)));
          hi = V::max_i(hi, k);
          lo = V::min_i(lo, k);
        }
        top_key[i] = hi;
        low_key[i] = V::xor_i(lo, ones);
      }
    }
    vi const kmx = V::max_lanes_i(top_key);
    vi const kmn = V::xor_i(V::max_lanes_i(low_key), ones);
    vm const poisoned = V::mask_or(V::gt_i(kmx, V::set1_i(0x7f7fffff)),  // +Inf, positive NaNs
                                   V::gt_i(V::set1_i(static_cast<std::int32_t>(0x80800000u)), kmn));  // -Inf, ...
    unsigned const bad = V::mask_bits(poisoned);
    // kivi_make_header for W groups: ±0 -> +0, scale = (mx - mn) / (2^B - 1), saturating fp16.
    vf const zf = V::set1(0.0f);
    vf vmn = V::from_bits(key(kmn));  // (the key map is its own inverse)
    vf vmx = V::from_bits(key(kmx));
    vmn = V::select_f(V::eq_f(vmn, zf), zf, vmn);
    vmx = V::select_f(V::eq_f(vmx, zf), zf, vmx);
    vf const scale = V::div(V::sub(vmx, vmn), V::set1(static_cast<float>(detail::kivi_max_code(B))));
    vi const poison = V::set1_i(detail::kivi_poisoned_param);
    alignas(64) u16 hs[std::size_t{W}];
    alignas(64) u16 hm[std::size_t{W}];
    V::store_u16(hs, V::select_i(poisoned, poison, f16_saturate(V::f32_to_f16_hw(scale))));
    V::store_u16(hm, V::select_i(poisoned, poison, f16_saturate(V::f32_to_f16_hw(vmn))));
    alignas(64) float s[std::size_t{W}];
    alignas(64) float mv[std::size_t{W}];
    V::store(s, f16_load(hs));
    V::store(mv, f16_load(hm));

    vf const top = V::set1(static_cast<float>(detail::kivi_max_code(B)));
    vi const zero = V::set1_i(0);
    for (int i = 0; i < m; ++i) {
      u8* const d = dst[i];
      detail::kivi_store_u16(d, hs[i]);
      detail::kivi_store_u16(d + 2, hm[i]);
      u8* const codes = d + detail::kivi_group_header_bytes;
      if (((bad >> i) & 1u) || !(s[i] > 0.0f)) {  // poisoned, constant or underflowed scale: every code 0
        std::memset(codes, 0, static_cast<std::size_t>(code_bytes));
        continue;
      }
      vf const sv = V::set1(s[i]);
      vf const mvv = V::set1(mv[i]);
      for (int ch = 0; ch < chunks; ++ch) {
        int const real = n(i) - ch * W;
        vi q = kivi_codes(kivi_chunk(x[i], n(i), ch), sv, mvv, top);
        if (real < W) q = V::select_i(V::lanes_below(real), q, zero);  // padding lanes hold code 0
        int const left = code_bytes - ch * chunk_bytes;
        if (left >= chunk_bytes) {
          V::template store_codes<B>(codes + ch * chunk_bytes, q);
        } else if (left > 0) {  // always (ch * W < lanes); the test keeps GCC's -O0 -Wstringop-overflow quiet
          alignas(64) u8 t[std::size_t{chunk_bytes}];
          V::template store_codes<B>(t, q);
          std::memcpy(codes + ch * chunk_bytes, t, static_cast<std::size_t>(left));
        }
      }
    }
  }

  /// Decodes the n real elements of one group of `lanes` lanes.
  template <int B>
  static void kivi_value_decode_group(u8 const* src, int n, int lanes, float* y) noexcept {
    constexpr int chunk_bytes = W * B / 8;
    vf const s = V::set1(detail::f16_bits_to_f32(detail::kivi_load_u16(src)));
    vf const m = V::set1(detail::f16_bits_to_f32(detail::kivi_load_u16(src + 2)));
    u8 const* const codes = src + detail::kivi_group_header_bytes;
    int const code_bytes = (lanes * B + 7) / 8;
    for (int ch = 0; ch * W < n; ++ch) {
      int const left = code_bytes - ch * chunk_bytes;
      vi q;
      if (left >= chunk_bytes) {
        q = V::template load_codes<B>(codes + ch * chunk_bytes);
      } else {
        alignas(64) u8 t[std::size_t{chunk_bytes}] = {};
        // left > 0 always (ch * W < n <= lanes); the test keeps GCC's -O0 -Wstringop-overflow quiet.
        if (left > 0) std::memcpy(t, codes + ch * chunk_bytes, static_cast<std::size_t>(left));
        q = V::template load_codes<B>(t);
      }
      vf const r = kivi_values(q, s, m);
      int const real = n - ch * W;
      if (real >= W)
        V::store(y + ch * W, r);
      else
        store_part(y + ch * W, r, real);
    }
  }

  /// kivi_value_batch of W full groups, out of line for uniform batches (see ggml_batch_full).
  template <int B, int Full>
  KVQ_CPU_NOINLINE static void kivi_value_batch_full(float const* const* x, int const* n, u8* const* dst) noexcept {
    kivi_value_batch<B, Full>(x, n, dst, W, Full);
  }

  template <int B, int G>
  static void kivi_value_encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* dst,
                                     std::size_t ds) noexcept {
    auto const g = kivi_value<B, G>::geometry(hd);
    // Every group full and whole vectors: the batches run kivi_value_batch's constant-count form.
    constexpr int full_lanes = G % W == 0 ? G : 0;
    bool const full = full_lanes > 0 && hd % G == 0;
    float const* gx[std::size_t{W}];
    int gn[std::size_t{W}];
    u8* gd[std::size_t{W}];
    if constexpr (full_lanes > 0)
      if (full) {
        for (int j = 0; j < W; ++j) gn[j] = full_lanes;
        uniform_batches(
            x, xs, rows, hd, full_lanes, dst, ds, g.block_bytes,
            [&](float const* const* px, u8* const* pd) { kivi_value_batch_full<B, full_lanes>(px, gn, pd); });
      }
    int m = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (int b = 0; b < g.blocks; ++b) {
        int const c = b * g.block_channels;
        gx[m] = x + r * xs + c;
        gn[m] = hd - c < g.block_channels ? hd - c : g.block_channels;
        if (r + rows_ahead < rows) prefetch_ahead(gx[m], gn[m], xs);
        gd[m] = dst + static_cast<std::size_t>(r) * ds + static_cast<std::size_t>(b) * g.block_bytes;
        if (++m == W) {
          if (full)
            kivi_value_batch<B, full_lanes>(gx, gn, gd, m, g.block_channels);
          else
            kivi_value_batch<B>(gx, gn, gd, m, g.block_channels);
          m = 0;
        }
      }
    }
    if (m) kivi_value_batch<B>(gx, gn, gd, m, g.block_channels);
  }

  template <int B, int G>
  static void kivi_value_decode_row(u8 const* src, int head_dim, float* y) noexcept {
    auto const g = kivi_value<B, G>::geometry(head_dim);
    for (int c = 0; c < head_dim; c += g.block_channels, src += g.block_bytes) {
      int const n = head_dim - c < g.block_channels ? head_dim - c : g.block_channels;
      kivi_value_decode_group<B>(src, n, g.block_channels, y + c);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // KIVI keys: per channel, G tokens; lanes are W consecutive channels

  // Tiles are walked row-major (token by token) over super-blocks of up to `kb` chunks of W
  // channels, so reads and writes stream through memory; channels past the last full chunk run
  // the reference.
  static constexpr int kb = 8;

  template <int B, int G>
  static void kivi_key_encode_tile(float const* x, std::ptrdiff_t ts, int head_dim, u8* dst) noexcept {
    using K = kivi_key<B, G>;
    int const full = head_dim / W * W;
    for (int cb = 0; cb < full; cb += kb * W) {
      int const nv = (full - cb) / W < kb ? (full - cb) / W : kb;
      if (nv == kb)  // (a constant count: the per-vector loops unrolled without tests)
        kivi_key_encode_channels<B, G, kb>(x, ts, head_dim, dst, cb, kb);
      else
        kivi_key_encode_channels<B, G, 0>(x, ts, head_dim, dst, cb, nv);
    }
    for (int c = full; c < head_dim; ++c)  // remaining channels: the reference, one channel at a time
      detail::kivi_encode_group(x + c, ts, G, G, B, dst + K::scale_offset(head_dim, c),
                                dst + K::min_offset(head_dim, c), dst + K::codes_offset(head_dim, c));
  }

  /// Encodes the nv (NV when not 0) vectors of channels from cb of a key tile.
  template <int B, int G, int NV>
  KVQ_CPU_ALWAYS_INLINE static void kivi_key_encode_channels(float const* x, std::ptrdiff_t ts, int head_dim, u8* dst,
                                                             int cb, int nv_) noexcept {
    using K = kivi_key<B, G>;
    constexpr int per_word = 32 / B;  // tokens per 32-bit word of codes
    vf const top = V::set1(static_cast<float>(detail::kivi_max_code(B)));
    vf const zf = V::set1(0.0f);
    vi const zero = V::set1_i(0);
    vi const poison = V::set1_i(detail::kivi_poisoned_param);
    int const nv = NV > 0 ? NV : nv_;
    vf mn[kb], mx[kb];
    vm bad[kb];
    for (int k = 0; k < nv; ++k) {
      mn[k] = V::set1(detail::f32_from_bits(0x7f800000u));
      mx[k] = V::set1(detail::f32_from_bits(0xff800000u));
      bad[k] = V::mask_false();
    }
    for (int t = 0; t < G; ++t) {
      float const* const row = x + t * ts + cb;
      for (int k = 0; k < nv; ++k) {
        vf const v = V::load(row + k * W);
        mn[k] = V::min(mn[k], v);
        mx[k] = V::max(mx[k], v);
        bad[k] = V::mask_or(bad[k], nonfinite(v));
        // The same line of the next tile (G tokens on), streamed while this one computes.
        if ((k * W) % 16 == 0) prefetch_at(row + k * W, G * ts * std::ptrdiff_t{sizeof(float)});
      }
    }
    // kivi_make_header per channel; s and m are the stored parameters read back exactly.
    vf s[kb], m[kb];
    vm coded[kb];
    for (int k = 0; k < nv; ++k) {
      int const c0 = cb + k * W;
      vf const lo = V::select_f(V::eq_f(mn[k], zf), zf, mn[k]);  // ±0 counts as +0
      vf const hi = V::select_f(V::eq_f(mx[k], zf), zf, mx[k]);
      vf const scale = V::div(V::sub(hi, lo), top);
      alignas(64) u16 hs[std::size_t{W}];
      alignas(64) u16 hm[std::size_t{W}];
      V::store_u16(hs, V::select_i(bad[k], poison, f16_saturate(V::f32_to_f16_hw(scale))));
      V::store_u16(hm, V::select_i(bad[k], poison, f16_saturate(V::f32_to_f16_hw(lo))));
      std::memcpy(dst + K::scale_offset(head_dim, c0), hs, sizeof hs);  // little-endian fp16 fields
      std::memcpy(dst + K::min_offset(head_dim, c0), hm, sizeof hm);
      s[k] = f16_load(hs);
      m[k] = f16_load(hm);
      coded[k] = V::gt_f(s[k], zf);  // false for s == 0 and for a poisoned (NaN) scale
    }
    for (int w = 0; w * per_word < G; ++w) {
      vi acc[kb];
      for (int k = 0; k < nv; ++k) acc[k] = zero;
      for (int j = 0; j < per_word && w * per_word + j < G; ++j) {
        float const* const row = x + (w * per_word + j) * ts + cb;
        for (int k = 0; k < nv; ++k) {
          vi const q = V::select_i(coded[k], kivi_codes(V::load(row + k * W), s[k], m[k], top), zero);
          acc[k] = V::or_i(acc[k], V::sll_n(q, j * B));
        }
      }
      for (int k = 0; k < nv; ++k) {
        alignas(64) std::int32_t words[std::size_t{W}];
        V::store_i(words, acc[k]);
        u8* const codes = dst + K::codes_offset(head_dim, cb + k * W) + 4 * w;
        if constexpr (K::code_bytes % 4 == 0) {  // whole words: fixed-size stores
          for (int l = 0; l < W; ++l) std::memcpy(codes + l * K::code_bytes, &words[l], 4);
        } else {
          int const nbytes = K::code_bytes - 4 * w < 4 ? K::code_bytes - 4 * w : 4;
          for (int l = 0; l < W; ++l)
            std::memcpy(codes + l * K::code_bytes, &words[l], static_cast<std::size_t>(nbytes));
        }
      }
    }
  }

  template <int B, int G>
  static void kivi_key_decode_tokens(u8 const* tile, int head_dim, int first, int count, float* y,
                                     std::ptrdiff_t ys) noexcept {
    using K = kivi_key<B, G>;
    constexpr bool gather_ok = K::code_bytes % 4 == 0;  // every 32-bit word lies inside its channel
    vi const mask = V::set1_i(detail::kivi_max_code(B));
    int const full = head_dim / W * W;
    for (int cb = 0; cb < full; cb += kb * W) {
      int const nv = (full - cb) / W < kb ? (full - cb) / W : kb;
      vf s[kb], m[kb];
      vi word[kb];
      for (int k = 0; k < nv; ++k) {
        s[k] = f16_load(reinterpret_cast<u16 const*>(tile + K::scale_offset(head_dim, cb + k * W)));
        m[k] = f16_load(reinterpret_cast<u16 const*>(tile + K::min_offset(head_dim, cb + k * W)));
      }
      int cur = -1;
      for (int i = 0; i < count; ++i) {
        int const t = first + i;
        int const w = (t * B) >> 5;
        if (w != cur) {
          cur = w;
          for (int k = 0; k < nv; ++k) {
            u8 const* const codes = tile + K::codes_offset(head_dim, cb + k * W) + 4 * w;
            if constexpr (gather_ok) {
              word[k] = V::gather_u32(codes, K::code_bytes);
            } else {
              alignas(64) std::int32_t tw[std::size_t{W}] = {};
              int const nb = K::code_bytes - 4 * w < 4 ? K::code_bytes - 4 * w : 4;
              for (int l = 0; l < W; ++l) std::memcpy(&tw[l], codes + l * K::code_bytes, static_cast<std::size_t>(nb));
              word[k] = V::load_i(tw);
            }
          }
        }
        int const shift = (t * B) & 31;
        float* const row = y + i * ys + cb;
        for (int k = 0; k < nv; ++k)
          V::store(row + k * W, kivi_values(V::and_i(V::srl_n(word[k], shift), mask), s[k], m[k]));
      }
    }
    for (int c = full; c < head_dim; ++c) {  // remaining channels: the reference
      kivi_scale_min const p = K::group_params(tile, head_dim, c);
      for (int i = 0; i < count; ++i)
        y[i * ys + c] = detail::kivi_value(K::code(tile, head_dim, c, first + i), p.scale, p.min);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // The rotation R (FORMATS.md §6.1)
  //
  // Every element goes through the reference's operations in the reference's order: its sign, the
  // butterfly stages h = 1, 2, 4, ... (strides below W inside a vector, V::butterfly; the others
  // between whole vectors), each a rounded add or subtract with the reference's operands, then the
  // product by c_n (V::mul, opaque: nothing can be fused with it). Blocks smaller than W run the
  // reference's loops.

  /// The sign bits of channels i .. i + W - 1 (i a multiple of W) in the low bits.
  static std::uint64_t sign_bits(std::uint64_t const* words, int i) noexcept { return words[i / 64] >> (i % 64); }

  /// The butterfly stages of strides 1 .. W / 2 of one vector.
  KVQ_CPU_ALWAYS_INLINE static vf butterflies_in_vector(vf v) noexcept {
    if constexpr (W >= 2) v = V::template butterfly<1>(v);
    if constexpr (W >= 4) v = V::template butterfly<2>(v);
    if constexpr (W >= 8) v = V::template butterfly<4>(v);
    if constexpr (W >= 16) v = V::template butterfly<8>(v);
    return v;
  }

  /// The butterfly stages of strides W .. (NV / 2) W between the vectors v[0 .. NV).
  template <int NV>
  KVQ_CPU_ALWAYS_INLINE static void butterflies_across(vf* v) noexcept {
    static_for<std::bit_width(unsigned{NV}) - 1>([&]<int S>() KVQ_CPU_ALWAYS_INLINE {
      constexpr int hv = 1 << S;
      static_for<NV / 2>([&]<int P>() KVQ_CPU_ALWAYS_INLINE {
        constexpr int j = P / hv * 2 * hv + P % hv;  // the P-th index with (j & hv) == 0
        vf const a = v[j], b = v[j + hv];
        v[j] = V::add(a, b);
        v[j + hv] = V::sub(a, b);
      });
    });
  }

  /// Rotates the block x: (NV W), channel i0 of the row, in registers (NV <= 16) into y (x or a
  /// block that does not overlap it).
  template <bool Inverse, int NV>
  KVQ_CPU_ALWAYS_INLINE static void rotate_block_in_registers(float const* x, float* y, int i0,
                                                              std::uint64_t const* words, float c) noexcept {
    vf v[std::size_t{NV}];
    static_for<NV>([&]<int J>() KVQ_CPU_ALWAYS_INLINE {
      v[J] = V::load(x + J * W);
      if constexpr (!Inverse) v[J] = V::flip_signs(v[J], sign_bits(words, i0 + J * W));
      v[J] = butterflies_in_vector(v[J]);
    });
    butterflies_across<NV>(v);
    vf const cv = V::set1(c);
    static_for<NV>([&]<int J>() KVQ_CPU_ALWAYS_INLINE {
      vf r = V::mul(v[J], cv);
      if constexpr (Inverse) r = V::flip_signs(r, sign_bits(words, i0 + J * W));
      V::store(y + J * W, r);
    });
  }

  /// Rotates the block x: (n), n > 16 W, channel i0 of the row: the stages up to stride 8 W in
  /// registers 16 vectors at a time, then one pass over memory per larger stride.
  template <bool Inverse>
  static void rotate_block_in_memory(float* x, int n, int i0, std::uint64_t const* words, float c) noexcept {
    int const nv = n / W;
    for (int g = 0; g < nv; g += 16) {
      vf v[16];
      for (int j = 0; j < 16; ++j) {
        v[j] = V::load(x + (g + j) * W);
        if constexpr (!Inverse) v[j] = V::flip_signs(v[j], sign_bits(words, i0 + (g + j) * W));
        v[j] = butterflies_in_vector(v[j]);
      }
      butterflies_across<16>(v);
      for (int j = 0; j < 16; ++j) V::store(x + (g + j) * W, v[j]);
    }
    for (int hv = 16; hv < nv; hv *= 2)
      for (int j = 0; j < nv; ++j)
        if ((j & hv) == 0) {
          vf const a = V::load(x + j * W), b = V::load(x + (j + hv) * W);
          V::store(x + j * W, V::add(a, b));
          V::store(x + (j + hv) * W, V::sub(a, b));
        }
    vf const cv = V::set1(c);
    for (int j = 0; j < nv; ++j) {
      vf y = V::mul(V::load(x + j * W), cv);
      if constexpr (Inverse) y = V::flip_signs(y, sign_bits(words, i0 + j * W));
      V::store(x + j * W, y);
    }
  }

  /// The rotation blocks of a head_dim (offset, size, c_n), computed once for a batch of rows.
  struct rotation_plan {
    int count = 0;
    int offset[32];
    int size[32];
    float scale[32];
    explicit rotation_plan(int head_dim) noexcept {
      for (int o = 0; o < head_dim && count < 32; ++count) {
        offset[count] = o;
        size[count] = detail::rotation_block_size(head_dim, o);
        scale[count] = detail::rotation_scale(size[count]);
        o += size[count];
      }
    }
  };

  /// Calls f.template operator()<NV>() when a block of n coordinates is NV = 1, 2, 4, 8 or 16
  /// whole vectors (rotate_block_in_registers' sizes) and returns true; false for other sizes.
  template <class F>
  KVQ_CPU_ALWAYS_INLINE static bool with_register_block(int n, F&& f) {
    switch (n % W == 0 ? n / W : 0) {
      case 1:
        f.template operator()<1>();
        return true;
      case 2:
        f.template operator()<2>();
        return true;
      case 4:
        f.template operator()<4>();
        return true;
      case 8:
        f.template operator()<8>();
        return true;
      case 16:
        f.template operator()<16>();
        return true;
      default:
        return false;
    }
  }

  /// R x (Inverse: R^T x) of one row x: (head_dim) in place, its blocks given by `plan`.
  template <bool Inverse>
  static void rotate_row(float* x, rotation_plan const& plan, std::uint64_t const* words) noexcept {
    for (int k = 0; k < plan.count; ++k) {
      int const o = plan.offset[k];
      int const n = plan.size[k];
      float const c = plan.scale[k];
      float* const b = x + o;
      if (with_register_block(n, [&]<int NV>() { rotate_block_in_registers<Inverse, NV>(b, b, o, words, c); }))
        continue;
      if (n > 16 * W) {
        rotate_block_in_memory<Inverse>(b, n, o, words, c);
      } else {  // a block smaller than a vector: the reference's loops
        if constexpr (!Inverse)
          for (int i = 0; i < n; ++i) b[i] = detail::rotation_apply_sign(b[i], words[(o + i) / 64], (o + i) % 64);
        detail::rotation_butterflies(b, n);
        for (int i = 0; i < n; ++i) b[i] = detail::mul_rn(b[i], c);
        if constexpr (Inverse)
          for (int i = 0; i < n; ++i) b[i] = detail::rotation_apply_sign(b[i], words[(o + i) / 64], (o + i) % 64);
      }
    }
  }

  /// R x (Inverse: R^T x) of `rows` rows x + r * xs: (head_dim) into y + r * ys: in place when y
  /// is x (and ys xs), else rows that do not overlap x's.
  template <bool Inverse>
  static void rotate_rows(float const* x, std::ptrdiff_t xs, float* y, std::ptrdiff_t ys, std::int64_t rows,
                          int head_dim, std::uint64_t const* words) noexcept {
    rotation_plan const plan(head_dim);
    // One block of 1-16 vectors (head_dim 64 or 128 and the like): the block's kernel chosen once,
    // reading x and writing y in one pass.
    if (plan.count == 1 && with_register_block(plan.size[0], [&]<int NV>() {
          for (std::int64_t r = 0; r < rows; ++r)
            rotate_block_in_registers<Inverse, NV>(x + r * xs, y + r * ys, 0, words, plan.scale[0]);
        }))
      return;
    for (std::int64_t r = 0; r < rows; ++r) {
      if (y != x) std::memcpy(y + r * ys, x + r * xs, static_cast<std::size_t>(head_dim) * sizeof(float));
      rotate_row<Inverse>(y + r * ys, plan, words);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // tq codebooks (tq_codebook<B>, FORMATS.md §6.2 steps 2-8)
  //
  // Encoding: the 32 partial sums of squares are 32 / W vectors (products rounded, then added, in
  // the reference's order), reduced by the reference's tree; each z = y * k is a rounded product;
  // its code, the number of boundaries below it, is found by a binary search over the sorted
  // boundaries (a table lookup per step), which counts the same boundaries as the reference's
  // linear scan; the centroid norm is summed as the squares. Blocks smaller than W run the
  // reference's block function.

  /// The codebook tables of B bits as the policy's 16-entry tables.
  template <int B>
  struct tq_tables {
    static constexpr int levels = 1 << B;
    float centroid[16];
    float boundary[15];
    typename V::table16 centroids;  // t[i] = c[i mod 2^B]
    typename V::table16 above;      // t[i] = the boundary below code i: t_(i-1) (t[0] unused)
    tq_tables() noexcept {
      detail::tq_tables(B, centroid, boundary);
      alignas(64) float c16[16], b16[16];
      for (int i = 0; i < 16; ++i) {
        int const k = i % levels;
        c16[i] = centroid[k];
        b16[i] = k == 0 ? 0.0f : boundary[k - 1];
      }
      centroids = V::make_table16(c16);
      above = V::make_table16(b16);
    }
  };

  /// The codes of z: the number of boundaries t_j < z (NaN: 0), by binary search.
  template <int B>
  static vi tq_codes_of(tq_tables<B> const& t, vf z) noexcept {
    vi code = V::set1_i(0);
    auto const step = [&](int s) {
      vi const cand = V::add_i(code, V::set1_i(s));
      code = V::select_i(V::gt_f(z, V::template lookup<B>(t.above, cand)), cand, code);
    };
    if constexpr (B >= 4) step(8);
    if constexpr (B >= 3) step(4);
    step(2);
    step(1);
    return code;
  }

  /// Writes the W codes of coordinates c .. c + W - 1 (c a multiple of W) into the zeroed bit stream.
  template <int B>
  static void tq_put_codes(u8* codes, int c, vi q) noexcept {
    if constexpr (B != 3 || W >= 8) {
      V::template store_codes<B>(codes + B * c / 8, q);
    } else {
      alignas(64) std::int32_t t[std::size_t{W}];
      V::store_i(t, q);
      for (int g = 0; g < W; g += 4) {  // 4 codes, 12 bits
        auto const w = static_cast<std::uint32_t>(t[g] | (t[g + 1] << 3) | (t[g + 2] << 6) | (t[g + 3] << 9));
        int const bit = 3 * (c + g);
        std::uint32_t const sh = w << (bit % 8);
        codes[bit / 8] = static_cast<u8>(codes[bit / 8] | (sh & 0xffu));
        codes[bit / 8 + 1] = static_cast<u8>(codes[bit / 8 + 1] | ((sh >> 8) & 0xffu));
      }
    }
  }

  /// The 32 partial sums p (32 / W vectors, partial l at lane l % W of p[l / W]) reduced by the
  /// reference's tree: p_l += p_(l + w) for l < w, w = 16, 8, 4, 2, 1 (between vectors while
  /// w >= W, then the lower lanes of butterfly stages, whose lane l < w is p_l + p_(l + w)).
  KVQ_CPU_ALWAYS_INLINE static float tq_reduce(vf const* p) noexcept {
    vf q[std::size_t{32 / W}];
    for (int j = 0; j < 32 / W; ++j) q[j] = p[j];
    for (int n = 32 / W; n > 1; n /= 2)
      for (int j = 0; j < n / 2; ++j) q[j] = V::add(q[j], q[j + n / 2]);
    vf v = q[0];
    if constexpr (W >= 16) v = V::template butterfly<8>(v);
    if constexpr (W >= 8) v = V::template butterfly<4>(v);
    if constexpr (W >= 4) v = V::template butterfly<2>(v);
    if constexpr (W >= 2) v = V::template butterfly<1>(v);
    alignas(64) float lane[std::size_t{W}];
    V::store(lane, v);
    return lane[0];
  }

  /// A finite rotation block of n >= W coordinates y, coordinate `offset` of its row, whose codes
  /// go into the row's zeroed code bytes `codes` and whose scale bits go to `scale`.
  struct tq_unit {
    float const* y;
    int offset;
    int n;
    u8* codes;
    u8* scale;
  };

  /// The sum of squares of a block's coordinates (or centroids) as the reference's 32 partials.
  template <class Value>
  KVQ_CPU_ALWAYS_INLINE static void tq_squares(int n, vf* p, Value&& value) noexcept {
    constexpr int P = 32 / W;  // partial-sum vectors
    for (int j = 0; j < P; ++j) p[j] = V::set1(0.0f);
    for (int i0 = 0; i0 < n; i0 += 32)
      for (int j = 0; j < P; ++j)
        if (i0 + j * W < n) {  // (a block of 16 or 8 channels fills only the first vectors)
          vf const v = value(i0 + j * W);
          p[j] = V::add(p[j], V::mul(v, v));
        }
  }

  /// Encodes U units, each phase over all of them in turn: the norms, then the codes and the
  /// centroid norms, then the scales (the serial sqrt / divide chains of the units overlap).
  template <int B, int U>
  static void tq_encode_units(tq_tables<B> const& t, tq_unit const* u) noexcept {
    constexpr int P = 32 / W;
    vf p[std::size_t{U}][std::size_t{P}];
    float nu[std::size_t{U}];
    static_for<U>([&]<int R>() KVQ_CPU_ALWAYS_INLINE {
      tq_squares(u[R].n, p[R], [&](int i) KVQ_CPU_ALWAYS_INLINE { return V::load(u[R].y + i); });
    });
    static_for<U>([&]<int R>() KVQ_CPU_ALWAYS_INLINE { nu[R] = detail::tq_sqrt(tq_reduce(p[R])); });
    static_for<U>([&]<int R>() KVQ_CPU_ALWAYS_INLINE {
      if (nu[R] == 0.0f) return;  // a block of zeros: scale +0, codes 0
      vf const k = V::set1(detail::div_rn(detail::tq_sqrt(static_cast<float>(u[R].n)), nu[R]));
      tq_squares(u[R].n, p[R], [&](int i) KVQ_CPU_ALWAYS_INLINE {
        vi const q = tq_codes_of<B>(t, V::mul(V::load(u[R].y + i), k));
        tq_put_codes<B>(u[R].codes, u[R].offset + i, q);
        return V::template lookup_symmetric<B>(t.centroids, q);
      });
    });
    // The scales nu / rho rounded to f16 together (finite or +Inf: the conversion is exact RNE).
    alignas(64) float scale[std::size_t{W}] = {};
    alignas(64) u16 bits[std::size_t{W}];
    static_for<U>([&]<int R>() KVQ_CPU_ALWAYS_INLINE {
      if (nu[R] != 0.0f) scale[R] = detail::div_rn(nu[R], detail::tq_sqrt(tq_reduce(p[R])));
    });
    V::store_u16(bits, V::f32_to_f16_hw(V::load(scale)));
    for (int r = 0; r < U; ++r) {
      u[r].scale[0] = static_cast<u8>(bits[r] & 0xffu);
      u[r].scale[1] = static_cast<u8>(bits[r] >> 8);
    }
  }

  template <int B>
  static void tq_encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* dst,
                             std::size_t ds) noexcept {
    tq_tables<B> const t;
    int const blocks = detail::rotation_block_count(hd);
    int const code_bytes = (B * hd + 7) / 8;
    constexpr int U = 4;  // units encoded together
    tq_unit pending[U];
    int m = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      float const* y = x + r * xs;
      u8* const row = dst + static_cast<std::size_t>(r) * ds;
      u8* const codes = row + 2 * blocks;
      std::memset(codes, 0, static_cast<std::size_t>(code_bytes));
      vm bad = V::mask_false();
      int i = 0;
      for (; i + W <= hd; i += W) bad = V::mask_or(bad, nonfinite(V::load(y + i)));
      bool finite = !V::any(bad);
      for (; i < hd; ++i) finite = finite && detail::is_finite_f32(y[i]);
      if (!finite) {
        for (int b = 0; b < blocks; ++b) detail::tq_set_scale_bits(row, b, detail::tq_poisoned_scale);
        continue;
      }
      int block = 0;
      for (int o = 0; o < hd; ++block) {
        int const n = detail::rotation_block_size(hd, o);
        if (n >= W) {
          pending[m++] = {y + o, o, n, codes, row + 2 * block};
          if (m == U) {
            tq_encode_units<B, U>(t, pending);
            m = 0;
          }
        } else {
          detail::tq_set_scale_bits(row, block, detail::tq_encode_block(B, y + o, o, n, codes, t.centroid, t.boundary));
        }
        o += n;
      }
    }
    for (int k = 0; k < m; ++k) tq_encode_units<B, 1>(t, pending + k);
  }

  template <int B>
  static void tq_decode_rows(u8 const* src, std::size_t ss, std::int64_t rows, int hd, float* y,
                             std::ptrdiff_t ys) noexcept {
    tq_tables<B> const t;
    int const sb = detail::tq_scale_bytes(hd);
    for (std::int64_t r = 0; r < rows; ++r) {
      u8 const* const row = src + static_cast<std::size_t>(r) * ss;
      float* const out = y + r * ys;
      int block = 0;
      for (int o = 0; o < hd; ++block) {
        int const n = detail::rotation_block_size(hd, o);
        float const g = detail::tq_block_scale(row, block);
        if (n >= W) {
          vf const gv = V::set1(g);
          for (int i = o; i < o + n; i += W)
            V::store(
                out + i,
                V::mul(V::template lookup_symmetric<B>(t.centroids, V::template stream_codes<B>(row + sb, i)), gv));
        } else {
          for (int i = o; i < o + n; ++i) out[i] = detail::mul_rn(t.centroid[detail::tq_code(B, row, hd, i)], g);
        }
        o += n;
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Dispatch by codec

  /// True when C has a SIMD row kernel here.
  template <class C>
  static constexpr bool has_rows =
      std::is_same_v<C, f32_codec> || std::is_same_v<C, f16_codec> || std::is_same_v<C, q8_0> ||
      std::is_same_v<C, q4_0> || std::is_same_v<C, int8_sym> || std::is_same_v<C, fp8_e4m3> ||
      std::is_same_v<C, fp8_e5m2> || std::is_same_v<C, mxfp4> || std::is_same_v<C, nvfp4> ||
      kivi_value_traits<C>::value || tq_codebook_traits<C>::value;

  template <row_codec C>
  static void encode_rows(float const* x, std::ptrdiff_t xs, std::int64_t rows, int hd, u8* dst, std::size_t ds,
                          typename C::params_type const& p) noexcept {
    auto const bytes = C::geometry(hd).bytes();
    // Elementwise codecs over contiguous rows: one long run (no per-row tails).
    bool const packed = xs == hd && ds == bytes;
    if constexpr (std::is_same_v<C, f32_codec>) {
      if (packed) {
        if (rows > 0) std::memcpy(dst, x, static_cast<std::size_t>(rows) * bytes);
      } else {
        for (std::int64_t r = 0; r < rows; ++r) std::memcpy(dst + static_cast<std::size_t>(r) * ds, x + r * xs, bytes);
      }
    } else if constexpr (std::is_same_v<C, f16_codec>) {
      if (packed)
        to_f16(x, reinterpret_cast<u16*>(dst), rows * hd);
      else
        for (std::int64_t r = 0; r < rows; ++r)
          to_f16(x + r * xs, reinterpret_cast<u16*>(dst + static_cast<std::size_t>(r) * ds), hd);
    } else if constexpr (std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>) {
      constexpr bool e4m3 = std::is_same_v<C, fp8_e4m3>;
      if (packed)
        fp8_encode<e4m3>(x, dst, rows * hd, p);
      else
        for (std::int64_t r = 0; r < rows; ++r)
          fp8_encode<e4m3>(x + r * xs, dst + static_cast<std::size_t>(r) * ds, hd, p);
    } else if constexpr (std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0>) {
      ggml_encode_rows<std::is_same_v<C, q4_0>>(x, xs, rows, hd, dst, ds);
    } else if constexpr (std::is_same_v<C, int8_sym>) {
      for (std::int64_t r = 0; r < rows; ++r) int8_encode_row(x + r * xs, hd, dst + static_cast<std::size_t>(r) * ds);
    } else if constexpr (kivi_value_traits<C>::value) {
      kivi_value_encode_rows<C::bits, C::group>(x, xs, rows, hd, dst, ds);
    } else if constexpr (tq_codebook_traits<C>::value) {
      tq_encode_rows<C::bits>(x, xs, rows, hd, dst, ds);
    } else if constexpr (std::is_same_v<C, mxfp4> || std::is_same_v<C, nvfp4>) {
      fp4_encode_rows<std::is_same_v<C, mxfp4>>(x, xs, rows, hd, dst, ds, p);
    } else {
      scalar::encode_rows<C>(x, xs, rows, hd, dst, ds, p);
    }
  }

  template <row_codec C>
  static void decode_rows(u8 const* src, std::size_t ss, std::int64_t rows, int hd, float* y, std::ptrdiff_t ys,
                          typename C::params_type const& p) noexcept {
    auto const bytes = C::geometry(hd).bytes();
    bool const packed = ys == hd && ss == bytes;
    if constexpr (std::is_same_v<C, f32_codec>) {
      if (packed) {
        if (rows > 0) std::memcpy(y, src, static_cast<std::size_t>(rows) * bytes);
      } else {
        for (std::int64_t r = 0; r < rows; ++r) std::memcpy(y + r * ys, src + static_cast<std::size_t>(r) * ss, bytes);
      }
    } else if constexpr (std::is_same_v<C, f16_codec>) {
      if (packed)
        from_f16(reinterpret_cast<u16 const*>(src), y, rows * hd);
      else
        for (std::int64_t r = 0; r < rows; ++r)
          from_f16(reinterpret_cast<u16 const*>(src + static_cast<std::size_t>(r) * ss), y + r * ys, hd);
    } else if constexpr (std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>) {
      constexpr bool e4m3 = std::is_same_v<C, fp8_e4m3>;
      if (packed)
        fp8_decode<e4m3>(src, y, rows * hd, p);
      else
        for (std::int64_t r = 0; r < rows; ++r)
          fp8_decode<e4m3>(src + static_cast<std::size_t>(r) * ss, y + r * ys, hd, p);
    } else if constexpr (std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0>) {
      for (std::int64_t r = 0; r < rows; ++r)
        ggml_decode_row<std::is_same_v<C, q4_0>>(src + static_cast<std::size_t>(r) * ss, hd, y + r * ys);
    } else if constexpr (std::is_same_v<C, int8_sym>) {
      for (std::int64_t r = 0; r < rows; ++r) int8_decode_row(src + static_cast<std::size_t>(r) * ss, hd, y + r * ys);
    } else if constexpr (kivi_value_traits<C>::value) {
      for (std::int64_t r = 0; r < rows; ++r)
        kivi_value_decode_row<C::bits, C::group>(src + static_cast<std::size_t>(r) * ss, hd, y + r * ys);
    } else if constexpr (tq_codebook_traits<C>::value) {
      tq_decode_rows<C::bits>(src, ss, rows, hd, y, ys);
    } else if constexpr (std::is_same_v<C, mxfp4> || std::is_same_v<C, nvfp4>) {
      fp4_decode_rows<std::is_same_v<C, mxfp4>>(src, ss, rows, hd, y, ys, p);
    } else {
      scalar::decode_rows<C>(src, ss, rows, hd, y, ys, p);
    }
  }

  template <token_group_codec C>
  static void encode_tile(float const* x, std::ptrdiff_t ts, int hd, u8* dst,
                          typename C::params_type const& p) noexcept {
    if constexpr (kivi_key_traits<C>::value)
      kivi_key_encode_tile<C::bits, C::group>(x, ts, hd, dst);
    else
      scalar::encode_tile<C>(x, ts, hd, dst, p);
  }

  template <token_group_codec C>
  static void decode_tile_tokens(u8 const* tile, int hd, int first, int count, float* y, std::ptrdiff_t ys,
                                 typename C::params_type const& p) noexcept {
    if constexpr (kivi_key_traits<C>::value)
      kivi_key_decode_tokens<C::bits, C::group>(tile, hd, first, count, y, ys);
    else
      scalar::decode_tile_tokens<C>(tile, hd, first, count, y, ys, p);
  }

  template <cpu_element T>
  static void convert_to_f32(T const* src, float* dst, std::int64_t n) noexcept {
    if constexpr (std::is_same_v<T, float>)
      scalar::convert_to_f32(src, dst, n);
    else if constexpr (std::is_same_v<T, f16>)
      from_f16(reinterpret_cast<u16 const*>(src), dst, n);
    else
      from_bf16(reinterpret_cast<u16 const*>(src), dst, n);
  }

  template <cpu_element T>
  static void convert_from_f32(float const* src, T* dst, std::int64_t n) noexcept {
    if constexpr (std::is_same_v<T, float>)
      scalar::convert_from_f32(src, dst, n);
    else if constexpr (std::is_same_v<T, f16>)
      to_f16(src, reinterpret_cast<u16*>(dst), n);
    else
      to_bf16(src, reinterpret_cast<u16*>(dst), n);
  }
};

}  // namespace simd
}  // namespace cpu_kernels
KVQ_NAMESPACE_END

/// Defines, in the current namespace, the public kernel entry points of an ISA over its `ops`
/// policy (the same names and signatures as kvq::cpu_kernels and kvq::cpu_kernels::scalar).
#define KVQ_CPU_DEFINE_ENTRY_POINTS(OPS)                                                                              \
  template <::kvq::row_codec C>                                                                                       \
  void encode_rows(float const* x, std::ptrdiff_t x_stride, std::int64_t rows, int head_dim, std::uint8_t* dst,       \
                   std::size_t dst_stride, typename C::params_type const& p = {}) noexcept {                          \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template encode_rows<C>(x, x_stride, rows, head_dim, dst, dst_stride, \
                                                                        p);                                           \
  }                                                                                                                   \
  template <::kvq::row_codec C>                                                                                       \
  void decode_rows(std::uint8_t const* src, std::size_t src_stride, std::int64_t rows, int head_dim, float* y,        \
                   std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {                         \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template decode_rows<C>(src, src_stride, rows, head_dim, y, y_stride, \
                                                                        p);                                           \
  }                                                                                                                   \
  template <::kvq::token_group_codec C>                                                                               \
  void encode_tile(float const* x, std::ptrdiff_t token_stride, int head_dim, std::uint8_t* dst,                      \
                   typename C::params_type const& p = {}) noexcept {                                                  \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template encode_tile<C>(x, token_stride, head_dim, dst, p);           \
  }                                                                                                                   \
  template <::kvq::token_group_codec C>                                                                               \
  void decode_tile_tokens(std::uint8_t const* tile, int head_dim, int first_token, int count, float* y,               \
                          std::ptrdiff_t y_stride, typename C::params_type const& p = {}) noexcept {                  \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template decode_tile_tokens<C>(tile, head_dim, first_token, count, y, \
                                                                               y_stride, p);                          \
  }                                                                                                                   \
  template <::kvq::cpu_kernels::cpu_element T>                                                                        \
  void convert_to_f32(T const* src, float* dst, std::int64_t n) noexcept {                                            \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::convert_to_f32(src, dst, n);                                          \
  }                                                                                                                   \
  template <::kvq::cpu_kernels::cpu_element T>                                                                        \
  void convert_from_f32(float const* src, T* dst, std::int64_t n) noexcept {                                          \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::convert_from_f32(src, dst, n);                                        \
  }                                                                                                                   \
  inline void convert_to_f16_satfinite(float const* src, ::kvq::f16* dst, std::int64_t n) noexcept {                  \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::to_f16_satfinite(src, reinterpret_cast<std::uint16_t*>(dst), n);      \
  }                                                                                                                   \
  inline void round_to_f16_satfinite(float const* src, float* dst, std::int64_t n) noexcept {                         \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::round_f16_satfinite(src, dst, n);                                     \
  }                                                                                                                   \
  inline void rotate_forward_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,                   \
                                  std::uint64_t const* words) noexcept {                                              \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template rotate_rows<false>(x, stride, x, stride, rows, head_dim,     \
                                                                            words);                                   \
  }                                                                                                                   \
  inline void rotate_forward_rows(float const* x, std::ptrdiff_t x_stride, float* y, std::ptrdiff_t y_stride,         \
                                  std::int64_t rows, int head_dim, std::uint64_t const* words) noexcept {             \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template rotate_rows<false>(x, x_stride, y, y_stride, rows, head_dim, \
                                                                            words);                                   \
  }                                                                                                                   \
  inline void rotate_inverse_rows(float* x, std::int64_t rows, std::ptrdiff_t stride, int head_dim,                   \
                                  std::uint64_t const* words) noexcept {                                              \
    ::kvq::cpu_kernels::simd::simd_codecs<OPS>::template rotate_rows<true>(x, stride, x, stride, rows, head_dim,      \
                                                                           words);                                    \
  }
