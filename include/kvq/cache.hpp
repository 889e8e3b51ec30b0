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
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cpu/kernels.hpp"
#include "codec/codec.hpp"
#include "codec/fp8.hpp"
#include "codec/kivi.hpp"
#include "detail/host_vector.hpp"
#include "error.hpp"
#include "memory_resource.hpp"

KVQ_NAMESPACE_BEGIN

/// Alignment in bytes of every array of the cache's storage.
inline constexpr std::size_t storage_alignment = 64;

/// Shape of a cache for one sequence.
struct cache_shape {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t capacity = 0;  ///< tokens per layer
  friend constexpr bool operator==(cache_shape const&, cache_shape const&) = default;
};

/// Element types accepted for input and output: float, f16 and bf16.
template <class T>
concept element = std::same_as<T, float> || std::same_as<T, f16> || std::same_as<T, bf16>;

/// A read-only view of (tokens, kv_heads, head_dim) elements; head_dim is contiguous and the
/// strides, in elements, place token t, head h at `data + t * token_stride + h * head_stride`.
template <element T>
struct kv_tensor {
  T const* data = nullptr;
  std::int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
};

/// A dense token-major view [tokens][kv_heads][head_dim].
template <element T>
constexpr auto token_major(T const* data, std::int64_t tokens, int kv_heads, int head_dim) -> kv_tensor<T> {
  return {data, tokens, kv_heads, head_dim, static_cast<std::int64_t>(kv_heads) * head_dim, head_dim};
}

/// Memory use of a cache, every byte accounted for.
struct memory_report {
  std::size_t total_bytes = 0;      ///< bytes allocated
  std::size_t key_bytes = 0;        ///< quantized key storage (scales and padding included)
  std::size_t value_bytes = 0;      ///< quantized value storage (scales and padding included)
  std::size_t residual_bytes = 0;   ///< KIVI f16 residual / window buffers
  std::size_t alignment_bytes = 0;  ///< bytes lost to 64-byte alignment
  double bytes_per_token = 0;       ///< total_bytes / capacity (all layers, K and V)
  double bits_per_element = 0;      ///< total_bytes * 8 / (capacity * layers * kv_heads * head_dim * 2)
};

/// Stored blocks whose scale is NaN or ±Inf, so that they decode to NaN or ±Inf (see
/// `QuantizedKVCache::nonfinite_blocks`): a block is a q8_0 / q4_0 block of 32 channels, an int8
/// row, a KIVI value group, or a KIVI key channel of one tile (G tokens).
struct nonfinite_report {
  std::int64_t key_blocks = 0;    ///< poisoned key blocks
  std::int64_t value_blocks = 0;  ///< poisoned value blocks
  /// key_blocks + value_blocks.
  constexpr auto total() const noexcept -> std::int64_t { return key_blocks + value_blocks; }
  friend constexpr bool operator==(nonfinite_report const&, nonfinite_report const&) = default;
};

/// A non-owning view of one (layer, kv_head)'s key or value storage.
struct storage_view {
  std::byte const* units = nullptr;    ///< encoded rows or tiles, 64-byte aligned
  std::size_t unit_bytes = 0;          ///< bytes per row (row codecs) or per tile (KIVI keys)
  int tokens_per_unit = 1;             ///< 1 for rows, G for tiles
  std::int64_t quantized_tokens = 0;   ///< tokens [0, quantized_tokens) live in `units`
  f16 const* residual = nullptr;       ///< f16 rows of the residual (KIVI), else nullptr
  std::int64_t residual_tokens = 0;    ///< tokens [quantized_tokens, length) live in `residual`
  std::int64_t residual_capacity = 0;  ///< rows of the residual buffer
  std::int64_t residual_first = 0;     ///< ring index of token `quantized_tokens` (values window)
};

namespace detail {

/// True for codecs that keep recent tokens in an f16 sliding window (KIVI values).
template <class C>
struct has_value_window : std::false_type {};
template <int B, int G>
struct has_value_window<::kvq::kivi_value<B, G>> : std::true_type {};

/// Formats a float for an error message ("%g": 0.5, 1e-08, nan, inf).
inline auto format_float(float x) -> std::string {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  return buf;
}

constexpr auto align_up(std::size_t n) -> std::size_t {
  return (n + storage_alignment - 1) / storage_alignment * storage_alignment;
}

/// Widens an input element to float.
template <element T>
inline auto load_f32(T x) -> float {
  return to_f32(x);
}

/// Narrows a float to the output element type (round to nearest even).
template <element T>
inline auto store_as(float x) -> T {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, f16>) {
    return to_f16(x);
  } else {
    return to_bf16(x);
  }
}

/// Byte sizes of the regions of one (layer, kv_head) for a codec used as keys or values.
template <codec C, bool IsValue>
struct region_layout {
  std::size_t units_bytes = 0;     // encoded storage, aligned
  std::size_t residual_bytes = 0;  // f16 residual / window, aligned
  std::size_t units_raw = 0;       // encoded storage before alignment
  std::size_t residual_raw = 0;    // residual before alignment
  std::int64_t residual_rows = 0;  // F (keys) or R (values window)
  std::int64_t units = 0;          // rows or tiles

  static constexpr auto make(cache_shape const& s, int residual) -> region_layout {
    region_layout r;
    auto const g = C::geometry(s.head_dim);
    if constexpr (C::layout == codec_layout::token_group) {
      r.units = s.capacity / C::group;
      r.residual_rows = residual > 0 ? residual : C::group;
    } else {
      r.units = s.capacity;
      if constexpr (IsValue && has_value_window<C>::value) r.residual_rows = residual;
    }
    r.units_raw = static_cast<std::size_t>(r.units) * g.bytes();
    r.residual_raw = static_cast<std::size_t>(r.residual_rows) * static_cast<std::size_t>(s.head_dim) * 2;
    r.units_bytes = align_up(r.units_raw);
    r.residual_bytes = align_up(r.residual_raw);
    return r;
  }
  constexpr auto bytes() const -> std::size_t { return units_bytes + residual_bytes; }
};

