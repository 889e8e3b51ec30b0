// kvq: decode attention on a quantized cache (CPU, scalar reference).
//
//   out[h] = softmax(scale · q[h] · K[kv(h)]ᵀ) · V[kv(h)]   for every query head h of one layer,
//   kv(h) = h / (q_heads / kv_heads)  (GQA; MQA when kv_heads = 1; MHA when equal).
//
// The cache is read tile by tile (`attention_tile` tokens): each tile of a kv_head is decoded once
// and used by every query head that shares it; no full-precision copy of the cache is made.
// Softmax is online (flash-style) with fp32 accumulation, so any context length works.
//
// NaN/Inf: a NaN or +Inf logit makes that head's output NaN; −Inf logits get weight 0; a head that
// attends to no token (empty range, or every logit −Inf) outputs zeros. NaN or Inf in V propagates
// through the weighted sum as IEEE arithmetic says.
//
// Split form: `attend_range` over [begin, end) returns a partial state (unnormalised output,
// running max, running sum) per head; `combine` merges two states exactly (rescaling by exp of the
// max difference) and `finalize` divides, so an engine can run the parts on its own thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend/cpu/attention_kernels.hpp"
#include "cache.hpp"
#include "codec/centered.hpp"
#include "codec/int8.hpp"
#include "codec/q4_0.hpp"
#include "codec/q8_0.hpp"
#include "detail/host_vector.hpp"

KVQ_NAMESPACE_BEGIN

/// Precision of the query in the q·K products.
enum class query_precision {
  f32,   ///< the query as given
  q8_0,  ///< the query rounded to q8_0 blocks; q8_0/q4_0 keys then use integer block dot products
};

/// Precision of the softmax probabilities in the P·V products.
enum class probability_precision {
  f32,  ///< probabilities as computed
  f16,  ///< probabilities rounded to f16 before multiplying V (sums stay f32)
  /// Integer P·V (CPU): for q8_0, q4_0 and int8 values, per tile of 32 tokens, query row and value
  /// scale group, each probability times its token's scale is rounded to an integer in [-127, 127]
  /// against the group's largest (a relative step of 1/127 of it), the codes are summed against
  /// those integers exactly and the sums scaled once; sums stay f32 and exact. Tiles with a masked,
  /// infinite or NaN logit, and other value codecs, take f32 probabilities. The CUDA and Metal
  /// caches raise unsupported_error.
  i8,
};

/// Which tokens each query token of a multi-token attention (kvq::attention) attends.
enum class mask_kind {
  causal,    ///< query token i, at position first_pos + i, attends tokens [0, first_pos + i]
  none,      ///< every query token attends every token of the layer
  additive,  ///< every token, with mask_data's floats (n_q, mask_stride) added to the logits (−Inf excludes)
  boolean,   ///< the tokens mask_data's bytes (n_q, mask_stride) allow: nonzero attends, 0 excludes
};

/// Options of decode and multi-token attention.
struct attention_options {
  float scale = 0.0f;  ///< softmax scale; 0 means 1/sqrt(head_dim)
  std::int64_t window =
      0;  ///< > 0: a query at position p attends only tokens (p − window, p]; decode: the last `window`
  float softcap = 0.0f;  ///< > 0: logit = softcap · tanh(logit / softcap), after scaling
  query_precision query = query_precision::f32;
  probability_precision probabilities = probability_precision::f32;
  /// Attention sinks: nullptr, or one logit per query head (q_heads floats, finite or −Inf) that
  /// joins every softmax denominator of that head without a value (gpt-oss style).
  float const* sinks = nullptr;
  // Multi-token attention only (kvq::attention; decode attention is its n_q = 1 case):
  mask_kind mask = mask_kind::causal;
  std::int64_t first_pos = -1;  ///< position of query token 0; −1: size(layer) − n_q (the chunk just appended)
  void const* mask_data =
      nullptr;  ///< additive: float, boolean: std::uint8_t; row i at element i · mask_stride, column j = token j
  std::int64_t mask_stride = 0;  ///< elements between mask rows; 0: size(layer)
};

/// Tokens decoded per tile by the reference kernel.
inline constexpr int attention_tile = 32;

/// Partial attention over a token range: per query head, the unnormalised output, running max
/// and running sum of exp(logit − max).
struct attention_partial {
  int q_heads = 0;
  int head_dim = 0;
  detail::vector<float> out;  ///< (q_heads, head_dim)
  detail::vector<float> max;  ///< (q_heads), −Inf when nothing was attended
  detail::vector<float> sum;  ///< (q_heads)

  /// An empty state (no token attended) for q_heads × head_dim.
  static auto empty(int q_heads, int head_dim) -> attention_partial {
    attention_partial p;
    p.q_heads = q_heads;
    p.head_dim = head_dim;
    p.out.assign(static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(head_dim), 0.0f);
    p.max.assign(static_cast<std::size_t>(q_heads), -std::numeric_limits<float>::infinity());
    p.sum.assign(static_cast<std::size_t>(q_heads), 0.0f);
    return p;
  }
};

