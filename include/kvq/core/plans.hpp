// kvq: the state machine of a cache layer and the plans of its operations, for every backend.
//
// A layer's state is a handful of token counts (length, KIVI quantized counts, window position);
// every operation is planned here from the state as kernel launches over core/kernel_args.h
// (append, read, truncate) or byte moves (shift_left), and the attention as a split-and-combine
// launch geometry. The CPU backend runs the plans with its SIMD kernels, CUDA and Metal with the
// kernel bodies of core/kernel_bodies.h: one state machine, so bytes and KIVI residual rules are
// the same everywhere by construction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../codec/centered.hpp"
#include "../codec/codec.hpp"
#include "../codec/fp4.hpp"
#include "../codec/fp8.hpp"
#include "../codec/int8.hpp"
#include "../codec/kivi.hpp"
#include "../codec/passthrough.hpp"
#include "../codec/q4_0.hpp"
#include "../codec/q8_0.hpp"
#include "../codec/rotated.hpp"
#include "../codec/tq_codebook.hpp"
#include "kernel_args.h"
#include "storage_layout.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The kernel codec id of a kvq codec (kvq_codec_id); undefined for codecs without GPU kernels.
template <class C>
struct kernel_codec;
template <>
struct kernel_codec<f32_codec> : std::integral_constant<int, kvq_codec_f32> {};
template <>
struct kernel_codec<f16_codec> : std::integral_constant<int, kvq_codec_f16> {};
template <>
struct kernel_codec<q8_0> : std::integral_constant<int, kvq_codec_q8_0> {};
template <>
struct kernel_codec<q4_0> : std::integral_constant<int, kvq_codec_q4_0> {};
template <>
struct kernel_codec<int8_sym> : std::integral_constant<int, kvq_codec_int8> {};
template <>
struct kernel_codec<fp8_e4m3> : std::integral_constant<int, kvq_codec_fp8_e4m3> {};
template <>
struct kernel_codec<fp8_e5m2> : std::integral_constant<int, kvq_codec_fp8_e5m2> {};
template <>
struct kernel_codec<mxfp4> : std::integral_constant<int, kvq_codec_mxfp4> {};
template <>
struct kernel_codec<nvfp4> : std::integral_constant<int, kvq_codec_nvfp4> {};
template <int B, int G>
struct kernel_codec<::kvq::kivi_value<B, G>> : std::integral_constant<int, B == 2   ? kvq_codec_kivi_value2
                                                                           : B == 4 ? kvq_codec_kivi_value4
                                                                                    : kvq_codec_kivi_value8> {};
template <int B, int G>
struct kernel_codec<::kvq::kivi_key<B, G>> : std::integral_constant<int, B == 2   ? kvq_codec_kivi_key2
                                                                         : B == 4 ? kvq_codec_kivi_key4
                                                                                  : kvq_codec_kivi_key8> {};

template <int B>
struct kernel_codec<tq_codebook<B>> : std::integral_constant<int, B == 2   ? kvq_codec_tq2
                                                                  : B == 3 ? kvq_codec_tq3
                                                                           : kvq_codec_tq4> {};

/// A codec with kernel bodies in core/kernel_bodies.h (so with CUDA and Metal kernels).
template <class C>
concept kernel_codec_of = requires {
  kernel_codec<C>::value;
};

/// A rotated codec runs its stored codec's kernels (the rotation travels in the arguments).
template <rotated_codec C>
requires kernel_codec_of<typename C::stored_codec>
struct kernel_codec<C> : kernel_codec<typename C::stored_codec> {
};

/// A centered codec that is not rotated runs its inner codec's kernels (centered<rotated<X>> is a
/// rotated codec: X's); the key mean travels in the arguments.
template <centered_codec C>
requires(!rotated_codec<C> && kernel_codec_of<typename C::centered_inner>) struct kernel_codec<C>
    : kernel_codec<typename C::centered_inner> {
};

/// The kernel element type of an input/output element type.
template <element T>
constexpr auto kernel_elem() -> int {
  if constexpr (std::is_same_v<T, float>) {
    return kvq_elem_f32;
  } else if constexpr (std::is_same_v<T, f16>) {
    return kvq_elem_f16;
  } else {
    return kvq_elem_bf16;
  }
}