/// Converts one input row (head_dim elements) to float.
template <element T>
inline void row_to_f32(T const* src, int head_dim, float* dst) {
  cpu_kernels::convert_to_f32(src, dst, head_dim);
}

/// Rounds a float row to f16 storage.
inline void row_to_f16(float const* src, int head_dim, f16* dst) { cpu_kernels::convert_from_f32(src, dst, head_dim); }

/// Widens an f16 row to float.
inline void row_from_f16(f16 const* src, int head_dim, float* dst) { cpu_kernels::convert_to_f32(src, dst, head_dim); }

/// Largest finite f16 value.
inline constexpr float f16_max = 65504.0f;

/// Clips the finite elements of a row to [-65504, 65504] in place (NaN and ±Inf are kept), so that
/// rounding it to f16 saturates instead of overflowing to ±Inf: the KIVI residual and window store
/// finite inputs beyond the f16 range as ±65504, as the KIVI codec clips its parameters.
inline void saturate_to_f16_range(float* row, int head_dim) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (int i = 0; i < head_dim; ++i) {
    float const x = row[i];
    if (x > f16_max && x != inf) row[i] = f16_max;
    if (x < -f16_max && x != -inf) row[i] = -f16_max;
  }
}

/// "[first, first + count)" for an error message, computed without overflowing int64.
inline auto format_range(std::int64_t first, std::int64_t count) -> std::string {
  constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t hi = std::numeric_limits<std::int64_t>::max();
  bool const fits = count >= 0 ? first <= hi - count : first >= lo - count;
  std::string const end = fits ? std::to_string(first + count) : std::to_string(first) + " + " + std::to_string(count);
  return "[" + std::to_string(first) + ", " + end + ")";
}

/// True when a + b * n <= limit, for a, b, n >= 0 and limit >= 0 (no overflow on the way); on
/// success a becomes a + b * n.
inline auto add_product_within(std::int64_t& a, std::int64_t b, std::int64_t n, std::int64_t limit) -> bool {
  if (a > limit) return false;
  if (b == 0 || n == 0) return true;
  if (n > (limit - a) / b) return false;
  a += b * n;
  return true;
}

/// Raises invalid_argument_error, naming `who`, unless 1 <= layers, 1 <= kv_heads,
/// 1 <= head_dim <= 65536 and 1 <= capacity <= 2^40: the rule of every cache constructor,
/// plan_memory and make_any_cache.
inline void check_cache_shape(cache_shape const& s, char const* who) {
  auto const w = [who] { return std::string(who) + ": "; };
  check<invalid_argument_error>(s.layers > 0,
                                [&] { return w() + "layers = " + std::to_string(s.layers) + " must be > 0"; });
  check<invalid_argument_error>(s.kv_heads > 0,
                                [&] { return w() + "kv_heads = " + std::to_string(s.kv_heads) + " must be > 0"; });
  check<invalid_argument_error>(s.head_dim > 0 && s.head_dim <= 65536, [&] {
    return w() + "head_dim = " + std::to_string(s.head_dim) + " must be in [1, 65536]";
  });
  check<invalid_argument_error>(s.capacity > 0 && s.capacity <= (std::int64_t{1} << 40), [&] {
    return w() + "capacity = " + std::to_string(s.capacity) + " must be in [1, 2^40]";
  });
}

/// Raises shape_error ("append: <what> strides (token ts, head hs) ...") unless the strides of an
/// appended (tokens >= 0, kv_heads >= 1, head_dim >= 1) tensor of `element_bytes`-byte elements
/// are non-negative, place rows of head_dim contiguous elements without overlap (heads within a
/// token, or tokens within a head) and address no more elements, (tokens - 1) * ts +
/// (kv_heads - 1) * hs + head_dim, than the address space holds (no real tensor is larger, so every
/// row pointer is then computed without overflow). Products are compared by division
/// (hs * kv_heads <= ts as hs <= ts / kv_heads), so nothing overflows. Every backend's rule.
inline void check_tensor_strides(std::int64_t tokens, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t ts,
                                 std::int64_t hs, std::size_t element_bytes, char const* what) {
  std::int64_t const d = head_dim;
  bool const non_negative = ts >= 0 && hs >= 0;
  bool const token_major_ok = non_negative && hs >= d && (tokens <= 1 || hs <= ts / kv_heads);
  bool const head_major_ok = non_negative && ts >= d && (kv_heads <= 1 || tokens == 0 || ts <= hs / tokens);
  bool const single = tokens <= 1 && kv_heads <= 1;
  auto const strides = [&] {
    return std::string("append: ") + what + " strides (token " + std::to_string(ts) + ", head " + std::to_string(hs) +
           ")";
  };
  check<shape_error>(non_negative && (single || token_major_ok || head_major_ok),
                     [&] { return strides() + " make rows of " + std::to_string(d) + " elements overlap"; });
  std::int64_t extent = d;
  std::int64_t const limit = std::numeric_limits<std::ptrdiff_t>::max() / static_cast<std::int64_t>(element_bytes);
  check<shape_error>(tokens == 0 || (add_product_within(extent, ts, tokens - 1, limit) &&
                                     add_product_within(extent, hs, kv_heads - 1, limit)),
                     [&] {
                       return strides() + " for " + std::to_string(tokens) +
                              " tokens address more elements than the address space holds";
                     });
}

/// Raises index_error ("<what>: range [first, first + count) is outside the <len> tokens of layer
/// <layer>") unless 0 <= first <= first + count <= len, checked without overflow: every backend's
/// read rule.
inline void check_read_range(char const* what, int layer, std::int64_t len, std::int64_t first, std::int64_t count) {
  check<index_error>(first >= 0 && count >= 0 && first <= len && count <= len - first, [&] {
    return std::string(what) + ": range " + format_range(first, count) + " is outside the " + std::to_string(len) +
           " tokens of layer " + std::to_string(layer);
  });
}