namespace detail {

/// Integer dot product of a q8_0 key block with a q8_0 query block (ggml order, no fusion):
/// sumi · (dk · dq).
inline auto dot_block(block_q8_0 const& k, block_q8_0 const& q) -> float {
  int sumi = 0;
  for (int j = 0; j < 32; ++j) sumi += static_cast<int>(k.qs[j]) * static_cast<int>(q.qs[j]);
  return mul_rn(static_cast<float>(sumi), mul_rn(f16_bits_to_f32(k.d), f16_bits_to_f32(q.d)));
}

/// Integer dot product of a q4_0 key block with a q8_0 query block (ggml order, no fusion):
/// (sumi · dk) · dq.
inline auto dot_block(block_q4_0 const& k, block_q8_0 const& q) -> float {
  int sumi = 0;
  for (int j = 0; j < 16; ++j) {
    sumi += ((k.qs[j] & 0x0f) - 8) * static_cast<int>(q.qs[j]);
    sumi += ((k.qs[j] >> 4) - 8) * static_cast<int>(q.qs[j + 16]);
  }
  return mul_rn(mul_rn(static_cast<float>(sumi), f16_bits_to_f32(k.d)), f16_bits_to_f32(q.d));
}

/// Dot product of a q8_0/q4_0 key row with a q8_0-quantized query row: the block products summed
/// in block order from 0.
template <class KeyCodec, class Block>
inline auto dot_row(std::uint8_t const* key_row, block_q8_0 const* q_blocks, int nblocks) -> float {
  float sum = 0.0f;
  for (int b = 0; b < nblocks; ++b) {
    Block k;
    std::memcpy(&k, key_row + static_cast<std::size_t>(b) * sizeof(Block), sizeof(Block));
    sum = add_rn(sum, dot_block(k, q_blocks[b]));
  }
  return sum;
}

/// Dot product of an int8 key row (fp32 scale s, head_dim codes) with a q8_0-quantized query:
/// (sum over blocks b, in order from 0, of sumi_b * dq_b) * s, sumi_b the exact integer dot of
/// block b's codes (the last block holding head_dim - 32 b of them).
inline auto dot_row_int8(std::uint8_t const* key_row, int head_dim, block_q8_0 const* q_blocks, int nblocks) -> float {
  float scale;
  std::memcpy(&scale, key_row, 4);
  auto const* codes = reinterpret_cast<std::int8_t const*>(key_row + int8_row_header_bytes);
  float sum = 0.0f;
  for (int b = 0; b < nblocks; ++b) {
    int sumi = 0;
    for (int j = 0; j < 32 && 32 * b + j < head_dim; ++j)
      sumi += static_cast<int>(codes[32 * b + j]) * static_cast<int>(q_blocks[b].qs[j]);
    sum = add_rn(sum, mul_rn(static_cast<float>(sumi), f16_bits_to_f32(q_blocks[b].d)));
  }
  return mul_rn(sum, scale);
}

/// True for key codecs that use integer dot products with a q8_0 query.
template <class KeyCodec>
inline constexpr bool integer_key_dot =
    std::is_same_v<KeyCodec, q8_0> || std::is_same_v<KeyCodec, q4_0> || std::is_same_v<KeyCodec, int8_sym>;

/// The q8_0 query dot of one key row of an integer-dot codec.
template <class KeyCodec>
inline auto integer_dot_row(std::uint8_t const* row, int head_dim, block_q8_0 const* q_blocks, int nblocks) -> float {
  if constexpr (std::is_same_v<KeyCodec, q8_0>)
    return dot_row<KeyCodec, block_q8_0>(row, q_blocks, nblocks);
  else if constexpr (std::is_same_v<KeyCodec, q4_0>)
    return dot_row<KeyCodec, block_q4_0>(row, q_blocks, nblocks);
  else
    return dot_row_int8(row, head_dim, q_blocks, nblocks);
}

/// Decodes tokens [t0, t0 + n) of a token source of codec C to f32 rows of d floats at y: encoded
/// units, or f16 residual rows (ring slots) from `quantized` on.
template <codec C>
void decode_source_tokens(cpu_kernels::token_source const& src, typename C::params_type const& p, int d,
                          std::int64_t t0, int n, float* y) {
  for (int i = 0; i < n; ++i) {
    std::int64_t const t = t0 + i;
    float* row = y + static_cast<std::ptrdiff_t>(i) * d;
    if (t >= src.quantized) {
      std::int64_t const slot = (src.residual_first + (t - src.quantized)) % src.residual_capacity;
      cpu_kernels::convert_to_f32(reinterpret_cast<f16 const*>(src.residual) + slot * d, row, d);
    } else if constexpr (C::layout == codec_layout::token_group) {
      cpu_kernels::decode_tile_tokens<C>(src.units + static_cast<std::size_t>(t / C::group) * src.unit_bytes, d,
                                         static_cast<int>(t % C::group), 1, row, d, p);
    } else {
      cpu_kernels::decode_rows<C>(src.units + static_cast<std::size_t>(t) * src.unit_bytes, src.unit_bytes, 1, d, row,
                                  d, p);
    }
  }
}

/// Kernel tag: the scalar reference (always compiled), with the SIMD kernels' interface: attends
/// the group's heads (query q: (group, head_dim), already rounded as the options say; qb: its q8_0
/// blocks for integer key dots, or nullptr) to tokens [begin, end) of one kv head, tile by tile,
/// token by token, updating `state`.
struct reference_attention {
  template <class KC, class VC>
  static void attend(cpu_kernels::token_source const& k, typename KC::params_type const& kp,
                     cpu_kernels::token_source const& v, typename VC::params_type const& vp,
                     cpu_kernels::attention_call const& call, float const* q, block_q8_0 const* qb, std::int64_t begin,
                     std::int64_t end, cpu_kernels::attention_state const& state,
                     cpu_kernels::attention_scratch& scratch) {
    int const d = call.head_dim;
    std::size_t const hd = static_cast<std::size_t>(d);
    int const q_nblocks = q8_0::geometry(d).blocks;
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();
    scratch.reserve(d, call.group);
    float* const ktile = scratch.keys.data();
    float* const vtile = scratch.values.data();
    float* const logits = scratch.special_values.data();
    for (std::int64_t t0 = begin; t0 < end; t0 += attention_tile) {
      int const n = static_cast<int>(std::min<std::int64_t>(attention_tile, end - t0));
      decode_source_tokens<KC>(k, kp, d, t0, n, ktile);
      decode_source_tokens<VC>(v, vp, d, t0, n, vtile);
      for (int g = 0; g < call.group; ++g) {
        float const* qh = q + static_cast<std::size_t>(g) * hd;
        for (int i = 0; i < n; ++i) {
          float dot = 0.0f;
          bool integer = false;
          if constexpr (integer_key_dot<KC>) {
            if (qb != nullptr && t0 + i < k.quantized) {
              integer = true;
              dot = integer_dot_row<KC>(k.units + static_cast<std::size_t>(t0 + i) * k.unit_bytes, d,
                                        qb + static_cast<std::size_t>(g) * static_cast<std::size_t>(q_nblocks),
                                        q_nblocks);
            }
          }
          if (!integer) {
            float const* kr = ktile + static_cast<std::size_t>(i) * hd;
            for (int c = 0; c < d; ++c) dot = madd_f32(qh[c], kr[c], dot);
          }
          float s = dot * call.scale;
          if (call.row_offset != nullptr) s += call.row_offset[g];
          if (call.softcap > 0.0f) s = call.softcap * std::tanh(s / call.softcap);
          logits[i] = s;
        }
        if (call.masked()) call.apply_masks(g, t0, logits, n);
        float& m = state.max[g];
        float& sum = state.sum[g];
        float* o = state.out + static_cast<std::size_t>(g) * hd;
        if constexpr (cpu_kernels::integer_value_codec<VC>) {
          if (call.i8_weights && t0 + n <= v.quantized && call.unmasked(g, t0, n) &&
              std::all_of(logits, logits + n, [](float x) { return is_finite_f32(x); })) {
            integer_tile<VC>(v, t0, n, d, logits, m, sum, o);
            continue;
          }
        }
        for (int i = 0; i < n; ++i) {
          float const s = logits[i];
          if (s == neg_inf) continue;  // weight 0
          if (s > m) {
            float const corr = m == neg_inf ? 0.0f : std::exp(m - s);
            for (int c = 0; c < d; ++c) o[c] *= corr;
            sum *= corr;
            m = s;
          }
          float const p = std::exp(s - m);  // NaN for NaN or +Inf logits, which then propagates
          float const pv = call.f16_probabilities ? to_f32(to_f16(p)) : p;
          sum += p;
          float const* vr = vtile + static_cast<std::size_t>(i) * hd;
          for (int c = 0; c < d; ++c) o[c] = madd_f32(pv, vr[c], o[c]);
        }
      }
    }
  }