/// Bytes of one element of a kernel element type.
constexpr auto kernel_elem_bytes(int type) -> std::size_t { return type == kvq_elem_f32 ? 4 : 2; }

/// The state of one layer; every kv_head advances identically.
struct layer_state {
  std::int64_t length = 0;           ///< tokens in the layer
  std::int64_t key_quantized = 0;    ///< KIVI keys: tokens in tiles (a multiple of G)
  std::int64_t value_quantized = 0;  ///< KIVI values: tokens in encoded rows
  std::int64_t window_tokens = 0;    ///< KIVI values: tokens in the f16 window
  std::int64_t window_first = 0;     ///< KIVI values: ring row of the oldest window token
  friend constexpr bool operator==(layer_state const&, layer_state const&) = default;
};

/// The static description of the keys or the values of a layer: region geometry and codec.
struct cache_side {
  kvq_region region{};      ///< `quantized` and `residual_first` are set per operation
  int codec = 0;            ///< kvq_codec_id, or -1 for a codec without GPU kernels
  int blocks = 1;           ///< blocks per encoded row (row codecs)
  bool tiles = false;       ///< KIVI keys: encoded per tile of G tokens from an f16 residual
  bool window = false;      ///< KIVI values with R > 0: an f16 window of the last R tokens
  bool kivi_value = false;  ///< KIVI values (quantized count tracked apart from the length)
  bool rotated = false;     ///< a rotated codec: inputs rotated, reads un-rotated (region.rotation_seed)
  /// Centered keys whose means live in device memory (the GPU caches; the CPU cache keeps them on
  /// the host): inputs less mu, reads plus mu, attention logits plus scale * q.mu.
  bool device_means = false;
  std::uint64_t means0 = 0;     ///< flat caches: byte offset of kv_head 0's key mean in a layer allocation
  std::int64_t residual = 0;    ///< rows of the f16 residual (tiles: F; window: R; else 0)
  std::size_t units_bytes = 0;  ///< aligned bytes of the encoded units of one kv_head
};

/// Describes codec C used as keys (IsValue false) or values in a layer of `shape`, whose regions
/// start at byte `head0` and are `head_stride` bytes apart (the layout of storage_layout.hpp).
template <codec C, bool IsValue>
auto make_cache_side(cache_shape const& shape, int residual, typename C::params_type const& params, std::size_t head0,
                     std::size_t head_stride) -> cache_side {
  auto const layout = region_layout<C, IsValue>::make(shape, residual);
  auto const g = C::geometry(shape.head_dim);
  cache_side s;
  if constexpr (kernel_codec_of<C>) {
    s.codec = kernel_codec<C>::value;
  } else {
    s.codec = -1;
  }
  s.blocks = g.blocks;
  s.tiles = C::layout == codec_layout::token_group;
  s.kivi_value = IsValue && has_value_window<C>::value;
  s.window = s.kivi_value && residual > 0;
  s.residual = layout.residual_rows;
  s.units_bytes = layout.units_bytes;
  s.region.head0 = head0;
  s.region.head_stride = head_stride;
  s.region.residual0 = head0 + layout.units_bytes;
  s.region.residual_stride = head_stride;
  s.region.unit_bytes = static_cast<std::uint32_t>(g.bytes());
  if constexpr (requires { C::group; }) s.region.group = C::group;
  s.region.residual_rows = static_cast<std::int32_t>(std::max<std::int64_t>(layout.residual_rows, 1));
  s.region.codec_scale = 1.0f;
  s.region.fp8_saturate = 1;
  if constexpr (rotated_codec<C>) {
    s.rotated = true;
    s.region.rotation_seed = static_cast<std::uint32_t>(C::rotation_seed);
  }
  if constexpr (std::is_same_v<typename C::params_type, fp8_params>) {
    s.region.codec_scale = params.scale;
    s.region.fp8_saturate = params.overflow == fp8_overflow::saturate ? 1 : 0;
  } else if constexpr (std::is_same_v<typename C::params_type, fp4_params>) {
    s.region.codec_scale = params.scale;
  } else {
    (void)params;
  }
  return s;
}

