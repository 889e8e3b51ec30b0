// kvq: the arguments of kvq's Metal kernels, shared by the shaders and the host (C++14 subset).
//
// Every kernel receives one of the structs below by value through `setBytes` at buffer index 0
// (`constant kvq_metal_*_args& a [[buffer(0)]]`). They hold only fixed-width integers and floats,
// ordered so that the Metal and the host compilers lay them out identically; their sizes are pinned
// by static_assert. As in ggml's ggml-metal-impl.h, they live in the global namespace with a
// `kvq_metal_` prefix, so shader and host spell them the same way.
//
// The second half of this file (between the "host-only" markers) is host C++20: it maps kvq's
// codec types to kernel codec ids and plans the kernel launches of the Metal cache (append,
// truncate, shift, attention). It is shared by backend/metal/metal_cache.hpp and the CPU test
// harness of the kernels (tests/metal), and is left out of the embedded shader source.
#pragma once

#include "../../detail/config.h"

#if !defined(__METAL_VERSION__)
#  include <stdint.h>
#endif

/// Codec of a kernel, passed as Metal function constant 0 (keys, or the codec of a row kernel) and
/// 1 (values, attention only), so every pipeline is specialised to its codecs.
enum kvq_metal_codec : int32_t {
  kvq_metal_f32 = 0,
  kvq_metal_f16 = 1,
  kvq_metal_q8_0 = 2,
  kvq_metal_q4_0 = 3,
  kvq_metal_int8 = 4,
  kvq_metal_fp8_e4m3 = 5,
  kvq_metal_fp8_e5m2 = 6,
  kvq_metal_kivi_value2 = 7,  ///< KIVI values, per token, 2-bit
  kvq_metal_kivi_value4 = 8,
  kvq_metal_kivi_value8 = 9,
  kvq_metal_kivi_key2 = 10,  ///< KIVI keys, per channel over tiles of G tokens, 2-bit
  kvq_metal_kivi_key4 = 11,
  kvq_metal_kivi_key8 = 12,
};

/// Element type of a kernel's input (appended keys/values) or output (decoded rows).
enum kvq_metal_elem : int32_t {
  kvq_metal_elem_f32 = 0,
  kvq_metal_elem_f16 = 1,
  kvq_metal_elem_bf16 = 2,
  kvq_metal_elem_f16_sat = 3,  ///< output only: f16 with finite values saturating to ±65504 (the KIVI residual)
};

/// Where the keys (or values) of one layer live in the layer's buffer, and how they are encoded.
///
/// kv_head h's region starts at `head0 + h * head_stride`; it holds the encoded units (rows, or
/// tiles of `group` tokens for KIVI keys) from byte 0 and, for KIVI, f16 residual rows of
/// head_dim elements from byte `residual_offset`. Token t < quantized is in unit t (rows) or
/// t / group (tiles); token t >= quantized is residual row
/// (residual_first + t - quantized) % residual_rows (a ring for the KIVI values window).
struct kvq_metal_region {
  uint64_t head0;            ///< byte offset of kv_head 0's region in the layer buffer
  uint64_t head_stride;      ///< bytes between the regions of consecutive kv_heads
  uint64_t residual_offset;  ///< byte offset, inside a region, of the f16 residual rows
  uint32_t unit_bytes;       ///< bytes per encoded row (row codecs) or tile (KIVI keys)
  int32_t group;             ///< KIVI group size G (0 for the other codecs)
  int32_t quantized;         ///< tokens [0, quantized) are encoded units
  int32_t residual_rows;     ///< rows of the residual buffer (>= 1; the ring modulus)
  int32_t residual_first;    ///< residual row of token `quantized`
  float fp8_scale;           ///< fp8 codecs: code = fp8(x / scale), value = fp8 * scale
  int32_t fp8_saturate;      ///< fp8 codecs: 1 saturates overflow to ±max finite, 0 does not
  int32_t reserved;
};
static_assert(sizeof(kvq_metal_region) == 56, "kvq_metal_region must be 56 bytes on host and device");

