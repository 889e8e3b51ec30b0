// kvq: the logic of the CUDA cache, independent of the CUDA runtime.
//
// `cuda_cache_core<Choice, Runtime>` is everything QuantizedKVCache<Choice, kvq::cuda>
// (cuda_cache.cuh) does on the host: argument checks (strong guarantee), the layer bookkeeping
// (token counts, KIVI residual and window positions), the launch plans (which kernel, arguments,
// thread counts) and the attention split plan. It reaches the GPU only through `Runtime`:
//
//   using stream_type = ...;
//   auto allocate(void** p, std::size_t bytes) -> device_status;        // zero-filled
//   void deallocate(void* p) noexcept;
//   auto sm_count() const -> int;  auto smem_per_block() const -> std::size_t;
//   auto copy_2d(void* dst, std::size_t dpitch, void const* src, std::size_t spitch, std::size_t width,
//                std::size_t height, stream_type) -> device_status;   // device to device
//   auto zero(void* p, std::size_t bytes, stream_type) -> device_status;
//   template <int C> auto encode_rows(kvq_cuda::write_args const&, long long threads, stream_type) -> device_status;
//   template <int C> auto encode_key_tiles(...same...) -> device_status;
//   auto store_f16_rows(...same...) -> device_status;
//   template <int C> auto decode(kvq_cuda::decode_args const&, long long threads, stream_type) -> device_status;
//   template <int KC, int VC> auto attention(kvq_cuda::attention_args const&, unsigned gx, unsigned gy,
//                unsigned gz, int threads, std::size_t smem_bytes, stream_type) -> device_status;
//   auto combine(kvq_cuda::combine_args const&, long long threads, stream_type) -> device_status;
//   auto synchronize(stream_type) -> device_status;
//
// The CUDA runtime implements it with cudaMalloc and kernel launches (cuda_cache.cuh); the host
// test implements it by running the kernel bodies of cuda_device.h on the CPU, so this file and
// those bodies are tested without a GPU.
//
// Storage: one allocation per layer, laid out exactly as the CPU cache's layer (cache.hpp), so
// bytes, memory accounting and `plan_memory` are the CPU cache's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../../attention.hpp"
#include "../../cache.hpp"
#include "../../codec/fp8.hpp"
#include "../../codec/int8.hpp"
#include "../../codec/kivi.hpp"
#include "../../codec/passthrough.hpp"
#include "../../codec/q4_0.hpp"
#include "../../codec/q8_0.hpp"
#include "../../detail/host_vector.hpp"
#include "../../error.hpp"
#include "../backend.hpp"
#include "cuda_device.h"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// The CUDA codec id of a kvq codec; undefined for codecs without CUDA kernels.
template <class C>
struct cuda_codec_id;
template <>
struct cuda_codec_id<f32_codec> : std::integral_constant<int, kvq_cuda::codec_f32> {};
template <>
struct cuda_codec_id<f16_codec> : std::integral_constant<int, kvq_cuda::codec_f16> {};
template <>
struct cuda_codec_id<q8_0> : std::integral_constant<int, kvq_cuda::codec_q8_0> {};
template <>
struct cuda_codec_id<q4_0> : std::integral_constant<int, kvq_cuda::codec_q4_0> {};
template <>
struct cuda_codec_id<int8_sym> : std::integral_constant<int, kvq_cuda::codec_int8> {};
template <>
struct cuda_codec_id<fp8_e4m3> : std::integral_constant<int, kvq_cuda::codec_fp8_e4m3> {};
template <>
struct cuda_codec_id<fp8_e5m2> : std::integral_constant<int, kvq_cuda::codec_fp8_e5m2> {};
template <int B, int G>
struct cuda_codec_id<::kvq::kivi_value<B, G>> : std::integral_constant<int, B == 2   ? kvq_cuda::codec_kivi_value2
                                                                            : B == 4 ? kvq_cuda::codec_kivi_value4
                                                                                     : kvq_cuda::codec_kivi_value8> {};
template <int B, int G>
struct cuda_codec_id<::kvq::kivi_key<B, G>> : std::integral_constant<int, B == 2   ? kvq_cuda::codec_kivi_key2
                                                                          : B == 4 ? kvq_cuda::codec_kivi_key4
                                                                                   : kvq_cuda::codec_kivi_key8> {};

/// A codec with CUDA kernels.
template <class C>
concept cuda_codec = requires {
  cuda_codec_id<C>::value;
};

}  // namespace detail

/// Codecs with CUDA kernels are implemented on the CUDA backend.
template <detail::cuda_codec C>
struct implements<C, cuda> : std::true_type {};

/// The outcome of one CUDA runtime call: ok, or the failing call's name and the runtime's message.
struct device_status {
  char const* call = nullptr;  ///< nullptr when the call succeeded
  char const* text = "";       ///< the runtime's error string
  constexpr auto ok() const noexcept -> bool { return call == nullptr; }
};

