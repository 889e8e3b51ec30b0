// kvq: QuantizedKVCache<Codec, Backend>, the quantized key/value cache of one sequence.
//
// Shape: layers × kv_heads × capacity tokens × head_dim. Keys and values are appended per layer
// from token-major input (tokens, kv_heads, head_dim) in f32, f16 or bf16, read back as any token
// range of a (layer, kv_head), truncated, shifted and reset. Every operation validates its
// arguments first and leaves the cache unchanged when it raises (strong guarantee).
//
// Storage layout (documented contract, reachable through `key_storage` / `value_storage`):
//   one allocation per layer, 64-byte aligned; inside it, for each kv_head h, the key region of h,
//   then for each kv_head h, the value region of h; every array below starts 64-byte aligned.
//   * row codec region:         rows[capacity][row_bytes]          row t = token t
//   * KIVI key region:          tiles[capacity / G][tile_bytes]    tile i = tokens [iG, iG + G)
//                               residual[F][head_dim] f16          F = R, or G when R = 0
//   * KIVI value region:        rows[capacity][row_bytes]          row t = token t (t < quantized)
//                               window[R][head_dim] f16            ring buffer of the last R tokens
//
// KIVI residual semantics (FORMATS.md §4.3, R a multiple of G, R = 0 allowed):
//   * keys: tokens enter an f16 residual; when it holds F tokens they are quantized as F/G groups
//     from the stored f16 values and the residual is emptied (at the append that fills it);
//   * values: tokens enter an f16 sliding window of the last R tokens; the oldest token leaving it
//     is quantized per token from its stored f16 value (R = 0: quantized at once, from the f16-rounded
//     input), so the bytes never depend on how appends are chunked.
//   * truncate(n) cutting into a quantized key group dequantizes that group back into the residual
//     (lossy: the tokens keep their quantization error); values already quantized stay quantized and
//     the window refills with new tokens.
//   * f16 range: every value stored in the residual or window (and every R = 0 value) is rounded
//     to f16 saturating: finite values beyond ±65504 become ±65504 (as the KIVI codec clips its
//     parameters), never ±Inf. NaN and ±Inf inputs are kept, and poison their quantized group
//     (it decodes to NaN: the key channel's G tokens, or the value row's group of channels).
//
// Non-finite scales: q8_0 and q4_0 store ggml's fp16 scale, which overflows to Inf for finite
// blocks with amax above ~8.3e6 (q8_0) or |max| above ~5.2e5 (q4_0); such blocks decode to ±Inf
// and NaN (ggml's bytes, kept). NaN/Inf inputs poison the blocks of every scaled codec.
// `nonfinite_blocks()` counts the stored blocks whose scale is not finite (a debug check).
//
// Threads: const member functions (reads, views, attention) may run concurrently; `append` on
// different layers may run concurrently; anything else needs external synchronisation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "backend/backend.hpp"
#include "backend/cpu/cpu_device.hpp"
#include "backend/cpu/kernels.hpp"
#include "codec/centered.hpp"
#include "codec/codec.hpp"
#include "codec/fp4.hpp"
#include "codec/tq.hpp"
#include "core/cache_core.hpp"
#include "core/cache_types.hpp"
#include "detail/host_vector.hpp"
#include "error.hpp"
#include "memory_resource.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Stored scales of one encoded unit (row or tile) of codec C that are NaN or ±Inf: q8_0 / q4_0
/// blocks, the int8 row scale, KIVI groups (value blocks, key channels), mxfp4 blocks, nvfp4
/// sub-blocks (their NaN scale bytes) and tq rotation blocks. A unit decodes to NaN or
/// ±Inf exactly where its scale is not finite. Codecs without scales (f32, f16, fp8) have none.
template <class Codec>
inline auto nonfinite_scales(std::uint8_t const* unit, int head_dim) -> std::int64_t {
  using C = stored_codec_t<Codec>;  // a rotated codec's scales are its stored codec's
  std::int64_t n = 0;
  if constexpr (std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0> || has_value_window<C>::value) {
    auto const g = C::geometry(head_dim);
    for (int b = 0; b < g.blocks; ++b) {
      std::uint8_t const* p = unit + static_cast<std::size_t>(b) * g.block_bytes;
      auto const bits = static_cast<u16>(p[0] | (static_cast<unsigned>(p[1]) << 8));  // fp16 d / scale, little-endian
      n += (bits & 0x7c00u) == 0x7c00u ? 1 : 0;
    }
  } else if constexpr (std::is_same_v<C, mxfp4>) {
    auto const g = C::geometry(head_dim);
    for (int b = 0; b < g.blocks; ++b)
      n += unit[static_cast<std::size_t>(b) * g.block_bytes] == mxfp4_poisoned_scale ? 1 : 0;
  } else if constexpr (std::is_same_v<C, nvfp4>) {
    auto const g = C::geometry(head_dim);
    for (int b = 0; b < g.blocks; ++b)
      for (int s = 0; s < 4; ++s)
        n += unit[static_cast<std::size_t>(b) * g.block_bytes + static_cast<std::size_t>(s)] == nvfp4_poisoned_scale
                 ? 1
                 : 0;
  } else if constexpr (requires { C::scale(unit, 0); }) {  // tq codebooks: one f16 scale per rotation block
    for (int b = 0; b < rotation_block_count(head_dim); ++b) n += is_finite_f32(C::scale(unit, b)) ? 0 : 1;
  } else if constexpr (std::is_same_v<C, int8_sym>) {
    float scale;
    std::memcpy(&scale, unit, sizeof scale);
    n += std::isfinite(scale) ? 0 : 1;
  } else if constexpr (C::layout == codec_layout::token_group) {
    for (int c = 0; c < head_dim; ++c) n += std::isfinite(C::group_params(unit, head_dim, c).scale) ? 0 : 1;
  } else {
    (void)unit;
    (void)head_dim;
  }
  return n;
}

}  // namespace detail