/// Where the rows of a batch come from (kernels that write the cache).
///
/// Batch row i of kv_head h is residual row (residual_first + i) % residual_rows of the
/// destination region when i < from_residual (f16, already rounded), and otherwise input token
/// first + i - from_residual: elements `(token * token_stride + h * head_stride + c)` of the input
/// buffer, of type `type`, rounded to f16 first when `round_f16` (KIVI quantizes stored f16 values).
struct kvq_metal_source {
  uint64_t token_stride;   ///< elements between consecutive tokens of the input
  uint64_t head_stride;    ///< elements between consecutive kv_heads of the input
  int32_t type;            ///< kvq_metal_elem of the input
  int32_t first;           ///< input token of the first batch row that comes from the input
  int32_t from_residual;   ///< batch rows [0, from_residual) come from the residual rows
  int32_t residual_first;  ///< residual row of batch row 0
  int32_t round_f16;       ///< 1: input values are rounded to f16 before they are encoded
  int32_t reserved;
};
static_assert(sizeof(kvq_metal_source) == 40, "kvq_metal_source must be 40 bytes on host and device");

/// Arguments of kvq_encode_rows, kvq_encode_key_tiles and kvq_store_f16_rows.
///
///   kvq_encode_rows:      grid (blocks, count * kv_heads); batch row i of head h -> unit first + i
///   kvq_encode_key_tiles: grid (head_dim, count / G * kv_heads); tile j of head h holds batch rows
///                         [jG, jG + G) -> tile first + j
///   kvq_store_f16_rows:   grid (head_dim, count * kv_heads); batch row i of head h -> f16 residual
///                         row (first + i) % residual_rows
struct kvq_metal_write_args {
  kvq_metal_region dst;
  kvq_metal_source src;
  int32_t head_dim;
  int32_t kv_heads;
  int32_t count;   ///< batch rows per kv_head
  int32_t first;   ///< destination unit (row or tile) or residual row of batch row 0
  int32_t blocks;  ///< blocks per encoded row (the grid width of kvq_encode_rows)
  int32_t reserved;
};
static_assert(sizeof(kvq_metal_write_args) == 120, "kvq_metal_write_args must be 120 bytes on host and device");

/// Arguments of kvq_decode: tokens [first, first + count) of one kv_head to rows of `out_type`,
/// `out_stride` elements apart. Grid (head_dim, count).
struct kvq_metal_decode_args {
  kvq_metal_region src;
  uint64_t out_stride;
  int32_t head_dim;
  int32_t head;
  int32_t first;
  int32_t count;
  int32_t out_type;
  int32_t reserved;
};
static_assert(sizeof(kvq_metal_decode_args) == 88, "kvq_metal_decode_args must be 88 bytes on host and device");

/// Arguments of kvq_attention_partial (flash decoding, one query token).
///
/// Threadgroups (splits, kv_heads * chunks); threadgroup (s, y) attends query heads
/// [kv * group + chunk * heads, ... + heads) of kv_head kv = y / chunks (chunk = y % chunks,
/// group = q_heads / kv_heads) to tokens [begin + s * split_tokens, min(end, ... + split_tokens)),
/// `tile` tokens at a time, and writes the unnormalised partial state of each head: out
/// (splits, q_heads, head_dim), max and sum (splits, q_heads).
struct kvq_metal_attention_args {
  kvq_metal_region key;
  kvq_metal_region value;
  int32_t head_dim;
  int32_t kv_heads;
  int32_t q_heads;
  int32_t begin;
  int32_t end;
  int32_t split_tokens;  ///< tokens per split (a multiple of tile)
  int32_t splits;
  int32_t tile;        ///< tokens decoded per step (<= 32)
  int32_t heads;       ///< query heads per threadgroup
  int32_t chunks;      ///< threadgroups per kv_head along the query heads
  float scale;         ///< softmax scale (already resolved: never 0)
  float softcap;       ///< > 0: logit = softcap * tanh(logit / softcap)
  int32_t query_q8_0;  ///< 1: the query is rounded to q8_0 (integer dots for q8_0/q4_0 keys)
  int32_t probs_f16;   ///< 1: probabilities are rounded to f16 before they multiply V
};
static_assert(sizeof(kvq_metal_attention_args) == 168, "kvq_metal_attention_args must be 168 bytes on host and device");