  /// One row's tile of n tokens from t0 with integer weights (probability_precision::i8; the
  /// logits s are finite and unmasked): the running state is rescaled to the tile's max, the
  /// probabilities are kvq's exp (cpu_kernels::exp_nonpositive_scalar), and each value scale group
  /// adds step · sum_t w[t] · code[t][c] (cpu_kernels::integer_weights).
  template <class VC>
  static void integer_tile(cpu_kernels::token_source const& v, std::int64_t t0, int n, int d, float const* s, float& m,
                           float& sum, float* o) {
    using layout = cpu_kernels::integer_value_layout<VC>;
    float const tmax = *std::max_element(s, s + n);
    if (tmax > m) {
      float const corr = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - tmax);
      for (int c = 0; c < d; ++c) o[c] *= corr;
      sum *= corr;
      m = tmax;
    }
    float e[attention_tile], scale[attention_tile];
    std::uint8_t const* rows[attention_tile];
    for (int i = 0; i < n; ++i) {
      e[i] = cpu_kernels::exp_nonpositive_scalar(s[i] - m);
      sum += e[i];
      rows[i] = v.units + static_cast<std::size_t>(t0 + i) * v.unit_bytes;
    }
    int const gc = layout::group(d);
    for (int g = 0; g * gc < d; ++g) {
      int const c0 = g * gc, c1 = std::min(d, c0 + gc);
      for (int i = 0; i < n; ++i) scale[i] = layout::scale(rows[i], g);
      std::int8_t w[attention_tile];
      float const step = cpu_kernels::integer_weights(e, scale, n, w);
      if (step == 0.0f) continue;
      if (is_nan_f32(step)) {  // f32 products, as with f32 probabilities
        for (int i = 0; i < n; ++i)
          for (int c = c0; c < c1; ++c)
            o[c] = madd_f32(e[i], mul_rn(static_cast<float>(layout::code(rows[i], c)), scale[i]), o[c]);
        continue;
      }
      for (int c = c0; c < c1; ++c) {
        std::int32_t acc = 0;
        for (int i = 0; i < n; ++i) acc += static_cast<std::int32_t>(w[i]) * layout::code(rows[i], c);
        o[c] = madd_f32(step, static_cast<float>(acc), o[c]);
      }
    }
  }
};

#if defined(KVQ_CPU_HAS_AVX512) || defined(KVQ_CPU_HAS_AVX2) || defined(KVQ_CPU_HAS_NEON)
/// The kernel attend_range uses: the best SIMD one compiled in.
using default_attention = cpu_kernels::attention_kernel;
#else
/// The kernel attend_range uses: the scalar reference (no SIMD in this translation unit).
using default_attention = reference_attention;
#endif

/// The attention kernel's view of a storage_view.
inline auto token_source_of(storage_view const& v) -> cpu_kernels::token_source {
  cpu_kernels::token_source s;
  s.units = reinterpret_cast<std::uint8_t const*>(v.units);
  s.unit_bytes = v.unit_bytes;
  s.quantized = v.quantized_tokens;
  s.residual = reinterpret_cast<std::uint16_t const*>(v.residual);
  s.residual_capacity = std::max<std::int64_t>(v.residual_capacity, 1);
  s.residual_first = v.residual_first;
  return s;
}

}  // namespace detail

