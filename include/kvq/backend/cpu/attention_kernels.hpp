// kvq: the CPU decode-attention kernel, written once over a vector-operations policy `V` (one per
// ISA: avx2.hpp, avx512.hpp, neon.hpp), used by attention.hpp.
//
// One call attends the `group` query heads that share one kv head to a token range, updating their
// online-softmax state (unnormalised output, running max, running sum):
//   * the range is walked in tiles of `tile` tokens aligned to multiples of `tile`; every key and
//     value byte of a tile is read once and used by every query head of the group;
//   * keys: row codecs are decoded into an L1-resident f32 tile (the f32 cache is read in place) and
//     dotted with each head, or decoded in registers for a few heads (the codecs with a row loader
//     below; tq codebooks by a register-table lookup of the centroids); KIVI keys skip decoding:
//     with channel-major codes, the logits of a tile are sum_c (q[c] * scale_c) * code[c][t] +
//     sum_c q[c] * min_c, so the query is scaled per channel once per tile and multiplied straight
//     into the codes;
//   * with a q8_0 query, q8_0 / q4_0 / int8 keys use exact integer block dot products (VNNI where
//     the flags allow), W tokens at a time: each token's block sum lands in one lane (transposed
//     reduction), and the lanes take the reference's float steps block by block, so those logits
//     equal the scalar reference bit for bit;
//   * softmax is updated once per tile per head (vector exp); values are decoded into an f32 tile
//     and accumulated with FMAs; everything accumulates in fp32;
//   * many rows (multi-token attention: query tokens x heads) take transposed tiles instead
//     (attend_transposed): the query transposed once, logits as (tokens, rows) from outer products,
//     the softmax on vectors of rows, p . V from the transposed probabilities.
// Results match attention.hpp's scalar reference within fp32 rounding (FMA contraction, a
// polynomial exp with ~2 ulp error, another summation order); a tile whose logits hold a NaN or +Inf
// takes the reference's per-token path so the NaN/Inf semantics are the reference's.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../codec/fp4.hpp"
#include "../../codec/fp8.hpp"
#include "../../codec/int8.hpp"
#include "../../codec/kivi.hpp"
#include "../../codec/passthrough.hpp"
#include "../../codec/q4_0.hpp"
#include "../../codec/q8_0.hpp"
#include "../../codec/tq_codebook.hpp"
#include "../../detail/block_layouts.h"
#include "../../detail/host_vector.hpp"
#include "simd_codecs.hpp"

KVQ_NAMESPACE_BEGIN
namespace cpu_kernels {

/// Where the tokens of one (layer, kv head) live, as the attention kernel reads them: token t <
/// `quantized` is in `units` (row t, or tile t / G for KIVI keys); later tokens are f16 rows of
/// `residual`, token t at ring slot (residual_first + t - quantized) % residual_capacity.
struct token_source {
  std::uint8_t const* units = nullptr;
  std::size_t unit_bytes = 0;
  std::int64_t quantized = 0;
  std::uint16_t const* residual = nullptr;
  std::int64_t residual_capacity = 1;
  std::int64_t residual_first = 0;
};

/// One attention call's inputs that do not depend on the kv head.
struct attention_call {
  int head_dim = 0;
  int group = 1;         ///< query rows attended together (query heads per kv head, times query tokens)
  float scale = 1.0f;    ///< logit = scale * q.k (then softcap)
  float softcap = 0.0f;  ///< > 0: logit = softcap * tanh(logit / softcap)
  bool f16_probabilities = false;
  /// Probabilities times the value scales as 8-bit integers per tile (probability_precision::i8):
  /// see integer_weights; used for integer_value_codec values, others take f32 probabilities.
  bool i8_weights = false;
  /// Per-row logit offsets (nullptr: none): row r's logit is scale * q.k + row_offset[r], then
  /// softcap (a centered key codec's scale * q.mu, codec/centered.hpp).
  float const* row_offset = nullptr;
  // Per-row masks of a multi-token attention, all optional (nullptr: none). Token indices are
  // absolute: the source's token t is token `token_offset + t` here. After scale and softcap,
  // row r's logit of token j becomes -Inf unless row_begin[r] <= j < row_end[r] (when given) and
  // row_allow[r][j] != 0 (when given), and row_bias[r][j] is added to it (when given).
  std::int64_t token_offset = 0;
  std::int64_t const* row_begin = nullptr;
  std::int64_t const* row_end = nullptr;
  float const* const* row_bias = nullptr;
  std::uint8_t const* const* row_allow = nullptr;

  /// True when some row mask is set.
  auto masked() const noexcept -> bool {
    return row_begin != nullptr || row_end != nullptr || row_bias != nullptr || row_allow != nullptr;
  }

  /// Applies row r's masks to the n logits s of source tokens [t0, t0 + n) (already scaled and
  /// softcapped); returns false when the row attends none of them.
  auto apply_masks(int r, std::int64_t t0, float* s, int n) const noexcept -> bool {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    std::int64_t const j0 = token_offset + t0;
    std::int64_t lo = 0, hi = n;
    if (row_begin != nullptr) lo = std::clamp<std::int64_t>(row_begin[r] - j0, 0, n);
    if (row_end != nullptr) hi = std::clamp<std::int64_t>(row_end[r] - j0, 0, n);
    if (hi <= lo) {
      std::fill_n(s, n, neg_inf);
      return false;
    }
    std::fill_n(s, lo, neg_inf);
    std::fill_n(s + hi, n - hi, neg_inf);
    if (row_allow != nullptr) {
      std::uint8_t const* a = row_allow[r] + j0;
      for (std::int64_t t = lo; t < hi; ++t)
        if (a[t] == 0) s[t] = neg_inf;
    }
    if (row_bias != nullptr) {
      float const* b = row_bias[r] + j0;
      for (std::int64_t t = lo; t < hi; ++t) s[t] += b[t];
    }
    return true;
  }