/// Arguments of kvq_attention_combine: merges `splits` partial states per query head in split
/// order and writes the normalised output (q_heads, head_dim). Grid (head_dim, q_heads).
struct kvq_metal_combine_args {
  int32_t q_heads;
  int32_t head_dim;
  int32_t splits;
  int32_t reserved;
};
static_assert(sizeof(kvq_metal_combine_args) == 16, "kvq_metal_combine_args must be 16 bytes on host and device");

/// Offsets, in floats, of the threadgroup arrays of kvq_attention_partial, and their total.
struct kvq_metal_attention_smem {
  uint32_t q;       ///< (heads, head_dim) query, f32 (dequantized when the query is q8_0)
  uint32_t o;       ///< (heads, head_dim) unnormalised output
  uint32_t k;       ///< (tile, head_dim) decoded keys
  uint32_t p;       ///< (heads, tile) logits
  uint32_t w;       ///< (heads, tile) weights of the values (probabilities rescaled to the tile's max)
  uint32_t m;       ///< (heads) running max
  uint32_t l;       ///< (heads) running sum
  uint32_t corr;    ///< (heads) rescale factor of the current tile
  uint32_t qd;      ///< (heads, blocks) q8_0 query scales (query_q8_0 only)
  uint32_t qcodes;  ///< (heads, blocks * 32) q8_0 query codes as bytes (query_q8_0 only)
  uint32_t total;   ///< floats in all, a multiple of 4 (setThreadgroupMemoryLength wants 16-byte multiples)
};

/// Threadgroup memory layout of kvq_attention_partial for a head_dim, tile, heads per threadgroup
/// and query precision.
inline kvq_metal_attention_smem kvq_metal_attention_layout(int32_t head_dim, int32_t tile, int32_t heads,
                                                           int32_t query_q8_0) {
  const uint32_t d = static_cast<uint32_t>(head_dim);
  const uint32_t h = static_cast<uint32_t>(heads);
  const uint32_t blocks = (d + 31u) / 32u;
  kvq_metal_attention_smem s;
  s.q = 0u;
  s.o = s.q + h * d;
  s.k = s.o + h * d;
  s.p = s.k + static_cast<uint32_t>(tile) * d;
  s.w = s.p + h * static_cast<uint32_t>(tile);
  s.m = s.w + h * static_cast<uint32_t>(tile);
  s.l = s.m + h;
  s.corr = s.l + h;
  s.qd = s.corr + h;
  s.qcodes = s.qd + (query_q8_0 != 0 ? h * blocks : 0u);
  const uint32_t end = s.qcodes + (query_q8_0 != 0 ? h * blocks * 8u : 0u);  // 32 bytes = 8 floats per block
  s.total = (end + 3u) / 4u * 4u;
  return s;
}

// ---- kvq-embed: host-only begin ----
#if !defined(__METAL_VERSION__)

#  include <algorithm>
#  include <cstddef>
#  include <cstdint>
#  include <type_traits>

#  include "../../attention.hpp"
#  include "../../cache.hpp"
#  include "../../codec/fp8.hpp"
#  include "../../codec/int8.hpp"
#  include "../../codec/kivi.hpp"
#  include "../../codec/passthrough.hpp"
#  include "../../codec/q4_0.hpp"
#  include "../../codec/q8_0.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Kernels of kvq's Metal backend, in the order of `metal_kernel_names`.
enum class metal_kernel : int {
  encode_rows,
  encode_key_tiles,
  store_f16_rows,
  decode,
  attention_partial,
  attention_combine,
};

/// The function names of the kernels in kernels.metal.
inline constexpr char const* metal_kernel_names[] = {
    "kvq_encode_rows", "kvq_encode_key_tiles",  "kvq_store_f16_rows",
    "kvq_decode",      "kvq_attention_partial", "kvq_attention_combine",
};