namespace detail {

/// The query of one attention as the products use it: f32 (rounded to q8_0 on request), and for
/// integer key dots its q8_0 blocks.
struct prepared_query {
  int head_dim = 0;
  int nblocks = 0;
  detail::vector<float> f;       ///< (q_heads, head_dim)
  detail::vector<block_q8_0> b;  ///< (q_heads, nblocks) when integer key dots are used, else empty
  /// The query of head h on.
  auto query(std::size_t h) const -> float const* { return f.data() + h * static_cast<std::size_t>(head_dim); }
  /// The q8_0 blocks of head h on, or nullptr without integer key dots.
  auto blocks(std::size_t h) const -> block_q8_0 const* {
    return b.empty() ? nullptr : b.data() + h * static_cast<std::size_t>(nblocks);
  }
};

/// Prepares the query (q_heads, d) for key codec KC under `opt`: rotated once per head for a
/// rotated key codec (then rounded to q8_0 on request).
template <class KC>
auto prepare_query(float const* q, int q_heads, int d, attention_options const& opt) -> prepared_query {
  prepared_query pq;
  pq.head_dim = d;
  pq.nblocks = q8_0::geometry(d).blocks;
  std::size_t const hd = static_cast<std::size_t>(d);
  pq.f.assign(q, q + static_cast<std::size_t>(q_heads) * hd);
  if constexpr (rotated_codec<KC>) side_rotation<KC>(d).forward_rows(pq.f.data(), q_heads, d);
  if (opt.query == query_precision::q8_0) {
    detail::vector<block_q8_0> qb(static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(pq.nblocks));
    for (int h = 0; h < q_heads; ++h) {
      auto* blocks = reinterpret_cast<std::uint8_t*>(qb.data() + static_cast<std::size_t>(h) *
                                                                     static_cast<std::size_t>(pq.nblocks));
      q8_0::encode_row(pq.f.data() + static_cast<std::size_t>(h) * hd, d, blocks);
      q8_0::decode_row(blocks, d, pq.f.data() + static_cast<std::size_t>(h) * hd);
    }
    if (integer_key_dot<stored_codec_t<KC>>) pq.b = std::move(qb);
  }
  return pq;
}

/// `call` with the logit offsets of a centered key codec KC (codec/centered.hpp): scale · (q·μ) for
/// each of its rows of the prepared query q (rows of head_dim), μ (head_dim floats, the cache's
/// key mean) taken into the query's space (rotated for a rotated KC); `offsets` holds them.
/// Other key codecs: `call` unchanged.
template <class KC>
auto centered_call(cpu_kernels::attention_call call, float const* q, float const* mu, vector<float>& offsets)
    -> cpu_kernels::attention_call {
  if constexpr (centered_codec<KC>) {
    int const d = call.head_dim;
    vector<float> m(mu, mu + d);
    side_rotation<KC>(d).forward_rows(m.data(), 1, d);
    offsets.resize(static_cast<std::size_t>(call.group));
    key_mean_offsets(q, call.group, d, m.data(), call.scale, offsets.data());
    call.row_offset = offsets.data();
  } else {
    (void)q;
    (void)mu;
    (void)offsets;
  }
  return call;
}

/// The key mean of (layer, head) of a flat cache with a centered key codec, else nullptr.
template <class Cache>
auto flat_key_mean(Cache const& cache, int layer, int head) -> float const* {
  if constexpr (centered_codec<typename Cache::key_codec>) {
    return cache.key_mean(layer, head);
  } else {
    (void)cache;
    (void)layer;
    (void)head;
    return nullptr;
  }
}

/// The kernel inputs of an attention of `group` query heads per kv head under `opt`.
inline auto attention_call_of(int d, int group, attention_options const& opt) -> cpu_kernels::attention_call {
  cpu_kernels::attention_call call;
  call.head_dim = d;
  call.group = group;
  call.scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  call.softcap = opt.softcap;
  call.f16_probabilities = opt.probabilities == probability_precision::f16;
  call.i8_weights = opt.probabilities == probability_precision::i8;
  return call;
}

/// Whether a GPU attention rounds probabilities to f16 under `opt`; raises unsupported_error for
/// probability_precision::i8, which the CUDA and Metal kernels do not implement.
inline auto device_probabilities_f16(attention_options const& opt) -> bool {
  check<unsupported_error>(opt.probabilities != probability_precision::i8, [] {
    return std::string("attention: probability_precision::i8 is implemented by the CPU caches only");
  });
  return opt.probabilities == probability_precision::f16;
}

/// Raises shape_error unless q_heads is a positive multiple of kv_heads.
inline void check_query_heads(int q_heads, int kv_heads) {
  check<shape_error>(q_heads > 0 && q_heads % kv_heads == 0, [&] {
    return "attention: " + std::to_string(q_heads) + " query heads is not a positive multiple of " +
           std::to_string(kv_heads) + " kv heads";
  });
}

/// Raises invalid_argument_error unless the scale, softcap and window of `opt` are finite and
/// non-negative.
inline void check_attention_options(attention_options const& opt) {
  check<invalid_argument_error>(
      detail::is_finite_f32(opt.scale) && opt.scale >= 0.0f && detail::is_finite_f32(opt.softcap) &&
          opt.softcap >= 0.0f && opt.window >= 0,
      [] { return std::string("attention: scale, softcap and window must be finite and non-negative"); });
}

/// attend_range with the kernel `Kernel`: reference_attention, or a cpu_kernels::<isa>::attention_kernel
/// (tests compare every ISA compiled in against the reference through this entry).
template <class Kernel, class Cache>
auto attend_range_with(Cache const& cache, int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
                       attention_options const& opt) -> attention_partial {
  using key_codec = typename Cache::key_codec;
  using value_codec = typename Cache::value_codec;
  auto const& shape = cache.shape();
  std::int64_t const len = cache.size(layer);
  int const d = shape.head_dim;
  int const kv = shape.kv_heads;
  check_query_heads(q_heads, kv);
  check<shape_error>(q != nullptr, [] { return std::string("attention: the query is null"); });
  check<index_error>(begin >= 0 && begin <= end && end <= len, [&] {
    return "attention: range [" + std::to_string(begin) + ", " + std::to_string(end) + ") is outside the " +
           std::to_string(len) + " tokens of layer " + std::to_string(layer);
  });
  check_attention_options(opt);
  if (opt.window > 0) begin = std::max(begin, len - opt.window);
  end = std::max(begin, end);

  int const group = q_heads / kv;
  auto part = attention_partial::empty(q_heads, d);
  prepared_query const pq = prepare_query<key_codec>(q, q_heads, d, opt);
  cpu_kernels::attention_call const call = attention_call_of(d, group, opt);
  cpu_kernels::attention_scratch scratch;
  scratch.reserve(d, group);
  std::size_t const hd = static_cast<std::size_t>(d);
  vector<float> offsets;
  for (int kh = 0; kh < kv; ++kh) {
    std::size_t const h0 = static_cast<std::size_t>(kh) * static_cast<std::size_t>(group);
    cpu_kernels::attention_state state{part.out.data() + h0 * hd, part.max.data() + h0, part.sum.data() + h0};
    Kernel::template attend<stored_codec_t<key_codec>, stored_codec_t<value_codec>>(
        token_source_of(cache.key_storage(layer, kh)), cache.get_options().key,
        token_source_of(cache.value_storage(layer, kh)), cache.get_options().value,
        centered_call<key_codec>(call, pq.query(h0), flat_key_mean(cache, layer, kh), offsets), pq.query(h0),
        pq.blocks(h0), begin, end, state, scratch);
  }
  side_rotation<value_codec>(d).inverse_rows(part.out.data(), q_heads, d);  // once per head (linear)
  return part;
}

}  // namespace detail