/// The key side's region as of state `st`.
inline auto key_region(cache_side const& k, layer_state const& st) -> kvq_region {
  kvq_region r = k.region;
  r.quantized = static_cast<std::int32_t>(k.tiles ? st.key_quantized : st.length);
  r.residual_first = 0;
  return r;
}

/// The value side's region as of state `st`.
inline auto value_region(cache_side const& v, layer_state const& st) -> kvq_region {
  kvq_region r = v.region;
  r.quantized = static_cast<std::int32_t>(v.kivi_value ? st.value_quantized : st.length);
  r.residual_first = static_cast<std::int32_t>(v.window ? st.window_first : 0);
  return r;
}

/// The write kernels.
enum class write_kernel { encode_rows, encode_key_tiles, store_f16_rows };

/// One kernel launch of an append: kernel, input (keys or values), arguments and thread count.
struct write_step {
  write_kernel kernel = write_kernel::encode_rows;
  bool values = false;  ///< the input is the values tensor (else the keys tensor)
  kvq_write_args args{};
  std::int64_t threads = 0;  ///< kv_heads * (count * blocks | count / G * head_dim | count * head_dim)
};

/// The launch that fixes the key means of a centered key side from the first chunk appended to an
/// empty layer: n input tokens described by `ks`, into the f32 (kv_heads, head_dim) at byte
/// `mean0` of the allocation (store_f16_rows in mode kvq_write_key_mean).
inline auto key_mean_step(int head_dim, int kv_heads, std::int64_t n, kvq_source ks, std::uint64_t mean0)
    -> write_step {
  write_step s;
  s.kernel = write_kernel::store_f16_rows;
  s.values = false;
  s.args.src = ks;
  s.args.src.mean = 0;
  s.args.src.mean0 = mean0;
  s.args.head_dim = head_dim;
  s.args.kv_heads = kv_heads;
  s.args.count = static_cast<std::int32_t>(n);
  s.args.mode = kvq_write_key_mean;
  s.args.dst.residual_rows = 1;
  s.threads = static_cast<std::int64_t>(kv_heads) * head_dim;
  return s;
}

/// The launches of one append, in order, and the layer state after them.
struct append_plan {
  write_step steps[4];
  int count = 0;
  layer_state next;
};

/// An input tensor as the kernels see it (`first` and the residual fields are filled by the planner).
inline auto kernel_source(int type, std::int64_t token_stride, std::int64_t head_stride) -> kvq_source {
  kvq_source s{};
  s.token_stride = static_cast<std::uint64_t>(token_stride);
  s.head_stride = static_cast<std::uint64_t>(head_stride);
  s.type = type;
  return s;
}