/// Sizes a cache without allocating: the memory report a cache of this shape would have. Raises
/// what the constructor would raise for this shape and residual (invalid_argument_error: a
/// non-positive size, a KIVI residual that is not a non-negative multiple of G, a byte size beyond
/// size_t).
template <codec_choice Choice>
auto plan_memory(cache_shape const& shape, int residual = 128) -> memory_report {
  using K = typename codec_pair<Choice>::key;
  using V = typename codec_pair<Choice>::value;
  detail::check_cache_options<K, V>(shape, residual, typename K::params_type{}, typename V::params_type{});
  return detail::plan_memory_unchecked<K, V>(shape, residual);
}

/// The quantized key/value cache of one sequence.
///
/// `Choice` is one codec for K and V (`q8_0`), a pair `kv_codecs<q8_0, q4_0>`, or a named pair
/// such as `kivi<4>`. `Backend` selects memory and kernels; an unimplemented combination fails to
/// compile naming it. The host logic is the cache core's (core/cache_core.hpp) over the CPU device
/// (backend/cpu/cpu_device.hpp); the CUDA and Metal caches are the same core over their devices.
///
/// **Example**:
/// ```
/// kvq::QuantizedKVCache<kvq::q8_0> cache({32, 8, 128, 8192});
/// cache.append(layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// ```
template <codec_choice Choice, backend Backend = cpu>
class QuantizedKVCache : public cache_codecs<Choice> {
  using core_type = cache_core<Choice, detail::cpu_device>;
  using key_codec_t = typename core_type::key_codec;
  using value_codec_t = typename core_type::value_codec;

 public:
  static_assert(require_implemented<key_codec_t, Backend>());
  static_assert(require_implemented<value_codec_t, Backend>());
  static_assert(std::is_same_v<Backend, cpu>, "kvq: QuantizedKVCache for this backend lives in its own header");
  static_assert(!centered_codec<value_codec_t>, "kvq: centered<C> is a key codec (values are not centered)");