namespace detail {

/// The CUDA element type id of an input/output element type.
template <element T>
constexpr auto cuda_elem_id() -> int {
  if constexpr (std::is_same_v<T, float>) {
    return kvq_cuda::elem_f32;
  } else if constexpr (std::is_same_v<T, f16>) {
    return kvq_cuda::elem_f16;
  } else {
    return kvq_cuda::elem_bf16;
  }
}

/// Per-layer bookkeeping of the CUDA cache; every kv_head advances identically (as on the CPU).
struct cuda_state {
  std::int64_t length = 0;           ///< tokens in the layer
  std::int64_t key_quantized = 0;    ///< KIVI keys: tokens in tiles (a multiple of G)
  std::int64_t value_quantized = 0;  ///< KIVI values: tokens in encoded rows
  std::int64_t window_tokens = 0;    ///< KIVI values: tokens in the f16 window
  std::int64_t window_first = 0;     ///< KIVI values: ring row of the oldest window token
  friend constexpr bool operator==(cuda_state const&, cuda_state const&) = default;
};

/// The static description of the keys or the values of a layer: region geometry and codec.
struct cuda_side {
  kvq_cuda::region region{};  ///< `quantized` and `residual_first` are set per operation
  int codec = 0;              ///< kvq_cuda::codec_id
  int blocks = 1;             ///< blocks per encoded row (row codecs)
  bool tiles = false;         ///< KIVI keys: encoded per tile of G tokens from an f16 residual
  bool window = false;        ///< KIVI values with R > 0: an f16 window of the last R tokens
  bool kivi_value = false;    ///< KIVI values (quantized count tracked separately from the length)
  std::int64_t residual = 0;  ///< rows of the f16 residual (tiles: F; window: R; else 0)
};

/// Describes codec C used as keys (IsValue false) or values in a layer of `shape`, whose regions
/// start at byte `head0` and are `head_stride` bytes apart: the CPU cache's storage layout.
template <cuda_codec C, bool IsValue>
inline auto make_cuda_side(cache_shape const& shape, int residual, typename C::params_type const& params,
                           std::size_t head0, std::size_t head_stride) -> cuda_side {
  auto const layout = region_layout<C, IsValue>::make(shape, residual);
  auto const g = C::geometry(shape.head_dim);
  cuda_side s;
  s.codec = cuda_codec_id<C>::value;
  s.blocks = g.blocks;
  s.tiles = C::layout == codec_layout::token_group;
  s.kivi_value = IsValue && has_value_window<C>::value;
  s.window = s.kivi_value && residual > 0;
  s.residual = layout.residual_rows;
  s.region.head0 = static_cast<long long>(head0);
  s.region.head_stride = static_cast<long long>(head_stride);
  s.region.residual_offset = static_cast<long long>(layout.units_bytes);
  s.region.unit_bytes = static_cast<long long>(g.bytes());
  if constexpr (requires { C::group; }) s.region.group = C::group;
  s.region.residual_rows = static_cast<int>(std::max<std::int64_t>(layout.residual_rows, 1));
  s.region.fp8_scale = 1.0f;
  s.region.fp8_saturate = 1;
  if constexpr (std::is_same_v<typename C::params_type, fp8_params>) {
    s.region.fp8_scale = params.scale;
    s.region.fp8_saturate = params.overflow == fp8_overflow::saturate ? 1 : 0;
  } else {
    (void)params;
  }
  return s;
}

/// The key side's region as of state `st`.
inline auto cuda_key_region(cuda_side const& k, cuda_state const& st) -> kvq_cuda::region {
  kvq_cuda::region r = k.region;
  r.quantized = static_cast<int>(k.tiles ? st.key_quantized : st.length);
  r.residual_first = 0;
  return r;
}

/// The value side's region as of state `st`.
inline auto cuda_value_region(cuda_side const& v, cuda_state const& st) -> kvq_cuda::region {
  kvq_cuda::region r = v.region;
  r.quantized = static_cast<int>(v.kivi_value ? st.value_quantized : st.length);
  r.residual_first = static_cast<int>(v.window ? st.window_first : 0);
  return r;
}

/// The write kernels.
enum class cuda_write_kernel { encode_rows, encode_key_tiles, store_f16_rows };

/// One kernel launch of an append: kernel, arguments (pointers filled by the caller) and threads.
struct cuda_write_step {
  cuda_write_kernel kernel = cuda_write_kernel::encode_rows;
  bool values = false;  ///< the input is the values tensor (else the keys tensor)
  kvq_cuda::write_args args{};
  long long threads = 0;
};

/// The launches of one append, in order, and the layer state after them.
struct cuda_append_plan {
  cuda_write_step steps[4];
  int count = 0;
  cuda_state next;
};

/// An input tensor as the kernels see it (`first` and the residual fields are filled by the planner).
inline auto cuda_source(void const* data, int type, std::int64_t token_stride, std::int64_t head_stride)
    -> kvq_cuda::source {
  kvq_cuda::source s{};
  s.data = data;
  s.token_stride = token_stride;
  s.head_stride = head_stride;
  s.type = type;
  return s;
}

/// Plans the append of n tokens (keys `ks`, values `vs`) to a layer in state `st`, reproducing the
/// CPU cache: row codecs encode every token; KIVI keys go through the f16 residual of F rows,
/// flushed as F/G tiles from the stored f16 values when it fills; KIVI values go through the f16
/// window of the last R tokens, the tokens leaving it being encoded from their f16 values (R = 0:
/// at once, from the f16-rounded input).
inline auto plan_cuda_append(cuda_side const& k, cuda_side const& v, int head_dim, int kv_heads, cuda_state const& st,
                             std::int64_t n, kvq_cuda::source ks, kvq_cuda::source vs) -> cuda_append_plan {
  cuda_append_plan plan;
  plan.next = st;
  auto add = [&](cuda_write_kernel kernel, bool values, kvq_cuda::region const& dst, kvq_cuda::source const& src,
                 std::int64_t count, std::int64_t first, int blocks) {
    cuda_write_step& s = plan.steps[plan.count++];
    s.kernel = kernel;
    s.values = values;
    s.args.dst = dst;
    s.args.src = src;
    s.args.head_dim = head_dim;
    s.args.kv_heads = kv_heads;
    s.args.count = static_cast<int>(count);
    s.args.first = static_cast<int>(first);
    s.args.blocks = blocks;
    std::int64_t const per_head = kernel == cuda_write_kernel::encode_rows        ? count * blocks
                                  : kernel == cuda_write_kernel::encode_key_tiles ? count / dst.group * head_dim
                                                                                  : count * head_dim;
    s.threads = per_head * kv_heads;
  };
  if (n <= 0) return plan;

  // Keys.
  kvq_cuda::region const kr = cuda_key_region(k, st);
  if (k.tiles) {
    std::int64_t const f = k.residual;
    std::int64_t const g = k.region.group;
    std::int64_t const r = st.length - st.key_quantized;  // rows in the residual (< F)
    std::int64_t const flushes = (r + n) / f;
    std::int64_t const left = r + n - flushes * f;  // rows in the residual afterwards
    if (flushes > 0) {
      kvq_cuda::source src = ks;
      src.from_residual = static_cast<int>(r);
      src.residual_first = 0;
      src.first = 0;
      src.round_f16 = 1;
      add(cuda_write_kernel::encode_key_tiles, false, kr, src, flushes * f, st.key_quantized / g, 1);
      plan.next.key_quantized = st.key_quantized + flushes * f;
    }
    std::int64_t const stored = flushes > 0 ? left : n;  // new tokens that stay in the residual
    if (stored > 0) {
      kvq_cuda::source src = ks;
      src.first = static_cast<int>(n - stored);
      add(cuda_write_kernel::store_f16_rows, false, kr, src, stored, flushes > 0 ? 0 : r, 1);
    }
  } else {
    add(cuda_write_kernel::encode_rows, false, kr, ks, n, st.length, k.blocks);
  }

  // Values.
  kvq_cuda::region const vr = cuda_value_region(v, st);
  if (v.window) {
    std::int64_t const rr = v.residual;
    std::int64_t const out = std::max<std::int64_t>(0, st.window_tokens + n - rr);  // tokens leaving the window
    if (out > 0) {
      kvq_cuda::source src = vs;
      src.from_residual = static_cast<int>(std::min(out, st.window_tokens));
      src.residual_first = static_cast<int>(st.window_first);
      src.first = 0;
      src.round_f16 = 1;
      add(cuda_write_kernel::encode_rows, true, vr, src, out, st.value_quantized, v.blocks);
    }
    std::int64_t const kept = std::min(n, st.window_tokens + n - out);  // new tokens in the window
    if (kept > 0) {
      kvq_cuda::source src = vs;
      src.first = static_cast<int>(n - kept);
      // The ring row of token t is (window_first + t - value_quantized) % R; the first kept token
      // is t = length + n - kept.
      std::int64_t const row = (st.window_first + st.window_tokens + n - kept) % rr;
      add(cuda_write_kernel::store_f16_rows, true, vr, src, kept, row, 1);
    }
    plan.next.value_quantized = st.value_quantized + out;
    plan.next.window_first = (st.window_first + out) % rr;
    plan.next.window_tokens = st.window_tokens + n - out;
  } else {
    kvq_cuda::source src = vs;
    src.round_f16 = v.kivi_value ? 1 : 0;  // KIVI values with R = 0: quantized from the f16-rounded input
    add(cuda_write_kernel::encode_rows, true, vr, src, n, v.kivi_value ? st.value_quantized : st.length, v.blocks);
    if (v.kivi_value) plan.next.value_quantized = st.value_quantized + n;
  }
  plan.next.length = st.length + n;
  return plan;
}

/// What truncate(n) does to a layer: the new state and, when n cuts into a quantized KIVI key tile,
/// the tokens [untile_first, untile_first + untile_count) of that tile to decode back into the f16
/// residual rows [0, untile_count) (lossy, as on the CPU).
struct cuda_truncate_plan {
  cuda_state next;
  std::int64_t untile_first = 0;
  std::int64_t untile_count = 0;
};

/// Plans truncate(n) of a layer in state `st` (a layer holding n or fewer tokens is unchanged).
inline auto plan_cuda_truncate(cuda_side const& k, cuda_side const& v, cuda_state const& st, std::int64_t n)
    -> cuda_truncate_plan {
  cuda_truncate_plan p;
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
struct cuda_move {
  std::size_t src = 0;
  std::size_t dst = 0;
  std::size_t bytes = 0;
};

/// The moves of shift_left(n) inside each kv_head's key and value regions, and the new state.
struct cuda_shift_plan {
  cuda_move key[2];
  int key_count = 0;
  cuda_move value;
  cuda_state next;
};

/// Plans shift_left(n) of a non-empty layer in state `st`. Requires n <= st.length (and n % G == 0
/// for KIVI keys).
inline auto plan_cuda_shift(cuda_side const& k, cuda_side const& v, int head_dim, cuda_state const& st, std::int64_t n)
    -> cuda_shift_plan {
  cuda_shift_plan p;
  p.next = st;
  std::size_t const kb = static_cast<std::size_t>(k.region.unit_bytes);
  std::size_t const vb = static_cast<std::size_t>(v.region.unit_bytes);
  if (k.tiles) {
    std::int64_t const g = k.region.group;
    std::int64_t const drop_tiles = std::min(n, st.key_quantized) / g;
    std::int64_t const keep_tiles = st.key_quantized / g - drop_tiles;
    p.key[p.key_count++] = {static_cast<std::size_t>(drop_tiles) * kb, 0, static_cast<std::size_t>(keep_tiles) * kb};
    if (n > st.key_quantized) {
      std::int64_t const drop = n - st.key_quantized;
      std::int64_t const keep = st.length - st.key_quantized - drop;
      std::size_t const row = static_cast<std::size_t>(head_dim) * 2;
      std::size_t const res = static_cast<std::size_t>(k.region.residual_offset);
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

/// The launch geometry of one decode attention (flash decoding): the attention kernel over blocks
/// (splits, kv_heads * chunks, batch) of `threads` threads with `smem_bytes` of dynamic shared
/// memory, then the combine kernel. Partial states take batch * splits * q_heads * (head_dim + 2)
/// floats of scratch.
struct cuda_attention_plan {
  int tile = 32;
  int heads = 1;   ///< query heads per block
  int chunks = 1;  ///< blocks per kv_head along its query heads
  int threads = 128;
  std::int64_t split_tokens = 0;
  int splits = 0;  ///< 0: nothing is attended, the output is zeros
  std::size_t smem_bytes = 0;
  std::size_t scratch_floats = 0;
};

/// Plans decode attention of `batch` sequences of `q_heads` query heads whose longest attended
/// range is `span` tokens. The tile (<= 32 tokens) and the heads per block are the largest that fit
/// `smem_limit` bytes; the context is split so that about 4 blocks per SM run (`sm_count`), but at
/// least 256 tokens per split; `split_tokens` > 0 forces the tokens per split (rounded up to a
/// multiple of the tile). Returns false when nothing fits in `smem_limit`.
inline auto plan_cuda_attention(int head_dim, int kv_heads, int q_heads, int batch, std::int64_t span, bool query_q8_0,
                                int sm_count, std::size_t smem_limit, int threads, std::int64_t split_tokens,
                                cuda_attention_plan& plan) -> bool {
  plan = cuda_attention_plan{};
  int const group = q_heads / kv_heads;
  int const q8 = query_q8_0 ? 1 : 0;
  auto bytes = [&](int t, int h) {
    return static_cast<std::size_t>(kvq_cuda::attention_smem_layout(head_dim, t, h, q8).total) * 4;
  };
  int tile = 32;
  int heads = group;
  while (heads > 1 && bytes(tile, heads) > smem_limit) heads = (heads + 1) / 2;
  while (tile > 1 && bytes(tile, heads) > smem_limit) tile /= 2;
  if (bytes(tile, heads) > smem_limit) return false;
  plan.tile = tile;
  plan.heads = heads;
  plan.chunks = (group + heads - 1) / heads;
  plan.threads = threads;
  plan.smem_bytes = bytes(tile, heads);
  span = std::max<std::int64_t>(span, 0);
  std::int64_t split = split_tokens;
  if (split <= 0) {
    std::int64_t const blocks = static_cast<std::int64_t>(kv_heads) * plan.chunks * batch;
    std::int64_t const want =
        std::max<std::int64_t>(1, (4 * static_cast<std::int64_t>(std::max(sm_count, 1)) + blocks - 1) / blocks);
    split = std::max<std::int64_t>(256, (span + want - 1) / want);
  }
  split = (split + tile - 1) / tile * tile;
  plan.split_tokens = split;
  plan.splits = span == 0 ? 0 : static_cast<int>((span + split - 1) / split);
  plan.scratch_floats = static_cast<std::size_t>(batch) * static_cast<std::size_t>(plan.splits) *
                        static_cast<std::size_t>(q_heads) * (static_cast<std::size_t>(head_dim) + 2);
  return true;
}

/// Raises shape_error unless `x` (kv_heads, head_dim, tokens, strides) fits a cache of `shape`
/// (the CPU cache's checks and messages).
template <element T>
inline void check_cuda_tensor(kv_tensor<T> const& x, cache_shape const& shape, char const* what) {
  std::string const w = std::string("append: ") + what;
  check<shape_error>(x.kv_heads == shape.kv_heads && x.head_dim == shape.head_dim,
                     w + " have shape (" + std::to_string(x.kv_heads) + " heads, " + std::to_string(x.head_dim) +
                         " dims); the cache has (" + std::to_string(shape.kv_heads) + ", " +
                         std::to_string(shape.head_dim) + ")");
  check<shape_error>(x.tokens >= 0, w + " token count " + std::to_string(x.tokens) + " is negative");
  check<shape_error>(x.tokens == 0 || x.data != nullptr, w + " data is null");
  check_tensor_strides(x.tokens, x.kv_heads, x.head_dim, x.token_stride, x.head_stride, sizeof(T), what);
}

}  // namespace detail

/// Device scratch memory of the attention and of shift_left, grown on demand (growing frees the
/// old buffer, which waits for the device; reserve the largest size once to keep the hot path
/// free of it).
template <class Runtime>
class basic_cuda_workspace {
 public:
  explicit basic_cuda_workspace(Runtime const& rt) : rt_(rt) {}
  basic_cuda_workspace(basic_cuda_workspace const&) = delete;
  basic_cuda_workspace& operator=(basic_cuda_workspace const&) = delete;
  ~basic_cuda_workspace() {
    if (data_ != nullptr) rt_.deallocate(data_);
  }

  /// Makes the scratch at least `bytes` long; raises device_error when the allocation fails.
  void reserve(std::size_t bytes) {
    if (bytes <= bytes_) return;
    if (data_ != nullptr) rt_.deallocate(data_);
    data_ = nullptr;
    bytes_ = 0;
    void* p = nullptr;
    device_status const st = rt_.allocate(&p, bytes);
    if (!st.ok())
      detail::raise<device_error>(std::string("CUDA: ") + st.call + " of " + std::to_string(bytes) +
                                  " bytes of scratch failed: " + st.text);
    data_ = p;
    bytes_ = bytes;
  }
  auto data() const noexcept -> void* { return data_; }
  auto bytes() const noexcept -> std::size_t { return bytes_; }
  auto runtime() const noexcept -> Runtime const& { return rt_; }

 private:
  Runtime rt_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

template <codec_choice Choice, class Runtime>
class cuda_cache_core;

namespace detail {
template <codec_choice Choice, class Runtime>
void cuda_attention_batch(std::span<cuda_cache_core<Choice, Runtime>* const> caches, int layer, float const* q,
                          int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                          typename Runtime::stream_type stream);
}  // namespace detail

/// The host logic of the CUDA cache over a runtime (see the file comment); QuantizedKVCache<Choice,
/// kvq::cuda> is this over the CUDA runtime.
template <codec_choice Choice, class Runtime>
class cuda_cache_core {
 public:
  using key_codec = typename codec_pair<Choice>::key;
  using value_codec = typename codec_pair<Choice>::value;
  using key_params = typename key_codec::params_type;
  using value_params = typename value_codec::params_type;
  using stream_type = typename Runtime::stream_type;
  static_assert(require_implemented<key_codec, cuda>());
  static_assert(require_implemented<value_codec, cuda>());
  static_assert(value_codec::layout == codec_layout::row,
                "kvq: value codecs must be row codecs (values are quantized per token)");
  static constexpr int key_id = detail::cuda_codec_id<key_codec>::value;
  static constexpr int value_id = detail::cuda_codec_id<value_codec>::value;

  /// Run-time options of a CUDA cache (the CPU cache's, without the allocator hook).
  struct options {
    int residual = 128;             ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    key_params key{};               ///< run-time parameters of the key codec (e.g. fp8 scale)
    value_params value{};           ///< run-time parameters of the value codec
    int threads = 128;              ///< threads per block of the attention kernel (a multiple of 32, <= 256)
    std::int64_t split_tokens = 0;  ///< > 0: tokens per split of the attention (else planned per call)
  };

  /// Allocates a zero-filled cache of `shape`. Raises invalid_argument_error on a bad shape or
  /// option (the CPU cache's checks, plus capacity < 2^31 tokens and a head_dim whose attention
  /// fits the shared memory of a block), device_error when an allocation fails.
  cuda_cache_core(cache_shape const& shape, options const& opt, Runtime rt)
      : rt_(std::move(rt)), shape_(validated(shape, opt)), opt_(opt), workspace_(rt_) {
    auto const kl = detail::region_layout<key_codec, false>::make(shape_, opt.residual);
    auto const vl = detail::region_layout<value_codec, true>::make(shape_, opt.residual);
    std::size_t const kv = static_cast<std::size_t>(shape_.kv_heads);
    key_ = detail::make_cuda_side<key_codec, false>(shape_, opt.residual, opt.key, 0, kl.bytes());
    value_ = detail::make_cuda_side<value_codec, true>(shape_, opt.residual, opt.value, kv * kl.bytes(), vl.bytes());
    layer_bytes_ = kv * (kl.bytes() + vl.bytes());
    detail::cuda_attention_plan probe;
    detail::check<invalid_argument_error>(
        detail::plan_cuda_attention(shape_.head_dim, shape_.kv_heads, shape_.kv_heads, 1, 0, true, rt_.sm_count(),
                                    rt_.smem_per_block(), opt.threads, 0, probe),
        "CUDA cache: head_dim = " + std::to_string(shape_.head_dim) + " needs more shared memory than the " +
            std::to_string(rt_.smem_per_block()) + " bytes of a block");
    layers_.reserve(static_cast<std::size_t>(shape_.layers));
    for (int l = 0; l < shape_.layers; ++l) {
      void* p = nullptr;
      device_status const st = rt_.allocate(&p, std::max<std::size_t>(layer_bytes_, storage_alignment));
      if (!st.ok()) {
        for (auto* b : layers_) rt_.deallocate(b);
        layers_.clear();
        detail::raise<device_error>(std::string("CUDA cache: ") + st.call + " of " + std::to_string(layer_bytes_) +
                                    " bytes for layer " + std::to_string(l) + " failed: " + st.text);
      }
      layers_.push_back(static_cast<unsigned char*>(p));
    }
    state_.assign(static_cast<std::size_t>(shape_.layers), detail::cuda_state{});
  }

  cuda_cache_core(cuda_cache_core const&) = delete;
  cuda_cache_core& operator=(cuda_cache_core const&) = delete;
  ~cuda_cache_core() {
    for (auto* b : layers_) rt_.deallocate(b);
  }

  /// The cache's shape.
  auto shape() const noexcept -> cache_shape const& { return shape_; }
  /// The cache's options.
  auto get_options() const noexcept -> options const& { return opt_; }
  /// Tokens currently held by `layer` (as of the calls made so far; the device may still be busy).
  auto size(int layer) const -> std::int64_t { return state_at(layer).length; }
  /// Memory use: the CPU cache's accounting (same layout; the attention scratch is not counted).
  auto memory() const noexcept -> memory_report { return plan_memory<Choice>(shape_, opt_.residual); }
  /// False once a CUDA call failed: every later call then raises device_error.
  auto usable() const noexcept -> bool { return failure_.empty(); }
  /// The runtime.
  auto runtime() const noexcept -> Runtime const& { return rt_; }

  /// Device pointer to `layer`'s allocation (the CPU cache's layer layout, see cache.hpp).
  auto layer_data(int layer) const -> std::byte const* {
    state_at(layer);
    return reinterpret_cast<std::byte const*>(layers_[static_cast<std::size_t>(layer)]);
  }
  /// Bytes of one layer's allocation.
  auto layer_bytes() const noexcept -> std::size_t { return layer_bytes_; }

  /// Non-owning view of the key storage of (layer, head); the pointers are device pointers.
  auto key_storage(int layer, int head) const -> storage_view {
    auto const& st = state_at(layer);
    check_head(head);
    storage_view v;
    kvq_cuda::region const r = detail::cuda_key_region(key_, st);
    v.units = layer_data(layer) + r.head0 + static_cast<std::int64_t>(head) * r.head_stride;
    v.unit_bytes = static_cast<std::size_t>(r.unit_bytes);
    v.quantized_tokens = r.quantized;
    if (key_.tiles) {
      v.tokens_per_unit = r.group;
      v.residual = reinterpret_cast<f16 const*>(v.units + r.residual_offset);
      v.residual_tokens = st.length - st.key_quantized;
      v.residual_capacity = key_.residual;
    }
    return v;
  }
  /// Non-owning view of the value storage of (layer, head); the pointers are device pointers.
  auto value_storage(int layer, int head) const -> storage_view {
    auto const& st = state_at(layer);
    check_head(head);
    storage_view v;
    kvq_cuda::region const r = detail::cuda_value_region(value_, st);
    v.units = layer_data(layer) + r.head0 + static_cast<std::int64_t>(head) * r.head_stride;
    v.unit_bytes = static_cast<std::size_t>(r.unit_bytes);
    v.quantized_tokens = r.quantized;
    if (value_.kivi_value) {
      v.residual = reinterpret_cast<f16 const*>(v.units + r.residual_offset);
      v.residual_tokens = st.window_tokens;
      v.residual_capacity = value_.residual;
      v.residual_first = st.window_first;
    }
    return v;
  }

  /// Appends `keys` and `values` (same token count; device pointers, f32/f16/bf16) to `layer`,
  /// on `stream`; returns without waiting.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values, stream_type stream) {
    check_usable();
    auto& st = state_at(layer);
    detail::check_cuda_tensor(keys, shape_, "keys");
    detail::check_cuda_tensor(values, shape_, "values");
    detail::check<shape_error>(keys.tokens == values.tokens, "append: keys have " + std::to_string(keys.tokens) +
                                                                 " tokens but values have " +
                                                                 std::to_string(values.tokens));
    std::int64_t const n = keys.tokens;
    detail::check<capacity_error>(n <= shape_.capacity - st.length,
                                  "append: layer " + std::to_string(layer) + " holds " + std::to_string(st.length) +
                                      " tokens; appending " + std::to_string(n) + " exceeds the capacity of " +
                                      std::to_string(shape_.capacity));
    if (n == 0) return;
    int const type = detail::cuda_elem_id<T>();
    auto plan =
        detail::plan_cuda_append(key_, value_, shape_.head_dim, shape_.kv_heads, st, n,
                                 detail::cuda_source(keys.data, type, keys.token_stride, keys.head_stride),
                                 detail::cuda_source(values.data, type, values.token_stride, values.head_stride));
    for (int i = 0; i < plan.count; ++i) {
      auto& s = plan.steps[i];
      s.args.layer = layers_[static_cast<std::size_t>(layer)];
      if (s.values) {
        if (s.kernel == detail::cuda_write_kernel::encode_rows) {
          succeed(rt_.template encode_rows<value_id>(s.args, s.threads, stream));
        } else {
          succeed(rt_.store_f16_rows(s.args, s.threads, stream));
        }
      } else if (s.kernel == detail::cuda_write_kernel::encode_rows) {
        if constexpr (key_codec::layout == codec_layout::row)
          succeed(rt_.template encode_rows<key_id>(s.args, s.threads, stream));
      } else if (s.kernel == detail::cuda_write_kernel::encode_key_tiles) {
        if constexpr (key_codec::layout == codec_layout::token_group)
          succeed(rt_.template encode_key_tiles<key_id>(s.args, s.threads, stream));
      } else {
        succeed(rt_.store_f16_rows(s.args, s.threads, stream));
      }
    }
    st = plan.next;
  }

  /// Decodes keys [first, first + count) of (layer, head) into device memory `out`, rows
  /// `out_stride` elements apart (0: head_dim), on `stream`; returns without waiting.
  template <element T>
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride,
                 stream_type stream) {
    read_impl<true>(layer, head, first, count, out, out_stride, stream);
  }
  /// Decodes values [first, first + count) of (layer, head) into device memory (see read_keys).
  template <element T>
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride,
                   stream_type stream) {
    read_impl<false>(layer, head, first, count, out, out_stride, stream);
  }

  /// Keeps the first n tokens of every layer (speculative-decoding rollback); layers holding n or
  /// fewer tokens are unchanged. Cutting into a quantized KIVI key tile decodes its kept tokens
  /// back into the f16 residual on `stream` (lossy, as on the CPU).
  void truncate(std::int64_t n, stream_type stream) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0, "truncate: n = " + std::to_string(n) + " is negative");
    std::vector<detail::cuda_state> next = state_;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const p = detail::plan_cuda_truncate(key_, value_, state_[static_cast<std::size_t>(l)], n);
      if constexpr (key_codec::layout == codec_layout::token_group) {
        for (int h = 0; h < shape_.kv_heads && p.untile_count > 0; ++h) {
          kvq_cuda::decode_args a{};
          a.layer = layers_[static_cast<std::size_t>(l)];
          a.src = detail::cuda_key_region(key_, state_[static_cast<std::size_t>(l)]);
          a.out = layers_[static_cast<std::size_t>(l)] + key_.region.head0 +
                  static_cast<long long>(h) * key_.region.head_stride + key_.region.residual_offset;
          a.out_stride = shape_.head_dim;
          a.head_dim = shape_.head_dim;
          a.head = h;
          a.first = static_cast<int>(p.untile_first);
          a.count = static_cast<int>(p.untile_count);
          a.out_type = kvq_cuda::elem_f16_sat;  // the residual saturates, as on the CPU
          succeed(rt_.template decode<key_id>(a, static_cast<long long>(a.count) * a.head_dim, stream));
        }
      }
      next[static_cast<std::size_t>(l)] = p.next;
    }
    state_ = std::move(next);
  }

  /// Drops the oldest n tokens of every layer (sliding window) on `stream`. Raises index_error when
  /// a non-empty layer holds fewer than n tokens, unsupported_error for KIVI keys when n is not a
  /// multiple of G. The bytes move through the workspace (which may grow, see basic_cuda_workspace).
  void shift_left(std::int64_t n, stream_type stream) {
    check_usable();
    detail::check<invalid_argument_error>(n >= 0, "shift_left: n = " + std::to_string(n) + " is negative");
    if constexpr (key_codec::layout == codec_layout::token_group)
      detail::check<unsupported_error>(n % key_codec::group == 0, "shift_left: KIVI keys shift by multiples of G = " +
                                                                      std::to_string(key_codec::group) + ", not " +
                                                                      std::to_string(n));
    for (int l = 0; l < shape_.layers; ++l) {
      auto const len = state_[static_cast<std::size_t>(l)].length;
      detail::check<index_error>(len == 0 || n <= len, "shift_left: layer " + std::to_string(l) + " holds " +
                                                           std::to_string(len) + " tokens, cannot drop " +
                                                           std::to_string(n));
    }
    if (n == 0) return;
    std::size_t const kv = static_cast<std::size_t>(shape_.kv_heads);
    workspace_.reserve(shift_chunk * kv);
    for (int l = 0; l < shape_.layers; ++l) {
      auto& st = state_[static_cast<std::size_t>(l)];
      if (st.length == 0) continue;
      auto const p = detail::plan_cuda_shift(key_, value_, shape_.head_dim, st, n);
      unsigned char* base = layers_[static_cast<std::size_t>(l)];
      for (int i = 0; i < p.key_count; ++i)
        move(base + key_.region.head0, static_cast<std::size_t>(key_.region.head_stride), p.key[i], stream);
      move(base + value_.region.head0, static_cast<std::size_t>(value_.region.head_stride), p.value, stream);
      st = p.next;
    }
  }

  /// Empties every layer.
  void reset() noexcept {
    for (auto& st : state_) st = detail::cuda_state{};
  }

  /// Decode attention of the query q (q_heads, head_dim; device f32) over every token of `layer`
  /// into out (q_heads, head_dim; device f32), on `stream`; returns without waiting. Same options
  /// and NaN/Inf rules as kvq::decode_attention. Uses the cache's own workspace.
  void attention(int layer, float const* q, int q_heads, float* out, attention_options const& opt, stream_type stream) {
    cuda_cache_core* self = this;
    detail::cuda_attention_batch<Choice, Runtime>(std::span<cuda_cache_core* const>(&self, 1), layer, q, q_heads, out,
                                                  opt, workspace_, stream);
  }

  /// Waits for `stream` and reports any failure of the work queued so far as device_error; a
  /// failure marks the cache unusable.
  void synchronize(stream_type stream) {
    check_usable();
    succeed(rt_.synchronize(stream));
  }

  /// Raises device_error if the cache is unusable (a CUDA call failed earlier).
  void check_usable() const {
    detail::check<device_error>(failure_.empty(), "CUDA cache: unusable after an earlier failure: " + failure_);
  }

  /// The state of `layer`; raises index_error when out of range.
  auto state_at(int layer) const -> detail::cuda_state const& {
    detail::check<index_error>(
        layer >= 0 && layer < shape_.layers,
        "layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(shape_.layers) + ")");
    return state_[static_cast<std::size_t>(layer)];
  }
  auto key_side() const noexcept -> detail::cuda_side const& { return key_; }
  auto value_side() const noexcept -> detail::cuda_side const& { return value_; }
  auto layer_ptr(int layer) const -> unsigned char* { return layers_[static_cast<std::size_t>(layer)]; }

  /// Raises device_error naming the failed call (and marks the cache unusable) unless `s` is ok.
  void succeed(device_status const& s) {
    if (s.ok()) return;
    failure_ = std::string(s.call) + ": " + s.text;
    detail::raise<device_error>("CUDA cache: " + failure_);
  }

 private:
  static constexpr std::size_t shift_chunk = std::size_t{4} << 20;  // bytes per kv_head moved per step

  auto state_at(int layer) -> detail::cuda_state& {
    return const_cast<detail::cuda_state&>(static_cast<cuda_cache_core const&>(*this).state_at(layer));
  }

  void check_head(int head) const {
    detail::check<index_error>(
        head >= 0 && head < shape_.kv_heads,
        "kv_head " + std::to_string(head) + " is out of range [0, " + std::to_string(shape_.kv_heads) + ")");
  }

  static auto validated(cache_shape const& s, options const& o) -> cache_shape {
    using detail::check;
    // The CPU cache's checks (a throwaway plan_memory-sized validation), then the CUDA limits.
    check<invalid_argument_error>(s.layers > 0, "cache: layers = " + std::to_string(s.layers) + " must be > 0");
    check<invalid_argument_error>(s.kv_heads > 0, "cache: kv_heads = " + std::to_string(s.kv_heads) + " must be > 0");
    check<invalid_argument_error>(s.head_dim > 0 && s.head_dim <= 65536,
                                  "cache: head_dim = " + std::to_string(s.head_dim) + " must be in [1, 65536]");
    check<invalid_argument_error>(s.capacity > 0 && s.capacity < (std::int64_t{1} << 31),
                                  "CUDA cache: capacity = " + std::to_string(s.capacity) + " must be in [1, 2^31)");
    int g = 0;
    if constexpr (key_codec::layout == codec_layout::token_group) g = std::lcm(std::max(g, 1), key_codec::group);
    if constexpr (detail::has_value_window<value_codec>::value) g = std::lcm(std::max(g, 1), value_codec::group);
    check<invalid_argument_error>(g == 0 || (o.residual >= 0 && o.residual % g == 0),
                                  "cache: KIVI residual R = " + std::to_string(o.residual) +
                                      " must be a non-negative multiple of G = " + std::to_string(g));
    if constexpr (requires { fp8_params_valid(o.key); })
      check<invalid_argument_error>(
          fp8_params_valid(o.key),
          "cache: the key codec's fp8 scale = " + detail::format_float(o.key.scale) + " must be finite and > 0");
    if constexpr (requires { fp8_params_valid(o.value); })
      check<invalid_argument_error>(
          fp8_params_valid(o.value),
          "cache: the value codec's fp8 scale = " + detail::format_float(o.value.scale) + " must be finite and > 0");
    check<invalid_argument_error>(
        o.threads >= 32 && o.threads <= 256 && o.threads % 32 == 0,
        "CUDA cache: threads = " + std::to_string(o.threads) + " must be a multiple of 32 in [32, 256]");
    check<invalid_argument_error>(o.split_tokens >= 0,
                                  "CUDA cache: split_tokens = " + std::to_string(o.split_tokens) + " is negative");
    return s;
  }

  /// Moves m.bytes from m.src to m.dst (m.src >= m.dst) inside every kv_head's region, in chunks
  /// through the workspace, lowest first, so overlapping ranges move correctly.
  void move(unsigned char* region0, std::size_t head_stride, detail::cuda_move const& m, stream_type stream) {
    if (m.bytes == 0 || m.src == m.dst) return;
    auto* tmp = static_cast<unsigned char*>(workspace_.data());
    std::size_t const kv = static_cast<std::size_t>(shape_.kv_heads);
    for (std::size_t off = 0; off < m.bytes; off += shift_chunk) {
      std::size_t const w = std::min(shift_chunk, m.bytes - off);
      succeed(rt_.copy_2d(tmp, w, region0 + m.src + off, head_stride, w, kv, stream));
      succeed(rt_.copy_2d(region0 + m.dst + off, head_stride, tmp, w, w, kv, stream));
    }
  }

  template <bool Keys, element T>
  void read_impl(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride,
                 stream_type stream) {
    check_usable();
    auto const& st = state_at(layer);
    check_head(head);
    char const* what = Keys ? "read_keys" : "read_values";
    detail::check_read_range(what, layer, st.length, first, count);
    int const d = shape_.head_dim;
    std::int64_t const stride = detail::check_read_output(what, d, count, out, out_stride);
    if (count == 0) return;
    kvq_cuda::decode_args a{};
    a.layer = layers_[static_cast<std::size_t>(layer)];
    a.src = Keys ? detail::cuda_key_region(key_, st) : detail::cuda_value_region(value_, st);
    a.out = out;
    a.out_stride = stride;
    a.head_dim = d;
    a.head = head;
    a.first = static_cast<int>(first);
    a.count = static_cast<int>(count);
    a.out_type = detail::cuda_elem_id<T>();
    long long const threads = static_cast<long long>(count) * d;
    if constexpr (Keys) {
      succeed(rt_.template decode<key_id>(a, threads, stream));
    } else {
      succeed(rt_.template decode<value_id>(a, threads, stream));
    }
  }

  Runtime rt_;
  cache_shape shape_;
  options opt_;
  basic_cuda_workspace<Runtime> workspace_;
  detail::cuda_side key_;
  detail::cuda_side value_;
  std::size_t layer_bytes_ = 0;
  detail::vector<unsigned char*> layers_;
  std::vector<detail::cuda_state> state_;
  std::string failure_;
};