/// The Metal codec id of a kvq codec; undefined for codecs without Metal kernels.
template <class C>
struct metal_codec_id;
template <>
struct metal_codec_id<f32_codec> : std::integral_constant<int, kvq_metal_f32> {};
template <>
struct metal_codec_id<f16_codec> : std::integral_constant<int, kvq_metal_f16> {};
template <>
struct metal_codec_id<q8_0> : std::integral_constant<int, kvq_metal_q8_0> {};
template <>
struct metal_codec_id<q4_0> : std::integral_constant<int, kvq_metal_q4_0> {};
template <>
struct metal_codec_id<int8_sym> : std::integral_constant<int, kvq_metal_int8> {};
template <>
struct metal_codec_id<fp8_e4m3> : std::integral_constant<int, kvq_metal_fp8_e4m3> {};
template <>
struct metal_codec_id<fp8_e5m2> : std::integral_constant<int, kvq_metal_fp8_e5m2> {};
template <int B, int G>
struct metal_codec_id<::kvq::kivi_value<B, G>> : std::integral_constant<int, B == 2   ? kvq_metal_kivi_value2
                                                                             : B == 4 ? kvq_metal_kivi_value4
                                                                                      : kvq_metal_kivi_value8> {};
template <int B, int G>
struct metal_codec_id<::kvq::kivi_key<B, G>> : std::integral_constant<int, B == 2   ? kvq_metal_kivi_key2
                                                                           : B == 4 ? kvq_metal_kivi_key4
                                                                                    : kvq_metal_kivi_key8> {};

/// A codec with Metal kernels.
template <class C>
concept metal_codec = requires {
  metal_codec_id<C>::value;
};

/// The Metal element type id of an input/output element type.
template <element T>
constexpr auto metal_elem_id() -> int {
  if constexpr (std::is_same_v<T, float>) {
    return kvq_metal_elem_f32;
  } else if constexpr (std::is_same_v<T, f16>) {
    return kvq_metal_elem_f16;
  } else {
    return kvq_metal_elem_bf16;
  }
}

/// Bytes of one element of a Metal element type id.
constexpr auto metal_elem_bytes(int type) -> std::size_t { return type == kvq_metal_elem_f32 ? 4 : 2; }

/// Per-layer bookkeeping of the Metal cache; every kv_head advances identically (as on the CPU).
struct metal_state {
  std::int64_t length = 0;           ///< tokens in the layer
  std::int64_t key_quantized = 0;    ///< KIVI keys: tokens in tiles (a multiple of G)
  std::int64_t value_quantized = 0;  ///< KIVI values: tokens in encoded rows
  std::int64_t window_tokens = 0;    ///< KIVI values: tokens in the f16 window
  std::int64_t window_first = 0;     ///< KIVI values: ring row of the oldest window token
};

/// The static description of the keys or the values of a layer: region geometry and codec.
struct metal_side {
  kvq_metal_region region{};    ///< `quantized` and `residual_first` are set per operation
  int codec = 0;                ///< kvq_metal_codec
  int blocks = 1;               ///< blocks per encoded row (row codecs)
  bool tiles = false;           ///< KIVI keys: encoded per tile of G tokens from an f16 residual
  bool window = false;          ///< KIVI values: an f16 window of the last R tokens
  std::int64_t residual = 0;    ///< rows of the f16 residual (tiles: F; window: R; else 0)
  std::size_t units_bytes = 0;  ///< aligned bytes of the encoded units of one kv_head
};

/// Fills the fp8 fields of a region from a codec's parameters (no-op for other parameter types).
template <class Params>
inline void set_metal_params(kvq_metal_region& r, Params const& p) {
  if constexpr (std::is_same_v<Params, fp8_params>) {
    r.fp8_scale = p.scale;
    r.fp8_saturate = p.overflow == fp8_overflow::saturate ? 1 : 0;
  } else {
    (void)p;
    r.fp8_scale = 1.0f;
    r.fp8_saturate = 1;
  }
}