  /// Run-time options of a cache.
  struct options {
    int residual = 128;                    ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    typename core_type::key_params key{};  ///< run-time parameters of the key codec (e.g. fp8 scale)
    typename core_type::value_params value{};  ///< run-time parameters of the value codec
    kvq::memory_resource* memory = nullptr;    ///< allocator hook; nullptr = the default resource
  };

  /// Allocates a cache of `shape`; raises invalid_argument_error on a bad shape or option
  /// (1 <= layers, kv_heads; 1 <= head_dim <= 65536; 1 <= capacity <= 2^40; KIVI R a non-negative
  /// multiple of G; fp8 scales finite and > 0; the byte size within size_t), and propagates what
  /// the memory resource throws. `options::memory`, when set, must outlive the cache.
  explicit QuantizedKVCache(cache_shape const& shape, options const& opt = options{})
      : opt_(opt),
        core_(shape, opt.residual, opt.key, opt.value, detail::cpu_device(opt.memory)),
        means_(shape.layers, shape.kv_heads, shape.head_dim) {}

  QuantizedKVCache(QuantizedKVCache const&) = delete;
  QuantizedKVCache& operator=(QuantizedKVCache const&) = delete;
  /// Takes the storage of `o`, which is left with no layers (every layer index is out of range).
  QuantizedKVCache(QuantizedKVCache&& o) noexcept
      : opt_(o.opt_), core_(std::move(o.core_)), means_(std::move(o.means_)) {}
  QuantizedKVCache& operator=(QuantizedKVCache&&) = delete;
  ~QuantizedKVCache() = default;

  /// The cache's shape.
  auto shape() const noexcept -> cache_shape const& { return core_.shape(); }
  /// The cache's options.
  auto get_options() const noexcept -> options const& { return opt_; }
  /// Tokens currently held by `layer`.
  auto size(int layer) const -> std::int64_t { return core_.size(layer); }