/// Attends the query heads `q` (q_heads, head_dim) of `layer` to tokens [begin, end) of `cache`,
/// returning the partial state. `q` must hold q_heads × head_dim floats. Raises index_error for a
/// bad layer or range, shape_error for a null `q` or q_heads not a positive multiple of kv_heads,
/// invalid_argument_error for a negative or non-finite scale / softcap or a negative window. Runs the best
/// SIMD kernel compiled in (backend/cpu/attention_kernels.hpp), else the scalar reference; the two
/// agree within fp32 rounding, and with a q8_0 query the q8_0 / q4_0 / int8 key logits are equal.
template <class Cache>
auto attend_range(Cache const& cache, int layer, float const* q, int q_heads, std::int64_t begin, std::int64_t end,
                  attention_options const& opt = {}) -> attention_partial {
  return detail::attend_range_with<detail::default_attention>(cache, layer, q, q_heads, begin, end, opt);
}

namespace detail {

/// True when the vectors of a partial state have the sizes its q_heads and head_dim say.
inline auto partial_consistent(attention_partial const& p) -> bool {
  if (p.q_heads < 0 || p.head_dim < 0) return false;
  std::size_t const h = static_cast<std::size_t>(p.q_heads);
  return p.out.size() == h * static_cast<std::size_t>(p.head_dim) && p.max.size() == h && p.sum.size() == h;
}

}  // namespace detail

/// Merges the partial state `b` into `a` (same heads and head_dim, disjoint token ranges). Raises
/// shape_error when the shapes differ or a state's vectors do not match its shape.
inline void combine(attention_partial& a, attention_partial const& b) {
  detail::check<shape_error>(detail::partial_consistent(a) && detail::partial_consistent(b),
                             [] { return std::string("combine: a partial state's vectors do not match its shape"); });
  detail::check<shape_error>(a.q_heads == b.q_heads && a.head_dim == b.head_dim,
                             "combine: partial states of different shapes");
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < a.q_heads; ++h) {
    std::size_t const hh = static_cast<std::size_t>(h);
    float const ma = a.max[hh], mb = b.max[hh];
    if (mb == neg_inf && !detail::is_nan_f32(b.sum[hh])) continue;  // b attended nothing
    float const m =
        detail::is_nan_f32(ma) || detail::is_nan_f32(mb) ? std::numeric_limits<float>::quiet_NaN() : std::max(ma, mb);
    float const ca = ma == neg_inf ? 0.0f : std::exp(ma - m);
    float const cb = std::exp(mb - m);
    float* oa = a.out.data() + hh * static_cast<std::size_t>(a.head_dim);
    float const* ob = b.out.data() + hh * static_cast<std::size_t>(a.head_dim);
    for (int c = 0; c < a.head_dim; ++c) oa[c] = detail::madd_f32(oa[c], ca, detail::mul_rn(ob[c], cb));
    a.sum[hh] = detail::madd_f32(a.sum[hh], ca, detail::mul_rn(b.sum[hh], cb));
    a.max[hh] = m;
  }
}

namespace detail {

/// Writes the normalised output (d floats) of one head's online-softmax state (o, m, sum) to y,
/// with `sink` (−Inf: none) joining the denominator; a head that attended nothing outputs zeros.
inline void finalize_head(float const* o, float m, float sum, float sink, int d, float* y) noexcept {
  if (sum == 0.0f) {
    std::fill_n(y, d, 0.0f);
    return;
  }
  float corr = 1.0f;
  if (f32_bits(sink) != 0xff800000u) {  // a sink (a bit test: immune to -fno-honor-infinities)
    float const mm = is_nan_f32(m) ? m : std::max(m, sink);
    corr = std::exp(m - mm);
    sum = madd_f32(sum, corr, std::exp(sink - mm));
  }
  float const inv = 1.0f / sum;
  for (int c = 0; c < d; ++c) y[c] = corr == 1.0f ? o[c] * inv : mul_rn(o[c], corr) * inv;
}

/// The sink logit of query head h under `sinks` (nullptr: −Inf, no sink).
inline auto sink_of(float const* sinks, std::size_t h) noexcept -> float {
  return sinks == nullptr ? -std::numeric_limits<float>::infinity() : sinks[h];
}

/// Raises invalid_argument_error unless every sink of the q_heads heads is finite or −Inf.
inline void check_sinks(float const* sinks, int q_heads) {
  if (sinks == nullptr) return;
  for (int h = 0; h < q_heads; ++h) {
    float const x = sinks[h];
    check<invalid_argument_error>(!is_nan_f32(x) && f32_bits(x) != 0x7f800000u, [&] {
      return "attention: the sink of query head " + std::to_string(h) + " is NaN or +Inf";
    });
  }
}

}  // namespace detail

/// Writes the normalised output (q_heads, head_dim) of a partial state into `out`, which must hold
/// q_heads × head_dim floats; heads that attended nothing output zeros. `sinks`: nullptr or one
/// logit per head joining its softmax denominator (attention_options::sinks). Raises shape_error
/// for a null `out` (unless the state is empty) or a state whose vectors do not match its shape,
/// invalid_argument_error for a NaN or +Inf sink.
inline void finalize(attention_partial const& p, float* out, float const* sinks = nullptr) {
  detail::check<shape_error>(detail::partial_consistent(p), [] {
    return std::string("finalize: the partial state's vectors do not match its shape");
  });
  detail::check<shape_error>(out != nullptr || p.out.empty(),
                             [] { return std::string("finalize: the output is null"); });
  detail::check_sinks(sinks, p.q_heads);
  std::size_t const hd = static_cast<std::size_t>(p.head_dim);
  for (int h = 0; h < p.q_heads; ++h) {
    std::size_t const hh = static_cast<std::size_t>(h);
    detail::finalize_head(p.out.data() + hh * hd, p.max[hh], p.sum[hh], detail::sink_of(sinks, hh), p.head_dim,
                          out + hh * hd);
  }
}