/// Describes codec C used as keys (IsValue false) or values in a layer of `shape`, whose regions
/// start at byte `head0` and are `head_stride` bytes apart: the CPU cache's storage layout.
template <metal_codec C, bool IsValue>
inline auto make_metal_side(cache_shape const& shape, int residual, typename C::params_type const& params,
                            std::size_t head0, std::size_t head_stride) -> metal_side {
  auto const layout = region_layout<C, IsValue>::make(shape, residual);
  auto const g = C::geometry(shape.head_dim);
  metal_side s;
  s.codec = metal_codec_id<C>::value;
  s.blocks = g.blocks;
  s.tiles = C::layout == codec_layout::token_group;
  s.window = IsValue && has_value_window<C>::value && residual > 0;
  s.residual = layout.residual_rows;
  s.units_bytes = layout.units_bytes;
  s.region.head0 = head0;
  s.region.head_stride = head_stride;
  s.region.residual_offset = layout.units_bytes;
  s.region.unit_bytes = static_cast<std::uint32_t>(g.bytes());
  if constexpr (requires { C::group; }) s.region.group = C::group;
  s.region.residual_rows = static_cast<std::int32_t>(std::max<std::int64_t>(layout.residual_rows, 1));
  set_metal_params(s.region, params);
  return s;
}

/// The key side's region as of state `st`.
inline auto metal_key_region(metal_side const& k, metal_state const& st) -> kvq_metal_region {
  kvq_metal_region r = k.region;
  r.quantized = static_cast<std::int32_t>(k.tiles ? st.key_quantized : st.length);
  r.residual_first = 0;
  return r;
}

/// The value side's region as of state `st`.
inline auto metal_value_region(metal_side const& v, metal_state const& st) -> kvq_metal_region {
  kvq_metal_region r = v.region;
  r.quantized = static_cast<std::int32_t>(v.window ? st.value_quantized : st.length);
  r.residual_first = static_cast<std::int32_t>(v.window ? st.window_first : 0);
  return r;
}

/// One kernel launch of a write plan: kernel, arguments and grid (threads).
struct metal_write_step {
  metal_kernel kernel = metal_kernel::encode_rows;
  bool values = false;  ///< the input is the values tensor (else the keys tensor)
  kvq_metal_write_args args{};
  std::uint32_t grid_x = 0;
  std::uint32_t grid_y = 0;
};

/// The launches of one append, in order, and the layer state after them.
struct metal_append_plan {
  metal_write_step steps[4];
  int count = 0;
  metal_state next;
};

/// An input tensor as the kernels see it (`first` is filled by the planner).
inline auto metal_source(int type, std::int64_t token_stride, std::int64_t head_stride) -> kvq_metal_source {
  kvq_metal_source s{};
  s.token_stride = static_cast<std::uint64_t>(token_stride);
  s.head_stride = static_cast<std::uint64_t>(head_stride);
  s.type = type;
  return s;
}