/// Returns the row stride of a read of `count` rows of head_dim elements of T into `out`, rows
/// `out_stride` elements apart (0: head_dim). Raises shape_error when the stride is below head_dim,
/// when `out` is null (count > 0), or when the rows, (count - 1) * stride + head_dim elements, span
/// more than the address space: every backend's rule for a host output.
template <class T>
auto check_read_output(char const* what, int head_dim, std::int64_t count, T const* out, std::int64_t out_stride)
    -> std::int64_t {
  std::int64_t const stride = out_stride == 0 ? head_dim : out_stride;
  check<shape_error>(stride >= head_dim, [&] {
    return std::string(what) + ": output stride " + std::to_string(stride) + " is smaller than head_dim " +
           std::to_string(head_dim);
  });
  check<shape_error>(count == 0 || out != nullptr, [&] { return std::string(what) + ": output is null"; });
  std::int64_t extent = head_dim;
  std::int64_t const limit = std::numeric_limits<std::ptrdiff_t>::max() / static_cast<std::int64_t>(sizeof(T));
  check<shape_error>(count == 0 || add_product_within(extent, stride, count - 1, limit), [&] {
    return std::string(what) + ": " + std::to_string(count) + " rows " + std::to_string(stride) +
           " elements apart do not fit in the address space";
  });
  return stride;
}

