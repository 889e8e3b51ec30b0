// kvq: the storage layout of a cache layer and the validation of a cache's options, for every
// backend.
//
// Layout (documented contract, see cache.hpp): one allocation per layer, 64-byte aligned; inside
// it, for each kv_head h, the key region of h, then for each kv_head h, the value region of h;
// every array starts 64-byte aligned. A region holds the encoded units (rows, or KIVI key tiles
// of G tokens) and, for KIVI, the f16 residual (keys) or window (values) rows after them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>

#include "../codec/codec.hpp"
#include "../codec/fp4.hpp"
#include "../codec/fp8.hpp"
#include "../codec/kivi.hpp"
#include "../codec/rotated.hpp"
#include "checks.hpp"

KVQ_NAMESPACE_BEGIN
namespace detail {

/// True for codecs that keep recent tokens in an f16 sliding window (KIVI values).
template <class C>
struct has_value_window : std::false_type {};
template <int B, int G>
struct has_value_window<::kvq::kivi_value<B, G>> : std::true_type {};
template <rotated_codec C>
struct has_value_window<C> : has_value_window<typename C::stored_codec> {};

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

/// Raises invalid_argument_error unless a cache of key codec K and value codec V may have `shape`
/// and these options: the shape rule (check_cache_shape), a KIVI residual R that is a non-negative
/// multiple of every KIVI group in use (the key residual flushes R/G whole tiles), fp8 and fp4
/// scales finite and > 0, and a byte size within size_t. `max_capacity` below 2^40 adds a backend limit
/// (GPU kernels index tokens with 32-bit integers), reported as `who`'s.
template <codec K, codec V>
void check_cache_options(cache_shape const& s, int residual, typename K::params_type const& key,
                         typename V::params_type const& value, std::int64_t max_capacity = std::int64_t{1} << 40,
                         char const* who = "cache") {
  check_cache_shape(s, "cache");
  check<invalid_argument_error>(s.capacity <= max_capacity, [&] {
    return std::string(who) + ": capacity = " + std::to_string(s.capacity) + " must be in [1, " +
           std::to_string(max_capacity) + "]";
  });
  constexpr bool key_tiles = K::layout == codec_layout::token_group;
  constexpr bool value_window = has_value_window<V>::value;
  if constexpr (key_tiles || value_window) {
    int g = 1;
    if constexpr (key_tiles) g = std::lcm(g, K::group);
    if constexpr (value_window) g = std::lcm(g, V::group);
    check<invalid_argument_error>(residual >= 0 && residual % g == 0, [&] {
      return "cache: KIVI residual R = " + std::to_string(residual) +
             " must be a non-negative multiple of G = " + std::to_string(g);
    });
  }
  auto const fp8_message = [](char const* which, auto const& p) {
    return std::string("cache: the ") + which + " codec's fp8 scale = " + format_float(p.scale) +
           " must be finite and > 0 (overflow mode " + std::to_string(static_cast<int>(p.overflow)) + ")";
  };
  if constexpr (requires { fp8_params_valid(key); })
    check<invalid_argument_error>(fp8_params_valid(key), [&] { return fp8_message("key", key); });
  if constexpr (requires { fp8_params_valid(value); })
    check<invalid_argument_error>(fp8_params_valid(value), [&] { return fp8_message("value", value); });
  auto const fp4_message = [](char const* which, fp4_params const& p) {
    return std::string("cache: the ") + which + " codec's fp4 scale = " + format_float(p.scale) +
           " must be finite and > 0";
  };
  if constexpr (requires { fp4_params_valid(key); })
    check<invalid_argument_error>(fp4_params_valid(key), [&] { return fp4_message("key", key); });
  if constexpr (requires { fp4_params_valid(value); })
    check<invalid_argument_error>(fp4_params_valid(value), [&] { return fp4_message("value", value); });
  // The byte size of the cache must fit in size_t (estimated in floating point, before any size
  // is computed in size_t, where it would wrap around).
  double residual_rows = 0;
  if constexpr (key_tiles) residual_rows += residual > 0 ? residual : K::group;
  if constexpr (value_window) residual_rows += residual;
  double const key_units =
      key_tiles ? static_cast<double>(s.capacity / K::geometry(s.head_dim).tokens) : static_cast<double>(s.capacity);
  double const per_head = key_units * static_cast<double>(K::geometry(s.head_dim).bytes()) +
                          static_cast<double>(s.capacity) * static_cast<double>(V::geometry(s.head_dim).bytes()) +
                          residual_rows * s.head_dim * 2.0 + 4.0 * storage_alignment;
  check<invalid_argument_error>(
      per_head * s.kv_heads * s.layers <= static_cast<double>(std::numeric_limits<std::size_t>::max()) / 2, [&] {
        return "cache: " + std::to_string(s.layers) + " layers x " + std::to_string(s.kv_heads) + " kv_heads x " +
               std::to_string(s.capacity) + " tokens x " + std::to_string(s.head_dim) +
               " head_dim need more bytes than size_t can hold";
      });
}

}  // namespace detail
KVQ_NAMESPACE_END