  /// Appends `keys` and `values` (same token count) to `layer`. Each tensor's `data` must point to
  /// readable elements at every (t, h, c) its strides address. Raises index_error for a bad layer;
  /// shape_error for heads / head_dim other than the cache's, a negative or unequal token count,
  /// null data with tokens > 0, negative or overlapping strides, or an extent beyond the address
  /// space; capacity_error past the capacity. On error nothing changes.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    core_.check_append(layer, detail::describe(keys), detail::describe(values));
    int const type = detail::kernel_elem<T>();
    if constexpr (centered_codec<key_codec_t>) {
      if (keys.tokens == 0) return;
      // The first append into an empty layer fixes μ; the stored keys are C(k − μ).
      bool const first = core_.size(layer) == 0;
      detail::vector<float> mu(means_.layer(layer), means_.layer(layer) + means_.per_layer());
      if (first) detail::chunk_key_mean(keys, mu.data());
      detail::vector<float> centered;
      detail::centered_keys(keys, mu.data(), centered);
      std::int64_t const row = static_cast<std::int64_t>(shape().kv_heads) * shape().head_dim;
      core_.append_checked(layer, keys.tokens, centered.data(),
                           detail::kernel_source(kvq_elem_f32, row, shape().head_dim), values.data,
                           detail::kernel_source(type, values.token_stride, values.head_stride), {});
      if (first) means_.fix(layer, mu.data());
    } else {
      core_.append_checked(layer, keys.tokens, keys.data,
                           detail::kernel_source(type, keys.token_stride, keys.head_stride), values.data,
                           detail::kernel_source(type, values.token_stride, values.head_stride), {});
    }
  }

  /// Reads keys [first, first + count) of (layer, head) into out, rows `out_stride` elements apart
  /// (0 = head_dim); `out` must hold (count - 1) * stride + head_dim elements, of which only the first
  /// head_dim of each row are written. Raises index_error for a bad layer, head or range;
  /// shape_error for a stride below head_dim, a null `out` with count > 0, or rows that cannot fit in
  /// the address space. On error `out` is untouched.
  template <element T>
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride = 0) const {
    read_impl(true, layer, head, first, count, out, out_stride);
  }

  /// Reads values [first, first + count) of (layer, head) into out, rows `out_stride` elements
  /// apart; preconditions and errors as read_keys.
  template <element T>
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, T* out,
                   std::int64_t out_stride = 0) const {
    read_impl(false, layer, head, first, count, out, out_stride);
  }

  /// Keeps the first n tokens of every layer (speculative-decoding rollback); layers holding n or
  /// fewer tokens are unchanged. Cutting into a quantized KIVI key group dequantizes it (lossy).
  /// Raises invalid_argument_error for n < 0.
  void truncate(std::int64_t n) {
    core_.truncate(n, {});
    clear_empty_means();
  }

  /// Drops the oldest n tokens of every layer (sliding window). Raises index_error when a
  /// non-empty layer holds fewer than n tokens, unsupported_error for KIVI keys when n is not a
  /// multiple of G, invalid_argument_error for n < 0.
  void shift_left(std::int64_t n) {
    core_.shift_left(n, {});
    clear_empty_means();
  }

  /// Empties every layer.
  void reset() noexcept {
    core_.reset();
    clear_empty_means();
  }

  /// The key mean μ of (layer, head) of a centered key codec (head_dim floats; zeros while the
  /// layer is empty), nullptr for other key codecs. Raises index_error.
  auto key_mean(int layer, int head) const -> float const* {
    check_layer(layer);
    check_head(head);
    if constexpr (centered_codec<key_codec_t>) {
      return means_.of(layer, head);
    } else {
      return nullptr;
    }
  }

  /// The key means of every layer (centered key codecs; persistence).
  auto key_means() noexcept -> detail::key_means_for<key_codec_t>& { return means_; }
  auto key_means() const noexcept -> detail::key_means_for<key_codec_t> const& { return means_; }

  /// Memory use of this cache.
  auto memory() const noexcept -> memory_report { return core_.memory(); }

  /// Counts the stored (quantized) blocks of `layer` whose scale is NaN or ±Inf, i.e. that decode
  /// to NaN or ±Inf: blocks poisoned by NaN/Inf input, and q8_0 / q4_0 blocks whose fp16 scale
  /// overflowed (finite amax above ~8.3e6 / |max| above ~5.2e5, as in ggml). A debug check that
  /// reads every scale of the layer; tokens in a KIVI f16 residual or window are not blocks.
  /// Raises index_error for a bad layer.
  auto nonfinite_blocks(int layer) const -> nonfinite_report {
    check_layer(layer);
    int const d = shape().head_dim;
    nonfinite_report r;
    for (int h = 0; h < shape().kv_heads; ++h) {
      storage_view const k = core_.key_storage(layer, h);
      std::int64_t const key_units = k.quantized_tokens / k.tokens_per_unit;
      for (std::int64_t u = 0; u < key_units; ++u)
        r.key_blocks += detail::nonfinite_scales<key_codec_t>(
            reinterpret_cast<std::uint8_t const*>(k.units) + static_cast<std::size_t>(u) * k.unit_bytes, d);
      storage_view const v = core_.value_storage(layer, h);
      for (std::int64_t u = 0; u < v.quantized_tokens; ++u)
        r.value_blocks += detail::nonfinite_scales<value_codec_t>(
            reinterpret_cast<std::uint8_t const*>(v.units) + static_cast<std::size_t>(u) * v.unit_bytes, d);
    }
    return r;
  }

  /// nonfinite_blocks summed over every layer.
  auto nonfinite_blocks() const -> nonfinite_report {
    nonfinite_report r;
    for (int l = 0; l < shape().layers; ++l) {
      auto const x = nonfinite_blocks(l);
      r.key_blocks += x.key_blocks;
      r.value_blocks += x.value_blocks;
    }
    return r;
  }

  /// Non-owning view of the key storage of (layer, head); its pointers stay valid until the cache
  /// is destroyed or moved from, its counters until the next non-const call. Raises index_error.
  auto key_storage(int layer, int head) const -> storage_view { return core_.key_storage(layer, head); }

  /// Non-owning view of the value storage of (layer, head); as key_storage.
  auto value_storage(int layer, int head) const -> storage_view { return core_.value_storage(layer, head); }

  /// Decodes keys [first, first + count) of (layer, head) to f32 rows `stride` apart. No checks:
  /// the caller guarantees a valid layer and head, 0 <= first <= first + count <= size(layer),
  /// stride >= head_dim and `out` holding (count - 1) * stride + head_dim floats.
  void decode_keys_unchecked(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                             std::int64_t stride) const {
    decode_unchecked<key_codec_t>(detail::key_region(core_.key_side(), core_.state(layer)), layer, head, first, count,
                                  out, stride, opt_.key);
    if constexpr (centered_codec<key_codec_t>)
      detail::add_key_mean(out, count, stride, shape().head_dim, means_.of(layer, head));
  }

  /// Decodes values [first, first + count) of (layer, head) to f32 rows `stride` apart. No checks:
  /// preconditions as decode_keys_unchecked.
  void decode_values_unchecked(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                               std::int64_t stride) const {
    decode_unchecked<value_codec_t>(detail::value_region(core_.value_side(), core_.state(layer)), layer, head, first,
                                    count, out, stride, opt_.value);
  }

  /// Raises index_error unless 0 <= layer < layers.
  void check_layer(int layer) const { core_.check_layer(layer); }
  /// Raises index_error unless 0 <= head < kv_heads.
  void check_head(int head) const { core_.check_head(head); }

  /// The cache core (state, sides, storage) that kvq's free functions (save, load, attention) use.
  auto core() noexcept -> core_type& { return core_; }
  auto core() const noexcept -> core_type const& { return core_; }

 private:
  template <class C>
  void decode_unchecked(kvq_region const& r, int layer, int head, std::int64_t first, std::int64_t count, float* out,
                        std::int64_t stride, typename C::params_type const& params) const {
    std::byte const* base = core_.layer(layer);
    for (std::int64_t i = 0; i < count; ++i)
      detail::cpu_device::decode_token<C>(r, base, head, first + i, shape().head_dim, out + i * stride, params);
  }

  template <element T>
  void read_impl(bool keys, int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride) const {
    char const* what = keys ? "read_keys" : "read_values";
    core_.check_read(what, layer, head, first, count);
    std::int64_t const stride = detail::check_read_output(what, shape().head_dim, count, out, out_stride);
    // Reads change nothing: the core's read runs on the CPU device, which holds no state.
    if constexpr (centered_codec<key_codec_t>) {
      if (keys && count > 0) {  // decode + μ in f32, then one rounding to T
        int const d = shape().head_dim;
        detail::vector<float> rows(static_cast<std::size_t>(count) * static_cast<std::size_t>(d));
        const_cast<core_type&>(core_).read_checked(true, layer, head, first, count, static_cast<void*>(rows.data()),
                                                   kvq_elem_f32, d, {});
        detail::add_key_mean(rows.data(), count, d, d, means_.of(layer, head));
        for (std::int64_t i = 0; i < count; ++i) {
          if constexpr (std::is_same_v<T, float>) {
            std::copy_n(rows.data() + i * d, d, out + i * stride);
          } else {
            cpu_kernels::convert_from_f32(rows.data() + i * d, out + i * stride, d);
          }
        }
        return;
      }
    }
    const_cast<core_type&>(core_).read_checked(keys, layer, head, first, count, static_cast<void*>(out),
                                               detail::kernel_elem<T>(), stride, {});
  }

  /// Clears μ of the layers that hold no token.
  void clear_empty_means() noexcept {
    if constexpr (centered_codec<key_codec_t>)
      for (int l = 0; l < shape().layers; ++l)
        if (core_.state(l).length == 0) means_.clear(l);
  }

  options opt_;
  core_type core_;
  [[no_unique_address]] detail::key_means_for<key_codec_t> means_;
};

KVQ_NAMESPACE_END