/// Stored scales of one encoded unit (row or tile) of codec C that are NaN or ±Inf: q8_0 / q4_0
/// blocks, the int8 row scale, KIVI groups (value blocks, key channels). A unit decodes to NaN or
/// ±Inf exactly where its scale is not finite. Codecs without scales (f32, f16, fp8) have none.
template <class C>
inline auto nonfinite_scales(std::uint8_t const* unit, int head_dim) -> std::int64_t {
  std::int64_t n = 0;
  if constexpr (std::is_same_v<C, q8_0> || std::is_same_v<C, q4_0> || has_value_window<C>::value) {
    auto const g = C::geometry(head_dim);
    for (int b = 0; b < g.blocks; ++b) {
      std::uint8_t const* p = unit + static_cast<std::size_t>(b) * g.block_bytes;
      auto const bits = static_cast<u16>(p[0] | (static_cast<unsigned>(p[1]) << 8));  // fp16 d / scale, little-endian
      n += (bits & 0x7c00u) == 0x7c00u ? 1 : 0;
    }
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
auto plan_memory(cache_shape const& shape, int residual = 128) -> memory_report;

namespace detail {

/// plan_memory of a valid shape and residual (no checks) for key codec K and value codec V.
template <codec K, codec V>
auto plan_memory_unchecked(cache_shape const& shape, int residual) -> memory_report {
  auto const k = region_layout<K, false>::make(shape, residual);
  auto const v = region_layout<V, true>::make(shape, residual);
  std::size_t const lh = static_cast<std::size_t>(shape.layers) * static_cast<std::size_t>(shape.kv_heads);
  memory_report m;
  m.key_bytes = lh * k.units_raw;
  m.value_bytes = lh * v.units_raw;
  m.residual_bytes = lh * (k.residual_raw + v.residual_raw);
  m.total_bytes = lh * (k.bytes() + v.bytes());
  m.alignment_bytes = m.total_bytes - m.key_bytes - m.value_bytes - m.residual_bytes;
  double const cap = static_cast<double>(shape.capacity);
  m.bytes_per_token = cap > 0 ? static_cast<double>(m.total_bytes) / cap : 0.0;
  double const elems = cap * static_cast<double>(lh) * static_cast<double>(shape.head_dim) * 2.0;
  m.bits_per_element = elems > 0 ? static_cast<double>(m.total_bytes) * 8.0 / elems : 0.0;
  return m;
}

}  // namespace detail

/// The quantized key/value cache of one sequence.
///
/// `Choice` is one codec for K and V (`q8_0`), a pair `kv_codecs<q8_0, q4_0>`, or a named pair
/// such as `kivi<4>`. `Backend` selects memory and kernels; an unimplemented combination fails to
/// compile naming it.
///
/// **Example**:
/// ```
/// kvq::QuantizedKVCache<kvq::q8_0> cache({32, 8, 128, 8192});
/// cache.append(layer, kvq::token_major(k, n, 8, 128), kvq::token_major(v, n, 8, 128));
/// ```
template <codec_choice Choice, backend Backend = cpu>
class QuantizedKVCache {
 public:
  using key_codec = typename codec_pair<Choice>::key;
  using value_codec = typename codec_pair<Choice>::value;
  using key_params = typename key_codec::params_type;
  using value_params = typename value_codec::params_type;
  static_assert(require_implemented<key_codec, Backend>());
  static_assert(require_implemented<value_codec, Backend>());
  static_assert(std::is_same_v<Backend, cpu>, "kvq: QuantizedKVCache for this backend lives in its own header");
  static_assert(key_codec::layout == codec_layout::row || key_codec::layout == codec_layout::token_group);
  static_assert(value_codec::layout == codec_layout::row,
                "kvq: value codecs must be row codecs (values are quantized per token)");

  /// Run-time options of a cache.
  struct options {
    int residual = 128;                      ///< KIVI residual length R (a multiple of G; 0 allowed); ignored otherwise
    key_params key{};                        ///< run-time parameters of the key codec (e.g. fp8 scale)
    value_params value{};                    ///< run-time parameters of the value codec
    kvq::memory_resource* memory = nullptr;  ///< allocator hook; nullptr = the default resource
  };

  /// Allocates a cache of `shape`; raises invalid_argument_error on a bad shape or option
  /// (1 <= layers, kv_heads; 1 <= head_dim <= 65536; 1 <= capacity <= 2^40; KIVI R a non-negative
  /// multiple of G; fp8 scales finite and > 0; the byte size within size_t), and propagates what
  /// the memory resource throws. `options::memory`, when set, must outlive the cache.
  explicit QuantizedKVCache(cache_shape const& shape, options const& opt = options{})
      : shape_(validated(shape, opt)),
        opt_(opt),
        key_layout_(key_region::make(shape, opt.residual)),
        value_layout_(value_region::make(shape, opt.residual)) {
    memory_ = opt_.memory ? opt_.memory : kvq::get_default_memory_resource();
    layer_bytes_ = static_cast<std::size_t>(shape_.kv_heads) * (key_layout_.bytes() + value_layout_.bytes());
    layers_.resize(static_cast<std::size_t>(shape_.layers));
    // Frees the layers allocated so far when an allocation fails (a guard rather than try/catch,
    // so that the header also compiles with exceptions disabled).
    struct release_on_failure {
      QuantizedKVCache* self;
      std::size_t done = 0;
      ~release_on_failure() {
        if (self == nullptr) return;
        for (std::size_t i = 0; i < done; ++i)
          self->memory_->deallocate(self->layers_[i].base, self->alloc_size(), storage_alignment);
      }
    } guard{this};
    for (; guard.done < layers_.size(); ++guard.done) {
      void* p = memory_->allocate(alloc_size(), storage_alignment);
      std::memset(p, 0, layer_bytes_);
      layers_[guard.done].base = static_cast<std::byte*>(p);
    }
    guard.self = nullptr;
  }

  QuantizedKVCache(QuantizedKVCache const&) = delete;
  QuantizedKVCache& operator=(QuantizedKVCache const&) = delete;
  QuantizedKVCache(QuantizedKVCache&& o) noexcept
      : shape_(o.shape_),
        opt_(o.opt_),
        key_layout_(o.key_layout_),
        value_layout_(o.value_layout_),
        memory_(o.memory_),
        layer_bytes_(o.layer_bytes_),
        layers_(std::move(o.layers_)) {
    o.layers_.clear();
    o.shape_.layers = 0;  // the moved-from cache has no layers: every layer index is out of range
  }
  QuantizedKVCache& operator=(QuantizedKVCache&&) = delete;
  ~QuantizedKVCache() {
    for (auto& l : layers_) memory_->deallocate(l.base, alloc_size(), storage_alignment);
  }

  /// The cache's shape.
  auto shape() const noexcept -> cache_shape const& { return shape_; }
  /// The cache's options.
  auto get_options() const noexcept -> options const& { return opt_; }
  /// Tokens currently held by `layer`.
  auto size(int layer) const -> std::int64_t {
    check_layer(layer);
    return layers_[static_cast<std::size_t>(layer)].length;
  }

  /// Appends `keys` and `values` (same token count) to `layer`. Each tensor's `data` must point to
  /// readable elements at every (t, h, c) its strides address. Raises index_error for a bad layer;
  /// shape_error for heads / head_dim other than the cache's, a negative or unequal token count,
  /// null data with tokens > 0, negative or overlapping strides, or an extent beyond the address
  /// space; capacity_error past the capacity. On error nothing changes.
  template <element T>
  void append(int layer, kv_tensor<T> const& keys, kv_tensor<T> const& values) {
    check_layer(layer);
    check_tensor(keys, "keys");
    check_tensor(values, "values");
    detail::check<shape_error>(keys.tokens == values.tokens, [&] {
      return "append: keys have " + std::to_string(keys.tokens) + " tokens but values have " +
             std::to_string(values.tokens);
    });
    auto& st = layers_[static_cast<std::size_t>(layer)];
    std::int64_t const n = keys.tokens;
    detail::check<capacity_error>(n <= shape_.capacity - st.length, [&] {
      return "append: layer " + std::to_string(layer) + " holds " + std::to_string(st.length) + " tokens; appending " +
             std::to_string(n) + " exceeds the capacity of " + std::to_string(shape_.capacity);
    });
    if (n == 0) return;
    int const d = shape_.head_dim;
    detail::vector<float> row(static_cast<std::size_t>(d));
    detail::vector<float> scratch(static_cast<std::size_t>(d));
    detail::vector<float> tile;
    if constexpr (key_codec::layout == codec_layout::token_group)
      tile.resize(static_cast<std::size_t>(key_codec::group) * static_cast<std::size_t>(d));
    layer_state next = st;
    for (int h = 0; h < shape_.kv_heads; ++h) {
      layer_state s = st;  // every head advances identically from the same state
      for (std::int64_t t = 0; t < n; ++t) {
        detail::row_to_f32(keys.data + t * keys.token_stride + h * keys.head_stride, d, row.data());
        push_key(st.base, h, s, row.data(), tile);
        detail::row_to_f32(values.data + t * values.token_stride + h * values.head_stride, d, row.data());
        push_value(st.base, h, s, row.data(), scratch);
        ++s.length;
      }
      next = s;
    }
    next.base = st.base;
    st = next;
  }

  /// Reads keys [first, first + count) of (layer, head) into out, rows `out_stride` elements apart
  /// (0 = head_dim); `out` must hold (count - 1) * stride + head_dim elements, of which only the first
  /// head_dim of each row are written. Raises index_error for a bad layer, head or range;
  /// shape_error for a stride below head_dim, a null `out` with count > 0, or rows that cannot fit in
  /// the address space. On error `out` is untouched.
  template <element T>
  void read_keys(int layer, int head, std::int64_t first, std::int64_t count, T* out,
                 std::int64_t out_stride = 0) const {
    read_impl<true>(layer, head, first, count, out, out_stride);
  }

  /// Reads values [first, first + count) of (layer, head) into out, rows `out_stride` elements
  /// apart; preconditions and errors as read_keys.
  template <element T>
  void read_values(int layer, int head, std::int64_t first, std::int64_t count, T* out,
                   std::int64_t out_stride = 0) const {
    read_impl<false>(layer, head, first, count, out, out_stride);
  }

  /// Keeps the first n tokens of every layer (speculative-decoding rollback); layers holding n or
  /// fewer tokens are unchanged. Cutting into a quantized KIVI key group dequantizes it (lossy).
  /// Raises invalid_argument_error for n < 0.
  void truncate(std::int64_t n) {
    detail::check<invalid_argument_error>(n >= 0, "truncate: n = " + std::to_string(n) + " is negative");
    int const d = shape_.head_dim;
    detail::vector<float> row(static_cast<std::size_t>(d));
    for (auto& st : layers_) {
      if (st.length <= n) continue;
      if constexpr (key_codec::layout == codec_layout::token_group) {
        if (n < st.key_quantized) {
          std::int64_t const g = key_codec::group;
          std::int64_t const q = n / g * g;
          for (int h = 0; h < shape_.kv_heads; ++h) {
            std::byte const* tile = key_units(st.base, h) + static_cast<std::size_t>(q / g) * key_unit_bytes();
            f16* res = key_residual(st.base, h);
            for (std::int64_t t = q; t < n; ++t) {
              cpu_kernels::decode_tile_tokens<key_codec>(reinterpret_cast<std::uint8_t const*>(tile), d,
                                                         static_cast<int>(t - q), 1, row.data(), d, opt_.key);
              detail::saturate_to_f16_range(row.data(), d);  // a decoded group can reach 65536
              detail::row_to_f16(row.data(), d, res + (t - q) * d);
            }
          }
          st.key_quantized = q;
        }
      }
      if constexpr (detail::has_value_window<value_codec>::value) {
        if (n < st.value_quantized) {
          st.value_quantized = n;
          st.window_tokens = 0;
          st.window_first = 0;
        } else {
          st.window_tokens = n - st.value_quantized;
        }
      }
      st.length = n;
    }
  }

  /// Drops the oldest n tokens of every layer (sliding window). Raises index_error when a
  /// non-empty layer holds fewer than n tokens, unsupported_error for KIVI keys when n is not a
  /// multiple of G, invalid_argument_error for n < 0.
  void shift_left(std::int64_t n) {
    detail::check<invalid_argument_error>(n >= 0, "shift_left: n = " + std::to_string(n) + " is negative");
    if constexpr (key_codec::layout == codec_layout::token_group) {
      detail::check<unsupported_error>(n % key_codec::group == 0, "shift_left: KIVI keys shift by multiples of G = " +
                                                                      std::to_string(key_codec::group) + ", not " +
                                                                      std::to_string(n));
    }
    for (std::size_t l = 0; l < layers_.size(); ++l)
      detail::check<index_error>(layers_[l].length == 0 || n <= layers_[l].length,
                                 "shift_left: layer " + std::to_string(l) + " holds " +
                                     std::to_string(layers_[l].length) + " tokens, cannot drop " + std::to_string(n));
    if (n == 0) return;
    for (auto& st : layers_) {
      if (st.length == 0) continue;
      for (int h = 0; h < shape_.kv_heads; ++h) {
        shift_keys(st, h, n);
        shift_values(st, h, n);
      }
      if constexpr (key_codec::layout == codec_layout::token_group) {
        st.key_quantized = std::max<std::int64_t>(st.key_quantized - n, 0);
      }
      if constexpr (detail::has_value_window<value_codec>::value) {
        if (n <= st.value_quantized) {
          st.value_quantized -= n;
        } else {
          std::int64_t const drop = n - st.value_quantized;
          st.value_quantized = 0;
          st.window_first = (st.window_first + drop) % std::max<std::int64_t>(value_layout_.residual_rows, 1);
          st.window_tokens -= drop;
        }
      }
      st.length -= n;
    }
  }

  /// Empties every layer.
  void reset() noexcept {
    for (auto& st : layers_) {
      std::byte* b = st.base;
      st = layer_state{};
      st.base = b;
    }
  }

  /// Memory use of this cache.
  auto memory() const noexcept -> memory_report {
    return detail::plan_memory_unchecked<key_codec, value_codec>(shape_, opt_.residual);
  }

  /// Counts the stored (quantized) blocks of `layer` whose scale is NaN or ±Inf, i.e. that decode
  /// to NaN or ±Inf: blocks poisoned by NaN/Inf input, and q8_0 / q4_0 blocks whose fp16 scale
  /// overflowed (finite amax above ~8.3e6 / |max| above ~5.2e5, as in ggml). A debug check that
  /// reads every scale of the layer; tokens in a KIVI f16 residual or window are not blocks.
  /// Raises index_error for a bad layer.
  auto nonfinite_blocks(int layer) const -> nonfinite_report {
    check_layer(layer);
    auto const& st = layers_[static_cast<std::size_t>(layer)];
    int const d = shape_.head_dim;
    std::int64_t key_units_used = st.length;
    if constexpr (key_codec::layout == codec_layout::token_group) key_units_used = st.key_quantized / key_codec::group;
    std::int64_t value_rows = st.length;
    if constexpr (detail::has_value_window<value_codec>::value) value_rows = st.value_quantized;
    std::size_t const vb = value_codec::geometry(d).bytes();
    nonfinite_report r;
    for (int h = 0; h < shape_.kv_heads; ++h) {
      auto const* k = reinterpret_cast<std::uint8_t const*>(key_units(st.base, h));
      for (std::int64_t u = 0; u < key_units_used; ++u)
        r.key_blocks += detail::nonfinite_scales<key_codec>(k + static_cast<std::size_t>(u) * key_unit_bytes(), d);
      auto const* v = reinterpret_cast<std::uint8_t const*>(value_units(st.base, h));
      for (std::int64_t u = 0; u < value_rows; ++u)
        r.value_blocks += detail::nonfinite_scales<value_codec>(v + static_cast<std::size_t>(u) * vb, d);
    }
    return r;
  }

  /// nonfinite_blocks summed over every layer.
  auto nonfinite_blocks() const -> nonfinite_report {
    nonfinite_report r;
    for (int l = 0; l < shape_.layers; ++l) {
      auto const x = nonfinite_blocks(l);
      r.key_blocks += x.key_blocks;
      r.value_blocks += x.value_blocks;
    }
    return r;
  }

  /// Non-owning view of the key storage of (layer, head); its pointers stay valid until the cache
  /// is destroyed or moved from, its counters until the next non-const call. Raises index_error.
  auto key_storage(int layer, int head) const -> storage_view {
    check_layer(layer);
    check_head(head);
    auto const& st = layers_[static_cast<std::size_t>(layer)];
    storage_view v;
    v.units = key_units(st.base, head);
    v.unit_bytes = key_unit_bytes();
    if constexpr (key_codec::layout == codec_layout::token_group) {
      v.tokens_per_unit = key_codec::group;
      v.quantized_tokens = st.key_quantized;
      v.residual = key_residual(st.base, head);
      v.residual_tokens = st.length - st.key_quantized;
      v.residual_capacity = key_layout_.residual_rows;
    } else {
      v.quantized_tokens = st.length;
    }
    return v;
  }

  /// Non-owning view of the value storage of (layer, head); as key_storage.
  auto value_storage(int layer, int head) const -> storage_view {
    check_layer(layer);
    check_head(head);
    auto const& st = layers_[static_cast<std::size_t>(layer)];
    storage_view v;
    v.units = value_units(st.base, head);
    v.unit_bytes = value_codec::geometry(shape_.head_dim).bytes();
    if constexpr (detail::has_value_window<value_codec>::value) {
      v.quantized_tokens = st.value_quantized;
      v.residual = value_window(st.base, head);
      v.residual_tokens = st.window_tokens;
      v.residual_capacity = value_layout_.residual_rows;
      v.residual_first = st.window_first;
    } else {
      v.quantized_tokens = st.length;
    }
    return v;
  }

  /// Decodes keys [first, first + count) of (layer, head) to f32 rows `stride` apart. No checks:
  /// the caller guarantees a valid layer and head, 0 <= first <= first + count <= size(layer),
  /// stride >= head_dim and `out` holding (count - 1) * stride + head_dim floats.
  void decode_keys_unchecked(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                             std::int64_t stride) const {
    auto const& st = layers_[static_cast<std::size_t>(layer)];
    int const d = shape_.head_dim;
    for (std::int64_t i = 0; i < count; ++i) {
      std::int64_t const t = first + i;
      float* y = out + i * stride;
      if constexpr (key_codec::layout == codec_layout::token_group) {
        if (t < st.key_quantized) {
          auto const* tile = reinterpret_cast<std::uint8_t const*>(key_units(st.base, head)) +
                             static_cast<std::size_t>(t / key_codec::group) * key_unit_bytes();
          cpu_kernels::decode_tile_tokens<key_codec>(tile, d, static_cast<int>(t % key_codec::group), 1, y, d,
                                                     opt_.key);
        } else {
          detail::row_from_f16(key_residual(st.base, head) + (t - st.key_quantized) * d, d, y);
        }
      } else {
        decode_one<key_codec>(reinterpret_cast<std::uint8_t const*>(key_units(st.base, head)) +
                                  static_cast<std::size_t>(t) * key_unit_bytes(),
                              d, y, opt_.key);
      }
    }
  }

  /// Decodes values [first, first + count) of (layer, head) to f32 rows `stride` apart. No checks:
  /// preconditions as decode_keys_unchecked.
  void decode_values_unchecked(int layer, int head, std::int64_t first, std::int64_t count, float* out,
                               std::int64_t stride) const {
    auto const& st = layers_[static_cast<std::size_t>(layer)];
    int const d = shape_.head_dim;
    std::size_t const rb = value_codec::geometry(d).bytes();
    for (std::int64_t i = 0; i < count; ++i) {
      std::int64_t const t = first + i;
      float* y = out + i * stride;
      if constexpr (detail::has_value_window<value_codec>::value) {
        if (t >= st.value_quantized) {
          std::int64_t const slot = (st.window_first + (t - st.value_quantized)) % value_layout_.residual_rows;
          detail::row_from_f16(value_window(st.base, head) + slot * d, d, y);
          continue;
        }
      }
      decode_one<value_codec>(
          reinterpret_cast<std::uint8_t const*>(value_units(st.base, head)) + static_cast<std::size_t>(t) * rb, d, y,
          opt_.value);
    }
  }

  /// Raises index_error unless 0 <= layer < layers.
  void check_layer(int layer) const {
    detail::check<index_error>(layer >= 0 && layer < shape_.layers, [&] {
      return "layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(shape_.layers) + ")";
    });
  }
  /// Raises index_error unless 0 <= head < kv_heads.
  void check_head(int head) const {
    detail::check<index_error>(head >= 0 && head < shape_.kv_heads, [&] {
      return "kv_head " + std::to_string(head) + " is out of range [0, " + std::to_string(shape_.kv_heads) + ")";
    });
  }

 private:
  /// Encodes one f32 row with the CPU kernels of codec C.
  template <class C>
  static void encode_one(float const* x, int d, std::uint8_t* dst, typename C::params_type const& p) {
    cpu_kernels::encode_rows<C>(x, d, 1, d, dst, C::geometry(d).bytes(), p);
  }
  /// Decodes one row with the CPU kernels of codec C.
  template <class C>
  static void decode_one(std::uint8_t const* src, int d, float* y, typename C::params_type const& p) {
    cpu_kernels::decode_rows<C>(src, C::geometry(d).bytes(), 1, d, y, d, p);
  }

  using key_region = detail::region_layout<key_codec, false>;
  using value_region = detail::region_layout<value_codec, true>;

  struct layer_state {
    std::byte* base = nullptr;
    std::int64_t length = 0;           // tokens in the layer
    std::int64_t key_quantized = 0;    // KIVI keys: tokens in tiles (multiple of G)
    std::int64_t value_quantized = 0;  // KIVI values: tokens in rows
    std::int64_t window_tokens = 0;    // KIVI values: tokens in the window
    std::int64_t window_first = 0;     // KIVI values: ring slot of the oldest window token
  };

  template <codec_choice C>
  friend auto plan_memory(cache_shape const& shape, int residual) -> memory_report;  // validates with `validated`

  static auto validated(cache_shape const& s, options const& o) -> cache_shape {
    using detail::check;
    detail::check_cache_shape(s, "cache");
    constexpr bool kivi_residual =
        key_codec::layout == codec_layout::token_group || detail::has_value_window<value_codec>::value;
    if constexpr (kivi_residual) {
      // A multiple of every KIVI group size in use: the key residual flushes R/G whole tiles.
      int g = 1;
      if constexpr (key_codec::layout == codec_layout::token_group) g = std::lcm(g, key_codec::group);
      if constexpr (detail::has_value_window<value_codec>::value) g = std::lcm(g, value_codec::group);
      check<invalid_argument_error>(o.residual >= 0 && o.residual % g == 0,
                                    "cache: KIVI residual R = " + std::to_string(o.residual) +
                                        " must be a non-negative multiple of G = " + std::to_string(g));
    }
    auto const fp8_message = [](char const* which, auto const& p) {
      return std::string("cache: the ") + which + " codec's fp8 scale = " + detail::format_float(p.scale) +
             " must be finite and > 0 (overflow mode " + std::to_string(static_cast<int>(p.overflow)) + ")";
    };
    if constexpr (requires { fp8_params_valid(o.key); })
      check<invalid_argument_error>(fp8_params_valid(o.key), fp8_message("key", o.key));
    if constexpr (requires { fp8_params_valid(o.value); })
      check<invalid_argument_error>(fp8_params_valid(o.value), fp8_message("value", o.value));
    // The byte size of the cache must fit in size_t (estimated in floating point, before any size
    // is computed in size_t, where it would wrap around).
    double residual_rows = 0;
    if constexpr (key_codec::layout == codec_layout::token_group)
      residual_rows += o.residual > 0 ? o.residual : key_codec::group;
    if constexpr (detail::has_value_window<value_codec>::value) residual_rows += o.residual;
    double const key_units = key_codec::layout == codec_layout::token_group
                                 ? static_cast<double>(s.capacity / key_codec::geometry(s.head_dim).tokens)
                                 : static_cast<double>(s.capacity);
    double const per_head =
        key_units * static_cast<double>(key_codec::geometry(s.head_dim).bytes()) +
        static_cast<double>(s.capacity) * static_cast<double>(value_codec::geometry(s.head_dim).bytes()) +
        residual_rows * s.head_dim * 2.0 + 4.0 * storage_alignment;
    check<invalid_argument_error>(
        per_head * s.kv_heads * s.layers <= static_cast<double>(std::numeric_limits<std::size_t>::max()) / 2,
        "cache: " + std::to_string(s.layers) + " layers x " + std::to_string(s.kv_heads) + " kv_heads x " +
            std::to_string(s.capacity) + " tokens x " + std::to_string(s.head_dim) +
            " head_dim need more bytes than size_t can hold");
    return s;
  }

  template <element T>
  void check_tensor(kv_tensor<T> const& x, char const* what) const {
    auto const w = [what] { return std::string("append: ") + what; };
    detail::check<shape_error>(x.kv_heads == shape_.kv_heads && x.head_dim == shape_.head_dim, [&] {
      return w() + " have shape (" + std::to_string(x.kv_heads) + " heads, " + std::to_string(x.head_dim) +
             " dims); the cache has (" + std::to_string(shape_.kv_heads) + ", " + std::to_string(shape_.head_dim) + ")";
    });
    detail::check<shape_error>(x.tokens >= 0,
                               [&] { return w() + " token count " + std::to_string(x.tokens) + " is negative"; });
    detail::check<shape_error>(x.tokens == 0 || x.data != nullptr, [&] { return w() + " data is null"; });
    detail::check_tensor_strides(x.tokens, x.kv_heads, x.head_dim, x.token_stride, x.head_stride, sizeof(T), what);
  }

  auto alloc_size() const -> std::size_t { return layer_bytes_ == 0 ? storage_alignment : layer_bytes_; }
  auto key_unit_bytes() const -> std::size_t { return key_codec::geometry(shape_.head_dim).bytes(); }

  auto key_units(std::byte* base, int h) const -> std::byte* {
    return base + static_cast<std::size_t>(h) * key_layout_.bytes();
  }
  auto key_units(std::byte const* base, int h) const -> std::byte const* {
    return base + static_cast<std::size_t>(h) * key_layout_.bytes();
  }
  auto key_residual(std::byte* base, int h) const -> f16* {
    return reinterpret_cast<f16*>(key_units(base, h) + key_layout_.units_bytes);
  }
  auto value_units(std::byte* base, int h) const -> std::byte* {
    return base + static_cast<std::size_t>(shape_.kv_heads) * key_layout_.bytes() +
           static_cast<std::size_t>(h) * value_layout_.bytes();
  }
  auto value_units(std::byte const* base, int h) const -> std::byte const* {
    return value_units(const_cast<std::byte*>(base), h);
  }
  auto value_window(std::byte* base, int h) const -> f16* {
    return reinterpret_cast<f16*>(value_units(base, h) + value_layout_.units_bytes);
  }

  // Appends one key row (f32) of head h to the state s (length not yet advanced).
  void push_key(std::byte* base, int h, layer_state& s, float* row, detail::vector<float>& tile) const {
    int const d = shape_.head_dim;
    if constexpr (key_codec::layout == codec_layout::token_group) {
      std::int64_t const f = key_layout_.residual_rows;
      f16* res = key_residual(base, h);
      std::int64_t const r = s.length - s.key_quantized;
      detail::saturate_to_f16_range(row, d);  // finite beyond ±65504 -> ±65504, not Inf
      detail::row_to_f16(row, d, res + r * d);
      if (r + 1 == f) {  // the residual is full: quantize it as f/G groups from the stored f16 values
        std::int64_t const g = key_codec::group;
        for (std::int64_t k = 0; k < f / g; ++k) {
          for (std::int64_t t = 0; t < g; ++t) detail::row_from_f16(res + (k * g + t) * d, d, tile.data() + t * d);
          auto* dst = reinterpret_cast<std::uint8_t*>(key_units(base, h)) +
                      static_cast<std::size_t>(s.key_quantized / g + k) * key_unit_bytes();
          cpu_kernels::encode_tile<key_codec>(tile.data(), d, d, dst, opt_.key);
        }
        s.key_quantized += f;
      }
    } else {
      (void)tile;
      encode_one<key_codec>(
          row, d,
          reinterpret_cast<std::uint8_t*>(key_units(base, h)) + static_cast<std::size_t>(s.length) * key_unit_bytes(),
          opt_.key);
    }
  }

  // Appends one value row (f32) of head h to the state s (length not yet advanced).
  void push_value(std::byte* base, int h, layer_state& s, float* row, detail::vector<float>& scratch) const {
    int const d = shape_.head_dim;
    std::size_t const rb = value_codec::geometry(d).bytes();
    auto* rows = reinterpret_cast<std::uint8_t*>(value_units(base, h));
    if constexpr (detail::has_value_window<value_codec>::value) {
      std::int64_t const r = value_layout_.residual_rows;
      detail::saturate_to_f16_range(row, d);  // finite beyond ±65504 -> ±65504, not Inf
      if (r == 0) {                           // no window: quantize the f16-rounded value at once
        for (int i = 0; i < d; ++i) row[i] = to_f32(to_f16(row[i]));
        encode_one<value_codec>(row, d, rows + static_cast<std::size_t>(s.value_quantized) * rb, opt_.value);
        ++s.value_quantized;
        return;
      }
      f16* win = value_window(base, h);
      if (s.window_tokens == r) {  // the oldest token leaves the window: quantize its stored value
        detail::row_from_f16(win + s.window_first * d, d, scratch.data());
        encode_one<value_codec>(scratch.data(), d, rows + static_cast<std::size_t>(s.value_quantized) * rb, opt_.value);
        ++s.value_quantized;
        s.window_first = (s.window_first + 1) % r;
        --s.window_tokens;
      }
      detail::row_to_f16(row, d, win + ((s.window_first + s.window_tokens) % r) * d);
      ++s.window_tokens;
    } else {
      (void)scratch;
      encode_one<value_codec>(row, d, rows + static_cast<std::size_t>(s.length) * rb, opt_.value);
    }
  }

  void shift_keys(layer_state& st, int h, std::int64_t n) {
    std::byte* units = key_units(st.base, h);
    if constexpr (key_codec::layout == codec_layout::token_group) {
      std::int64_t const g = key_codec::group;
      std::int64_t const drop_tiles = std::min(n, st.key_quantized) / g;
      std::int64_t const keep_tiles = st.key_quantized / g - drop_tiles;
      std::memmove(units, units + static_cast<std::size_t>(drop_tiles) * key_unit_bytes(),
                   static_cast<std::size_t>(keep_tiles) * key_unit_bytes());
      if (n > st.key_quantized) {
        std::int64_t const drop = n - st.key_quantized;
        std::int64_t const keep = st.length - st.key_quantized - drop;
        f16* res = key_residual(st.base, h);
        std::memmove(res, res + drop * shape_.head_dim, static_cast<std::size_t>(keep * shape_.head_dim) * 2);
      }
    } else {
      std::memmove(units, units + static_cast<std::size_t>(n) * key_unit_bytes(),
                   static_cast<std::size_t>(st.length - n) * key_unit_bytes());
    }
  }

  void shift_values(layer_state& st, int h, std::int64_t n) {
    std::byte* units = value_units(st.base, h);
    std::size_t const rb = value_codec::geometry(shape_.head_dim).bytes();
    std::int64_t rows = st.length;
    if constexpr (detail::has_value_window<value_codec>::value) rows = st.value_quantized;
    std::int64_t const drop = std::min(n, rows);
    std::memmove(units, units + static_cast<std::size_t>(drop) * rb, static_cast<std::size_t>(rows - drop) * rb);
  }

  template <bool Keys, element T>
  void read_impl(int layer, int head, std::int64_t first, std::int64_t count, T* out, std::int64_t out_stride) const {
    check_layer(layer);
    check_head(head);
    std::int64_t const len = layers_[static_cast<std::size_t>(layer)].length;
    char const* what = Keys ? "read_keys" : "read_values";
    detail::check_read_range(what, layer, len, first, count);
    int const d = shape_.head_dim;
    std::int64_t const stride = detail::check_read_output(what, d, count, out, out_stride);
    detail::vector<float> row(static_cast<std::size_t>(d));
    for (std::int64_t i = 0; i < count; ++i) {
      if constexpr (Keys) {
        decode_keys_unchecked(layer, head, first + i, 1, row.data(), d);
      } else {
        decode_values_unchecked(layer, head, first + i, 1, row.data(), d);
      }
      for (int c = 0; c < d; ++c) out[i * stride + c] = detail::store_as<T>(row[static_cast<std::size_t>(c)]);
    }
  }

  cache_shape shape_;
  options opt_;
  key_region key_layout_;
  value_region value_layout_;
  kvq::memory_resource* memory_ = nullptr;
  std::size_t layer_bytes_ = 0;
  std::vector<layer_state> layers_;
};

template <codec_choice Choice>
auto plan_memory(cache_shape const& shape, int residual) -> memory_report {
  typename QuantizedKVCache<Choice>::options o;
  o.residual = residual;
  (void)QuantizedKVCache<Choice>::validated(shape, o);
  return detail::plan_memory_unchecked<typename codec_pair<Choice>::key, typename codec_pair<Choice>::value>(shape,
                                                                                                             residual);
}

KVQ_NAMESPACE_END