/// Decode attention of one query token over every token of `layer`: out (q_heads, head_dim).
/// `q` and `out` must each hold q_heads × head_dim floats; raises index_error for a bad layer,
/// shape_error for a null `q` or `out` or q_heads not a positive multiple of kv_heads,
/// invalid_argument_error for bad options.
template <class Cache>
void decode_attention(Cache const& cache, int layer, float const* q, int q_heads, float* out,
                      attention_options const& opt = {}) {
  std::int64_t const len = cache.size(layer);
  detail::check<shape_error>(out != nullptr, [] { return std::string("attention: the output is null"); });
  auto const part = attend_range(cache, layer, q, q_heads, 0, len, opt);
  finalize(part, out, opt.sinks);
}

/// Decode attention split across `threads` std::threads (flash-decoding style), combined exactly.
/// Preconditions and errors as decode_attention; threads < 1 raises invalid_argument_error.
template <class Cache>
void decode_attention_parallel(Cache const& cache, int layer, float const* q, int q_heads, float* out, int threads,
                               attention_options const& opt = {}) {
  std::int64_t const len = cache.size(layer);
  detail::check<shape_error>(out != nullptr, [] { return std::string("attention: the output is null"); });
  detail::check<invalid_argument_error>(threads >= 1,
                                        "attention: threads = " + std::to_string(threads) + " must be >= 1");
  std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
  std::int64_t const span = len - begin;
  int const parts = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, span / attention_tile)));
  if (parts == 1) {
    decode_attention(cache, layer, q, q_heads, out, opt);
    return;
  }
  // Split on tile boundaries so the result is independent of the thread count up to the merge.
  std::int64_t const tiles = (span + attention_tile - 1) / attention_tile;
  std::vector<attention_partial> partials(static_cast<std::size_t>(parts));
  detail::vector<std::thread> pool;
  detail::vector<std::exception_ptr> errors(static_cast<std::size_t>(parts));
  pool.reserve(static_cast<std::size_t>(parts));
  try {
    for (int p = 0; p < parts; ++p) {
      std::int64_t const b = begin + tiles * p / parts * attention_tile;
      std::int64_t const e = std::min(len, begin + tiles * (p + 1) / parts * attention_tile);
      pool.emplace_back([&, p, b, e] {
        try {
          partials[static_cast<std::size_t>(p)] = attend_range(cache, layer, q, q_heads, b, e, opt);
        } catch (...) {
          errors[static_cast<std::size_t>(p)] = std::current_exception();
        }
      });
    }
  } catch (...) {
    // A thread could not be started (std::system_error): join the running ones before the locals
    // they reference go away (destroying a joinable std::thread would call std::terminate).
    for (auto& t : pool) t.join();
    throw;
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int p = 1; p < parts; ++p) combine(partials[0], partials[static_cast<std::size_t>(p)]);
  finalize(partials[0], out, opt.sinks);
}