/// Plans the append of n tokens (keys `ks`, values `vs`) to a layer in state `st` (FORMATS.md
/// §4.3): row codecs encode every token; KIVI keys go through the f16 residual of F rows, flushed
/// as F/G tiles from the stored f16 values when it fills; KIVI values go through the f16 window of
/// the last R tokens, the tokens leaving it being encoded from their f16 values (R = 0: at once,
/// from the f16-rounded input). The bytes never depend on how appends are chunked.
inline auto plan_append(cache_side const& k, cache_side const& v, int head_dim, int kv_heads, layer_state const& st,
                        std::int64_t n, kvq_source ks, kvq_source vs) -> append_plan {
  append_plan plan;
  plan.next = st;
  ks.rotate = k.rotated ? 1 : 0;  // input rows only: the residual rows are stored rotated
  vs.rotate = v.rotated ? 1 : 0;
  auto add = [&](write_kernel kernel, bool values, kvq_region const& dst, kvq_source const& src, std::int64_t count,
                 std::int64_t first, int blocks) {
    write_step& s = plan.steps[plan.count++];
    s.kernel = kernel;
    s.values = values;
    s.args.dst = dst;
    s.args.src = src;
    s.args.head_dim = head_dim;
    s.args.kv_heads = kv_heads;
    s.args.count = static_cast<std::int32_t>(count);
    s.args.first = static_cast<std::int32_t>(first);
    s.args.blocks = blocks;
    std::int64_t const per_head = kernel == write_kernel::encode_rows        ? count * blocks
                                  : kernel == write_kernel::encode_key_tiles ? count / dst.group * head_dim
                                                                             : count * head_dim;
    s.threads = per_head * kv_heads;
  };
  if (n <= 0) return plan;

  // Keys.
  kvq_region const kr = key_region(k, st);
  if (k.tiles) {
    std::int64_t const f = k.residual;
    std::int64_t const g = k.region.group;
    std::int64_t const r = st.length - st.key_quantized;  // rows in the residual (< F)
    std::int64_t const flushes = (r + n) / f;
    if (flushes > 0) {
      kvq_source src = ks;
      src.from_residual = static_cast<std::int32_t>(r);
      src.residual_first = 0;
      src.first = 0;
      src.round_f16 = 1;
      add(write_kernel::encode_key_tiles, false, kr, src, flushes * f, st.key_quantized / g, 1);
      plan.next.key_quantized = st.key_quantized + flushes * f;
    }
    // Every new token passes through the residual: new token i lands in row (r + i) % F, so the
    // last min(n, F) of them are what the rows hold afterwards (the last r + n - flushes * F of
    // them are the residual; the other rows keep older tokens, whatever the chunking).
    std::int64_t const stored = std::min(n, f);
    kvq_source src = ks;
    src.first = static_cast<std::int32_t>(n - stored);
    add(write_kernel::store_f16_rows, false, kr, src, stored, (r + n - stored) % f, 1);
  } else {
    add(write_kernel::encode_rows, false, kr, ks, n, st.length, k.blocks);
  }

  // Values.
  kvq_region const vr = value_region(v, st);
  if (v.window) {
    std::int64_t const rr = v.residual;
    std::int64_t const out = std::max<std::int64_t>(0, st.window_tokens + n - rr);  // tokens leaving the window
    if (out > 0) {
      kvq_source src = vs;
      src.from_residual = static_cast<std::int32_t>(std::min(out, st.window_tokens));
      src.residual_first = static_cast<std::int32_t>(st.window_first);
      src.first = 0;
      src.round_f16 = 1;
      add(write_kernel::encode_rows, true, vr, src, out, st.value_quantized, v.blocks);
    }
    std::int64_t const kept = std::min(n, st.window_tokens + n - out);  // new tokens in the window
    if (kept > 0) {
      kvq_source src = vs;
      src.first = static_cast<std::int32_t>(n - kept);
      // The ring row of token t is (window_first + t - value_quantized) % R; the first kept token
      // is t = length + n - kept.
      std::int64_t const row = (st.window_first + st.window_tokens + n - kept) % rr;
      add(write_kernel::store_f16_rows, true, vr, src, kept, row, 1);
    }
    plan.next.value_quantized = st.value_quantized + out;
    plan.next.window_first = (st.window_first + out) % rr;
    plan.next.window_tokens = st.window_tokens + n - out;
  } else {
    kvq_source src = vs;
    src.round_f16 = v.kivi_value ? 1 : 0;  // KIVI values with R = 0: quantized from the f16-rounded input
    add(write_kernel::encode_rows, true, vr, src, n, v.kivi_value ? st.value_quantized : st.length, v.blocks);
    if (v.kivi_value) plan.next.value_quantized = st.value_quantized + n;
  }
  plan.next.length = st.length + n;
  return plan;
}

/// What truncate(n) does to a layer: the new state and, when n cuts into a quantized KIVI key tile,
/// the tokens [untile_first, untile_first + untile_count) of that tile to decode back into the f16
/// residual rows [0, untile_count) (lossy: the tokens keep their quantization error).
struct truncate_plan {
  layer_state next;
  std::int64_t untile_first = 0;
  std::int64_t untile_count = 0;
};