  /// True when row r's masks leave every logit of source tokens [t0, t0 + n) as it is.
  auto unmasked(int r, std::int64_t t0, int n) const noexcept -> bool {
    std::int64_t const j0 = token_offset + t0;
    return row_bias == nullptr && row_allow == nullptr && (row_begin == nullptr || row_begin[r] <= j0) &&
           (row_end == nullptr || j0 + n <= row_end[r]);
  }
};

/// Online-softmax state of the group's heads: out (group, head_dim), max (group), sum (group).
struct attention_state {
  float* out = nullptr;
  float* max = nullptr;
  float* sum = nullptr;
};

/// Tokens per tile of the attention kernel.
inline constexpr int attention_kernel_tile = 32;

/// Working memory of the attention kernel, reused across calls of one attention.
struct attention_scratch {
  detail::vector<float> keys;            // (tile, head_dim)
  detail::vector<float> values;          // (tile, head_dim)
  detail::vector<float> logits;          // (group, tile)
  detail::vector<float> scaled;          // (4, head_dim): query scaled per KIVI channel
  detail::vector<float> probs;           // (group, tile)
  detail::vector<float> saved;           // (group, head_dim)
  detail::vector<float> special_values;  // (tile, head_dim)
  detail::vector<char> special;          // (group)
  detail::vector<float> dense;           // (tile, head_dim): values decoded once for many rows
  detail::vector<float> folded_query;    // (group, head_dim): the query times an fp8 key scale
  detail::vector<float> weights;         // (group, tile): the probabilities times an fp8 value scale
  detail::vector<float> q_scale;         // (group, blocks): a q8_0 query's block scales as f32
  detail::vector<std::int32_t> q_sum;    // (group, blocks): its block code sums
  // Many query rows (simd_attention::attend_transposed), rows padded to whole vectors (rp):
  detail::vector<float> query_t;   // (head_dim, rp): the query transposed
  detail::vector<float> logits_t;  // (tile, rp)
  detail::vector<float> probs_t;   // (tile, rp)
  detail::vector<float> rows_t;    // (7, rp): max, sum, correction, offset, first and end token, special
  void reserve(int head_dim, int group) {
    dense.resize(static_cast<std::size_t>(attention_kernel_tile) * static_cast<std::size_t>(head_dim));
    special_values.resize(static_cast<std::size_t>(attention_kernel_tile) * static_cast<std::size_t>(head_dim));
    std::size_t const td = static_cast<std::size_t>(attention_kernel_tile) * static_cast<std::size_t>(head_dim);
    keys.resize(td);
    values.resize(td);
    logits.resize(static_cast<std::size_t>(group) * attention_kernel_tile);
    scaled.resize(4 * static_cast<std::size_t>(head_dim));
  }
};

/// e^x for x <= 0 exactly as simd_attention::exp_nonpositive computes each lane (the same
/// constants and steps, fused where it fuses): the probabilities integer weights are rounded from,
/// so the scalar reference and every ISA round the same values.
inline auto exp_nonpositive_scalar(float x) noexcept -> float {
  bool const tiny = -87.3f > x;
  x = std::max(x, -87.3f);
  float const nf = std::nearbyint(x * 1.44269504088896341f);
  auto const n = static_cast<std::int32_t>(nf);
  float r = std::fma(nf, -0.693359375f, x);
  r = std::fma(nf, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  float const rr = r * r;
  p = std::fma(p, rr, r + 1.0f);
  float const two_n = std::bit_cast<float>(static_cast<std::uint32_t>(n + 127) << 23);
  return tiny ? 0.0f : p * two_n;
}

/// True for the value codecs whose rows are integer codes times one scale per (token, scale
/// group): with probability_precision::i8 their P·V products run on integers.
template <class C>
inline constexpr bool integer_value_codec =
    std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0> || std::is_same_v<C, int8_sym>;

/// The codes and scales of an integer_value_codec row: channels [g · group(d), (g + 1) · group(d))
/// share the scale of scale group g; value = code · scale.
template <class C>
struct integer_value_layout {
  static_assert(integer_value_codec<C>, "integer_value_layout: not an integer value codec");
  static constexpr std::size_t block_bytes =
      std::is_same_v<C, q8_0> ? sizeof(detail::block_q8_0) : sizeof(detail::block_q4_0);
  /// Channels per scale group (a q8_0 / q4_0 block, or the whole int8 row).
  static constexpr auto group(int d) noexcept -> int {
    if constexpr (std::is_same_v<C, int8_sym>)
      return d;
    else
      return 32;
  }
  /// The scale of group g of `row`.
  static auto scale(std::uint8_t const* row, int g) noexcept -> float {
    if constexpr (std::is_same_v<C, int8_sym>) {
      float x;
      std::memcpy(&x, row, 4);
      return x;
    } else {
      std::uint16_t h;
      std::memcpy(&h, row + block_bytes * static_cast<std::size_t>(g), 2);
      return detail::f16_bits_to_f32(h);
    }
  }
  /// The signed code of channel c of `row`.
  static auto code(std::uint8_t const* row, int c) noexcept -> int {
    if constexpr (std::is_same_v<C, int8_sym>) {
      return static_cast<std::int8_t>(row[detail::int8_row_header_bytes + static_cast<std::size_t>(c)]);
    } else {
      std::uint8_t const* qs = row + block_bytes * static_cast<std::size_t>(c / 32) + 2;
      if constexpr (std::is_same_v<C, q8_0>) {
        return static_cast<std::int8_t>(qs[c % 32]);
      } else {
        int const j = c % 32;
        return (j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4)) - 8;
      }
    }
  }
};

/// Integer weights of one (row, scale group) of a tile (probability_precision::i8): with x[t] =
/// e[t] · s[t] (probability times the token's value scale, rounded to f32) and amax = max |x[t]|,
/// w[t] = round-to-nearest-even(x[t] · (127 / amax)), in [-127, 127]. Returns the step amax / 127,
/// by which the integer sums of w[t] · code are multiplied; 0 when every x[t] is 0 (nothing to
/// add); NaN when some x[t] or 127 / amax is not finite (the caller then adds the f32 products
/// e[t] · value, as with f32 probabilities).
inline auto integer_weights(float const* e, float const* s, int n, std::int8_t* w) noexcept -> float {
  float x[attention_kernel_tile];
  float amax = 0.0f;
  bool finite = true;
  for (int t = 0; t < n; ++t) {
    x[t] = detail::mul_rn(e[t], s[t]);
    finite = finite && detail::is_finite_f32(x[t]);
    amax = std::max(amax, std::fabs(x[t]));
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 0.0f;
  float const inv = 127.0f / amax;
  if (!detail::is_finite_f32(inv)) return std::numeric_limits<float>::quiet_NaN();
  for (int t = 0; t < n; ++t)
    w[t] = static_cast<std::int8_t>(static_cast<int>(std::nearbyint(detail::mul_rn(x[t], inv))));
  return amax / 127.0f;
}

namespace simd {

/// True for the row codecs whose keys have an exact integer dot with a q8_0 query.
template <class C>
inline constexpr bool integer_dot_key =
    std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0> || std::is_same_v<C, int8_sym>;

/// The attention kernel over the vector policy V.
template <class V>
struct simd_attention {
  using vf = typename V::vf;
  using vi = typename V::vi;
  using vm = typename V::vm;
  static constexpr int W = V::W;
  static constexpr int T = attention_kernel_tile;
  /// Whether a table of 16 floats is one register of 16 lanes (AVX-512): the 4-bit loaders then
  /// decode by one permute of the block's values.
  static constexpr bool register_table16 = W == 16 && sizeof(typename V::table16) == sizeof(vf);
  /// From this many query rows on (heads, or tokens x heads), a tile's keys and values are decoded
  /// once into f32 rows instead of in registers for every four rows.
  static constexpr int many_rows = 8;

  // ---------------------------------------------------------------------------------------------
  // Element helpers

  /// e^x for x <= 0 (Cephes-style: x = n ln2 + r, degree-6 polynomial in r, scaled by 2^n);
  /// lanes below -87.3 (and -Inf) give exactly 0. NaN lanes are not handled (callers exclude them).
  static vf exp_nonpositive(vf x) noexcept {
    vf const lo = V::set1(-87.3f);
    vm const tiny = V::gt_f(lo, x);
    x = V::max(x, lo);
    vi const n = V::cvt_rne(V::mul_c(x, V::set1(1.44269504088896341f)));
    vf const nf = V::cvt_f(n);
    vf r = V::fma(nf, V::set1(-0.693359375f), x);
    r = V::fma(nf, V::set1(2.12194440e-4f), r);
    vf p = V::set1(1.9875691500e-4f);
    p = V::fma(p, r, V::set1(1.3981999507e-3f));
    p = V::fma(p, r, V::set1(8.3334519073e-3f));
    p = V::fma(p, r, V::set1(4.1665795894e-2f));
    p = V::fma(p, r, V::set1(1.6666665459e-1f));
    p = V::fma(p, r, V::set1(5.0000001201e-1f));
    p = V::fma(p, V::mul_c(r, r), V::add(r, V::set1(1.0f)));
    vf const two_n = V::from_bits(V::template slli<23>(V::add_i(n, V::set1_i(127))));
    return V::select_f(tiny, V::set1(0.0f), V::mul_c(p, two_n));
  }

  // ---------------------------------------------------------------------------------------------
  // Row loaders: W consecutive elements of a tile's token t, starting at channel c (a multiple of
  // W), as f32 lanes — the codec's decoded values (one rounding: NaN payloads aside, bit-identical
  // to the codec's decode). `rows[t]` points at token t's encoded row.

  // Each loader also has prepare(t, c): what load(t, c', prepared) needs for channels c' in
  // c's 32-channel block (the broadcast scales), so it is computed once per block.
  struct no_prep {};
  struct scale_prep {
    vf scale;
  };

  /// The f32 value of the f16 scale at p (hardware conversion).
  static float scale_at(std::uint8_t const* p) noexcept {
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    return V::f16_scalar_hw(h);
  }

  /// f32 rows (row pointers are byte pointers in every loader: the arrays hold one type).
  struct f32_rows {
    std::uint8_t const* const* rows;
    no_prep prepare(int, int) const noexcept { return {}; }
    vf load(int t, int c, no_prep) const noexcept { return V::load(reinterpret_cast<float const*>(rows[t]) + c); }
    float at(int t, int c) const noexcept {
      float x;
      std::memcpy(&x, rows[t] + 4 * static_cast<std::size_t>(c), 4);
      return x;
    }
  };
  /// f16 rows.
  struct f16_rows {
    std::uint8_t const* const* rows;
    no_prep prepare(int, int) const noexcept { return {}; }
    vf load(int t, int c, no_prep) const noexcept {
      return V::f16_load_hw(reinterpret_cast<std::uint16_t const*>(rows[t]) + c);
    }
    float at(int t, int c) const noexcept { return scale_at(rows[t] + 2 * static_cast<std::size_t>(c)); }
  };
  /// q8_0 rows.
  struct q8_0_rows {
    std::uint8_t const* const* rows;
    static constexpr std::size_t bb = sizeof(detail::block_q8_0);
    scale_prep prepare(int t, int c) const noexcept {
      return {V::set1(scale_at(rows[t] + bb * static_cast<std::size_t>(c / 32)))};
    }
    vf load(int t, int c, scale_prep const& pr) const noexcept {
      return V::mul_c(V::cvt_f(V::load_i8(rows[t] + bb * static_cast<std::size_t>(c / 32) + 2 + (c % 32))), pr.scale);
    }
    float at(int t, int c) const noexcept {
      std::uint8_t const* blk = rows[t] + bb * static_cast<std::size_t>(c / 32);
      return static_cast<float>(static_cast<std::int8_t>(blk[2 + c % 32])) * scale_at(blk);
    }
  };
  /// q4_0 rows. With 16 lanes and a register table of 16 floats, prepare computes the block's
  /// sixteen values (n - 8) d (each product rounded once, as the codec's) and a load is one permute
  /// of them by the nibbles; elsewhere a load is the exact n - 8 times d, one rounding (the fused
  /// n d - 8 d would round the same but give NaN where an infinite d gives +-Inf).
  struct q4_0_rows {
    std::uint8_t const* const* rows;
    static constexpr std::size_t bb = sizeof(detail::block_q4_0);
    static constexpr bool by_table = register_table16;
    /// Lane n: n - 8, a code's value before scaling.
    alignas(64) static constexpr float centred[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    struct table_prep {
      vf values;  // lane n: (n - 8) d
    };
    using prep = std::conditional_t<by_table, table_prep, scale_prep>;
    prep prepare(int t, int c) const noexcept {
      float const x = scale_at(rows[t] + bb * static_cast<std::size_t>(c / 32));
      if constexpr (by_table) {
        return {V::mul_c(V::load(centred), V::set1(x))};
      } else {
        return {V::set1(x)};
      }
    }
    vf load(int t, int c, prep const& pr) const noexcept {
      int const j = c % 32;
      vi const bytes = V::load_u8(rows[t] + bb * static_cast<std::size_t>(c / 32) + 2 + (j % 16));
      if constexpr (by_table) {  // the permute reads the low 4 bits of each lane
        return V::template lookup<4>(pr.values, j < 16 ? bytes : V::template srli<4>(bytes));
      } else {
        vi const nib = j < 16 ? V::and_i(bytes, V::set1_i(15)) : V::template srli<4>(bytes);
        return V::mul_c(V::cvt_f(V::sub_i(nib, V::set1_i(8))), pr.scale);
      }
    }
    float at(int t, int c) const noexcept {
      std::uint8_t const* blk = rows[t] + bb * static_cast<std::size_t>(c / 32);
      int const j = c % 32;
      std::uint8_t const byte = blk[2 + (j % 16)];
      int const nib = j < 16 ? (byte & 15) : (byte >> 4);
      return static_cast<float>(nib - 8) * scale_at(blk);
    }
  };
  /// int8 rows (fp32 scale, then the codes).
  struct int8_rows {
    std::uint8_t const* const* rows;
    static float scale(std::uint8_t const* row) noexcept {
      float x;
      std::memcpy(&x, row, 4);
      return x;
    }
    scale_prep prepare(int t, int) const noexcept { return {V::set1(scale(rows[t]))}; }
    vf load(int t, int c, scale_prep const& pr) const noexcept {
      return V::mul_c(V::cvt_f(V::load_i8(rows[t] + detail::int8_row_header_bytes + c)), pr.scale);
    }
    float at(int t, int c) const noexcept {
      return static_cast<float>(static_cast<std::int8_t>(rows[t][detail::int8_row_header_bytes + c])) * scale(rows[t]);
    }
  };

  /// fp8 rows (E4M3 or E5M2), decoded through the f16 conversion (policy e5m2_load_hw /
  /// e4m3_load_hw_scaled) and multiplied by the codec's scale: one rounding, as the codec's decode
  /// (NaN payloads aside). E4M3 values come times 2^-8, so the scale is taken times 2^8 (exact: the
  /// caller checks that it stays finite); E4M3 NaN codes, which that conversion would read as
  /// finite values, are the caller's to exclude (then fp8_rows_exact). Unscaled rows (Scaled false)
  /// give the codes' values times 2^-8 (E4M3) or as they are (E5M2), for a caller that multiplies
  /// the other operand by factor().
  template <bool E4M3, bool Scaled = true>
  struct fp8_rows {
    std::uint8_t const* const* rows;
    float scale;
    /// The largest finite magnitude an unscaled load gives.
    static constexpr float largest = E4M3 ? 448.0f / 256.0f : 57344.0f;
    struct prep {
      vf scale;
    };
    /// What the unscaled values are to be multiplied by: the scale (E4M3: times 2^8).
    float factor() const noexcept { return E4M3 ? scale * 256.0f : scale; }
    fp8_rows<E4M3, false> unscaled() const noexcept { return {rows, scale}; }
    prep prepare(int, int) const noexcept { return {V::set1(factor())}; }
    vf load(int t, int c, [[maybe_unused]] prep const& pr) const noexcept {
      vf const x = E4M3 ? V::e4m3_load_hw_scaled(rows[t] + c) : V::e5m2_load_hw(rows[t] + c);
      if constexpr (Scaled)
        return V::mul_c(x, pr.scale);
      else
        return x;
    }
    float at(int t, int c) const noexcept {
      float const f = Scaled ? scale : E4M3 ? 1.0f / 256.0f : 1.0f;
      return E4M3 ? detail::e4m3_to_f32_scaled(rows[t][c], f) : detail::e5m2_to_f32_scaled(rows[t][c], f);
    }
  };
  template <class C>
  static constexpr bool fp8_codec = std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>;
  template <class L>
  static constexpr bool is_scaled_fp8_rows = std::is_same_v<L, fp8_rows<true>> || std::is_same_v<L, fp8_rows<false>>;

  /// E4M3 rows that may hold NaN codes (or whose scale times 2^8 overflows): the codecs' exact
  /// vector decode (simd_codecs::fp8_values), then the scale (one rounding).
  struct fp8_rows_exact {
    std::uint8_t const* const* rows;
    float scale;
    struct prep {
      vf scale;
    };
    prep prepare(int, int) const noexcept { return {V::set1(scale)}; }
    vf load(int t, int c, prep const& pr) const noexcept {
      return V::mul_c(simd_codecs<V>::template fp8_values<true>(V::load_u8(rows[t] + c)), pr.scale);
    }
    float at(int t, int c) const noexcept { return detail::e4m3_to_f32_scaled(rows[t][c], scale); }
  };

  /// KIVI value rows with groups of 32 channels: code * scale + min per group.
  template <int B>
  struct kivi_value_rows {
    std::uint8_t const* const* rows;
    int gv;  // channels per group: min(32, head_dim)
    struct prep {
      vf scale, min;
    };
    std::size_t block_bytes() const noexcept {
      return static_cast<std::size_t>(detail::kivi_group_header_bytes + (gv * B + 7) / 8);
    }
    prep prepare(int t, int c) const noexcept {
      std::uint8_t const* blk = rows[t] + block_bytes() * static_cast<std::size_t>(c / gv);
      return {V::set1(scale_at(blk)), V::set1(scale_at(blk + 2))};
    }
    vf load(int t, int c, prep const& pr) const noexcept {
      std::uint8_t const* blk = rows[t] + block_bytes() * static_cast<std::size_t>(c / gv);
      vi const q = V::template load_codes<B>(blk + detail::kivi_group_header_bytes + (c % gv) * B / 8);
      return V::fma(V::cvt_f(q), pr.scale, pr.min);
    }
    /// 4-bit codes only: the W bytes holding channels c .. c + 2W - 1 (c even), one per lane.
    vi pair_bytes(int t, int c) const noexcept {
      return V::load_u8(rows[t] + block_bytes() * static_cast<std::size_t>(c / gv) + detail::kivi_group_header_bytes +
                        (c % gv) / 2);
    }
    float at(int t, int c) const noexcept {
      std::uint8_t const* blk = rows[t] + block_bytes() * static_cast<std::size_t>(c / gv);
      int const lane = c % gv;
      int const q =
          detail::kivi_unpack(blk[detail::kivi_group_header_bytes + detail::kivi_code_byte(lane, B)], lane, B);
      return detail::kivi_value(q, scale_at(blk), scale_at(blk + 2));
    }
  };

  /// tq codebook rows of one rotation block, unscaled: c[code] of W channels unpacked from the bit
  /// stream by a register table of the centroids, for a caller that multiplies each token's
  /// products by the token's scale (tq_rows::token_scales).
  template <int B>
  struct tq_centroid_rows {
    using table = typename V::table16;
    std::uint8_t const* const* rows;
    int d;
    int scale_bytes;  // where the codes start
    table centroids;  // t[i] = c[i mod 2^B]
    KVQ_CPU_ALWAYS_INLINE no_prep prepare(int, int) const noexcept { return {}; }
    KVQ_CPU_ALWAYS_INLINE vf load(int t, int c, no_prep) const noexcept {
      return V::template lookup_symmetric<B>(centroids, V::template stream_codes<B>(rows[t] + scale_bytes, c));
    }
    float at(int t, int c) const noexcept { return detail::tq_centroid(B, detail::tq_code(B, rows[t], d, c)); }
  };

  /// tq codebook rows (tq_codebook<B>, FORMATS.md §6.2): the codes of W channels unpacked from
  /// the bit stream and looked up in a register table of the centroids times the scale of their
  /// rotation block, c[code] * g (one rounding, the codec's decode; NaN signs aside). For head_dims
  /// that are multiples of W: every vector the kernels load then lies inside one rotation block,
  /// and prepare(t, c) gives the table scaled by the scale of c's block (blocks of >= 32 channels
  /// are 32-aligned).
  template <int B>
  struct tq_rows {
    using table = typename V::table16;
    std::uint8_t const* const* rows;
    int d;
    int blocks;
    int scale_bytes;  // 2 * rotation blocks: where the codes start
    table centroids;
    float centroid[16];
    struct prep {
      table scaled;
    };
    tq_rows(std::uint8_t const* const* r, int head_dim) noexcept
        : rows(r),
          d(head_dim),
          blocks(detail::rotation_block_count(head_dim)),
          scale_bytes(detail::tq_scale_bytes(head_dim)) {
      alignas(64) float t16[16];
      for (int i = 0; i < (1 << B); ++i) centroid[i] = detail::tq_centroid(B, i);
      for (int i = 0; i < 16; ++i) t16[i] = centroid[i % (1 << B)];
      centroids = V::make_table16(t16);
    }
    /// The rotation block of channel c: the blocks follow the bits of d from the highest, so c's
    /// block is the one of the highest bit where c and d differ.
    int block_of(int c) const noexcept {
      auto const ud = static_cast<unsigned>(d);
      return std::popcount(ud >> std::bit_width(static_cast<unsigned>(c) ^ ud));
    }
    KVQ_CPU_ALWAYS_INLINE prep prepare(int t, int c) const noexcept {
      float const g = scale_at(rows[t] + 2 * (blocks == 1 ? 0 : block_of(c)));
      return {V::template scale_symmetric<B>(centroids, V::set1(g))};
    }
    KVQ_CPU_ALWAYS_INLINE vf load(int t, int c, prep const& pr) const noexcept {
      return V::template lookup_symmetric<B>(pr.scaled, V::template stream_codes<B>(rows[t] + scale_bytes, c));
    }
    float at(int t, int c) const noexcept {
      return detail::mul_rn(centroid[detail::tq_code(B, rows[t], d, c)], scale_at(rows[t] + 2 * block_of(c)));
    }
    /// The same rows without their scales (one rotation block: blocks == 1).
    tq_centroid_rows<B> unscaled() const noexcept { return {rows, d, scale_bytes, centroids}; }
    /// g[t] = the scale of token t < m (one rotation block); whether all of them are finite.
    bool token_scales(int m, float* g) const noexcept {
      bool finite = true;
      for (int t = 0; t < m; ++t) {
        g[t] = scale_at(rows[t]);
        finite = finite && std::isfinite(g[t]);
      }
      return finite;
    }
  };
  template <class L>
  static constexpr bool is_tq_rows =
      std::is_same_v<L, tq_rows<2>> || std::is_same_v<L, tq_rows<3>> || std::is_same_v<L, tq_rows<4>>;

  /// detail::fp4_doubled_value of codes 0-15.
  alignas(64) static constexpr float fp4_doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  /// FP4 rows load by a register lookup: 16 lanes permute a table of the 16 codes' values, 8
  /// lanes (AVX2) the 8 magnitudes' and flip the sign by bit 3 of the code.
  static constexpr bool fp4_register_lookup = register_table16 || W == 8;
  /// Lane l = the value of code idx_l (low 4 bits) given the first W of the 16 values (W = 16: all
  /// of them; W = 8: the magnitudes, codes 0-7, the others their negations).
  KVQ_CPU_ALWAYS_INLINE static vf fp4_lookup(vf values, vi idx) noexcept {
    if constexpr (W == 16)
      return V::template lookup<4>(values, idx);
    else
      return V::lookup_sign_magnitude(values, idx);
  }

  /// mxfp4 rows (fp4_register_lookup): prepare computes the block's decoded values of the first W
  /// codes, K[code] h times the codec scale rounded as the codec's decode rounds them (NaNs for a
  /// poisoned block), and a load is one fp4_lookup of them by the codes.
  struct mxfp4_rows {
    static constexpr std::size_t bb = sizeof(detail::block_mxfp4);
    std::uint8_t const* const* rows;
    float scale;
    struct prep {
      vf values;  // lane i: the value of code i
    };
    std::uint8_t const* block_of(int t, int c) const noexcept {
      return rows[t] + bb * static_cast<std::size_t>(c / detail::qk_mxfp4);
    }
    KVQ_CPU_ALWAYS_INLINE prep prepare(int t, int c) const noexcept {
      std::uint8_t const e = block_of(t, c)[0];
      if (e == detail::mxfp4_poisoned_scale) return {V::set1(detail::fp4_nan())};
      return {V::mul(V::mul(V::load(fp4_doubled), V::set1(detail::mxfp4_half_scale(e))), V::set1(scale))};
    }
    KVQ_CPU_ALWAYS_INLINE vf load(int t, int c,
                                  prep const& pr) const noexcept {  // byte j: channels j (low nibble), j + 16 (high)
      int const j = c % detail::qk_mxfp4;
      vi const bytes = V::load_u8(block_of(t, c) + offsetof(detail::block_mxfp4, qs) + j % 16);
      return fp4_lookup(pr.values, j < 16 ? bytes : V::template srli<4>(bytes));
    }
    float at(int t, int c) const noexcept {
      std::uint8_t const* blk = block_of(t, c);
      if (blk[0] == detail::mxfp4_poisoned_scale) return detail::fp4_nan();
      int const j = c % detail::qk_mxfp4;
      std::uint8_t const* qs = blk + offsetof(detail::block_mxfp4, qs);
      int const code = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
      return detail::mul_rn(detail::fp4_value(code, detail::mxfp4_half_scale(blk[0])), scale);
    }
  };

  /// nvfp4 rows (fp4_register_lookup): a vector is a sub-block of 16 channels (8 code bytes; half
  /// of one on 8 lanes), its codes looked up in the constant doubled E2M1 values K, times the
  /// sub-block's half-scale h (exact: K has at most two significant bits, h at most four), then
  /// times the codec scale (one rounding): the codec's decode. h comes from a table of the 256
  /// scale bytes (NaN for the poisoned one), a memory operand of the multiply, so the loader holds
  /// no per-token registers. (Two prepared tables per 32 channels spilled the q . k tile's
  /// registers.)
  struct nvfp4_rows {
    static constexpr std::size_t bb = sizeof(detail::block_nvfp4);
    std::uint8_t const* const* rows;
    float scale;
    float const* half;  // half_scales()
    struct prep {};
    /// h of every scale byte: detail::nvfp4_half_scale, NaN for detail::nvfp4_poisoned_scale.
    static float const* half_scales() noexcept {
      static auto const table = [] {
        std::array<float, 256> h{};
        for (int b = 0; b < 256; ++b)
          h[static_cast<std::size_t>(b)] = b == detail::nvfp4_poisoned_scale
                                               ? detail::fp4_nan()
                                               : detail::nvfp4_half_scale(static_cast<std::uint8_t>(b));
        return h;
      }();
      return table.data();
    }
    std::uint8_t const* block_of(int t, int c) const noexcept {
      return rows[t] + bb * static_cast<std::size_t>(c / detail::qk_nvfp4);
    }
    KVQ_CPU_ALWAYS_INLINE prep prepare(int, int) const noexcept { return {}; }
    KVQ_CPU_ALWAYS_INLINE vf load(int t, int c, prep const&) const noexcept {
      std::uint8_t const* blk = block_of(t, c);
      int const s = (c % detail::qk_nvfp4) / detail::qk_nvfp4_sub;
      std::uint8_t const* qs = blk + offsetof(detail::block_nvfp4, qs) + static_cast<std::size_t>(8 * s);
      vi codes;
      if constexpr (W == 16) {
        codes = V::load_nibble_halves(qs);
      } else {  // channels j < 8 of the sub-block: low nibbles of its 8 bytes, j >= 8: high nibbles
        vi const bytes = V::load_u8(qs);
        codes = c % detail::qk_nvfp4_sub < 8 ? bytes : V::template srli<4>(bytes);
      }
      vf const value = V::mul_c(fp4_lookup(V::load(fp4_doubled), codes), V::set1(half[blk[s]]));
      return V::mul(value, V::set1(scale));
    }
    float at(int t, int c) const noexcept {
      std::uint8_t const* blk = block_of(t, c);
      int const s = (c % detail::qk_nvfp4) / detail::qk_nvfp4_sub, j = c % detail::qk_nvfp4_sub;
      if (blk[s] == detail::nvfp4_poisoned_scale) return detail::fp4_nan();
      std::uint8_t const byte = blk[offsetof(detail::block_nvfp4, qs) + static_cast<std::size_t>(8 * s + j % 8)];
      int const code = j < 8 ? byte & 15 : byte >> 4;
      return detail::mul_rn(detail::fp4_value(code, detail::nvfp4_half_scale(blk[s])), scale);
    }
  };

  /// Per-tile memory of the loaders: row pointers.
  struct tile_rows {
    std::uint8_t const* rows[T];
  };

  /// Calls f(loader) with a loader for tokens [t, t + m) of a row codec C's quantized rows (codecs
  /// without a loader are decoded into `buffer` first).
  template <class C, class F>
  static void with_quantized_rows(token_source const& src, typename C::params_type const& p, int d, std::int64_t t,
                                  int m, tile_rows& tr, float* buffer, F&& f) noexcept {
    std::uint8_t const* row0 = src.units + static_cast<std::size_t>(t) * src.unit_bytes;
    for (int r = 0; r < m; ++r) tr.rows[r] = row0 + static_cast<std::size_t>(r) * src.unit_bytes;
    if constexpr (std::is_same_v<C, f32_codec>) {
      f(f32_rows{tr.rows});
    } else if constexpr (std::is_same_v<C, f16_codec>) {
      f(f16_rows{tr.rows});
    } else if constexpr ((std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0>)&&32 % W == 0) {
      auto const* const* rows = tr.rows;
      if constexpr (std::is_same_v<C, q8_0>)
        f(q8_0_rows{rows});
      else
        f(q4_0_rows{rows});
    } else if constexpr (std::is_same_v<C, int8_sym>) {
      f(int8_rows{tr.rows});
    } else if constexpr (std::is_same_v<C, fp8_e5m2>) {
      f(fp8_rows<false>{tr.rows, p.scale});
    } else if constexpr (std::is_same_v<C, fp8_e4m3>) {
      // The f16 conversion unless the tile holds a NaN code or the scale times 2^8 overflows.
      if (std::isfinite(p.scale * 256.0f) &&
          !V::any_magnitude_above(row0, static_cast<std::size_t>(m) * src.unit_bytes, 0x7e))
        f(fp8_rows<true>{tr.rows, p.scale});
      else
        f(fp8_rows_exact{tr.rows, p.scale});
    } else if constexpr (simd::kivi_value_traits<C>::value) {
      if constexpr (C::group == 32 && 32 % W == 0)
        f(kivi_value_rows<C::bits>{tr.rows, C::group_channels(d)});
      else
        decoded<C>(src, p, d, t, m, tr, buffer, f);
    } else if constexpr (simd::tq_codebook_traits<C>::value) {
      // A head_dim with a rotation block smaller than W (d % W != 0: d = 40 on AVX-512) would
      // leave its last channels to at(), element by element: decoded rows instead.
      if (d % W == 0)
        f(tq_rows<C::bits>{tr.rows, d});
      else
        decoded<C>(src, p, d, t, m, tr, buffer, f);
    } else if constexpr (std::is_same_v<C, mxfp4> && fp4_register_lookup) {
      f(mxfp4_rows{tr.rows, p.scale});
    } else if constexpr (std::is_same_v<C, nvfp4> && fp4_register_lookup) {
      f(nvfp4_rows{tr.rows, p.scale, nvfp4_rows::half_scales()});
    } else {  // codecs without a loader (FP4 on NEON, ...): decoded rows
      decoded<C>(src, p, d, t, m, tr, buffer, f);
    }
  }

  /// Decodes tokens [t, t + m) of row codec C into buffer rows and calls f with an f32 loader.
  template <class C, class F>
  static void decoded(token_source const& src, typename C::params_type const& p, int d, std::int64_t t, int m,
                      tile_rows& tr, float* buffer, F&& f) noexcept {
    simd_codecs<V>::template decode_rows<C>(src.units + static_cast<std::size_t>(t) * src.unit_bytes, src.unit_bytes, m,
                                            d, buffer, d, p);
    f(rows_in(buffer, m, d, tr.rows));
  }

  /// The m rows of buf: (m, d) as an f32 loader whose row pointers are written to ptrs: (m).
  static f32_rows rows_in(float const* buf, int m, int d, std::uint8_t const** ptrs) noexcept {
    for (int r = 0; r < m; ++r)
      ptrs[r] = reinterpret_cast<std::uint8_t const*>(buf + static_cast<std::ptrdiff_t>(r) * d);
    return f32_rows{ptrs};
  }

  /// Calls f(loader) with an f16 loader for tokens [t, t + m) of the residual (ring) rows.
  template <class F>
  static void with_residual_rows(token_source const& src, int d, std::int64_t t, int m, tile_rows& tr, F&& f) noexcept {
    for (int r = 0; r < m; ++r) {
      std::int64_t const slot = (src.residual_first + (t + r - src.quantized)) % src.residual_capacity;
      tr.rows[r] = reinterpret_cast<std::uint8_t const*>(src.residual + slot * d);
    }
    f(f16_rows{tr.rows});
  }

  /// Writes tokens t < m of a loader as f32 rows of d floats to y.
  template <class L>
  static void decode_rows(L const& rows, int m, int d, float* y) noexcept {
    for (int t = 0; t < m; ++t) {
      float* yt = y + static_cast<std::ptrdiff_t>(t) * d;
      int c = 0;
      for (; c + 32 <= d; c += 32) {
        auto const pr = rows.prepare(t, c);
        for (int w = 0; w < 32; w += W) V::store(yt + c + w, rows.load(t, c + w, pr));
      }
      for (; c + W <= d; c += W) V::store(yt + c, rows.load(t, c, rows.prepare(t, c)));
      for (; c < d; ++c) yt[c] = rows.at(t, c);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // q . k

  /// logits[(h0 + i) * T + t0 + j] = q_(h0+i) . k_(t0+j) for i < NH heads and j < nt <= NT tokens:
  /// NH * NT = W independent accumulators, summed by one reduce_lanes; each key vector is loaded
  /// (decoded) once for the NH heads.
  template <int NH, int NT, class L>
  static void dot_tile(float const* q, int d, int h0, L const& k, int t0, int nt, float* logits) noexcept {
    static_assert(NH * NT == W, "dot_tile: NH * NT must be the lane count");
    vf acc[std::size_t{W}];
    for (int i = 0; i < W; ++i) acc[i] = V::set1(0.0f);
    float const* qh = q + static_cast<std::ptrdiff_t>(h0) * d;
    int tj[std::size_t{NT}];
    for (int j = 0; j < NT; ++j) tj[j] = t0 + (j < nt ? j : 0);
    auto const step = [&](int c, auto const* pr) KVQ_CPU_ALWAYS_INLINE {
      vf kv[std::size_t{NT}];
      for (int j = 0; j < NT; ++j) kv[j] = k.load(tj[j], c, pr[j]);
      for (int i = 0; i < NH; ++i) {
        vf const qv = V::load(qh + static_cast<std::ptrdiff_t>(i) * d + c);
        for (int j = 0; j < NT; ++j) acc[i * NT + j] = V::fma(qv, kv[j], acc[i * NT + j]);
      }
    };
    using prep = decltype(k.prepare(0, 0));
    int c = 0;
    if constexpr (NH == 1 && std::is_same_v<prep, no_prep>) {
      // One head: walk the rows in memory order (token by token), which the hardware prefetchers
      // follow; the W accumulator chains still interleave.
      int const full = d - d % W;
      for (int j = 0; j < NT; ++j) {
        int cc = 0;
        for (; cc + 4 * W <= full; cc += 4 * W) {
          vf a0 = V::fma(V::load(qh + cc), k.load(tj[j], cc, no_prep{}), acc[j]);
          vf a1 = V::mul_c(V::load(qh + cc + W), k.load(tj[j], cc + W, no_prep{}));
          a0 = V::fma(V::load(qh + cc + 2 * W), k.load(tj[j], cc + 2 * W, no_prep{}), a0);
          a1 = V::fma(V::load(qh + cc + 3 * W), k.load(tj[j], cc + 3 * W, no_prep{}), a1);
          acc[j] = V::add(a0, a1);
        }
        for (; cc < full; cc += W) acc[j] = V::fma(V::load(qh + cc), k.load(tj[j], cc, no_prep{}), acc[j]);
      }
      c = full;
    } else {
      for (; c + 32 <= d; c += 32) {  // whole 32-channel blocks: the scales prepared once
        prep pr[std::size_t{NT}];
        for (int j = 0; j < NT; ++j) pr[j] = k.prepare(tj[j], c);
        for (int w = 0; w < 32; w += W) step(c + w, pr);
      }
      for (; c + W <= d; c += W) {
        prep pr[std::size_t{NT}];
        for (int j = 0; j < NT; ++j) pr[j] = k.prepare(tj[j], c);
        step(c, pr);
      }
    }
    alignas(64) float sums[std::size_t{W}];
    V::store(sums, V::reduce_lanes(acc));
    if (c == d && nt == NT) {  // the usual case: whole vectors, whole token groups
      for (int i = 0; i < NH; ++i)
        std::memcpy(logits + (h0 + i) * T + t0, sums + i * NT, sizeof(float) * static_cast<std::size_t>(NT));
      return;
    }
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < nt; ++j) {
        float s = sums[i * NT + j];
        for (int cc = c; cc < d; ++cc) s += qh[static_cast<std::ptrdiff_t>(i) * d + cc] * k.at(t0 + j, cc);
        logits[(h0 + i) * T + t0 + j] = s;
      }
  }

  /// dot_one_head for q4_0 keys on 16 lanes (register_table16; d a multiple of 32): per block the
  /// query against the centred codes n - 8 (exact table values), then one FMA by the block's scale,
  /// and W tokens share one reduce_lanes. A NaN or infinite scale makes the logit NaN or infinite;
  /// such groups of W tokens are recomputed by dot_one_head_exact, whose per-element products give
  /// the reference's NaN or Inf.
  template <int NB>
  KVQ_CPU_NOINLINE static void dot_one_head_q4_0(float const* q, int d, q4_0_rows const& k, int n,
                                                 float* logits) noexcept {
    constexpr std::size_t bb = q4_0_rows::bb;
    int const nb = NB > 0 ? NB : d / 32;  // NB > 0: d = 32 NB, the block loop unrolled
    vf const table = V::load(q4_0_rows::centred);
    for (int t0 = 0; t0 < n; t0 += W) {
      int const nt = std::min(W, n - t0);
      vf acc[std::size_t{W}];
      for (int j = 0; j < W; ++j) {
        std::uint8_t const* row = k.rows[t0 + (j < nt ? j : 0)];
        vf a = V::set1(0.0f);
        alignas(64) float sc[std::size_t{W}];
        for (int b = 0; b < nb; ++b) {
          std::uint8_t const* blk = row + bb * static_cast<std::size_t>(b);
          vi const bytes = V::load_u8(blk + 2);
          vf part = V::mul_c(V::load(q + 32 * b), V::template lookup<4>(table, bytes));
          part = V::fma(V::load(q + 32 * b + 16), V::template lookup<4>(table, V::template srli<4>(bytes)), part);
          if constexpr (NB > 0) {  // the scales of four blocks converted together
            if (b % 4 == 0) V::store(sc, V::template f16_strided_hw<bb, std::min(NB, 4)>(blk));
            a = V::fma(part, V::set1(sc[b % 4]), a);
          } else {
            a = V::fma(part, V::f16_broadcast_hw(blk), a);
          }
        }
        acc[j] = a;
      }
      vf const sums = V::reduce_lanes(acc);
      if ((V::mask_bits(V::le_f(V::abs(sums), V::set1(std::numeric_limits<float>::max()))) | ~((1u << nt) - 1u)) !=
          ~0u) {
        dot_one_head_exact(q, d, q4_0_rows{k.rows + t0}, nt, logits + t0);
        continue;
      }
      alignas(64) float out[std::size_t{W}];
      V::store(out, sums);
      std::memcpy(logits + t0, out, sizeof(float) * static_cast<std::size_t>(nt));
    }
  }

  /// logits[t] = q . k_t for one head and tokens t < n, four tokens at a time, each key vector
  /// decoded in registers (no f32 tile), each product the codec's decoded value times the query's.
  template <class L>
  static void dot_one_head_exact(float const* q, int d, L const& k, int n, float* logits) noexcept {
    using prep = decltype(k.prepare(0, 0));
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      vf acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = V::set1(0.0f);
      int c = 0;
      for (; c + 32 <= d; c += 32) {
        prep pr[4];
        for (int j = 0; j < 4; ++j) pr[j] = k.prepare(t + j, c);
        for (int w = 0; w < 32; w += W) {
          vf const qv = V::load(q + c + w);
          for (int j = 0; j < 4; ++j) acc[j] = V::fma(qv, k.load(t + j, c + w, pr[j]), acc[j]);
        }
      }
      for (; c + W <= d; c += W) {
        vf const qv = V::load(q + c);
        for (int j = 0; j < 4; ++j) acc[j] = V::fma(qv, k.load(t + j, c, k.prepare(t + j, c)), acc[j]);
      }
      for (int j = 0; j < 4; ++j) {
        float s = V::reduce_add(acc[j]);
        for (int cc = c; cc < d; ++cc) s += q[cc] * k.at(t + j, cc);
        logits[t + j] = s;
      }
    }
    for (; t < n; ++t) {
      float s = 0.0f;
      for (int c = 0; c < d; ++c) s += q[c] * k.at(t, c);
      logits[t] = s;
    }
  }

  /// dot_one_head_exact, or dot_one_head_q4_0 where it applies.
  template <class L>
  static void dot_one_head(float const* q, int d, L const& k, int n, float* logits) noexcept {
    if constexpr (std::is_same_v<L, q4_0_rows> && q4_0_rows::by_table) {
      if (d % 32 == 0) {
        if (d == 64)
          dot_one_head_q4_0<2>(q, d, k, n, logits);
        else if (d == 128)
          dot_one_head_q4_0<4>(q, d, k, n, logits);
        else if (d == 256)
          dot_one_head_q4_0<8>(q, d, k, n, logits);
        else
          dot_one_head_q4_0<0>(q, d, k, n, logits);
        return;
      }
    }
    dot_one_head_exact(q, d, k, n, logits);
  }

  /// logits[h * T + off + t] = q_h . k_t for every head of the group and tokens t < n.
  template <class L>
  static void dot_rows(float const* q, int d, int group, L const& k, int n, int off, float* logits) noexcept {
    float* const lo = logits + off;
    constexpr int H4 = W >= 4 ? 4 : W;
    constexpr int H2 = W >= 2 ? 2 : 1;
    if (group % H4 == 0) {
      for (int h = 0; h < group; h += H4)
        for (int t = 0; t < n; t += W / H4) dot_tile<H4, W / H4>(q, d, h, k, t, std::min(W / H4, n - t), lo);
    } else if (group % H2 == 0) {
      for (int h = 0; h < group; h += H2)
        for (int t = 0; t < n; t += W / H2) dot_tile<H2, W / H2>(q, d, h, k, t, std::min(W / H2, n - t), lo);
    } else {
      for (int h = 0; h < group; ++h)
        for (int t = 0; t < n; t += W) dot_tile<1, W>(q, d, h, k, t, std::min(W, n - t), lo);
    }
  }

  /// The exact q8_0-query dot of one int8 key row whose head_dim is not a multiple of 32 (the last
  /// block zero-padded), in the reference's order (attention.hpp detail::dot_row_int8); other
  /// integer-dot rows take integer_logits.
  static float int8_tail_dot(std::uint8_t const* row, detail::block_q8_0 const* qb, int d) noexcept {
    int const nb = (d + 31) / 32;
    float scale;
    std::memcpy(&scale, row, 4);
    auto const* codes = reinterpret_cast<std::int8_t const*>(row + detail::int8_row_header_bytes);
    alignas(32) std::int8_t tail[32];
    float sum = 0.0f;
    for (int b = 0; b < nb; ++b) {
      std::int8_t const* k = codes + 32 * b;
      if (32 * b + 32 > d) {
        std::memset(tail, 0, sizeof tail);
        std::memcpy(tail, k, static_cast<std::size_t>(d - 32 * b));
        k = tail;
      }
      int const sumi = V::dot_s8x32(k, qb[b].qs);
      sum = detail::add_rn(sum, detail::mul_rn(static_cast<float>(sumi), V::f16_scalar_hw(qb[b].d)));
    }
    return detail::mul_rn(sum, scale);
  }

  /// Asks for the n bytes at p to be brought into cache, one request per 64 bytes.
  static void prefetch_bytes(std::uint8_t const* p, std::size_t n) noexcept {
#if defined(__GNUC__)
    for (std::size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
#else
    (void)p;
    (void)n;
#endif
  }

  /// The f32 scales (hardware conversion, equal to the reference's for every non-NaN scale) and code
  /// sums of n q8_0 query blocks.
  static void query_block_terms(detail::block_q8_0 const* qb, std::size_t n, float* q_scale,
                                std::int32_t* q_sum) noexcept {
    for (std::size_t b = 0; b < n; ++b) {
      q_scale[b] = V::f16_scalar_hw(qb[b].d);
      std::int32_t sum = 0;
      for (std::int8_t c : qb[b].qs) sum += c;
      q_sum[b] = sum;
    }
  }

  /// logits[(h0 + i) * T + j] = the q8_0-query dot of row j and head h0 + i for i < NH and j < m, row j
  /// at row0 + j * stride: the exact integer block dots of W tokens in the lanes of one vector
  /// (policy nibble_dots / byte_dots), then the reference's float arithmetic lane-wise, block by
  /// block in order (attention.hpp detail::integer_dot_row), so each logit equals the reference's bit for bit. q_scale
  /// / q_sum: the query blocks' f32 scales and code sums, (group, nb).
  template <class KC, int NH>
  static void integer_logits_heads(std::uint8_t const* row0, std::size_t stride, int m, detail::block_q8_0 const* qb,
                                   float const* q_scale, std::int32_t const* q_sum, int nb, int h0,
                                   float* logits) noexcept {
    constexpr bool q4 = std::is_same_v<KC, q4_0>;
    constexpr bool int8 = std::is_same_v<KC, int8_sym>;
    constexpr std::size_t bb = q4 ? sizeof(detail::block_q4_0) : sizeof(detail::block_q8_0);
    // The f16 scales (or int8's f32 row scales) at byte `off` of W rows: one gather for whole
    // groups; a group's last rows repeated for a partial one (never read past row m - 1).
    auto const scales_at = [&](std::uint8_t const* const* tok, bool whole, std::size_t off) KVQ_CPU_ALWAYS_INLINE {
      if (whole) return V::gather_u32(tok[0] + off, static_cast<int>(stride));
      alignas(64) std::int32_t w[std::size_t{W}];
      for (int j = 0; j < W; ++j) std::memcpy(w + j, tok[j] + off, 4);
      return V::load_i(w);
    };
    for (int t0 = 0; t0 < m; t0 += W) {
      int const nt = std::min(W, m - t0);
      // The group's rows asked for in memory order, which the loads below (block b of every row,
      // then block b + 1) do not follow.
      prefetch_bytes(row0 + stride * static_cast<std::size_t>(t0), stride * static_cast<std::size_t>(nt));
      std::uint8_t const* tok[std::size_t{W}];
      for (int j = 0; j < W; ++j) tok[j] = row0 + stride * static_cast<std::size_t>(t0 + std::min(j, nt - 1));
      vf acc[std::size_t{NH}];
      for (int i = 0; i < NH; ++i) acc[i] = V::set1(0.0f);
      for (int b = 0; b < nb; ++b) {
        std::int8_t const* qc[std::size_t{NH}];
        for (int i = 0; i < NH; ++i) qc[i] = qb[static_cast<std::ptrdiff_t>(h0 + i) * nb + b].qs;
        vi sums[std::size_t{NH}];
        vf dk = V::set1(1.0f);
        if constexpr (int8) {
          V::template byte_dots<NH>(tok, detail::int8_row_header_bytes + 32 * static_cast<std::size_t>(b), qc, sums);
        } else {
          dk = V::f16_low_hw(scales_at(tok, nt == W, bb * static_cast<std::size_t>(b)));
          if constexpr (q4)
            V::template nibble_dots<NH>(tok, bb * static_cast<std::size_t>(b) + 2, qc, sums);
          else
            V::template byte_dots<NH>(tok, bb * static_cast<std::size_t>(b) + 2, qc, sums);
        }
        for (int i = 0; i < NH; ++i) {
          std::ptrdiff_t const qi = static_cast<std::ptrdiff_t>(h0 + i) * nb + b;
          vf const dq = V::set1(q_scale[qi]);
          if constexpr (q4) {  // ((sumi * dk) * dq), sumi = sum(nibble * q) - 8 * sum(q)
            vf const x = V::cvt_f(V::sub_i(sums[i], V::set1_i(8 * q_sum[qi])));
            acc[i] = V::add(acc[i], V::mul(V::mul(x, dk), dq));
          } else if constexpr (int8) {  // (sumi * dq), the row's scale after the sum
            acc[i] = V::add(acc[i], V::mul(V::cvt_f(sums[i]), dq));
          } else {  // sumi * (dk * dq)
            acc[i] = V::add(acc[i], V::mul(V::cvt_f(sums[i]), V::mul(dk, dq)));
          }
        }
      }
      if constexpr (int8) {
        vf const scale = V::from_bits(scales_at(tok, nt == W, 0));
        for (int i = 0; i < NH; ++i) acc[i] = V::mul(acc[i], scale);
      }
      for (int i = 0; i < NH; ++i) {
        float* const li = logits + static_cast<std::ptrdiff_t>(h0 + i) * T + t0;
        if (nt == W) {
          V::store(li, acc[i]);
        } else {
          alignas(64) float tmp[std::size_t{W}];
          V::store(tmp, acc[i]);
          std::memcpy(li, tmp, static_cast<std::size_t>(nt) * 4);
        }
      }
    }
  }

  /// integer_logits_heads for every head of the group, four at a time.
  template <class KC>
  static void integer_logits(std::uint8_t const* row0, std::size_t stride, int m, detail::block_q8_0 const* qb,
                             float const* q_scale, std::int32_t const* q_sum, int nb, int group,
                             float* logits) noexcept {
    int h = 0;
    for (; h + 4 <= group; h += 4) integer_logits_heads<KC, 4>(row0, stride, m, qb, q_scale, q_sum, nb, h, logits);
    switch (group - h) {
      case 3:
        integer_logits_heads<KC, 3>(row0, stride, m, qb, q_scale, q_sum, nb, h, logits);
        break;
      case 2:
        integer_logits_heads<KC, 2>(row0, stride, m, qb, q_scale, q_sum, nb, h, logits);
        break;
      case 1:
        integer_logits_heads<KC, 1>(row0, stride, m, qb, q_scale, q_sum, nb, h, logits);
        break;
      default:
        break;
    }
  }

  // ---------------------------------------------------------------------------------------------
  // q . k for KIVI key tiles (query scaled per channel)

  /// logits[h * T + off + i] = q_h . k_(first + i) for i < n, tokens first .. first + n - 1 of a
  /// KIVI key tile (first + n <= G).
  template <class KC>
  static void kivi_logits(std::uint8_t const* tile, int d, float const* q, int group, int first, int n, int off,
                          float* logits, float* scaled) noexcept {
    auto const* scales = reinterpret_cast<std::uint16_t const*>(tile + KC::scale_offset(d, 0));
    auto const* mins = reinterpret_cast<std::uint16_t const*>(tile + KC::min_offset(d, 0));
    std::uint8_t const* codes = tile + KC::codes_offset(d, 0);
    int const j0 = first / W, j1 = (first + n + W - 1) / W;
    for (int h0 = 0; h0 < group; h0 += 4) {
      int const nh = std::min(4, group - h0);
      float bias[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int i = 0; i < nh; ++i) {
        float const* qh = q + static_cast<std::ptrdiff_t>(h0 + i) * d;
        float* sh = scaled + static_cast<std::ptrdiff_t>(i) * d;
        vf b = V::set1(0.0f);
        int c = 0;
        for (; c + W <= d; c += W) {
          vf const qv = V::load(qh + c);
          V::store(sh + c, V::mul_c(qv, V::f16_load_hw(scales + c)));
          b = V::fma(qv, V::f16_load_hw(mins + c), b);
        }
        float bs = V::reduce_add(b);
        for (; c < d; ++c) {
          sh[c] = qh[c] * detail::f16_bits_to_f32(scales[c]);
          bs += qh[c] * detail::f16_bits_to_f32(mins[c]);
        }
        bias[i] = bs;
      }
      // Lane l of acc[k * 4 + i] is head h0 + i's logit of token `token(k, l)`, kept when in range.
      auto const scatter = [&](vf const* acc, int nk, auto token) {
        alignas(64) float lane[std::size_t{W}];
        for (int k = 0; k < nk; ++k)
          for (int i = 0; i < nh; ++i) {
            V::store(lane, acc[k * 4 + i]);
            for (int l = 0; l < W; ++l) {
              int const t = token(k, l);
              if (t >= first && t < first + n) logits[(h0 + i) * T + off + (t - first)] = lane[l];
            }
          }
      };
      if constexpr (KC::bits == 4 && KC::group % (2 * W) == 0) {  // W bytes of a channel: 2W tokens
        for (int j = first / (2 * W); j * 2 * W < first + n; ++j) {
          vf acc[8];
          with_head_count(
              nh, [&](auto NH) { kivi_packed_dots<KC, decltype(NH)::value>(codes + j * W, d, scaled, bias, acc); });
          scatter(acc, 2, [&](int odd, int l) { return j * 2 * W + 2 * l + odd; });
        }
        continue;
      }
      if constexpr (KC::bits == 2 && KC::group % (4 * W) == 0) {  // W bytes of a channel: 4W tokens
        if (nh <= 2) {
          for (int j = first / (4 * W); j * 4 * W < first + n; ++j) {
            vf acc[16];
            if (nh == 1)
              kivi_packed_dots<KC, 1>(codes + j * W, d, scaled, bias, acc);
            else
              kivi_packed_dots<KC, 2>(codes + j * W, d, scaled, bias, acc);
            scatter(acc, 4, [&](int r, int l) { return j * 4 * W + 4 * l + r; });
          }
          continue;
        }
      }
      for (int j = j0; j < j1;) {
        int const nj = j + 1 < j1 ? 2 : 1;
        vf acc[8];
        with_head_count(nh, [&](auto NH) {
          if (nj == 2)
            kivi_chunk_dots<KC, decltype(NH)::value, 2>(codes, j, d, scaled, bias, acc);
          else
            kivi_chunk_dots<KC, decltype(NH)::value, 1>(codes, j, d, scaled, bias, acc);
        });
        scatter(acc, nj, [&](int jj, int l) { return (j + jj) * W + l; });
        j += nj;
      }
    }
  }

  /// Calls f(std::integral_constant<int, nh>{}) for a head count nh of 1 .. 4.
  template <class F>
  static void with_head_count(int nh, F&& f) {
    switch (nh) {
      case 1:
        f(std::integral_constant<int, 1>{});
        break;
      case 2:
        f(std::integral_constant<int, 2>{});
        break;
      case 3:
        f(std::integral_constant<int, 3>{});
        break;
      default:
        f(std::integral_constant<int, 4>{});
        break;
    }
  }

  /// The 8 / B codes of B = 4 or 2 bits packed in the low byte of each lane, lowest bits first.
  template <int B>
  static void unpack_byte_codes(vi b, vf (&x)[std::size_t{8 / B}]) noexcept {
    vi const mask = V::set1_i((1 << B) - 1);
    x[0] = V::cvt_f(V::and_i(b, mask));
    if constexpr (B == 4) {
      x[1] = V::cvt_f(V::template srli<4>(b));
    } else {
      x[1] = V::cvt_f(V::and_i(V::template srli<2>(b), mask));
      x[2] = V::cvt_f(V::and_i(V::template srli<4>(b), mask));
      x[3] = V::cvt_f(V::template srli<6>(b));
    }
  }

  /// kivi_chunk_dots for codes of B = 4 or 2 bits, R = 8 / B to a byte, R W tokens at a time:
  /// channel c's W code bytes at cj + c · code_bytes hold tokens R l .. R l + R - 1 in lane l (the
  /// low bits first), so out[r * 4 + i] gets head i's tokens R l + r, without unpacking the codes in
  /// order. P (the channel residues summed apart) depends on NH alone, as kivi_chunk_dots'.
  template <class KC, int NH>
  static void kivi_packed_dots(std::uint8_t const* cj, int d, float const* scaled, float const* bias,
                               vf* out) noexcept {
    constexpr int B = KC::bits, R = 8 / B;
    static_assert((B == 4 && NH <= 4) || (B == 2 && NH <= 2),
                  "kivi_packed_dots: 4-bit codes for up to four heads, 2-bit codes for up to two");
    constexpr int code_bytes = KC::code_bytes;
    constexpr int P = B == 4 ? (NH >= 4 ? 1 : NH >= 2 ? 2 : 4) : (NH == 1 ? 2 : 1);
    vf acc[std::size_t{P}][std::size_t{R}][std::size_t{NH}];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < NH; ++i) acc[p][r][i] = V::set1(p == 0 ? bias[i] : 0.0f);
    auto const step = [&](int c, vf(&a)[std::size_t{R}][std::size_t{NH}]) {
      vf x[std::size_t{R}];
      unpack_byte_codes<B>(V::load_u8(cj + static_cast<std::ptrdiff_t>(c) * code_bytes), x);
      for (int i = 0; i < NH; ++i) {
        vf const s = V::set1(scaled[i * d + c]);
        for (int r = 0; r < R; ++r) a[r][i] = V::fma(x[r], s, a[r][i]);
      }
    };
    int c = 0;
    for (; c + P <= d; c += P)
      for (int p = 0; p < P; ++p) step(c + p, acc[p]);
    for (; c < d; ++c) step(c, acc[0]);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NH; ++i) {
        vf a = acc[0][r][i];
        for (int p = 1; p < P; ++p) a = V::add(a, acc[p][r][i]);
        out[r * 4 + i] = a;
      }
  }

  /// acc[jj * 4 + i] = bias[i] + sum_c scaled[i * d + c] * code_c(token chunk j + jj) for NH heads and NJ
  /// chunks of W tokens of a KIVI key tile's codes; the channels split into P residues so that
  /// NH · NJ · P FMA chains run independently (one head alone is otherwise latency-bound). P depends
  /// on NH alone, so a token's logit is summed in the same order whatever range it is attended in.
  template <class KC, int NH, int NJ>
  static void kivi_chunk_dots(std::uint8_t const* codes, int j, int d, float const* scaled, float const* bias,
                              vf* out) noexcept {
    constexpr int B = KC::bits;
    constexpr int code_bytes = KC::code_bytes;
    constexpr int P = NH >= 4 ? 1 : NH >= 2 ? 2 : 4;
    vf acc[std::size_t{P}][std::size_t{NJ}][std::size_t{NH}];
    for (int p = 0; p < P; ++p)
      for (int jj = 0; jj < NJ; ++jj)
        for (int i = 0; i < NH; ++i) acc[p][jj][i] = V::set1(p == 0 ? bias[i] : 0.0f);
    std::uint8_t const* cj = codes + j * (W * B / 8);
    int c = 0;
    for (; c + P <= d; c += P)
      for (int p = 0; p < P; ++p)
        for (int jj = 0; jj < NJ; ++jj) {
          vf const x = V::cvt_f(
              V::template load_codes<B>(cj + jj * (W * B / 8) + static_cast<std::ptrdiff_t>(c + p) * code_bytes));
          for (int i = 0; i < NH; ++i) acc[p][jj][i] = V::fma(x, V::set1(scaled[i * d + c + p]), acc[p][jj][i]);
        }
    for (; c < d; ++c)
      for (int jj = 0; jj < NJ; ++jj) {
        vf const x =
            V::cvt_f(V::template load_codes<B>(cj + jj * (W * B / 8) + static_cast<std::ptrdiff_t>(c) * code_bytes));
        for (int i = 0; i < NH; ++i) acc[0][jj][i] = V::fma(x, V::set1(scaled[i * d + c]), acc[0][jj][i]);
      }
    for (int jj = 0; jj < NJ; ++jj)
      for (int i = 0; i < NH; ++i) {
        vf a = acc[0][jj][i];
        for (int p = 1; p < P; ++p) a = V::add(a, acc[p][jj][i]);
        out[jj * 4 + i] = a;
      }
  }

  /// Raw logits (before scale) of tokens [tb, tb + n) for every head of the group, in s.logits
  /// (group, T); segments of key rows that reach f32 arithmetic go through dot(loader, m, off),
  /// which must write the logits of the loader's m rows, tile tokens [off, off + m), in s.logits
  /// (RowMajor) or elsewhere (then every loader it gets scales its rows).
  template <class KC, bool RowMajor = true, class Dot>
  static void tile_logits(token_source const& k, typename KC::params_type const& kp, attention_call const& call,
                          float const* q, detail::block_q8_0 const* qb, std::int64_t tb, int n, attention_scratch& s,
                          tile_rows& tr, Dot&& dot) noexcept {
    int const d = call.head_dim;
    float* const logits = s.logits.data();
    int i = 0;
    while (i < n) {
      std::int64_t const t = tb + i;
      if (t >= k.quantized) {  // f16 residual rows (KIVI keys)
        int const m = n - i;
        with_residual_rows(k, d, t, m, tr, [&](auto const& rows) { dot(rows, m, i); });
        i += m;
        continue;
      }
      if constexpr (KC::layout == codec_layout::token_group) {
        constexpr int G = KC::group;
        std::int64_t const tile = t / G;
        int const first = static_cast<int>(t % G);
        int const m = static_cast<int>(std::min<std::int64_t>({n - i, G - first, k.quantized - t}));
        std::uint8_t const* tp = k.units + static_cast<std::size_t>(tile) * k.unit_bytes;
        bool scaled_query = false;  // few rows: the query scaled into the codes; many: decoded once
        if constexpr (G % W == 0) scaled_query = call.group < many_rows;
        if (scaled_query) {
          if constexpr (G % W == 0) kivi_logits<KC>(tp, d, q, call.group, first, m, i, logits, s.scaled.data());
        } else {
          simd_codecs<V>::template decode_tile_tokens<KC>(tp, d, first, m, s.keys.data(), d, kp);
          dot(rows_in(s.keys.data(), m, d, tr.rows), m, i);
        }
        i += m;
      } else {
        int const m = static_cast<int>(std::min<std::int64_t>(n - i, k.quantized - t));
        if constexpr (integer_dot_key<KC>) {
          if (qb != nullptr) {
            std::uint8_t const* row0 = k.units + static_cast<std::size_t>(t) * k.unit_bytes;
            int const nb = (d + 31) / 32;
            if (!std::is_same_v<KC, int8_sym> || d % 32 == 0) {  // int8 codes in whole blocks
              integer_logits<KC>(row0, k.unit_bytes, m, qb, s.q_scale.data(), s.q_sum.data(), nb, call.group,
                                 logits + i);
              i += m;
              continue;
            }
            for (int h = 0; h < call.group; ++h)
              for (int r = 0; r < m; ++r)
                logits[h * T + i + r] = int8_tail_dot(row0 + static_cast<std::size_t>(r) * k.unit_bytes,
                                                      qb + static_cast<std::ptrdiff_t>(h) * nb, d);
            i += m;
            continue;
          }
        }
        auto const rows_logits = [&](auto const& rows) {
          using loader = std::decay_t<decltype(rows)>;
          constexpr int H4 = W >= 4 ? 4 : W;
          if constexpr (!std::is_same_v<decltype(rows.prepare(0, 0)), no_prep>) {
            if (call.group == 1) {  // one head: decode in registers, 4 tokens at a time
              dot_one_head(q, d, rows, m, logits + i);
              return;
            }
          }
          constexpr bool scaled = !std::is_same_v<decltype(rows.prepare(0, 0)), no_prep>;
          bool const decode_once =
              !std::is_same_v<loader, f32_rows> && (call.group >= many_rows || (scaled && call.group % H4 != 0));
          if (!decode_once) {
            // Each key vector decoded in registers once for H4 heads (W / H4 tokens at a time).
            dot(rows, m, i);
          } else {  // many rows, or scaled codes: decode once into the f32 tile (the dot's registers go to the tokens)
            decode_rows<loader>(rows, m, d, s.keys.data());
            std::uint8_t const* ptrs[T];
            dot(rows_in(s.keys.data(), m, d, ptrs), m, i);
          }
        };
        with_quantized_rows<KC>(k, kp, d, t, m, tr, s.keys.data(), [&](auto const& rows) {
          if constexpr (RowMajor && is_tq_rows<std::decay_t<decltype(rows)>>) {
            // One rotation block: g (q . c) for the unscaled centroids c, where every g is finite
            // (an infinite g would give NaN where some product q_i (g c_i) is NaN, not Inf).
            float g[T];
            if (rows.blocks == 1 && rows.token_scales(m, g)) {
              rows_logits(rows.unscaled());
              for (int h = 0; h < call.group; ++h)
                for (int r = 0; r < m; ++r) logits[h * T + i + r] *= g[r];
              return;
            }
          }
          rows_logits(rows);
        });
        i += m;
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // p . V

  /// The probabilities of consecutive rows: row i's of tile token t at p[i HS + t ps] (HS = T, ps =
  /// 1: row-major (rows, T); HS = 1, ps = rp: transposed (T, rp)), so a token's rows need one pointer.
  template <int HS>
  struct prob_rows {
    float const* p;
    std::ptrdiff_t ps;
    float at(int i, int t) const noexcept { return p[t * ps + i * HS]; }
  };

  /// o_(h0+i)[c0 + j W ...] += sum_t p.at(i, t) * v_t for i < NH heads, NC chunks of W channels.
  template <int NH, int NC, class L, class P>
  static void accumulate_tile(float* const* o, P const& p, L const& v, int n, int c0) noexcept {
    vf acc[std::size_t{NH}][std::size_t{NC}];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < NC; ++j) acc[i][j] = V::load(o[i] + c0 + j * W);
    using prep = decltype(v.prepare(0, 0));
    for (int t = 0; t < n; ++t) {
      vf pv[std::size_t{NH}];
      for (int i = 0; i < NH; ++i) pv[i] = V::set1(p.at(i, t));
      prep pr = v.prepare(t, c0);
      for (int j = 0; j < NC; ++j) {
        if (j > 0 && (c0 + j * W) % 32 == 0) pr = v.prepare(t, c0 + j * W);
        vf const x = v.load(t, c0 + j * W, pr);
        for (int i = 0; i < NH; ++i) acc[i][j] = V::fma(pv[i], x, acc[i][j]);
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < NC; ++j) V::store(o[i] + c0 + j * W, acc[i][j]);
  }

  /// accumulate_tile for 4-bit KIVI values, NC chunks of 2W channels from c0: W code bytes give the
  /// chunk's even channels (low nibbles) and odd ones (high nibbles) in two vectors, accumulated
  /// apart and interleaved into o once per tile.
  template <int NH, int NC, class P>
  static void accumulate_nibble_pairs(float* const* o, P const& p, kivi_value_rows<4> const& v, int n,
                                      int c0) noexcept {
    vf acc[std::size_t{NH}][std::size_t{NC}][2];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < NC; ++j) acc[i][j][0] = acc[i][j][1] = V::set1(0.0f);
    for (int t = 0; t < n; ++t) {
      vf pv[std::size_t{NH}];
      for (int i = 0; i < NH; ++i) pv[i] = V::set1(p.at(i, t));
      auto pr = v.prepare(t, c0);
      for (int j = 0; j < NC; ++j) {
        int const c = c0 + j * 2 * W;
        if (j > 0 && c % v.gv == 0) pr = v.prepare(t, c);
        vi const b = v.pair_bytes(t, c);
        vf const lo = V::fma(V::cvt_f(V::and_i(b, V::set1_i(15))), pr.scale, pr.min);
        vf const hi = V::fma(V::cvt_f(V::template srli<4>(b)), pr.scale, pr.min);
        for (int i = 0; i < NH; ++i) {
          acc[i][j][0] = V::fma(pv[i], lo, acc[i][j][0]);
          acc[i][j][1] = V::fma(pv[i], hi, acc[i][j][1]);
        }
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < NC; ++j) {
        float* const oc = o[i] + c0 + j * 2 * W;
        vf lo, hi;
        V::interleave(acc[i][j][0], acc[i][j][1], lo, hi);
        V::store(oc, V::add(V::load(oc), lo));
        V::store(oc + W, V::add(V::load(oc + W), hi));
      }
  }

  /// o_(h0+i) += sum_t p.at(i, t) * v_t over every channel, for NH heads.
  template <int NH, class L, class P>
  static void accumulate_heads(float* const* o, P const& p, L const& v, int n, int d) noexcept {
    constexpr int NC = NH == 8 ? 2 : NH == 6 ? 4 : NH == 4 ? (W >= 16 ? 4 : 2) : NH == 2 ? 4 : 8;
    int c = 0;
    if constexpr (std::is_same_v<L, kivi_value_rows<4>>) {
      if (v.gv % (2 * W) == 0) {               // chunks of 2W channels never straddle a group
        constexpr int regs = W == 8 ? 8 : 24;  // accumulators: 16 ymm on AVX2, 32 registers elsewhere
        constexpr int NP = std::clamp(regs / (2 * NH), 1, 4);
        for (; c + NP * 2 * W <= d; c += NP * 2 * W) accumulate_nibble_pairs<NH, NP>(o, p, v, n, c);
        for (; c + 2 * W <= d; c += 2 * W) accumulate_nibble_pairs<NH, 1>(o, p, v, n, c);
      }
    }
    for (; c + NC * W <= d; c += NC * W) accumulate_tile<NH, NC>(o, p, v, n, c);
    for (; c + W <= d; c += W) accumulate_tile<NH, 1>(o, p, v, n, c);
    for (; c < d; ++c)
      for (int i = 0; i < NH; ++i) {
        float a = o[i][c];
        for (int t = 0; t < n; ++t) a += p.at(i, t) * v.at(t, c);
        o[i][c] = a;
      }
  }

  /// o_h += sum_t p_h[t] * v_t for every head of the group, tokens from tile token `off`: row-major
  /// probabilities (group, T) by default, transposed ones (T, ps) with HS = 1.
  template <int HS = T, class L>
  static void accumulate(float* out, int d, int group, float const* probs, int off, L const& v, int n,
                         std::ptrdiff_t ps = 1) noexcept {
    auto const heads = [&]<int NH>(int h) {
      float* o[std::size_t{NH}];
      for (int i = 0; i < NH; ++i) o[i] = out + static_cast<std::ptrdiff_t>(h + i) * d;
      accumulate_heads<NH>(o, prob_rows<HS>{probs + h * HS + off * ps, ps}, v, n, d);
    };
    int h = 0;
    if (W >= 16)  // 32 registers: 6 heads x 4 vectors of accumulators
      for (; h + 6 <= group; h += 6) heads.template operator()<6>(h);
    if (W >= 4)
      for (; h + 4 <= group; h += 4) heads.template operator()<4>(h);
    for (; h + 2 <= group; h += 2) heads.template operator()<2>(h);
    for (; h < group; ++h) heads.template operator()<1>(h);
  }

  /// Lanes b < K: the f16 at p + b S as f32 (policies with f16_strided_hw, the 16-lane ones).
  template <std::size_t S, int K>
  static vf f16_strided(std::uint8_t const* p) noexcept {
    return V::template f16_strided_hw<static_cast<int>(S), K>(p);
  }

  /// Calls pass.template operator()<K>(b) over nb blocks: K = NB per pass, then the 1 .. NB - 1 left.
  template <int NB, class Pass>
  static void block_passes(int nb, Pass const& pass) noexcept {
    int b = 0;
    for (; b + NB <= nb; b += NB) pass.template operator()<NB>(b);
    if constexpr (NB > 3)
      if (nb - b == 3) return pass.template operator()<3>(b);
    if constexpr (NB > 2)
      if (nb - b == 2) return pass.template operator()<2>(b);
    if (nb - b == 1) pass.template operator()<1>(b);
  }

  /// o += sum_t p[t] v_t for one head's q4_0 value rows (d a multiple of 32) with each block's
  /// scale folded into the probability: w = p[t] d_(t,b), then o += w (n - 8), so a block's codes
  /// cost a load, the exact n - 8 (one permute of the register table on 16 lanes; mask or shift,
  /// subtract and convert elsewhere) and one FMA per vector. NaN and infinite scales give the
  /// reference's NaN and Inf lanes: (p d)(n - 8) is NaN exactly where p ((n - 8) d) is, infinite
  /// where it is.
  KVQ_CPU_NOINLINE static void accumulate_one_head_q4_0(float* o, float const* p, q4_0_rows const& v, int n,
                                                        int d) noexcept {
    constexpr std::size_t bb = q4_0_rows::bb;
    constexpr int U = 16 / W;                         // vectors per half block (16 codes)
    constexpr int NB = W == 16 ? 4 : W == 8 ? 2 : 3;  // blocks per pass: 8 accumulators (12 on 4 lanes)
    vf const table = V::load(q4_0_rows::centred);
    // n - 8 of the nibbles in the low 4 bits of each lane (the high bits: zero, or ignored by the permute).
    auto const centred = [&](vi nibbles) KVQ_CPU_ALWAYS_INLINE {
      if constexpr (q4_0_rows::by_table)
        return V::template lookup<4>(table, nibbles);
      else
        return V::cvt_f(V::sub_i(nibbles, V::set1_i(8)));
    };
    block_passes<NB>(d / 32, [&]<int K>(int b0) KVQ_CPU_ALWAYS_INLINE {
      vf acc[std::size_t{K}][std::size_t{2 * U}];  // (blocks, low nibbles then high ones)
      for (int b = 0; b < K; ++b)
        for (int u = 0; u < 2 * U; ++u) acc[b][u] = V::load(o + 32 * (b0 + b) + W * u);
      for (int t = 0; t < n; ++t) {
        std::uint8_t const* row = v.rows[t] + bb * static_cast<std::size_t>(b0);
        alignas(64) float w[std::size_t{W >= K ? W : K}];
        if constexpr (q4_0_rows::by_table && K > 1)  // the K weights computed together
          V::store(w, V::mul_c(V::set1(p[t]), f16_strided<bb, K>(row)));
        else
          for (int b = 0; b < K; ++b) w[b] = p[t] * scale_at(row + bb * static_cast<std::size_t>(b));
        for (int b = 0; b < K; ++b) {
          std::uint8_t const* codes = row + bb * static_cast<std::size_t>(b) + 2;
          vf const wb = V::set1(w[b]);
          for (int u = 0; u < U; ++u) {
            vi const bytes = V::load_u8(codes + W * u);
            acc[b][u] = V::fma(wb, centred(q4_0_rows::by_table ? bytes : V::and_i(bytes, V::set1_i(15))), acc[b][u]);
            acc[b][U + u] = V::fma(wb, centred(V::template srli<4>(bytes)), acc[b][U + u]);
          }
        }
      }
      for (int b = 0; b < K; ++b)
        for (int u = 0; u < 2 * U; ++u) V::store(o + 32 * (b0 + b) + W * u, acc[b][u]);
    });
  }

  /// o += sum_t p[t] v_t for one head's KIVI value rows of 4 or 2 bits (groups of 32 channels, d a
  /// multiple of 32) with each group's scale folded into the probability and its minimum summed
  /// apart: o += (p s) q over the codes q, then o += sum_t p m once per tile. A NaN or infinite
  /// scale or minimum gives the reference's NaN and Inf lanes (p s q is NaN where p (q s) is; an
  /// infinite p m makes the whole group infinite or NaN, as an infinite m makes each of its values).
  template <int B>
  KVQ_CPU_NOINLINE static void accumulate_one_head_kivi(float* o, float const* p, kivi_value_rows<B> const& v, int n,
                                                        int d) noexcept {
    constexpr std::size_t bb = detail::kivi_group_header_bytes + 32 * B / 8;
    // B = 4: W bytes give 2W channels, even and odd apart; B = 2 on at most 8 lanes ("crumbs"): W
    // bytes give 4W channels, apart by residue mod 4; B = 2 on 16 lanes: W codes per vector.
    constexpr bool crumbs = B == 2 && W <= 8;
    constexpr int U = B == 4 ? 16 / W : crumbs ? 8 / W : 32 / W;  // vectors of codes per group
    constexpr int NB = W == 16 ? 4 : W == 8 ? 2 : 3;
    alignas(64) static constexpr float codes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf const table = V::load(codes);
    block_passes<NB>(d / 32, [&]<int K>(int b0) KVQ_CPU_ALWAYS_INLINE {
      // B = 4: acc[b][2u] holds the even channels of bytes u W .. u W + W - 1 (low nibbles),
      // acc[b][2u + 1] the odd ones; crumbs: acc[b][4u + r] channels 4 (u W + l) + r in lane l;
      // else acc[b][u] channels u W .. u W + W - 1.
      constexpr int A = B == 4 ? 2 * U : crumbs ? 4 * U : U;
      vf acc[std::size_t{K}][std::size_t{A}];
      for (int b = 0; b < K; ++b)
        for (int u = 0; u < A; ++u) acc[b][u] = V::set1(0.0f);
      alignas(64) float w[std::size_t{W >= K ? W : K}];
      alignas(64) float pm[std::size_t{W >= K ? W : K}] = {};  // sum_t p m of group b0 + b
      vf pmv = V::set1(0.0f);
      for (int t = 0; t < n; ++t) {
        std::uint8_t const* row = v.rows[t] + bb * static_cast<std::size_t>(b0);
        if constexpr (register_table16) {  // the K weights and minima together
          vf const pt = V::set1(p[t]);
          V::store(w, V::mul_c(pt, f16_strided<bb, K>(row)));
          pmv = V::fma(pt, f16_strided<bb, K>(row + 2), pmv);
        } else {
          for (int b = 0; b < K; ++b) {
            std::uint8_t const* blk = row + bb * static_cast<std::size_t>(b);
            w[b] = p[t] * scale_at(blk);
            pm[b] += p[t] * scale_at(blk + 2);
          }
        }
        for (int b = 0; b < K; ++b) {
          std::uint8_t const* blk = row + bb * static_cast<std::size_t>(b) + detail::kivi_group_header_bytes;
          vf const wb = V::set1(w[b]);
          for (int u = 0; u < U; ++u) {
            if constexpr (B == 4 || crumbs) {
              constexpr int R = 8 / B;  // codes per byte lane
              vi const bytes = V::load_u8(blk + W * u);
              vf x[std::size_t{R}];
              if constexpr (B == 4 && register_table16) {  // the permute reads the low 4 bits of each lane
                x[0] = V::template lookup<4>(table, bytes);
                x[1] = V::template lookup<4>(table, V::template srli<4>(bytes));
              } else {
                unpack_byte_codes<B>(bytes, x);
              }
              for (int r = 0; r < R; ++r) acc[b][R * u + r] = V::fma(wb, x[r], acc[b][R * u + r]);
            } else {
              acc[b][u] = V::fma(wb, V::cvt_f(V::template load_codes<2>(blk + W * u / 4)), acc[b][u]);
            }
          }
        }
      }
      if constexpr (register_table16) V::store(pm, pmv);
      for (int b = 0; b < K; ++b) {
        float* const oc = o + 32 * (b0 + b);
        vf const mb = V::set1(pm[b]);
        for (int u = 0; u < A; u += B == 4 ? 2 : crumbs ? 4 : 1) {
          if constexpr (crumbs) {  // residues 0 .. 3 of 4W channels into channel order
            vf x0, x1, y0, y1, c[4];
            V::interleave(acc[b][u], acc[b][u + 2], x0, x1);      // channels 0, 2, 4, ...
            V::interleave(acc[b][u + 1], acc[b][u + 3], y0, y1);  // channels 1, 3, 5, ...
            V::interleave(x0, y0, c[0], c[1]);
            V::interleave(x1, y1, c[2], c[3]);
            for (int k = 0; k < 4; ++k) V::store(oc + W * (u + k), V::add(V::load(oc + W * (u + k)), V::add(c[k], mb)));
          } else if constexpr (B == 4) {
            vf lo, hi;
            V::interleave(acc[b][u], acc[b][u + 1], lo, hi);
            V::store(oc + W * u, V::add(V::load(oc + W * u), V::add(lo, mb)));
            V::store(oc + W * u + W, V::add(V::load(oc + W * u + W), V::add(hi, mb)));
          } else {
            V::store(oc + W * u, V::add(V::load(oc + W * u), V::add(acc[b][u], mb)));
          }
        }
      }
    });
  }

  // ---------------------------------------------------------------------------------------------
  // p . V on integers (probability_precision::i8)

  /// integer_weights over the tile's T lanes (tokens t >= n weigh 0), with the same f32 products
  /// and roundings, so the weights equal the reference's for equal probabilities.
  static float quantize_weights(float const* p, float const* sc, int n, std::int8_t* w, std::int32_t& sum) noexcept {
    vf x[std::size_t{T / W}];
    vf amax = V::set1(0.0f);
    vf const big = V::set1(std::numeric_limits<float>::max());
    unsigned ok = (1u << W) - 1u;
    for (int j = 0; j < T / W; ++j) {
      x[j] = V::select_f(V::lanes_below(n - j * W), V::mul_c(V::load(p + j * W), V::load(sc + j * W)), V::set1(0.0f));
      ok &= V::mask_bits(V::le_f(V::abs(x[j]), big));
      amax = V::max(amax, V::abs(x[j]));
    }
    sum = 0;
    if (ok != (1u << W) - 1u) return std::numeric_limits<float>::quiet_NaN();
    float const m = V::reduce_max(amax);
    if (m == 0.0f) return 0.0f;
    float const inv = 127.0f / m;
    if (!detail::is_finite_f32(inv)) return std::numeric_limits<float>::quiet_NaN();
    vf const iv = V::set1(inv);
    vf total = V::set1(0.0f);
    for (int j = 0; j < T / W; ++j) {
      vi const q = V::cvt_rne(V::mul_c(x[j], iv));
      total = V::add(total, V::cvt_f(q));  // integers below 2^24: exact
      V::store_u8(reinterpret_cast<std::uint8_t*>(w) + j * W, q);
    }
    sum = static_cast<std::int32_t>(V::reduce_add(total));
    return m / 127.0f;
  }

  /// The heads' integer weights of one tile and scale group, NH (at most) at a time.
  struct weight_block {
    static constexpr int NH = W >= 16 ? 4 : 2;
    alignas(64) std::int8_t w[std::size_t{NH}][std::size_t{T}];
    float step[std::size_t{NH}];
    std::int32_t sum[std::size_t{NH}];
  };

  /// o_i[c] += step_i · (sum_t w_i[t] · code_t[c] − bias · sum_i) for NH heads, the K · 16 signed
  /// byte codes at r[t] + off (channels c, c + 1, ...) of tokens t < n4 (a multiple of 4).
  template <int NH, int K>
  static void integer_s8(float* const* o, weight_block const& wb, std::uint8_t const* const* r, int n4, std::size_t off,
                         int c) noexcept {
    constexpr int VK = 16 / W;
    vi acc[std::size_t{NH}][std::size_t{K * VK}];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < K * VK; ++j) acc[i][j] = V::set1_i(0);
    for (int t = 0; t < n4; t += 4) {
      typename V::s8_quad q[std::size_t{K}];
      if constexpr (K == 2)
        V::s8_codes2(r + t, off, q[0], q[1]);
      else
        q[0] = V::s8_codes(r + t, off);
      for (int i = 0; i < NH; ++i) {
        std::int32_t w4;
        std::memcpy(&w4, wb.w[i] + t, 4);
        for (int k = 0; k < K; ++k) V::dot_s8(acc[i] + k * VK, q[k], w4);
      }
    }
    for (int i = 0; i < NH; ++i) {
      if (wb.step[i] == 0.0f) continue;
      vf const st = V::set1(wb.step[i]);
      vi const bias = V::set1_i(V::s8_code_bias * wb.sum[i]);
      for (int j = 0; j < K * VK; ++j) {
        float* const oc = o[i] + c + j * W;
        V::store(oc, V::fma(st, V::cvt_f(V::sub_i(acc[i][j], bias)), V::load(oc)));
      }
    }
  }

  /// integer_s8 for q4_0 blocks: the 32 nibble codes of the 16 bytes at r[t] + off (low nibbles
  /// channels c .. c + 15, high nibbles c + 16 .. c + 31), code = nibble − 8.
  template <int NH>
  static void integer_u4(float* const* o, weight_block const& wb, std::uint8_t const* const* r, int n4, std::size_t off,
                         int c) noexcept {
    constexpr int VK = 16 / W;
    vi lo[std::size_t{NH}][std::size_t{VK}], hi[std::size_t{NH}][std::size_t{VK}];
    for (int i = 0; i < NH; ++i)
      for (int j = 0; j < VK; ++j) lo[i][j] = hi[i][j] = V::set1_i(0);
    for (int t = 0; t < n4; t += 4) {
      auto const q = V::u4_codes(r + t, off);
      for (int i = 0; i < NH; ++i) {
        std::int32_t w4;
        std::memcpy(&w4, wb.w[i] + t, 4);
        V::dot_u4(lo[i], q.lo, w4);
        V::dot_u4(hi[i], q.hi, w4);
      }
    }
    for (int i = 0; i < NH; ++i) {
      if (wb.step[i] == 0.0f) continue;
      vf const st = V::set1(wb.step[i]);
      vi const bias = V::set1_i(8 * wb.sum[i]);
      for (int j = 0; j < VK; ++j) {
        float* const ol = o[i] + c + j * W;
        float* const oh = ol + 16;
        V::store(ol, V::fma(st, V::cvt_f(V::sub_i(lo[i][j], bias)), V::load(ol)));
        V::store(oh, V::fma(st, V::cvt_f(V::sub_i(hi[i][j], bias)), V::load(oh)));
      }
    }
  }

  /// The channels [c0, c1) of integer_s8 / integer_u4 one by one (tails, ISAs without byte dots).
  template <class VC>
  static void integer_channels(float* const* o, int nh, weight_block const& wb, std::uint8_t const* const* r, int n,
                               int c0, int c1) noexcept {
    for (int i = 0; i < nh; ++i) {
      if (wb.step[i] == 0.0f) continue;
      for (int c = c0; c < c1; ++c) {
        std::int32_t acc = 0;
        for (int t = 0; t < n; ++t)
          acc += static_cast<std::int32_t>(wb.w[i][t]) * integer_value_layout<VC>::code(r[t], c);
        o[i][c] = detail::madd_f32(wb.step[i], static_cast<float>(acc), o[i][c]);
      }
    }
  }

  /// o_h += P·V for every row of the group with integer weights (probability_precision::i8) over
  /// the n quantized value rows `rows` of one tile of an integer_value_codec VC: per scale group,
  /// each row's probabilities times the tokens' scales are rounded to weights (quantize_weights),
  /// the codes summed against them exactly and the sums scaled once; the reference's
  /// integer_tile computes the same (f32 products where a weight is not finite).
  template <class VC>
  static void accumulate_integer(float* out, int d, int group, float const* probs, std::uint8_t const* const* rows,
                                 int n) noexcept {
    using layout = integer_value_layout<VC>;
    constexpr int NH = weight_block::NH;
    int const n4 = (n + 3) & ~3;
    std::uint8_t const* r[T];
    for (int t = 0; t < n4; ++t) r[t] = rows[t < n ? t : 0];  // weight 0 past n
    alignas(64) float sc[T] = {};
    weight_block wb;
    int const gc = layout::group(d);
    int const groups = (d + gc - 1) / gc;
    // The f16 scales of up to 8 blocks (head_dim 256), gathered row by row (each row's lines are
    // touched once, together), then converted W at a time per block.
    constexpr int gathered = 8;
    alignas(64) std::uint16_t hs[gathered][T];
    if constexpr (!std::is_same_v<VC, int8_sym>) {
      if (groups <= gathered) {
        if (n < T)
          for (int g = 0; g < groups; ++g) std::memset(hs[g] + n, 0, 2 * static_cast<std::size_t>(T - n));
        for (int t = 0; t < n; ++t)
          for (int g = 0; g < groups; ++g)
            std::memcpy(hs[g] + t, r[t] + layout::block_bytes * static_cast<std::size_t>(g), 2);
      }
    }
    for (int g = 0; g < groups; ++g) {
      int const c0 = g * gc, c1 = std::min(d, c0 + gc);
      if constexpr (std::is_same_v<VC, int8_sym>) {
        for (int t = 0; t < n; ++t) sc[t] = layout::scale(r[t], 0);
      } else {
        if (groups > gathered)
          for (int t = 0; t < n; ++t) sc[t] = scale_at(r[t] + layout::block_bytes * static_cast<std::size_t>(g));
        else
          for (int t = 0; t < T; t += W) V::store(sc + t, V::f16_load_hw(hs[g] + t));
      }
      for (int h0 = 0; h0 < group; h0 += NH) {
        int const nh = std::min(NH, group - h0);
        float* o[std::size_t{NH}];
        for (int i = 0; i < nh; ++i) {
          int const h = h0 + i;
          o[i] = out + static_cast<std::ptrdiff_t>(h) * d;
          float const* p = probs + h * T;
          wb.step[i] = quantize_weights(p, sc, n, wb.w[i], wb.sum[i]);
          if (detail::is_nan_f32(wb.step[i])) {  // f32 products, as the reference
            for (int t = 0; t < n; ++t)
              for (int c = c0; c < c1; ++c)
                o[i][c] =
                    detail::madd_f32(p[t], detail::mul_rn(static_cast<float>(layout::code(r[t], c)), sc[t]), o[i][c]);
            wb.step[i] = 0.0f;
          }
          if (wb.step[i] == 0.0f) std::memset(wb.w[i], 0, T);
        }
        int c = c0;
        if constexpr (V::integer_value_dots) {
          with_head_count(nh, [&](auto k) {
            constexpr int K = std::min<int>(decltype(k)::value, NH);
            if constexpr (std::is_same_v<VC, q4_0>) {
              if (c + 32 <= c1) {
                integer_u4<K>(o, wb, r, n4, layout::block_bytes * static_cast<std::size_t>(g) + 2, c);
                c += 32;
              }
            } else {
              std::size_t const base =
                  std::is_same_v<VC, int8_sym>
                      ? detail::int8_row_header_bytes
                      : layout::block_bytes * static_cast<std::size_t>(g) + 2 - static_cast<std::size_t>(c0);
              for (; c + 32 <= c1; c += 32) integer_s8<K, 2>(o, wb, r, n4, base + static_cast<std::size_t>(c), c);
              for (; c + 16 <= c1; c += 16) integer_s8<K, 1>(o, wb, r, n4, base + static_cast<std::size_t>(c), c);
            }
          });
        }
        integer_channels<VC>(o, nh, wb, r, n, c, c1);
      }
    }
  }

  /// Calls f(loader, first, count) for the value rows of tokens [tb, tb + n), segment by segment.
  template <class VC, class F>
  static void with_value_rows(token_source const& v, typename VC::params_type const& vp, int d, std::int64_t tb, int n,
                              attention_scratch& s, tile_rows& tr, F&& f) noexcept {
    int i = 0;
    while (i < n) {
      std::int64_t const t = tb + i;
      if (t >= v.quantized) {
        int const m = n - i;
        with_residual_rows(v, d, t, m, tr, [&](auto const& rows) { f(rows, i, m); });
        i += m;
      } else {
        int const m = static_cast<int>(std::min<std::int64_t>(n - i, v.quantized - t));
        with_quantized_rows<VC>(v, vp, d, t, m, tr, s.values.data(), [&](auto const& rows) { f(rows, i, m); });
        i += m;
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Softmax

  /// The reference's per-token online-softmax update (attention.hpp), for a head whose tile holds
  /// a NaN or an infinite logit; v: the tile's value rows as f32 (d floats apart).
  static void update_per_token(float* o, float& m, float& sum, int d, float const* s, int n, float const* v,
                               bool f16_probabilities) noexcept {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) {
      if (s[t] == neg_inf) continue;
      if (s[t] > m) {
        float const corr = m == neg_inf ? 0.0f : std::exp(m - s[t]);
        for (int c = 0; c < d; ++c) o[c] *= corr;
        sum *= corr;
        m = s[t];
      }
      float const p = std::exp(s[t] - m);
      float const pv = f16_probabilities ? detail::f16_bits_to_f32(detail::f32_to_f16_bits(p)) : p;
      sum += p;
      float const* vt = v + static_cast<std::ptrdiff_t>(t) * d;
      for (int c = 0; c < d; ++c) o[c] = detail::madd_f32(pv, vt[c], o[c]);
    }
  }

  /// Scales (and softcaps) one head's n logits s in place, rescales its state to the new running
  /// max and writes the probabilities to p. Returns false, touching nothing else, when the logits
  /// hold a NaN or an infinity, or when `row` >= 0 and that row's masks change a logit of tokens
  /// [t_first, t_first + n) (then s holds the masked logits; the per-token path handles all
  /// those); p is all 0 when every logit is -Inf.
  static bool softmax_tile(float* o, float& m, float& sum, attention_call const& call, float* s, int n, float* p,
                           int row, std::int64_t t_first, float offset) noexcept {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    constexpr float big = std::numeric_limits<float>::max();
    int const d = call.head_dim;
    bool finite = true;
    float tmax = neg_inf;
    int t0 = 0;
    if (call.softcap == 0.0f) {
      vf const sc = V::set1(call.scale), bigv = V::set1(big), off = V::set1(offset);
      vf mx = V::set1(neg_inf);
      unsigned ok = (1u << W) - 1u;
      for (; t0 + W <= n; t0 += W) {
        vf x = V::mul_c(V::load(s + t0), sc);
        if (call.row_offset != nullptr) x = V::add(x, off);
        V::store(s + t0, x);
        ok &= V::mask_bits(V::le_f(V::abs(x), bigv));  // lanes neither NaN nor infinite
        mx = V::max(mx, x);
      }
      finite = ok == (1u << W) - 1u;
      tmax = V::reduce_max(mx);
    }
    for (int t = t0; t < n; ++t) {
      float x = s[t] * call.scale;
      if (call.row_offset != nullptr) x += offset;
      if (call.softcap > 0.0f) x = call.softcap * std::tanh(x / call.softcap);
      s[t] = x;
      finite = finite && std::fabs(x) <= big;
      tmax = std::max(tmax, x);
    }
    if (row >= 0 && !call.unmasked(row, t_first, n)) {
      call.apply_masks(row, t_first, s, n);
      return false;  // masked logits are -Inf: the per-token path skips them as the reference does
    }
    if (!finite) return false;
    if (tmax > m) {
      float const corr = m == neg_inf ? 0.0f : std::exp(m - tmax);
      vf const cv = V::set1(corr);
      int c = 0;
      for (; c + W <= d; c += W) V::store(o + c, V::mul_c(V::load(o + c), cv));
      for (; c < d; ++c) o[c] *= corr;
      sum *= corr;
      m = tmax;
    }
    vf const mv = V::set1(m);
    vf acc = V::set1(0.0f);
    int t = 0;
    for (; t + W <= n; t += W) {
      vf const e = exp_nonpositive(V::sub(V::load(s + t), mv));
      acc = V::add(acc, e);
      V::store(p + t, call.f16_probabilities ? V::round_f16(e) : e);
    }
    float total = V::reduce_add(acc);
    for (; t < n; ++t) {
      float const e = call.i8_weights ? exp_nonpositive_scalar(s[t] - m) : std::exp(s[t] - m);
      total += e;
      p[t] = call.f16_probabilities ? detail::f16_bits_to_f32(detail::f32_to_f16_bits(e)) : e;
    }
    sum += total;
    return true;
  }

  /// Writes the loader's m value rows as f32 to s.special_values from tile row `first`, for the
  /// per-token path.
  template <class L>
  static void save_special_values(L const& rows, int first, int m, int d, attention_scratch& s) noexcept {
    for (int r = 0; r < m; ++r) {
      float* y = s.special_values.data() + static_cast<std::ptrdiff_t>(first + r) * d;
      for (int c = 0; c < d; ++c) y[c] = rows.at(r, c);
    }
  }

  /// The reference's per-token update of the tile's n tokens for the rows marked in s.special:
  /// each row's output restored from s.saved, its scaled logits row-major in s.logits (rows, T).
  static void update_special_rows(attention_call const& call, int rows, int n, float* out, float* max, float* sum,
                                  attention_scratch& s) noexcept {
    int const d = call.head_dim;
    for (int r = 0; r < rows; ++r) {
      if (!s.special[static_cast<std::size_t>(r)]) continue;
      float* const o = out + static_cast<std::ptrdiff_t>(r) * d;
      std::memcpy(o, s.saved.data() + static_cast<std::ptrdiff_t>(r) * d, static_cast<std::size_t>(d) * 4);
      update_per_token(o, max[r], sum[r], d, s.logits.data() + static_cast<std::ptrdiff_t>(r) * T, n,
                       s.special_values.data(), call.f16_probabilities);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Many query rows: transposed query, logits and probabilities

  /// Query rows from which attend() works on transposed tiles (attend_transposed): 16 on AVX-512
  /// and AVX2, 8 on NEON (measured on AVX-512: 16 rows take 0.6x the time of the per-row path).
  static constexpr int transposed_rows = W >= 16 ? W : 2 * W;
  /// Tokens and row vectors of one dot_block_t: R * NV accumulators.
  static constexpr int block_tokens = W >= 16 ? 8 : 4;
  static constexpr int block_vectors = W >= 8 ? 2 : 4;

  /// lt[j * rp + c'] = q_(c') . k_j for NV * W rows (columns c' of qt, the query transposed: (d,
  /// rp)) and tokens j < nt <= R: each key element is broadcast against NV vectors of rows, so the
  /// R * NV accumulators need no horizontal sums.
  template <int R, int NV>
  static void dot_block_t(float const* qt, int rp, int d, float const* const* k, int nt, float* lt) noexcept {
    vf acc[std::size_t{R}][std::size_t{NV}];
    for (int j = 0; j < R; ++j)
      for (int v = 0; v < NV; ++v) acc[j][v] = V::set1(0.0f);
    float const* kj[std::size_t{R}];
    for (int j = 0; j < R; ++j) kj[j] = k[j < nt ? j : nt - 1];
    for (int c = 0; c < d; ++c) {
      float const* qc = qt + static_cast<std::ptrdiff_t>(c) * rp;
      vf qv[std::size_t{NV}];
      for (int v = 0; v < NV; ++v) qv[v] = V::load(qc + v * W);
      for (int j = 0; j < R; ++j) {
        vf const kb = V::set1(kj[j][c]);
        for (int v = 0; v < NV; ++v) acc[j][v] = V::fma(kb, qv[v], acc[j][v]);
      }
    }
    for (int j = 0; j < nt; ++j)
      for (int v = 0; v < NV; ++v) V::store(lt + static_cast<std::ptrdiff_t>(j) * rp + v * W, acc[j][v]);
  }

  /// dot_block_t over the `left` row vectors from qt, NV at a time.
  template <int R, int NV>
  static void dot_blocks_t(float const* qt, int rp, int left, int d, float const* const* k, int nt,
                           float* lt) noexcept {
    for (; left >= NV; left -= NV, qt += NV * W, lt += NV * W) dot_block_t<R, NV>(qt, rp, d, k, nt, lt);
    if constexpr (NV > 1)
      if (left > 0) dot_blocks_t<R, NV - 1>(qt, rp, left, d, k, nt, lt);
  }

  /// lt[(off + j) * rp + r] = q_r . k_j for the rows of qt (rp of them, padded) and the loader's
  /// tokens j < m (decoded into buf first).
  template <class L>
  static void dot_rows_t(float const* qt, int rp, int d, L const& k, int m, int off, float* lt, float* buf) noexcept {
    decode_rows(k, m, d, buf);  // f32 rows copied too: the broadcasts then read L1
    float const* rows[T];
    for (int j = 0; j < m; ++j) rows[j] = buf + static_cast<std::ptrdiff_t>(j) * d;
    constexpr int R = block_tokens;
    for (int j0 = 0; j0 < m; j0 += R)
      dot_blocks_t<R, block_vectors>(qt, rp, rp / W, d, rows + j0, std::min(R, m - j0),
                                     lt + static_cast<std::ptrdiff_t>(off + j0) * rp);
  }

  /// The online-softmax update of one tile for every row at once, on the transposed logits lt (n, rp):
  /// scale, offset, softcap and the rows' token ranges applied in place, the rows' max and sum
  /// (m, l) updated, their output corrections written to corr and the probabilities to pt (n, rp).
  /// Rows whose tile holds a NaN or +Inf logit keep their state, get corr 1 and probabilities 0,
  /// and are marked in `special` (1.0f) for the reference's per-token path.
  static void softmax_tile_t(attention_call const& call, int rows, int rp, float* lt, int n, float* m, float* l,
                             float* corr, float const* offset, float const* first, float const* last, bool ranged,
                             float* special, float* pt) noexcept {
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    bool const capped = call.softcap > 0.0f;
    if (capped)  // scale, offset and softcap as the reference orders them, element by element
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < rows; ++r) {
          float& x = lt[static_cast<std::ptrdiff_t>(t) * rp + r];
          x = x * call.scale + offset[r];
          x = call.softcap * std::tanh(x / call.softcap);
        }
    vf const sc = V::set1(call.scale), bigv = V::set1(std::numeric_limits<float>::max());
    vf const ninf = V::set1(neg_inf), zero = V::set1(0.0f), one = V::set1(1.0f);
    for (int r0 = 0; r0 < rp; r0 += W) {
      vf const off = V::load(offset + r0);
      vf const lo = V::load(first + r0), hi = V::load(last + r0);
      vf mx = ninf, bad = zero;
      for (int t = 0; t < n; ++t) {
        float* const x_at = lt + static_cast<std::ptrdiff_t>(t) * rp + r0;
        vf x = V::load(x_at);
        if (!capped) x = V::add(V::mul_c(x, sc), off);
        if (ranged) {
          vf const tv = V::set1(static_cast<float>(t));
          x = V::select_f(V::gt_f(lo, tv), ninf, x);
          x = V::select_f(V::le_f(hi, tv), ninf, x);
        }
        V::store(x_at, x);
        bad = V::select_f(V::le_f(x, bigv), bad, one);  // NaN or +Inf
        mx = V::max(mx, x);
      }
      vm const is_bad = V::gt_f(bad, zero);
      vf const m_old = V::load(m + r0);
      vf const m_new = V::select_f(is_bad, m_old, V::max(m_old, mx));
      vm const none = V::le_f(m_new, ninf);  // every logit so far -Inf: nothing attended yet
      vf const skip = V::select_f(none, one, bad);
      vf c = V::select_f(V::gt_f(skip, zero), one, exp_nonpositive(V::sub(m_old, m_new)));
      vf sum = zero;
      for (int t = 0; t < n; ++t) {
        float const* const x_at = lt + static_cast<std::ptrdiff_t>(t) * rp + r0;
        vf e = exp_nonpositive(V::sub(V::load(x_at), m_new));
        e = V::select_f(V::gt_f(skip, zero), zero, e);
        sum = V::add(sum, e);
        V::store(pt + static_cast<std::ptrdiff_t>(t) * rp + r0, call.f16_probabilities ? V::round_f16(e) : e);
      }
      vf const l_old = V::load(l + r0);
      V::store(l + r0, V::select_f(is_bad, l_old, V::add(V::mul_c(l_old, c), sum)));
      V::store(m + r0, m_new);
      V::store(corr + r0, c);
      V::store(special + r0, bad);
    }
  }

  /// attend() for many query rows (call.group >= transposed_rows, no i8 weights, no custom masks,
  /// no integer key dots): the query is transposed once, each tile's logits come out transposed
  /// (tokens, rows) from register-blocked outer products, the softmax runs on vectors of rows, and
  /// p . V reads the transposed probabilities.
  template <class KC, class VC>
  static void attend_transposed(token_source const& k, typename KC::params_type const& kp, token_source const& v,
                                typename VC::params_type const& vp, attention_call const& call, float const* q,
                                std::int64_t begin, std::int64_t end, attention_state const& state,
                                attention_scratch& s) noexcept {
    int const d = call.head_dim;
    int const rows = call.group;
    int const rp = (rows + W - 1) / W * W;
    std::size_t const urp = static_cast<std::size_t>(rp), ud = static_cast<std::size_t>(d);
    s.query_t.assign(ud * urp, 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < d; ++c)
        s.query_t[static_cast<std::size_t>(c) * urp + static_cast<std::size_t>(r)] =
            q[static_cast<std::size_t>(r) * ud + static_cast<std::size_t>(c)];
    s.logits_t.resize(T * urp);
    s.probs_t.resize(T * urp);
    s.rows_t.assign(7 * urp, 0.0f);
    if (s.saved.size() < static_cast<std::size_t>(rows) * ud) s.saved.resize(static_cast<std::size_t>(rows) * ud);
    if (s.special.size() < static_cast<std::size_t>(rows)) s.special.resize(static_cast<std::size_t>(rows));
    if (s.logits.size() < static_cast<std::size_t>(rows) * T) s.logits.resize(static_cast<std::size_t>(rows) * T);
    float* const m = s.rows_t.data();
    float* const l = m + urp;
    float* const corr = l + urp;
    float* const offset = corr + urp;
    float* const first = offset + urp;
    float* const last = first + urp;
    float* const special = last + urp;
    for (int r = 0; r < rp; ++r) m[r] = -std::numeric_limits<float>::infinity();
    std::copy_n(state.max, rows, m);
    std::copy_n(state.sum, rows, l);
    if (call.row_offset != nullptr) std::copy_n(call.row_offset, rows, offset);
    tile_rows tr;
    for (std::int64_t t0 = begin; t0 < end; t0 += T) {
      std::int64_t const tb = t0;
      int const n = static_cast<int>(std::min(end, t0 + T) - tb);
      prefetch_tile(k, KC::geometry(d).tokens, tb + n, std::min<std::int64_t>(end - tb - n, T));
      tile_logits<KC, false>(k, kp, call, q, nullptr, tb, n, s, tr, [&](auto const& rows_of, int cnt, int off) {
        dot_rows_t(s.query_t.data(), rp, d, rows_of, cnt, off, s.logits_t.data(), s.keys.data());
      });
      prefetch_tile(v, 1, tb + n, std::min<std::int64_t>(end - tb - n, T));
      // The rows' token ranges within the tile (causal and window masks).
      bool ranged = false;
      if (call.row_begin != nullptr || call.row_end != nullptr) {
        std::int64_t const j0 = call.token_offset + tb;
        for (int r = 0; r < rp; ++r) {
          std::int64_t lo = 0, hi = n;
          if (r < rows && call.row_begin != nullptr) lo = std::clamp<std::int64_t>(call.row_begin[r] - j0, 0, n);
          if (r < rows && call.row_end != nullptr) hi = std::clamp<std::int64_t>(call.row_end[r] - j0, 0, n);
          ranged = ranged || lo > 0 || hi < n;
          first[r] = static_cast<float>(lo);
          last[r] = static_cast<float>(hi);
        }
      }
      softmax_tile_t(call, rows, rp, s.logits_t.data(), n, m, l, corr, offset, first, last, ranged, special,
                     s.probs_t.data());
      bool any_special = false;
      for (int r = 0; r < rows; ++r) {
        float* const o = state.out + static_cast<std::ptrdiff_t>(r) * d;
        bool const sp = special[r] != 0.0f;
        s.special[static_cast<std::size_t>(r)] = sp;
        if (sp) {  // the row's scaled logits, row-major, for the per-token path
          any_special = true;
          std::memcpy(s.saved.data() + static_cast<std::ptrdiff_t>(r) * d, o, ud * 4);
          for (int t = 0; t < n; ++t)
            s.logits[static_cast<std::size_t>(r) * T + static_cast<std::size_t>(t)] =
                s.logits_t[static_cast<std::size_t>(t) * urp + static_cast<std::size_t>(r)];
        } else if (corr[r] != 1.0f) {
          vf const cv = V::set1(corr[r]);
          int c = 0;
          for (; c + W <= d; c += W) V::store(o + c, V::mul_c(V::load(o + c), cv));
          for (; c < d; ++c) o[c] *= corr[r];
        }
      }
      with_value_rows<VC>(v, vp, d, tb, n, s, tr, [&](auto const& vrows, int fst, int cnt) {
        using loader = std::decay_t<decltype(vrows)>;
        float const* const pt = s.probs_t.data();
        if constexpr (std::is_same_v<loader, f32_rows>) {
          accumulate<1>(state.out, d, rows, pt, fst, vrows, cnt, rp);
        } else {
          decode_rows<loader>(vrows, cnt, d, s.dense.data());
          std::uint8_t const* ptrs[T];
          accumulate<1>(state.out, d, rows, pt, fst, rows_in(s.dense.data(), cnt, d, ptrs), cnt, rp);
        }
        if (any_special) save_special_values(vrows, fst, cnt, d, s);
      });
      if (any_special) update_special_rows(call, rows, n, state.out, m, l, s);
    }
    std::copy_n(m, rows, state.max);
    std::copy_n(l, rows, state.sum);
  }

  // ---------------------------------------------------------------------------------------------
  // Entry

  /// Asks for the quantized bytes of tokens [t, t + n) to be brought into cache (units of
  /// `per_unit` tokens).
  static void prefetch_tile(token_source const& src, int per_unit, std::int64_t t, std::int64_t n) noexcept {
    if (n <= 0 || t >= src.quantized) return;
    std::int64_t const last = std::min(t + n, src.quantized) - 1;
    std::size_t const first_unit = static_cast<std::size_t>(t / per_unit);
    prefetch_bytes(src.units + first_unit * src.unit_bytes,
                   (static_cast<std::size_t>(last / per_unit) + 1 - first_unit) * src.unit_bytes);
  }

  /// Attends the group's heads (query q: (group, head_dim), already rounded as the options say;
  /// qb: its q8_0 blocks (group, blocks) for integer key dots, or nullptr) to tokens [begin, end)
  /// of one kv head, updating `state`.
  template <class KC, class VC>
  static void attend(token_source const& k, typename KC::params_type const& kp, token_source const& v,
                     typename VC::params_type const& vp, attention_call const& options, float const* q,
                     detail::block_q8_0 const* qb, std::int64_t begin, std::int64_t end, attention_state const& state,
                     attention_scratch& s) noexcept {
    attention_call call = options;
    call.i8_weights = call.i8_weights && integer_value_codec<VC>;  // others: f32 probabilities, as given
    if (call.group >= transposed_rows && !call.i8_weights && call.row_bias == nullptr && call.row_allow == nullptr &&
        (qb == nullptr || !integer_dot_key<KC>)) {
      attend_transposed<KC, VC>(k, kp, v, vp, call, q, begin, end, state, s);
      return;
    }
    int const d = call.head_dim;
    int const group = call.group;
    tile_rows tr;
    if (s.probs.size() < static_cast<std::size_t>(group) * T) s.probs.resize(static_cast<std::size_t>(group) * T);
    if (s.saved.size() < static_cast<std::size_t>(group) * static_cast<std::size_t>(d))
      s.saved.resize(static_cast<std::size_t>(group) * static_cast<std::size_t>(d));
    if (s.special.size() < static_cast<std::size_t>(group)) s.special.resize(static_cast<std::size_t>(group));
    if constexpr (integer_dot_key<KC>) {
      if (qb != nullptr) {
        std::size_t const nqb = static_cast<std::size_t>(group) * static_cast<std::size_t>((d + 31) / 32);
        if (s.q_scale.size() < nqb) {
          s.q_scale.resize(nqb);
          s.q_sum.resize(nqb);
        }
        query_block_terms(qb, nqb, s.q_scale.data(), s.q_sum.data());
      }
    }
    // fp8 rows: the scale folded into the query (keys) or into the probabilities (values) where no
    // product can overflow in either order, so the NaN and Inf lanes stay the reference's and the
    // loaders skip one multiply per vector.
    bool fold_key_scale = false, fold_value_scale = false;
    float value_factor = 0.0f;
    if constexpr (fp8_codec<KC>) {
      using rows_type = fp8_rows<std::is_same_v<KC, fp8_e4m3>>;
      float const f = rows_type{nullptr, kp.scale}.factor();
      std::size_t const nq = static_cast<std::size_t>(group) * static_cast<std::size_t>(d);
      float qmax = 0.0f;  // NaN lanes are skipped (q f keeps them NaN)
      for (std::size_t i = 0; i < nq; ++i) qmax = std::max(qmax, std::fabs(q[i]));
      if (std::isfinite(f * rows_type::largest) && std::isfinite(qmax * f * rows_type::largest)) {
        if (s.folded_query.size() < nq) s.folded_query.resize(nq);
        for (std::size_t i = 0; i < nq; ++i) s.folded_query[i] = q[i] * f;
        fold_key_scale = true;
      }
    }
    if constexpr (fp8_codec<VC>) {
      using rows_type = fp8_rows<std::is_same_v<VC, fp8_e4m3>>;
      value_factor = rows_type{nullptr, vp.scale}.factor();
      fold_value_scale = std::isfinite(value_factor * rows_type::largest);
    }
    // Weighted probabilities (p times a row or codec scale) for the folds of fp8 and tq values.
    if ((fold_value_scale || simd::tq_codebook_traits<VC>::value) &&
        s.weights.size() < static_cast<std::size_t>(group) * T)
      s.weights.resize(static_cast<std::size_t>(group) * T);
    for (std::int64_t t0 = begin; t0 < end; t0 += T) {
      std::int64_t const tb = t0;
      int const n = static_cast<int>(std::min(end, t0 + T) - tb);
      prefetch_tile(k, KC::geometry(d).tokens, tb + n, std::min<std::int64_t>(end - tb - n, T));
      tile_logits<KC>(k, kp, call, q, qb, tb, n, s, tr, [&](auto const& rows, int m, int off) {
        if constexpr (is_scaled_fp8_rows<std::decay_t<decltype(rows)>>) {
          if (fold_key_scale)
            return dot_rows(s.folded_query.data(), d, group, rows.unscaled(), m, off, s.logits.data());
        }
        dot_rows(q, d, group, rows, m, off, s.logits.data());
      });
      prefetch_tile(v, 1, tb + n, std::min<std::int64_t>(end - tb - n, T));
      // Softmax per head; heads with a NaN or infinite logit take the per-token path below.
      bool any_special = false;
      for (int h = 0; h < group; ++h) {
        float* const o = state.out + static_cast<std::ptrdiff_t>(h) * d;
        bool const ok =
            softmax_tile(o, state.max[h], state.sum[h], call, s.logits.data() + h * T, n, s.probs.data() + h * T,
                         call.masked() ? h : -1, tb, call.row_offset != nullptr ? call.row_offset[h] : 0.0f);
        s.special[static_cast<std::size_t>(h)] = !ok;
        if (!ok) {
          any_special = true;
          std::memcpy(s.saved.data() + static_cast<std::ptrdiff_t>(h) * d, o, static_cast<std::size_t>(d) * 4);
          std::fill_n(s.probs.data() + h * T, n, 0.0f);
        }
      }
      with_value_rows<VC>(v, vp, d, tb, n, s, tr, [&](auto const& rows, int first, int m) {
        using loader = std::decay_t<decltype(rows)>;
        // The whole tile's probabilities as u8 against the value codes, when the call asks for it.
        constexpr bool integer_codes =
            integer_value_codec<VC> && !std::is_same_v<loader, f16_rows> && !std::is_same_v<loader, f32_rows>;
        if (integer_codes && call.i8_weights && first == 0 && m == n) {
          if constexpr (integer_codes) accumulate_integer<VC>(state.out, d, group, s.probs.data(), rows.rows, m);
        } else if (group >= many_rows && !std::is_same_v<loader, f32_rows>) {  // decoded once for the many rows
          decode_rows<loader>(rows, m, d, s.dense.data());
          std::uint8_t const* ptrs[T];
          accumulate(state.out, d, group, s.probs.data(), first, rows_in(s.dense.data(), m, d, ptrs), m);
        } else if constexpr (std::is_same_v<loader, q4_0_rows>) {
          if (group == 1 && d % 32 == 0)
            accumulate_one_head_q4_0(state.out, s.probs.data() + first, rows, m, d);
          else
            accumulate(state.out, d, group, s.probs.data(), first, rows, m);
        } else if constexpr ((std::is_same_v<loader, kivi_value_rows<4>> ||
                              std::is_same_v<loader, kivi_value_rows<2>>)) {
          if (group == 1 && d % 32 == 0)
            accumulate_one_head_kivi(state.out, s.probs.data() + first, rows, m, d);
          else
            accumulate(state.out, d, group, s.probs.data(), first, rows, m);
        } else if constexpr (is_tq_rows<loader>) {
          if (rows.blocks == 1) {  // (p g) c for the unscaled centroids c: NaN and Inf where p (g c) is
            float g[T];
            rows.token_scales(m, g);
            float* const w = s.weights.data();
            for (int h = 0; h < group; ++h)
              for (int t = 0; t < m; ++t)
                w[h * T + first + t] = s.probs[static_cast<std::size_t>(h * T + first + t)] * g[t];
            accumulate(state.out, d, group, w, first, rows.unscaled(), m);
          } else {
            accumulate(state.out, d, group, s.probs.data(), first, rows, m);
          }
        } else if constexpr (is_scaled_fp8_rows<loader>) {
          if (fold_value_scale) {  // (p f) x for the unscaled x
            float* const w = s.weights.data();
            for (int h = 0; h < group; ++h)
              for (int t = first; t < first + m; ++t)
                w[h * T + t] = s.probs[static_cast<std::size_t>(h * T + t)] * value_factor;
            accumulate(state.out, d, group, w, first, rows.unscaled(), m);
          } else {
            accumulate(state.out, d, group, s.probs.data(), first, rows, m);
          }
        } else {
          accumulate(state.out, d, group, s.probs.data(), first, rows, m);
        }
        if (any_special) save_special_values(rows, first, m, d, s);
      });
      if (any_special) update_special_rows(call, group, n, state.out, state.max, state.sum, s);
    }
  }
};

}  // namespace simd
}  // namespace cpu_kernels
KVQ_NAMESPACE_END

/// Defines kvq::cpu_kernels::<isa>::attention_kernel, simd_attention over the policy OPS.
#define KVQ_CPU_DEFINE_ATTENTION(OPS) \
  struct attention_kernel : ::kvq::cpu_kernels::simd::simd_attention<OPS> {};