/// Plans the append of n tokens (keys `ks`, values `vs`) to a layer in state `st`, reproducing the
/// CPU cache (cache.hpp): row codecs encode every token; KIVI keys go through the f16 residual of F
/// rows, flushed as F/G tiles from the stored f16 values when it fills; KIVI values go through the
/// f16 window of the last R tokens, the tokens leaving it being encoded from their f16 values
/// (R = 0: at once, from the f16-rounded input).
inline auto plan_metal_append(metal_side const& k, metal_side const& v, int head_dim, int kv_heads,
                              metal_state const& st, std::int64_t n, kvq_metal_source ks, kvq_metal_source vs)
    -> metal_append_plan {
  metal_append_plan plan;
  plan.next = st;
  auto add = [&](metal_kernel kernel, bool values, kvq_metal_region const& dst, kvq_metal_source const& src,
                 std::int64_t count, std::int64_t first, int blocks) {
    metal_write_step& s = plan.steps[plan.count++];
    s.kernel = kernel;
    s.values = values;
    s.args.dst = dst;
    s.args.src = src;
    s.args.head_dim = head_dim;
    s.args.kv_heads = kv_heads;
    s.args.count = static_cast<std::int32_t>(count);
    s.args.first = static_cast<std::int32_t>(first);
    s.args.blocks = blocks;
    std::int64_t const rows = kernel == metal_kernel::encode_key_tiles ? count / dst.group : count;
    s.grid_x = static_cast<std::uint32_t>(kernel == metal_kernel::encode_rows ? blocks : head_dim);
    s.grid_y = static_cast<std::uint32_t>(rows * kv_heads);
  };
  if (n <= 0) return plan;

  // Keys.
  kvq_metal_region const kr = metal_key_region(k, st);
  if (k.tiles) {
    std::int64_t const f = k.residual;
    std::int64_t const g = k.region.group;
    std::int64_t const r = st.length - st.key_quantized;  // rows in the residual (< F)
    std::int64_t const flushes = (r + n) / f;
    std::int64_t const left = r + n - flushes * f;  // rows in the residual afterwards
    if (flushes > 0) {
      kvq_metal_source src = ks;
      src.from_residual = static_cast<std::int32_t>(r);
      src.residual_first = 0;
      src.first = 0;
      src.round_f16 = 1;
      add(metal_kernel::encode_key_tiles, false, kr, src, flushes * f, st.key_quantized / g, 1);
      plan.next.key_quantized = st.key_quantized + flushes * f;
    }
    std::int64_t const stored = flushes > 0 ? left : n;  // new tokens that stay in the residual
    if (stored > 0) {
      kvq_metal_source src = ks;
      src.first = static_cast<std::int32_t>(n - stored);
      add(metal_kernel::store_f16_rows, false, kr, src, stored, flushes > 0 ? 0 : r, 1);
    }
  } else {
    kvq_metal_source src = ks;
    add(metal_kernel::encode_rows, false, kr, src, n, st.length, k.blocks);
  }

  // Values.
  kvq_metal_region const vr = metal_value_region(v, st);
  if (v.window) {
    std::int64_t const rr = v.residual;
    std::int64_t const out = std::max<std::int64_t>(0, st.window_tokens + n - rr);  // tokens leaving the window
    if (out > 0) {
      kvq_metal_source src = vs;
      src.from_residual = static_cast<std::int32_t>(std::min(out, st.window_tokens));
      src.residual_first = static_cast<std::int32_t>(st.window_first);
      src.first = 0;
      src.round_f16 = 1;
      add(metal_kernel::encode_rows, true, vr, src, out, st.value_quantized, v.blocks);
    }
    std::int64_t const kept = std::min(n, st.window_tokens + n - out);  // new tokens in the window
    if (kept > 0) {
      kvq_metal_source src = vs;
      src.first = static_cast<std::int32_t>(n - kept);
      // Ring row of token t is (window_first + t - value_quantized) % R; the first kept token is
      // t = length + n - kept.
      std::int64_t const row = (st.window_first + st.window_tokens + n - kept) % rr;
      add(metal_kernel::store_f16_rows, true, vr, src, kept, row, 1);
    }
    plan.next.value_quantized = st.value_quantized + out;
    plan.next.window_first = (st.window_first + out) % rr;
    plan.next.window_tokens = st.window_tokens + n - out;
  } else {
    kvq_metal_source src = vs;
    bool const kivi = v.codec >= kvq_metal_kivi_value2 && v.codec <= kvq_metal_kivi_value8;
    src.round_f16 = kivi ? 1 : 0;  // KIVI values with R = 0: quantized from the f16-rounded input
    add(metal_kernel::encode_rows, true, vr, src, n, kivi ? st.value_quantized : st.length, v.blocks);
    if (kivi) plan.next.value_quantized = st.value_quantized + n;
  }
  plan.next.length = st.length + n;
  return plan;
}

/// What truncate(n) does to a layer: the new state and, when n cuts into a quantized KIVI key tile,
/// the tokens [untile_first, untile_first + untile_count) of that tile to decode back into the f16
/// residual rows [0, untile_count) (lossy, as on the CPU).
struct metal_truncate_plan {
  metal_state next;
  std::int64_t untile_first = 0;
  std::int64_t untile_count = 0;
};