namespace detail {

/// Decode attention of `caches` (same shape and options) over `layer`, one query token each:
/// q and out (caches.size(), q_heads, head_dim) f32 on the device. Checks everything first (no
/// cache changes either way), then launches the attention and combine kernels once per 64
/// sequences.
template <codec_choice Choice, class Runtime>
void cuda_attention_batch(std::span<cuda_cache_core<Choice, Runtime>* const> caches, int layer, float const* q,
                          int q_heads, float* out, attention_options const& opt, basic_cuda_workspace<Runtime>& ws,
                          typename Runtime::stream_type stream) {
  using core = cuda_cache_core<Choice, Runtime>;
  check<shape_error>(!caches.empty(), "attention: no cache");
  for (core const* c : caches) check<invalid_argument_error>(c != nullptr, "attention: a cache is null");
  core& c0 = *caches[0];
  for (core const* c : caches) c->check_usable();
  cache_shape const& shape = c0.shape();
  for (core const* c : caches) {
    check<shape_error>(c->shape() == shape && c->get_options().residual == c0.get_options().residual &&
                           c->get_options().key == c0.get_options().key &&
                           c->get_options().value == c0.get_options().value,
                       "attention: the caches of a batch must have the same shape and options");
    c->state_at(layer);
  }
  int const d = shape.head_dim;
  check<shape_error>(q_heads > 0 && q_heads % shape.kv_heads == 0, "attention: " + std::to_string(q_heads) +
                                                                       " query heads is not a positive multiple of " +
                                                                       std::to_string(shape.kv_heads) + " kv heads");
  check<shape_error>(q != nullptr && out != nullptr, "attention: the query or the output is null");
  check<invalid_argument_error>(detail::is_finite_f32(opt.scale) && opt.scale >= 0.0f &&
                                    detail::is_finite_f32(opt.softcap) && opt.softcap >= 0.0f && opt.window >= 0,
                                "attention: scale, softcap and window must be finite and non-negative");
  float const scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t span = 0;
  for (core const* c : caches) {
    std::int64_t const len = c->size(layer);
    std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
    span = std::max(span, len - begin);
  }
  std::size_t const batch = caches.size();
  int const launch_batch = static_cast<int>(std::min<std::size_t>(batch, kvq_cuda::max_batch));
  cuda_attention_plan plan;
  check<invalid_argument_error>(
      plan_cuda_attention(d, shape.kv_heads, q_heads, launch_batch, span, opt.query == query_precision::q8_0,
                          c0.runtime().sm_count(), c0.runtime().smem_per_block(), c0.get_options().threads,
                          c0.get_options().split_tokens, plan),
      "attention: the shared memory of a block is too small for head_dim " + std::to_string(d));
  std::size_t const qd = static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(d);
  if (plan.splits == 0) {  // nothing attended: zeros
    c0.succeed(c0.runtime().zero(out, batch * qd * sizeof(float), stream));
    return;
  }
  ws.reserve(plan.scratch_floats * sizeof(float));
  auto* scratch = static_cast<float*>(ws.data());
  std::size_t const per_launch = static_cast<std::size_t>(launch_batch) * static_cast<std::size_t>(plan.splits);

  kvq_cuda::attention_args a{};
  a.key = c0.key_side().region;
  a.value = c0.value_side().region;
  a.part_out = scratch;
  a.part_max = scratch + per_launch * qd;
  a.part_sum = a.part_max + per_launch * static_cast<std::size_t>(q_heads);
  a.head_dim = d;
  a.kv_heads = shape.kv_heads;
  a.q_heads = q_heads;
  a.split_tokens = static_cast<int>(plan.split_tokens);
  a.splits = plan.splits;
  a.tile = plan.tile;
  a.heads = plan.heads;
  a.chunks = plan.chunks;
  a.scale = scale;
  a.softcap = opt.softcap;
  a.query_q8_0 = opt.query == query_precision::q8_0 ? 1 : 0;
  a.probs_f16 = opt.probabilities == probability_precision::f16 ? 1 : 0;
  kvq_cuda::combine_args cb{};
  cb.part_out = a.part_out;
  cb.part_max = a.part_max;
  cb.part_sum = a.part_sum;
  cb.q_heads = q_heads;
  cb.head_dim = d;
  cb.splits = plan.splits;
  for (std::size_t b0 = 0; b0 < batch; b0 += kvq_cuda::max_batch) {
    int const nb = static_cast<int>(std::min<std::size_t>(batch - b0, kvq_cuda::max_batch));
    a.batch = nb;
    a.q = q + b0 * qd;
    for (int i = 0; i < nb; ++i) {
      core const& c = *caches[b0 + static_cast<std::size_t>(i)];
      cuda_state const& st = c.state_at(layer);
      std::int64_t const len = st.length;
      std::int64_t const begin = opt.window > 0 ? std::max<std::int64_t>(0, len - opt.window) : 0;
      kvq_cuda::attention_seq& s = a.seq[i];
      s.layer = c.layer_ptr(layer);
      s.key_quantized = cuda_key_region(c.key_side(), st).quantized;
      kvq_cuda::region const vr = cuda_value_region(c.value_side(), st);
      s.value_quantized = vr.quantized;
      s.value_residual_first = vr.residual_first;
      s.begin = static_cast<int>(begin);
      s.end = static_cast<int>(len);
    }
    cb.batch = nb;
    cb.out = out + b0 * qd;
    c0.succeed(c0.runtime().template attention<core::key_id, core::value_id>(
        a, static_cast<unsigned>(plan.splits), static_cast<unsigned>(shape.kv_heads * plan.chunks),
        static_cast<unsigned>(nb), plan.threads, plan.smem_bytes, stream));
    c0.succeed(c0.runtime().combine(cb, static_cast<long long>(nb) * static_cast<long long>(qd), stream));
  }
}

}  // namespace detail
KVQ_NAMESPACE_END
