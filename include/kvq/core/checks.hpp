// kvq: argument checks shared by every cache (strong guarantee: they run before anything changes).
//
// One rule per argument, one message per rule, whatever the backend: the cache core
// (core/cache_core.hpp), plan_memory and make_any_cache call these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "../error.hpp"
#include "cache_types.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// Formats a float for an error message ("%g": 0.5, 1e-08, nan, inf).
inline auto format_float(float x) -> std::string {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  return buf;
}

constexpr auto align_up(std::size_t n) -> std::size_t {
  return (n + storage_alignment - 1) / storage_alignment * storage_alignment;
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

/// Raises shape_error unless an appended tensor `x` ("keys" or "values") fits a cache of `shape`:
/// its kv_heads and head_dim are the cache's, its token count is >= 0, its data is not null when it
/// has tokens, and its strides pass check_tensor_strides (for elements of `element_bytes` bytes).
inline void check_kv_tensor(cache_shape const& shape, int kv_heads, int head_dim, std::int64_t tokens, bool has_data,
                            std::int64_t token_stride, std::int64_t head_stride, std::size_t element_bytes,
                            char const* what) {
  auto const w = [what] { return std::string("append: ") + what; };
  check<shape_error>(kv_heads == shape.kv_heads && head_dim == shape.head_dim, [&] {
    return w() + " have shape (" + std::to_string(kv_heads) + " heads, " + std::to_string(head_dim) +
           " dims); the cache has (" + std::to_string(shape.kv_heads) + ", " + std::to_string(shape.head_dim) + ")";
  });
  check<shape_error>(tokens >= 0, [&] { return w() + " token count " + std::to_string(tokens) + " is negative"; });
  check<shape_error>(tokens == 0 || has_data, [&] { return w() + " data is null"; });
  check_tensor_strides(tokens, kv_heads, head_dim, token_stride, head_stride, element_bytes, what);
}

/// Raises index_error unless 0 <= layer < layers.
inline void check_layer_index(int layer, int layers) {
  check<index_error>(layer >= 0 && layer < layers, [&] {
    return "layer " + std::to_string(layer) + " is out of range [0, " + std::to_string(layers) + ")";
  });
}

/// Raises index_error unless 0 <= head < kv_heads.
inline void check_head_index(int head, int kv_heads) {
  check<index_error>(head >= 0 && head < kv_heads, [&] {
    return "kv_head " + std::to_string(head) + " is out of range [0, " + std::to_string(kv_heads) + ")";
  });
}

}  // namespace detail
KVQ_NAMESPACE_END