/// Plans truncate(n) of a layer in state `st` (a layer holding n or fewer tokens is unchanged).
inline auto plan_truncate(cache_side const& k, cache_side const& v, layer_state const& st, std::int64_t n)
    -> truncate_plan {
  truncate_plan p;
  p.next = st;
  if (st.length <= n) return p;
  if (k.tiles && n < st.key_quantized) {
    std::int64_t const q = n / k.region.group * k.region.group;
    p.untile_first = q;
    p.untile_count = n - q;
    p.next.key_quantized = q;
  }
  if (v.kivi_value) {
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

/// A byte move inside every kv_head's region (memmove semantics: src >= dst, the ranges may overlap).
struct byte_move {
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t bytes = 0;
};

/// The moves of shift_left(n) inside each kv_head's key and value regions, and the new state.
struct shift_plan {
  byte_move key[2];
  int key_count = 0;
  byte_move value;
  layer_state next;
};

/// Plans shift_left(n) of a non-empty layer in state `st`. Requires n <= st.length (and n % G == 0
/// for KIVI keys).
inline auto plan_shift(cache_side const& k, cache_side const& v, int head_dim, layer_state const& st, std::int64_t n)
    -> shift_plan {
  shift_plan p;
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
      std::size_t const res = k.region.residual0 - k.region.head0;  // inside the region
      p.key[p.key_count++] = {res + static_cast<std::size_t>(drop) * row, res, static_cast<std::size_t>(keep) * row};
    }
    p.next.key_quantized = std::max<std::int64_t>(st.key_quantized - n, 0);
  } else {
    p.key[p.key_count++] = {static_cast<std::size_t>(n) * kb, 0, static_cast<std::size_t>(st.length - n) * kb};
  }
  std::int64_t const rows = v.kivi_value ? st.value_quantized : st.length;
  std::int64_t const drop = std::min(n, rows);
  p.value = {static_cast<std::size_t>(drop) * vb, 0, static_cast<std::size_t>(rows - drop) * vb};
  if (v.kivi_value) {
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

/// How a backend runs the partial attention: its block-shared memory, threads per block, the
/// largest tile it wants, and how many blocks fill the device.
struct attention_device {
  std::size_t smem_limit = 48 * 1024;  ///< bytes of block-shared memory a block may use
  int threads = 128;                   ///< threads per block
  int max_tile = 32;                   ///< tokens per tile at most (<= 32)
  std::int64_t target_blocks = 64;     ///< blocks that fill the device
  std::int64_t split_tokens = 0;       ///< > 0: forced tokens per split (rounded up to the tile)
};

/// The launch geometry of one attention (flash decoding): the partial kernel over blocks
/// (splits, kv_heads * chunks, batch) of `threads` threads with `smem_bytes` of block-shared
/// memory, then the combine kernel. Partial states take batch * splits * n_q * q_heads *
/// (head_dim + 2) floats of scratch.
struct attention_plan {
  int tile = 32;
  int heads = 1;   ///< rows (query token, query head) per block
  int chunks = 1;  ///< blocks per kv_head along its rows
  int threads = 128;
  std::int64_t split_tokens = 0;
  int splits = 0;  ///< 0: nothing is attended, the output is zeros
  std::size_t smem_bytes = 0;
  std::size_t scratch_floats = 0;
};

/// Plans the attention of `batch` sequences of n_q query tokens of `q_heads` query heads whose
/// longest attended range (union over the query tokens) is `span` tokens. The tile (<= dev.max_tile
/// tokens) and the rows per block (at most max(group, 64), fewer when they do not fit) are the
/// largest that fit dev.smem_limit; the context is split so that about dev.target_blocks blocks
/// run, but at least 256 tokens per split. Returns false when nothing fits in dev.smem_limit.
inline auto plan_attention(int head_dim, int kv_heads, int q_heads, int batch, std::int64_t span, bool query_q8_0,
                           attention_device const& dev, attention_plan& plan, int n_q = 1) -> bool {
  plan = attention_plan{};
  int const group = q_heads / kv_heads;
  int const rows = static_cast<int>(std::min<std::int64_t>(static_cast<std::int64_t>(n_q) * group, 1 << 30));
  int const q8 = query_q8_0 ? 1 : 0;
  auto bytes = [&](int t, int h) {
    return static_cast<std::size_t>(kvq_attention_smem_layout(head_dim, t, h, q8).total) * 4;
  };
  int tile = std::clamp(dev.max_tile, 1, 32);
  int heads = std::min(rows, std::max(group, 64));
  while (heads > 1 && bytes(tile, heads) > dev.smem_limit) heads = (heads + 1) / 2;
  while (tile > 1 && bytes(tile, heads) > dev.smem_limit) tile /= 2;
  if (bytes(tile, heads) > dev.smem_limit) return false;
  plan.tile = tile;
  plan.heads = heads;
  plan.chunks = (rows + heads - 1) / heads;
  plan.threads = dev.threads;
  plan.smem_bytes = bytes(tile, heads);
  span = std::max<std::int64_t>(span, 0);
  std::int64_t split = dev.split_tokens;
  if (split <= 0) {
    std::int64_t const blocks = static_cast<std::int64_t>(kv_heads) * plan.chunks * batch;
    std::int64_t const want =
        std::max<std::int64_t>(1, (std::max<std::int64_t>(dev.target_blocks, 1) + blocks - 1) / blocks);
    split = std::max<std::int64_t>(256, (span + want - 1) / want);
  }
  split = (split + tile - 1) / tile * tile;
  plan.split_tokens = split;
  plan.splits = span == 0 ? 0 : static_cast<int>((span + split - 1) / split);
  plan.scratch_floats = static_cast<std::size_t>(batch) * static_cast<std::size_t>(plan.splits) *
                        static_cast<std::size_t>(n_q) * static_cast<std::size_t>(q_heads) *
                        (static_cast<std::size_t>(head_dim) + 2);
  return true;
}

/// The attention arguments shared by every sequence of a launch (regions, geometry, options).
inline auto attention_arguments(cache_side const& k, cache_side const& v, int head_dim, int kv_heads, int q_heads,
                                attention_plan const& plan, float scale, float softcap, bool query_q8_0, bool probs_f16)
    -> kvq_attention_args {
  kvq_attention_args a{};
  a.key = k.region;
  a.value = v.region;
  a.head_dim = head_dim;
  a.kv_heads = kv_heads;
  a.q_heads = q_heads;
  a.split_tokens = static_cast<std::int32_t>(plan.split_tokens);
  a.splits = plan.splits;
  a.tile = plan.tile;
  a.heads = plan.heads;
  a.chunks = plan.chunks;
  a.scale = scale;
  a.softcap = softcap;
  a.query_q8_0 = query_q8_0 ? 1 : 0;
  a.probs_f16 = probs_f16 ? 1 : 0;
  a.n_q = 1;
  a.rotation = (k.rotated ? kvq_rotate_query : 0) | (v.rotated ? kvq_unrotate_output : 0);
  a.key_mean = k.device_means ? 1 : 0;
  return a;
}

/// Sets the multi-token fields of attention arguments: n_q query tokens per sequence, the rows'
/// ranges (causal or not, window) and custom mask kind (mask rows `mask_stride` elements apart) of
/// `opt`, a kvq::attention_options (a template: this header does not include attention.hpp).
template <class Options>
void set_query_tokens(kvq_attention_args& a, int n_q, Options const& opt, std::int64_t mask_stride) {
  using kind = decltype(opt.mask);
  a.n_q = n_q;
  a.causal = opt.mask == kind::causal ? 1 : 0;
  a.window = static_cast<std::int32_t>(std::min<std::int64_t>(opt.window, std::numeric_limits<std::int32_t>::max()));
  a.mask = opt.mask == kind::additive  ? kvq_mask_additive
           : opt.mask == kind::boolean ? kvq_mask_boolean
                                       : kvq_mask_none;
  a.mask_stride = static_cast<std::uint64_t>(std::max<std::int64_t>(mask_stride, 0));
}

/// The attention sequence of a layer in state `st` attending tokens [begin, end).
inline auto attention_sequence(cache_side const& k, cache_side const& v, layer_state const& st, std::int64_t begin,
                               std::int64_t end) -> kvq_attention_seq {
  kvq_attention_seq s{};
  s.key_quantized = key_region(k, st).quantized;
  kvq_region const vr = value_region(v, st);
  s.value_quantized = vr.quantized;
  s.value_residual_first = vr.residual_first;
  s.begin = static_cast<std::int32_t>(begin);
  s.end = static_cast<std::int32_t>(std::max(begin, end));
  s.length = static_cast<std::int32_t>(st.length);
  s.first_pos = static_cast<std::int32_t>(st.length - 1);
  s.key_residual0 = k.region.residual0;
  s.value_residual0 = v.region.residual0;
  s.key_mean0 = k.means0;  // paged caches: the sequence's (paged_attention_sequence)
  return s;
}

}  // namespace detail
KVQ_NAMESPACE_END