/// Plans truncate(n) of a layer in state `st` (a layer holding n or fewer tokens is unchanged).
inline auto plan_metal_truncate(metal_side const& k, metal_side const& v, metal_state const& st, std::int64_t n)
    -> metal_truncate_plan {
  metal_truncate_plan p;
  p.next = st;
  if (st.length <= n) return p;
  if (k.tiles && n < st.key_quantized) {
    std::int64_t const q = n / k.region.group * k.region.group;
    p.untile_first = q;
    p.untile_count = n - q;
    p.next.key_quantized = q;
  }
  if (v.codec >= kvq_metal_kivi_value2 && v.codec <= kvq_metal_kivi_value8) {
    if (n < st.value_quantized) {
      p.next.value_quantized = n;
      p.next.window_tokens = 0;
      p.next.window_first = 0;
    } else {
      p.next.window_tokens = n - st.value_quantized;
    }
  }
  p.next.length = n;
  return p;
}

/// A byte move inside one kv_head's region (memmove semantics: the ranges may overlap).
struct metal_move {
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t bytes = 0;
};

/// The moves of shift_left(n) inside each kv_head's key region (keys = true) or value region, and
/// the new state, reproducing the CPU cache. Requires n <= st.length (and n % G == 0 for KIVI keys).
struct metal_shift_plan {
  metal_move key[2];
  int key_count = 0;
  metal_move value[1];
  int value_count = 0;
  metal_state next;
};

/// Plans shift_left(n) of a non-empty layer in state `st`.
inline auto plan_metal_shift(metal_side const& k, metal_side const& v, int head_dim, metal_state const& st,
                             std::int64_t n) -> metal_shift_plan {
  metal_shift_plan p;
  p.next = st;
  std::size_t const kb = k.region.unit_bytes;
  std::size_t const vb = v.region.unit_bytes;
  if (k.tiles) {
    std::int64_t const g = k.region.group;
    std::int64_t const drop_tiles = std::min(n, st.key_quantized) / g;
    std::int64_t const keep_tiles = st.key_quantized / g - drop_tiles;
    p.key[p.key_count++] = {static_cast<std::size_t>(drop_tiles) * kb, 0, static_cast<std::size_t>(keep_tiles) * kb};
    if (n > st.key_quantized) {
      std::int64_t const drop = n - st.key_quantized;
      std::int64_t const keep = st.length - st.key_quantized - drop;
      std::size_t const row = static_cast<std::size_t>(head_dim) * 2;
      p.key[p.key_count++] = {k.region.residual_offset + static_cast<std::size_t>(drop) * row, k.region.residual_offset,
                              static_cast<std::size_t>(keep) * row};
    }
    p.next.key_quantized = std::max<std::int64_t>(st.key_quantized - n, 0);
  } else {
    p.key[p.key_count++] = {static_cast<std::size_t>(n) * kb, 0, static_cast<std::size_t>(st.length - n) * kb};
  }
  bool const kivi_value = v.codec >= kvq_metal_kivi_value2 && v.codec <= kvq_metal_kivi_value8;
  std::int64_t const rows = kivi_value ? st.value_quantized : st.length;
  std::int64_t const drop = std::min(n, rows);
  p.value[p.value_count++] = {static_cast<std::size_t>(drop) * vb, 0, static_cast<std::size_t>(rows - drop) * vb};
  if (kivi_value) {
    if (n <= st.value_quantized) {
      p.next.value_quantized = st.value_quantized - n;
    } else {
      std::int64_t const d = n - st.value_quantized;
      p.next.value_quantized = 0;
      p.next.window_first = (st.window_first + d) % std::max<std::int64_t>(v.residual, 1);
      p.next.window_tokens = st.window_tokens - d;
    }
  }
  p.next.length = st.length - n;
  return p;
}