namespace detail {

/// One chunk of query tokens of a multi-token attention, as the driver sees it: n_q tokens at
/// positions [first_pos, first_pos + n_q) of a sequence of `len` tokens (entry `entry` of the
/// caller's storage), their query and output rows from row `row` of q / out (rows of q_heads heads).
struct query_chunk_plan {
  int entry = 0;
  std::int64_t len = 0;
  std::int64_t first_pos = 0;
  std::int64_t n_q = 0;
  std::int64_t row = 0;
  void const* mask = nullptr;  ///< the chunk's custom mask rows (attention_options::mask_data layout)
  std::int64_t mask_stride = 0;
};

/// Tokens [begin, end) that the query at position `pos` attends in a sequence of len tokens, before
/// custom masks.
inline auto query_token_range(attention_options const& opt, std::int64_t pos, std::int64_t len)
    -> std::pair<std::int64_t, std::int64_t> {
  std::int64_t const end = opt.mask == mask_kind::causal ? std::min(len, pos + 1) : len;
  std::int64_t const begin = opt.window > 0 ? std::clamp<std::int64_t>(pos - opt.window + 1, 0, len) : 0;
  return {begin, std::max(begin, end)};
}

/// Query tokens per block of a multi-token attention with `group` heads per kv head: a block's
/// 128 rows (tokens × heads) are attended together, each key and value tile decoded once for them.
inline auto query_block_tokens(int group) -> std::int64_t { return std::max(1, 128 / group); }

/// The multi-token attention driver of the CPU caches (flat and paged). Cuts every chunk into
/// blocks of query tokens, each (block, kv_head) into runs of `granularity`-aligned tokens when
/// threads > 1, runs them on `threads` threads and merges the runs in token order. For every
/// item, `attend(entry, kv_head, call, q, qb, begin, end, state, scratch)` must attend the rows
/// of `call` to tokens [begin, end) of the entry's kv_head with the kernel (setting
/// call.token_offset for sources that start past token 0).
template <class KeyCodec, class ValueCodec, class Attend>
void run_query_chunks(std::span<query_chunk_plan const> chunks, float const* q, int q_heads, int kv_heads, int d,
                      float* out, attention_options const& opt, int threads, std::int64_t granularity,
                      Attend&& attend) {
  struct block {
    std::size_t chunk;
    std::int64_t i0, i1;  // query tokens of the chunk
    int head;             // kv head
    std::int64_t begin, end;
  };
  struct item {
    std::size_t block;
    std::int64_t begin, end;
  };
  int const group = q_heads / kv_heads;
  std::size_t const hd = static_cast<std::size_t>(d);
  std::int64_t const qbt = query_block_tokens(group);
  detail::vector<block> blocks;
  std::int64_t total = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    query_chunk_plan const& ch = chunks[c];
    for (std::int64_t i0 = 0; i0 < ch.n_q; i0 += qbt) {
      std::int64_t const i1 = std::min(ch.n_q, i0 + qbt);
      std::int64_t b = std::numeric_limits<std::int64_t>::max(), e = 0;
      for (std::int64_t i = i0; i < i1; ++i) {
        auto const [lo, hi] = query_token_range(opt, ch.first_pos + i, ch.len);
        if (lo < hi) {
          b = std::min(b, lo);
          e = std::max(e, hi);
        }
      }
      if (e == 0) b = 0;
      for (int h = 0; h < kv_heads; ++h) blocks.push_back({c, i0, i1, h, b, e});
      total += (e - b) * kv_heads;
    }
  }
  std::int64_t split = std::numeric_limits<std::int64_t>::max();
  if (threads > 1 && static_cast<std::int64_t>(blocks.size()) < 4 * static_cast<std::int64_t>(threads)) {
    std::int64_t const per = total / (4 * static_cast<std::int64_t>(threads));
    split = std::max<std::int64_t>(granularity,
                                   (std::max<std::int64_t>(per, 256) + granularity - 1) / granularity * granularity);
  }
  detail::vector<item> items;
  detail::vector<std::size_t> first_item(blocks.size() + 1);
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    first_item[k] = items.size();
    block const& bl = blocks[k];
    std::int64_t t = bl.begin;
    do {
      std::int64_t const e =
          split == std::numeric_limits<std::int64_t>::max() ? bl.end : std::min(bl.end, (t / split + 1) * split);
      items.push_back({k, t, e});
      t = e;
    } while (t < bl.end);
  }
  first_item.back() = items.size();

  // Per item: the rows' state, out (rows, d), max (rows), sum (rows), rows = block tokens × group.
  std::size_t const max_rows = static_cast<std::size_t>(qbt) * static_cast<std::size_t>(group);
  std::size_t const stride = max_rows * (hd + 2);
  detail::vector<float> states(items.size() * stride);
  auto rows_of = [&](block const& bl) { return static_cast<int>(bl.i1 - bl.i0) * group; };

  struct worker_memory {
    cpu_kernels::attention_scratch scratch;
    detail::vector<float> query;  // (rows, d) gathered
    detail::vector<std::int64_t> row_begin, row_end;
    detail::vector<float const*> row_bias;
    detail::vector<std::uint8_t const*> row_allow;
  };
  auto run = [&](std::size_t index, worker_memory& w) {
    item const& it = items[index];
    block const& bl = blocks[it.block];
    query_chunk_plan const& ch = chunks[bl.chunk];
    int const rows = rows_of(bl);
    std::size_t const nr = static_cast<std::size_t>(rows);
    float* o = states.data() + index * stride;
    float* m = o + nr * hd;
    float* l = m + nr;
    std::fill(o, o + nr * hd, 0.0f);
    std::fill(m, m + nr, -std::numeric_limits<float>::infinity());
    std::fill(l, l + nr, 0.0f);
    if (it.begin >= it.end) return;
    // Rows (token i, head g) of the block, token-major.
    w.query.resize(nr * hd);
    w.row_begin.resize(nr);
    w.row_end.resize(nr);
    w.row_bias.assign(nr, nullptr);
    w.row_allow.assign(nr, nullptr);
    bool ragged = false;
    for (std::int64_t i = bl.i0; i < bl.i1; ++i) {
      auto const [lo, hi] = query_token_range(opt, ch.first_pos + i, ch.len);
      ragged = ragged || lo != bl.begin || hi != bl.end;
      std::size_t const row_q = static_cast<std::size_t>(ch.row + i) * static_cast<std::size_t>(q_heads) +
                                static_cast<std::size_t>(bl.head) * static_cast<std::size_t>(group);
      auto const* mrow = static_cast<std::uint8_t const*>(ch.mask);
      if (mrow != nullptr)
        mrow += static_cast<std::size_t>(i) * static_cast<std::size_t>(ch.mask_stride) *
                (opt.mask == mask_kind::additive ? sizeof(float) : 1);
      for (int g = 0; g < group; ++g) {
        std::size_t const r =
            static_cast<std::size_t>(i - bl.i0) * static_cast<std::size_t>(group) + static_cast<std::size_t>(g);
        std::copy_n(q + (row_q + static_cast<std::size_t>(g)) * hd, hd, w.query.data() + r * hd);
        w.row_begin[r] = lo;
        w.row_end[r] = hi;
        if (opt.mask == mask_kind::additive) w.row_bias[r] = reinterpret_cast<float const*>(mrow);
        if (opt.mask == mask_kind::boolean) w.row_allow[r] = mrow;
      }
    }
    prepared_query const pq = prepare_query<KeyCodec>(w.query.data(), rows, d, opt);
    cpu_kernels::attention_call call = attention_call_of(d, rows, opt);
    if (ragged) {
      call.row_begin = w.row_begin.data();
      call.row_end = w.row_end.data();
    }
    if (opt.mask == mask_kind::additive) call.row_bias = w.row_bias.data();
    if (opt.mask == mask_kind::boolean) call.row_allow = w.row_allow.data();
    w.scratch.reserve(d, rows);
    cpu_kernels::attention_state const state{o, m, l};
    attend(ch.entry, bl.head, call, pq.query(0), pq.blocks(0), it.begin, it.end, state, w.scratch);
  };

  int const workers = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), items.size()));
  if (workers <= 1) {
    worker_memory w;
    for (std::size_t i = 0; i < items.size(); ++i) run(i, w);
  } else {
    std::atomic<std::size_t> next{0};
    detail::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
    auto work = [&](int wi) {
      try {
        worker_memory w;
        for (std::size_t i = next++; i < items.size(); i = next++) run(i, w);
      } catch (...) {
        errors[static_cast<std::size_t>(wi)] = std::current_exception();
      }
    };
    detail::vector<std::thread> pool;
    pool.reserve(static_cast<std::size_t>(workers - 1));
    try {
      for (int wi = 1; wi < workers; ++wi) pool.emplace_back(work, wi);
    } catch (...) {
      next = items.size();  // no more work for the running threads
      for (auto& t : pool) t.join();
      throw;
    }
    work(0);
    for (auto& t : pool) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  // Merge the runs of every block in token order (as combine), un-rotate the rows' values (a
  // rotated value codec) and normalise them.
  side_rotation<ValueCodec> const value_rotation(d);
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    block const& bl = blocks[k];
    query_chunk_plan const& ch = chunks[bl.chunk];
    int const rows = rows_of(bl);
    std::size_t const nr = static_cast<std::size_t>(rows);
    attention_partial acc = attention_partial::empty(rows, d);
    attention_partial part = attention_partial::empty(rows, d);
    for (std::size_t i = first_item[k]; i < first_item[k + 1]; ++i) {
      float const* o = states.data() + i * stride;
      float const* m = o + nr * hd;
      float const* l = m + nr;
      attention_partial& into = i == first_item[k] ? acc : part;
      std::copy(o, o + nr * hd, into.out.begin());
      std::copy(m, m + nr, into.max.begin());
      std::copy(l, l + nr, into.sum.begin());
      if (i != first_item[k]) combine(acc, part);
    }
    value_rotation.inverse_rows(acc.out.data(), rows, d);
    for (int r = 0; r < rows; ++r) {
      std::int64_t const i = bl.i0 + r / group;
      std::size_t const h =
          static_cast<std::size_t>(bl.head) * static_cast<std::size_t>(group) + static_cast<std::size_t>(r % group);
      std::size_t const rr = static_cast<std::size_t>(r);
      finalize_head(acc.out.data() + rr * hd, acc.max[rr], acc.sum[rr], sink_of(opt.sinks, h), d,
                    out + (static_cast<std::size_t>(ch.row + i) * static_cast<std::size_t>(q_heads) + h) * hd);
    }
  }
}

/// Checks the multi-token options of an attention of n_q query tokens from position `first_pos`
/// over `len` tokens (first_pos already resolved from −1).
inline void check_query_chunk(attention_options const& opt, std::int64_t n_q, std::int64_t first_pos, std::int64_t len,
                              void const* mask, std::int64_t mask_stride) {
  check<invalid_argument_error>(n_q >= 0, [&] { return "attention: n_q = " + std::to_string(n_q) + " is negative"; });
  check<index_error>(first_pos >= 0, [&] {
    return "attention: the first query position " + std::to_string(first_pos) + " is negative (" + std::to_string(n_q) +
           " query tokens over " + std::to_string(len) + " tokens)";
  });
  check<index_error>(opt.mask != mask_kind::causal || first_pos + n_q <= len, [&] {
    return "attention: causal query positions [" + std::to_string(first_pos) + ", " + std::to_string(first_pos + n_q) +
           ") reach past the layer's " + std::to_string(len) + " tokens (append the chunk's keys and values first)";
  });
  bool const custom = opt.mask == mask_kind::additive || opt.mask == mask_kind::boolean;
  check<invalid_argument_error>(!custom || n_q == 0 || (mask != nullptr && mask_stride >= len), [&] {
    return std::string("attention: a custom mask needs mask_data with rows of at least the layer's ") +
           std::to_string(len) + " tokens (mask_stride " + std::to_string(mask_stride) + ")";
  });
}

/// kvq::attention with the kernel `Kernel` (reference_attention or an ISA's attention_kernel).
template <class Kernel, class Cache>
void attention_with(Cache const& cache, int layer, float const* q, std::int64_t n_q, int q_heads, float* out,
                    attention_options const& opt, int threads) {
  using key_codec = typename Cache::key_codec;
  using value_codec = typename Cache::value_codec;
  auto const& shape = cache.shape();
  std::int64_t const len = cache.size(layer);
  int const d = shape.head_dim;
  int const kv = shape.kv_heads;
  check_query_heads(q_heads, kv);
  check<shape_error>(n_q == 0 || (q != nullptr && out != nullptr),
                     [] { return std::string("attention: the query or the output is null"); });
  check<invalid_argument_error>(threads >= 1,
                                [&] { return "attention: threads = " + std::to_string(threads) + " must be >= 1"; });
  check_attention_options(opt);
  check_sinks(opt.sinks, q_heads);
  std::int64_t const first = opt.first_pos < 0 ? len - n_q : opt.first_pos;
  std::int64_t const stride = opt.mask_stride > 0 ? opt.mask_stride : len;
  check_query_chunk(opt, n_q, first, len, opt.mask_data, stride);
  if (n_q == 0) return;
  query_chunk_plan const chunk{0, len, first, n_q, 0, opt.mask_data, stride};
  run_query_chunks<key_codec, value_codec>(
      std::span<query_chunk_plan const>(&chunk, 1), q, q_heads, kv, d, out, opt, threads, attention_tile,
      [&](int, int head, cpu_kernels::attention_call const& call, float const* qr, block_q8_0 const* qb,
          std::int64_t begin, std::int64_t end, cpu_kernels::attention_state const& state,
          cpu_kernels::attention_scratch& scratch) {
        vector<float> offsets;
        Kernel::template attend<stored_codec_t<key_codec>, stored_codec_t<value_codec>>(
            token_source_of(cache.key_storage(layer, head)), cache.get_options().key,
            token_source_of(cache.value_storage(layer, head)), cache.get_options().value,
            centered_call<key_codec>(call, qr, flat_key_mean(cache, layer, head), offsets), qr, qb, begin, end, state,
            scratch);
      });
}

}  // namespace detail

/// Attention of n_q query tokens over `layer` (chunked prefill, speculative verification, a
/// prefix-cache suffix): q and out are (n_q, q_heads, head_dim) floats, query token i at position
/// opt.first_pos + i (default: the last n_q tokens of the layer, i.e. the chunk just appended).
/// opt.mask says which tokens each query attends (causal by default; none; or a caller's additive
/// or boolean mask, (n_q, mask_stride) elements with token j in column j), narrowed by opt.window
/// around each query's position; opt.sinks add a logit per query head to every denominator. The
/// cache is read tile by tile, each tile decoded once for a block of query tokens and every head
/// of its kv group; options, precision and NaN/Inf semantics as decode_attention, of which
/// n_q = 1 is exactly the result. `threads` >= 1 threads share the (query block, kv head, token
/// run) items. Raises index_error for a bad layer, a negative first position or causal positions
/// past the layer's tokens; shape_error for a null q / out or q_heads not a positive multiple of
/// kv_heads; invalid_argument_error for bad options, sinks, masks, n_q < 0 or threads < 1.
template <class Cache>
void attention(Cache const& cache, int layer, float const* q, std::int64_t n_q, int q_heads, float* out,
               attention_options const& opt = {}, int threads = 1) {
  detail::attention_with<detail::default_attention>(cache, layer, q, n_q, q_heads, out, opt, threads);
}

KVQ_NAMESPACE_END