/// The launches of one decode attention: kvq_attention_partial over `threadgroups` of `threads`
/// threads with `smem_bytes` of threadgroup memory, then kvq_attention_combine over (head_dim,
/// q_heads) threads. Partial states take splits * q_heads * (head_dim + 2) floats.
struct metal_attention_plan {
  kvq_metal_attention_args args{};
  kvq_metal_combine_args combine{};
  std::uint32_t threadgroups_x = 0;
  std::uint32_t threadgroups_y = 0;
  std::uint32_t threads = 0;
  std::size_t smem_bytes = 0;
  bool empty = true;  ///< no token is attended: the output is all zeros
};

/// Plans decode attention of q_heads query heads over tokens [begin, end) of a layer in state `st`
/// (the window option already applied by the caller). `smem_limit` is the device's threadgroup
/// memory limit in bytes, `threads` the threadgroup size (a multiple of the SIMD width), and
/// `split_tokens` > 0 forces the tokens per split (rounded up to a multiple of the tile).
/// Returns false when no tile/heads choice fits in `smem_limit`.
inline auto plan_metal_attention(metal_side const& k, metal_side const& v, metal_state const& st, int head_dim,
                                 int kv_heads, int q_heads, std::int64_t begin, std::int64_t end, float scale,
                                 attention_options const& opt, std::size_t smem_limit, std::uint32_t threads,
                                 std::int64_t split_tokens, metal_attention_plan& plan) -> bool {
  plan = metal_attention_plan{};
  int const group = q_heads / kv_heads;
  int const q8 = opt.query == query_precision::q8_0 ? 1 : 0;
  int tile = std::clamp(4096 / std::max(head_dim, 1), 1, 32);
  int heads = group;
  auto bytes = [&](int t, int h) {
    return static_cast<std::size_t>(kvq_metal_attention_layout(head_dim, t, h, q8).total) * 4;
  };
  while (heads > 1 && bytes(tile, heads) > smem_limit) heads = (heads + 1) / 2;
  while (tile > 1 && bytes(tile, heads) > smem_limit) tile /= 2;
  if (bytes(tile, heads) > smem_limit) return false;
  std::int64_t const span = std::max<std::int64_t>(end - begin, 0);
  int const chunks = (group + heads - 1) / heads;
  std::int64_t split = split_tokens;
  if (split <= 0) {
    // Enough threadgroups to fill a GPU (about 64 per layer), but at least 256 tokens each.
    std::int64_t const want = std::max<std::int64_t>(1, 64 / (static_cast<std::int64_t>(kv_heads) * chunks));
    split = std::max<std::int64_t>(256, (span + want - 1) / want);
  }
  split = (split + tile - 1) / tile * tile;
  std::int64_t const splits = span == 0 ? 0 : (span + split - 1) / split;
  auto& a = plan.args;
  a.key = metal_key_region(k, st);
  a.value = metal_value_region(v, st);
  a.head_dim = head_dim;
  a.kv_heads = kv_heads;
  a.q_heads = q_heads;
  a.begin = static_cast<std::int32_t>(begin);
  a.end = static_cast<std::int32_t>(std::max(begin, end));
  a.split_tokens = static_cast<std::int32_t>(split);
  a.splits = static_cast<std::int32_t>(splits);
  a.tile = tile;
  a.heads = heads;
  a.chunks = chunks;
  a.scale = scale;
  a.softcap = opt.softcap;
  a.query_q8_0 = q8;
  a.probs_f16 = opt.probabilities == probability_precision::f16 ? 1 : 0;
  plan.combine = {q_heads, head_dim, static_cast<std::int32_t>(splits), 0};
  plan.threadgroups_x = static_cast<std::uint32_t>(splits);
  plan.threadgroups_y = static_cast<std::uint32_t>(kv_heads * chunks);
  plan.threads = threads;
  plan.smem_bytes = bytes(tile, heads);
  plan.empty = splits == 0;
  return true;
}

}  // namespace detail
KVQ_NAMESPACE_END

#endif  // !__METAL_VERSION__
// ---- kvq-embed: host-only end ----
